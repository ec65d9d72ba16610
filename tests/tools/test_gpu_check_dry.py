"""tools/gpu_check.sh's control flow without a GPU (DRY=1: every step is listed with its command, none runs):
the steps for N GPUs, $SKIP, the deadline, and the two files it leaves in $OUT."""
import os
import pathlib
import subprocess
import tarfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _check(tmp_path, n, **env):
    out = tmp_path / f"out{n}"
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), str(n)], capture_output=True, text=True,
                          env={**os.environ, "DRY": "1", "OUT": str(out), **env}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.tgz", "summary.txt"]
    with tarfile.open(out / "gpu-check.tgz") as tar:
        assert "gpu-check/summary.txt" in tar.getnames()
    return (out / "summary.txt").read_text()


def test_four_gpus_run_every_family(tmp_path):
    text = _check(tmp_path, 4)
    for step in ("build", "test_intranode", "test_expert_major", "test_low_latency", "test_internode",
                 "test_teardown_faults", "test_teardown", "test_soak", "test_megatron_layer", "test_megatron_train",
                 "bench_normal_4", "bench_normal_2", "bench_ll_4",
                 "bench_ll_2", "bench_internode", "host_profile"):
        assert f"DRY  {step} " in text, step
    assert "-k 4-nvl2 or 4-nvl1" in text and "--nvl-size 2" in text


def test_every_kernel_gpu_test_file_is_a_step(tmp_path):
    """A GPU test file that no step runs is never run by the whole check."""
    text = _check(tmp_path, 4)
    missing = [p.name for p in sorted((ROOT / "tests" / "kernels").glob("test_*_gpu.py")) if p.name not in text]
    assert not missing, f"tests/kernels files no step of tools/gpu_check.sh runs: {missing}"


def test_two_gpus_run_internode_as_two_domains_and_honour_skip(tmp_path):
    text = _check(tmp_path, 2, SKIP="bench_ll_2 host_profile")
    assert "test_internode_gpu.py -k 2-nvl1" in text  # 2 ranks as 2 domains of one GPU
    assert "--num-ranks 2 --nvl-size 1" in text
    assert "SKIP host_profile ($SKIP)" in text


def test_deadline_skips_the_rest(tmp_path):
    text = _check(tmp_path, 8, DEADLINE_S="5")
    assert "SKIP build (deadline)" in text and "SKIP round_trip_profile (deadline)" in text


def test_every_tool_has_a_readme_row():
    """tools/README.md is where a user finds the tools: each script or folder of tools/ has a row there."""
    readme = (ROOT / "tools" / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "tools").iterdir())
               if p.name != "README.md" and not p.name.startswith((".", "__")) and f"`{p.name}" not in readme]
    assert not missing, f"tools without a row in tools/README.md: {missing}"
