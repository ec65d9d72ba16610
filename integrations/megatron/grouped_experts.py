"""MoE experts as two grouped GEMMs (torch's grouped matmul), for Megatron-Core without Transformer Engine.

Megatron-Core 0.19's grouped-GEMM experts (TEGroupedMLP) need Transformer Engine; without it the local layer
spec runs SequentialMLP, one small GEMM per local expert and a host read of the per-expert row counts. This
module computes the same function with one grouped GEMM per projection:

    fc1:  [M, H] rows of expert e  x  W1[e]^T  -> [M, 2F] (gated linear unit) or [M, F]
    act:  act(gate) * up (+ glu_linear_offset), times the row's prob (float32 multiply, cast back)
    fc2:  [M, F] rows of expert e  x  W2[e]^T  -> [M, H]

Weights are one parameter per projection: ``weight1`` [E_local, 2F or F, H] and ``weight2`` [E_local, H, F],
expert e's slice being exactly SequentialMLP's ``local_experts[e].linear_fc{1,2}.weight``
(``load_sequential_mlp_state`` copies one into the other). The row offsets of the experts stay on the device
(a cumulative sum of ``tokens_per_expert``), so the experts add no host sync to a dispatcher that keeps its
counts on the device.

Where the grouped matmul runs: bfloat16 rows on CUDA go to ``torch._grouped_mm`` (autograd included; sm90+).
Other dtypes or devices (CPU tests, float32) take a per-expert loop of ``F.linear``, which is what
SequentialMLP computes, op for op. Expert tensor parallelism (ETP > 1) and linear biases are not supported.

Select it with ``moe_grouped_gemm: true`` in a training config (train.py), or put it in a layer spec with
``use_grouped_gemm_experts(block_spec)``.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether torch's grouped matmul serves rows like ``x``: bfloat16 on a CUDA device of compute
    capability 9.0 or newer (the kernels torch ships)."""
    return (x.dtype == torch.bfloat16 and x.is_cuda and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   counts: list[int] | None) -> torch.Tensor:
    """Rows of expert e times weight[e]^T, experts' rows back to back.

    x: [M, K]; weight: [E, N, K] (each expert's weight as F.linear takes it); offsets: int32 [E] on x's
    device, the end row of each expert (cumulative counts; rows past offsets[-1] are left out of every
    expert); counts: the same counts on the host, needed only by the loop. Returns [M, N] in x's dtype; rows
    past offsets[-1] are zero in the loop and unspecified in the grouped kernel (callers pass M =
    offsets[-1] or ignore those rows).
    """
    if grouped_mm_available(x):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    if counts is None:
        counts = offsets.diff(prepend=offsets.new_zeros(1)).tolist()
    used = sum(counts)
    parts = [F.linear(rows, w) for rows, w in zip(torch.split(x[:used], counts), weight.unbind(0))]
    if used < x.shape[0]:
        parts.append(x.new_zeros(x.shape[0] - used, weight.shape[1]))
    return torch.cat(parts)


class GroupedGemmExperts(MegatronModule):
    """The local experts of an MoE layer as two grouped GEMMs (module docstring).

    Built by MoELayer as ``experts(num_local_experts, config, pg_collection=..., name=...)``; called as
    ``forward(rows [M, H], tokens_per_expert int64 [E_local] (host or device), probs [M]) -> ([M, H], None)``,
    rows in expert-major order (expert e's rows contiguous, experts in local order), as every Megatron
    dispatcher hands them over. Rows past sum(tokens_per_expert) come out as zeros on the loop and are
    never read by combine on the grouped path (dispatchers with fixed row counts count them in the last
    expert; ours also hands the counts without them, which this module uses: forward).
    """

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None,
                 name: str | None = None) -> None:
        super().__init__(config=config)
        refused = [field for field in ("add_bias_linear", "use_te_activation_func", "moe_apply_probs_on_input")
                   if getattr(config, field, False)]
        if config.expert_tensor_parallel_size not in (None, 1):
            refused.append("expert_tensor_parallel_size > 1")
        if getattr(config, "moe_latent_size", None) is not None:
            refused.append("moe_latent_size")
        if config.fp8 or config.fp4:
            refused.append("fp8/fp4")
        if refused:
            raise NotImplementedError(f"{type(self).__name__} does not support {', '.join(refused)}")
        self.num_local_experts = num_local_experts
        ffn = config.moe_ffn_hidden_size
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        dtype = config.params_dtype
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, fc1_out, config.hidden_size,
                                                      device=device, dtype=dtype))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, config.hidden_size, ffn,
                                                      device=device, dtype=dtype))
        expert_parallel = config.expert_model_parallel_size > 1
        for weight, init in ((self.weight1, config.init_method), (self.weight2, config.output_layer_init_method)):
            # Megatron's marks for expert weights: reduced over the expert-data-parallel group, not all of DP.
            weight.allreduce = not expert_parallel
            with _expert_rng(config):
                init(weight.data)

    def forward(self, hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Our dispatcher's fixed row counts (sizing.py) count the rows past the last expert's in the last
        # expert, for Megatron's experts; their ``without_tail`` leaves them out, so the grouped GEMMs compute
        # only rows of some expert (the tail's outputs are never read: zeros on the loop, unspecified on the
        # grouped path, as for any rows past offsets[-1]).
        tokens_per_expert = getattr(tokens_per_expert, "without_tail", tokens_per_expert)
        counts = None
        if not grouped_mm_available(hidden_states):
            counts = tokens_per_expert.tolist()
        if hidden_states.is_cuda and not tokens_per_expert.is_cuda:
            # Host counts (dispatchers that synchronised for them): copy the offsets from pinned memory, so the
            # copy is queued on the stream instead of waiting for it (a pageable copy would).
            offsets = tokens_per_expert.cumsum(0).to(torch.int32).pin_memory().to(hidden_states.device,
                                                                                   non_blocking=True)
        else:
            offsets = tokens_per_expert.to(hidden_states.device).cumsum(0).to(torch.int32)
        h = grouped_linear(hidden_states, self.weight1, offsets, counts)
        h = self._activation(h, permuted_probs)
        return grouped_linear(h, self.weight2, offsets, counts), None

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """MLP.forward's unfused activation, with the probs applied as Megatron's MLP applies its
        per-token scale (the float32 multiply and cast back)."""
        config = self.config
        if config.gated_linear_unit:
            gate, up = torch.chunk(h, 2, dim=-1)
            h = config.activation_func(gate) * (up + config.glu_linear_offset)
        else:
            h = config.activation_func(h)
        return (h * probs.unsqueeze(-1)).to(h.dtype)

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass itself (no delayed wgrad)."""

    def load_sequential_mlp_state(self, sequential) -> None:
        """Copy the weights of a SequentialMLP (same config) into this module."""
        with torch.no_grad():
            for e, expert in enumerate(sequential.local_experts):
                self.weight1[e].copy_(expert.linear_fc1.weight)
                self.weight2[e].copy_(expert.linear_fc2.weight)


def _expert_rng(config):
    """The expert-parallel RNG stream on GPUs (different weights on every EP rank, as Megatron's experts get);
    nothing on CPU initialisation."""
    if config.use_cpu_initialization or not torch.cuda.is_available():
        import contextlib
        return contextlib.nullcontext()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
    return get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())


def use_grouped_gemm_experts(block_spec):
    """Return ``block_spec`` (Megatron's TransformerBlockSubmodules, e.g. from get_gpt_decoder_block_spec) with
    the experts of every MoE layer built as GroupedGemmExperts. Layers without MoE are left as they are."""
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

    layers = []
    for layer in block_spec.layer_specs:
        mlp = layer.submodules.mlp
        if isinstance(mlp, functools.partial) and mlp.func is MoELayer and isinstance(
                mlp.keywords.get("submodules"), MoESubmodules):
            moe = dataclasses.replace(mlp.keywords["submodules"], experts=GroupedGemmExperts)
            mlp = functools.partial(MoELayer, *mlp.args, **{**mlp.keywords, "submodules": moe})
            layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))
        layers.append(layer)
    return dataclasses.replace(block_spec, layer_specs=layers)
