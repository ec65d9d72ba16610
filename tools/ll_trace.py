"""Where the time of the low-latency kernels goes: phase timelines from the kernels' own %globaltimer stamps.

  torchrun --standalone --nproc_per_node 4 tools/ll_trace.py [--calls 30] [--warmup 10] [--experts 256]
        [--tokens 128] [--hidden 7168] [--topk 8] [--bf16] [--out DIR]

Sets MOE_DISPATCHER_LL_TRACE=1 (docs/low_latency.md, "Phase trace"), builds a low-latency Buffer on the compiled
kernels with the bench's shape and routing (moe_dispatcher/bench/low_latency.py: T=128, H=7168, top-8 of E, FP8
dispatch), and runs four modes (--modes), each `--calls` timed iterations after `--warmup`:
  eager d+c   dispatch then combine from Python, back to back (no host sync inside the loop);
  eager d+d   two dispatches from Python (the bench's eager "dispatch" figure: is the GPU waiting on the host?);
  graph d+c   one CUDA graph holding dispatch + combine (the bench's "dispatch+combine graph");
  graph d+d   one CUDA graph holding two dispatches (the bench's "dispatch graph" replays two calls too).
After each iteration the whole device trace (every (kernel, buffer half) record) is copied into a history
buffer by one device-to-device copy on the same stream (no host sync; between iterations, never between the
calls of one iteration). Rank 0 gathers every rank's history and prints, per mode and call:

  * the phase timeline: for each event, min / median / max over (ranks x blocks) of its time relative to the
    EARLIEST kernel entry of that call over all ranks, as the median over iterations (column `worst` = the
    largest max of any iteration);
  * per-block phase durations (the difference of two events of the same block), same statistics;
  * per rank: first entry (entry skew across ranks), block-launch ramp (last - first block entry), kernel span
    (first entry -> last exit: compare with the bench's graph figures), and the gap between consecutive
    kernels of one iteration (exit of the last block of call k -> first entry of call k+1, same rank);
  * signals: per (source -> receiver) rank pair, the time from the sender publishing a count / flag to the
    receiver seeing it (cross-GPU: includes the clocks' offset, estimated below), when the last count / flag of
    each source is seen, and how often a signal was already there when the receiver first polled it;
  * the timer's granularity seen in the data, and the SMs the blocks ran on (one block per SM expected).

Host launch -> kernel entry cannot be measured this way (the host clock and %globaltimer are not related
here); the entry skew across ranks and the inter-kernel gaps stand in for it. Raw records and the summary go
to DIR (default $OUT or .): ll_trace_<R>gpu.pt (torch.save) and ll_trace_<R>gpu.txt.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
from collections.abc import Sequence

import torch

KINDS = ("dispatch", "combine")  # == moe_dispatcher.compiled.low_latency.TRACE_KINDS

# Per-block phase durations worth reading: (label, from event, to event).
DURATIONS = {
    "dispatch": [
        ("counting pass (entry -> counted)", "entry", "counted"),
        ("row loads + FP8 cast (counted -> cast_done)", "counted", "cast_done"),
        ("stores to peers issued (cast_done -> stores_issued)", "cast_done", "stores_issued"),
        ("fences + count signals / flags (stores_issued -> signaled)", "stores_issued", "signaled"),
        ("send phase (entry -> signaled)", "entry", "signaled"),
        ("wait for counts, 1st unit (recv_entry -> first_arrival)", "recv_entry", "first_arrival"),
        ("receive after 1st arrival (first_arrival -> copy_done)", "first_arrival", "copy_done"),
        ("last unit's copy (last_arrival -> copy_done)", "last_arrival", "copy_done"),
        ("tail: done counter + signal reset (copy_done -> exit)", "copy_done", "exit"),
        ("block lifetime (entry -> exit)", "entry", "exit"),
    ],
    "combine": [
        ("per-rank: routing of every source seen (entry -> routed)", "entry", "routed"),
        ("per-rank: partial rows stored (routed -> sends_issued)", "routed", "sends_issued"),
        ("row stores issued (entry -> sends_issued)", "entry", "sends_issued"),
        ("fence + atomic + flags (sends_issued -> flags_up)", "sends_issued", "flags_up"),
        ("wait for all flags (recv_entry -> wait_done)", "recv_entry", "wait_done"),
        ("weighted reduction (wait_done -> reduce_done)", "wait_done", "reduce_done"),
        ("block lifetime (entry -> exit)", "entry", "exit"),
    ],
}
ALREADY_THERE_NS = 300  # seen - wait below this: the signal was there when first polled (an upper bound)


def _med(v: Sequence[float]) -> float:
    return statistics.median(v) if v else float("nan")


def _mmm(v: Sequence[float]) -> tuple[float, float, float]:
    return (min(v), _med(v), max(v)) if v else (float("nan"),) * 3


def _fmt(x: float) -> str:
    return "     -" if math.isnan(x) else f"{x:6.1f}"


def parse(words: torch.Tensor, kind: str, meta: dict) -> dict:
    """One record (CPU int64 [words]); the same layout as moe_dispatcher.compiled.low_latency.parse_trace_record
    (repeated here so that the analysis runs without the package's GPU pieces)."""
    b, ev, e = meta["num_blocks"], meta["events_per_block"], meta["num_experts"]
    rows = words[: meta["pair_sent"]].view(-1, ev)[:b]
    return {"events": {name: rows[:, i].tolist() for name, i in meta["events"][kind].items()},
            "smid": rows[:, meta["smid"]].tolist(),
            "sent": words[meta["pair_sent"]: meta["pair_sent"] + e].tolist(),
            "wait": words[meta["pair_wait"]: meta["pair_wait"] + e].tolist(),
            "seen": words[meta["pair_seen"]: meta["pair_seen"] + e].tolist()}


def _table(title: str, rows: dict[str, list[tuple[float, float, float]]]) -> list[str]:
    """rows: label -> per-iteration (min, median, max) -> one line of medians over iterations + worst max."""
    out = [f"    {title:<60s}    min    med    max  worst"]
    for label, per_it in rows.items():
        per_it = [t for t in per_it if not math.isnan(t[0])]
        if not per_it:
            out.append(f"    {label:<60s}      -      -      -      -   (never reached)")
            continue
        out.append(f"    {label:<60s} {_fmt(_med([t[0] for t in per_it]))} {_fmt(_med([t[1] for t in per_it]))} "
                   f"{_fmt(_med([t[2] for t in per_it]))} {_fmt(max(t[2] for t in per_it))}")
    return out


def _signal_pairs(kind: str, recs: list[dict], meta: dict) -> list[tuple[int, int, int, int, int]]:
    """(source rank, receiver rank, sent ns on source, wait ns on receiver, seen ns on receiver) of every count
    (dispatch) or flag (combine) of one call, from the records of all ranks (recs[rank])."""
    R, E = meta["num_ranks"], meta["num_experts"]
    L = E // R
    out = []
    for r in range(R):  # receiver
        for idx in range(E):
            if kind == "dispatch":  # receiver word p = l*R + s; sender word: global expert r*L + l
                l, s = divmod(idx, R)
                sent = recs[s]["sent"][r * L + l]
            else:  # receiver word e (expert e lives on rank e // L); sender word: l*R + r
                s, l = divmod(idx, L)
                sent = recs[s]["sent"][l * R + r]
            out.append((s, r, sent, recs[r]["wait"][idx], recs[r]["seen"][idx]))
    return out


def summarize(mode: str, calls: Sequence[tuple[str, int]], data: torch.Tensor, meta: dict) -> list[str]:
    """data: int64 [R, N, kinds, 2, words] (every rank's copy of the whole trace after each of N iterations);
    calls: the (kind, half) launched in each iteration, in order. Returns the report's lines."""
    R, N = data.shape[0], data.shape[1]
    lines = [f"== {mode}: {R} ranks, {meta['num_blocks']} blocks, {N} iterations, calls "
             + " + ".join(f"{k}(half {h})" for k, h in calls)
             + "; us; median over iterations of (min / median / max over ranks x blocks); worst = largest max"]
    # recs[i][c][r]: parsed record of call c of iteration i on rank r
    recs = [[[parse(data[r, i, KINDS.index(k), h], k, meta) for r in range(R)] for k, h in calls] for i in range(N)]

    # timer granularity: smallest positive step between distinct stamps of one rank and iteration
    steps = []
    for i in range(min(N, 5)):
        for r in range(R):
            ts = sorted({t for c in range(len(calls)) for v in recs[i][c][r]["events"].values() for t in v if t > 0})
            steps += [b - a for a, b in itertools.pairwise(ts) if b > a]
    if steps:
        lines.append(f"  %globaltimer: smallest step seen {min(steps)} ns (median step {int(_med(steps))} ns)")

    spans: dict[int, list[list[float]]] = {}
    for c, (kind, half) in enumerate(calls):
        ev_names = list(meta["events"][kind])
        entry = "entry"
        timeline: dict[str, list[tuple[float, float, float]]] = {n: [] for n in ev_names}
        durs: dict[str, list[tuple[float, float, float]]] = {d[0]: [] for d in DURATIONS[kind]}
        first_entry = [[] for _ in range(R)]
        ramp = [[] for _ in range(R)]
        span = [[] for _ in range(R)]
        sms_dup = 0
        for i in range(N):
            rr = recs[i][c]
            starts = [t for r in range(R) for t in rr[r]["events"][entry] if t > 0]
            if not starts:
                continue
            t0 = min(starts)
            for n in ev_names:
                timeline[n].append(_mmm([(t - t0) / 1e3 for r in range(R) for t in rr[r]["events"][n] if t > 0]))
            for label, a, b in DURATIONS[kind]:
                if a not in rr[0]["events"] or b not in rr[0]["events"]:  # an extension without these events
                    durs[label].append(_mmm([]))
                    continue
                v = [(tb - ta) / 1e3 for r in range(R) for ta, tb in zip(rr[r]["events"][a], rr[r]["events"][b])
                     if ta > 0 and tb > 0]
                durs[label].append(_mmm(v))
            for r in range(R):
                es = [t for t in rr[r]["events"][entry] if t > 0]
                xs = [t for t in rr[r]["events"]["exit"] if t > 0]
                if es:
                    first_entry[r].append((min(es) - t0) / 1e3)
                    ramp[r].append((max(es) - min(es)) / 1e3)
                if es and xs:
                    span[r].append((max(xs) - min(es)) / 1e3)
                sm = [s for s, e in zip(rr[r]["smid"], rr[r]["events"][entry]) if e > 0]
                sms_dup = max(sms_dup, len(sm) - len(set(sm)))
        spans[c] = span
        lines.append(f"  -- call {c}: {kind} (half {half})")
        lines += _table("timeline from the call's earliest entry (all ranks)", timeline)
        lines += _table("per-block phase durations", durs)
        lines.append("    per rank (median over iterations):  first entry | block-launch ramp | span entry->exit")
        for r in range(R):
            lines.append(f"      rank {r}: {_fmt(_med(first_entry[r]))} | {_fmt(_med(ramp[r]))} | "
                         f"{_fmt(_med(span[r]))}")
        skew = [max(v) - min(v) for v in zip(*first_entry)] if all(first_entry) else []
        lines.append(f"    entry skew across ranks (max - min first entry): median {_fmt(_med(skew))}, "
                     f"max {_fmt(max(skew) if skew else float('nan'))}; blocks sharing an SM: {sms_dup}")
        peer = meta.get("peer_bytes", {}).get(kind)
        if peer:  # egress: bytes to peers over (this rank's first entry -> its last block past the send)
            done = "signaled" if kind == "dispatch" else "flags_up"
            rates = []
            for r in range(R):
                per = []
                for i in range(N):
                    ev = recs[i][c][r]["events"]
                    es, ds = [t for t in ev["entry"] if t > 0], [t for t in ev[done] if t > 0]
                    if es and ds and max(ds) > min(es):
                        per.append((max(ds) - min(es)) / 1e3)
                us = _med(per)
                rates.append(f"r{r} {peer[r] / 1e6:.2f} MB / {us:.1f} us = {peer[r] / us / 1e3:.0f} GB/s")
            lines.append(f"    send egress to peers (first entry -> last {done}, per rank): " + "; ".join(rates))

        # signals
        lat: dict[tuple[int, int], list[float]] = {}
        last_src: dict[int, list[float]] = {s: [] for s in range(R)}
        already = total = 0
        for i in range(N):
            rr = recs[i][c]
            starts = [t for r in range(R) for t in rr[r]["events"][entry] if t > 0]
            if not starts:
                continue
            t0 = min(starts)
            per_src_last: dict[tuple[int, int], int] = {}
            for s, r, sent, wait, seen in _signal_pairs(kind, rr, meta):
                if seen <= 0:
                    continue
                total += 1
                already += int(wait > 0 and seen - wait < ALREADY_THERE_NS)
                if sent > 0:
                    lat.setdefault((s, r), []).append((seen - sent) / 1e3)
                per_src_last[(s, r)] = max(per_src_last.get((s, r), 0), seen)
            for (s, r), t in per_src_last.items():
                last_src[s].append((t - t0) / 1e3)
        what = "count" if kind == "dispatch" else "flag (receiver block 0)"
        lines.append(f"    signals: {what} published on the source -> seen on the receiver (us; cross-GPU includes "
                     f"the clock offset):")
        for (s, r), v in sorted(lat.items()):
            lo, md, hi = _mmm(v)
            lines.append(f"      {s} -> {r}: min {_fmt(lo)}  med {_fmt(md)}  max {_fmt(hi)}")
        # offsets: min latency a->b = offset(b - a) + d, b->a = -offset + d (d: one-way floor, assumed symmetric)
        for a in range(R):
            for b in range(a + 1, R):
                if (a, b) in lat and (b, a) in lat:
                    mab, mba = min(lat[(a, b)]), min(lat[(b, a)])
                    lines.append(f"      ranks {a},{b}: one-way floor ~{(mab + mba) / 2:.2f} us, clock offset "
                                 f"(rank {b} - rank {a}) ~{(mab - mba) / 2:+.2f} us")
        lines.append("    last " + what + " of each source seen, from the earliest entry (median over receivers and "
                     "iterations): " + ", ".join(f"src {s} {_fmt(_med(v)).strip()}" for s, v in last_src.items()))
        if total:
            lines.append(f"    already there when first polled: {100.0 * already / total:.0f}% of {total} "
                         f"(seen - wait < {ALREADY_THERE_NS} ns; then 'seen' is only an upper bound of arrival)")

    # gaps between consecutive calls of one iteration, per rank
    for c in range(1, len(calls)):
        gaps = [[] for _ in range(R)]
        for i in range(N):
            for r in range(R):
                prev = [t for t in recs[i][c - 1][r]["events"]["exit"] if t > 0]
                nxt = [t for t in recs[i][c][r]["events"]["entry"] if t > 0]
                if prev and nxt:
                    gaps[r].append((min(nxt) - max(prev)) / 1e3)
        lines.append(f"  gap call {c - 1} last exit -> call {c} first entry, per rank (median / max): "
                     + ", ".join(f"r{r} {_fmt(_med(g)).strip()}/{_fmt(max(g) if g else float('nan')).strip()}"
                                 for r, g in enumerate(gaps)))
    if len(calls) > 1:
        whole = []
        for i in range(N):
            for r in range(R):
                es = [t for t in recs[i][0][r]["events"]["entry"] if t > 0]
                xs = [t for t in recs[i][-1][r]["events"]["exit"] if t > 0]
                if es and xs:
                    whole.append((max(xs) - min(es)) / 1e3)
        lines.append(f"  iteration span on one rank (first entry of call 0 -> last exit of call {len(calls) - 1}): "
                     f"median {_fmt(_med(whole)).strip()}, max {_fmt(max(whole) if whole else float('nan')).strip()}")
    return lines


# ---------------------------------------------------------------------------------------------------- GPU run
def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--bf16", action="store_true", help="BF16 dispatch instead of FP8")
    ap.add_argument("--modes", default="eager,eager_dd,graph,graph_dd")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    o = ap.parse_args(argv)

    os.environ["MOE_DISPATCHER_LL_TRACE"] = "1"  # read when the Buffer's backend is created
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    from moe_dispatcher import Buffer

    t, h, k, e = o.tokens, o.hidden, o.topk, o.experts
    buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(t, h, world, e), low_latency_mode=True,
                 backend="kernels", explicitly_destroy=True)
    be = buf._kernels_ll
    if be is None or not be.tracing:
        raise SystemExit(f"low-latency kernels unavailable or tracing off: {getattr(buf, '_kernels_ll_why', '')}")
    meta = be.trace_meta(e)
    gen = torch.Generator(device=dev)
    gen.manual_seed(7000 + 97 * e + rank)  # the bench's routing
    scores = torch.randn(t, e, device=dev, generator=gen).abs() + 1
    idx = scores.topk(k, dim=-1).indices.to(torch.int64)
    w = torch.randn(t, k, device=dev, generator=gen).abs().float()
    x = torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16)
    y = torch.randn(e // world, world * t, h, device=dev, generator=gen).to(torch.bfloat16)
    fp8 = not o.bf16
    buf.clean_low_latency_buffer(t, h, e)
    # bytes each rank sends to peers: dispatch messages (header + payload (+ scales), 16-byte multiple) and
    # combine rows (2H), from the selections matrix sel[s][r] (source s chose experts of rank r)
    dest_counts = torch.bincount((idx[idx >= 0] // (e // world)).flatten(), minlength=world)
    all_counts = [torch.empty_like(dest_counts) for _ in range(world)]
    dist.all_gather(all_counts, dest_counts)
    sel = torch.stack(all_counts).cpu().tolist()
    msg = (16 + (h + h // 128 * 4 if fp8 else 2 * h) + 15) // 16 * 16
    if be.kernels_for(t, h, e).startswith("dedup"):  # one message per (token, rank it picks): body + picks, ~msg bytes
        dest = torch.where(idx >= 0, idx // (e // world), world)
        hits = torch.zeros(t, world + 1, dtype=torch.int64, device=dev).scatter_(1, dest, 1)[:, :world].sum(0)
        all_hits = [torch.empty_like(hits) for _ in range(world)]
        dist.all_gather(all_hits, hits)
        msgs = torch.stack(all_hits).cpu().tolist()
    else:
        msgs = sel
    meta["peer_bytes"] = {
        "dispatch": [msg * sum(msgs[s][r] for r in range(world) if r != s) for s in range(world)],
        "combine": [2 * h * sum(sel[s][r] for s in range(world) if s != r) for r in range(world)]}

    def last(kind: str) -> tuple[str, int]:
        return kind, be._trace_last[kind][0]

    def d_c() -> list[tuple[str, int]]:
        handle = buf.low_latency_dispatch(x, idx, t, e, use_fp8=fp8)[2]
        calls = [last("dispatch")]
        buf.low_latency_combine(y, idx, w, handle)
        return calls + [last("combine")]

    def d_d() -> list[tuple[str, int]]:
        buf.low_latency_dispatch(x, idx, t, e, use_fp8=fp8)
        calls = [last("dispatch")]
        buf.low_latency_dispatch(x, idx, t, e, use_fp8=fp8)
        return calls + [last("dispatch")]

    def run(step, replay=None) -> tuple[list[tuple[str, int]], torch.Tensor]:
        hist = torch.zeros((o.calls,) + tuple(be._trace.shape), dtype=torch.int64, device=dev)
        calls = None
        for _ in range(o.warmup):
            calls = replay() if replay else step()
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        for i in range(o.calls):
            c = replay() if replay else step()
            calls = calls or c
            hist[i].copy_(be._trace)  # after the iteration's calls: no copy between them
        torch.cuda.synchronize()
        return calls, hist

    results = {}
    for mode in o.modes.split(","):
        if mode in ("eager", "eager_dd"):
            results["eager d+c" if mode == "eager" else "eager d+d"] = run(d_c if mode == "eager" else d_d)
        elif mode in ("graph", "graph_dd"):
            body = d_c if mode == "graph" else d_d
            body()  # warm-up with the same shapes (no clean inside the capture)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                captured = body()
            torch.cuda.synchronize()

            def replay(g=g, captured=captured):
                g.replay()
                return captured
            results["graph d+c" if mode == "graph" else "graph d+d"] = run(None, replay)
            del g
        else:
            raise SystemExit(f"unknown mode {mode!r}")

    report: list[str] = []
    saved = {"meta": meta, "args": vars(o), "modes": {}}
    for name, (calls, hist) in results.items():
        parts = [torch.empty_like(hist) for _ in range(world)]
        dist.all_gather(parts, hist)
        if rank == 0:
            data = torch.stack([p.cpu() for p in parts])  # [R, N, kinds, 2, words]
            saved["modes"][name] = {"calls": calls, "data": data}
            report += summarize(name, calls, data, meta) + [""]
    if rank == 0:
        head = (f"# ll_trace: {world} ranks, T={t} H={h} top-{k} E={e} {'FP8' if fp8 else 'BF16'} dispatch, "
                f"{o.calls} iterations after {o.warmup}, grid {meta['num_blocks']} blocks, "
                f"{torch.cuda.get_device_name(dev)}")
        text = "\n".join([head] + report)
        print(text)
        os.makedirs(o.out, exist_ok=True)
        with open(os.path.join(o.out, f"ll_trace_{world}gpu.txt"), "w") as f:
            f.write(text + "\n")
        torch.save(saved, os.path.join(o.out, f"ll_trace_{world}gpu.pt"))
    torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
