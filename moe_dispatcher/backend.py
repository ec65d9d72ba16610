"""The Backend protocol: what every backend of a Buffer implements, and what it declares it serves.

A Buffer holds at most one backend per mode: a normal-mode backend (the compiled intranode or internode kernels,
or the reference) and a low-latency one (the compiled NVSHMEM kernels, or the reference). Each backend states
its reach in `capabilities` (data, never probed with hasattr); `Buffer` reads them in one place
(`Buffer._resolve`) to decide, per call shape, which backend serves a call and when to fall back to the reference
backend. Methods a backend does not serve raise NotImplementedError (the resolver never sends it such calls).

Expert-major calls have a default here: the backend's rank-major dispatch / combine composed with the local
permutation of moe_dispatcher.expert_major. A backend with fused expert-major kernels overrides the three
methods and sets `capabilities.expert_major`.

Shapes and dtypes are those of docs/semantics.md: T tokens, H hidden, K top-k slots, R ranks, E experts,
L = E / R local experts, N received rows, M expert-major rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, FrozenSet, NamedTuple, Optional, Sequence, Tuple

import torch

from .expert_major import ExpertMajorHandle, compose_expert_major_dispatch, gather_rows, unpermute

if TYPE_CHECKING:
    from .config import Config
    from .handle import DispatchHandle, LowLatencyHandle

Tensor = torch.Tensor
ALL_DTYPES: FrozenSet[torch.dtype] = frozenset({torch.bfloat16, torch.float16, torch.float32, torch.float64})


class Capabilities(NamedTuple):
    """What a backend serves, declared once when it is made.

    normal:            get_dispatch_layout, dispatch, cached_dispatch, combine.
    low_latency:       low_latency_dispatch / low_latency_combine and their buffer helpers.
    expert_major:      native expert-major calls (False: the composition of this class serves them).
    combine_dtypes:    dtypes of combine input the backend reduces (others go to the reference backend).
    max_local_experts: fresh dispatches with more experts per rank than this go to the reference (None: any).
    devices:           device types whose tensors the backend takes ("cpu", "cuda").
    """

    normal: bool = False
    low_latency: bool = False
    expert_major: bool = False
    combine_dtypes: FrozenSet[torch.dtype] = ALL_DTYPES
    max_local_experts: Optional[int] = None
    devices: FrozenSet[str] = frozenset({"cpu", "cuda"})


class Backend:
    """Base class of every backend (reference, intranode, internode, low-latency).

    Subclasses set `name` (the tag their handles carry) and `capabilities`, and implement the methods of the
    modes they declare. Inputs reach them validated (moe_dispatcher.validation, on the first call of a shape)
    and on the stream the Buffer chose; they allocate outputs on the current stream and return them.
    """

    name: str = "backend"
    capabilities: Capabilities = Capabilities()
    num_ranks: int  # ranks of the Buffer's group
    # Compiled normal-mode backends: their native CommStream (csrc/bindings/stream_join.h), which orders every
    # launch that uses the Buffer after the previous one; the Buffer's full path tells it where it launches.
    launch_order = None
    # Compiled normal-mode backends: get_dispatch_layout as one native call, layout_call(topk_idx, num_experts,
    # *layout_args) -> the layout, or None for arguments it does not take (csrc/bindings/layout_call.h).
    layout_call = None
    layout_args: tuple = ()

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int):
        """topk_idx int64 [T, K] -> (num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [D] or None,
        num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R])."""
        raise NotImplementedError(f"the {self.name} backend has no normal mode")

    def dispatch(self, x: Tensor, x_scales: Optional[Tensor], topk_idx: Optional[Tensor],
                 topk_weights: Optional[Tensor], num_tokens_per_rank: Tensor, is_token_in_rank: Tensor,
                 num_tokens_per_expert: Tensor, expert_alignment: int, num_worst_tokens: int,
                 config: Optional["Config"] = None):
        """Fresh dispatch: -> (recv_x [N, H], recv_scales [N, S] or None, recv_topk_idx int64 [N, K] or None,
        recv_topk_weights float32 [N, K] or None, counts, DispatchHandle). counts: the received pairs per local
        expert, each rounded up to expert_alignment, from the counts the exchange carried: python ints [L], or
        with num_worst_tokens the same as int32 [L] on the device (no host sync; they count the rows past
        num_worst_tokens too, which the kernels drop: the expert-major composition's rows needed).
        Buffer.dispatch returns them as python ints, or [] with num_worst_tokens (DeepEP's contract)."""
        raise NotImplementedError(f"the {self.name} backend has no normal mode")

    def cached_dispatch(self, x: Tensor, x_scales: Optional[Tensor], handle: "DispatchHandle",
                        config: Optional["Config"] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """Dispatch along a handle's routing: -> (recv_x [N, H], recv_scales or None)."""
        raise NotImplementedError(f"the {self.name} backend has no normal mode")

    def combine(self, x: Tensor, handle: "DispatchHandle", topk_weights: Optional[Tensor], bias: Sequence[Tensor],
                config: Optional["Config"] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """x [N, H] -> (combined_x [T, H] x.dtype, combined_topk_weights float32 [T, K] or None)."""
        raise NotImplementedError(f"the {self.name} backend has no normal mode")

    # ------------------------------------------------------------------ expert-major (default: composition)
    def expert_major_dispatch(self, x: Tensor, x_scales: Optional[Tensor], topk_idx: Tensor,
                              topk_weights: Optional[Tensor], num_experts: int, expert_alignment: int,
                              num_worst_tokens: int, config: Optional["Config"] = None):
        """-> (permuted_x [M, H], permuted_scales or None, permuted_weights float32 [M] or None,
        tokens_per_expert int32 [L], counts (python ints), ExpertMajorHandle)."""
        return compose_expert_major_dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts,
                                             num_experts // self.num_ranks, expert_alignment, num_worst_tokens,
                                             config)

    def expert_major_cached_dispatch(self, x: Tensor, x_scales: Optional[Tensor], handle: ExpertMajorHandle,
                                     config: Optional["Config"] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """x [T, H] -> (expert-major rows [M, H], scales or None) along the handle's routing."""
        rows, row_scales = self.cached_dispatch(x, x_scales, handle.dispatch, config)
        return gather_rows(rows, handle), (gather_rows(row_scales, handle) if x_scales is not None else None)

    def expert_major_combine(self, x: Tensor, handle: ExpertMajorHandle, weights: Optional[Tensor],
                             topk_weights: Optional[Tensor], bias: Sequence[Tensor],
                             config: Optional["Config"] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """Expert-major rows x [M, H] -> (combined_x [T, H], combined_topk_weights [T, K] or None)."""
        rows, w_rows = unpermute(x, handle, weights, topk_weights)
        return self.combine(rows, handle.dispatch, w_rows, bias, config)

    def forget_overflow(self) -> None:
        """Drop the record of an earlier num_worst_tokens overflow that the next synchronised dispatch would raise
        (the compiled backends keep one in their mailbox; the reference raises at the call instead). For a caller
        that checked those calls itself (Buffer._forget_dropped_rows): call it on every rank, once those
        dispatches finished."""

    def check_refused_calls(self) -> None:
        """Raise now, on every rank alike, the disagreement of an earlier call that has not raised yet (Buffer.
        check_refused_calls; every rank calls it at the same point, after the same calls). The compiled normal-mode
        backends refuse such a call in notify and report it at a host wait, which calls with num_worst_tokens never
        make (compiled.raise_refused_calls). Default: nothing, for a backend that raises at the call itself (the
        reference agrees every call's signature in the call's own all-gather, num_worst_tokens or not)."""

    # ------------------------------------------------------------------ low-latency mode
    # A low-latency backend owns its double buffering (each call takes the buffer half after the previous
    # call's), its hooks (one call each; stale once their half was taken again; shapes change only while none
    # is pending) and the reduction order (set_rank_partials). The Buffer validates a call's arguments on the
    # first call of its key and then calls these methods directly (the compiled backend's are native).
    def low_latency_dispatch(self, x: Tensor, topk_idx: Tensor, max_tokens: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[Tensor],
                             dispatch_wait_recv_cost_stats: Optional[Tensor], use_fp8: bool, round_scale: bool,
                             use_ue8m0: bool, async_finish: bool, return_recv_hook: bool):
        """x bf16 [T, H], topk_idx int64 [T, K] -> (recv_x bf16 [L, R*maxT, H] (or (fp8, scales [L, R*maxT, G])),
        recv_count int32 [L], LowLatencyHandle, EventOverlap, hook or None)."""
        raise NotImplementedError(f"the {self.name} backend has no low-latency mode")

    def low_latency_combine(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, handle: "LowLatencyHandle",
                            zero_copy: bool, async_finish: bool, return_recv_hook: bool, out: Optional[Tensor],
                            combine_wait_recv_cost_stats: Optional[Tensor]):
        """x bf16 [L, R*maxT, H], topk_idx int64 / topk_weights float32 [T, K] -> (combined_x bf16 [T, H],
        EventOverlap, hook or None)."""
        raise NotImplementedError(f"the {self.name} backend has no low-latency mode")

    def set_rank_partials(self, rank_partials: bool) -> None:
        """The low-latency combine's reduction order of later calls: per-rank partials (True) or per expert."""

    def next_combine_buffer(self, handle: "LowLatencyHandle") -> Tensor:
        """bf16 [L, R*maxT, H]: the rows a zero-copy low-latency combine made as the next call sends."""
        raise NotImplementedError(f"the {self.name} backend has no low-latency mode")

    def clean_low_latency_buffer(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency signal words (collective)."""
        raise NotImplementedError(f"the {self.name} backend has no low-latency mode")

    # ------------------------------------------------------------------ errors
    def post_abort(self) -> None:
        """This rank raises in a Buffer call (an error its peers do not raise alike): let the peers' kernels that
        wait for it give up instead of timing out. The compiled backends write this rank's abort byte in every
        peer's memory (kernels/common/wait.cuh, "Peer abort") and clear it at their next launch; a backend whose own
        kernels honoured a peer's abort posts nothing. Best effort, never raises. Default: nothing (the reference
        backend's collectives read the Board instead)."""

    # ------------------------------------------------------------------ buffer access and lifetime
    def local_buffer_tensor(self, dtype: torch.dtype, size: Optional[Sequence[int]], offset: int,
                            use_rdma_buffer: bool) -> Tensor:
        """A typed view of this rank's NVLink (or NVSHMEM) buffer from byte `offset`."""
        raise NotImplementedError(f"the {self.name} backend has no communication buffer")

    # Creation: the steps moe_dispatcher.compiled.create_backends runs between its bounded agreement rounds, after
    # the constructor (local: this rank's allocations, no collective).
    def creation_payload(self) -> object:
        """What the peers need of this rank to connect (picklable), e.g. its buffer's CUDA IPC handle."""
        return None

    def connect(self, payloads: Sequence[object]) -> None:
        """Local, once every rank's constructor succeeded: use the peers' payloads (index: rank), e.g. map their
        buffers."""

    def start(self) -> None:
        """Collective, once every rank connected: the steps every rank takes together (NVSHMEM bootstrap)."""

    def close_mappings(self) -> None:
        """Creation failed after connect(): stop using the peers' memory."""

    def discard(self) -> None:
        """Creation failed before start() and no peer uses this rank's memory (any more): free it."""

    # Teardown: what moe_dispatcher/runtime/release.py calls (the reference backend shares no memory).
    symmetric = False  # holds NVSHMEM memory (freed only collectively)
    broken = False  # a kernel recorded a timeout (or honoured a peer's abort)

    def quiesce(self) -> None:
        """Local: wait for this GPU's work, stop using the peers' memory, refuse later calls."""

    def views_alive(self) -> bool:
        """A tensor handed to the user still views this backend's NVSHMEM memory."""
        return False

    def free(self, symmetric: bool) -> None:
        """Every peer stopped: free (the NVSHMEM memory only when `symmetric`)."""

    def abandon(self) -> None:
        """A peer never confirmed: leave the exported memory allocated until the process exits."""
