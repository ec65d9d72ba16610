"""The benchmark CLI end to end on the CPU: 2 gloo ranks it spawns itself, the reference backend, tiny shapes.

Checks that the tables are printed, that the JSON / markdown files are written with the expected records,
and that the byte counts follow DeepEP V1's convention (bench/README.md) (they do not depend on the timing)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARGS = ["--cpu", "--num-ranks", "2", "--backend", "reference", "--mode", "all", "--quick", "--tokens", "64",
        "--hidden", "256", "--num-experts", "16", "--topk", "4", "--num-sms", "8,24", "--chunks", "16:256",
        "--plot-sweep", "--tokens-sweep", "32,64", "--ll-tokens", "8", "--ll-experts", "16", "--iters", "3",
        "--warmup", "1", "--timeout", "60"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "moe_dispatcher.bench", *ARGS, "--json", str(out / "r.json"),
                           "--out-dir", str(out / "dir")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout, out


def test_tables_printed(run):
    stdout, _ = run
    for text in ("== normal mode: 2 ranks", "[normal] dispatch bf16", "[gloo] all_to_all_single",
                 "[low-latency] E=16", "## Normal mode (cached-handle calls)", "## Normal mode: baselines",
                 "## Tokens per rank sweep", "## Low-latency mode", "ours/gloo", "GB/s logical", "GB/s phys",
                 "naive gloo MoE dispatch", "host-overhead dispatch", "not performance figures",
                 "baseline: torch.distributed all_to_all_single over gloo"):
        assert text in stdout, f"{text!r} missing from the output:\n{stdout[-3000:]}"


def test_json_records(run):
    _, out = run
    doc = json.loads((out / "r.json").read_text())
    assert {"meta", "notes", "records"} <= set(doc)
    meta = doc["meta"]
    assert meta["num_ranks"] == 2 and meta["device_kind"] == "cpu" and meta["backends_used"] == ["reference"]
    assert meta["failed_sections"] == []
    recs = doc["records"]
    ops = {(r["section"], r["op"], r.get("dtype")) for r in recs}
    for want in [("normal", "dispatch", "bf16"), ("normal", "dispatch", "fp8"), ("normal", "combine", "bf16"),
                 ("nccl", "nccl-a2a dispatch-bf16", None), ("normal-extra", "naive-nccl-dispatch", "bf16"),
                 ("normal-extra", "fresh-dispatch", "bf16"), ("normal-extra", "host-overhead dispatch", "bf16"),
                 ("tokens", "dispatch", "bf16")]:
        assert want in ops, f"{want} not among {sorted(ops, key=str)}"
    normal = [r for r in recs if r["section"] == "normal"]
    assert {r["num_sms"] for r in normal} == {8, 24}
    for r in normal:
        for key in ("t_us", "t_us_median", "logical_gbps", "physical_gbps", "nccl", "ratio_vs_nccl", "per_rank_us",
                    "bytes_logical", "bytes_physical", "send_chunk", "recv_chunk", "backend"):
            assert key in r, f"{key} missing from {r['op']} {r['dtype']}"
        assert len(r["per_rank_us"]) == 2 and r["t_us"]["min"] <= r["t_us"]["mean"] <= r["t_us"]["max"]
    # byte formula: BF16 = received rows x 2H (self included); FP8 = that x (1 + 4/128) / 2; physical <= logical
    h = 256
    bf16 = next(r for r in normal if r["op"] == "dispatch" and r["dtype"] == "bf16")
    fp8 = next(r for r in normal if r["op"] == "dispatch" and r["dtype"] == "fp8")
    comb = next(r for r in normal if r["op"] == "combine")
    for rank in range(2):
        rows = bf16["bytes_logical"][rank] / (2 * h)
        assert rows == int(rows) and rows > 0
        assert fp8["bytes_logical"][rank] == pytest.approx(bf16["bytes_logical"][rank] * (1 + 4 / 128) / 2)
        assert comb["bytes_logical"][rank] == bf16["bytes_logical"][rank]
        assert 0 < bf16["bytes_physical"][rank] < bf16["bytes_logical"][rank]
    nccl = next(r for r in recs if r["op"] == "nccl-a2a dispatch-bf16" and r["section"] == "nccl")
    assert nccl["bytes_logical"] == bf16["bytes_logical"], "the NCCL baseline must move the same rows"
    # low-latency: valid selections x (H + H/128*4 + 16) for dispatch, x 2H for combine (all T*K slots valid)
    # Both combine orders are timed (--ll-reductions default); the baseline sits with the first.
    for reduction in ("per_rank", "per_expert"):
        ll = {r["op"]: r for r in recs if r["section"] == "low-latency" and r.get("path") == "events"
              and r.get("reduction") == reduction}
        assert set(ll) == {"dispatch", "combine", "dispatch+combine"}, reduction
        sel = 8 * 4
        assert ll["dispatch"]["bytes_logical"] == [sel * (h + h // 128 * 4 + 16)] * 2
        assert ll["combine"]["bytes_logical"] == [sel * 2 * h] * 2
        assert ("nccl" in ll["dispatch"]) == (reduction == "per_rank")
        # physical: the per-rank order sends one row per (token, other rank) it picks, never more than per expert
        assert all(0 < p <= sel * 2 * h for p in ll["combine"]["bytes_physical"]), ll["combine"]["bytes_physical"]


def test_out_dir_files(run):
    _, out = run
    names = os.listdir(out / "dir")
    md = [n for n in names if n.endswith(".md")]
    assert len(md) == 1 and md[0].startswith("bench_all_cpux2_"), names
    assert any(n.endswith(".json") for n in names)
    text = (out / "dir" / md[0]).read_text()
    assert "## Low-latency mode" in text and "## Tokens per rank sweep" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot skipped" in text and '.[plot]' in text
    else:
        assert any(n.endswith(".png") for n in names), names


def test_help_and_bad_options():
    from moe_dispatcher.bench.cli import parser, resolve
    assert "--plot-sweep" in parser().format_help()
    with pytest.raises(SystemExit):
        resolve(parser().parse_args(["--cpu", "--hidden", "100"]))
    with pytest.raises(SystemExit):
        resolve(parser().parse_args(["--cpu", "--backend", "kernels"]))


EM_ARGS = ["--cpu", "--num-ranks", "2", "--backend", "reference", "--mode", "expert-major", "--quick", "--tokens",
           "64", "--hidden", "256", "--num-experts", "16", "--topk", "4", "--iters", "2", "--warmup", "1",
           "--timeout", "60"]
EM_OPS = {"rank-major dispatch (cached)", "rank-major combine", "em dispatch fresh num_worst_tokens",
          "em dispatch fresh exact (host sync)", "em dispatch cached", "em combine", "em combine +weights",
          "em combine +topk_weights", "torch composition (unpermute + combine)", "torch unpermute alone (local)",
          "NCCL a2a dispatch rows", "NCCL a2a combine rows"}


def test_expert_major_mode(tmp_path):
    """--mode expert-major on the reference backend: every case timed back to back and after a barrier, the
    table printed, md/json written, the combine variants checked bit for bit against the composition."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "moe_dispatcher.bench", *EM_ARGS, "--json", str(tmp_path / "r.json"),
                           "--out-dir", str(tmp_path / "dir")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    for text in ("== expert-major mode: 2 ranks", "## Expert-major vs rank-major",
                 "synced / rank-major combine", "equals the torch composition bit for bit"):
        assert text in proc.stdout, f"{text!r} missing from the output:\n{proc.stdout[-3000:]}"
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["meta"]["failed_sections"] == [] and doc["meta"]["mode"] == "expert-major"
    recs = [r for r in doc["records"] if r["section"] == "expert-major"]
    assert {r["op"] for r in recs} == EM_OPS
    assert {(r["op"], r["timing"]) for r in recs} == {(op, t) for op in EM_OPS for t in ("b2b", "sync")}
    for r in recs:
        assert len(r["per_rank_us"]) == 2 and r["t_us"]["min"] <= r["t_us"]["mean"] <= r["t_us"]["max"]
        assert r["recv_rows"] > 0 and r["em_rows"] >= r["recv_rows"]
    files = sorted(p.name for p in (tmp_path / "dir").iterdir())
    assert any(f.startswith("bench_expert-major_cpux2_") and f.endswith(".md") for f in files), files
    assert any(f.endswith(".json") for f in files), files


OVERLAP_ARGS = ["--cpu", "--num-ranks", "2", "--backend", "reference", "--mode", "overlap", "--quick", "--tokens", "64",
                "--hidden", "256", "--num-experts", "16", "--topk", "4", "--num-sms", "4,8", "--gemm-size", "64",
                "--rounds", "3", "--repeats", "2", "--timeout", "60"]


def test_overlap_mode(tmp_path):
    """--mode overlap on the reference backend: GEMMs alone, each exchange (gloo all_to_all_single, ours at each SM
    count and at the default choice) alone and beside the GEMMs, the summary table, the num_sms rule point; md and
    json written. On the CPU nothing overlaps: the structure runs, the figures mean nothing."""
    from moe_dispatcher.config import default_num_sms
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "moe_dispatcher.bench", *OVERLAP_ARGS, "--json",
                           str(tmp_path / "r.json"), "--out-dir", str(tmp_path / "dir")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                                  f"stderr:\n{proc.stderr[-4000:]}")
    default = default_num_sms(2, True, 256 * 2, 64)
    for text in ("== overlap mode: 2 ranks", "## Overlap: GEMMs beside the exchange",
                 "gloo all_to_all_single, same rows", f"ours, {default} SMs (default)", "efficiency",
                 "GEMM slowdown", "nothing overlaps", "efficiency of a perfect overlap", "shorter hidden",
                 "num_sms rule point (config.NUM_SMS_SWEEPS): (2, True): {64 * 512: {"):
        assert text in proc.stdout, f"{text!r} missing from the output:\n{proc.stdout[-3000:]}"
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["meta"]["failed_sections"] == [] and doc["meta"]["mode"] == "overlap"
    summary = [r for r in doc["records"] if r["section"] == "overlap-summary"]
    assert [(r["impl"], r["num_sms"]) for r in summary] == [("nccl", None)] + [("ours", s) for s in
                                                                             sorted({4, 8, default})]
    assert [r["num_sms"] for r in summary if r["default"]] == [default]
    for r in summary:
        assert r["gemm_us"] > 0 and r["exchange_us"] > 0 and r["together_us"] > 0
        assert r["efficiency"] == pytest.approx((r["gemm_us"] + r["exchange_us"]) / r["together_us"])
        beside = r["gemm_carved_us"] if r["gemm_carved_us"] is not None else r["gemm_us"]
        assert r["efficiency_bound"] == pytest.approx((r["gemm_us"] + r["exchange_us"]) /
                                                      max(beside, r["exchange_us"]))
        assert r["hidden"] == pytest.approx((r["gemm_us"] + r["exchange_us"] - r["together_us"]) /
                                            min(r["gemm_us"], r["exchange_us"]))
        assert r["gemm_slowdown"] == pytest.approx(r["gemm_together_us"] / r["gemm_us"] - 1)
        assert r["round_us"] == pytest.approx(r["exchange_us"] / 3)
    timed = {(r["op"], r.get("impl"), r.get("num_sms")) for r in doc["records"] if r["section"] == "overlap"}
    assert ("gemm alone", "torch.mm", None) in timed
    for impl, sms in [(r["impl"], r["num_sms"]) for r in summary]:
        for op in ("exchange alone", "together", "gemm in together", "exchange in together"):
            assert (op, impl, sms) in timed, (op, impl, sms)
    ours = next(r for r in doc["records"] if r["section"] == "overlap" and r.get("impl") == "ours")
    assert ours["backend"] == "reference" and len(ours["per_rank_us"]) == 2
    # the exchange moves a dispatch's and a combine's rows per round: 2 x received rows x 2H, 3 rounds
    assert all(b > 0 and b % (2 * 2 * 256 * 3) == 0 for b in ours["bytes_logical"])
    files = sorted(p.name for p in (tmp_path / "dir").iterdir())
    assert any(f.startswith("bench_overlap_cpux2_") and f.endswith(".md") for f in files), files


def test_overlap_options():
    from moe_dispatcher.bench.cli import parser, resolve
    opts = resolve(parser().parse_args(["--cpu", "--mode", "overlap"]))
    assert (opts.num_sms, opts.gemm_size, opts.rounds) == ([4, 8, 16, 24], 8192, 40)
    assert resolve(parser().parse_args(["--cpu", "--mode", "normal"])).num_sms == [8, 16, 24]
    for bad in (["--num-sms", "6,7"], ["--rounds", "0"], ["--gemm-size", "0"]):
        with pytest.raises(SystemExit):
            resolve(parser().parse_args(["--cpu", "--mode", "overlap", *bad]))
