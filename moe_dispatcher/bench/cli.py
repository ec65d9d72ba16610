"""Command line: `python -m moe_dispatcher.bench [options]` (or under torchrun). See bench/README.md."""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import traceback
from typing import List, Optional

import torch
import torch.distributed as dist

from .launch import default_num_ranks, launch, under_torchrun


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.replace(" ", "").split(",") if v]


def _names(text: str) -> List[str]:
    return [v for v in text.replace(" ", "").split(",") if v]


def _triples(text: str) -> List[tuple]:
    out = []
    for item in text.replace(" ", "").split(","):
        if item:
            sms, send, recv = item.split(":")
            out.append((int(sms), int(send), int(recv)))
    return out


def _pairs(text: str) -> List[tuple]:
    out = []
    for item in text.replace(" ", "").split(","):
        if item:
            send, recv = item.split(":")
            out.append((int(send), int(recv)))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_dispatcher.bench",
        description="Benchmark moe_dispatcher's dispatch/combine against NCCL (one process per GPU; spawns them "
                    "itself unless run under torchrun). Without CUDA: gloo ranks on the CPU, reference backend.")
    a = p.add_argument
    a("--mode", choices=("normal", "low-latency", "internode", "expert-major", "overlap", "all"), default="normal",
      help="expert-major: expert-major calls vs rank-major on one routing; overlap: GEMMs beside cached "
           "dispatch+combine rounds (neither is part of 'all')")
    a("--nvl-size", type=int, default=None, help="internode mode: GPUs per emulated NVLink domain (default R/2)")
    a("--backend", choices=("auto", "kernels", "reference"), default="auto",
      help="Buffer(backend=...): kernels = error instead of falling back to the reference backend")
    a("--num-pool-bytes", type=int, default=0, metavar="N",
      help="normal, overlap and internode modes: Buffer(num_pool_bytes=N): dispatch writes straight into outputs in "
           "the peer pool and combine pulls its inputs from the pool (internode: over the NVLink domain) (0: none)")
    a("--num-ranks", type=int, default=None, help="ranks (default: every visible GPU; on CPU 2)")
    a("--cpu", action="store_true", help="gloo ranks on the CPU even when GPUs are visible")
    a("--json", default=None, metavar="PATH", help="write every record as JSON here")
    a("--out-dir", default=None, metavar="DIR", help="write bench_<mode>_<device>x<ranks>_<date>.{md,json,png} here")
    a("--quick", action="store_true", help="few iterations, small shapes (smoke test)")
    a("--sweep", action="store_true", help="normal mode: the full num_sms x send x recv chunk grid")
    a("--plot-sweep", action="store_true", help="normal mode: tokens-per-rank sweep and the PNG plot")
    g = p.add_argument_group("shapes and timing (defaults: the standard shapes of bench/README.md; --quick shrinks "
                             "them)")
    g.add_argument("--tokens", type=int, default=None, help="normal-mode tokens per rank (4096)")
    g.add_argument("--hidden", type=int, default=None, help="hidden size (7168)")
    g.add_argument("--num-experts", type=int, default=None, help="normal-mode experts (256)")
    g.add_argument("--topk", type=int, default=None, help="top-k (8)")
    g.add_argument("--num-sms", type=_ints, default=None, help="num_sms sweep with tuned chunks (8,16,24; overlap "
                   "mode: 4,8,16,24 and the default choice)")
    g.add_argument("--chunks", type=_pairs, default=None,
                   help="extra send:recv chunk pairs at the largest num_sms (8:128,16:256,32:512)")
    g.add_argument("--configs", type=_triples, default=[],
                   help="extra num_sms:send:recv configs, e.g. 16:12:256,24:32:512 (after the rows above)")
    g.add_argument("--plot-sms", type=int, default=None, help="num_sms of the tokens sweep (24)")
    g.add_argument("--tokens-sweep", type=_ints, default=None, help="tokens per rank of --plot-sweep "
                   "(512,1024,2048,4096,8192)")
    g.add_argument("--ll-tokens", type=int, default=None, help="low-latency tokens per rank (128)")
    g.add_argument("--ll-experts", type=_ints, default=None, help="low-latency expert counts (256,32)")
    g.add_argument("--ll-reductions", type=_names, default=["per_rank", "per_expert"],
                   help="low-latency combine reduction orders to time side by side (Buffer "
                        "low_latency_combine_reduction; default: per_rank,per_expert)")
    g.add_argument("--iters", type=int, default=None, help="timed calls per case (50)")
    g.add_argument("--warmup", type=int, default=None, help="warm-up calls per case (10)")
    g.add_argument("--no-graph", action="store_true", help="low-latency: skip the CUDA-graph timings")
    g.add_argument("--gemm-size", type=int, default=None, help="overlap: N of the BF16 N x N x N GEMMs (8192)")
    g.add_argument("--rounds", type=int, default=None, help="overlap: GEMMs and exchange rounds per measurement (40)")
    g.add_argument("--repeats", type=int, default=None, help="overlap: measurements per case after a warm-up (5)")
    g.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds (300)")
    return p


FULL = dict(tokens=4096, hidden=7168, num_experts=256, topk=8, num_sms=[8, 16, 24],
            chunks=[(8, 128), (16, 256), (32, 512)], plot_sms=24, tokens_sweep=[512, 1024, 2048, 4096, 8192],
            ll_tokens=128, ll_experts=[256, 32], iters=50, warmup=10, gemm_size=8192, rounds=40, repeats=5)
QUICK = dict(tokens=256, hidden=512, num_experts=32, topk=8, num_sms=[8, 24], chunks=[(16, 256)], plot_sms=24,
             tokens_sweep=[64, 256], ll_tokens=16, ll_experts=[32, 16], iters=5, warmup=2, gemm_size=512, rounds=4,
             repeats=2)
OVERLAP_SMS = [4, 8, 16, 24]


def resolve(opts: argparse.Namespace) -> argparse.Namespace:
    defaults = QUICK if opts.quick else FULL
    if opts.mode == "overlap" and opts.num_sms is None:
        opts.num_sms = list(OVERLAP_SMS)
    for k, v in defaults.items():
        if getattr(opts, k) is None:
            setattr(opts, k, v)
    if opts.hidden % 128:
        raise SystemExit(f"--hidden must be a multiple of 128 (FP8 scales per 128 channels), got {opts.hidden}")
    if opts.iters < 1 or opts.warmup < 0:
        raise SystemExit("--iters must be >= 1 and --warmup >= 0")
    if min(opts.gemm_size, opts.rounds, opts.repeats) < 1:
        raise SystemExit("--gemm-size, --rounds and --repeats must be >= 1")
    if any(s < 2 or s % 2 for s in opts.num_sms):
        raise SystemExit(f"--num-sms takes positive even counts (a channel is a pair of SMs), got {opts.num_sms}")
    opts.use_cuda = torch.cuda.is_available() and not opts.cpu
    if opts.backend == "kernels" and not opts.use_cuda:
        raise SystemExit("--backend kernels needs CUDA GPUs (the CPU runs only the reference backend)")
    if opts.num_ranks is None:
        opts.num_ranks = default_num_ranks() if opts.use_cuda or under_torchrun() else 2
    if opts.num_ranks < 1:
        raise SystemExit("--num-ranks must be >= 1")
    if opts.num_experts % opts.num_ranks:
        raise SystemExit(f"--num-experts {opts.num_experts} is not divisible by {opts.num_ranks} ranks")
    opts.command = " ".join(["python -m moe_dispatcher.bench"] + sys.argv[1:])
    now = datetime.datetime.now()
    opts.date, opts.stamp = now.strftime("%Y-%m-%d %H:%M"), now.strftime("%Y%m%d-%H%M")
    opts.commit = _commit()
    return opts


def _commit() -> Optional[str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        pass
    return None


def rank_main(opts: argparse.Namespace) -> None:
    """The benchmark on one rank (the process group is up)."""
    from . import expert_major, internode, low_latency, normal, overlap, report
    from .common import Context, baseline_label, env_info, quiet_fallback_warnings
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if opts.use_cuda else torch.device("cpu")
    ctx = Context(opts=opts, rank=rank, num_ranks=world, device=device,
                  baseline=baseline_label(str(dist.get_backend())))
    quiet_fallback_warnings(rank)
    info = env_info(ctx)
    ctx.say(f"moe_dispatcher bench: {info['device']} x{world} ({info['process_group']}), backend={opts.backend}, "
            f"mode={opts.mode}{' (quick)' if opts.quick else ''}")
    if ctx.baseline != "NCCL":
        ctx.say(f"note: {report.CPU_NOTE}")
    failed = []
    sections = {"normal": normal.run, "low-latency": low_latency.run, "internode": internode.run,
                "expert-major": expert_major.run, "overlap": overlap.run}
    for name, fn in sections.items():
        if opts.mode != name and (opts.mode != "all" or name in ("expert-major", "overlap")):
            continue
        try:
            fn(ctx)
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            failed.append(name)
            ctx.note(f"{name} mode failed: {type(exc).__name__}: {exc}")
            if rank == 0:
                traceback.print_exc()
    if rank == 0:
        meta = {**info, "date": opts.date, "stamp": opts.stamp, "command": opts.command, "commit": opts.commit,
                "backend_requested": opts.backend, "mode": opts.mode, "quick": opts.quick,
                "backends_used": sorted({r["backend"] for r in ctx.records if r.get("backend") not in (None, "nccl")}),
                "env": {k: os.environ.get(k) for k in ("NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE",
                                                       "TORCH_SYMM_MEM_DISABLE_MULTICAST", "MOE_DISPATCHER_BACKEND",
                                                       "MOE_DISPATCHER_NVL_SIZE", "MOE_DISPATCHER_LL_COMBINE")},
                "options": {k: v for k, v in vars(opts).items() if k not in ("command",)},
                "failed_sections": failed}
        report.write(meta, ctx.records, ctx.notes, opts.json, opts.out_dir, opts.mode)
    dist.barrier()
    if failed:
        raise SystemExit(1)


def main(argv: Optional[List[str]] = None) -> int:
    opts = resolve(parser().parse_args(argv))
    try:
        launch(rank_main, opts, opts.num_ranks, opts.use_cuda, opts.timeout)
    except Exception as exc:  # noqa: BLE001 - a rank failed: its traceback was printed by that rank
        name = type(exc).__name__
        if name == "ProcessExitedException" and getattr(exc, "exit_code", None) == 1:
            print("moe_dispatcher.bench: some sections failed (see the Notes above)", file=sys.stderr)
            return 1
        if name in ("ProcessExitedException", "ProcessRaisedException"):
            print(f"moe_dispatcher.bench: a rank failed: {str(exc).strip()}", file=sys.stderr)
            return 1
        raise
    return 0
