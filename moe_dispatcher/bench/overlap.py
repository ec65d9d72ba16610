"""Overlap mode: BF16 GEMMs on one stream beside cached dispatch + combine rounds on another
(`python -m moe_dispatcher.bench --mode overlap`).

What runs, per rank (the standard shape unless --tokens/--hidden/--num-experts/--topk say otherwise):
  GEMMs: --rounds matmuls of BF16 [N, N] x [N, N] (N = --gemm-size, 8192), written into one output, on the
    current stream at its priority, as a Megatron-Core training step runs its expert and attention GEMMs;
  exchange: --rounds rounds of one cached BF16 dispatch and one BF16 combine along a handle made once per SM
    count (ours: a Buffer at Config(num_sms, tuned chunks) for every --num-sms and the default choice,
    config.default_num_sms), called as Megatron-Core's flex dispatcher calls DeepEP: previous_event = the
    launching stream's work so far, async_finish=True, allocate_on_comm_stream=True, then the launching stream
    waits for the returned event. The exchange is issued from its own stream, made at the highest priority as
    Megatron-Core makes its EP-overlap communication stream with high_priority_a2a_comm_stream; our kernels run
    on the Buffer's comm stream (high priority, as DeepEP V1's);
  NCCL: the same rounds as all_to_all_single of exactly the rows dispatch and combine move, from the same
    launching stream, over an NCCL group whose internal stream is high priority (is_high_priority_stream).
Launch order (together): round by round the exchange is issued before its GEMM, as Megatron-Core's combined
1F1B schedule issues a communication node before the computation it hides.
SMs left to the exchange: cuBLAS's GEMMs are persistent (a grid of one CTA per SM), so a kernel launched beside
one waits for a GEMM to end before it gets an SM, whatever its stream's priority. Each "ours, s SMs" row therefore
runs its GEMMs with an SM carveout of s (torch._C._set_sm_carveout_experimental: cuBLAS targets the other SMs), so
the exchange's SMs are free whenever it launches; the GEMMs alone at that carveout are timed too. One row,
"no carveout", runs ours at the default count beside uncarved GEMMs, for contrast; NCCL runs beside uncarved GEMMs.

Timing: CUDA events around the whole batch (alone: GEMMs; alone: exchange; together: from one start event that
both streams wait on to each stream's last event), after a device synchronize and a group barrier. Each
measurement runs --repeats times after one warm-up; the figures are means over repeats and ranks.
Efficiency = (GEMM alone + exchange alone) / together (2.0: equal times, the exchange hidden entirely; 1.0: not
at all); GEMM slowdown = GEMMs' span together / GEMMs alone - 1, both against the uncarved GEMMs alone. Two more
figures say what the efficiency can mean for a row: its bound, (GEMM alone + exchange alone) / max(the GEMMs alone
as they ran beside it (carved for ours), exchange alone), the efficiency of a perfect overlap of these two times
(below 2.0 whenever they differ: an exchange much faster than the GEMMs cannot reach 1.8), and the share hidden,
(GEMM alone + exchange alone - together) / the shorter of the two (1.0: the shorter one hidden entirely, 0: run
one after the other). On a CPU (gloo, reference backend) nothing runs concurrently: the mode runs its structure,
and its figures are not overlap figures.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..config import Config, smallest_at_ceiling, default_num_sms, get_combine_config, get_dispatch_config
from ..topology import Topology
from .common import Context, make_record
from .normal import Workload, nvl_bytes
from .timing import barrier, sync

SECTION = "overlap"
STREAMS_NOTE = ("streams: GEMMs on the current stream (priority {gemm}); the exchange issued from a stream of priority "
                "{launch} (the highest, as Megatron-Core's EP-overlap communication stream with "
                "high_priority_a2a_comm_stream); our kernels on the Buffer's comm stream (priority {comm}); NCCL on "
                "its group's internal stream ({nccl}). Launch order: round by round, the exchange (dispatch then "
                "combine) before its GEMM")


# ------------------------------------------------------------------------------------------------ workloads
class Gemms:
    """`rounds` BF16 matmuls [n, n] x [n, n] into one preallocated output (no allocation while timed)."""

    def __init__(self, n: int, device: torch.device, seed: int) -> None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU BF16 matmul is emulated: slow
        self.a = torch.randn(n, n, device=device, generator=gen).to(dtype)
        self.b = torch.randn(n, n, device=device, generator=gen).to(dtype)
        self.c = torch.empty(n, n, device=device, dtype=dtype)
        self.flops = 2.0 * n ** 3

        self.carveout: Optional[int] = None  # SMs the GEMMs leave free (None: all SMs)

    def __call__(self, i: int) -> None:
        if self.carveout is None:
            torch.mm(self.a, self.b, out=self.c)
            return
        # cuBLAS honours a carveout only through cuBLASLt (measured on H100: cuBLAS's plain GEMM kept ~all SMs).
        backend = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(self.carveout)
        try:
            torch.mm(self.a, self.b, out=self.c)
        finally:
            torch._C._set_sm_carveout_experimental(None)
            torch.backends.cuda.preferred_blas_library(backend)


def ours_round(buffer: Buffer, w: Workload, handle, dcfg: Config, ccfg: Config) -> Callable[[int], None]:
    """One cached BF16 dispatch + combine, called as Megatron-Core's flex dispatcher calls DeepEP V1."""
    def fn(i: int) -> None:
        _, _, _, _, _, done = buffer.dispatch(w.xs[i % len(w.xs)], handle=handle, config=dcfg,
                                              previous_event=Buffer.capture(), async_finish=True,
                                              allocate_on_comm_stream=True)
        done.current_stream_wait()
        _, _, done = buffer.combine(w.ys[i % len(w.ys)], handle, config=ccfg, previous_event=Buffer.capture(),
                                    async_finish=True, allocate_on_comm_stream=True)
        done.current_stream_wait()
    return fn


def nccl_round(ctx: Context, w: Workload, group) -> Callable[[int], None]:
    """all_to_all_single of the rows a dispatch moves, then of the rows its combine moves back."""
    dev, h = ctx.device, w.hidden
    gen = torch.Generator(device=dev)
    gen.manual_seed(99 + ctx.rank)
    send = torch.randn(w.send_rows, h, device=dev, generator=gen).to(torch.bfloat16)
    recv = torch.empty(w.recv_rows, h, device=dev, dtype=torch.bfloat16)
    back = torch.empty(w.send_rows, h, device=dev, dtype=torch.bfloat16)

    def fn(i: int) -> None:
        dist.all_to_all_single(recv, send, w.recv_counts, w.send_counts, group=group)
        dist.all_to_all_single(back, w.ys[i % len(w.ys)], w.send_counts, w.recv_counts, group=group)
    return fn


# ------------------------------------------------------------------------------------------------ timing
class Streams:
    """The compute stream (current) and the stream the exchange is issued from; CPU: none."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.compute = torch.cuda.current_stream(device) if self.cuda else None
        self.launch = None
        if self.cuda:
            _, high = torch.cuda.Stream.priority_range()
            self.launch = torch.cuda.Stream(device=device, priority=high)


def _span(streams: Streams, start_on, work: List[Tuple[Any, Callable[[int], None]]], rounds: int) -> List[float]:
    """Seconds from one start event (recorded on `start_on`, waited on by every stream of `work`) to the last
    event of each stream of `work`; work = [(stream, fn)], round i issues fn(i) of each in list order."""
    if not streams.cuda:
        t0 = time.perf_counter()
        for i in range(rounds):
            for _, fn in work:
                fn(i)
        return [time.perf_counter() - t0] * len(work)
    start = torch.cuda.Event(enable_timing=True)
    start.record(start_on)
    for stream, _ in work:
        stream.wait_event(start)
    for i in range(rounds):
        for stream, fn in work:
            with torch.cuda.stream(stream):
                fn(i)
    ends = []
    for stream, _ in work:
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        ends.append(e)
    for e in ends:
        e.synchronize()
    return [start.elapsed_time(e) * 1e-3 for e in ends]


def measure(ctx: Context, streams: Streams, work: List[Tuple[Any, Callable[[int], None]]], rounds: int,
            repeats: int) -> List[List[float]]:
    """[stream of work][repeat] seconds, after one warm-up of a few rounds; every repeat starts after a
    device synchronize and a group barrier."""
    _span(streams, streams.compute, work, min(rounds, 4))
    out: List[List[float]] = [[] for _ in work]
    for _ in range(repeats):
        barrier(ctx.device, ctx.group)
        for k, t in enumerate(_span(streams, streams.compute, work, rounds)):
            out[k].append(t)
    sync(ctx.device)
    return out


# ------------------------------------------------------------------------------------------------ run
def sm_counts(ctx: Context, topology: Topology) -> Tuple[List[int], int]:
    """The SM counts to run (--num-sms and the default choice, ascending) and the default choice."""
    o = ctx.opts
    default = default_num_sms(ctx.num_ranks, topology.is_single_domain, o.hidden * 2, o.tokens,
                              direct=o.num_pool_bytes > 0)
    return sorted(set(o.num_sms) | {default}), default


def nccl_group(ctx: Context):
    """An NCCL group of every rank whose internal stream is high priority (the process group elsewhere)."""
    if str(dist.get_backend(ctx.group)) != "nccl":
        return ctx.group
    try:
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
    except (AttributeError, RuntimeError) as exc:  # the same outcome on every rank: no group is made anywhere
        ctx.note(f"NCCL runs on the process group's own stream: no high-priority options ({type(exc).__name__})")
        return ctx.group
    return dist.new_group(list(range(ctx.num_ranks)), backend="nccl", pg_options=options)


def run(ctx: Context) -> None:
    o, r = ctx.opts, ctx.num_ranks
    counts, default = sm_counts(ctx, Topology.from_group(ctx.group))
    configs = [(s, get_dispatch_config(r, s), get_combine_config(r, s)) for s in counts]
    buffer = Buffer(ctx.group, num_nvl_bytes=nvl_bytes([c for _, d, cc in configs for c in (d, cc)], o.hidden, r),
                    backend=o.backend, num_pool_bytes=o.num_pool_bytes)
    dtype = "BF16" if ctx.device.type == "cuda" else "FP32 on the CPU"
    ctx.say(f"== overlap mode: {r} ranks, {o.rounds} GEMMs of {o.gemm_size}^3 ({dtype}) beside {o.rounds} cached "
            f"BF16 dispatch+combine rounds (T={o.tokens} H={o.hidden} top-{o.topk} of {o.num_experts}), SMs {counts} "
            f"(default choice {default}), {o.repeats} repeats after a warm-up"
            + (f", peer pool {o.num_pool_bytes >> 20} MiB" if o.num_pool_bytes else ""))
    group = None
    try:
        group = nccl_group(ctx)
        _run(ctx, buffer, configs, default, group)
    finally:
        sync(ctx.device)
        if group is not None and group is not ctx.group:
            dist.destroy_process_group(group)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        buffer.destroy()


def _record(ctx: Context, fields: Dict[str, Any], times: List[float], nbytes: float) -> Dict[str, Any]:
    rec = make_record(ctx, {"section": SECTION, **fields}, times, nbytes)
    ctx.records.append(rec)
    return rec


def _summary(ctx: Context, impl: str, sms: Optional[int], carveout: Optional[int], gemm: Dict, carved: Optional[Dict],
             exch: Dict, span: Dict, gemm_span: Dict, exch_span: Dict, is_default: bool, rounds: int) -> Dict[str, Any]:
    g, e, t = gemm["t_us"]["mean"], exch["t_us"]["mean"], span["t_us"]["mean"]
    beside = carved["t_us"]["mean"] if carved is not None else g  # the GEMMs alone as they ran beside the exchange
    s = {"section": "overlap-summary", "impl": impl, "num_sms": sms, "carveout": carveout,
         "default": is_default,
         "gemm_us": g, "gemm_carved_us": carved["t_us"]["mean"] if carved is not None else None,
         "exchange_us": e, "together_us": t, "gemm_together_us": gemm_span["t_us"]["mean"],
         "exchange_together_us": exch_span["t_us"]["mean"], "round_us": e / rounds,
         "efficiency": (g + e) / t if t > 0 else float("nan"),
         "efficiency_bound": ((g + e) / max(beside, e)) if max(beside, e) > 0 else float("nan"),
         "hidden": (g + e - t) / min(g, e) if min(g, e) > 0 else float("nan"),
         "gemm_slowdown": gemm_span["t_us"]["mean"] / g - 1 if g > 0 else float("nan"),
         "together_ranks_us": [span["t_us"]["min"], span["t_us"]["max"]]}
    ctx.records.append(s)
    if impl == "ours":
        label = f"ours {sms:2d} SMs{' (default)' if s['default'] else ''}{'' if carveout else ', no carveout'}"
    else:
        label = "NCCL a2a"
    gemm_text = f"GEMMs {g / 1e3:7.2f} ms" + (f" ({s['gemm_carved_us'] / 1e3:.2f} carved)" if carved else "")
    ctx.say(f"[{SECTION}] {label:32s}: {gemm_text}, exchange {e / 1e3:7.2f} ms, together {t / 1e3:7.2f} ms -> "
            f"efficiency {s['efficiency']:.2f} (bound {s['efficiency_bound']:.2f}, {100 * s['hidden']:.0f}% of the "
            f"shorter hidden), GEMM slowdown {100 * s['gemm_slowdown']:+.1f}%")
    return s


def _run(ctx: Context, buffer: Buffer, configs, default: int, group) -> None:
    o, dev = ctx.opts, ctx.device
    streams = Streams(dev)
    gemms = Gemms(o.gemm_size, dev, seed=5 + ctx.rank)
    w = Workload(ctx, buffer, o.tokens, seed=1)
    recv_x, handle0 = w.fresh(configs[0][1])
    w.learn(recv_x, handle0)
    backend = handle0.backend
    del recv_x, handle0
    logical, _ = w.bytes_bf16()
    round_bytes = 2 * logical * o.rounds
    base = {**w.fields(), "rounds": o.rounds, "gemm_size": o.gemm_size}
    if streams.cuda:
        note = STREAMS_NOTE.format(gemm=streams.compute.priority, launch=streams.launch.priority,
                                   comm=buffer.get_comm_stream().priority,
                                   nccl="is_high_priority_stream" if group is not ctx.group else "default")
    else:
        note = "CPU: one thread runs the GEMMs and the exchange in turn, so nothing overlaps (structure only)"
    ctx.note(note)
    compute, launch = streams.compute, streams.launch

    (g_times,) = measure(ctx, streams, [(compute, gemms)], o.rounds, o.repeats)
    gemm = _record(ctx, {**base, "op": "gemm alone", "impl": "torch.mm", "backend": None}, g_times, 0)
    tflops = gemms.flops * o.rounds / (gemm["t_us"]["mean"] * 1e-6) / 1e12
    ctx.say(f"[{SECTION}] GEMMs alone: {gemm['t_us']['mean'] / 1e3:.2f} ms ({tflops:.0f} TFLOP/s)")

    # (impl, SMs, one round, backend, the GEMMs' carveout)
    rows: List[Tuple[str, Optional[int], Callable[[int], None], str, Optional[int]]] = [
        ("nccl", None, nccl_round(ctx, w, group), "nccl", None)]
    handles = []
    for sms, dcfg, ccfg in configs:
        _, handle = w.fresh(dcfg)
        handles.append(handle)
        fn = ours_round(buffer, w, handle, dcfg, ccfg)
        rows.append(("ours", sms, fn, handle.backend, sms if streams.cuda else None))
        if sms == default and streams.cuda:
            rows.append(("ours", sms, fn, handle.backend, None))
    for impl, sms, fn, used, carveout in rows:
        fields = {**base, "impl": impl, "num_sms": sms, "backend": used, "carveout": carveout}
        carved = None
        gemms.carveout = carveout
        try:
            if carveout is not None:
                (c_times,) = measure(ctx, streams, [(compute, gemms)], o.rounds, o.repeats)
                carved = _record(ctx, {**base, "op": "gemm alone", "impl": "torch.mm", "backend": None,
                                       "carveout": carveout}, c_times, 0)
            (e_times,) = measure(ctx, streams, [(launch, fn)], o.rounds, o.repeats)
            exch = _record(ctx, {**fields, "op": "exchange alone"}, e_times, round_bytes)
            e_span, g_span = measure(ctx, streams, [(launch, fn), (compute, gemms)], o.rounds, o.repeats)
        finally:
            gemms.carveout = None
        t_span = [max(a, b) for a, b in zip(e_span, g_span)]
        span = _record(ctx, {**fields, "op": "together"}, t_span, round_bytes)
        gs = _record(ctx, {**fields, "op": "gemm in together"}, g_span, 0)
        es = _record(ctx, {**fields, "op": "exchange in together"}, e_span, round_bytes)
        # The default row the goal reads: ours at the default count with its carveout (on a CPU, the only one).
        is_default = impl == "ours" and sms == default and (carveout is not None or not streams.cuda)
        _summary(ctx, impl, sms, carveout, gemm, carved, exch, span, gs, es, is_default, o.rounds)
    del handles
    if backend == "reference" and dev.type == "cuda":
        ctx.note("the reference backend ignores Config: the SM-count rows time the same code")
    _rule_point(ctx, buffer, default)


def _rule_point(ctx: Context, buffer: Buffer, default: int) -> None:
    """The NUM_SMS_SWEEPS entry this run measured (exchange alone per round, by SM count), and what the rule
    would choose from it."""
    o = ctx.opts
    rows = [s for s in ctx.records if s.get("section") == "overlap-summary" and s["impl"] == "ours"]
    carved = {s["num_sms"] for s in rows if s["carveout"]}  # the uncarved contrast row repeats its count
    ours = {s["num_sms"]: round(s["round_us"]) for s in rows if s["carveout"] or s["num_sms"] not in carved}
    if len(ours) < 2:
        return
    key = (ctx.num_ranks, buffer.topology.is_single_domain)
    pick = smallest_at_ceiling(ours)
    table = "NUM_SMS_SWEEPS_DIRECT" if o.num_pool_bytes else "NUM_SMS_SWEEPS"
    ctx.note(f"num_sms rule point (config.{table}): {key}: {{{o.tokens} * {o.hidden * 2}: {ours}}}; the rule "
             f"would choose {pick} from it (the table's choice now: {default})")
