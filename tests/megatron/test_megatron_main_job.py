"""The GPU main job (configs/qwen3_moe_like_4gpu.yaml through train.py --compare), shortened to 40 steps with ours
and Megatron's alltoall: both train and the step breakdown has GPU kernel time in every part. About 3 minutes
on 4 GPUs; kept out of test_megatron_train.py so that tools/gpu_check.sh's budget for that file holds.
"""
from __future__ import annotations

import pytest
import torch
from test_megatron_train import _compare

pytest.importorskip("megatron.core", reason="needs megatron-core (bash tools/install_megatron.sh)")


@pytest.mark.gpu(4)
def test_gpu_main_job_compare(tmp_path):
    out, stdout = _compare(tmp_path, "configs/qwen3_moe_like_4gpu.yaml", "ours,alltoall", 4, "--steps", "40",
                           env={"MOE_DISPATCHER_BACKEND": "kernels"}, timeout=540)
    results = out["results"]
    assert sorted(results) == ["alltoall", "ours"] and not out["failed"], out
    for name, res in results.items():
        losses = torch.tensor(res["losses"])
        assert losses[-5:].mean() < losses[:3].mean() - 0.3, f"{name}: loss did not fall: {res['losses']}"
        assert all(v > 0 for v in res["breakdown_ms"].values()), (name, res["breakdown_ms"])
    print(stdout[stdout.index("=== comparison"):])
