"""Python-side host time of a low-latency call, on a CPU machine (no GPU needed).

    python tools/ll_host_cpu.py [--calls 20000] [--hidden 7168] [--tokens 128] [--experts 256] [--profile]

A one-rank gloo group and a Buffer(low_latency_mode=True) whose LowLatencyBackend runs over a runtime that
does nothing: its dispatch / combine return prepared results. So a row is what the Python layers in front of
the native runtime cost per call (Buffer.low_latency_dispatch / low_latency_combine: the key look-up and the
delegation; on a GPU machine the native runtime's own checks, allocation and launch come on top:
tools/host_profile.py and DeepEP's timing loops measure that). Per call: this thread's CPU time, the lowest
average over blocks of calls after a warm-up (tools/host_glue_cpu.py's method), and the Python-level function
calls one call makes (sys.setprofile), which does not depend on the machine. --profile prints cProfile's
top entries of 10k dispatch + combine pairs.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile

import torch
import torch.distributed as dist

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests", "helpers")]  # the package, and tests/helpers/stub_low_latency.py

from host_glue_cpu import per_call_us, python_calls  # noqa: E402  (tools/ is on sys.path as the script's folder)


class NullRuntime:
    """The native runtime's call surface, returning results made once (measures the layers in front of it)."""

    def __init__(self, dispatch_result: tuple, combine_result: tuple) -> None:
        self._d, self._c = dispatch_result, combine_result

    def dispatch(self, x, topk_idx, max_tokens, num_experts, cum_stats, wait_stats, use_fp8, round_scale, use_ue8m0,
                 async_finish, return_recv_hook):
        return self._d

    def combine(self, x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook, out, wait_stats):
        return self._c


def make_world(tokens: int, hidden: int, experts: int):
    from stub_low_latency import attach_stub_low_latency

    from moe_dispatcher import Buffer
    store = dist.FileStore(tempfile.mktemp(prefix="ll_host_cpu_"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    buf = Buffer(num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(tokens, hidden, 1, experts),
                 low_latency_mode=True, backend="reference")
    backend = attach_stub_low_latency(buf)
    x = torch.randn(tokens, hidden).bfloat16()
    idx = torch.rand(tokens, experts).topk(8, dim=1).indices
    w = torch.rand(tokens, 8)
    # One real (stub) pair makes a handle and the outputs the null runtime returns from then on.
    d = buf.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True)
    y = torch.zeros(experts, tokens, hidden, dtype=torch.bfloat16)
    c = buf.low_latency_combine(y, idx, w, d[2])
    null = NullRuntime(d, c)
    backend.low_latency_dispatch, backend.low_latency_combine = null.dispatch, null.combine
    buf._ll_dispatch_runs.clear()
    buf._ll_combine_runs.clear()
    return buf, null, x, idx, w, y, d[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    buf, null, x, idx, w, y, handle = make_world(a.tokens, a.hidden, a.experts)
    T, E = a.tokens, a.experts
    rows = [
        ("buffer.low_latency_dispatch(x, idx, T, E)", lambda: buf.low_latency_dispatch(x, idx, T, E)),
        ("buffer.low_latency_combine(y, idx, w, handle)", lambda: buf.low_latency_combine(y, idx, w, handle)),
        ("buffer.low_latency_dispatch(..., return_recv_hook=True)",
         lambda: buf.low_latency_dispatch(x, idx, T, E, return_recv_hook=True)),
        ("runtime.dispatch alone (the floor: one Python call)",
         lambda: null.dispatch(x, idx, T, E, None, None, True, False, False, False, False)),
    ]
    print(f"T={T} H={a.hidden} E={E}, {a.calls} calls per row; us of this thread's CPU time per call, Python calls")
    for name, fn in rows:
        print(f"  {per_call_us(fn, a.calls):7.2f} us  {python_calls(fn):3d}  {name}")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10000):
            buf.low_latency_dispatch(x, idx, T, E)
            buf.low_latency_combine(y, idx, w, handle)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
