"""Train one config with several dispatchers in turn and compare them (train.py's ``--compare``).

    python -m moe_dispatcher.integrations.megatron.train --config configs/qwen3_moe_like_4gpu.yaml \
        --compare ours,alltoall,allgather,flex-deepep

Each dispatcher gets its own torchrun of the training driver (a fresh process group, fresh GPU memory), with
the same config, seed and data; the runs go one after the other in this one call. At the end it prints, per
dispatcher: tokens/s, our speed-up over it, the profiler's step breakdown (router, dispatch, permute,
experts, combine, rest; step_profile.py) and the loss curves side by side. ``flex-deepep`` (Megatron's flex
dispatcher on DeepEP V1) runs only when ``deep_ep`` is importable (put its build on PYTHONPATH); otherwise it
is reported as skipped. ``ours-pool`` is ours with a peer pool (RUN_ENV; GPUs only). ``ours-overlap`` and
``alltoall-overlap`` run ours and Megatron's alltoall through
Megatron's EP-overlap schedule (``overlap_moe_expert_parallel_comm``; GPUs only, with ``--set
data.num_microbatches=2`` or more, which the plain runs then use as well, so that every run trains on the same
microbatches).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

# name -> the train.py overrides that select it; "-overlap": the steps run through Megatron's EP-overlap schedule
# (schedule.py; GPUs, data.num_microbatches >= 2)
EP_OVERLAP = "model.overlap_moe_expert_parallel_comm=true"
RUNS: dict[str, list[str]] = {
    "ours": ["model.moe_token_dispatcher_type=moe_dispatcher"],
    "ours-overlap": ["model.moe_token_dispatcher_type=moe_dispatcher", EP_OVERLAP],
    "alltoall": ["model.moe_token_dispatcher_type=alltoall"],
    "alltoall-overlap": ["model.moe_token_dispatcher_type=alltoall", EP_OVERLAP],
    "allgather": ["model.moe_token_dispatcher_type=allgather"],
    "flex-deepep": ["model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=deepep"],
    "ours-pool": ["model.moe_token_dispatcher_type=moe_dispatcher"],
}
# name -> environment of its run: "ours-pool" gives the dispatcher's Buffers a 1 GiB peer pool (direct dispatch and
# pull combine; MOE_DISPATCHER_POOL_BYTES), enough for the configs in configs/
RUN_ENV: dict[str, dict[str, str]] = {"ours-pool": {"MOE_DISPATCHER_POOL_BYTES": str(1 << 30)}}
PARTS = ("router", "dispatch", "permute", "experts", "combine", "rest")


def _nproc(requested: int | None) -> int:
    if requested:
        return requested
    import torch
    return torch.cuda.device_count() or 2


def _unavailable(name: str) -> str | None:
    """Why `name` cannot run here, or None."""
    import torch
    if name == "flex-deepep" and importlib.util.find_spec("deep_ep") is None:
        return "deep_ep is not importable (put DeepEP V1's build on PYTHONPATH)"
    if name.endswith("-overlap") and not torch.cuda.is_available():
        return "needs CUDA (Megatron's EP-overlap schedule uses CUDA streams)"
    if name in ("alltoall", "flex-deepep") and not torch.cuda.is_available():
        return "needs CUDA (Megatron's dispatcher uses CUDA streams)"
    if name == "ours-pool" and not torch.cuda.is_available():
        return "needs CUDA (the peer pool is memory every GPU has mapped)"
    return None


def _launch(config: str, overrides: list[str], name: str, nproc: int, log: str) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "moe_dispatcher.integrations.megatron.train", "--config", config, "--no-progress",
           "--log-json", log]
    for item in [*overrides, *RUNS[name]]:
        cmd += ["--set", item]
    print(f"\n=== {name}: {' '.join(cmd[3:])}", flush=True)
    # Every run gets exactly its RUN_ENV entries of the variables any run sets (a caller's exported
    # MOE_DISPATCHER_POOL_BYTES must not turn "ours" into "ours-pool").
    env = {k: v for k, v in os.environ.items() if not any(k in e for e in RUN_ENV.values())}
    env.update({"OMP_NUM_THREADS": "1", **RUN_ENV.get(name, {})})
    return subprocess.run(cmd, check=False, env=env).returncode


def run(config: str, overrides: list[str], names: list[str], nproc: int | None,
        log_json: str | None = None) -> bool:
    """Run each named dispatcher (RUNS) in turn, print the comparison; True when every run that could run
    succeeded. log_json: write {name: result} there."""
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"--compare: unknown {unknown}; choose from {', '.join(RUNS)}")
    nproc = _nproc(nproc)
    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="moe_compare_") as tmp:
        for name in names:
            why = _unavailable(name)
            if why:
                skipped[name] = why
                print(f"\n=== {name}: skipped: {why}", flush=True)
                continue
            log = os.path.join(tmp, f"{name}.json")
            if _launch(config, overrides, name, nproc, log) != 0 or not os.path.exists(log):
                failed.append(name)
                continue
            with open(log, encoding="utf-8") as f:
                results[name] = json.load(f)
            _write(log_json, results, skipped, failed)  # after each run: a call cut short keeps the runs done
    print(report(results, skipped, failed), flush=True)
    _write(log_json, results, skipped, failed)
    return not failed


def _write(log_json: str | None, results: dict, skipped: dict, failed: list) -> None:
    if log_json:
        with open(log_json, "w", encoding="utf-8") as f:
            json.dump({"results": results, "skipped": skipped, "failed": failed}, f, indent=1)


def report(results: dict[str, dict[str, Any]], skipped: dict[str, str], failed: list[str]) -> str:
    """The comparison as text: throughput table, step breakdown, loss curves."""
    lines = ["", "=== comparison (same config, seed and data; one run each, in turn)"]
    # "ours x" is over our first run in the comparison ("ours", else "ours-pool", ...): a comparison without the
    # plain run still shows its speed-ups.
    ours_name = next((n for n in results if n == "ours"), next((n for n in results if n.startswith("ours")), None))
    ours = (results.get(ours_name) or {}).get("tokens_per_s") if ours_name else None
    lines.append(f"{'dispatcher':<18}{'tokens/s':>10}{'ms/step':>9}{'ours x':>8}{'loss first':>12}{'loss last':>11}")
    for name, r in results.items():
        tps = r.get("tokens_per_s")
        speedup = f"{ours / tps:.3f}" if ours and tps and name != ours_name else "-"
        lines.append(f"{name:<18}{tps or 0:>10.0f}{r.get('step_ms') or 0:>9.1f}{speedup:>8}{r['losses'][0]:>12.4f}"
                     f"{r['losses'][-1]:>11.4f}")
    for name, why in skipped.items():
        lines.append(f"{name:<18} skipped: {why}")
    for name in failed:
        lines.append(f"{name:<18} FAILED (its output is above)")
    profiled = {n: r for n, r in results.items() if r.get("breakdown_ms")}
    if profiled:
        first = next(iter(profiled.values()))
        lines += ["", (f"step breakdown, {first.get('breakdown_unit')} on rank 0 over {first.get('profiled_steps')} "
                       "profiled steps (concurrent streams add up; step_profile.py); GPU busy: the share of the "
                       "profiled steps' wall time in which the GPU ran anything; exposed: the share of the MoE "
                       "layers' GPU time in which the dispatcher's kernels (dispatch, permute, combine) run alone"),
                  f"{'dispatcher':<18}" + "".join(f"{p:>10}" for p in PARTS) + f"{'sum':>10}{'wall':>10}{'GPU busy':>10}"
                  f"{'exposed':>10}"]
        for name, r in profiled.items():
            b = r["breakdown_ms"]
            busy = (r.get("gpu_busy") or {}).get("busy_fraction")
            exposed = (r.get("exposed_dispatcher") or {}).get("exposed_fraction")
            lines.append(f"{name:<18}" + "".join(f"{b.get(p, 0):>10.2f}" for p in PARTS)
                         + f"{sum(b.values()):>10.2f}{r.get('step_ms') or 0:>10.1f}"
                         + (f"{100 * busy:>9.0f}%" if busy is not None else f"{'-':>10}")
                         + (f"{100 * exposed:>9.0f}%" if exposed is not None else f"{'-':>10}"))
    hosted = {n: r for n, r in results.items() if r.get("host_ms")}
    if hosted:
        host_parts = [p for p in PARTS if p != "rest"]
        lines += ["", "host wall time inside the MoE parts, ms per profiled step on rank 0 (forward and backward; host "
                      "syncs included)",
                  f"{'dispatcher':<18}" + "".join(f"{p:>10}" for p in host_parts)]
        for name, r in hosted.items():
            lines.append(f"{name:<18}" + "".join(f"{r['host_ms'].get(p, 0):>10.2f}" for p in host_parts))
    if results:
        names = list(results)
        steps = max(len(r["losses"]) for r in results.values())
        every = max(1, steps // 20)
        lines += ["", f"loss curves (mean over all ranks, every {every} steps)", f"{'step':>6}" + "".join(f"{n:>18}" for n in names)]
        for i in list(range(0, steps, every)) + ([steps - 1] if (steps - 1) % every else []):
            lines.append(f"{i + 1:>6}" + "".join(f"{results[n]['losses'][i]:>18.4f}" if i < len(results[n]['losses'])
                                                else f"{'':>18}" for n in names))
    return "\n".join(lines)
