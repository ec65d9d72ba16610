"""The training driver, end to end, as a user runs it: torchrun + `-m moe_dispatcher.integrations.megatron.train`.

CPU: a short run of configs/tiny_cpu.yaml on 2 gloo ranks with each of our dispatchers (the loss falls).
GPU: 200 steps of configs/tiny_gpu.yaml with ours and with Megatron's alltoall; the loss curves must agree
within the alltoall run's own run-to-run noise.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (bash tools/install_megatron.sh)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(tmp_path, config: str, nproc: int, *extra: str, env: dict[str, str] | None = None,
           timeout: int = 300) -> dict[str, Any]:
    log = tmp_path / f"run{len(list(tmp_path.iterdir()))}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "moe_dispatcher.integrations.megatron.train", "--config", os.path.join(ROOT, config),
           "--no-progress", "--log-json", str(log), *extra]
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result = json.loads(log.read_text())
    result["stdout"] = proc.stdout
    return result


@pytest.mark.parametrize("dispatcher", ["moe_dispatcher", "moe_dispatcher_ll"])
def test_tiny_cpu_training(tmp_path, dispatcher):
    steps = 30
    res = _train(tmp_path, "configs/tiny_cpu.yaml", 2, "--dispatcher", dispatcher, "--steps", str(steps),
                 "--set", "train.log_interval=5", "--set", "train.warmup_steps=5")
    losses: list[float] = res["losses"]
    assert res["dispatcher"] == f"flex/{dispatcher}"
    assert len(losses) == steps and not any(math.isnan(v) for v in losses), losses
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3, f"loss did not fall: {losses}"
    assert set(res["comm_seconds"]) == {"dispatch", "dispatch.backward", "combine", "combine.backward"}
    assert res["tokens_per_s"] > 0
    out = res["stdout"]
    assert "tok/s" in out and "dispatch" in out and "done: loss" in out, out


# One rank trains two steps; every group our dispatcher was built on must be gone once train() returns.
_RELEASE_CHECK = """
import gc, sys, weakref
from moe_dispatcher.integrations.megatron import buffers, train
seen = []
topology_of = buffers.topology_of
def spy(group):
    seen.append(weakref.ref(group))
    return topology_of(group)
buffers.topology_of = spy
cfg = train.load_config(sys.argv[1], ["train.steps=2", "train.log_interval=1", "train.warmup_steps=1"], None)
train.train(cfg, show_progress=False)
gc.collect()
print("groups seen", len(seen), "alive", sum(r() is not None for r in seen))
"""


def test_training_releases_the_dispatch_group(tmp_path):
    """train() drops the Buffers and Topologies it cached (and the model) before destroying the process groups:
    a group alive after destroy_process_group() is torn down during interpreter exit, after threads it needs,
    and gloo then aborts the finished rank (SIGABRT, a failed torchrun) at random."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", MASTER_PORT=str(port))
    proc = subprocess.run([sys.executable, "-c", _RELEASE_CHECK, os.path.join(ROOT, "configs/tiny_cpu.yaml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("groups seen ") and not last.startswith("groups seen 0 "), proc.stdout[-2000:]
    assert last.endswith(" alive 0"), f"process groups outlive train(): {last}"


def test_tiny_cpu_fp8_dispatch_loss_matches_bf16_dispatch(tmp_path):
    """MOE_DISPATCHER_FP8_DISPATCH=1 against the same run without it (fp32 rows on CPU): 200 steps of
    configs/tiny_cpu.yaml on 2 gloo ranks (about 20 s each here). The losses are not bit-identical (the
    dispatched rows were quantised) but follow the same curve (5.56 -> 0.8): averages over windows of 10 steps
    agree within 3% + 0.01 and every step within 8% (measured on CPU: at most 0.65% / 0.008 over windows,
    2.9% / 0.03 per step)."""
    steps = 200
    runs = {flag: _train(tmp_path, "configs/tiny_cpu.yaml", 2, "--steps", str(steps),
                         "--set", "train.log_interval=50", env={"MOE_DISPATCHER_FP8_DISPATCH": flag})
            for flag in ("0", "1")}
    a, b = torch.tensor(runs["1"]["losses"]), torch.tensor(runs["0"]["losses"])
    assert a.shape == b.shape == (steps,)
    assert runs["1"]["dispatcher"] == "flex/moe_dispatcher fp8-dispatch", runs["1"]["dispatcher"]
    assert runs["0"]["dispatcher"] == "flex/moe_dispatcher", runs["0"]["dispatcher"]
    assert b[-20:].mean() < b[:5].mean() - 2.0, "the unquantised-dispatch run did not learn"
    assert not torch.equal(a, b), "MOE_DISPATCHER_FP8_DISPATCH=1 changed nothing: the rows were not quantised"
    assert bool(((a - b).abs() <= 0.08 * b).all()), f"per-step losses differ: {(a - b).abs().max().item()}"
    wa, wb = a.view(20, 10).mean(1), b.view(20, 10).mean(1)
    assert bool(((wa - wb).abs() <= 0.03 * wb + 0.01).all()), \
        f"loss curves differ: fp8 dispatch {wa.tolist()} vs unquantised {wb.tolist()}"


@pytest.mark.gpu(2)
def test_tiny_gpu_loss_curve_matches_alltoall(tmp_path):
    n = min(torch.cuda.device_count(), 4)
    ours = _train(tmp_path, "configs/tiny_gpu.yaml", n, env={"MOE_DISPATCHER_BACKEND": "kernels"}, timeout=540)
    ref = _train(tmp_path, "configs/tiny_gpu.yaml", n, "--dispatcher", "alltoall", timeout=540)
    a, b = torch.tensor(ours["losses"]), torch.tensor(ref["losses"])
    assert a.shape == b.shape == (200,)
    assert b[-20:].mean() < b[:5].mean() - 1.0, "the reference run did not learn"
    # bf16 runs drift apart slowly (different summation orders): compare averages over windows of 10 steps.
    # The bound is the alltoall run's own noise: two runs of it with the same seed differed by up to 11.8%
    # (0.0275 absolute, in the steep part near loss 0.1-0.3) on 4 x H200 (2026-11-21),
    # while ours repeats bit for bit; ours stayed within 5.6% of either run.
    wa, wb = a.view(20, 10).mean(1), b.view(20, 10).mean(1)
    assert bool(((wa - wb).abs() <= 0.1 * wb + 0.01).all()), \
        f"loss curves differ: ours {wa.tolist()} vs alltoall {wb.tolist()}"


def _compare(tmp_path, config: str, names: str, nproc: int, *extra: str, env: dict[str, str] | None = None,
             timeout: int = 300) -> tuple[dict[str, Any], str]:
    """train.py --compare, as a user runs it; returns (its --log-json, its stdout)."""
    log = tmp_path / "compare.json"
    cmd = [sys.executable, "-m", "moe_dispatcher.integrations.megatron.train", "--config", os.path.join(ROOT, config),
           "--compare", names, "--nproc-per-node", str(nproc), "--log-json", str(log), *extra]
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"--compare failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    return json.loads(log.read_text()), proc.stdout


def test_compare_cpu_grouped_experts(tmp_path):
    """One call runs ours and Megatron's allgather in turn (grouped-GEMM experts), prints tokens/s, the step
    breakdown and the loss curves; alltoall, flex-deepep and ours-pool are reported as skipped on CPU."""
    steps = 12
    out, stdout = _compare(tmp_path, "configs/tiny_cpu.yaml", "ours,allgather,alltoall,flex-deepep,ours-pool", 2,
                           "--steps", str(steps), "--set", "train.log_interval=4", "--set", "train.profile_steps=2",
                           "--set", "model.moe_grouped_gemm=true")
    results = out["results"]
    assert sorted(results) == ["allgather", "ours"] and not out["failed"], out
    assert sorted(out["skipped"]) == ["alltoall", "flex-deepep", "ours-pool"], out["skipped"]
    for name, res in results.items():
        assert len(res["losses"]) == steps and res["tokens_per_s"] > 0, (name, res)
        assert res["profiled_steps"] == 2, res
        breakdown = res["breakdown_ms"]
        assert list(breakdown) == ["router", "dispatch", "permute", "experts", "combine", "rest"], breakdown
        assert all(breakdown[p] > 0 for p in ("router", "dispatch", "experts", "combine", "rest")), (name, breakdown)
        # Each part's costliest kernels (CPU: ops), at most 8, costliest first, and within the part's total.
        # every rank's breakdown, rank 0's being the one above
        assert len(res["breakdown_ms_by_rank"]) == res["world_size"] and res["breakdown_ms_by_rank"][0] == breakdown, res
        assert all(list(r) == list(breakdown) for r in res["breakdown_ms_by_rank"]), res["breakdown_ms_by_rank"]
        top = res["top_kernels_ms"]
        assert list(top) == list(breakdown), top
        for part, rows in top.items():
            assert len(rows) <= 8 and [r[1] for r in rows] == sorted((r[1] for r in rows), reverse=True), rows
            assert sum(r[1] for r in rows) <= breakdown[part] + 1e-3 * len(rows), (part, rows, breakdown[part])
            # launches per step and the longest launch: at least one launch, none longer than the part's total
            assert all(r[2] > 0 and 0 <= r[3] <= r[1] * res["profiled_steps"] + 1e-3 for r in rows), rows
        assert top["experts"] and top["dispatch"], top
    # Same model, data and seed, float32 on CPU: both dispatchers train alike.
    a, b = torch.tensor(results["ours"]["losses"]), torch.tensor(results["allgather"]["losses"])
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a, b)
    assert "GroupedGemmExperts" in stdout, stdout[-3000:]
    for text in ("=== comparison", "step breakdown", "loss curves", "skipped: deep_ep is not importable"):
        assert text in stdout, f"{text!r} not in:\n{stdout[-3000:]}"



def test_gpu_busy_is_the_union_of_kernel_intervals():
    """The step profile's GPU-busy time counts overlapping kernels (concurrent streams) once and gaps not at all."""
    from moe_dispatcher.integrations.megatron.step_profile import covered

    assert covered([]) == 0.0
    assert covered([(0.0, 10.0)]) == 10.0
    assert covered([(5.0, 8.0), (0.0, 10.0), (12.0, 15.0)]) == 13.0  # nested, then a gap of 2
    assert covered([(0.0, 4.0), (3.0, 6.0), (6.0, 7.0)]) == 7.0      # overlapping and touching


def test_host_breakdown_is_the_cpu_time_inside_each_part():
    """The host's wall time inside each MoE part's ranges, nested ranges once, per step; other CPU events and the
    ranges' GPU-side spans do not count; the comparison prints it."""
    from types import SimpleNamespace

    from moe_dispatcher.integrations.megatron import compare
    from moe_dispatcher.integrations.megatron.step_profile import StepProfile

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    rng = lambda lo, hi: SimpleNamespace(start=lo, end=hi)  # noqa: E731
    ev = lambda name, lo, hi, dev=cpu: SimpleNamespace(name=name, device_type=dev, time_range=rng(lo, hi))  # noqa: E731
    profile = StepProfile.__new__(StepProfile)
    profile.profiler = SimpleNamespace(events=lambda: [
        ev("moe.dispatch", 0, 100), ev("moe.dispatch", 40, 60),   # a nested range of the same part counts once
        ev("moe.dispatch.backward", 500, 530),                     # backward ranges count too
        ev("moe.experts", 100, 300), ev("aten::mm", 100, 300),     # ops are not parts
        ev("moe.combine", 300, 310, cuda),                         # a range's GPU-side span is not host time
        ev("moe.combine", 300, 320)])
    profile.num_steps = 2
    got = profile.host_breakdown()
    assert got == {"router": 0.0, "dispatch": 0.065, "permute": 0.0, "experts": 0.1, "combine": 0.01}, got
    text = compare.report({"ours": {"losses": [1.0], "tokens_per_s": 1.0, "step_ms": 1.0, "host_ms": got}}, {}, [])
    assert "host wall time inside the MoE parts" in text and "0.07" in text, text


def test_comparison_speedup_is_over_our_first_run():
    """ "ours x" is ours' tokens/s over each other run's, also when ours ran only with a peer pool."""
    from moe_dispatcher.integrations.megatron import compare
    run = lambda tps: {"losses": [2.0, 1.0], "tokens_per_s": tps, "step_ms": 1.0}  # noqa: E731
    for ours in ("ours", "ours-pool"):
        text = compare.report({ours: run(120.0), "alltoall": run(100.0)}, {}, [])
        row = next(line for line in text.splitlines() if line.startswith("alltoall"))
        assert row.split()[3] == "1.200", text
        assert next(line for line in text.splitlines() if line.startswith(ours)).split()[3] == "-", text


def test_exposed_dispatcher_time_is_what_no_other_kernel_hides(monkeypatch):
    """The dispatcher's exposed time: its kernels' union minus what other kernels (any stream) cover meanwhile,
    over the union of every MoE part; kernels are charged to the part of the CPU op that launched them."""
    from types import SimpleNamespace

    from moe_dispatcher.integrations.megatron import step_profile
    from moe_dispatcher.integrations.megatron.step_profile import StepProfile, exposed_share

    # dispatch 0-10 with experts 5-20 beside it (5 exposed); combine 20-30 alone (10 exposed); the permute 30-32
    # alone (2); rest 40-100 outside the layer
    spans = [("dispatch", 0, 10), ("experts", 5, 20), ("combine", 20, 30), ("permute", 30, 32), ("rest", 40, 100)]
    got = exposed_share(spans, num_steps=1)
    assert got == {"dispatcher_ms": 0.022, "exposed_ms": 0.017, "moe_layer_ms": 0.032,
                   "exposed_fraction": round(17 / 32, 3), "unlinked_ms": 0.0}, got
    assert exposed_share(spans, num_steps=2)["dispatcher_ms"] == 0.011  # per step
    # attention overlapping the combine hides it as well (any other kernel counts), and a router kernel is MoE time
    got = exposed_share([("combine", 0, 10), ("rest", 0, 4), ("router", 8, 12)], num_steps=1)
    assert got["exposed_ms"] == 0.004 and got["moe_layer_ms"] == 0.012, got
    assert exposed_share([], 1) == {} and exposed_share([("rest", 0, 5)], 1) == {}
    # a kernel with no recorded launching op hides nothing and is not MoE time; it is reported apart
    got = exposed_share([("combine", 0, 10), (None, 0, 6)], num_steps=1)
    assert got["exposed_ms"] == 0.01 and got["moe_layer_ms"] == 0.01 and got["unlinked_ms"] == 0.006, got

    # the part of a device event is that of its launching CPU op (correlation id), through the moe.* ranges
    cpu, cuda = step_profile.torch.autograd.DeviceType.CPU, step_profile.torch.autograd.DeviceType.CUDA
    scope = SimpleNamespace(name="moe.combine.backward", cpu_parent=None, id=1, device_type=cpu, kernels=[])
    launch = SimpleNamespace(name="aten::mm", cpu_parent=scope, id=2, device_type=cpu, kernels=["k"])
    plain = SimpleNamespace(name="aten::add", cpu_parent=None, id=3, device_type=cpu, kernels=["k"])
    # a CUDA runtime event (CPU-side, CUPTI's id counter) whose id collides with the op's: torch links no kernel
    # to it, so it is not a launching op (listed after the op, it would otherwise replace it)
    runtime = SimpleNamespace(name="cudaLaunchKernel", cpu_parent=None, id=2, device_type=cpu, kernels=[])

    def raw(linked, lo, hi, annotation=False):  # a raw profiler (kineto) event on the GPU, times in ns
        return SimpleNamespace(device_type=lambda: cuda, linked_correlation_id=lambda: linked,
                               start_ns=lambda: lo * 1000, end_ns=lambda: hi * 1000,
                               is_user_annotation=lambda: annotation)
    kernels = [raw(2, 0, 10), raw(3, 2, 4), raw(99, 20, 30),
               raw(1, 0, 40, annotation=True)]  # the GPU-side span of a record_function range: not device work
    profile = StepProfile.__new__(StepProfile)
    profile.profiler = SimpleNamespace(events=lambda: [scope, launch, plain, runtime],
                                       profiler=SimpleNamespace(kineto_results=SimpleNamespace(
                                           events=lambda: kernels)))
    profile.num_steps = 1
    spans = sorted(profile._device_spans(), key=lambda s: s[1])
    assert spans == [("combine", 0, 10), ("rest", 2, 4), (None, 20, 30)], spans
    monkeypatch.setattr(step_profile.torch.cuda, "is_available", lambda: True)
    assert profile.exposed_dispatcher()["exposed_ms"] == 0.008


def test_compare_keeps_the_runs_done_when_cut_short(tmp_path, monkeypatch):
    """--log-json is written after every run, so a call that times out keeps the dispatchers already measured."""
    from moe_dispatcher.integrations.megatron import compare

    log = tmp_path / "cmp.json"
    seen = []

    def fake_launch(config, overrides, name, nproc, out):
        if name == "alltoall":  # the second run is cut short: by then the first must be on disk
            seen.append(json.loads(log.read_text()))
            raise KeyboardInterrupt
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"losses": [1.0], "tokens_per_s": 10.0}, f)
        return 0

    monkeypatch.setattr(compare, "_launch", fake_launch)
    monkeypatch.setattr(compare, "_unavailable", lambda name: None)
    with pytest.raises(KeyboardInterrupt):
        compare.run("cfg.yaml", [], ["ours", "alltoall"], 2, str(log))
    assert seen and list(seen[0]["results"]) == ["ours"], seen


def test_compare_pool_run_gets_its_environment(monkeypatch):
    """--compare ours-pool launches ours with MOE_DISPATCHER_POOL_BYTES set, and only that run (a value the caller
    exported reaches no run)."""
    from moe_dispatcher.integrations.megatron import compare
    envs = {}

    def fake_run(cmd, check, env):
        envs[cmd[cmd.index("--log-json") + 1]] = env
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(compare.subprocess, "run", fake_run)
    monkeypatch.setenv("MOE_DISPATCHER_POOL_BYTES", "12345")  # exported by the caller: only ours-pool's own counts
    compare._launch("cfg.yaml", [], "ours-pool", 2, "pool.json")
    compare._launch("cfg.yaml", [], "ours", 2, "plain.json")
    assert envs["pool.json"]["MOE_DISPATCHER_POOL_BYTES"] == str(1 << 30)
    assert "MOE_DISPATCHER_POOL_BYTES" not in envs["plain.json"]
