"""Expert-major mode: the expert-major calls beside the rank-major ones on ONE routing
(`python -m moe_dispatcher.bench --mode expert-major --num-ranks 4`).

On the standard shape (4096 tokens/rank, H 7168, top-8 of 256, routing `topk(randn.abs() + 1)`) and the
Buffer's default Config (Buffer.num_sms SMs, the tuned chunks: what Megatron uses), it times:
  rank-major dispatch (cached handle) and combine;
  expert_major_dispatch fresh with num_worst_tokens (no host sync), fresh exact (host waits for the counts),
  cached;
  expert_major_combine without weights, with weights [M], with topk_weights [M];
  the torch composition (expert_major.unpermute + rank-major combine) and unpermute alone;
  NCCL all_to_all_single of the same rows (dispatch and combine direction).
Each case twice: "b2b" = per-call CUDA events with calls back to back (what a training loop sees: includes
waiting for peers that start late), "sync" = a device synchronize + dist.barrier + synchronize before every
call, events around the call only (every rank starts together, so what remains is the kernels' own time plus
the launch; the difference b2b - sync is skew between ranks). Bytes as normal mode: received rows x 2H.
"""
from __future__ import annotations

import time
from typing import Any, Callable, List

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..expert_major import unpermute
from .common import Context, make_record
from .normal import Workload, nvl_bytes
from .timing import barrier, rotation, sync, time_calls

SECTION = "expert-major"


def time_calls_synced(fn: Callable[[int], Any], iters: int, warmup: int, device: torch.device,
                      group=None) -> List[float]:
    """Seconds of each call fn(i), every call after a device-wide barrier (sync, dist.barrier, sync)."""
    for i in range(warmup):
        fn(i)
    out = []
    for i in range(iters):
        barrier(device, group)
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(warmup + i)
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn(warmup + i)
            out.append(time.perf_counter() - t0)
    sync(device)
    return out


def run(ctx: Context) -> None:
    o, dev, g = ctx.opts, ctx.device, ctx.group
    r = ctx.num_ranks
    dcfg, ccfg = Buffer.get_dispatch_config(r), Buffer.get_combine_config(r)
    buffer = Buffer(g, num_nvl_bytes=nvl_bytes([dcfg, ccfg], o.hidden, r), backend=o.backend)
    ctx.say(f"== expert-major mode: {r} ranks, T={o.tokens} H={o.hidden} top-{o.topk} of {o.num_experts} experts, "
            f"sms={dcfg.num_sms} (Buffer default) chunks d {dcfg.num_max_nvl_chunked_send_tokens}/"
            f"{dcfg.num_max_nvl_chunked_recv_tokens} c {ccfg.num_max_nvl_chunked_send_tokens}/"
            f"{ccfg.num_max_nvl_chunked_recv_tokens}, {o.iters} calls after {o.warmup} warm-up, b2b and synced")
    try:
        _run(ctx, buffer, dcfg, ccfg)
    finally:
        sync(dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        buffer.destroy()


def _run(ctx: Context, buffer: Buffer, dcfg, ccfg) -> None:
    o, dev, g = ctx.opts, ctx.device, ctx.group
    w = Workload(ctx, buffer, o.tokens, seed=1)
    recv_x, handle = w.fresh(dcfg)
    w.learn(recv_x, handle)
    del recv_x
    fields = {"section": SECTION, "dtype": "bf16", **w.fields(), "num_sms": dcfg.num_sms}
    logical, physical = w.bytes_bf16()

    # Expert-major handle (exact), and a num_worst_tokens bound every rank's rows fit (10% over the largest).
    px, _, _, _, em_handle, _ = buffer.expert_major_dispatch(w.xs[0], topk_idx=w.topk_idx, topk_weights=w.topk_weights,
                                                             num_experts=w.num_experts, config=dcfg)
    m = int(px.shape[0])
    del px
    need = torch.tensor([m], dtype=torch.int64)
    if dev.type == "cuda":
        need = need.to(dev)
    dist.all_reduce(need, op=dist.ReduceOp.MAX, group=g)
    worst = (int(int(need.item()) * 1.1) + 127) // 128 * 128
    n_rows = int(em_handle.dispatch.recv_src_idx.shape[0])
    ctx.say(f"  backend {em_handle.dispatch.backend}: rank {ctx.rank}: receives {w.recv_rows} rows, {m} expert rows "
            f"(pairs + padding); num_worst_tokens bound {worst}")
    counts = [None] * ctx.num_ranks
    dist.all_gather_object(counts, (w.recv_rows, m), group=g)
    ctx.note(f"rows per rank (received, expert-major): {counts}; num_worst_tokens bound {worst}")

    gen = torch.Generator(device=dev)
    gen.manual_seed(77 + ctx.rank)
    copies = rotation(m * o.hidden * 2, dev)
    ems = [torch.randn(m, o.hidden, device=dev, generator=gen).to(torch.bfloat16) for _ in range(copies)]
    em_w = torch.rand(m, device=dev, generator=gen).float()
    em_tw = torch.rand(m, device=dev, generator=gen).float()

    cases: List[tuple] = []  # (op, fn, note)
    cases.append(("rank-major dispatch (cached)", lambda i: buffer.dispatch(w.xs[i % len(w.xs)], handle=handle,
                                                                            config=dcfg)))
    cases.append(("rank-major combine", lambda i: buffer.combine(w.ys[i % len(w.ys)], handle, config=ccfg)))
    em_kw = dict(topk_idx=w.topk_idx, topk_weights=w.topk_weights, num_experts=w.num_experts, config=dcfg)

    def em_dispatch(**kw):
        return lambda i: buffer.expert_major_dispatch(w.xs[i % len(w.xs)], **kw)

    cases.append(("em dispatch fresh num_worst_tokens", em_dispatch(num_worst_tokens=worst, **em_kw)))
    cases.append(("em dispatch fresh exact (host sync)", em_dispatch(**em_kw)))
    cases.append(("em dispatch cached", em_dispatch(handle=em_handle, config=dcfg)))

    def em_combine(weights, topk_weights):
        return lambda i: buffer.expert_major_combine(ems[i % len(ems)], em_handle, weights=weights,
                                                     topk_weights=topk_weights, config=ccfg)

    cases.append(("em combine", em_combine(None, None)))
    cases.append(("em combine +weights", em_combine(em_w, None)))
    cases.append(("em combine +topk_weights", em_combine(None, em_tw)))

    def composition(i):
        rows, w_rows = unpermute(ems[i % len(ems)], em_handle, None, None)
        return buffer.combine(rows, em_handle.dispatch, topk_weights=w_rows, config=ccfg)

    cases.append(("torch composition (unpermute + combine)", composition))
    cases.append(("torch unpermute alone (local)", lambda i: unpermute(ems[i % len(ems)], em_handle, None, None)))

    # NCCL: all_to_all_single of the same rows (dispatch direction and combine direction).
    send = [torch.randn(w.send_rows, o.hidden, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2)]

    def a2a(inputs, rows_out, out_splits, in_splits):
        def fn(i):
            out = torch.empty(rows_out, o.hidden, dtype=torch.bfloat16, device=dev)
            dist.all_to_all_single(out, inputs[i % len(inputs)], out_splits, in_splits, group=g)
        return fn

    cases.append(("NCCL a2a dispatch rows", a2a(send, w.recv_rows, w.recv_counts, w.send_counts)))
    cases.append(("NCCL a2a combine rows", a2a(w.ys, w.send_rows, w.send_counts, w.recv_counts)))

    for op, fn in cases:
        for timing, timer in (("b2b", time_calls), ("sync", time_calls_synced)):
            try:
                times = timer(fn, o.iters, o.warmup, dev, g)
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                ctx.note(f"{op} ({timing}) failed: {type(exc).__name__}: {exc}")
                raise
            rec = make_record(ctx, {**fields, "op": op, "timing": timing, "backend": em_handle.dispatch.backend
                                    if not op.startswith("NCCL") else "nccl", "recv_rows": w.recv_rows,
                                    "em_rows": m, "n_rows": n_rows}, times, logical, physical)
            ctx.records.append(rec)
            t = rec["t_us"]
            ctx.say(f"[{SECTION}] {op:42s} {timing:4s}: {t['mean']:9.1f} us (ranks {t['min']:.1f}..{t['max']:.1f})")
    _check_equal(ctx, buffer, ems[0], em_w, em_tw, em_handle, ccfg)


def _check_equal(ctx: Context, buffer: Buffer, x, em_w, em_tw, em_handle, ccfg) -> None:
    """expert_major_combine against the torch composition, bit for bit (a note, and a RuntimeError if not)."""
    bad = []
    for weights, tw, what in ((None, None, "plain"), (em_w, None, "weights"), (None, em_tw, "topk_weights")):
        rows, w_rows = unpermute(x, em_handle, weights, tw)
        ref, ref_w, _ = buffer.combine(rows, em_handle.dispatch, topk_weights=w_rows, config=ccfg)
        out, out_w, _ = buffer.expert_major_combine(x, em_handle, weights=weights, topk_weights=tw, config=ccfg)
        if not (torch.equal(out, ref) and (tw is None or torch.equal(out_w, ref_w))):
            bad.append(what)
    verdicts = [None] * ctx.num_ranks
    dist.all_gather_object(verdicts, bad, group=ctx.group)
    failed = {r: v for r, v in enumerate(verdicts) if v}
    if failed:
        ctx.note(f"expert-major combine differs from the torch composition: {failed}")
        raise RuntimeError(f"expert-major combine is not bit-identical to the composition: {failed}")
    ctx.note("expert_major_combine x (plain, weights, topk_weights) equals the torch composition bit for bit on "
             "every rank")
