"""Side-by-side summary of DeepEP V1's own tests run against DeepEP V1 and against moe_dispatcher.

    python tools/deepep_summary.py LOG_DIR [NUM_GPUS] > LOG_DIR/summary.md

Reads what tools/deepep_side_by_side.sh leaves in LOG_DIR: for each run NAME in {intranode, low_latency} x
{deepep, ours}, NAME.log (the test's output) and NAME.rc ("exit_code seconds"; absent = not run), and
preflight_{deepep,ours}.log (which module `import deep_ep` gave, and its Buffer.is_sm90_compiled()).

What it takes from the logs (the lines DeepEP's tests print on local rank 0, or on every rank for low latency):
  intranode    "[testing] ... passed" lines (FP8 ones counted apart: they run only when is_sm90_compiled()),
               "[layout] Kernel performance: X ms", every "[tuning] SMs S, NVL chunk C: G GB/s (NVL), T us" line
               grouped by the "[tuning] Best ..." line that closes its sweep (FP8 dispatch, BF16 dispatch,
               combine), and the best of each sweep;
  low latency  per rank: "Dispatch + combine bandwidth: ... avg_t=T us" (eager pair, events), "Dispatch
               bandwidth ... avg_t=D us | Combine bandwidth ... avg_t=C us" (kernel times from the profiler) and
               "Dispatch send/recv time: a + b us | Combine send/recv time: c + d us" (hooked); the summary
               gives the largest value over ranks.
"""
from __future__ import annotations

import os
import re
import sys

RUNS = ("deepep", "ours")
TITLE = {"deepep": "DeepEP V1", "ours": "moe_dispatcher"}

_PASSED = re.compile(r"\[testing\] Running with (FP8|BF16).*passed")
_LAYOUT = re.compile(r"\[layout\] Kernel performance: ([\d.]+) ms")
_SWEEP = re.compile(r"\[tuning\] SMs (\d+), NVL chunk (\w+): ([\d.]+) GB/s \(NVL\), ([\d.]+) us")
_BEST = re.compile(r"\[tuning\] Best (dispatch \((FP8|BF16)\)|combine)\W.*?SMs (\d+), NVL chunk (\d+)\W+([\d.]+) GB/s"
                   r" \(NVL\), t: ([\d.]+) us")
_LL_PAIR = re.compile(r"\[rank (\d+)\] Dispatch \+ combine bandwidth: ([\d.]+) GB/s, avg_t=([\d.]+) us")
_LL_KERNELS = re.compile(r"\[rank (\d+)\] Dispatch bandwidth: ([\d.]+) GB/s, avg_t=([\d.]+) us \| "
                         r"Combine bandwidth: ([\d.]+) GB/s, avg_t=([\d.]+) us")
_LL_HOOK = re.compile(r"\[rank (\d+)\] Dispatch send/recv time: ([\d.]+) \+ ([\d.]+) us \| "
                      r"Combine send/recv time: ([\d.]+) \+ ([\d.]+) us")
_ERROR = re.compile(r"(Error|Exception|error:|Traceback|AssertionError|NotImplementedError|timed out)")


def read(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        return f.read()


def status(log_dir: str, name: str) -> str:
    """PASS / FAIL rc=N / TIMEOUT / not run, with the seconds the run took."""
    rc_text = read(os.path.join(log_dir, f"{name}.rc"))
    if rc_text is None:
        return "not run"
    rc, secs = (rc_text.split() + ["?"])[:2]
    verdict = {"0": "PASS", "124": "TIMEOUT", "137": "TIMEOUT (killed)"}.get(rc, f"FAIL rc={rc}")
    return f"{verdict} ({secs} s)"


def first_error(text: str | None) -> str | None:
    """The last line that names an error (the exception a traceback ends with), shortened."""
    if not text:
        return None
    hits = [line.strip() for line in text.splitlines() if _ERROR.search(line)]
    return hits[-1][:200] if hits else None


def parse_intranode(text: str | None) -> dict:
    out = {"passed": 0, "passed_fp8": 0, "layout_ms": None, "sweeps": {}, "best": {}}
    if not text:
        return out
    pending: list[tuple] = []
    for line in text.splitlines():
        m = _PASSED.search(line)
        if m:
            out["passed"] += 1
            out["passed_fp8"] += m.group(1) == "FP8"
        m = _LAYOUT.search(line)
        if m:
            out["layout_ms"] = float(m.group(1))
        m = _SWEEP.search(line)
        if m:
            pending.append((int(m.group(1)), m.group(2), float(m.group(3)), float(m.group(4))))
        m = _BEST.search(line)
        if m:
            label = f"dispatch {m.group(2)}" if m.group(2) else "combine"
            out["sweeps"][label] = pending
            out["best"][label] = (int(m.group(3)), int(m.group(4)), float(m.group(5)), float(m.group(6)))
            pending = []
    return out


def parse_low_latency(text: str | None) -> dict:
    """Largest value over ranks of each figure (us), or None when absent."""
    out = {"pair_us": None, "pair_gbps": None, "dispatch_us": None, "combine_us": None, "hook": None}
    if not text:
        return out
    pair, disp, comb, hook = [], [], [], []
    for line in text.splitlines():
        m = _LL_PAIR.search(line)
        if m:
            pair.append((float(m.group(3)), float(m.group(2))))
        m = _LL_KERNELS.search(line)
        if m:
            disp.append(float(m.group(3)))
            comb.append(float(m.group(5)))
        m = _LL_HOOK.search(line)
        if m:
            hook.append(tuple(float(m.group(i)) for i in range(2, 6)))
    if pair:
        slowest = max(pair)
        out["pair_us"], out["pair_gbps"] = slowest[0], min(p[1] for p in pair)
    if disp:
        out["dispatch_us"], out["combine_us"] = max(disp), max(comb)
    if hook:
        out["hook"] = tuple(max(h[i] for h in hook) for i in range(4))
    return out


def preflight(log_dir: str, run: str) -> str:
    text = read(os.path.join(log_dir, f"preflight_{run}.log"))
    if not text:
        return "-"
    lines = [line for line in text.splitlines() if line.startswith("deep_ep=")]
    return lines[-1] if lines else (first_error(text) or text.strip().splitlines()[-1])[:200]


def fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def render(log_dir: str, num_gpus: str = "?") -> str:
    logs = {(test, run): read(os.path.join(log_dir, f"{test}_{run}.log"))
            for test in ("intranode", "low_latency") for run in RUNS}
    intra = {run: parse_intranode(logs["intranode", run]) for run in RUNS}
    ll = {run: parse_low_latency(logs["low_latency", run]) for run in RUNS}
    lines = [(f"# DeepEP V1's tests, unmodified: DeepEP V1 vs moe_dispatcher (`import deep_ep` -> moe_dispatcher), "
              f"{num_gpus} GPUs"), "",
             "| | DeepEP V1 | moe_dispatcher | ours / DeepEP |", "|---|---|---|---|"]

    def row(name: str, a: str, b: str, r: str = "") -> None:
        lines.append(f"| {name} | {a} | {b} | {r} |")

    row("`import deep_ep` gave", preflight(log_dir, "deepep"), preflight(log_dir, "ours"))
    row("test_intranode.py", status(log_dir, "intranode_deepep"), status(log_dir, "intranode_ours"))
    row("  cases passed (of them FP8)", *(f"{intra[r]['passed']} ({intra[r]['passed_fp8']})" for r in RUNS))
    row("  layout kernel ms", *(fmt(intra[r]["layout_ms"], ".3f") for r in RUNS),
        ratio(intra["ours"]["layout_ms"], intra["deepep"]["layout_ms"]))
    for label in ("dispatch FP8", "dispatch BF16", "combine"):
        best = {r: intra[r]["best"].get(label) for r in RUNS}
        cell = {r: "-" if best[r] is None else f"{best[r][2]:.2f} GB/s ({best[r][3]:.0f} us, chunk {best[r][1]})"
                for r in RUNS}
        row(f"  best {label}, {next((b[0] for b in best.values() if b), '?')} SMs", cell["deepep"], cell["ours"],
            ratio(*(best[r][2] if best[r] else None for r in RUNS)))
        default = {r: next((s for s in intra[r]["sweeps"].get(label, []) if s[1] == "default"), None) for r in RUNS}
        row(f"  default config {label}", *("-" if default[r] is None else f"{default[r][2]:.2f} GB/s" for r in RUNS),
            ratio(*(default[r][2] if default[r] else None for r in RUNS)))
    row("test_low_latency.py", status(log_dir, "low_latency_deepep"), status(log_dir, "low_latency_ours"))
    row("  eager dispatch+combine us (bench, slowest rank)", *(fmt(ll[r]["pair_us"]) for r in RUNS),
        ratio(ll["ours"]["pair_us"], ll["deepep"]["pair_us"]))
    row("  dispatch kernel us (profiler, slowest rank)", *(fmt(ll[r]["dispatch_us"]) for r in RUNS),
        ratio(ll["ours"]["dispatch_us"], ll["deepep"]["dispatch_us"]))
    row("  combine kernel us (profiler, slowest rank)", *(fmt(ll[r]["combine_us"]) for r in RUNS),
        ratio(ll["ours"]["combine_us"], ll["deepep"]["combine_us"]))
    row("  hooked send + recv us: dispatch; combine",
        *("-" if ll[r]["hook"] is None else "{:.2f} + {:.2f}; {:.2f} + {:.2f}".format(*ll[r]["hook"])
          for r in RUNS))
    errors = [(f"{test}_{run}", first_error(logs[test, run])) for test in ("intranode", "low_latency")
              for run in RUNS if "PASS" not in status(log_dir, f"{test}_{run}")]
    errors = [(n, e) for n, e in errors if e]
    if errors:
        lines += ["", "Last error line of each run that did not pass:", ""]
        lines += [f"- {name}: `{err}`" for name, err in errors]

    sweeps = [label for label in ("dispatch FP8", "dispatch BF16", "combine")
              if any(intra[r]["sweeps"].get(label) for r in RUNS)]
    if sweeps:
        lines += ["", "Intranode sweeps (GB/s by DeepEP's byte count; NVL chunk = num_max_nvl_chunked_send_tokens):",
                  ""]
        for label in sweeps:
            lines += [f"| {label}: chunk | DeepEP V1 GB/s | moe_dispatcher GB/s |", "|---|---|---|"]
            by_chunk: dict[str, dict[str, float]] = {}
            for r in RUNS:
                for _, chunk, gbps, _ in intra[r]["sweeps"].get(label, []):
                    by_chunk.setdefault(chunk, {})[r] = gbps
            for chunk, vals in by_chunk.items():
                lines.append(f"| {chunk} | {fmt(vals.get('deepep'))} | {fmt(vals.get('ours'))} |")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    sys.stdout.write(render(argv[0], argv[1] if len(argv) > 1 else "?"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
