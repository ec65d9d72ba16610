"""tools/ll_trace.py's analysis on synthetic trace records (CPU): the record layout it reads matches the
backend's parse_trace_record, and the timeline, durations, gaps and signal latencies come out as constructed."""
from __future__ import annotations

import importlib.util
import pathlib

import torch

from moe_dispatcher.compiled.low_latency import TRACE_KINDS, parse_trace_record

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ll_trace", ROOT / "tools" / "ll_trace.py")
ll_trace = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ll_trace)

R, E, B, EV = 2, 8, 4, 16
D_EVENTS = {"entry": 0, "counted": 1, "cast_done": 2, "stores_issued": 3, "signaled": 4, "recv_entry": 5,
            "first_arrival": 6, "last_arrival": 7, "copy_done": 8, "exit": 9}
C_EVENTS = {"entry": 0, "sends_issued": 1, "flags_up": 2, "recv_entry": 3, "wait_done": 4, "reduce_done": 5,
            "exit": 6}
MAX_BLOCKS = 8  # the synthetic record's block capacity (the kernels' is TRACE_MAX_BLOCKS)
META = {"num_blocks": B, "num_ranks": R, "num_experts": E, "events_per_block": EV, "smid": EV - 1,
        "pair_sent": MAX_BLOCKS * EV, "pair_wait": MAX_BLOCKS * EV + 16, "pair_seen": MAX_BLOCKS * EV + 32,
        "words": MAX_BLOCKS * EV + 48, "events": {"dispatch": D_EVENTS, "combine": C_EVENTS}}
LAT_NS = 1500      # every signal: seen = sent + 1.5 us
SKEW_NS = 500      # rank r enters r * 0.5 us after rank 0
GAP_NS = 3000      # dispatch exit -> combine entry on every rank


def _fill(rec: torch.Tensor, kind: str, t0: int, rank: int) -> int:
    """Block b of `rank`: event j at t0 + b*100 + j*1000 ns (entry = event 0); returns the rank's last exit."""
    events = META["events"][kind]
    for b in range(B):
        for j, (_, idx) in enumerate(sorted(events.items(), key=lambda kv: kv[1])):
            rec[b * EV + idx] = t0 + b * 100 + j * 1000
        rec[b * EV + EV - 1] = 10 + b  # SM id
    return t0 + (B - 1) * 100 + (len(events) - 1) * 1000


def _data(n: int) -> torch.Tensor:
    data = torch.zeros(R, n, len(TRACE_KINDS), 2, META["words"], dtype=torch.int64)
    L = E // R
    for i in range(n):
        base = 10**9 + i * 10**6
        d_exit = [_fill(data[r, i, 0, 0], "dispatch", base + r * SKEW_NS, r) for r in range(R)]
        c_base = max(d_exit)  # combine entries: GAP_NS after each rank's own dispatch exit
        for r in range(R):
            _fill(data[r, i, 1, 1], "combine", d_exit[r] + GAP_NS, r)
        for s in range(R):  # pair words
            for e in range(E):
                sent = base + s * SKEW_NS + 5000 + e * 10
                data[s, i, 0, 0, META["pair_sent"] + e] = sent  # dispatch: sender word e (global expert)
                r, l = divmod(e, L)
                p = l * R + s
                data[r, i, 0, 0, META["pair_wait"] + p] = sent - 100
                data[r, i, 0, 0, META["pair_seen"] + p] = sent + LAT_NS
            for p in range(E):  # combine: sender word l*R + r -> receiver word s*L + l
                l, r = divmod(p, R)
                sent = c_base + 7000 + p * 10
                data[s, i, 1, 1, META["pair_sent"] + p] = sent
                data[r, i, 1, 1, META["pair_wait"] + s * L + l] = sent + LAT_NS - 50  # already there
                data[r, i, 1, 1, META["pair_seen"] + s * L + l] = sent + LAT_NS
    return data


def test_parse_matches_backend_layout():
    data = _data(1)
    for k, kind in enumerate(TRACE_KINDS):
        ours = ll_trace.parse(data[0, 0, k, k], kind, META)
        theirs = parse_trace_record(data[0, 0, k, k], kind, META)
        assert ours["events"] == {n: v.tolist() for n, v in theirs["events"].items()}
        for f in ("smid", "sent", "wait", "seen"):
            assert ours[f] == theirs[f].tolist()


def test_summary_numbers():
    lines = ll_trace.summarize("synthetic", [("dispatch", 0), ("combine", 1)], _data(3), META)
    text = "\n".join(lines)

    def line(prefix: str) -> str:
        hits = [x for x in lines if x.strip().startswith(prefix)]
        assert hits, f"no line starting with {prefix!r} in:\n{text}"
        return hits[0]

    # timeline: entry min 0, max = rank 1's skew + 3 blocks * 0.1 us; exit = entry + 9 us
    assert line("entry").split()[1:5] == ["0.0", "0.4", "0.8", "0.8"], line("entry")
    assert line("exit").split()[1] == "9.0"
    # every per-block duration of adjacent events is 1 us; lifetime 9 us (dispatch) / 6 us (combine)
    assert line("counting pass").split()[-4:] == ["1.0", "1.0", "1.0", "1.0"]
    lifetimes = [x for x in lines if "block lifetime" in x]
    assert lifetimes[0].split()[-4:] == ["9.0"] * 4
    assert lifetimes[1].split()[-4:] == ["6.0"] * 4
    assert "rank 1:    0.5 |    0.3 |    9.3" in text, text
    assert "entry skew across ranks (max - min first entry): median    0.5" in text
    assert "blocks sharing an SM: 0" in text
    # signals: 1.5 us everywhere, hence offset 0; combine flags were all there when polled
    assert "0 -> 1: min    1.5  med    1.5  max    1.5" in text
    assert "ranks 0,1: one-way floor ~1.50 us, clock offset (rank 1 - rank 0) ~+0.00 us" in text
    assert "already there when first polled: 100% of 48" in text
    assert "already there when first polled: 0% of 48" in text
    assert "r0 3.0/3.0, r1 3.0/3.0" in text
    assert "%globaltimer: smallest step seen 100 ns" in text
    # egress: 4.3 MB over (last signaled - first entry) = 4.3 us -> 1000 GB/s
    meta = dict(META, peer_bytes={"dispatch": [4_300_000] * R, "combine": [3_300_000] * R})
    text = "\n".join(ll_trace.summarize("synthetic", [("dispatch", 0), ("combine", 1)], _data(2), meta))
    assert "send egress to peers (first entry -> last signaled, per rank): r0 4.30 MB / 4.3 us = 1000 GB/s" in text
    assert "last flags_up, per rank): r0 3.30 MB / 2.3 us = 1435 GB/s" in text
