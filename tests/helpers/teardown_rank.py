"""One rank of the GPU fault and exit tests (tests/kernels/test_teardown_gpu.py), run as its own process so that it
can be SIGKILLed and exit through the interpreter's normal teardown (run_distributed's ranks skip it).

    python teardown_rank.py RANK WORLD_SIZE STORE_FILE SCENARIO VICTIM OUT_DIR

SCENARIO: "dispatch", "combine", "low_latency": rank VICTIM is SIGKILLed in the middle of that call (its kernels are
queued behind a GPU sleep, and a separate process kills it while they wait); the other ranks make the same call,
and write OUT_DIR/rank<r>.json = {"error": the RuntimeError they got, "elapsed": seconds from the call to it}.
"error": every rank builds an intranode and a low-latency Buffer, makes one call of each, then raises ValueError
(uncaught): the exit must be the interpreter's (status 1), never SIGABRT.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from dist import make_buffer

T, H, L, K, MAX_T = 64, 2048, 4, 4, 64


def _inputs(rank: int, world: int, dev: torch.device):
    g = torch.Generator().manual_seed(rank)
    e = L * world
    idx = torch.rand(T, e, generator=g).topk(K, dim=1).indices.to(dev)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    return e, idx, x, w


def _normal(buf, idx, x, e):
    layout = buf.get_dispatch_layout(idx, e)
    return buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                        topk_idx=idx)


def main() -> None:
    rank, world, store_file, scenario, victim, out_dir = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                                          int(sys.argv[5]), sys.argv[6])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=dev)
    e, idx, x, w = _inputs(rank, world, dev)
    if scenario == "error":
        nb = make_buffer(hidden_bytes=H * 2, backend="kernels")
        lb = make_buffer(low_latency=True, max_tokens=MAX_T, hidden=H, num_experts=e, backend="kernels")
        out = _normal(nb, idx, x, e)
        nb.combine(out[0], out[4])
        lb.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False)
        torch.cuda.synchronize()
        raise ValueError("a clean Python error")

    low_latency = scenario == "low_latency"
    buf = (make_buffer(low_latency=True, max_tokens=MAX_T, hidden=H, num_experts=e, backend="kernels")
           if low_latency else make_buffer(hidden_bytes=H * 2, backend="kernels"))
    # Warm up (plans made, every peer up), so that the call under test is the only one in flight.
    if low_latency:
        out = buf.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False)
        buf.low_latency_combine(out[0], idx, w, out[2])
    else:
        out = _normal(buf, idx, x, e)
        buf.combine(out[0], out[4])
    torch.cuda.synchronize()
    dist.barrier()

    def call():
        if scenario == "dispatch":
            _normal(buf, idx, x, e)
        elif scenario == "combine":
            buf.combine(out[0], out[4])
        else:
            buf.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False)

    if rank == victim:
        torch.cuda._sleep(int(3e9))  # ~2 s of GPU spin: this rank's kernels of the call wait behind it
        subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -9 {os.getpid()}"])  # independent of this process's GIL
        call()
        time.sleep(600)
        return
    t0 = time.monotonic()
    error = None
    try:
        call()
        torch.cuda.synchronize()  # the kernels give up after the timeout and end
        call()  # raises the recorded timeout
    except RuntimeError as exc:
        error = str(exc)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"error": error, "elapsed": time.monotonic() - t0}, f)
    # Exit through the interpreter: the live Buffer is released at exit, its dead peer never confirming.


if __name__ == "__main__":
    main()
