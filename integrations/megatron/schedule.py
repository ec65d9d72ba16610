"""One training step's forward and backward over its microbatches: one after the other, or through Megatron-Core's
EP-overlap schedule (``overlap_moe_expert_parallel_comm``).

Without the overlap each microbatch runs forward then backward, its gradients adding to the previous ones;
the loss is each microbatch's mean token loss divided by the number of microbatches, and the MoE auxiliary
losses are scaled alike, exactly as Megatron-Core's own schedule does it (so the two paths compute the same
numbers in the same order).

With ``overlap_moe_expert_parallel_comm: true`` in the model config the step runs through Megatron-Core's
``forward_backward_no_pipelining`` (pipeline parallel size 1), which then takes its combined 1F1B path: the
forward of microbatch i+1 runs layer by layer beside the backward of microbatch i (forward layer j with
backward layer L-1-j), each layer split into schedule nodes -- attention, router and ``dispatch_preprocess``;
``token_dispatch``; ``dispatch_postprocess``, experts and ``combine_preprocess``; ``token_combine`` and
``combine_postprocess`` -- with the dispatch and combine nodes on a second CUDA stream, so that one
microbatch's exchange runs while the other's attention or experts compute. The model's ``build_schedule_plan``
(GPTModel has it) is what the schedule asks ``forward_step`` for. It needs CUDA (streams and events), at least
two microbatches to overlap anything, and what Megatron's config checks ask (bf16 or fp16, EP > 1, the
alltoall or flex dispatcher, no ``moe_shared_expert_overlap``, no recompute); docs/megatron.md.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

Microbatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # tokens, positions, mask, labels


def check_ep_overlap(overlap: bool, num_microbatches: int, on_cuda: bool) -> None:
    """Refuse, with the reason, a step that asks for the EP-overlap schedule where it cannot run or would
    overlap nothing. Megatron's own config checks (dtype, EP size, dispatcher) come when the config is built."""
    if not overlap:
        return
    if not on_cuda:
        raise ValueError("overlap_moe_expert_parallel_comm needs CUDA: Megatron-Core's EP-overlap schedule runs "
                         "dispatch and combine on a second CUDA stream (and allocates on the GPU); leave it off "
                         "on CPU")
    if num_microbatches < 2:
        raise ValueError("overlap_moe_expert_parallel_comm overlaps one microbatch's forward with another's "
                         f"backward: set data.num_microbatches to 2 or more (got {num_microbatches})")


def _token_loss(output: torch.Tensor) -> torch.Tensor:
    """GPTModel's per-token losses [B, S] -> their mean, float32 scalar."""
    return output.float().mean()


def forward_backward(model: torch.nn.Module, config, microbatches: Sequence[Microbatch]) -> torch.Tensor:
    """Run the forward and backward of every microbatch; the gradients accumulate in the parameters (or in the
    DDP wrapper's buffers). Returns the step's loss (the mean over microbatches, float32 scalar, detached).
    ``model``: a GPTModel, or one wrapped in Megatron-Core's DistributedDataParallel; ``config`` its
    TransformerConfig."""
    n = len(microbatches)
    if config.overlap_moe_expert_parallel_comm:
        return _megatron_schedule(model, microbatches)
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # The auxiliary losses' gradient scale, as Megatron's schedules set it (1 / microbatches).
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=microbatches[0][0].device) / n)
    losses = []
    for tokens, positions, mask, labels in microbatches:
        loss = _token_loss(model(tokens, positions, mask, labels=labels))
        losses.append(loss.detach().clone())
        loss /= n  # in place, as Megatron's schedule divides it
        loss.backward()
    return torch.stack(losses).mean()


def _megatron_schedule(model: torch.nn.Module, microbatches: Sequence[Microbatch]) -> torch.Tensor:
    """Megatron-Core's forward_backward_no_pipelining over the microbatches (its EP-overlap path when the config
    asks for it): forward_step hands it a schedule plan instead of an output when asked."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    def loss_func(output: torch.Tensor):
        loss = _token_loss(output)
        # Megatron divides the returned loss in place by the number of microbatches: report a copy.
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator, gpt_model, return_schedule_plan: bool = False):
        tokens, positions, mask, labels = next(data_iterator)
        if return_schedule_plan:
            return gpt_model.build_schedule_plan(tokens, positions, mask, labels=labels), loss_func
        return gpt_model(tokens, positions, mask, labels=labels), loss_func

    tokens = microbatches[0][0]
    reported = forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=iter(microbatches), model=model,
        num_microbatches=len(microbatches), seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0])
    return torch.stack([r["loss"] for r in reported]).mean()
