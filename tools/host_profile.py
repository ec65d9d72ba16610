"""Where the host time of a cached intranode call goes (GPU machine, 2+ GPUs).

    torchrun --standalone --nproc_per_node 2 tools/host_profile.py [OUT_DIR]

Times (perf_counter, steady state, the device kept busy but never more than a few calls behind) of:
  buffer.dispatch(x, handle=h)          the public call (the fast path of a repeated call: one call of the
                                        handle's native plan)
  buffer.combine(y, h)                  the public call, likewise
  ... full path                         the same with previous_event given (every check, then _stream_scope,
                                        the backend and the plan)
  backend.cached_dispatch(...)          the backend alone, inside the comm stream (no Buffer stream semantics)
  the bare fresh launcher               the tensor-taking dispatch launcher, every argument precomputed
  the bare plan call                    the handle's native plan (checks, output allocation, launch) with the
                                        stream joins of a synchronous call, and without them
and a cProfile of 2000 public cached dispatches (rank 0), sorted by own time, written to OUT_DIR.
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist


def per_call_us(fn, n: int = 2000, warm: int = 50) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    spans = []
    for i in range(n):
        if i % 8 == 0:
            torch.cuda.synchronize()  # never run far ahead: the launch queue must not fill up
        t0 = time.perf_counter()
        fn()
        spans.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    spans.sort()
    return spans[len(spans) // 2] * 1e6


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    from moe_dispatcher import Buffer
    from moe_dispatcher.compiled.intranode import dispatch_slot_bytes

    t, h, e, k = 128, 7168, 256, 8
    cfg = Buffer.get_dispatch_config(world)
    nvl = max(c.get_nvl_buffer_size_hint(h * 2, world) for c in (cfg, Buffer.get_combine_config(world)))
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=nvl, backend="kernels")
    x = torch.randn(t, h, device="cuda").bfloat16()
    idx = torch.rand(t, e, device="cuda").topk(k, dim=1).indices
    w = torch.rand(t, k, device="cuda")
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
    recv, _, w_recv, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    y = recv.clone()
    backend = buf._kernels
    comm = buf.get_comm_stream()
    channels, offsets = handle.backend_state.routing[:2]
    _, chunk, slots = backend._config(None, combine=False)
    rows = handle.recv_src_idx.shape[0]
    recv_x = torch.empty(rows, h, dtype=x.dtype, device="cuda")
    recv_src = torch.empty(rows, dtype=torch.int32, device="cuda")
    slot_bytes = dispatch_slot_bytes(h * 2, 0, 0)
    mod, ipc, tmo = backend._mod, backend._ipc, backend._timeout_ns
    from moe_dispatcher import EventOverlap
    done = EventOverlap()  # previous_event given: the full path

    def bare():
        with torch.cuda.stream(comm):
            mod.dispatch(ipc, tmo, x, None, None, None, handle.is_token_in_rank, offsets, recv_x, None, None, None,
                         recv_src, 1, False, channels, chunk, slots, slot_bytes)

    buf.dispatch(x, handle=handle)  # the first cached dispatch makes the handle's plan
    plan = handle.backend_state.dispatch_plans[0]

    def plan_call(join):
        return lambda: plan(handle, x, None, None, buf.num_sms, join)

    def backend_only():
        with torch.cuda.stream(comm):
            backend.cached_dispatch(x, None, handle)

    rows_out = {}
    dispatch, combine = lambda: buf.dispatch(x, handle=handle), lambda: buf.combine(y, handle)
    for name, fn in (("public cached dispatch", dispatch),
                     ("public combine", combine),
                     ("public combine with topk_weights", lambda: buf.combine(y, handle, topk_weights=w_recv)),
                     ("public cached dispatch async_finish", lambda: buf.dispatch(x, handle=handle, async_finish=True)),
                     ("public cached dispatch, full path", lambda: buf.dispatch(x, handle=handle,
                                                                                previous_event=done)),
                     ("public combine, full path", lambda: buf.combine(y, handle, previous_event=done)),
                     ("backend.cached_dispatch in comm stream", backend_only),
                     ("bare fresh launcher (cached geometry)", bare),
                     ("bare plan call, sync joins", plan_call(2)),
                     ("bare plan call, no joins", plan_call(0)),
                     ("torch.empty + stream ctx + event record", lambda: (torch.empty(rows, h, dtype=x.dtype,
                                                                                         device="cuda"),
                                                                             torch.cuda.Event().record(comm)))):
        rows_out[name] = per_call_us(fn)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for i in range(2000):
        if i % 8 == 0:
            torch.cuda.synchronize()
        buf.dispatch(x, handle=handle)
    prof.disable()
    torch.cuda.synchronize()
    if rank == 0:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
        report = "\n".join(f"{v:8.1f} us  {n}" for n, v in rows_out.items())
        print(f"host time per call, median of 2000, {world} ranks, T={t}:\n{report}", flush=True)
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "host_profile.txt"), "w") as f:
            f.write(report + "\n\n" + s.getvalue())
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
