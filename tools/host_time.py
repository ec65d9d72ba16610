"""Host (CPU) time per call of moe_dispatcher beside DeepEP V1, measured in one launch on one machine.

    torchrun --standalone --nproc_per_node 4 tools/host_time.py [--deepep-path DIR] [--out DIR]

DIR (--deepep-path) is a folder from which `import deep_ep` gives the real DeepEP V1 (its `deep_ep` package and
its `deep_ep_cpp` extension, e.g. a private build prefix); without it only moe_dispatcher is measured.

What is timed, per library, with the same shapes, routing and call arguments (both speak DeepEP V1's API):
  LL pair            eager low_latency_dispatch (FP8, 128 tokens, H=7168, top-8 of 256 experts) then
                     low_latency_combine of a bf16 [L, R*128, H] expert output: neither async nor hooked, so each
                     call makes the current stream wait for its kernel (DeepEP's default). "LL dispatch" and
                     "LL combine" are the two calls of the same pairs, timed separately.
  layout             buffer.get_dispatch_layout(topk_idx, 256) of the same routing;
  cached dispatch    buffer.dispatch(x, handle=h): normal mode, BF16 [T, H], along the handle of a fresh dispatch
                     (T = 128, the shape of tools/host_profile.py and of the 9-10 us measured there, and 4096);
  combine            buffer.combine(y, h), y = the received rows;
  fresh dispatch     buffer.dispatch with the layout and topk_idx/topk_weights (informative: both libraries wait
                     on the host for the received counts here, so this is mostly device time).

Method: host time = the wall time (time.perf_counter) of the Python call alone, from entering it to its
return, i.e. the CPU work of checking arguments, allocating outputs and enqueuing kernels and stream waits.
The device is never waited for inside the timed region: torch.cuda.synchronize() runs only outside it, every
8 calls, so the launch queue never fills (a full queue would make a launch block and count device time as
host time) while the GPU stays busy with the calls queued before. Any host-device synchronisation a call does
internally is counted (that is host time the caller pays). Each rank times --calls calls after --warmup
untimed ones and keeps the median; the table gives the largest median over ranks (the slowest rank paces a
collective), and the per-rank medians are in the JSON.

Each library runs in its own child process group, one after the other, while the torchrun processes (a gloo
group that never touches a GPU) wait: both libraries bring up NVSHMEM (one state per process) and must not
share a process. The children use the same GPUs, shapes and seeds, so the two columns compare like for like.
Environment: NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set in every
child unless already set, and MOE_DISPATCHER_BACKEND=kernels (a call the kernels cannot serve fails instead of
falling back to the reference backend). One node only.

Output: a table on rank 0 (moe_dispatcher us, DeepEP V1 us, ratio, target) and OUT/host_time.md plus
OUT/host_time.json. Targets: LL pair <= 0.4x DeepEP V1's; cached dispatch / combine at T=128 <= half of
--today-cached-us (9.4 us, the cached-call host time of the README's status table, 4 x H200).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBS = ("moe_dispatcher", "deep_ep")
LABEL = {"moe_dispatcher": "moe_dispatcher", "deep_ep": "DeepEP V1"}
SYNC_EVERY = 8
LL_TOKENS, HIDDEN, TOPK, EXPERTS = 128, 7168, 8, 256
MULTICAST_OFF = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepep-path", default=None, help="folder from which `import deep_ep` gives DeepEP V1")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for host_time.md/.json")
    p.add_argument("--calls", type=int, default=1000, help="timed calls per measurement (per rank)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--normal-tokens", default="128,4096", help="tokens per rank of the normal-mode calls")
    p.add_argument("--today-cached-us", type=float, default=9.4,
                   help="today's cached-call host time; the target is half of it")
    p.add_argument("--child-timeout", type=int, default=240, help="seconds per library")
    p.add_argument("--worker", choices=LIBS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- timing
def time_calls(steps: dict[str, Callable[[], object]], calls: int, warmup: int) -> dict[str, float]:
    """Median host us of each step, the steps run in order as one iteration (a step may use what an earlier
    step of the same iteration returned, through the closures). Synchronises only outside the timed spans."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        for fn in steps.values():
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    spans: dict[str, list[float]] = {name: [] for name in steps}
    total: list[float] = []
    for i in range(calls):
        if i % SYNC_EVERY == 0:
            torch.cuda.synchronize()  # outside the timed spans: keeps the launch queue short
        start = time.perf_counter()
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            spans[name].append(time.perf_counter() - t0)
        total.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    result = {name: statistics.median(v) * 1e6 for name, v in spans.items()}
    if len(steps) > 1:
        result["+".join(steps)] = statistics.median(total) * 1e6
    return result


# ---------------------------------------------------------------------------------------------- worker
def import_library(name: str, deepep_path: str | None):
    if name == "moe_dispatcher":
        sys.path.insert(0, REPO)  # this checkout's package, with the extension built in it
        import moe_dispatcher
        return moe_dispatcher
    if deepep_path:
        sys.path.insert(0, os.path.abspath(deepep_path))
    import deep_ep
    if getattr(deep_ep, "__name__", "") != "deep_ep" or "moe_dispatcher" in (getattr(deep_ep, "__file__", "") or ""):
        raise RuntimeError(f"`import deep_ep` gave {deep_ep!r}, not DeepEP V1")
    return deep_ep


def measure_normal(lib, group, rank: int, world: int, tokens: int, args) -> dict[str, float]:
    """Cached dispatch, combine and fresh dispatch of [tokens, H] bf16, top-8 of 256 experts."""
    import torch

    nvl = max(c.get_nvl_buffer_size_hint(HIDDEN * 2, world)
              for c in (lib.Buffer.get_dispatch_config(world), lib.Buffer.get_combine_config(world)))
    buf = lib.Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=0, explicitly_destroy=True)
    try:
        gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
        scores = torch.rand(tokens, EXPERTS, device="cuda", generator=gen)
        idx = scores.topk(TOPK, dim=1).indices.to(getattr(lib, "topk_idx_t", torch.int64))
        w = torch.rand(tokens, TOPK, device="cuda", generator=gen)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
        fresh = {"num_tokens_per_rank": per_rank, "num_tokens_per_rdma_rank": per_rdma, "is_token_in_rank": in_rank,
                 "num_tokens_per_expert": per_expert, "topk_idx": idx, "topk_weights": w}
        recv_x, _, _, _, handle, _ = buf.dispatch(x, **fresh)
        y = recv_x.clone()
        calls = args.calls if tokens <= 1024 else max(100, args.calls // 4)
        out = {}
        out.update(time_calls({f"layout T={tokens}": lambda: buf.get_dispatch_layout(idx, EXPERTS)}, calls,
                              args.warmup))
        out.update(time_calls({f"cached dispatch T={tokens}": lambda: buf.dispatch(x, handle=handle)},
                              calls, args.warmup))
        out.update(time_calls({f"combine T={tokens}": lambda: buf.combine(y, handle)}, calls, args.warmup))
        out.update(time_calls({f"fresh dispatch T={tokens}": lambda: buf.dispatch(x, **fresh)},
                              max(50, calls // 4), 10))
        torch.cuda.synchronize()
        return out
    finally:
        buf.destroy()


def measure_low_latency(lib, group, rank: int, world: int, args) -> dict[str, float]:
    """The eager LL pair: FP8 dispatch of [128, 7168] bf16, top-8 of 256 experts, then the bf16 combine."""
    import torch

    local = EXPERTS // world
    hint = lib.Buffer.get_low_latency_rdma_size_hint(LL_TOKENS, HIDDEN, world, EXPERTS)
    buf = lib.Buffer(group, num_nvl_bytes=0, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=local,
                     explicitly_destroy=True)
    try:
        gen = torch.Generator(device="cuda").manual_seed(2000 + rank)
        x = torch.randn(LL_TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
        scores = torch.rand(LL_TOKENS, EXPERTS, device="cuda", generator=gen)
        idx = scores.topk(TOPK, dim=1).indices.to(getattr(lib, "topk_idx_t", torch.int64))
        w = torch.rand(LL_TOKENS, TOPK, device="cuda", generator=gen)
        y = torch.randn(local, world * LL_TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
        state = {}

        def dispatch():
            state["handle"] = buf.low_latency_dispatch(x, idx, LL_TOKENS, EXPERTS, use_fp8=True)[2]

        def combine():
            buf.low_latency_combine(y, idx, w, state.pop("handle"))

        out = time_calls({"LL dispatch": dispatch, "LL combine": combine}, args.calls, args.warmup)
        out["LL pair"] = out.pop("LL dispatch+LL combine")
        torch.cuda.synchronize()
        return out
    finally:
        buf.destroy()


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    lib = import_library(args.worker, args.deepep_path)
    rows: dict[str, float] = {}
    for tokens in (int(t) for t in args.normal_tokens.split(",") if t):
        rows.update(measure_normal(lib, group, rank, world, tokens, args))
    dist.barrier()
    rows.update(measure_low_latency(lib, group, rank, world, args))
    record = {"lib": args.worker, "rank": rank, "world": world, "device": torch.cuda.get_device_name(),
              "module": getattr(lib, "__file__", None), "rows": rows}
    with open(os.path.join(args.result_dir, f"{args.worker}.rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(lib: str, port: int, args, result_dir: str) -> int:
    # The child makes its own rendezvous (env://) on a fresh port: torchrun's agent-store variables would send
    # it to the agent's store instead.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    for k, v in MULTICAST_OFF.items():
        env.setdefault(k, v)
    env.setdefault("MOE_DISPATCHER_BACKEND", "kernels")  # time the kernels' path, never a silent fallback
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", lib, "--result-dir", result_dir,
           "--calls", str(args.calls), "--warmup", str(args.warmup), "--normal-tokens", args.normal_tokens]
    if args.deepep_path:
        cmd += ["--deepep-path", args.deepep_path]
    try:
        return subprocess.run(cmd, check=False, env=env, timeout=args.child_timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"[host_time] rank {env.get('RANK')}: {lib} timed out after {args.child_timeout} s", flush=True)
        return 124


def collect(result_dir: str, world: int) -> dict[str, dict]:
    """{lib: {"device": str, "rows": {name: max over ranks of the median us}, "per_rank": {name: [us...]}}}."""
    found = {}
    for lib in LIBS:
        records = []
        for r in range(world):
            path = os.path.join(result_dir, f"{lib}.rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    records.append(json.load(f))
        if len(records) != world:
            continue
        names = list(records[0]["rows"])
        found[lib] = {"device": records[0]["device"], "module": records[0]["module"],
                      "rows": {n: max(rec["rows"][n] for rec in records) for n in names},
                      "per_rank": {n: [round(rec["rows"][n], 2) for rec in records] for n in names}}
    return found


def target_of(name: str, today_cached_us: float):
    """(text, check(ours_us, ratio) -> bool) for the rows with a target, else None."""
    if name == "LL pair":
        return "ratio <= 0.4", lambda ours, ratio: ratio is not None and ratio <= 0.4
    if name in ("cached dispatch T=128", "combine T=128"):
        limit = today_cached_us / 2
        return f"<= {limit:.1f} us", lambda ours, ratio: ours <= limit
    return None


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(found: dict[str, dict], world: int, today_cached_us: float) -> str:
    ours, theirs = found.get("moe_dispatcher"), found.get("deep_ep")
    device = (ours or theirs or {}).get("device", "?")
    lines = [f"# Host time per call, {world} x {device}, {time.strftime('%Y-%m-%d %H:%M')}",
             "",
             ("Median us of the Python call per rank (device never awaited inside the timed span; "
              f"synchronise every {SYNC_EVERY} calls), largest median over ranks."),
             "",
             "| call | moe_dispatcher us | DeepEP V1 us | ratio | target |",
             "|---|---|---|---|---|"]
    names = list((ours or theirs or {"rows": {}})["rows"])
    for name in names:
        a = ours["rows"].get(name) if ours else None
        b = theirs["rows"].get(name) if theirs else None
        ratio = a / b if a is not None and b else None
        target = target_of(name, today_cached_us)
        verdict = ""
        if target is not None and a is not None:
            met = target[1](a, ratio)
            verdict = f"{target[0]}: {'met' if met else 'NOT met'}"
        lines.append(f"| {name} | {_us(a)} | {_us(b)} | {_us(ratio)} | {verdict} |")
    if theirs is None:
        lines += ["", "DeepEP V1 not measured (no --deepep-path, or its run failed: see the log)."]
    return "\n".join(lines) + "\n"


def driver(args) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result_dir = os.path.join(os.path.abspath(args.out), "host_time_ranks")
    if rank == 0:
        os.makedirs(result_dir, exist_ok=True)
        for name in os.listdir(result_dir):
            os.remove(os.path.join(result_dir, name))
    libs = ["moe_dispatcher"] + (["deep_ep"] if args.deepep_path else [])
    ports = [free_port() for _ in libs] if rank == 0 else [0] * len(libs)
    dist.broadcast_object_list(ports, src=0)
    codes = {}
    for lib, port in zip(libs, ports):
        dist.barrier()
        codes[lib] = run_child(lib, port, args, result_dir)
    dist.barrier()
    if rank == 0:
        found = collect(result_dir, world)
        text = render(found, world, args.today_cached_us)
        for lib, code in codes.items():
            if code:
                text += f"\n{LABEL[lib]}: the child process group exited with {code} on rank 0.\n"
        print(text, flush=True)
        with open(os.path.join(args.out, "host_time.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "host_time.json"), "w") as f:
            json.dump({"world": world, "exit_codes": codes, "libs": found}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(c == 0 for c in codes.values()) else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    os.makedirs(args.out, exist_ok=True)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
