"""Kernel names a profiler shows: each API call's kernels are identifiable by name (DeepEP's benchmark scripts,
and people reading a profile, attribute time by substring).

Rule: per dispatch call exactly one kernel whose name contains "dispatch" (a low-latency dispatch with
return_recv_hook launches it twice: send, then receive), per combine exactly one containing "combine", and no
other kernel (layout, notify, permute, pair ranks, casts) uses either word. A demangled name carries its
namespaces and parameter types, so those must not contain the words either (lower case: DeepEP matches case
sensitively; parameter types like `DispatchArgs` are capitalised).

On CPU: a static scan of csrc/ (every __global__ function, its namespaces, its parameter types). On GPUs: the
names torch.profiler records for each call of the intranode and low-latency backends.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from dist import device, make_buffer, run_distributed

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "csrc")
WORDS = ("dispatch", "combine")


def _kernels() -> list[tuple[str, str, str]]:
    """(file, kernel name, text from its namespace line to its parameter list) of every __global__ function."""
    found = []
    for root, _, files in os.walk(CSRC):
        for f in files:
            if not f.endswith((".cu", ".cuh")):
                continue
            path = os.path.join(root, f)
            text = open(path, encoding="utf-8").read()
            namespaces = " ".join(re.findall(r"namespace\s+([\w:]+)\s*\{", text))
            for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)", text):
                found.append((os.path.relpath(path, CSRC), m.group(1), namespaces + " " + m.group(2)))
    return found


def test_kernel_names_in_the_sources():
    kernels = _kernels()
    assert len(kernels) >= 10, kernels  # the scan finds the kernels (a test that cannot fail is a defect)
    for path, name, context in kernels:
        words = [w for w in WORDS if w in name]
        assert len(words) <= 1, f"{path}: {name} contains both words"
        if words:  # a dispatch or combine kernel: named for its call
            assert name.startswith(words[0]), f"{path}: {name} should start with '{words[0]}' ('::{words[0]}')"
        for w in WORDS:
            assert w not in context, f"{path}: the namespace or parameter types of {name} contain '{w}': {context}"
    names = {name for _, name, _ in kernels}
    assert {"dispatch_kernel", "combine_kernel", "layout_kernel", "notify_kernel"} <= names, names


def _profiled(fn) -> list[str]:
    """Names of the CUDA kernels fn launches (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))]


def _count(names: list[str]) -> dict:
    return {w: sum(w in n for n in names) for w in WORDS}


def _world(rank: int, world_size: int) -> dict:
    dev = device()
    t, h, e, k = 64, 2048, 8 * world_size, 4
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices.to(dev)
    w = torch.rand(t, k, generator=g).to(dev)
    x = torch.randn(t, h, generator=g).bfloat16().to(dev)
    out = {}
    buf = make_buffer(hidden_bytes=h * 2, backend="kernels", explicitly_destroy=True)
    layout = buf.get_dispatch_layout(idx, e)
    out["layout"] = _profiled(lambda: buf.get_dispatch_layout(idx, e))
    fresh = lambda: buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],  # noqa: E731
                                 num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w)
    out["fresh dispatch"] = _profiled(fresh)
    recv_x, _, _, _, handle, _ = fresh()
    out["cached dispatch"] = _profiled(lambda: buf.dispatch(x, handle=handle))
    out["combine"] = _profiled(lambda: buf.combine(recv_x, handle))
    buf.destroy()
    ll = make_buffer(low_latency=True, max_tokens=t, hidden=h, num_experts=e, backend="kernels",
                     explicitly_destroy=True)
    out["ll dispatch"] = _profiled(lambda: ll.low_latency_dispatch(x, idx, t, e))
    rx, _, ll_handle, _, _ = ll.low_latency_dispatch(x, idx, t, e, use_fp8=False)
    out["ll combine"] = _profiled(lambda: ll.low_latency_combine(rx, idx, w, ll_handle))

    def hooked():
        hook = ll.low_latency_dispatch(x, idx, t, e, return_recv_hook=True)[4]
        hook()
    out["ll dispatch with hook"] = _profiled(hooked)
    ll.destroy()
    return {name: (_count(names), names) for name, names in out.items()}


@pytest.mark.gpu(2)
def test_kernel_names_in_a_profile():
    got = run_distributed(_world, 2, backend="nccl")[0]
    want = {"layout": (0, 0), "fresh dispatch": (1, 0), "cached dispatch": (1, 0), "combine": (0, 1),
            "ll dispatch": (1, 0), "ll combine": (0, 1), "ll dispatch with hook": (2, 0)}
    for call, (d, c) in want.items():
        counts, names = got[call]
        assert (counts["dispatch"], counts["combine"]) == (d, c), f"{call}: {names}"
