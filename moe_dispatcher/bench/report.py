"""The end of a run: markdown tables (printed and written), the JSON record, the PNG plot."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence

from .common import baseline_label, baseline_named


def _f(v: Optional[float], nd: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{nd}f}"


def _range(d: Dict[str, float], nd: int = 1) -> str:
    return f"{d['min']:.{nd}f}..{d['max']:.{nd}f}"


def _table(header: Sequence[str], rows: List[Sequence[str]]) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def _nccl_cells(rec: Dict[str, Any]) -> List[str]:
    if "nccl" not in rec:
        return ["-", "-", "-"]
    return [_f(rec["nccl"]["t_us"]["mean"]), _f(rec["nccl"]["gbps"]["mean"]), _f(rec["ratio_vs_nccl"], 2)]


def normal_table(records: List[Dict[str, Any]]) -> str:
    rows = []
    for r in records:
        if r["section"] != "normal":
            continue
        config = r["config"]
        rows.append([f"{r['op']} {r['dtype']}", r["num_sms"], f"{r['send_chunk']}/{r['recv_chunk']}", config,
                     _f(r["t_us"]["mean"]), _range(r["t_us"]), _f(r["logical_gbps"]["mean"]),
                     _f(r["logical_gbps"]["min"]), _f(r.get("physical_gbps", {}).get("mean")),
                     *_nccl_cells(r), _f(r.get("target_gbps"), 0)])
    if not rows:
        return ""
    return _table(["op", "SMs", "chunks s/r", "config", "t us", "t us ranks", "GB/s logical", "GB/s min rank",
                   "GB/s phys", "NCCL us", "NCCL GB/s", "ours/NCCL", "target GB/s"], rows)


def best_table(records: List[Dict[str, Any]]) -> str:
    """The best config of each (op, num_sms, ring protocol) of the normal-mode sweep."""
    best: Dict[tuple, Dict[str, Any]] = {}
    for r in records:
        if r["section"] != "normal":
            continue
        key = (f"{r['op']} {r['dtype']}", r["num_sms"])
        if key not in best or r["logical_gbps"]["mean"] > best[key]["logical_gbps"]["mean"]:
            best[key] = r
    if len(best) == sum(1 for r in records if r["section"] == "normal"):
        return ""  # one config per (op, SMs): the main table says it all
    rows = [[k[0], k[1], f"{r['send_chunk']}/{r['recv_chunk']}", _f(r["t_us"]["mean"]), _f(r["logical_gbps"]["mean"]),
             _f(r.get("physical_gbps", {}).get("mean")), _f(r.get("ratio_vs_nccl"), 2), _f(r.get("target_gbps"), 0)]
            for k, r in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1]))]
    return _table(["op", "SMs", "best chunks s/r", "t us", "GB/s logical", "GB/s phys", "ours/NCCL", "target GB/s"],
                  rows)


def extras_table(records: List[Dict[str, Any]]) -> str:
    rows = []
    for r in records:
        if r["section"] == "nccl":
            rows.append([f"NCCL all_to_all_single, {r['op'].split(' ', 1)[1]} rows", _f(r["t_us"]["mean"]),
                         _range(r["t_us"]), _f(r["logical_gbps"]["mean"]), _f(r["physical_gbps"]["mean"]), ""])
        elif r["section"] == "normal-extra":
            op = r["op"]
            if op.startswith("host-overhead"):
                rows.append([f"{op} (cached call, CPU us)", _f(r["t_us"]["mean"]), _range(r["t_us"]), "-", "-",
                             f"median {_f(r['t_us_median']['mean'])} us; target < 15 us"])
            elif op == "layout":
                rows.append(["get_dispatch_layout", _f(r["t_us"]["mean"]), _range(r["t_us"]), "-", "-", ""])
            else:
                label = {"naive-nccl-dispatch": "naive NCCL MoE dispatch bf16 (gather, count a2a, host sync, a2a)",
                         "fresh-dispatch": f"fresh dispatch bf16 (layout given), {r.get('num_sms')} SMs"}.get(op, op)
                rows.append([label, _f(r["t_us"]["mean"]), _range(r["t_us"]), _f(r["logical_gbps"]["mean"]),
                             _f(r.get("physical_gbps", {}).get("mean")), ""])
    if not rows:
        return ""
    return _table(["what", "t us", "t us ranks", "GB/s logical", "GB/s phys", "note"], rows)


def tokens_table(records: List[Dict[str, Any]]) -> str:
    by_t: Dict[int, Dict[str, Dict[str, Any]]] = {}
    for r in records:
        if r["section"] == "tokens":
            by_t.setdefault(r["tokens"], {})[f"{r['op']}-{r['dtype']}"] = r
    if not by_t:
        return ""
    rows = []
    for t in sorted(by_t):
        cells: List[str] = [str(t)]
        for key in ("dispatch-bf16", "dispatch-fp8", "combine-bf16"):
            r = by_t[t].get(key)
            if r is None:
                cells += ["-", "-", "-"]
                continue
            cells += [_f(r["logical_gbps"]["mean"]), _f(r.get("nccl", {}).get("gbps", {}).get("mean")),
                      _f(r["t_us"]["mean"])]
        rows.append(cells)
    return _table(["tokens/rank", "disp bf16 GB/s", "NCCL", "us", "disp fp8 GB/s", "NCCL", "us", "combine GB/s",
                   "NCCL", "us"], rows)


def ll_table(records: List[Dict[str, Any]]) -> str:
    rows = []
    for r in records:
        if r["section"] != "low-latency":
            continue
        ours = not r["op"].startswith("nccl")
        rows.append([r["num_experts"], r.get("reduction", "-"), r["op"] if ours else f"(no graph of ours) {r['op']}",
                     r.get("path", ""),
                     _f(r["t_us"]["mean"]), _range(r["t_us"]), _f(r["t_us_median"]["mean"]),
                     _f(sum(r["bytes_logical"]) / len(r["bytes_logical"]) / 1e6, 2), _f(r["logical_gbps"]["mean"]),
                     *(_nccl_cells(r) if ours else ["-", "-", "-"]), _f(r.get("target_us"), 0)])
    if not rows:
        return ""
    return _table(["E", "combine order", "op", "timing", "t us", "t us ranks", "median us", "MB/rank", "GB/s", "NCCL us",
                   "NCCL GB/s", "ours/NCCL", "target us"], rows)


def internode_table(records: List[Dict[str, Any]]) -> str:
    """The two-hop path beside the intranode kernels (same routing, same GPUs) and NCCL, per op."""
    by = {(r["section"], r["op"], r.get("dtype")): r for r in records if r["section"] in ("intranode", "internode")}
    nccl = {r["op"].split(" ", 1)[1]: r for r in records if r["section"] == "nccl"}
    rows = []
    for (section, op, dtype), r in by.items():
        if section != "internode":
            continue
        intra = by.get(("intranode", op, dtype))
        base = nccl.get(f"{op}-{dtype}")
        t, ti = r["t_us"]["mean"], intra["t_us"]["mean"] if intra else None
        rows.append([f"{op} {dtype}", r.get("num_sms", "-"), _f(t), _range(r["t_us"]), _f(ti),
                     _f(t / ti, 2) if ti else "-", _f(base["t_us"]["mean"]) if base else "-"])
    if not rows:
        return ""
    return _table(["op", "SMs", "internode t us", "t us ranks", "intranode t us", "internode/intranode",
                   "NCCL a2a t us"], rows)


def expert_major_table(records: List[Dict[str, Any]]) -> str:
    """Expert-major mode: one row per case, back-to-back and synced times side by side."""
    recs = [r for r in records if r.get("section") == "expert-major"]
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


OVERLAP_GOAL = {"efficiency": 1.8, "gemm_slowdown": 0.10}  # at the default SM count (bench/README.md)


def overlap_table(records: List[Dict[str, Any]]) -> str:
    """Overlap mode: one row per exchange (NCCL, ours at each SM count), times in ms over all rounds."""
    rows = []
    for r in records:
        if r.get("section") != "overlap-summary":
            continue
        if r["impl"] == "ours":
            what = (f"ours, {r['num_sms']} SMs" + (" (default)" if r["default"] else "")
                    + ("" if r.get("carveout") else ", GEMMs on every SM"))
        else:
            what = "NCCL all_to_all_single, same rows"
        carved = r.get("gemm_carved_us")
        goal = ""
        if r["default"]:
            ok = (r["efficiency"] >= OVERLAP_GOAL["efficiency"] and r["gemm_slowdown"] <= OVERLAP_GOAL["gemm_slowdown"])
            goal = "met" if ok else "missed"
        rows.append([what, _f(r["gemm_us"] / 1e3, 2), _f(carved / 1e3, 2) if carved else "-",
                     _f(r["exchange_us"] / 1e3, 2), _f(r["round_us"]),
                     _f(r["together_us"] / 1e3, 2), f"{_f(r['together_ranks_us'][0] / 1e3, 2)}.."
                     f"{_f(r['together_ranks_us'][1] / 1e3, 2)}", _f(r["gemm_together_us"] / 1e3, 2),
                     _f(r["exchange_together_us"] / 1e3, 2), _f(r["efficiency"], 2),
                     _f(r["efficiency_bound"], 2), f"{100 * r['hidden']:.0f}%",
                     f"{100 * r['gemm_slowdown']:+.1f}%", goal])
    if not rows:
        return ""
    return _table(["exchange", "GEMMs alone ms", "GEMMs alone, leaving the exchange's SMs, ms", "exchange alone ms", "us per round", "together ms", "together ranks",
                   "GEMMs' span together", "exchange's span together", "efficiency",
                   "efficiency of a perfect overlap", "shorter one hidden", "GEMM slowdown",
                   "goal (>= 1.8, <= +10%)"], rows)


CPU_NOTE = ("not a GPU run: the ranks and the baseline ran on CPUs, so these figures are a smoke test of the bench, "
            "not performance figures")


def render(meta: Dict[str, Any], records: List[Dict[str, Any]], notes: List[str]) -> str:
    label = baseline_label(str(meta.get("process_group")))
    parts = [f"# moe_dispatcher bench: {meta.get('device')} x{meta.get('num_ranks')}, {meta.get('date')}",
             "",
             f"- command: `{meta.get('command')}`",
             f"- backend requested: {meta.get('backend_requested')}; "
             f"used: {', '.join(meta.get('backends_used', [])) or '-'}",
             f"- torch {meta.get('torch')}, CUDA {meta.get('cuda', '-')}, NCCL {meta.get('nccl', '-')}, "
             f"process group {meta.get('process_group')}",
             "- GB/s logical: DeepEP V1's byte count (rows received incl. self x 2H; FP8 x (1+4/128)/2) / mean "
             "time; phys: rows to/from peers only. Times: mean over ranks of each rank's mean call time.",
             f"- baseline: torch.distributed all_to_all_single over {meta.get('process_group')} "
             f"(columns {label})"]
    if meta.get("process_group") != "nccl":
        parts.append(f"- {CPU_NOTE}")
    parts.append("")
    header, parts = parts, []  # the tables below are written with NCCL as the baseline's name
    for title, text in (("Normal mode (cached-handle calls)", normal_table(records)),
                        ("Normal mode: best chunks per op and SM count", best_table(records)),
                        ("Normal mode: baselines, fresh dispatch, host overhead", extras_table(records)),
                        ("Tokens per rank sweep (logical GB/s)", tokens_table(records)),
                        ("Low-latency mode", ll_table(records)),
                        ("Internode (two-hop) beside intranode", internode_table(records)),
                        ("Expert-major vs rank-major, one routing", expert_major_table(records)),
                        ("Overlap: GEMMs beside the exchange", overlap_table(records))):
        if text:
            parts += [f"## {title}", "", text, ""]
    if notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(header + [baseline_named("\n".join(parts), label)])


def plot(records: List[Dict[str, Any]], path: str, title: str, baseline: str = "NCCL") -> Optional[str]:
    """PNG of logical GB/s vs tokens per rank, ours (solid) vs the all_to_all baseline (dashed, named `baseline`).
    Returns a note when skipped."""
    series: Dict[str, Dict[int, float]] = {}
    for r in records:
        if r["section"] == "tokens":
            key = f"{r['op']} {r['dtype']}"
            series.setdefault(key, {})[r["tokens"]] = r["logical_gbps"]["mean"]
            if "nccl" in r:
                series.setdefault(f"{baseline} a2a ({key})", {})[r["tokens"]] = r["nccl"]["gbps"]["mean"]
    if not series:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return (f"plot skipped: matplotlib is not importable ({type(exc).__name__}); for plots install the extra: "
                f"pip install -e \".[plot]\" (or pip install matplotlib)")
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"dispatch bf16": "tab:blue", "dispatch fp8": "tab:orange", "combine bf16": "tab:green"}
    for key, pts in series.items():
        xs = sorted(pts)
        theirs = key.startswith(f"{baseline} a2a (")
        base = key[len(f"{baseline} a2a ("):-1] if theirs else key
        ax.plot(xs, [pts[x] for x in xs], marker="o", linestyle="--" if theirs else "-",
                color=colors.get(base), label=key)
    ax.set_xscale("log", base=2)
    ticks = sorted({t for pts in series.values() for t in pts})
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("logical GB/s per rank")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write(meta: Dict[str, Any], records: List[Dict[str, Any]], notes: List[str], json_path: Optional[str],
          out_dir: Optional[str], mode: str) -> List[str]:
    """Print the tables; write the JSON / markdown / PNG files asked for. Returns the paths written."""
    text = render(meta, records, notes)
    print("\n" + text, flush=True)
    written = []
    doc = {"meta": meta, "notes": notes, "records": records}
    stem = None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        stem = os.path.join(out_dir, f"bench_{mode}_{meta['device_kind']}x{meta['num_ranks']}_{meta['stamp']}")
    png_note = None
    if stem is not None:
        png = stem + ".png"
        label = baseline_label(str(meta.get("process_group")))
        png_note = plot(records, png, f"moe_dispatcher vs {label}, {meta.get('device')} x{meta.get('num_ranks')} "
                                      f"({', '.join(meta.get('backends_used', []))})", label)
        if png_note is None and os.path.exists(png):
            written.append(png)
        if png_note:
            print(png_note, flush=True)
            doc["notes"] = notes + [png_note]
        with open(stem + ".md", "w") as f:
            f.write(render(meta, records, doc["notes"]))
        written.append(stem + ".md")
    for path in filter(None, (json_path, stem + ".json" if stem else None)):
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        written.append(path)
    for p in written:
        print(f"wrote {p}", flush=True)
    return written
