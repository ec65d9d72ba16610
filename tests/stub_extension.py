"""A stand-in for the extension's intranode module (moe_dispatcher._C.intranode) on a machine without GPUs.

attach_stub_backend() gives a Buffer the real IntranodeBackend (its Python: checks, plans, allocation) over
launchers that launch nothing and record their arguments, so the host side of the compiled backend runs on
CPU tensors: tests/test_cached_plans_cpu.py checks what the cached-call fast path skips and what it still
checks, and tools/host_glue_cpu.py times the Python glue. Constants are those of
csrc/kernels/intranode/protocol.h (RINGS_OFFSET rounded: only size checks read it).
"""
from __future__ import annotations

import types
from typing import Callable, List, Optional, Tuple

import torch


def _noop(*args, **kwargs) -> None:
    return None


def stub_intranode(rows: int) -> types.SimpleNamespace:
    """The stub module; its notify reports `rows` received rows. `launches` lists (plan kind, launch args) of
    every plan launch, `plans` (kind, constructor args) of every plan made."""
    launches: List[Tuple[str, tuple]] = []
    plans: List[Tuple[str, tuple]] = []

    class IpcBuffer:
        local_ptr = 0

        def __init__(self, rank, num_ranks, num_bytes):
            self.alive = True
            self.timeout: Optional[tuple] = None  # what timeout_info() reports (a test sets it)

        def ipc_handle(self):
            return b""

        def open_peers(self, handles):
            pass

        def timeout_info(self):
            return self.timeout

        def wait_notify(self, seq, timeout_s):
            return rows, 0

        def take_worst_overflow(self):
            return None

        def expert_counts(self, n):
            return [0] * n

        def destroy(self):
            self.alive = False

    class StreamJoin:
        pass

    def plan_class(kind: str):
        class Plan:  # DispatchPlan / CombinePlan of csrc/intranode_bindings.cpp
            def __init__(self, buffer, join, *args):
                self.buffer = buffer
                plans.append((kind, args))

            def launch(self, *args):
                if not self.buffer.alive or self.buffer.timeout is not None:
                    return False  # refused, as the native plans do
                launches.append((kind, args))
                return True
        Plan.__name__ = kind
        return Plan

    return types.SimpleNamespace(
        MAX_RANKS=8, MAX_CHANNELS=32, MAX_LOCAL_EXPERTS=1024, MAX_TOPK=16, MAX_CHUNK=32, MAX_COMBINE_WINDOWS=4,
        RINGS_OFFSET=1 << 20, FLAG_LAYOUT_MISMATCH=1, PAIR_RANK_TOKENS=128, IpcBuffer=IpcBuffer,
        StreamJoin=StreamJoin, DispatchPlan=plan_class("DispatchPlan"), CombinePlan=plan_class("CombinePlan"),
        layout=_noop, notify=_noop, dispatch=_noop, combine=_noop, em_permute=_noop, em_unpermute=_noop,
        pair_rank=_noop, launches=launches, plans=plans)


def attach_stub_backend(buf, rows: int, patch: Callable = setattr):
    """Give `buf` (a Buffer of a gloo group) an IntranodeBackend over the stub module, serving handles made by
    its dispatch (call backend.dispatch directly: the Buffer routes fresh CPU calls to the reference).
    patch(obj, name, value) replaces module attributes (pytest's monkeypatch.setattr undoes them)."""
    from moe_dispatcher import _ext
    from moe_dispatcher import buffer as buffer_module
    from moe_dispatcher.compiled import intranode
    ext = types.SimpleNamespace(intranode=stub_intranode(rows))
    no_stream = lambda device=None: 0  # noqa: E731 - CPU: no streams
    patch(_ext, "load", lambda: ext)
    patch(torch.cuda, "current_device", lambda: 0)
    patch(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(multi_processor_count=132))
    patch(intranode, "current_stream_ptr", no_stream)
    patch(buffer_module, "current_stream_ptr", no_stream)
    buf._kernels = intranode.IntranodeBackend(buf)
    buf._comm_stream = types.SimpleNamespace(cuda_stream=0)  # read, never used as a stream, on CPU
    return buf._kernels
