"""Host time of the Python side of the intranode backend's cached calls, on a CPU machine (no GPU needed).

    python tools/host_glue_cpu.py [--calls 20000] [--hidden 7168] [--tokens 128]

The real Buffer and IntranodeBackend run on CPU tensors over the stub extension of tests/helpers/stub_extension.py:
a launch is one Python call that records its arguments, there are no CUDA streams or events, torch.empty
allocates host memory. So the figures are the Python glue of a call (checks, plan look-up, argument
building, allocation), not its host time on a GPU machine (tools/host_profile.py measures that: there the
native launch, the stream joins and a CUDA allocation come on top, and the full path's stream handling in
Python, which CPU tensors skip). Per call: this thread's CPU time (time spent descheduled on a shared
machine does not count), the lowest average over blocks of calls after a warm-up; and the Python-level
function calls one call makes (sys.setprofile), which does not depend on the machine.

Rows: buffer.dispatch(x, handle=h) and buffer.combine(y, h) on the fast path (one call of the handle's native
plan) and on the full path (what a call with previous_event takes: every check, _stream_scope, the backend,
the plan), the backend's cached_dispatch alone, and the stub plan's run (the native call's stand-in).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests", "helpers")]  # the package, and tests/helpers/stub_extension.py


def make_world(rows: int):
    """A one-rank gloo group and a Buffer whose IntranodeBackend runs over the stub extension."""
    from stub_extension import attach_stub_backend

    from moe_dispatcher import Buffer
    store = dist.FileStore(tempfile.mktemp(prefix="host_glue_"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    buf = Buffer(num_nvl_bytes=1 << 30, backend="reference")
    attach_stub_backend(buf, rows)
    return buf


def per_call_us(fn, n: int, block: int = 250) -> float:
    """CPU time of one call: this thread's CPU time (time.thread_time, so time spent descheduled on a shared machine
    does not count) over blocks of `block` calls, the lowest block average."""
    for _ in range(min(n // 10, 1000)):
        fn()
    clock = time.thread_time
    best = float("inf")
    for _ in range(max(n // block, 1)):
        t0 = clock()
        for _ in range(block):
            fn()
        best = min(best, (clock() - t0) / block)
    return best * 1e6


def python_calls(fn) -> int:
    """Python functions and builtins entered by one call of fn (fn itself excluded)."""
    count = [0]

    def prof(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1

    fn()
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0] - 2  # fn's own frame and the setprofile(None) builtin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    opts = ap.parse_args()
    t, h, k = opts.tokens, opts.hidden, 8
    buf = make_world(rows=t)
    backend = buf._kernels
    e = 8
    idx = torch.rand(t, e).topk(k, dim=1).indices
    in_rank = torch.ones(t, 1, dtype=torch.bool)
    per_rank = torch.full((1,), t, dtype=torch.int32)
    per_expert = torch.zeros(e, dtype=torch.int32)
    x = torch.randn(t, h).bfloat16()
    recv = backend.dispatch(x, None, idx, None, per_rank, in_rank, per_expert, 1, 0)
    handle = recv[5]
    y = torch.randn(handle.recv_src_idx.shape[0], h).bfloat16()
    buf.dispatch(x, handle=handle)  # the first cached dispatch makes the handle's plan
    plan = handle.backend_state.dispatch_plans[0]
    from moe_dispatcher import EventOverlap
    done = EventOverlap()  # previous_event given: the full path

    dispatch = lambda: buf.dispatch(x, handle=handle)  # noqa: E731
    combine = lambda: buf.combine(y, handle)  # noqa: E731
    rows = [("public cached dispatch", dispatch),
            ("public combine", combine),
            ("public cached dispatch, full path", lambda: buf.dispatch(x, handle=handle, previous_event=done)),
            ("public combine, full path", lambda: buf.combine(y, handle, previous_event=done)),
            ("backend.cached_dispatch", lambda: backend.cached_dispatch(x, None, handle)),
            ("stub plan run (the native call)", lambda: plan(handle, x, None, None, buf.num_sms, 2))]
    # The Buffer's own glue: a handle whose plan answers at once (what the public call costs beyond the native one).
    answer = (torch.empty(handle.recv_src_idx.shape[0], h, dtype=x.dtype), None, None)
    from moe_dispatcher.compiled import HandleState
    free = handle._replace(backend_state=HandleState(handle.backend_state.routing))
    free.backend_state.dispatch_plans[0] = lambda *args: answer
    rows.append(("public cached dispatch, the native call free", lambda: buf.dispatch(x, handle=free)))
    print(f"Python glue per call (CPU tensors, stub extension), T={t} H={h}, {opts.calls} calls each:")
    for name, fn in rows:
        print(f"  {per_call_us(fn, opts.calls):7.2f} us  {python_calls(fn):4d} calls  {name}")
        backend._mod.launches.clear()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
