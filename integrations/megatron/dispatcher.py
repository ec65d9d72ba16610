"""Megatron-Core token dispatchers on moe_dispatcher's Buffer: normal mode and low-latency mode.

Both implement Megatron's MoETokenDispatcher interface (megatron-core 0.19.x) over the ``tp_ep`` group:

  dispatch_preprocess   routing map / probs [T, E] -> top-k ids / weights (local work only)
  token_dispatch        the differentiable Buffer dispatch (the only communication on the way in)
  dispatch_postprocess  received rows -> expert-major rows, tokens_per_expert (CPU), permuted probs
  combine_preprocess    expert-major outputs -> one row per received row (a token's local experts summed)
  token_combine         the differentiable Buffer combine (plain sum per source token)
  combine_postprocess   back to the input's shape (plus the overlapped shared experts' output)

Each step reads its tensors from its arguments, not from state an earlier step stashed, so Megatron's
EP-overlap schedule (which detaches the tensors between steps) gets correct gradients. Only index
bookkeeping (top-k ids, handles, the permutation) is kept on the dispatcher between steps.

With MOE_DISPATCHER_FP8_DISPATCH on, the forward dispatch sends FP8 rows (e4m3 per 128-channel block + float32
scales) and casts them back on arrival; everything else stays in the activation dtype (docs/megatron.md).

Expert tensor parallelism follows Megatron's flex dispatcher: the tp_ep group holds ETP x EP ranks, every
expert has one copy per expert-TP rank, a token goes to all copies of its experts, and combine sums their
partial outputs (see permutation.routing_to_topk).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import CudaGraphModule
from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from moe_dispatcher import Buffer
from moe_dispatcher import autograd as md_autograd
from moe_dispatcher.env import differing_setting, env_flag, env_int, env_raw

from . import guard
from .buffers import buffer_backend, get_buffer
from .permutation import LowLatencyPacking, routing_to_topk
from .sizing import ExpertRowBudget, tokens_per_expert_covering
from .timing import comm_timer

LL_MAX_TOKENS_ENV = "MOE_DISPATCHER_LL_MAX_TOKENS_PER_RANK"
FP8_DISPATCH_ENV = "MOE_DISPATCHER_FP8_DISPATCH"
FP8_BLOCK = 128  # channels per FP8 scale (moe_dispatcher.reference.fp8)


def fixed_max_tokens_per_rank() -> int | None:
    """$MOE_DISPATCHER_LL_MAX_TOKENS_PER_RANK (an int >= 1), or None when unset: found per call instead."""
    return env_int(LL_MAX_TOKENS_ENV, None, minimum=1)


class MoEDispatcherTokenDispatcher(MoETokenDispatcher):
    """Normal-mode dispatcher (``moe_token_dispatcher_type: "moe_dispatcher"``), for training and prefill."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config,
                 pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        if num_local_experts <= 0 or list(local_expert_indices) != list(
                range(local_expert_indices[0], local_expert_indices[0] + num_local_experts)):
            raise ValueError(f"{type(self).__name__}: local experts must be a non-empty contiguous range, got "
                             f"{local_expert_indices}")
        if config.moe_pad_expert_input_to_capacity:
            raise NotImplementedError(f"{type(self).__name__} does not support moe_pad_expert_input_to_capacity "
                                      "(drop-and-pad); use Megatron's alltoall dispatcher for it")
        if config.cuda_graph_impl != "none" and CudaGraphModule.moe_preprocess in (config.cuda_graph_modules or []):
            raise NotImplementedError(f"{type(self).__name__} cannot be captured in the moe_preprocess CUDA graph "
                                      "scope (its dispatch reads token counts on the host)")
        self.group = self.tp_ep_group
        self.group_size = dist.get_world_size(self.group)
        if self.group_size != self.tp_size * self.ep_size:
            raise ValueError(f"tp_ep group has {self.group_size} ranks, expected expert-TP {self.tp_size} x "
                             f"EP {self.ep_size}")
        expected = self.ep_rank * self.tp_size + self.tp_rank
        if dist.get_rank(self.group) != expected:
            raise ValueError(f"tp_ep rank {dist.get_rank(self.group)} is not EP rank {self.ep_rank} x expert-TP size "
                             f"{self.tp_size} + expert-TP rank {self.tp_rank}: the expert-TP rank must vary fastest")
        # Experts as the Buffer sees them: one copy of each per expert-TP rank.
        self.num_dispatch_experts = config.num_moe_experts * self.tp_size
        self.pad_multiple = 1
        if config.moe_router_padding_for_quantization:
            self.pad_multiple = get_align_size_for_quantization(config) or 1
        num_sms = getattr(config, "moe_flex_dispatcher_num_sms", None)
        if num_sms is not None:
            Buffer.set_num_sms(num_sms)
        self.buffer_backend = buffer_backend()  # an unknown name fails here, not mid-step
        # Forward dispatch in FP8 (per-128-channel e4m3 + float32 scales), cast back to the activation dtype on
        # arrival; the backward and the combine stay in the activation dtype (docs/megatron.md).
        self.fp8_dispatch = env_flag(FP8_DISPATCH_ENV)
        if self.fp8_dispatch and config.hidden_size % FP8_BLOCK:
            raise ValueError(f"{FP8_DISPATCH_ENV}=1 needs a hidden size that is a multiple of {FP8_BLOCK}, got "
                             f"{config.hidden_size}")
        self.cudagraph_attrs = []
        self._buffer: Buffer | None = None
        self._topk_idx: torch.Tensor | None = None
        self._handle = None
        self._recv_counts: list[int] | None = None
        self._tokens_per_expert: torch.Tensor | None = None
        self._probs_dtype = torch.float32
        # Expert-major row counts: exact by default, fixed with bound sizing or a capacity factor (sizing.py).
        self._row_budget = ExpertRowBudget(self.pad_multiple,
                                           getattr(config, "moe_expert_rank_capacity_factor", None),
                                           num_local_experts=num_local_experts, group=self.group)
        guard.track(self)

    # -------------------------------------------------------------- helpers shared with the low-latency one
    def _routing(self, routing_map: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Keep the top-k ids for the dispatch; return the top-k weights (differentiable)."""
        self._probs_dtype = probs.dtype
        self._topk_idx, weights = routing_to_topk(routing_map, probs, self.config.moe_router_topk,
                                                  self.num_local_experts, self.tp_size)
        return weights

    def _shared_experts_before_dispatch(self) -> None:
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()

    def _shared_experts_after_dispatch(self, hidden_states: torch.Tensor, dispatched: torch.Tensor) -> None:
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states, wait_current_stream=False)
            self.shared_experts.linear_fc1_forward_and_act(dispatched)

    def _finish(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(hidden_states)
            self.shared_experts.post_forward_comm()
            hidden_states = hidden_states + self.shared_experts.get_output()
        return hidden_states.view(self.hidden_shape)

    # -------------------------------------------------------------- Megatron's interface
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """[S/TP, B, H] tokens, bool [T, E] routing map, [T, E] probs -> ([T, H], top-k weights float32 [T, K'])."""
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        return hidden_states, self._routing(routing_map, probs)

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor, async_finish: bool = True,
                       allocate_on_comm_stream: bool = True):
        """Send each token to the ranks of its experts, straight into expert-major layout (the Buffer's expert-major
        dispatch): returns (rows [M, H], one per (token, local expert) pair, each expert's rows contiguous
        and padded to the quantization multiple; their probs [M]). async_finish / allocate_on_comm_stream are
        accepted for the flex call signature; the results are ready on the current stream."""
        self._shared_experts_before_dispatch()
        buffer = get_buffer(self.group, hidden=hidden_states.shape[-1], element_size=hidden_states.element_size(),
                            backend=self.buffer_backend)
        x, weights = comm_timer.backward_end("dispatch", hidden_states, probs)
        worst = self._row_budget.rows_for(hidden_states.shape[0], self._topk_idx.shape[1],  # 0: exact
                                          hidden_states.device)
        with comm_timer.forward("dispatch", hidden_states.device):
            permuted, permuted_probs, counts, tpe, handle = md_autograd.expert_major_dispatch(
                buffer, x, self._topk_idx, weights, self.num_dispatch_experts, expert_alignment=self.pad_multiple,
                num_worst_tokens=worst, fp8=self.fp8_dispatch)
        permuted, permuted_probs = comm_timer.backward_start("dispatch", permuted, permuted_probs)
        if worst:  # M = worst rows, counts on the device only; the need is checked later (sizing.py, guard.py)
            self._row_budget.watch(handle.rows_needed, worst)
            guard.note_fixed_rows(buffer)  # a refusal of this call (its ranks disagree) raises at the step's end
            self._tokens_per_expert = tokens_per_expert_covering(tpe, worst)
        else:  # exact: the counts came to the host (the dispatch's one host sync)
            self._row_budget.observe(sum(counts))
            self._tokens_per_expert = torch.tensor(counts, dtype=torch.int64)
        self._buffer, self._handle = buffer, handle
        self._topk_idx = None
        self._shared_experts_after_dispatch(hidden_states, permuted)
        return permuted, permuted_probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """-> (expert-major rows, tokens_per_expert int64 (padded counts), permuted probs).

        With moe_router_padding_for_quantization each expert's rows are padded with zero rows (prob 0) to a
        multiple of 16/32, so fp8/fp4 grouped GEMMs need no padding of their own. With fixed rows (sizing.py:
        bound sizing or a capacity factor) tokens_per_expert stays on the device (experts that need
        it on the host read it there, as Megatron's SequentialMLP / GroupedMLP do with .tolist()) and the zero
        rows past the last expert's are counted in the last expert, so the counts add up to the rows."""
        tokens_per_expert, self._tokens_per_expert = self._tokens_per_expert, None
        return hidden_states, tokens_per_expert, probs.to(self._probs_dtype)

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Expert-major outputs go to combine as they are (the Buffer undoes the permutation)."""
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor, async_finish: bool = True,
                      allocate_on_comm_stream: bool = True) -> torch.Tensor:
        """Return the expert rows to their tokens' ranks and sum them per token -> [T, H]."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        (x,) = comm_timer.backward_end("combine", hidden_states)
        with comm_timer.forward("combine", hidden_states.device):
            out = md_autograd.expert_major_combine(self._buffer, x.contiguous(), self._handle)
        (out,) = comm_timer.backward_start("combine", out)
        self._handle = self._buffer = None
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, H] -> the input's [S/TP, B, H] (adding the shared experts' output when they overlap)."""
        return self._finish(hidden_states)


class MoEDispatcherLowLatencyTokenDispatcher(MoEDispatcherTokenDispatcher):
    """Low-latency dispatcher (``moe_token_dispatcher_type: "moe_dispatcher_ll"``), for small decode batches.

    Uses the Buffer's low-latency mode: bf16 rows land per local expert in fixed-size slots
    ([E_local, R * maxT, H]) with no layout exchange, and combine applies the top-k weights itself. So the
    experts get probs of 1 (the router still learns: low_latency_combine is differentiable in the weights),
    and ``moe_apply_probs_on_input`` / expert biases, which do not commute with that, are refused.

    maxT, the most tokens any rank sends per call, is $MOE_DISPATCHER_LL_MAX_TOKENS_PER_RANK when set (no
    extra work per call; it must be alike on every rank: the first call gathers it once and raises on every rank
    if it differs; a rank with more tokens has its dispatch refused by the Buffer, whose abort fails its peers'
    call too); otherwise it is the running maximum over the group, found with one small
    all-reduce per call. Megatron's experts split their input on the host, so the received counts are read
    once per call (one device-to-host copy of E_local ints).
    """

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config,
                 pg_collection=None) -> None:
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
        if self.fp8_dispatch:
            raise NotImplementedError(f"{type(self).__name__} does not support {FP8_DISPATCH_ENV}: it is for "
                                      "moe_token_dispatcher_type 'moe_dispatcher' (normal mode)")
        refused = [name for name in ("moe_apply_probs_on_input", "add_bias_linear", "overlap_moe_expert_parallel_comm")
                   if getattr(config, name, False)]
        if refused:
            raise NotImplementedError(f"{type(self).__name__} does not support {', '.join(refused)}: its combine "
                                      "weights the expert outputs itself; use moe_token_dispatcher_type "
                                      "'moe_dispatcher'")
        self.fixed_max_tokens = fixed_max_tokens_per_rank()
        self._max_tokens_agreed = False
        self._max_tokens = 0
        self._packing: LowLatencyPacking | None = None

    def _num_max_tokens(self, num_tokens: int, device: torch.device) -> int:
        if not self._max_tokens_agreed:  # the first call: the variable alike on every rank, or a raise on every rank
            self._agree_fixed_max_tokens()
        if self.fixed_max_tokens is not None:
            # More tokens than that: the Buffer's dispatch refuses them and its abort fails the peers' call too.
            return self.fixed_max_tokens
        count = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        self._max_tokens = max(self._max_tokens, int(count.item()))  # a high-water mark: no buffer churn
        return self._max_tokens

    def _agree_fixed_max_tokens(self) -> None:
        """$MOE_DISPATCHER_LL_MAX_TOKENS_PER_RANK must be alike on every rank of the group: a rank with it skips
        the per-call all-reduce its peers make. Gathered once; a value that differs raises ValueError on every
        rank, naming each rank's value."""
        values: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(values, env_raw(LL_MAX_TOKENS_ENV), group=self.group)
        differing = differing_setting(LL_MAX_TOKENS_ENV, values, "the expert-parallel group")
        if differing is not None:
            raise differing
        self._max_tokens_agreed = True

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor, async_finish: bool = True,
                       allocate_on_comm_stream: bool = True):
        """Returns (recv rows bf16 [E_local, R*maxT, H], the top-k weights, kept for combine)."""
        self._shared_experts_before_dispatch()
        num_tokens, hidden = hidden_states.shape
        max_tokens = self._num_max_tokens(num_tokens, hidden_states.device)
        buffer = get_buffer(self.group, hidden=hidden, element_size=2, low_latency=True,
                            num_max_dispatch_tokens_per_rank=max_tokens, num_experts=self.num_dispatch_experts,
                            backend=self.buffer_backend)
        self._dtype = hidden_states.dtype
        (x,) = comm_timer.backward_end("dispatch", hidden_states.to(torch.bfloat16))
        with comm_timer.forward("dispatch", hidden_states.device):
            recv_x, recv_count, handle = md_autograd.low_latency_dispatch(buffer, x, self._topk_idx, max_tokens,
                                                                          self.num_dispatch_experts)
        (recv_x,) = comm_timer.backward_start("dispatch", recv_x)
        self._buffer, self._handle, self._recv_count = buffer, handle, recv_count
        self._shared_experts_after_dispatch(hidden_states, recv_x)
        return recv_x, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """[E_local, R*maxT, H] slots -> packed expert-major rows, tokens_per_expert (CPU), probs of 1."""
        self._topk_weights = probs
        self._recv_shape = hidden_states.shape
        self._packing = LowLatencyPacking.build(self._recv_count, hidden_states.shape[1], self.pad_multiple)
        self._recv_count = None
        packed = self._packing.pack(hidden_states).to(self._dtype)
        ones = torch.ones(packed.shape[0], dtype=self._probs_dtype, device=packed.device)
        return packed, self._packing.tokens_per_expert, ones

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self._packing.unpack(hidden_states.to(torch.bfloat16), self._recv_shape)
        self._packing = None
        return out

    def token_combine(self, hidden_states: torch.Tensor, async_finish: bool = True,
                      allocate_on_comm_stream: bool = True) -> torch.Tensor:
        """Weighted combine of the expert outputs -> [T, H] in the model's dtype."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        x, weights = comm_timer.backward_end("combine", hidden_states, self._topk_weights)
        with comm_timer.forward("combine", hidden_states.device):
            out = md_autograd.low_latency_combine(self._buffer, x, self._topk_idx, weights, self._handle)
        (out,) = comm_timer.backward_start("combine", out)
        self._handle = self._buffer = self._topk_idx = self._topk_weights = None
        return out.to(self._dtype)
