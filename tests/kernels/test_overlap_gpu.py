"""The default SM count with the compiled kernels, the comm stream's priority, and the overlap bench, on GPUs.

- A fresh dispatch without a Config, while Buffer.num_sms is the default, makes a handle of
  config.default_num_sms(R, one NVLink domain, row bytes) / 2 channels; with a patched rule table the choice
  follows it, on every rank alike, and the calls along that handle match the reference (dispatch bit for bit,
  combine within rounding); Buffer.set_num_sms still wins.
- The Buffer's comm stream has the highest priority (DeepEP V1's has too).
- `python -m moe_dispatcher.bench --mode overlap --backend kernels --quick` runs end to end on 2 GPUs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dist import assert_close, assert_equal, make_buffer, run_distributed

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T, H, E, K = 512, 2048, 32, 4


def _world_default_channels(rank: int, world_size: int) -> dict:
    from moe_dispatcher import Buffer
    from moe_dispatcher import config as cfg
    assert cfg.is_default_num_sms(Buffer.num_sms)
    # A rule table with a sweep for this group: the smallest count within the ceiling is 6 SMs (3 channels).
    cfg.NUM_SMS_SWEEPS = {(world_size, True): {4096 * H * 2: {4: 200.0, 6: 104.0, 8: 100.0}}}
    want = cfg.default_num_sms(world_size, True, H * 2)
    assert want == 6
    kb = make_buffer(hidden_bytes=H * 2, backend="kernels", explicitly_destroy=True)
    rb = make_buffer(hidden_bytes=H * 2, backend="reference", explicitly_destroy=True)
    try:
        top = torch.cuda.Stream.priority_range()[1]
        assert kb.get_comm_stream().priority == top, (kb.get_comm_stream().priority, top)
        dev = torch.device("cuda", torch.cuda.current_device())
        g = torch.Generator(device=dev).manual_seed(rank)
        idx = (torch.randn(T, E, device=dev, generator=g).abs() + 1).topk(K, dim=1).indices
        x = torch.randn(T, H, device=dev, generator=g).bfloat16()
        out = {}
        for name, buf in (("kernels", kb), ("reference", rb)):
            n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
            recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                                    num_tokens_per_expert=n_expert, topk_idx=idx)
            again = buf.dispatch(x, handle=handle)[0]
            back = buf.combine(recv, handle)[0]
            out[name] = (recv, again, back, handle)
        channels = out["kernels"][3].backend_state.routing[0]
        assert channels == want // 2, (channels, want)
        for i, what in enumerate(("fresh dispatch", "cached dispatch")):
            assert_equal(out["kernels"][i], out["reference"][i], what, bitwise=True)
        assert_close(out["kernels"][2], out["reference"][2], "combine", rtol=1e-2, atol=1e-2)
        # A count set with set_num_sms wins over the rule.
        Buffer.set_num_sms(8)
        n_rank, _, n_expert, in_rank, _ = kb.get_dispatch_layout(idx, E)
        handle = kb.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
                             topk_idx=idx)[4]
        set_channels = handle.backend_state.routing[0]
        torch.cuda.synchronize()
        return {"channels": channels, "set_channels": set_channels}
    finally:
        dist.barrier()
        kb.destroy()
        rb.destroy()


@pytest.mark.parametrize("world_size", [2, 4])
def test_default_num_sms_makes_the_handle(world_size):
    results = run_distributed(_world_default_channels, world_size, backend="nccl", timeout=180)
    assert all(r == {"channels": 3, "set_channels": 4} for r in results), results


@pytest.mark.gpu(2)
def test_overlap_bench_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "moe_dispatcher.bench", "--mode", "overlap", "--backend", "kernels",
                           "--num-ranks", "2", "--quick", "--num-sms", "4,8", "--json", str(tmp_path / "r.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                                  f"stderr:\n{proc.stderr[-4000:]}")
    assert "## Overlap: GEMMs beside the exchange" in proc.stdout and "(default)" in proc.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    summary = [r for r in doc["records"] if r["section"] == "overlap-summary"]
    assert {r["impl"] for r in summary} == {"nccl", "ours"} and doc["meta"]["backends_used"] == ["intranode"]
    top = str(torch.cuda.Stream.priority_range()[1])
    streams = next(n for n in doc["notes"] if n.startswith("streams:"))
    assert f"comm stream (priority {top})" in streams and "is_high_priority_stream" in streams, streams
    for r in summary:
        assert r["efficiency"] > 0.5 and r["gemm_us"] > 0 and r["together_us"] > 0, r
