"""One rank of the GPU fault and exit tests (tests/kernels/test_teardown_gpu.py), run as its own process so that it
can be SIGKILLed and exit through the interpreter's normal teardown (run_distributed's ranks skip it).

    python teardown_rank.py RANK WORLD_SIZE STORE_FILE SCENARIO VICTIM OUT_DIR

SCENARIO: "dispatch", "combine", "low_latency": rank VICTIM is SIGKILLed in the middle of that call (its kernels are
queued behind a GPU sleep, and a separate process kills it while they wait); the other ranks make the same call,
and write OUT_DIR/rank<r>.json = {"error": the RuntimeError they got, "elapsed": seconds from the call to it}.
"error": every rank builds an intranode and a low-latency Buffer, makes one call of each, then raises ValueError
(uncaught): the exit must be the interpreter's (status 1), never SIGABRT.
"raise_<kind>", "retry_<kind>" (kind: "dispatch" intranode, "low_latency", "internode" emulating 2 NVLink domains):
after a warm-up call, rank VICTIM passes topk_idx as int32 to a fresh call of that kind (it raises in the Buffer's
checks) while the other ranks make the valid call. raise_: the others must raise "rank VICTIM raised: ..." (the
peer abort, kernels/common/wait.cuh) long before MOE_DISPATCHER_TIMEOUT_S; retry_: VICTIM catches its error and
makes the valid call 50 ms later, and every rank's call (and a combine after it) succeeds. Every rank writes
OUT_DIR/rank<r>.json = {"error": the error its valid call raised or None, "elapsed": seconds from that call to the
error or to its completion, "own_error": VICTIM's error}, then destroys its Buffer: every rank must exit with 0.
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


def _raising_rank(rank: int, world: int, scenario: str, victim: int, out_dir: str, dev: torch.device) -> None:
    from moe_dispatcher.topology import Topology
    retry, kind = scenario.split("_", 1)
    retry = retry == "retry"
    e, idx, x, w = _inputs(rank, world, dev)
    if kind == "low_latency":
        buf = make_buffer(low_latency=True, max_tokens=MAX_T, hidden=H, num_experts=e, backend="kernels",
                          explicitly_destroy=True)

        def call(topk):
            return buf.low_latency_dispatch(x, topk, MAX_T, e, use_fp8=False)

        def finish(out):
            buf.low_latency_combine(out[0], idx, w, out[2])
    else:
        topo = {"topology": Topology(rank, world, world // 2)} if kind == "internode" else {}
        buf = make_buffer(hidden_bytes=H * 2, backend="kernels", explicitly_destroy=True, **topo)
        assert buf._kernels is not None and buf._kernels.name == ("internode" if topo else "intranode"), \
            buf._kernels_why
        layout = buf.get_dispatch_layout(idx, e)

        def call(topk):
            return buf.dispatch(x, num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
                                is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], topk_idx=topk)

        def finish(out):
            buf.combine(out[0], out[4])
    finish(call(idx))  # warm-up: plans made, every peer up
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    own_error = error = None
    t0 = time.monotonic()
    try:
        if rank == victim:
            try:
                call(idx.int())
            except Exception as exc:  # noqa: BLE001 - the bad argument's error, whatever its type
                own_error = f"{type(exc).__name__}: {exc}"
            if not retry:
                raise _Done()
            time.sleep(0.05)
            t0 = time.monotonic()
        out = call(idx)
        torch.cuda.synchronize()  # a low-latency kernel gives up on the device; the next call raises
        finish(out)
        torch.cuda.synchronize()
        finish(call(idx))  # the Buffer is still usable (or raises what its kernels recorded)
        torch.cuda.synchronize()
    except _Done:
        pass
    except RuntimeError as exc:
        error = str(exc)
    elapsed = time.monotonic() - t0
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"error": error, "elapsed": elapsed, "own_error": own_error}, f)
    buf.destroy()
    dist.destroy_process_group()


class _Done(Exception):
    """The victim of raise_<kind>: nothing more to call."""


def main() -> None:
    rank, world, store_file, scenario, victim, out_dir = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                                          int(sys.argv[5]), sys.argv[6])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=dev)
    if scenario.startswith(("raise_", "retry_")):
        _raising_rank(rank, world, scenario, victim, out_dir, dev)
        return
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
