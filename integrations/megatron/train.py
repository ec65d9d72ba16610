"""Train a GPT-MoE with Megatron-Core and moe_dispatcher, from a YAML config; or compare dispatchers on it.

    torchrun --nproc_per_node 2 -m moe_dispatcher.integrations.megatron.train --config configs/tiny_cpu.yaml
    python -m moe_dispatcher.integrations.megatron.train --config configs/qwen3_moe_like_4gpu.yaml \
        --compare ours,alltoall,allgather,flex-deepep      # each in turn, one torchrun each (compare.py)

On a CPU-only machine it runs on gloo with the reference backend; with GPUs on NCCL with the kernels,
Megatron's DDP and distributed optimizer (Trainer). It prints the loss, tokens/s and the time spent in
dispatch and combine (forward and backward; timing.py, on in the timed steps only), with a progress bar,
and, with train.profile_steps, a profiler breakdown of the step (step_profile.py). The data are synthetic
and learnable: each sequence counts up from a random start with a random stride (mod the vocabulary), so
the loss falls well below ln(vocab) within a few hundred steps.

The config has four sections (configs/tiny_cpu.yaml shows them all):
  model:    TransformerConfig fields, passed as they are (moe_token_dispatcher_type selects the dispatcher;
            moe_grouped_gemm: true the grouped-GEMM experts of grouped_experts.py; params_dtype as a
            string, activation_func by name), plus vocab_size.
  parallel: tensor_model_parallel_size, expert_model_parallel_size ("world": all ranks),
            expert_tensor_parallel_size; the data-parallel size is what remains.
  data:     seq_length, micro_batch_size (sequences per microbatch and data-parallel rank), num_microbatches
            (per step: their gradients add up before the optimizer step; 1), max_stride.
  train:    steps, lr, weight_decay, warmup_steps, seed, log_interval, clip_grad (gradient-norm clipping,
            1.0), profile_steps (the last N steps run under torch.profiler for the breakdown; 0: none).
`--set section.key=value` overrides one entry (YAML syntax for the value); `--dispatcher NAME` is short for
`--set model.moe_token_dispatcher_type=NAME`. `model.overlap_moe_expert_parallel_comm: true` runs each step
through Megatron-Core's EP-overlap schedule (GPUs, data.num_microbatches >= 2; schedule.py).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

from . import compare, schedule

ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "squared_relu": lambda x: F.relu(x) ** 2}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
SECTIONS = ("model", "parallel", "data", "train")
DEFAULTS: dict[str, dict[str, Any]] = {
    "model": {"vocab_size": 256},
    "parallel": {"tensor_model_parallel_size": 1, "expert_model_parallel_size": "world",
                 "expert_tensor_parallel_size": 1},
    "data": {"seq_length": 64, "micro_batch_size": 4, "num_microbatches": 1, "max_stride": 8},
    "train": {"steps": 300, "lr": 1e-3, "weight_decay": 0.0, "warmup_steps": 10, "seed": 1234, "log_interval": 25,
              "clip_grad": 1.0, "profile_steps": 0},
}


# ----------------------------------------------------------------------------- config
def load_config(path: str, overrides: list[str], dispatcher: str | None) -> dict[str, dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    unknown = set(raw) - set(SECTIONS)
    if unknown:
        raise ValueError(f"{path}: unknown sections {sorted(unknown)}; expected {list(SECTIONS)}")
    cfg = {s: {**DEFAULTS[s], **{k: _scalar(v) for k, v in (raw.get(s) or {}).items()}} for s in SECTIONS}
    if dispatcher:
        overrides = [f"model.moe_token_dispatcher_type={dispatcher}", *overrides]
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or section not in SECTIONS:
            raise ValueError(f"--set {item!r}: expected section.key=value with section in {list(SECTIONS)}")
        cfg[section][name] = _scalar(yaml.safe_load(value))
    return cfg


def _scalar(value: Any) -> Any:
    """YAML reads 1e-3 as a string (it wants 1.0e-3): take such strings as numbers."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def transformer_config(model: dict[str, Any], parallel: dict[str, int]):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = {k: v for k, v in model.items() if k != "vocab_size"}
    for key in ("params_dtype", "pipeline_dtype"):
        if isinstance(kwargs.get(key), str):
            kwargs[key] = DTYPES[kwargs[key]]
    if isinstance(kwargs.get("activation_func"), str):
        kwargs["activation_func"] = ACTIVATIONS[kwargs["activation_func"]]
    kwargs.setdefault("use_cpu_initialization", not torch.cuda.is_available())
    kwargs.setdefault("hidden_dropout", 0.0)
    kwargs.setdefault("attention_dropout", 0.0)
    tp = parallel["tensor_model_parallel_size"]
    return TransformerConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                             expert_model_parallel_size=parallel["expert_model_parallel_size"],
                             expert_tensor_parallel_size=parallel["expert_tensor_parallel_size"], **kwargs)


# ----------------------------------------------------------------------------- distributed setup
def init_distributed() -> torch.device:
    if "RANK" not in os.environ:  # a plain `python -m ...`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def init_model_parallel(parallel: dict[str, Any], seed: int) -> None:
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    tp, etp = parallel["tensor_model_parallel_size"], parallel["expert_tensor_parallel_size"]
    if parallel["expert_model_parallel_size"] == "world":
        parallel["expert_model_parallel_size"] = world // etp
    ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                 expert_model_parallel_size=parallel["expert_model_parallel_size"],
                                 expert_tensor_parallel_size=etp)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(seed)


# ----------------------------------------------------------------------------- model and data
def build_model(config, vocab_size: int, seq_length: int, device: torch.device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    if config.moe_grouped_gemm:  # the local spec would run SequentialMLP: use the grouped-GEMM experts
        from moe_dispatcher.integrations.megatron.grouped_experts import use_grouped_gemm_experts
        spec = use_grouped_gemm_experts(spec)
    model = GPTModel(config, spec, vocab_size=vocab_size, max_sequence_length=seq_length,
                     position_embedding_type="rope")
    return model.to(device)


def synthetic_batch(step: int, data: dict[str, Any], vocab: int, seed: int, dp_rank: int, device: torch.device):
    """Counting sequences: token t = (start + t * stride) mod vocab. Different per data-parallel rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + dp_rank * 10_007 + step)
    b, s = data["micro_batch_size"], data["seq_length"]
    start = torch.randint(0, vocab, (b, 1), generator=g)
    stride = torch.randint(1, data["max_stride"] + 1, (b, 1), generator=g)
    seq = (start + stride * torch.arange(s + 1)) % vocab
    tokens, labels = seq[:, :-1].to(device), seq[:, 1:].to(device)
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
    return tokens, positions, causal, labels


# ----------------------------------------------------------------------------- optimisation
class Trainer:
    """The model wrapped for data parallelism, its optimizer and learning-rate schedule.

    On GPUs, Megatron-Core's own, as Megatron-LM sets them up: DistributedDataParallel keeps the gradients
    in contiguous float32 buffers, reduced over data parallel for dense parameters and over expert data
    parallel for expert ones, and the distributed optimizer (Adam on float32 master weights, sharded over
    data parallel: reduce-scatter of the gradients, all-gather of the updated parameters; gradient clipping
    at ``train.clip_grad``). finalize_model_grads does what Megatron's schedules do after the backward:
    finish the gradient reduction and update the routers' expert bias when the config enables it.

    On CPU (gloo) Megatron's optimizers cannot run (they allocate on CUDA): the stand-in is AdamW on float32
    master weights with the same reductions done explicitly (CPUOptimizer).

    The learning rate warms up linearly over ``train.warmup_steps``, then follows a cosine to a tenth of
    ``train.lr`` at ``train.steps``.
    """

    def __init__(self, model: torch.nn.Module, config, train: dict[str, Any]) -> None:
        self.lr, self.warmup, self.steps = train["lr"], train["warmup_steps"], train["steps"]
        if not torch.cuda.is_available():
            self.model, self.optimizer = model, CPUOptimizer(model, config, train)
            return
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        self.model = DistributedDataParallel(config, ddp_config, model)
        opt_config = OptimizerConfig(optimizer="adam", lr=train["lr"], weight_decay=train["weight_decay"],
                                     adam_beta1=0.9, adam_beta2=0.95, bf16=config.params_dtype == torch.bfloat16,
                                     params_dtype=config.params_dtype, use_distributed_optimizer=True,
                                     clip_grad=train["clip_grad"])
        self.optimizer = get_megatron_optimizer(opt_config, [self.model], use_gloo_process_groups=False)

    def zero_grad(self) -> None:
        if isinstance(self.optimizer, CPUOptimizer):
            self.model.zero_grad(set_to_none=True)
            return
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self, step: int) -> None:
        warm = min(1.0, (step + 1) / max(1, self.warmup))
        decay = 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, self.steps))))
        lr = self.lr * warm * (0.1 + 0.9 * decay)
        if isinstance(self.optimizer, CPUOptimizer):
            self.optimizer.step(lr)
            return
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()


class CPUOptimizer:
    """AdamW on fp32 master weights, with Megatron's gradient reductions done explicitly (the CPU stand-in
    for Megatron's optimizer): sequence-parallel params (norms, router) summed over TP, dense params averaged
    over data parallel, expert params (``param.allreduce == False``) averaged over expert data parallel, the
    gradient norm clipped to ``train.clip_grad``. Also updates the routers' expert bias when the config
    enables it, as Megatron's finalize_model_grads does."""

    def __init__(self, model: torch.nn.Module, config, train: dict[str, Any]) -> None:
        from megatron.core import parallel_state as ps

        self.model, self.config, self.clip = model, config, train["clip_grad"]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone() if p.dtype != torch.float32 else p for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=train["lr"], weight_decay=train["weight_decay"],
                                     betas=(0.9, 0.95))
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.edp_group = ps.get_expert_data_parallel_group()

    def step(self, lr: float) -> None:
        for p, m in zip(self.params, self.master):
            g = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            if getattr(p, "sequence_parallel", False) and dist.get_world_size(self.tp_group) > 1:
                dist.all_reduce(g, group=self.tp_group)
            group = self.dp_group if getattr(p, "allreduce", True) else self.edp_group
            if dist.get_world_size(group) > 1:
                dist.all_reduce(g, group=group)
                g /= dist.get_world_size(group)
            p.grad = None
            m.grad = g  # (m may be p itself)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.master, self.clip)  # (rank-local norm: a stand-in)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if p is not m:
                    p.copy_(m)
        if self.config.moe_router_enable_expert_bias:  # aux-loss-free balancing (DeepSeek-V3), per step
            from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
            _update_router_expert_bias([self.model], self.config)


# ----------------------------------------------------------------------------- main loop
def progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in requirements/megatron.txt; without it, the log lines still appear
        return None
    # disable=None: no bar when stdout is not a terminal (logs, CI), where the log lines suffice
    return tqdm(total=total, unit="step", file=sys.stdout, disable=None)


def say(bar, text: str) -> None:
    if bar is not None:
        bar.write(text)
    else:
        print(text, flush=True)


def train(cfg: dict[str, dict[str, Any]], show_progress: bool = True, log_json: str | None = None) -> dict[str, Any]:
    """Train `cfg` on this rank (torchrun's environment) and return rank 0's result dict (every rank returns its
    own); the process groups are destroyed at the end."""
    device = init_distributed()
    result = _train(cfg, device, show_progress, log_json)
    from megatron.core import parallel_state as ps

    from moe_dispatcher.integrations.megatron.buffers import destroy_buffers
    # The model, its dispatchers and our cached Buffers hold the process groups: destroy and drop them first. A
    # group alive after destroy_process_group() is torn down during interpreter exit, after threads it needs
    # (gloo then aborts the finished process with SIGABRT, and torchrun reports a failure). (megatron-core 0.19
    # itself keeps a few of its groups alive past destroy_model_parallel(); those are Megatron's.)
    destroy_buffers()
    gc.collect()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return result


def _train(cfg: dict[str, dict[str, Any]], device: torch.device, show_progress: bool,
           log_json: str | None) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from moe_dispatcher.integrations.megatron import comm_timer, cpu, guard, megatron_topology
    from moe_dispatcher.integrations.megatron.step_profile import StepProfile
    on_cpu = cpu.enable()
    model_cfg, parallel, data, train_cfg = cfg["model"], cfg["parallel"], cfg["data"], cfg["train"]
    num_microbatches = data["num_microbatches"]
    schedule.check_ep_overlap(bool(model_cfg.get("overlap_moe_expert_parallel_comm")), num_microbatches,
                              device.type == "cuda")
    init_model_parallel(parallel, train_cfg["seed"])
    torch.manual_seed(train_cfg["seed"])
    config = transformer_config(model_cfg, parallel)
    model = build_model(config, model_cfg["vocab_size"], data["seq_length"], device)
    profile = StepProfile(model)
    trainer = Trainer(model, config, train_cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    kind = dispatcher_label(config)
    topo = megatron_topology()
    tokens_per_step = data["micro_batch_size"] * data["seq_length"] * num_microbatches * dp_size
    steps, log_every = train_cfg["steps"], train_cfg["log_interval"]
    # The last profile_steps steps run under torch.profiler and are left out of tokens/s.
    profile_steps = min(train_cfg["profile_steps"], max(0, steps - 2 * log_every))
    timed_steps = steps - profile_steps
    bar = progress(steps, show_progress and rank == 0)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        experts = type(next((m.experts for m in profile.layers), None)).__name__
        say(bar, f"GPT-MoE: {config.num_layers} layers ({len(profile.layers)} MoE), hidden {config.hidden_size}, "
                 f"{config.num_moe_experts} experts top-{config.moe_router_topk} ({experts}), "
                 f"{n_params / 1e6:.2f}M params on rank 0 | {world} ranks "
                 f"({'gloo, CPU' if on_cpu else 'NCCL, GPU'}): TP {config.tensor_model_parallel_size}, EP "
                 f"{config.expert_model_parallel_size}, ETP {config.expert_tensor_parallel_size}, DP {dp_size} | "
                 f"dispatcher {kind} | optimizer {type(trainer.optimizer).__name__} | NVLink domains of "
                 f"{topo.nvl_size} ({topo.source}) | {tokens_per_step} tokens/step in {num_microbatches} "
                 f"microbatch{'es' if num_microbatches > 1 else ''}")
    comm_timer.enable()
    comm_timer.summary()
    losses: list[float] = []
    window_start, window_tokens, measured = time.perf_counter(), 0, {"time": 0.0, "tokens": 0}
    comm_total: dict[str, float] = {}
    allocator_from: dict[str, int] | None = None
    for step in range(steps):
        if step == min(log_every, steps - 1):  # after the first window (warm-up: buffer creation, first calls)
            allocator_from = allocator_syncs(device)
        if step == timed_steps and profile_steps:
            # The profiled steps' comm times are never read (the log windows end at timed_steps), and the timer's
            # marks (CUDA events, identity autograd nodes around every exchange) are host work that Megatron's
            # dispatchers do not do: off, so that the profile charges our dispatcher only its own work.
            comm_timer.enable(False)
            profiling = profile.steps(profile_steps)
            profiling.__enter__()
        microbatches = [synthetic_batch(step * num_microbatches + i, data, model_cfg["vocab_size"], train_cfg["seed"],
                                        dp_rank, device) for i in range(num_microbatches)]
        trainer.zero_grad()
        # Fixed-size expert rows (bound sizing, a capacity factor) are checked at the step's end (guard.py).
        loss = guard.run_step(lambda batches=microbatches: schedule.forward_backward(trainer.model, config, batches))
        trainer.step(step)
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / world)
        window_tokens += tokens_per_step
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if step + 1 <= timed_steps and ((step + 1) % log_every == 0 or step + 1 == timed_steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - window_start
            comm = comm_timer.summary()
            n = log_every if (step + 1) % log_every == 0 else (step + 1) % log_every
            if step + 1 > log_every:  # the first window holds warm-up (buffer creation, first calls)
                measured["time"] += elapsed
                measured["tokens"] += window_tokens
                for name, seconds in comm.items():
                    comm_total[name] = comm_total.get(name, 0.0) + seconds
            if rank == 0:
                ms = {name: 1e3 * s / n for name, s in comm.items()}
                say(bar, f"step {step + 1:5d}/{steps} | loss {losses[-1]:.4f} | {window_tokens / elapsed:9.0f} tok/s | "
                         f"{1e3 * elapsed / n:7.1f} ms/step | dispatch {ms.get('dispatch', 0):6.2f} + bwd "
                         f"{ms.get('dispatch.backward', 0):6.2f} ms | combine {ms.get('combine', 0):6.2f} + bwd "
                         f"{ms.get('combine.backward', 0):6.2f} ms")
            window_start, window_tokens = time.perf_counter(), 0
    if profile_steps:
        profiling.__exit__(None, None, None)
    if bar is not None:
        bar.close()
    comm_timer.enable(False)
    step_ms = 1e3 * measured["time"] / (measured["tokens"] / tokens_per_step) if measured["tokens"] else None
    result = {"dispatcher": kind, "world_size": world, "steps": steps, "num_microbatches": num_microbatches,
              "losses": losses,
              "tokens_per_s": measured["tokens"] / measured["time"] if measured["time"] else None,
              "step_ms": step_ms, "breakdown_ms": profile.breakdown(), "top_kernels_ms": profile.top_kernels(),
              "gpu_busy": profile.gpu_busy(), "exposed_dispatcher": profile.exposed_dispatcher(),
              "host_ms": profile.host_breakdown(),
              "profiled_steps": profile_steps,
              "breakdown_unit": "CPU op ms/step" if on_cpu else "GPU kernel ms/step",
              "comm_seconds": comm_total, "measured_seconds": measured["time"],
              "allocator_per_step": allocator_per_step(allocator_from, allocator_syncs(device),
                                                       steps - min(log_every, steps - 1))}
    # Every rank's breakdown (a collective on every rank): a kernel that waits for its peers (the first
    # synchronising kernel of a layer) is long on the ranks that arrive early and short on the late one, so the
    # ranks' figures side by side tell the ranks' skew from the exchange's own work.
    by_rank: list = [None] * world
    dist.all_gather_object(by_rank, {"breakdown_ms": result["breakdown_ms"],
                                     "busy_fraction": result["gpu_busy"].get("busy_fraction")})
    result["breakdown_ms_by_rank"] = [r["breakdown_ms"] for r in by_rank]
    result["gpu_busy_by_rank"] = [r["busy_fraction"] for r in by_rank]
    if rank == 0:
        comm_s = sum(comm_total.values())
        share = f"{100 * comm_s / measured['time']:.1f}% of" if measured["time"] else "n/a of"
        tps = f"{result['tokens_per_s']:.0f}" if result["tokens_per_s"] else "n/a"
        print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} | {tps} tokens/s after warm-up | "
              f"dispatch+combine (fwd+bwd) {comm_s:.2f} s = {share} the measured time", flush=True)
        if result["breakdown_ms"]:
            parts = " | ".join(f"{part} {ms:.2f}" for part, ms in result["breakdown_ms"].items())
            print(f"step breakdown over {profile_steps} profiled steps ({result['breakdown_unit']}, rank 0): {parts}",
                  flush=True)
        if result["breakdown_ms"] and world > 1:
            parts = " | ".join(f"{part} " + " / ".join(f"{r.get(part, 0.0):.2f}" for r in result["breakdown_ms_by_rank"])
                               for part in ("dispatch", "permute", "combine", "experts"))
            print(f"the same by rank (ranks 0..{world - 1}): {parts}", flush=True)
        if result["host_ms"]:
            parts = " | ".join(f"{part} {ms:.2f}" for part, ms in result["host_ms"].items())
            print(f"host wall time inside the MoE parts (ms per profiled step, rank 0): {parts}", flush=True)
        alloc = result["allocator_per_step"]
        if alloc:
            print(f"CUDA allocator per step after warm-up (rank 0): {alloc['num_alloc_retries']:.1f} retries, "
                  f"{alloc['num_ooms']:.1f} out-of-memory errors (a full peer pool included), "
                  f"{alloc['num_sync_all_streams']:.1f} all-stream syncs, {alloc['num_device_free']:.1f} device frees "
                  "(each a host wait for the GPU)", flush=True)
        busy = result["gpu_busy"]
        if busy:
            print(f"GPU busy {busy['busy_ms']:.1f} of {busy['wall_ms']:.1f} ms per profiled step "
                  f"({100 * busy['busy_fraction']:.0f}%, rank 0; the rest the GPU waits for the host)", flush=True)
        exposed = result["exposed_dispatcher"]
        if exposed:
            print(f"dispatcher exposed {exposed['exposed_ms']:.1f} ms per profiled step (of its {exposed['dispatcher_ms']:.1f} "
                  f"ms): {100 * exposed['exposed_fraction']:.0f}% of the MoE layers' {exposed['moe_layer_ms']:.1f} ms "
                  "(rank 0; exposed: no other kernel runs meanwhile)", flush=True)
        if log_json:
            with open(log_json, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
    return result


ALLOCATOR_SYNC_STATS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_free")


def allocator_syncs(device: torch.device) -> dict[str, int] | None:
    """The CUDA caching allocator's counters of events that cost the host (an allocation retry frees cached blocks
    after synchronising; an out-of-memory error, e.g. a full peer pool's, queries the device's memory and raises
    inside torch), or None off CUDA."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(name, 0)) for name in ALLOCATOR_SYNC_STATS}


def allocator_per_step(start: dict[str, int] | None, end: dict[str, int] | None,
                       steps: int) -> dict[str, float] | None:
    if start is None or end is None or steps <= 0:
        return None
    return {name: (end[name] - start[name]) / steps for name in ALLOCATOR_SYNC_STATS}


def dispatcher_label(config) -> str:
    """"alltoall", "allgather" or "flex/<backend>" (how the config's dispatcher reads after registration), with
    " fp8-dispatch" when ours dispatches FP8 rows ($MOE_DISPATCHER_FP8_DISPATCH) and " ep-overlap" when the
    steps run through Megatron's EP-overlap schedule."""
    label = _dispatcher_name(config)
    if config.overlap_moe_expert_parallel_comm:
        label += " ep-overlap"
    return label


def _dispatcher_name(config) -> str:
    from moe_dispatcher.env import env_flag
    from moe_dispatcher.integrations.megatron.dispatcher import FP8_DISPATCH_ENV

    if config.moe_token_dispatcher_type == "flex":
        label = f"flex/{config.moe_flex_dispatcher_backend}"
        if config.moe_flex_dispatcher_backend == "moe_dispatcher" and env_flag(FP8_DISPATCH_ENV):
            label += " fp8-dispatch"
        return label
    return config.moe_token_dispatcher_type


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config entry (repeatable)")
    parser.add_argument("--dispatcher", help="moe_token_dispatcher_type to use instead of the config's")
    parser.add_argument("--steps", type=int, help="number of steps (same as --set train.steps=N)")
    parser.add_argument("--log-json", help="rank 0 writes the loss curve and timings here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar, log lines only")
    parser.add_argument("--compare", metavar="NAMES",
                        help="run the config once per dispatcher, in turn, and compare them: a comma-separated "
                             f"list of {', '.join(compare.RUNS)} (each its own torchrun of --nproc-per-node ranks)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="with --compare: ranks per run (default: the visible GPUs, else 2)")
    args = parser.parse_args(argv)
    overrides = list(args.set) + ([f"train.steps={args.steps}"] if args.steps is not None else [])
    if args.compare:
        if args.dispatcher:
            parser.error("--compare runs each dispatcher it names; leave out --dispatcher")
        ok = compare.run(args.config, overrides, args.compare.split(","), args.nproc_per_node, args.log_json)
        sys.exit(0 if ok else 1)
    cfg = load_config(args.config, overrides, args.dispatcher)
    # Megatron warns about optional packages it runs without (Transformer Engine, apex).
    warnings.filterwarnings("ignore", module="megatron")
    train(cfg, show_progress=not args.no_progress, log_json=args.log_json)


if __name__ == "__main__":
    main()
