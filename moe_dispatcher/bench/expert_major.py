"""Expert-major mode: the fused permutation beside the rank-major kernels on ONE routing (diagnosis of the
fused combine's cost; `python -m moe_dispatcher.bench --mode expert-major --num-ranks 4`).

On the standard shape (4096 tokens/rank, H 7168, top-8 of 256, routing `topk(randn.abs() + 1)`) and the
Buffer's default Config (Buffer.num_sms SMs, the tuned chunks: what Megatron uses), it times:
  rank-major dispatch (cached handle) and combine;
  expert_major_dispatch fresh with num_worst_tokens (no host sync), fresh exact (host waits for the counts),
  cached, for every dispatch variant the backend has (compiled intranode: "split" = the rank-major dispatch,
  then a whole-GPU pass copies each received row to its expert-major rows, "fused" = the dispatch kernel's
  receivers write them; MOE_DISPATCHER_EM_DISPATCH picks the default, the bench runs both);
  expert_major_combine without weights, with weights [M], with topk_weights [M], for every combine variant
  the backend has ("split" = a whole-GPU pass sums each received row's expert rows, then the rank-major
  combine; "fused" = the combine kernel's senders gather and sum; MOE_DISPATCHER_EM_COMBINE);
  the split variants' local passes alone (em_permute, em_unpermute: their HBM bytes / time in the notes);
  the torch composition (expert_major.unpermute + rank-major combine) and unpermute alone;
  NCCL all_to_all_single of the same rows (dispatch and combine direction).
Each case twice: "b2b" = per-call CUDA events with calls back to back (what a training loop sees: includes
waiting for peers that start late), "sync" = a device synchronize + dist.barrier + synchronize before every
call, events around the call only (every rank starts together, so what remains is the kernels' own time plus
the launch; the difference b2b - sync is skew between ranks). Bytes as normal mode: received rows x 2H.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

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


def _em_backend(buffer: Buffer, handle):
    """The backend object serving the handle, and its (dispatch, combine) variants (() when it has none)."""
    backend = buffer._backend_of(handle.dispatch, (type(handle.dispatch),))
    if not hasattr(backend, "em_combine_mode"):
        return backend, (), ()
    from ..compiled.intranode import EM_COMBINE_MODES, EM_DISPATCH_MODES
    return backend, tuple(EM_DISPATCH_MODES), tuple(EM_COMBINE_MODES)


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
    pairs = int((em_handle.pair_row >= 0).sum())
    backend, dmodes, modes = _em_backend(buffer, em_handle)
    default_mode = getattr(backend, "em_combine_mode", None)
    default_dmode = getattr(backend, "em_dispatch_mode", None)
    ctx.say(f"  backend {em_handle.dispatch.backend}: rank {ctx.rank}: receives {w.recv_rows} rows, {m} expert rows "
            f"(pairs + padding); num_worst_tokens bound {worst}; dispatch variants {list(dmodes) or '-'} (default "
            f"{default_dmode}), combine variants {list(modes) or '-'} (default {default_mode})")
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

    def em_dispatch(mode: Optional[str], **kw):
        def fn(i):
            if mode is not None:
                backend.em_dispatch_mode = mode
            return buffer.expert_major_dispatch(w.xs[i % len(w.xs)], **kw)
        return fn

    for mode in (dmodes or (None,)):
        tag = f" [{mode}]" if mode else ""
        cases.append((f"em dispatch fresh num_worst_tokens{tag}", em_dispatch(mode, num_worst_tokens=worst, **em_kw)))
        cases.append((f"em dispatch fresh exact (host sync){tag}", em_dispatch(mode, **em_kw)))
        cases.append((f"em dispatch cached{tag}", em_dispatch(mode, handle=em_handle, config=dcfg)))

    def em_combine(mode: Optional[str], weights, topk_weights):
        def fn(i):
            if mode is not None:
                backend.em_combine_mode = mode
            return buffer.expert_major_combine(ems[i % len(ems)], em_handle, weights=weights,
                                               topk_weights=topk_weights, config=ccfg)
        return fn

    for mode in (modes or (None,)):
        tag = f" [{mode}]" if mode else ""
        cases.append((f"em combine{tag}", em_combine(mode, None, None)))
        cases.append((f"em combine +weights{tag}", em_combine(mode, em_w, None)))
        cases.append((f"em combine +topk_weights{tag}", em_combine(mode, None, em_tw)))

    def composition(i):
        rows, w_rows = unpermute(ems[i % len(ems)], em_handle, None, None)
        return buffer.combine(rows, em_handle.dispatch, topk_weights=w_rows, config=ccfg)

    # The split variants' local passes alone; HBM bytes: every received row and every pair's expert row once.
    local_bytes = (n_rows + pairs) * o.hidden * 2
    if dmodes:
        rank_rows = [torch.randn(n_rows, o.hidden, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2)]
        cases.append(("em_permute alone (local, split dispatch)",
                      lambda i: backend.em_permute(rank_rows[i % 2], None, em_handle)))
    if modes:
        cases.append(("em_unpermute alone (local, split combine)",
                      lambda i: backend.em_unpermute(ems[i % len(ems)], em_handle, None, None)))
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
            if op.startswith("em_") and timing == "sync":
                ctx.note(f"{op}: {t['mean']:.1f} us for {local_bytes / 1e6:.0f} MB read + written (rank "
                         f"{ctx.rank}: {n_rows} received rows, {pairs} pairs) = "
                         f"{local_bytes / (t['mean'] * 1e-6) / 1e9:.0f} GB/s")
    if default_mode is not None:
        backend.em_combine_mode = default_mode
        backend.em_dispatch_mode = default_dmode
    _check_equal(ctx, buffer, backend, modes, ems[0], em_w, em_tw, em_handle, ccfg)
    _check_dispatch_equal(ctx, buffer, backend, dmodes, w, worst, em_handle, dcfg)


def _check_equal(ctx: Context, buffer: Buffer, backend, modes, x, em_w, em_tw, em_handle, ccfg) -> None:
    """Every combine variant against the torch composition, bit for bit (a note, and a RuntimeError if not)."""
    bad = []
    default_mode = getattr(backend, "em_combine_mode", None)
    for weights, tw, what in ((None, None, "plain"), (em_w, None, "weights"), (None, em_tw, "topk_weights")):
        rows, w_rows = unpermute(x, em_handle, weights, tw)
        ref, ref_w, _ = buffer.combine(rows, em_handle.dispatch, topk_weights=w_rows, config=ccfg)
        for mode in (modes or (None,)):
            if mode is not None:
                backend.em_combine_mode = mode
            out, out_w, _ = buffer.expert_major_combine(x, em_handle, weights=weights, topk_weights=tw, config=ccfg)
            same = torch.equal(out, ref) and (tw is None or torch.equal(out_w, ref_w))
            if not same:
                bad.append(f"{mode or 'default'}/{what}")
    if default_mode is not None:
        backend.em_combine_mode = default_mode
    verdicts = [None] * ctx.num_ranks
    dist.all_gather_object(verdicts, bad, group=ctx.group)
    failed = {r: v for r, v in enumerate(verdicts) if v}
    if failed:
        ctx.note(f"expert-major combine differs from the torch composition: {failed}")
        raise RuntimeError(f"expert-major combine is not bit-identical to the composition: {failed}")
    ctx.note(f"every expert-major combine variant ({', '.join(modes) or 'default'}) x (plain, weights, "
             f"topk_weights) equals the torch composition bit for bit on every rank")


def _check_dispatch_equal(ctx: Context, buffer: Buffer, backend, dmodes, w, worst: int, em_handle, dcfg) -> None:
    """Every dispatch variant against the first, bit for bit: fresh exact, fresh num_worst_tokens (outputs and
    handle tables) and cached (a note, and a RuntimeError if not)."""
    if len(dmodes) < 2:
        return
    default = backend.em_dispatch_mode
    kw = dict(topk_idx=w.topk_idx, topk_weights=w.topk_weights, num_experts=w.num_experts, config=dcfg)
    results = {}
    for mode in dmodes:
        backend.em_dispatch_mode = mode
        got = []
        for extra in ({}, {"num_worst_tokens": worst}):
            px, pw, _, tpe, h, _ = buffer.expert_major_dispatch(w.xs[0], **kw, **extra)
            got += [px, pw, tpe, h.pair_row, h.pair_slot, h.backend_state[0], h.dispatch.recv_src_idx]
        got.append(buffer.expert_major_dispatch(w.xs[1 % len(w.xs)], handle=em_handle, config=dcfg)[0])
        results[mode] = got
    backend.em_dispatch_mode = default
    first = results[dmodes[0]]
    bad = []
    for mode in dmodes[1:]:
        for i, (a, b) in enumerate(zip(first, results[mode])):
            if a.shape != b.shape or not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                bad.append(f"{mode}/output {i}")
    verdicts = [None] * ctx.num_ranks
    dist.all_gather_object(verdicts, bad, group=ctx.group)
    failed = {r: v for r, v in enumerate(verdicts) if v}
    if failed:
        ctx.note(f"expert-major dispatch variants differ: {failed}")
        raise RuntimeError(f"expert-major dispatch variants are not bit-identical: {failed}")
    ctx.note(f"every expert-major dispatch variant ({', '.join(dmodes)}) x (fresh exact, fresh num_worst_tokens, "
             f"cached) gives the same rows, weights, counts and tables bit for bit on every rank")


def table(records: List[Dict[str, Any]]) -> str:
    """One row per case: back-to-back and synced times side by side."""
    from .report import _f, _range, _table
    recs = [r for r in records if r.get("section") == SECTION]
    if not recs:
        return ""
    by_op: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for r in recs:
        by_op.setdefault(r["op"], {})[r["timing"]] = r
    base = by_op.get("rank-major combine", {}).get("sync")
    rows = []
    for op, t in by_op.items():
        b, s = t.get("b2b"), t.get("sync")
        ratio = (s["t_us"]["mean"] / base["t_us"]["mean"]) if (s and base and base["t_us"]["mean"] > 0) else None
        rows.append([op, _f(b["t_us"]["mean"]) if b else "-", _range(b["t_us"]) if b else "-",
                     _f(s["t_us"]["mean"]) if s else "-", _range(s["t_us"]) if s else "-",
                     _f(b["t_us"]["mean"] - s["t_us"]["mean"]) if (b and s) else "-",
                     _f(s["logical_gbps"]["mean"]) if s else "-", _f(ratio, 2)])
    return _table(["case", "b2b us", "b2b ranks", "synced us", "synced ranks", "b2b - synced", "GB/s logical (synced)",
                   "synced / rank-major combine"], rows)
