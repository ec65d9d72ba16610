"""Normal-mode intranode backend: dispatch and combine over NVLink with the compiled kernels.

One IntranodeBackend belongs to one Buffer whose group is a single NVLink domain of 2..8 GPUs. It owns
the rank's NVLink buffer (cudaMalloc'd, shared with the peers through CUDA IPC handles exchanged over the
group) and a host-mapped mailbox. The Buffer runs every method inside its comm stream and applies the
previous_event / async_finish / allocate_on_comm_stream semantics; methods here only validate, allocate
outputs on the current stream and launch. docs/intranode.md describes the protocol.

Host synchronisation: a fresh dispatch without num_worst_tokens waits (spinning on mapped memory) for
notify's receive counts; cached dispatch, dispatch with num_worst_tokens, layout and combine never do.
So a rank receiving more than num_worst_tokens rows cannot raise at that call: its extra rows are dropped
(nothing hangs) and every rank raises ValueError at its next synchronised (fresh, no num_worst_tokens)
dispatch.
A spin-wait that exceeds MOE_DISPATCHER_TIMEOUT_S seconds (default 10) in a kernel records the phase, the
waiting rank and the peer; the next call (or the notify wait) raises RuntimeError naming them.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import _ext
from ..backend import Backend, Capabilities
from ..config import Config, align_slot
from ..expert_major import ExpertMajorHandle, compose_expert_major_dispatch, gather_rows, unpermute
from ..handle import DispatchHandle
from . import (JOIN_NONE, HandleState, buffer_view, check_topk, combine_row_bytes, current_stream_ptr,
               dispatch_inputs, recv_tensors, row_geometry, timeout_message, wait_counts)

TIMEOUT_ENV = "MOE_DISPATCHER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 10.0
# Expert-major variants, read when the backend is created (the attributes em_dispatch_mode / em_combine_mode
# change them later, e.g. in the bench); the first of each tuple is the default. All are bit-identical.
# Dispatch: "split" = the rank-major dispatch kernel, then a local pass over the whole GPU (em_permute) copies
# each received row to its expert-major rows; "fused" = the dispatch kernel's receivers write the expert-major
# rows as the rows arrive (on num_channels SMs).
# Combine: "split" = a local pass over the whole GPU (em_unpermute) sums each received row's expert rows into a
# rank-major row, then the rank-major combine kernel sends them; "fused" = the combine kernel's senders gather
# and sum the expert rows themselves (send_em_row).
EM_DISPATCH_ENV = "MOE_DISPATCHER_EM_DISPATCH"
EM_DISPATCH_MODES = ("split", "fused")
EM_COMBINE_ENV = "MOE_DISPATCHER_EM_COMBINE"
EM_COMBINE_MODES = ("split", "fused")
# How the dispatch and combine kernels move rows through the rings (docs/intranode.md), read when the backend
# is created; the attribute nvl_variant changes it later (bench, tests). All give the same bytes and use the
# same rings, so calls of any may follow each other on one Buffer. "chunked": warp groups in lock-step
# chunks, each ending with a system-scope release by the group leader; "stream" (default: the fastest on
# 2 and 4 x H200, bench/results/*-092* in 62f8696): every warp moves its own rows and one publisher warp per
# block updates the ring counters (Config's send chunk is then the least rows per tail update).
NVL_VARIANT_ENV = "MOE_DISPATCHER_NVL_VARIANT"
NVL_VARIANTS = ("chunked", "stream")  # index = the kernels' RingProtocol
DEFAULT_NVL_VARIANT = "stream"
_COMBINE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def env_mode(name: str, modes: Sequence[str], default: Optional[str] = None) -> str:
    """The variant environment variable `name` selects (case-insensitive; unset or empty: default, else
    modes[0])."""
    value = os.environ.get(name, "").strip().lower() or default or modes[0]
    if value not in modes:
        raise ValueError(f"{name} must be one of {tuple(modes)}, got {value!r}")
    return value


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def dispatch_slot_bytes(hidden_bytes: int, num_scales: int, num_topk: int, pair_ranks: bool = False) -> int:
    """Bytes of one dispatch ring slot: payload, 4-byte scales, top-k ids (int32) and weights, source index,
    and (expert-major fresh dispatch) the int32 pair rank of each slot; rounded by align_slot."""
    return align_slot(hidden_bytes + num_scales * 4 + num_topk * (12 if pair_ranks else 8) + 4)


def combine_slot_bytes(row_bytes: int, num_topk: int) -> int:
    """Bytes of one combine ring slot: the row and its top-k weights; rounded by align_slot."""
    return align_slot(row_bytes + num_topk * 4)


def required_nvl_bytes(num_ranks: int, num_channels: int, num_slots: int, slot_bytes: int, rings_offset: int) -> int:
    """Smallest num_nvl_bytes whose rings hold `num_slots` slots per (channel, source rank)."""
    return rings_offset + num_ranks * _align16(num_channels * num_slots * slot_bytes + 127)


class CachedCall:
    """A cached call (dispatch along a handle, or combine) whose checks passed once, ready to launch again.

    Every check of a cached call reads only the handle, the metadata of its tensors (dtype, shape, device,
    contiguity: never their contents), the config and the backend. A later call with the same handle fields,
    tensors of the same metadata (`x`, and `aux`: the FP8 scales of a dispatch, the top-k weights of a
    combine, or None both times) and the same config would pass them again: matches() says so, and the caller
    launches this plan without redoing them. Anything else takes the full path, which checks and builds a new
    plan. What may change between two such calls (the buffer destroyed, a timeout recorded by a kernel) the
    native plan checks at every launch (`refused` then raises the reason).

    The plan keeps the handle's tensors whose addresses it holds (is_token_in_rank here; recv_channel_offset
    stays in the handle's state, which owns the plan) and no reference to the handle itself.
    """

    __slots__ = ("backend", "is_token_in_rank", "recv_src_idx", "num_tokens", "num_worst_tokens", "config", "num_sms",
                 "dtype", "shape", "device", "is_cuda", "torch_device", "aux_dtype", "aux_shape", "out_shape",
                 "aux_out_shape", "protocol", "native")

    def __init__(self, backend: "IntranodeBackend", handle: DispatchHandle, x: torch.Tensor,
                 aux: Optional[torch.Tensor], config: Optional[Config], out_shape: Tuple[int, int],
                 aux_out_shape: Optional[Tuple[int, int]], native) -> None:
        self.backend = backend
        self.is_token_in_rank, self.recv_src_idx = handle.is_token_in_rank, handle.recv_src_idx
        self.num_tokens, self.num_worst_tokens = handle.num_tokens, handle.num_worst_tokens
        self.config, self.num_sms = config, backend._buffer_cls.num_sms  # config None: the tuned one for num_sms
        self.dtype, self.shape, self.torch_device = x.dtype, x.shape, x.device
        self.device, self.is_cuda = x.get_device(), x.is_cuda  # the device, cheaply: index and type (CUDA or not)
        self.aux_dtype, self.aux_shape = (None, None) if aux is None else (aux.dtype, aux.shape)
        self.out_shape, self.aux_out_shape, self.native = out_shape, aux_out_shape, native
        self.protocol = backend._protocol  # the ring protocol the native plan launches

    def matches(self, backend: "IntranodeBackend", handle: DispatchHandle, x: torch.Tensor,
                aux: Optional[torch.Tensor], config: Optional[Config]) -> bool:
        """Would a call of `backend` with these arguments pass the checks this plan's call passed?"""
        if not (self.backend is backend and backend._protocol == self.protocol
                and handle.is_token_in_rank is self.is_token_in_rank
                and handle.recv_src_idx is self.recv_src_idx and handle.num_tokens == self.num_tokens
                and handle.num_worst_tokens == self.num_worst_tokens and x.dtype is self.dtype
                and x.shape == self.shape and x.get_device() == self.device and x.is_cuda is self.is_cuda
                and x.is_contiguous()
                and (config is self.config or (type(config) is Config and config == self.config))
                and (config is not None or backend._buffer_cls.num_sms == self.num_sms)):
            return False
        if aux is None:
            return self.aux_shape is None
        return (aux.dtype is self.aux_dtype and aux.shape == self.aux_shape and aux.get_device() == self.device
                and aux.is_cuda is self.is_cuda and aux.is_contiguous())


class DispatchCall(CachedCall):
    """The plan of a cached dispatch: aux = FP8 scales."""

    __slots__ = ()

    def run(self, x: torch.Tensor, scales: Optional[torch.Tensor], caller: int, stream: int, join: int):
        """Allocate the outputs (on the current stream) and launch on `stream`; (recv_x, recv_scales or None)."""
        recv_x = torch.empty(self.out_shape, dtype=self.dtype, device=self.torch_device)
        if scales is None:
            if not self.native.launch(x.data_ptr(), 0, recv_x.data_ptr(), 0, stream, caller, join):
                self.backend.refused()
            return recv_x, None
        recv_scales = torch.empty(self.aux_out_shape, dtype=self.aux_dtype, device=self.torch_device)
        if not self.native.launch(x.data_ptr(), scales.data_ptr(), recv_x.data_ptr(), recv_scales.data_ptr(), stream,
                                  caller, join):
            self.backend.refused()
        return recv_x, recv_scales


class CombineCall(CachedCall):
    """The plan of a combine: aux = top-k weights."""

    __slots__ = ()

    def run(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor], caller: int, stream: int, join: int,
            bias: Sequence[torch.Tensor] = ()):
        """Allocate the outputs (on the current stream) and launch on `stream`; (combined_x, weights or None)."""
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.torch_device)
        out_w = None
        if topk_weights is not None:
            out_w = torch.empty(self.aux_out_shape, dtype=torch.float32, device=self.torch_device)
        bias0 = bias[0].data_ptr() if len(bias) > 0 else 0
        bias1 = bias[1].data_ptr() if len(bias) > 1 else 0
        if not self.native.launch(x.data_ptr(), 0 if topk_weights is None else topk_weights.data_ptr(), bias0, bias1,
                                  out.data_ptr(), 0 if out_w is None else out_w.data_ptr(), stream, caller, join):
            self.backend.refused()
        return out, out_w


class _DeviceMemory:
    """Exposes a raw device range to torch.as_tensor through __cuda_array_interface__."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class IntranodeBackend(Backend):
    """Compiled normal-mode backend for one Buffer (see the module docstring). Float64 combines and more than
    MAX_LOCAL_EXPERTS experts per rank are not its (capabilities): the Buffer sends those to the reference."""

    name = "intranode"

    def __init__(self, buffer) -> None:
        mod = _ext.load()
        self._mod = mod.intranode
        self.group = buffer.group
        self.rank, self.num_ranks = buffer.rank, buffer.group_size
        self.num_nvl_bytes = buffer.num_nvl_bytes
        self.num_rdma_bytes = buffer.num_rdma_bytes
        self._buffer_token = buffer._token
        self._buffer_cls = type(buffer)
        self.capabilities = Capabilities(normal=True, expert_major=True, combine_dtypes=frozenset(_COMBINE_DTYPES),
                                         max_local_experts=self._mod.MAX_LOCAL_EXPERTS, devices=frozenset({"cuda"}))
        self.timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
        if self.timeout_s <= 0:
            raise ValueError(f"{TIMEOUT_ENV} must be positive, got {self.timeout_s}")
        self._timeout_ns = int(self.timeout_s * 1e9)
        self.em_dispatch_mode = env_mode(EM_DISPATCH_ENV, EM_DISPATCH_MODES)
        self.em_combine_mode = env_mode(EM_COMBINE_ENV, EM_COMBINE_MODES)
        self.nvl_variant = env_mode(NVL_VARIANT_ENV, NVL_VARIANTS, DEFAULT_NVL_VARIANT)
        minimum = self._mod.RINGS_OFFSET + self.num_ranks * 128
        if self.num_nvl_bytes < minimum:
            raise ValueError(f"num_nvl_bytes={self.num_nvl_bytes} is too small for the intranode kernels (at least "
                             f"{minimum}; use Config.get_nvl_buffer_size_hint)")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._ipc = self._mod.IpcBuffer(self.rank, self.num_ranks, self.num_nvl_bytes)
        handles: List[Optional[bytes]] = [None] * self.num_ranks
        dist.all_gather_object(handles, self._ipc.ipc_handle(), group=self.group)
        self._ipc.open_peers(handles)
        self._join = self._mod.StreamJoin()
        self._seq = 0
        self._broken: Optional[str] = None
        self._rdma_emulation: Optional[torch.Tensor] = None
        self._scratch: Optional[torch.Tensor] = None  # see _present

    @property
    def nvl_variant(self) -> str:
        """The ring protocol of later dispatch / combine calls (NVL_VARIANT_ENV)."""
        return NVL_VARIANTS[self._protocol]

    @nvl_variant.setter
    def nvl_variant(self, value: str) -> None:
        if value not in NVL_VARIANTS:
            raise ValueError(f"{NVL_VARIANT_ENV} / nvl_variant must be one of {NVL_VARIANTS}, got {value!r}")
        self._protocol = NVL_VARIANTS.index(value)

    # ------------------------------------------------------------------ errors
    def _check(self) -> None:
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if not self._ipc.alive:
            raise RuntimeError("the intranode backend was destroyed")
        info = self._ipc.timeout_info()
        if info is not None:
            self._fail(info)

    def _fail(self, info) -> None:
        self._broken = timeout_message(self.name, info, self.timeout_s, TIMEOUT_ENV)
        raise RuntimeError(self._broken)

    def refused(self) -> None:
        """A plan did not launch: raise why (destroyed, or a timeout recorded)."""
        self._check()
        raise RuntimeError("moe_dispatcher intranode: the launch was refused")

    @staticmethod
    def _stream() -> int:
        return current_stream_ptr()

    def _config(self, config: Optional[Config], combine: bool) -> Tuple[int, int, int]:
        if config is None:
            config = (self._buffer_cls.get_combine_config if combine else self._buffer_cls.get_dispatch_config)(
                self.num_ranks)
        channels = config.num_channels
        chunk, slots = config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens
        if channels > self._mod.MAX_CHANNELS:
            raise ValueError(f"Config.num_sms={config.num_sms}: the intranode kernels use at most "
                             f"{2 * self._mod.MAX_CHANNELS} SMs")
        if chunk > self._mod.MAX_CHUNK:
            raise ValueError(f"Config.num_max_nvl_chunked_send_tokens={chunk}: at most {self._mod.MAX_CHUNK}")
        if combine and slots < chunk + 32:
            raise ValueError(f"Config.num_max_nvl_chunked_recv_tokens={slots} must be at least "
                             f"num_max_nvl_chunked_send_tokens + 32 for combine")
        return channels, chunk, slots

    def _check_fits(self, channels: int, slots: int, slot_bytes: int, what: str) -> None:
        need = required_nvl_bytes(self.num_ranks, channels, slots, slot_bytes, self._mod.RINGS_OFFSET)
        if need > self.num_nvl_bytes:
            raise ValueError(f"{what}: num_nvl_bytes={self.num_nvl_bytes} is too small for {channels} channels x "
                             f"{slots} slots of {slot_bytes} bytes x {self.num_ranks} ranks (needs {need}); size "
                             f"the Buffer with Config.get_nvl_buffer_size_hint for this hidden size")

    @staticmethod
    def _ptr(t: Optional[torch.Tensor]) -> int:
        return 0 if t is None else t.data_ptr()

    def _present(self, t: Optional[torch.Tensor]) -> int:
        """Address of an optional input or output whose presence the kernels read from a non-null pointer.
        An empty tensor (a rank with T = 0 tokens or M = 0 expert rows) has data_ptr() 0, which would read as
        "absent" and fail the launchers' checks on that rank only, after notify already joined the others to
        the call; it gets the address of a small scratch block instead (never dereferenced: nothing to read
        or write when the tensor is empty)."""
        if t is None:
            return 0
        address = t.data_ptr()
        if address == 0:
            if self._scratch is None:
                self._scratch = torch.zeros(64, dtype=torch.int32, device=self.device)
            address = self._scratch.data_ptr()
        return address

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        self._check()
        topk_idx = topk_idx.contiguous()
        t, k = topk_idx.shape
        r = self.num_ranks
        per_rank = torch.zeros(r, dtype=torch.int32, device=topk_idx.device)
        per_expert = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device)
        in_rank = torch.empty(t, r, dtype=torch.bool, device=topk_idx.device)
        self._mod.layout(topk_idx.data_ptr(), t, k, num_experts, r, per_rank.data_ptr(), per_expert.data_ptr(),
                         in_rank.data_ptr(), self._stream())
        return per_rank, None, per_expert, in_rank

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], num_tokens_per_rank: torch.Tensor,
                 is_token_in_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor, expert_alignment: int,
                 num_worst_tokens: int, config: Optional[Config] = None):
        """Fresh dispatch; returns what ReferenceNormal.dispatch returns."""
        self._check()
        r = self.num_ranks
        x, x_scales, topk_idx, topk_weights, hidden_bytes, num_scales, num_topk = dispatch_inputs(
            x, x_scales, topk_idx, topk_weights, "intranode", self._mod.MAX_TOPK)
        num_experts = num_tokens_per_expert.numel()
        local = num_experts // r
        channels, chunk, slots = self._config(config, combine=False)
        slot_bytes = dispatch_slot_bytes(hidden_bytes, num_scales, num_topk)
        self._check_fits(channels, slots, slot_bytes, "dispatch")
        is_token_in_rank = is_token_in_rank.contiguous()
        num_tokens_per_rank = num_tokens_per_rank.contiguous()
        num_tokens_per_expert = num_tokens_per_expert.contiguous()
        dev, t = x.device, x.shape[0]

        prefix = torch.empty(r, r, dtype=torch.int32, device=dev)
        offsets = torch.empty(r, channels + 1, dtype=torch.int32, device=dev)
        self._seq = self._seq % 2_000_000_000 + 1
        seq = self._seq
        self._mod.notify(self._ipc, self._timeout_ns, is_token_in_rank.data_ptr(), num_tokens_per_rank.data_ptr(),
                         num_tokens_per_expert.data_ptr(), t, num_experts, channels, expert_alignment,
                         num_worst_tokens, seq, prefix.data_ptr(), offsets.data_ptr(), self._stream())
        counts: List[int] = []
        num_recv: Optional[int] = None
        if num_worst_tokens:
            rows = num_worst_tokens
        else:
            num_recv = self._wait_counts(seq)
            counts = self._ipc.expert_counts(local)
            rows = num_recv

        recv_x, recv_scales, recv_idx, recv_w, recv_src = recv_tensors(
            rows, x, x_scales, num_scales, num_topk if topk_idx is not None else None)
        self._mod.dispatch(self._ipc, self._timeout_ns, x.data_ptr(), self._ptr(x_scales), self._ptr(topk_idx),
                           self._ptr(topk_weights), is_token_in_rank.data_ptr(), offsets.data_ptr(),
                           recv_x.data_ptr(), self._ptr(recv_scales), self._ptr(recv_idx), self._ptr(recv_w),
                           recv_src.data_ptr(), t, hidden_bytes, num_scales, num_topk, local, rows,
                           1 if num_worst_tokens else 0, channels, chunk, slots, slot_bytes, self._stream(),
                           protocol=self._protocol)
        if topk_weights is None:
            recv_w = None
        handle = DispatchHandle(prefix, is_token_in_rank, recv_src, num_recv, t, num_worst_tokens, self.name,
                                self._buffer_token, backend_state=HandleState((channels, offsets)))
        return recv_x, recv_scales, recv_idx, recv_w, counts, handle

    def cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle,
                        config: Optional[Config] = None):
        """Dispatch along the routing of `handle` with no count exchange and no host sync, on the current stream."""
        self._check()
        x = x.contiguous()
        x_scales = x_scales.contiguous() if x_scales is not None else None
        plans, kind = handle.backend_state.dispatch_plans, x_scales is not None
        plan = plans[kind]
        if plan is None or not plan.matches(self, handle, x, x_scales, config):
            plan = plans[kind] = self._dispatch_plan(x, x_scales, handle, config)
        return plan.run(x, x_scales, 0, self._stream(), JOIN_NONE)

    def _dispatch_plan(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle,
                       config: Optional[Config]) -> DispatchCall:
        """The checks of a cached dispatch, then its plan."""
        hidden_bytes, num_scales = row_geometry(x, x_scales, "intranode")
        channels, offsets = handle.backend_state.routing
        _, chunk, slots = self._config(config, combine=False)
        slot_bytes = dispatch_slot_bytes(hidden_bytes, num_scales, 0)
        self._check_fits(channels, slots, slot_bytes, "cached dispatch")
        rows = handle.recv_src_idx.shape[0]
        native = self._mod.DispatchPlan(self._ipc, self._join, self._timeout_ns, handle.is_token_in_rank.data_ptr(),
                                        offsets.data_ptr(), x.shape[0], hidden_bytes, num_scales, rows,
                                        1 if handle.num_worst_tokens else 0, channels, chunk, slots, slot_bytes,
                                        self._protocol)
        return DispatchCall(self, handle, x, x_scales, config, (rows, x.shape[1]),
                            (rows, num_scales) if x_scales is not None else None, native)

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                bias: Sequence[torch.Tensor], config: Optional[Config] = None):
        """Reduce the rows of each source token on the current stream; returns (combined_x, combined_topk_weights
        or None)."""
        self._check()
        x = x.contiguous()
        topk_weights = topk_weights.contiguous() if topk_weights is not None else None
        plans, kind = handle.backend_state.combine_plans, topk_weights is not None
        plan = plans[kind]
        if plan is None or not plan.matches(self, handle, x, topk_weights, config):
            plan = plans[kind] = self._combine_plan(x, topk_weights, handle, config)
        return plan.run(x, topk_weights, 0, self._stream(), JOIN_NONE, [b.contiguous() for b in bias])

    def _combine_plan(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor], handle: DispatchHandle,
                      config: Optional[Config]) -> CombineCall:
        """The checks of a combine (x of a kernel dtype), then its plan."""
        row_bytes = combine_row_bytes(x)
        num_topk = check_topk(topk_weights, self._mod.MAX_TOPK, "combine:", "top-k weights per row")
        channels, offsets = handle.backend_state.routing
        _, chunk, slots = self._config(config, combine=True)
        slot_bytes = combine_slot_bytes(row_bytes, num_topk)
        self._check_fits(channels, slots, slot_bytes, "combine")
        t = handle.num_tokens
        native = self._mod.CombinePlan(self._ipc, self._join, self._timeout_ns, handle.is_token_in_rank.data_ptr(),
                                       offsets.data_ptr(), _COMBINE_DTYPES[x.dtype], t, x.shape[1], num_topk,
                                       x.shape[0], channels, chunk, slots, slot_bytes,
                                       self._protocol)
        return CombineCall(self, handle, x, topk_weights, config, (t, x.shape[1]),
                           (t, num_topk) if topk_weights is not None else None, native)

    # ------------------------------------------------------------------ expert-major (fused permutation)
    def expert_major_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                              topk_weights: Optional[torch.Tensor], num_experts: int, expert_alignment: int,
                              num_worst_tokens: int, config: Optional[Config] = None):
        """Dispatch into expert-major rows (docs/intranode.md, "Expert-major dispatch"). notify turns every
        source's per-expert counts into the layout table (each expert's first row); then, by em_dispatch_mode:
        "split": the rank-major dispatch kernel, then pair ranks over the received top-k and em_permute, which
        copies each received row to its expert-major rows over the whole GPU; "fused": the sender carries each
        pair's rank among its pairs for that expert and the dispatch kernel's receivers write each row straight
        to its expert-major rows. Same outputs bit for bit. Returns (permuted_x, permuted_scales,
        permuted_weights, tokens_per_expert int32 [L] (device), counts (python ints; empty with
        num_worst_tokens), ExpertMajorHandle). No host sync with num_worst_tokens; otherwise one wait for
        notify's counts, like dispatch."""
        self._check()
        r = self.num_ranks
        local = num_experts // r
        k = topk_idx.shape[1]
        if local > self._mod.MAX_LOCAL_EXPERTS or k > self._mod.MAX_TOPK or k == 0:
            return compose_expert_major_dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts, local,
                                                 expert_alignment, num_worst_tokens, config)
        split = self.em_dispatch_mode == "split"
        x = x.contiguous()
        x_scales = x_scales.contiguous() if x_scales is not None else None
        topk_idx = topk_idx.contiguous()
        topk_weights = topk_weights.contiguous() if topk_weights is not None else None
        hidden_bytes, num_scales = row_geometry(x, x_scales, "intranode")
        channels, chunk, slots = self._config(config, combine=False)
        slot_bytes = dispatch_slot_bytes(hidden_bytes, num_scales, k, pair_ranks=not split)
        self._check_fits(channels, slots, slot_bytes, "expert-major dispatch")
        per_rank, _, per_expert, in_rank = self.get_dispatch_layout(topk_idx, num_experts)
        dev, t, stream = x.device, x.shape[0], self._stream()

        if not split:  # the sender's pair ranks travel in the ring slots
            pair_rank = torch.empty(t, k, dtype=torch.int32, device=dev)
            self._pair_rank(topk_idx, num_experts, pair_rank, None)
        prefix = torch.empty(r, r, dtype=torch.int32, device=dev)
        offsets = torch.empty(r, channels + 1, dtype=torch.int32, device=dev)
        layout = torch.empty(self._mod.em_layout_words(r, local), dtype=torch.int32, device=dev)
        self._seq = self._seq % 2_000_000_000 + 1
        seq = self._seq
        # num_worst_tokens bounds the expert-major rows here, not the received rows (fewer: each holds at least
        # one pair), so notify's received-rows check is off (0); the Buffer checks rows_needed instead.
        self._mod.notify(self._ipc, self._timeout_ns, in_rank.data_ptr(), per_rank.data_ptr(), per_expert.data_ptr(), t,
                         num_experts, channels, expert_alignment, 0, seq, prefix.data_ptr(),
                         offsets.data_ptr(), stream, em_layout=layout.data_ptr())
        counts: List[int] = []
        num_recv: Optional[int] = None
        if num_worst_tokens:
            rows = m = num_worst_tokens
        else:
            num_recv = self._wait_counts(seq)
            counts = self._ipc.expert_counts(local)
            rows, m = num_recv, sum(counts)
        recv_src = torch.empty(rows, dtype=torch.int32, device=dev)
        received = offsets[-1, -1:]  # rows received, on the device (rows past it in num_worst_tokens tables)
        if split:
            # Rank-major rows in (source rank, token) order, top-k as local experts; no padding rows (pad_rows 0):
            # the passes below read only the rows received. Launched before the other outputs are allocated, so
            # after a host sync the GPU starts on the transfer first.
            recv_x = torch.empty(rows, x.shape[1], dtype=x.dtype, device=dev)
            recv_s = torch.empty(rows, num_scales, dtype=x_scales.dtype, device=dev) if x_scales is not None else None
            recv_idx = torch.empty(rows, k, dtype=torch.int64, device=dev)
            recv_w = torch.empty(rows, k, dtype=torch.float32, device=dev)
            self._mod.dispatch(self._ipc, self._timeout_ns, x.data_ptr(), self._ptr(x_scales), topk_idx.data_ptr(),
                               self._ptr(topk_weights), in_rank.data_ptr(), offsets.data_ptr(), recv_x.data_ptr(),
                               self._ptr(recv_s), recv_idx.data_ptr(), recv_w.data_ptr(), recv_src.data_ptr(), t,
                               hidden_bytes, num_scales, k, local, rows, 0, channels, chunk, slots, slot_bytes, stream,
                               protocol=self._protocol)
        px = torch.empty(m, x.shape[1], dtype=x.dtype, device=dev)
        ps = torch.empty(m, num_scales, dtype=x_scales.dtype, device=dev) if x_scales is not None else None
        pw = torch.empty(m, dtype=torch.float32, device=dev) if topk_weights is not None else None
        # One spare element each, so that even empty tables have a non-null address for the kernel.
        pair_row = torch.empty(m + 1, dtype=torch.int32, device=dev)[:m]
        pair_slot = torch.empty(m + 1, dtype=torch.int32, device=dev)[:m]
        inverse = torch.empty((rows + 1) * k, dtype=torch.int32, device=dev)[:rows * k].view(rows, k)
        if split:
            recv_rank = torch.empty(rows, k, dtype=torch.int32, device=dev)
            self._pair_rank(recv_idx, local, recv_rank, received)
            self._em_permute(recv_x, recv_s, inverse, layout, local, expert_alignment, received, px, ps,
                             num_worst_tokens > 0,
                             fresh=(recv_idx, recv_w, recv_rank, pw, pair_row, pair_slot, recv_src))
        else:
            self._mod.dispatch(self._ipc, self._timeout_ns, x.data_ptr(), self._ptr(x_scales), topk_idx.data_ptr(),
                               self._ptr(topk_weights), in_rank.data_ptr(), offsets.data_ptr(), 0, 0, 0, 0,
                               recv_src.data_ptr(), t, hidden_bytes, num_scales, k, local, rows,
                               1 if num_worst_tokens else 0, channels, chunk, slots, slot_bytes, stream,
                               em_mode=1, pair_rank=self._present(pair_rank), em_layout=layout.data_ptr(),
                               em_x=self._ptr(px), em_scales=self._ptr(ps), em_weights=self._present(pw),
                               em_pair_row=self._present(pair_row), em_pair_slot=self._present(pair_slot),
                               em_inverse=self._present(inverse), em_topk=k, em_rows=m,
                               protocol=self._protocol)
        r_local = r * local
        tpe = layout[r_local + 2 * local + 1: r_local + 3 * local + 1]
        need = layout[r_local + local]
        dh = DispatchHandle(prefix, in_rank, recv_src, num_recv, t, num_worst_tokens, self.name, self._buffer_token,
                            backend_state=HandleState((channels, offsets)))
        handle = ExpertMajorHandle(dh, pair_row, pair_slot, tpe, k, rows_needed=need,
                                   backend_state=(inverse, layout, local, expert_alignment))
        return px, ps, pw, tpe, counts, handle

    def _pair_rank(self, idx: torch.Tensor, num_experts: int, out: torch.Tensor, row_limit: Optional[torch.Tensor]):
        """out[t][k] = rank of pair (t, k) among the pairs of idx [T, K] for the same expert, (t, k) order (rows at
        or past the device count row_limit are left out)."""
        t, k = idx.shape
        blocks = (t + self._mod.PAIR_RANK_TOKENS - 1) // self._mod.PAIR_RANK_TOKENS
        workspace = torch.empty(max(blocks, 1) * num_experts, dtype=torch.int32, device=idx.device)
        self._mod.pair_rank(idx.data_ptr(), t, k, num_experts, out.data_ptr(), workspace.data_ptr(), self._stream(),
                            row_limit=self._ptr(row_limit))

    def _em_permute(self, rows_x: torch.Tensor, rows_s: Optional[torch.Tensor], inverse: torch.Tensor,
                    layout: torch.Tensor, local: int, alignment: int, received: torch.Tensor, px: torch.Tensor,
                    ps: Optional[torch.Tensor], bounded: bool, fresh=None) -> None:
        """Rank-major received rows [N, ...] -> expert-major rows px [M, ...] (split dispatch's local pass): fresh
        = (received top-k, received weights, pair ranks, permuted weights or None, pair_row, pair_slot, source
        indices) places the pairs and fills the tables; None (cached) follows inverse. received: the device count
        of rows that arrived (offsets[-1, -1:]). bounded: M is num_worst_tokens (rows past the last expert's are
        padding)."""
        n, k = inverse.shape
        m = px.shape[0]
        hidden_bytes, num_scales = row_geometry(px, ps, "intranode")
        # Padding rows: each expert's alignment rows, and with num_worst_tokens the rows past the last expert's.
        pad_blocks = min(self._num_sms, (m + 7) // 8) if (alignment > 1 or bounded) else 0
        idx, w, rank, pw, pair_row, pair_slot, src = fresh if fresh is not None else (None,) * 7
        p = self._present  # empty tensors (no rows) still need non-null addresses for the launcher's checks
        self._mod.em_permute(p(rows_x), p(rows_s), p(idx), p(w), p(rank), layout.data_ptr(), received.data_ptr(),
                             p(px), p(ps), p(pw), p(pair_row), p(pair_slot), p(inverse), p(src),
                             1 if fresh is not None else 0, n, hidden_bytes, num_scales, k,
                             self.num_ranks, local, alignment, m, pad_blocks, self._stream())

    def _wait_counts(self, seq: int) -> int:
        """The host's wait for notify call `seq` (fresh dispatch without num_worst_tokens): rows received (one
        method, so that tools/profile_round_trip.py can count the waits)."""
        return wait_counts(self, seq, self._mod.FLAG_LAYOUT_MISMATCH)

    def expert_major_cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                                     handle: ExpertMajorHandle, config: Optional[Config] = None):
        """x [T, H] -> expert-major rows [M, H] along the handle's routing (no count exchange, no host sync);
        em_dispatch_mode "split": rank-major cached dispatch, then em_permute along the handle's inverse table;
        "fused": the dispatch kernel's receivers write the expert-major rows."""
        self._check()
        if handle.backend_state is None:  # the handle came from the composition: do the same here
            rows, row_scales = self.cached_dispatch(x, x_scales, handle.dispatch)
            return gather_rows(rows, handle), (gather_rows(row_scales, handle) if x_scales is not None else None)
        x = x.contiguous()
        x_scales = x_scales.contiguous() if x_scales is not None else None
        hidden_bytes, num_scales = row_geometry(x, x_scales, "intranode")
        inverse, layout, local, alignment = handle.backend_state
        dh = handle.dispatch
        channels, offsets = dh.backend_state.routing
        _, chunk, slots = self._config(None, combine=False)
        slot_bytes = dispatch_slot_bytes(hidden_bytes, num_scales, 0)
        self._check_fits(channels, slots, slot_bytes, "expert-major cached dispatch")
        m, rows, dev = handle.pair_row.numel(), dh.recv_src_idx.shape[0], x.device
        if self.em_dispatch_mode == "split":  # rank-major rows (no padding rows: em_permute reads the received)
            recv_x = torch.empty(rows, x.shape[1], dtype=x.dtype, device=dev)
            recv_s = torch.empty(rows, num_scales, dtype=x_scales.dtype, device=dev) if x_scales is not None else None
            self._mod.dispatch(self._ipc, self._timeout_ns, x.data_ptr(), self._ptr(x_scales), 0, 0,
                               dh.is_token_in_rank.data_ptr(), offsets.data_ptr(), recv_x.data_ptr(),
                               self._ptr(recv_s), 0, 0, 0, x.shape[0], hidden_bytes, num_scales, 0, 1, rows, 0,
                               channels, chunk, slots, slot_bytes, self._stream(), protocol=self._protocol)
            return self.em_permute(recv_x, recv_s, handle)
        px = torch.empty(m, x.shape[1], dtype=x.dtype, device=dev)
        ps = torch.empty(m, num_scales, dtype=x_scales.dtype, device=dev) if x_scales is not None else None
        self._mod.dispatch(self._ipc, self._timeout_ns, x.data_ptr(), self._ptr(x_scales), 0, 0,
                           dh.is_token_in_rank.data_ptr(), offsets.data_ptr(), 0, 0, 0, 0, 0, x.shape[0],
                           hidden_bytes, num_scales, 0, local, rows, 1 if dh.num_worst_tokens else 0, channels, chunk,
                           slots, slot_bytes, self._stream(), em_mode=2, em_layout=layout.data_ptr(),
                           em_x=self._ptr(px), em_scales=self._ptr(ps), em_inverse=self._present(inverse),
                           em_topk=handle.num_topk, em_rows=m, protocol=self._protocol)
        return px, ps

    def em_permute(self, rows_x: torch.Tensor, rows_s: Optional[torch.Tensor], handle: ExpertMajorHandle):
        """Split dispatch's local pass along a handle of this backend: rank-major received rows [N, ...] (N rows
        of the handle's tables; only those received are read) -> (expert-major rows [M, ...], scales or None)."""
        inverse, layout, local, alignment = handle.backend_state
        dh = handle.dispatch
        m, dev = handle.pair_row.numel(), rows_x.device
        px = torch.empty(m, rows_x.shape[1], dtype=rows_x.dtype, device=dev)
        ps = torch.empty(m, rows_s.shape[1], dtype=rows_s.dtype, device=dev) if rows_s is not None else None
        self._em_permute(rows_x, rows_s, inverse, layout, local, alignment, dh.backend_state.routing[1][-1, -1:], px, ps,
                         bool(dh.num_worst_tokens))
        return px, ps

    def em_unpermute(self, x: torch.Tensor, handle: ExpertMajorHandle, weights: Optional[torch.Tensor],
                     topk_weights: Optional[torch.Tensor]):
        """Split combine's local pass: expert-major rows x [M, H] (bf16/fp16/fp32) -> each received row's sum of its
        pairs [N, H] (slot order, float32, rounded to x.dtype: unpermute()'s numbers) and, with topk_weights [M],
        the per-slot weights [N, K]. Rows past the received count (num_worst_tokens tables) are not written."""
        inverse = handle.backend_state[0]
        n, k = inverse.shape
        offsets = handle.dispatch.backend_state.routing[1]
        rows = torch.empty(n, x.shape[1], dtype=x.dtype, device=x.device)
        w_rows = torch.empty(n, k, dtype=torch.float32, device=x.device) if topk_weights is not None else None
        self._mod.em_unpermute(self._present(x), self._present(inverse), self._present(weights),
                               self._present(topk_weights), offsets[-1, -1:].data_ptr(), self._present(rows),
                               self._present(w_rows), _COMBINE_DTYPES[x.dtype], x.shape[1], n, k, self._stream())
        return rows, w_rows

    def expert_major_combine(self, x: torch.Tensor, handle: ExpertMajorHandle, weights: Optional[torch.Tensor],
                             topk_weights: Optional[torch.Tensor], bias: Sequence[torch.Tensor],
                             config: Optional[Config] = None):
        """Expert-major rows [M, H] -> [T, H]: each received row's pairs summed (slot order, float32, rounded to
        x.dtype) and sent through the combine rings; topk_weights [M] return to their slot. em_combine_mode
        "split": em_unpermute over the whole GPU, then the rank-major combine kernel; "fused": the combine
        kernel's senders sum straight from x. Returns (combined_x, combined_topk_weights [T, K] or None)."""
        self._check()
        if handle.backend_state is None or x.dtype not in _COMBINE_DTYPES:
            rows, w_rows = unpermute(x, handle, weights, topk_weights)
            return self.combine(rows, handle.dispatch, w_rows, bias, config)
        x = x.contiguous()
        row_bytes = combine_row_bytes(x)
        weights = weights.contiguous() if weights is not None else None
        topk_weights = topk_weights.contiguous() if topk_weights is not None else None
        dh = handle.dispatch
        k = handle.num_topk
        num_topk = k if topk_weights is not None else 0
        channels, offsets = dh.backend_state.routing
        _, chunk, slots = self._config(config, combine=True)
        slot_bytes = combine_slot_bytes(row_bytes, num_topk)
        self._check_fits(channels, slots, slot_bytes, "expert-major combine")
        biases = [b.contiguous() for b in bias]
        t, dev = dh.num_tokens, x.device
        out = torch.empty(t, x.shape[1], dtype=x.dtype, device=dev)
        out_w = torch.empty(t, k, dtype=torch.float32, device=dev) if topk_weights is not None else None
        n = dh.recv_src_idx.shape[0]
        if self.em_combine_mode == "split":
            # The permutation's reads (every expert row, scattered over the local experts' blocks) and the float32
            # sums run over the whole GPU here, not on the combine kernel's 2 x channels SMs.
            rows, w_rows = self.em_unpermute(x, handle, weights, topk_weights)
            self._mod.combine(self._ipc, self._timeout_ns, rows.data_ptr(), self._ptr(w_rows),
                              self._ptr(biases[0] if len(biases) > 0 else None),
                              self._ptr(biases[1] if len(biases) > 1 else None), dh.is_token_in_rank.data_ptr(),
                              offsets.data_ptr(), out.data_ptr(), self._ptr(out_w), _COMBINE_DTYPES[x.dtype], t,
                              x.shape[1], num_topk, n, channels, chunk, slots, slot_bytes, self._stream(),
                              protocol=self._protocol)
            return out, out_w
        self._mod.combine(self._ipc, self._timeout_ns, x.data_ptr(), 0,
                          self._ptr(biases[0] if len(biases) > 0 else None),
                          self._ptr(biases[1] if len(biases) > 1 else None), dh.is_token_in_rank.data_ptr(),
                          offsets.data_ptr(), out.data_ptr(), self._ptr(out_w), _COMBINE_DTYPES[x.dtype], t,
                          x.shape[1], num_topk, n, channels, chunk, slots, slot_bytes,
                          self._stream(), em_inverse=self._present(handle.backend_state[0]),
                          em_weights=self._present(weights), em_topk_weights=self._present(topk_weights), em_topk=k,
                          protocol=self._protocol)
        return out, out_w

    # ------------------------------------------------------------------ buffer access and lifetime
    def local_buffer_tensor(self, dtype: torch.dtype, size: Optional[Sequence[int]] = None, offset: int = 0,
                            use_rdma_buffer: bool = False) -> torch.Tensor:
        """A typed view of this rank's NVLink buffer from byte `offset` (the RDMA buffer is emulated by a
        plain allocation: this backend has none)."""
        self._check()
        total = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes

        def raw() -> torch.Tensor:
            if use_rdma_buffer:
                if self._rdma_emulation is None:
                    self._rdma_emulation = torch.zeros(total, dtype=torch.uint8, device=self.device)
                return self._rdma_emulation
            return torch.as_tensor(_DeviceMemory(self._ipc.local_ptr, total), device=self.device)
        return buffer_view(raw, total, dtype, size, offset, "RDMA" if use_rdma_buffer else "NVLink")

    def destroy(self) -> None:
        """Wait for the device, close the peers' mappings, free the buffer and the mailbox (local only)."""
        self._rdma_emulation = None
        if self._ipc.alive:
            self._ipc.destroy()
