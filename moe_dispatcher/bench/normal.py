"""Normal mode ("training / prefill"): cached-handle dispatch (BF16, FP8) and combine (BF16) over a sweep of
Configs, each beside NCCL's all_to_all_single of exactly the same rows; plus the naive NCCL MoE dispatch,
fresh (non-cached) dispatch, the layout, the host cost of a cached call, and a tokens-per-rank sweep.

Bytes (DeepEP V1's convention, bench/README.md): dispatch BF16 = recv_x.numel() * 2 per rank
(rows this rank receives, its own included); FP8 = that * (1 + 4/128) / 2; combine = the BF16 count.
Physical = the same per-row bytes for rows from (dispatch) or to (combine) peers only.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..config import Config
from ..reference.fp8 import per_token_cast_to_fp8
from .common import Context, attach_baseline, fmt_rec, make_record
from .timing import host_overhead, rotation, time_calls

FULL_SMS = (8, 16, 24, 32)
FULL_SEND = (4, 8, 12, 16, 24, 32)
FULL_RECV = (128, 256, 512)

# Logical GB/s at the standard shape (4096 tokens, H 7168, top-8 of 256), the project's targets:
# DeepEP V1 measured on the same machines (24 SMs) and our targets (2 GPUs: 1.2x DeepEP V1).
DEEPEP_GBPS = {4: {"dispatch-bf16": 262, "dispatch-fp8": 255, "combine-bf16": 357},
               2: {"dispatch-bf16": 341, "dispatch-fp8": 246, "combine-bf16": 287}}
TARGET_GBPS = {4: {"dispatch-bf16": 400, "dispatch-fp8": 380, "combine-bf16": 430},
               2: {k: round(1.2 * v) for k, v in DEEPEP_GBPS[2].items()}}


# ------------------------------------------------------------------------------------------------ configs
def _combine_ok(cfg: Config) -> bool:
    # The intranode combine needs recv slots >= send chunk + 32 (its ring keeps a margin).
    return cfg.num_max_nvl_chunked_recv_tokens >= cfg.num_max_nvl_chunked_send_tokens + 32


def sweep_configs(opts, num_ranks: int) -> List[Tuple[str, Config, Optional[Config]]]:
    """(tag, dispatch config, combine config or None) rows. Default: the tuned chunks at each num_sms, and a few
    chunk pairs at the largest num_sms; --sweep: the full grid; then the --configs rows."""
    rows: List[Tuple[str, Config, Optional[Config]]] = []
    seen = set()

    def add(tag: str, d: Config, c: Optional[Config]) -> None:
        key = (d, c)
        if key not in seen:
            seen.add(key)
            rows.append((tag, d, c))

    for sms in opts.num_sms:
        add("tuned", Config(sms, *_chunks(Buffer.get_dispatch_config(num_ranks))),
            Config(sms, *_chunks(Buffer.get_combine_config(num_ranks))))
    if opts.sweep:
        for sms in FULL_SMS:
            for send in FULL_SEND:
                for recv in FULL_RECV:
                    cfg = Config(sms, send, recv, 6, 256)
                    add("grid", cfg, cfg if _combine_ok(cfg) else None)
    else:
        sms = max(opts.num_sms)
        for send, recv in opts.chunks:
            cfg = Config(sms, send, recv, 6, 256)
            add("chunks", cfg, cfg if _combine_ok(cfg) else None)
    for sms, send, recv in getattr(opts, "configs", []):
        cfg = Config(sms, send, recv, 6, 256)
        add("configs", cfg, cfg if _combine_ok(cfg) else None)
    return rows


def _chunks(cfg: Config) -> tuple:
    return (cfg.num_max_nvl_chunked_send_tokens, cfg.num_max_nvl_chunked_recv_tokens,
            cfg.num_max_rdma_chunked_send_tokens, cfg.num_max_rdma_chunked_recv_tokens)


def plot_config(opts, num_ranks: int) -> Tuple[Config, Config]:
    sms = opts.plot_sms
    return (Config(sms, *_chunks(Buffer.get_dispatch_config(num_ranks))),
            Config(sms, *_chunks(Buffer.get_combine_config(num_ranks))))


def nvl_bytes(configs: List[Config], hidden: int, num_ranks: int) -> int:
    """NVLink buffer for every config of the run (rows of BF16 `hidden`, the largest payload), with slack."""
    need = max(c.get_nvl_buffer_size_hint(hidden * 2, num_ranks) for c in configs)
    return need + (2 << 20)


def _cfg_fields(cfg: Optional[Config]) -> Dict[str, Any]:
    if cfg is None:
        return {"num_sms": None, "send_chunk": None, "recv_chunk": None}
    return {"num_sms": cfg.num_sms, "send_chunk": cfg.num_max_nvl_chunked_send_tokens,
            "recv_chunk": cfg.num_max_nvl_chunked_recv_tokens}


# ---------------------------------------------------------------------------------------------- workload
class Workload:
    """One routing at `tokens` per rank and its inputs (several copies, rotated so the L2 cannot serve them)."""

    def __init__(self, ctx: Context, buffer: Buffer, tokens: int, seed: int) -> None:
        o, dev = ctx.opts, ctx.device
        self.ctx, self.buffer, self.tokens = ctx, buffer, tokens
        self.hidden, self.num_experts, self.topk = o.hidden, o.num_experts, o.topk
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed * 1000 + ctx.rank)
        h = self.hidden
        scores = torch.randn(tokens, self.num_experts, device=dev, generator=gen).abs() + 1
        self.topk_idx = scores.topk(self.topk, dim=-1).indices.to(torch.int64)
        self.topk_weights = torch.randn(tokens, self.topk, device=dev, generator=gen).abs().float()
        self.layout = buffer.get_dispatch_layout(self.topk_idx, self.num_experts)[:4]
        n = rotation(tokens * h * 2, dev)
        self.xs = [torch.randn(tokens, h, device=dev, generator=gen).to(torch.bfloat16) for _ in range(n)]
        self.x8 = []
        for x in self.xs:
            q, s = per_token_cast_to_fp8(x)
            self.x8.append((q.contiguous(), s.contiguous()))
        self._gen = gen
        self.ys: List[torch.Tensor] = []
        self.recv_rows = -1

    def fresh(self, cfg: Optional[Config], x=None):
        """Fresh dispatch along the routing; returns (recv_x, handle)."""
        n_rank, _, n_expert, in_rank = self.layout
        recv_x, _, _, _, handle, _ = self.buffer.dispatch(
            self.xs[0] if x is None else x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=n_expert, topk_idx=self.topk_idx, topk_weights=self.topk_weights, config=cfg)
        return recv_x, handle

    def learn(self, recv_x: torch.Tensor, handle) -> None:
        """Row counts of the exchange (host copies, outside any timing) and the combine inputs."""
        r, me = self.ctx.num_ranks, self.ctx.rank
        m = handle.rank_prefix_matrix.detach().cpu().to(torch.int64)
        per_src = torch.cat([m[:1], m[1:] - m[:-1]], dim=0)  # [i][j] rows rank i sends to rank j
        self.send_counts = [int(v) for v in per_src[me].tolist()]
        self.recv_counts = [int(v) for v in per_src[:, me].tolist()]
        self.recv_rows = int(recv_x.shape[0])  # the formula's recv_x.numel() * 2 is recv_rows * H * 2
        if self.recv_rows != sum(self.recv_counts):
            raise RuntimeError(f"rank {me}: recv_x has {self.recv_rows} rows but the handle's rank_prefix_matrix "
                               f"says {sum(self.recv_counts)}")
        self.self_rows = self.recv_counts[me]
        self.send_rows = sum(self.send_counts)
        assert r == len(self.send_counts)
        h, dev = self.hidden, self.ctx.device
        n = rotation(self.recv_rows * h * 2, dev)
        self.ys = [torch.randn(self.recv_rows, h, device=dev, generator=self._gen).to(torch.bfloat16)
                   for _ in range(n)]
        if getattr(self.buffer, "num_pool_bytes", 0):  # combine inputs in the peer pool: the pull combine
            try:
                pool = self.buffer.peer_pool
            except RuntimeError:  # not a compiled backend with a pool (intranode, or internode over its domain)
                pool = None
            if pool is not None:
                try:
                    self.ys = [pool.allocate(tuple(y.shape), y.dtype).copy_(y) for y in self.ys]
                except torch.OutOfMemoryError:  # PeerPoolExhausted: the combines take the ring (counted below)
                    self.ctx.say(f"  note: the combine inputs do not fit the peer pool ({self.buffer.num_pool_bytes} "
                                 f"bytes): combine runs on the ring")

    # byte counts of this rank (bench/README.md)
    def bytes_bf16(self) -> Tuple[float, float]:
        row = self.hidden * 2
        return self.recv_rows * row, (self.recv_rows - self.self_rows) * row

    def bytes_fp8(self) -> Tuple[float, float]:
        logical, physical = self.bytes_bf16()
        f = (1 + 4 / 128) / 2
        return logical * f, physical * f

    def fields(self) -> Dict[str, Any]:
        return {"tokens": self.tokens, "hidden": self.hidden, "num_experts": self.num_experts, "topk": self.topk}


# ------------------------------------------------------------------------------------------- baselines
def nccl_baselines(ctx: Context, w: Workload, iters: int, warmup: int) -> Dict[str, Dict[str, Any]]:
    """all_to_all_single of exactly the rows our dispatch (BF16, FP8 payload + scales) and combine move."""
    dev, h, g = ctx.device, w.hidden, ctx.group
    out: Dict[str, Dict[str, Any]] = {}
    gen = w._gen
    n = rotation(w.send_rows * h * 2, dev)
    send_bf16 = [torch.randn(w.send_rows, h, device=dev, generator=gen).to(torch.bfloat16) for _ in range(n)]
    fp8_row = h + h // 128 * 4
    send_fp8 = [torch.randint(0, 256, (w.send_rows, fp8_row), device=dev, dtype=torch.uint8, generator=gen)
                for _ in range(n)]

    def a2a(inputs, rows_out, width, dtype, out_splits, in_splits):
        def fn(i):
            o = torch.empty(rows_out, width, dtype=dtype, device=dev)
            dist.all_to_all_single(o, inputs[i % len(inputs)], out_splits, in_splits, group=g)
        return fn

    base = {"section": "nccl", **w.fields(), "backend": "nccl"}
    cases = [
        ("dispatch-bf16", a2a(send_bf16, w.recv_rows, h, torch.bfloat16, w.recv_counts, w.send_counts),
         w.bytes_bf16()),
        ("dispatch-fp8", a2a(send_fp8, w.recv_rows, fp8_row, torch.uint8, w.recv_counts, w.send_counts),
         w.bytes_fp8()),
        ("combine-bf16", a2a(w.ys, w.send_rows, h, torch.bfloat16, w.send_counts, w.recv_counts), w.bytes_bf16()),
    ]
    for name, fn, (logical, physical) in cases:
        times = time_calls(fn, iters, warmup, dev, g)
        rec = make_record(ctx, {**base, "op": f"nccl-a2a {name}"}, times, logical, physical)
        out[name] = rec
    del send_bf16, send_fp8
    return out


def naive_dispatch(ctx: Context, w: Workload, iters: int, warmup: int) -> Dict[str, Any]:
    """What a MoE layer does without a dispatcher: find each token's destination ranks, gather the rows by
    destination, exchange the counts (all_to_all), bring them to the host, then all_to_all_single the rows."""
    dev, g, r = ctx.device, ctx.group, ctx.num_ranks
    local = w.num_experts // r

    def fn(i):
        x = w.xs[i % len(w.xs)]
        t = x.shape[0]
        hit = torch.zeros(t, r, dtype=torch.bool, device=dev)
        hit.scatter_(1, w.topk_idx // local, True)
        order = hit.t().nonzero(as_tuple=True)[1]
        send = x.index_select(0, order)
        counts = hit.sum(0, dtype=torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=g)
        rc, sc = recv_counts.tolist(), counts.tolist()
        o = torch.empty(sum(rc), x.shape[1], dtype=x.dtype, device=dev)
        dist.all_to_all_single(o, send, rc, sc, group=g)

    times = time_calls(fn, iters, warmup, dev, g)
    logical, physical = w.bytes_bf16()
    return make_record(ctx, {"section": "normal-extra", "op": "naive-nccl-dispatch", "dtype": "bf16", **w.fields(),
                             "backend": "nccl"}, times, logical, physical)


# ------------------------------------------------------------------------------------------------ run
def cached_cases(ctx: Context, w: Workload, handle, dcfg: Config, ccfg: Optional[Config], iters: int, warmup: int,
                 nccl: Optional[Dict[str, Dict[str, Any]]], section: str, tag: str) -> List[Dict[str, Any]]:
    dev, g, buf = ctx.device, ctx.group, w.buffer
    recs = []
    cases = [("dispatch", "bf16", dcfg, lambda i: buf.dispatch(w.xs[i % len(w.xs)], handle=handle, config=dcfg),
              w.bytes_bf16(), "dispatch-bf16"),
             ("dispatch", "fp8", dcfg, lambda i: buf.dispatch(w.x8[i % len(w.x8)], handle=handle, config=dcfg),
              w.bytes_fp8(), "dispatch-fp8")]
    if ccfg is not None:
        cases.append(("combine", "bf16", ccfg, lambda i: buf.combine(w.ys[i % len(w.ys)], handle, config=ccfg),
                      w.bytes_bf16(), "combine-bf16"))
    for op, dtype, cfg, fn, (logical, physical), key in cases:
        times = time_calls(fn, iters, warmup, dev, g)
        rec = make_record(ctx, {"section": section, "op": op, "dtype": dtype, **w.fields(), **_cfg_fields(cfg),
                                "config": tag, "backend": handle.backend}, times, logical, physical)
        attach_baseline(rec, (nccl or {}).get(key))
        if (w.tokens, w.hidden, w.num_experts, w.topk) == (4096, 7168, 256, 8) and ctx.num_ranks in TARGET_GBPS:
            rec["target_gbps"] = TARGET_GBPS[ctx.num_ranks][key]
            rec["deepep_v1_gbps"] = DEEPEP_GBPS[ctx.num_ranks][key]
        ctx.say(f"[{section}] {op:8s} {dtype:4s} T={w.tokens:<5d} sms={cfg.num_sms:<2d} chunks="
                f"{cfg.num_max_nvl_chunked_send_tokens}/{cfg.num_max_nvl_chunked_recv_tokens} ({tag}): "
                f"{fmt_rec(rec)}")
        recs.append(rec)
    return recs


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run(ctx: Context) -> None:
    o = ctx.opts
    r = ctx.num_ranks
    rows = sweep_configs(o, r)
    pd, pc = plot_config(o, r)
    configs = [d for _, d, _ in rows] + [c for _, _, c in rows if c is not None] + [pd, pc]
    buffer = Buffer(ctx.group, num_nvl_bytes=nvl_bytes(configs, o.hidden, r), backend=o.backend,
                    num_pool_bytes=o.num_pool_bytes)
    ctx.say(f"== normal mode: {r} ranks, T={o.tokens} H={o.hidden} top-{o.topk} of {o.num_experts} experts, "
            f"{o.iters} timed calls after {o.warmup} warm-up, {len(rows)} configs"
            + (f", peer pool {o.num_pool_bytes >> 20} MiB" if o.num_pool_bytes else ""))
    try:
        w = Workload(ctx, buffer, o.tokens, seed=1)
        recv_x, handle0 = w.fresh(rows[0][1])
        w.learn(recv_x, handle0)
        del recv_x
        backend = handle0.backend
        ctx.say(f"  backend: {backend}" + ("" if backend != "reference" else
                                          f" (compiled kernels not used: {buffer._kernels_why})"))
        if backend == "reference" and ctx.device.type == "cuda":
            ctx.note("the reference backend ignores Config: the num_sms / chunk rows time the same code")
        ctx.say(f"  rank {ctx.rank}: sends {w.send_rows} rows, receives {w.recv_rows} ({w.self_rows} from itself)")
        nccl = nccl_baselines(ctx, w, o.iters, o.warmup)
        for key, rec in nccl.items():
            ctx.say(f"[nccl] all_to_all_single {key:13s} T={w.tokens}: {fmt_rec(rec)}")
        ctx.records.extend(nccl.values())
        del handle0
        for tag, dcfg, ccfg in rows:
            try:
                _, handle = w.fresh(dcfg)
                ctx.records.extend(cached_cases(ctx, w, handle, dcfg, ccfg, o.iters, o.warmup, nccl, "normal", tag))
                del handle
            except (ValueError, RuntimeError, NotImplementedError) as exc:
                ctx.note(f"config sms={dcfg.num_sms} chunks={dcfg.num_max_nvl_chunked_send_tokens}/"
                         f"{dcfg.num_max_nvl_chunked_recv_tokens} failed: {type(exc).__name__}: {exc}")
        extras(ctx, w, pd, pc)
        del w
        _release(ctx.device)
        counters = getattr(getattr(buffer, "_kernels", None), "_ipc", None)
        if o.num_pool_bytes and hasattr(counters, "path_counters"):
            direct, missed, pulls, pulls_missed = counters.path_counters()
            ctx.say(f"  peer pool: {direct - missed} of {direct} dispatches direct, {pulls - pulls_missed} of {pulls} "
                    f"combines pulled (the rest moved by the ring kernels)")
        if o.plot_sweep:
            token_sweep(ctx, buffer, pd, pc)
    finally:
        _release(ctx.device)
        buffer.destroy()


def extras(ctx: Context, w: Workload, dcfg: Config, ccfg: Config) -> None:
    o, dev, g, buf = ctx.opts, ctx.device, ctx.group, w.buffer
    rec = naive_dispatch(ctx, w, o.iters, o.warmup)
    ctx.say(f"[extra] naive NCCL MoE dispatch bf16 (gather by rank, count all-to-all, host sync, "
            f"all_to_all_single): {fmt_rec(rec)}")
    ctx.records.append(rec)

    logical, physical = w.bytes_bf16()
    fields = {"section": "normal-extra", "dtype": "bf16", **w.fields(), **_cfg_fields(dcfg)}
    times = time_calls(lambda i: w.fresh(dcfg, w.xs[i % len(w.xs)]), o.iters, o.warmup, dev, g)
    _, handle = w.fresh(dcfg)
    rec = make_record(ctx, {**fields, "op": "fresh-dispatch", "backend": handle.backend}, times, logical, physical)
    ctx.say(f"[extra] fresh dispatch bf16 (layout given; notify + host wait + dispatch): {fmt_rec(rec)}")
    ctx.records.append(rec)

    times = time_calls(lambda i: buf.get_dispatch_layout(w.topk_idx, w.num_experts), o.iters, o.warmup, dev, g)
    rec = make_record(ctx, {**fields, "dtype": None, "op": "layout", "backend": handle.backend}, times, 0)
    ctx.say(f"[extra] get_dispatch_layout: {rec['t_us']['mean']:.1f} us")
    ctx.records.append(rec)

    for op, fn in (("host-overhead dispatch", lambda i: buf.dispatch(w.xs[i % len(w.xs)], handle=handle, config=dcfg)),
                   ("host-overhead combine", lambda i: buf.combine(w.ys[i % len(w.ys)], handle, config=ccfg))):
        times = host_overhead(fn, o.iters, o.warmup, dev, g)
        rec = make_record(ctx, {**fields, "op": op, "backend": handle.backend, "unit": "cpu"}, times, 0)
        ctx.say(f"[extra] {op} (cached, CPU time per call): mean {rec['t_us']['mean']:.1f} us, median "
                f"{rec['t_us_median']['mean']:.1f} us (ranks max {rec['t_us']['max']:.1f}; target < 15 us)")
        ctx.records.append(rec)
    if handle.backend == "reference":
        ctx.note("host overhead on the reference backend includes its host syncs (it is not the kernels' figure)")


def token_sweep(ctx: Context, buffer: Buffer, dcfg: Config, ccfg: Config) -> None:
    o = ctx.opts
    ctx.say(f"== tokens-per-rank sweep {list(o.tokens_sweep)} at sms={dcfg.num_sms}")
    for i, tokens in enumerate(o.tokens_sweep):
        w = Workload(ctx, buffer, tokens, seed=10 + i)
        recv_x, handle = w.fresh(dcfg)
        w.learn(recv_x, handle)
        del recv_x
        nccl = nccl_baselines(ctx, w, o.iters, o.warmup)
        for rec in nccl.values():
            rec["section"] = "tokens-nccl"
        ctx.records.extend(nccl.values())
        ctx.records.extend(cached_cases(ctx, w, handle, dcfg, ccfg if _combine_ok(ccfg) else None, o.iters,
                                        o.warmup, nccl, "tokens", "tuned"))
        del w, handle
        _release(ctx.device)
