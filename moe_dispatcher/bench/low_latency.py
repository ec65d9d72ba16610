"""Low-latency mode ("decode"): FP8 dispatch (cast inside the call) and BF16 weighted combine, separately and
back to back, timed per call with CUDA events and (when every rank can capture them) as CUDA graph replays;
beside NCCL all_to_all_single of the same messages, the same way.

Bytes (shared/notes/performance.md): valid top-k selections sent by this rank x (H + H/128*4 + 16) for the
FP8 dispatch, x 2H for the BF16 combine; dispatch+combine counts both. Physical: selections whose expert
lives on another rank (the per-rank combine reduction: (token, rank) pairs with the rank another one, x 2H).
The combine is timed under each reduction order of --ll-reductions (records carry "reduction").
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..buffer import Buffer
from .common import Context, attach_baseline, fmt_rec, make_record
from .timing import gather, rotation, time_calls, time_graph_replays, try_capture

# (num_ranks, num_experts) -> (dispatch, combine, both) us targets at 128 tokens, H 7168, top-8
# (shared/notes/performance.md; on 2 GPUs: "below DeepEP V1's figures").
TARGETS_US = {(4, 256): (28.0, 45.0, 70.0), (2, 256): (29.0, 40.0, 72.0)}


def run(ctx: Context) -> None:
    o = ctx.opts
    r = ctx.num_ranks
    experts = [e for e in o.ll_experts if e % r == 0]
    for e in o.ll_experts:
        if e % r:
            ctx.note(f"low-latency E={e} skipped: not divisible by {r} ranks")
    if not experts:
        return
    rdma = max(Buffer.get_low_latency_rdma_size_hint(o.ll_tokens, o.hidden, r, e) for e in experts)
    ctx.say(f"== low-latency mode: {r} ranks, T={o.ll_tokens} H={o.hidden} top-{o.topk}, E={experts}, "
            f"{o.iters} timed calls after {o.warmup} warm-up; NVSHMEM buffer {rdma / 2**20:.0f} MiB")
    buffer = Buffer(ctx.group, 0, rdma, low_latency_mode=True, backend=o.backend)
    failed = []
    reductions = list(getattr(o, "ll_reductions", None) or ["per_rank"])
    cases = [(e, red) for e in experts for red in reductions]
    try:
        for e, red in cases:
            try:
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize()
                buffer.low_latency_combine_reduction = red
                one(ctx, buffer, e, nccl=red == reductions[0], reduction=red)
            except (ValueError, RuntimeError, NotImplementedError) as exc:
                failed.append(f"{e} ({red})")
                ctx.note(f"low-latency E={e} failed: {type(exc).__name__}: {exc}")
                if o.backend == "kernels":
                    break
    finally:
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        buffer.destroy()
    if failed:
        raise RuntimeError(f"low-latency cases failed for E={failed} (see the notes)")


def one(ctx: Context, buffer: Buffer, num_experts: int, nccl: bool = True, reduction: str = "per_rank") -> None:
    """One expert count; `nccl`: time the baseline too;
    `reduction`: the combine's order (the Buffer is set to it; labels the records)."""
    o, dev, g, me, r = ctx.opts, ctx.device, ctx.group, ctx.rank, ctx.num_ranks
    t, h, k = o.ll_tokens, o.hidden, o.topk
    local = num_experts // r
    gen = torch.Generator(device=dev)
    gen.manual_seed(7000 + 97 * num_experts + me)
    scores = torch.randn(t, num_experts, device=dev, generator=gen).abs() + 1
    topk_idx = scores.topk(k, dim=-1).indices.to(torch.int64)
    topk_weights = torch.randn(t, k, device=dev, generator=gen).abs().float()
    xs = [torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16)
          for _ in range(rotation(t * h * 2, dev))]
    buffer.clean_low_latency_buffer(t, h, num_experts)

    def dispatch(i: int):
        return buffer.low_latency_dispatch(xs[i % len(xs)], topk_idx, t, num_experts, use_fp8=True)

    _, _, handle, _, _ = dispatch(0)
    backend = handle.backend
    ys = [torch.randn(local, r * t, h, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2)]

    def combine(i: int, hd=None):
        return buffer.low_latency_combine(ys[i % len(ys)], topk_idx, topk_weights, handle if hd is None else hd)

    def both(i: int):
        _, _, hd, _, _ = dispatch(i)
        return combine(i, hd)

    # bytes of this rank (performance.md)
    valid = topk_idx >= 0
    dest = torch.where(valid, topk_idx // local, r)
    sel = int(valid.sum())
    to_peers = int((valid & (dest != me)).sum())
    msg = h + h // 128 * 4 + 16
    if reduction == "per_rank":  # one row per (token, rank) it picks
        pairs = torch.zeros(t, r + 1, dtype=torch.bool, device=dev)
        pairs.scatter_(1, dest, True)
        pairs[:, me] = False
        combine_physical = int(pairs[:, :r].sum()) * 2 * h
    else:
        combine_physical = to_peers * 2 * h
    nbytes = {"dispatch": (sel * msg, to_peers * msg), "combine": (sel * 2 * h, combine_physical)}
    nbytes["dispatch+combine"] = tuple(a + b for a, b in zip(nbytes["dispatch"], nbytes["combine"]))

    fields = {"section": "low-latency", "tokens": t, "hidden": h, "num_experts": num_experts, "topk": k,
              "dtype": "fp8 dispatch / bf16 combine", "reduction": reduction}
    tag = f" {reduction}"
    ctx.say(f"  E={num_experts}{tag}: backend {backend}; rank {me} sends {sel} selections ({to_peers} to peers)")

    # NCCL: the same messages with all_to_all_single (dispatch rows of `msg` bytes, combine rows of 2H bytes)
    send_counts = torch.bincount(dest[valid], minlength=r).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=g)
    sc, rc = [int(v) for v in send_counts.tolist()], [int(v) for v in recv_counts.tolist()]
    n_recv = sum(rc)
    d_in = [torch.randint(0, 256, (sel, msg), device=dev, dtype=torch.uint8, generator=gen) for _ in range(2)]
    c_in = [torch.randn(n_recv, h, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2)]
    d_out = torch.empty(n_recv, msg, dtype=torch.uint8, device=dev)
    c_out = torch.empty(sel, h, dtype=torch.bfloat16, device=dev)

    def n_dispatch(i: int):
        dist.all_to_all_single(d_out, d_in[i % 2], rc, sc, group=g)

    def n_combine(i: int):
        dist.all_to_all_single(c_out, c_in[i % 2], sc, rc, group=g)

    def n_both(i: int):
        n_dispatch(i)
        n_combine(i)

    ours: Dict[str, Callable[[int], Any]] = {"dispatch": dispatch, "combine": combine, "dispatch+combine": both}
    theirs: Dict[str, Callable[[int], Any]] = {"dispatch": n_dispatch, "combine": n_combine,
                                               "dispatch+combine": n_both}
    target = TARGETS_US.get((r, num_experts)) if (t, h, k) == (128, 7168, 8) else None

    def emit(op: str, path: str, times: List[float], base_times: Optional[List[float]], note: str = "") -> None:
        logical, physical = nbytes[op]
        rec = make_record(ctx, {**fields, "op": op, "path": path, "backend": backend}, times, logical, physical)
        if base_times is not None:
            base = make_record(ctx, {**fields, "op": f"nccl-a2a {op}", "path": path, "backend": "nccl"},
                               base_times, logical, physical)
            attach_baseline(rec, base)
        if target is not None:
            rec["target_us"] = target[("dispatch", "combine", "dispatch+combine").index(op)]
        if note:
            rec["note"] = note
        ctx.say(f"[low-latency] E={num_experts:<3d}{tag} {op:16s} {path:6s}: {fmt_rec(rec)}")
        ctx.records.append(rec)

    # per-call events (eager). The combine case reuses one dispatch's handle.
    for op in ("dispatch", "combine", "dispatch+combine"):
        if op == "combine":
            _, _, handle, _, _ = dispatch(0)
        times = time_calls(ours[op], o.iters, o.warmup, dev, g)
        base = time_calls(theirs[op], o.iters, o.warmup, dev, g) if nccl else None
        emit(op, "events", times, base)

    if dev.type != "cuda" or o.no_graph:
        return
    if backend == "reference":
        ctx.note("low-latency CUDA graphs not tried: the reference backend synchronises with the host")
        graphs_ours = None
    else:
        graphs_ours = {}
    # Two low-latency calls per graph, so replays keep alternating the buffer halves.
    bodies = {"dispatch": (lambda: (dispatch(0), dispatch(1)), 2),
              "combine": (lambda: (combine(0), combine(1)), 2),
              "dispatch+combine": (lambda: both(0), 1)}
    nccl_bodies = {"dispatch": (lambda: n_dispatch(0), 1), "combine": (lambda: n_combine(0), 1),
                   "dispatch+combine": (lambda: n_both(0), 1)}
    for op in ("dispatch", "combine", "dispatch+combine"):
        if op == "combine" and graphs_ours is not None:
            _, _, handle, _, _ = dispatch(0)
        mine = None
        if graphs_ours is not None:
            body, per = bodies[op]
            graph, why = try_capture(body, dev, g)
            if graph is None:
                ctx.note(f"low-latency {op} E={num_experts} not CUDA-graph capturable: {why}")
            else:
                mine = [x / per for x in time_graph_replays(graph, o.iters, o.warmup, dev, g)]
                del graph
        nbody, nper = nccl_bodies[op]
        ngraph, nwhy = try_capture(nbody, dev, g) if nccl else (None, None)
        base = None
        if ngraph is None and nccl:
            ctx.note(f"NCCL all_to_all_single {op} not CUDA-graph capturable: {nwhy}")
        elif ngraph is not None:
            base = [x / nper for x in time_graph_replays(ngraph, o.iters, o.warmup, dev, g)]
            del ngraph
        if mine is not None:
            emit(op, "graph", mine, base)
        elif base is not None and nccl:
            rec = make_record(ctx, {**fields, "op": f"nccl-a2a {op}", "path": "graph", "backend": "nccl"}, base,
                              *nbytes[op])
            ctx.say(f"[low-latency] E={num_experts:<3d} NCCL {op:16s} graph : {fmt_rec(rec)}")
            ctx.records.append(rec)
    gather(None, g)  # everyone done with the graphs before the buffers go
