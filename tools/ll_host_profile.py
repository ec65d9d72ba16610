"""Where the host time of an eager low-latency call goes (GPU machine, 2+ GPUs).

    torchrun --standalone --nproc_per_node 2 tools/ll_host_profile.py [OUT_DIR]

The shapes and arguments of tools/host_time.py's "LL pair" (FP8 dispatch of [128, 7168] bf16, top-8 of 256
experts, then the bf16 combine; neither async nor hooked), timed the same way (perf_counter around the call
alone, the device never awaited inside, synchronised every 8 calls; median per rank, largest over ranks), along
the layers of one call:
  public                 buf.low_latency_dispatch / low_latency_combine (the Buffer's native entries)
  Python method          Buffer.low_latency_dispatch(buf, ...) (what the public call was before the entries)
  runtime                the backend's native functions (positional, every argument given): checks, the output
                         allocation, the launch, the handle and the outputs' Python objects
and, for scale, what one call cannot avoid:
  torch.empty + free     one caching-allocator block of the dispatch's output bytes, made and dropped
  a launch               torch.cuda._sleep(0): one kernel launch through one bound call
Prints the table on rank 0 and writes OUT_DIR/ll_host_profile.txt.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

T, H, K, E = 128, 7168, 8, 256


def per_call_us(steps: dict, calls: int = 2000, warm: int = 50) -> dict:
    """Median us of each step, the steps run in order as one iteration (host_time.py's method)."""
    for _ in range(warm):
        for fn in steps.values():
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    spans = {name: [] for name in steps}
    for i in range(calls):
        if i % 8 == 0:
            torch.cuda.synchronize()  # outside the timed spans: the launch queue stays short
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            spans[name].append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return {name: statistics.median(v) * 1e6 for name, v in spans.items()}


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from moe_dispatcher import Buffer

    hint = Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buf = Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=E // world,
                 backend="kernels", explicitly_destroy=True)
    gen = torch.Generator(device="cuda").manual_seed(2000 + rank)
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    idx = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices
    w = torch.rand(T, K, device="cuda", generator=gen)
    y = torch.randn(E // world, world * T, H, device="cuda", generator=gen).bfloat16()
    backend = buf._kernels_ll
    run_dispatch, run_combine = backend.low_latency_dispatch, backend.low_latency_combine
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
    block_bytes = recv_x[0].untyped_storage().nbytes()  # the one block every output views
    del recv_x, handle
    state: dict = {}

    def layer(dispatch, combine) -> dict:
        return {"dispatch": lambda: state.__setitem__("h", dispatch()[2]),
                "combine": lambda: combine(state.pop("h"))}

    rows = {}
    for name, (d, c) in {
        "public": (lambda: buf.low_latency_dispatch(x, idx, T, E, use_fp8=True),
                   lambda h: buf.low_latency_combine(y, idx, w, h)),
        "Python method": (lambda: Buffer.low_latency_dispatch(buf, x, idx, T, E, use_fp8=True),
                          lambda h: Buffer.low_latency_combine(buf, y, idx, w, h)),
        "runtime": (lambda: run_dispatch(x, idx, T, E, None, None, True, False, False, False, False),
                    lambda h: run_combine(y, idx, w, h, False, False, False, None, None)),
    }.items():
        for step, us in per_call_us(layer(d, c)).items():
            rows[f"{name} {step}"] = us
    rows.update(per_call_us({"torch.empty + free (dispatch block)":
                             lambda: torch.empty(block_bytes, dtype=torch.uint8, device="cuda"),
                             "a launch (torch.cuda._sleep(0))": lambda: torch.cuda._sleep(0)}))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        lines = [f"host us per call, {world} x {torch.cuda.get_device_name()}, median per rank, largest over ranks",
                 f"(dispatch block {block_bytes} bytes)"]
        for name in rows:
            lines.append(f"  {max(r[name] for r in gathered):7.2f}  {name}")
        text = "\n".join(lines)
        print(text, flush=True)
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "ll_host_profile.txt"), "w") as f:
            f.write(text + "\n")
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
