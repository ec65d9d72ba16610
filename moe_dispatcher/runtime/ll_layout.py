"""The low-latency buffer layout, read from its one C++ definition (csrc/kernels/low_latency/layout.h).

moe_dispatcher._layout is a tiny CUDA-free module setup.py builds on every install with a C++ compiler, so the
layout is known on CPU machines (CI, the reference backend) as well as next to the CUDA extension.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Dict

_module: ModuleType | None = None


def _layout() -> ModuleType:
    global _module
    if _module is None:
        try:
            _module = importlib.import_module("moe_dispatcher._layout")
        except ImportError as exc:
            raise ImportError("moe_dispatcher._layout (the low-latency buffer layout, csrc/layout) is not built: "
                              "reinstall with a C++ compiler available (`pip install --no-build-isolation -e .`)"
                              ) from exc
    return _module


def buffer_bytes(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of NVSHMEM buffer per GPU low-latency mode needs for these shapes (both halves)."""
    return _layout().buffer_bytes(max_tokens, hidden, num_ranks, num_experts)


def half_layout(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> Dict[str, int]:
    """Byte layout of one buffer half: {half_bytes, send_off, recv_off, signal_off, msg_bytes, dedup_slot_bytes,
    signal_bytes} (layout.h, HalfLayout)."""
    return _layout().half_layout(max_tokens, hidden, num_ranks, num_experts)


def max_topk() -> int:
    """The kernels' top-k limit (kMaxTopk), which sizes the dedup message slots."""
    return _layout().MAX_TOPK
