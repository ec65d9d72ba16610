"""tools/deepep_summary.py (parses the output of DeepEP V1's tests) and tools/host_time.py's table, on CPU."""
import importlib.util
import json
import os

import pytest

_TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


summary = _load("deepep_summary")
host_time = _load("host_time")

INTRANODE = """[config] num_tokens=4096, hidden=7168, num_topk=8
[layout] Kernel performance: 0.051 ms

[testing] Running with BF16, without top-k (async=False, previous=False) ... passed
[testing] Running with FP8, with top-k (async=True, previous=True) ... passed
[tuning] SMs 24, NVL chunk 4: 100.50 GB/s (NVL), 700.00 us
[tuning] SMs 24, NVL chunk 6: 120.25 GB/s (NVL), 600.00 us
[tuning] SMs 24, NVL chunk default: 110.00 GB/s (NVL), 650.00 us
[tuning] Best dispatch (FP8): SMs 24, NVL chunk 6, 120.25 GB/s (NVL), t: 600.00 us

[tuning] SMs 24, NVL chunk 4: 200.00 GB/s (NVL), 800.00 us
[tuning] SMs 24, NVL chunk default: 190.00 GB/s (NVL), 820.00 us
[tuning] Best dispatch (BF16): SMs 24, NVL chunk 4, 200.00 GB/s (NVL), t: 800.00 us

[tuning] SMs 24, NVL chunk 1: 150.00 GB/s (NVL), 900.00 us
[tuning] SMs 24, NVL chunk 2: 300.00 GB/s (NVL), 450.00 us
[tuning] SMs 24, NVL chunk default: 290.00 GB/s (NVL), 460.00 us
[tuning] Best combine: SMs 24, NVL chunk 2: 300.00 GB/s (NVL), t: 450.00 us
"""
LOW_LATENCY = """Allocating buffer size: 1880.1 MB ...
[rank 0] Dispatch + combine bandwidth: 40.00 GB/s, avg_t=90.00 us, min_t=80.00 us, max_t=99.00 us
[rank 1] Dispatch + combine bandwidth: 38.00 GB/s, avg_t=95.00 us, min_t=81.00 us, max_t=99.00 us
[rank 0] Dispatch bandwidth: 50.00 GB/s, avg_t=30.00 us | Combine bandwidth: 60.00 GB/s, avg_t=55.00 us
[rank 1] Dispatch bandwidth: 49.00 GB/s, avg_t=31.00 us | Combine bandwidth: 61.00 GB/s, avg_t=54.00 us
[rank 0] Dispatch send/recv time: 10.00 + 5.00 us | Combine send/recv time: 12.00 + 6.00 us
[rank 1] Dispatch send/recv time: 11.00 + 4.00 us | Combine send/recv time: 11.00 + 7.00 us
"""


def test_parse_intranode():
    got = summary.parse_intranode(INTRANODE)
    assert (got["passed"], got["passed_fp8"], got["layout_ms"]) == (2, 1, 0.051)
    assert got["best"] == {"dispatch FP8": (24, 6, 120.25, 600.0), "dispatch BF16": (24, 4, 200.0, 800.0),
                           "combine": (24, 2, 300.0, 450.0)}
    assert [s[1] for s in got["sweeps"]["dispatch FP8"]] == ["4", "6", "default"]
    assert got["sweeps"]["combine"][2] == (24, "default", 290.0, 460.0)


def test_parse_low_latency_takes_the_slowest_rank():
    got = summary.parse_low_latency(LOW_LATENCY)
    assert (got["pair_us"], got["dispatch_us"], got["combine_us"]) == (95.0, 31.0, 55.0)
    assert got["hook"] == (11.0, 5.0, 12.0, 7.0)


def test_render(tmp_path):
    for run in ("deepep", "ours"):
        (tmp_path / f"intranode_{run}.log").write_text(INTRANODE)
        (tmp_path / f"low_latency_{run}.log").write_text(LOW_LATENCY)
        (tmp_path / f"preflight_{run}.log").write_text(f"deep_ep=x from /{run}, is_sm90_compiled=True\n")
    (tmp_path / "intranode_deepep.rc").write_text("0 61\n")
    (tmp_path / "intranode_ours.rc").write_text("1 30\n")
    (tmp_path / "intranode_ours.log").write_text(INTRANODE + "Traceback (most recent call last):\n"
                                                 "NotImplementedError: something\n")
    (tmp_path / "low_latency_deepep.rc").write_text("124 150\n")
    text = summary.render(str(tmp_path), "4 x H100")
    assert "| test_intranode.py | PASS (61 s) | FAIL rc=1 (30 s) |" in text
    assert "| test_low_latency.py | TIMEOUT (150 s) | not run |" in text
    assert "| 2 (1) | 2 (1) |" in text
    assert "- intranode_ours: `NotImplementedError: something`" in text
    assert "| default | 110.00 | 110.00 |" in text


@pytest.mark.parametrize("with_deepep", [True, False])
def test_host_time_table(tmp_path, with_deepep):
    rows = {"cached dispatch T=128": 4.0, "combine T=128": 5.0, "LL pair": 20.0}
    for lib, scale in (("moe_dispatcher", 1.0), ("deep_ep", 2.0)) if with_deepep else (("moe_dispatcher", 1.0),):
        for rank in range(2):
            rec = {"device": "H100", "module": lib, "rows": {k: v * scale + rank for k, v in rows.items()}}
            (tmp_path / f"{lib}.rank{rank}.json").write_text(json.dumps(rec))
    found = host_time.collect(str(tmp_path), 2)
    assert found["moe_dispatcher"]["rows"]["LL pair"] == 21.0  # the slowest rank
    text = host_time.render(found, 2, today_cached_us=9.4)
    if with_deepep:
        assert "| LL pair | 21.00 | 41.00 | 0.51 | ratio <= 0.4: NOT met |" in text
    else:
        assert "| LL pair | 21.00 | - | - | ratio <= 0.4: NOT met |" in text
        assert "DeepEP V1 not measured" in text
    assert "| cached dispatch T=128 | 5.00 |" in text and "<= 4.7 us: NOT met" in text
    assert "| combine T=128 | 6.00 |" in text
