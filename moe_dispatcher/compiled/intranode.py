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
from ..config import Config
from ..expert_major import ExpertMajorHandle, compose_expert_major_dispatch, gather_rows, unpermute
from ..handle import DispatchHandle
from . import current_stream_ptr, row_geometry, timeout_message

TIMEOUT_ENV = "MOE_DISPATCHER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 10.0
# Expert-major combine variant, read when the backend is created (the attribute em_combine_mode changes it
# later, e.g. in the bench): "split" (default) = a local pre-pass kernel over the whole GPU sums each received
# row's expert rows into a rank-major row, then the rank-major combine kernel sends them; "fused" = the combine
# kernel's senders gather and sum the expert rows themselves (send_em_row). Both are bit-identical.
EM_COMBINE_ENV = "MOE_DISPATCHER_EM_COMBINE"
EM_COMBINE_MODES = ("split", "fused")
# How the dispatch and combine kernels move rows through the rings (docs/intranode.md), read when the backend
# is created; the attribute nvl_variant changes it later (bench, tests). All give the same bytes and use the
# same rings, so calls of any may follow each other on one Buffer. "chunked" (default): warp groups in
# lock-step chunks, each ending with a system-scope release by the group leader; "stream": every warp moves
# its own rows and one publisher warp per block updates the ring counters (Config's send chunk is then the
# least rows per tail update); "tma": stream, with senders that move rows by bulk copies (TMA) through shared
# memory, one warp per ring (the expert-major combine sends as stream; so does a slot too large for 2 buffers
# per ring).
NVL_VARIANT_ENV = "MOE_DISPATCHER_NVL_VARIANT"
NVL_VARIANTS = ("chunked", "stream", "tma")  # index = the kernels' RingProtocol
_COMBINE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def dispatch_slot_bytes(hidden_bytes: int, num_scales: int, num_topk: int, pair_ranks: bool = False) -> int:
    """Bytes of one dispatch ring slot: payload, 4-byte scales, top-k ids (int32) and weights, source index,
    and (expert-major fresh dispatch) the int32 pair rank of each slot."""
    return _align16(hidden_bytes + num_scales * 4 + num_topk * (12 if pair_ranks else 8) + 4)


def combine_slot_bytes(row_bytes: int, num_topk: int) -> int:
    """Bytes of one combine ring slot: the row and its top-k weights."""
    return _align16(row_bytes + num_topk * 4)


def required_nvl_bytes(num_ranks: int, num_channels: int, num_slots: int, slot_bytes: int, rings_offset: int) -> int:
    """Smallest num_nvl_bytes whose rings hold `num_slots` slots per (channel, source rank)."""
    return rings_offset + num_ranks * _align16(num_channels * num_slots * slot_bytes + 127)


class _DeviceMemory:
    """Exposes a raw device range to torch.as_tensor through __cuda_array_interface__."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class IntranodeBackend:
    """Compiled normal-mode backend for one Buffer (see the module docstring)."""

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
        # Cases the kernels do not cover (float64 combine, > MAX_LOCAL_EXPERTS experts per rank) go to the
        # reference backend transparently.
        self._reference = buffer._reference_normal
        self.timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
        if self.timeout_s <= 0:
            raise ValueError(f"{TIMEOUT_ENV} must be positive, got {self.timeout_s}")
        self._timeout_ns = int(self.timeout_s * 1e9)
        self.em_combine_mode = os.environ.get(EM_COMBINE_ENV, "split").strip().lower() or "split"
        if self.em_combine_mode not in EM_COMBINE_MODES:
            raise ValueError(f"{EM_COMBINE_ENV} must be one of {EM_COMBINE_MODES}, got {self.em_combine_mode!r}")
        self.nvl_variant = os.environ.get(NVL_VARIANT_ENV, "").strip().lower() or NVL_VARIANTS[0]
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

    # ------------------------------------------------------------------ what this backend serves
    def serves_normal(self, topology) -> bool:
        return bool(topology.is_single_domain and 2 <= topology.num_ranks <= self._mod.MAX_RANKS)

    def serves_low_latency(self) -> bool:
        return False

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
        x = x.contiguous()
        x_scales = x_scales.contiguous() if x_scales is not None else None
        hidden_bytes, num_scales = row_geometry(x, x_scales, "intranode")
        num_topk = 0
        if topk_idx is not None:
            topk_idx = topk_idx.contiguous()
            num_topk = topk_idx.shape[1]
            if num_topk > self._mod.MAX_TOPK:
                raise ValueError(f"dispatch: the intranode kernels take at most {self._mod.MAX_TOPK} top-k slots, "
                                 f"got {num_topk}")
            if topk_weights is not None:
                topk_weights = topk_weights.contiguous()
        num_experts = num_tokens_per_expert.numel()
        local = num_experts // r
        if local > self._mod.MAX_LOCAL_EXPERTS:
            return self._reference.dispatch(x, x_scales, topk_idx, topk_weights, num_tokens_per_rank,
                                            is_token_in_rank, num_tokens_per_expert, expert_alignment,
                                            num_worst_tokens)
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
            num_recv, flags = self._ipc.wait_notify(seq, self.timeout_s + 30.0)
            if num_recv < 0:
                self._check()
                raise RuntimeError(f"moe_dispatcher intranode: rank {self.rank}: notify gave up")
            if flags & self._mod.FLAG_LAYOUT_MISMATCH:
                raise ValueError("dispatch: num_tokens_per_rank does not match is_token_in_rank on some rank (pass "
                                 "the layout that get_dispatch_layout returned for these topk_idx)")
            overflow = self._ipc.take_worst_overflow()
            if overflow is not None:
                raise ValueError(f"dispatch: in an earlier dispatch with num_worst_tokens={overflow[2]}, rank "
                                 f"{overflow[0]} received {overflow[1]} rows; the rows past num_worst_tokens were "
                                 f"dropped (the compiled backend reports this at the next synchronised dispatch, "
                                 f"on every rank; raise num_worst_tokens)")
            counts = self._ipc.expert_counts(local)
            rows = num_recv

        recv_x = torch.empty(rows, x.shape[1], dtype=x.dtype, device=dev)
        recv_scales = (torch.empty(rows, num_scales, dtype=x_scales.dtype, device=dev)
                       if x_scales is not None else None)
        recv_idx = recv_w = None
        if topk_idx is not None:
            recv_idx = torch.empty(rows, num_topk, dtype=torch.int64, device=dev)
            recv_w = torch.empty(rows, num_topk, dtype=torch.float32, device=dev)
        recv_src = torch.empty(rows, dtype=torch.int32, device=dev)
        self._mod.dispatch(self._ipc, self._timeout_ns, x.data_ptr(), self._ptr(x_scales), self._ptr(topk_idx),
                           self._ptr(topk_weights), is_token_in_rank.data_ptr(), offsets.data_ptr(),
                           recv_x.data_ptr(), self._ptr(recv_scales), self._ptr(recv_idx), self._ptr(recv_w),
                           recv_src.data_ptr(), t, hidden_bytes, num_scales, num_topk, local, rows,
                           1 if num_worst_tokens else 0, channels, chunk, slots, slot_bytes, self._stream(),
                           protocol=self._protocol)
        if topk_weights is None:
            recv_w = None
        handle = DispatchHandle(prefix, is_token_in_rank, recv_src, num_recv, t, num_worst_tokens, self.name,
                                self._buffer_token, backend_state=(channels, offsets))
        return recv_x, recv_scales, recv_idx, recv_w, counts, handle

    def cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle,
                        config: Optional[Config] = None):
        """Dispatch along the routing of `handle` with no count exchange and no host sync."""
        self._check()
        x = x.contiguous()
        x_scales = x_scales.contiguous() if x_scales is not None else None
        hidden_bytes, num_scales = row_geometry(x, x_scales, "intranode")
        channels, offsets = handle.backend_state
        _, chunk, slots = self._config(config, combine=False)
        slot_bytes = dispatch_slot_bytes(hidden_bytes, num_scales, 0)
        self._check_fits(channels, slots, slot_bytes, "cached dispatch")
        rows = handle.recv_src_idx.shape[0]
        dev = x.device
        recv_x = torch.empty(rows, x.shape[1], dtype=x.dtype, device=dev)
        recv_scales = (torch.empty(rows, num_scales, dtype=x_scales.dtype, device=dev)
                       if x_scales is not None else None)
        self._mod.dispatch(self._ipc, self._timeout_ns, x.data_ptr(), self._ptr(x_scales), 0, 0,
                           handle.is_token_in_rank.data_ptr(), offsets.data_ptr(), recv_x.data_ptr(),
                           self._ptr(recv_scales), 0, 0, 0, x.shape[0], hidden_bytes, num_scales, 0, 1, rows,
                           1 if handle.num_worst_tokens else 0, channels, chunk, slots, slot_bytes, self._stream(),
                           protocol=self._protocol)
        return recv_x, recv_scales

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                bias: Sequence[torch.Tensor], config: Optional[Config] = None):
        """Reduce the rows of each source token; returns (combined_x, combined_topk_weights or None)."""
        self._check()
        if x.dtype not in _COMBINE_DTYPES:  # float64: the reference reduces it (in float64)
            if handle.num_recv_tokens is None:
                n = int(handle.rank_prefix_matrix[-1, self.rank])
                handle = handle._replace(num_recv_tokens=n)
            return self._reference.combine(x, handle, topk_weights, bias)
        x = x.contiguous()
        row_bytes = x.shape[1] * x.element_size()
        if row_bytes % 16:
            raise ValueError(f"combine: rows of x must be a multiple of 16 bytes, got {row_bytes}")
        num_topk = 0
        if topk_weights is not None:
            topk_weights = topk_weights.contiguous()
            num_topk = topk_weights.shape[1]
            if num_topk > self._mod.MAX_TOPK:
                raise ValueError(f"combine: at most {self._mod.MAX_TOPK} top-k weights per row, got {num_topk}")
        channels, offsets = handle.backend_state
        _, chunk, slots = self._config(config, combine=True)
        slot_bytes = combine_slot_bytes(row_bytes, num_topk)
        self._check_fits(channels, slots, slot_bytes, "combine")
        biases = [b.contiguous() for b in bias]
        t, dev = handle.num_tokens, x.device
        out = torch.empty(t, x.shape[1], dtype=x.dtype, device=dev)
        out_w = torch.empty(t, num_topk, dtype=torch.float32, device=dev) if topk_weights is not None else None
        self._mod.combine(self._ipc, self._timeout_ns, x.data_ptr(), self._ptr(topk_weights),
                          self._ptr(biases[0] if len(biases) > 0 else None),
                          self._ptr(biases[1] if len(biases) > 1 else None), handle.is_token_in_rank.data_ptr(),
                          offsets.data_ptr(), out.data_ptr(), self._ptr(out_w), _COMBINE_DTYPES[x.dtype], t,
                          x.shape[1], num_topk, x.shape[0], channels, chunk, slots, slot_bytes, self._stream(),
                          protocol=self._protocol)
        return out, out_w

    # ------------------------------------------------------------------ expert-major (fused permutation)
    def expert_major_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                              topk_weights: Optional[torch.Tensor], num_experts: int, expert_alignment: int,
                              num_worst_tokens: int, config: Optional[Config] = None):
        """Dispatch straight into expert-major rows (docs/intranode.md, "Expert-major dispatch"): the sender
        carries each pair's rank among its pairs for that expert, notify turns every source's per-expert
        counts into a base row per (source, expert), and the receiver writes each row to all its expert-major
        rows. Returns (permuted_x, permuted_scales, permuted_weights, tokens_per_expert int32 [L] (device),
        counts (python ints; empty with num_worst_tokens), ExpertMajorHandle). No host sync with
        num_worst_tokens; otherwise one wait for notify's counts, like dispatch."""
        self._check()
        r = self.num_ranks
        local = num_experts // r
        k = topk_idx.shape[1]
        if local > self._mod.MAX_LOCAL_EXPERTS or k > self._mod.MAX_TOPK or k == 0:
            return compose_expert_major_dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts, local,
                                                 expert_alignment, num_worst_tokens, config)
        x = x.contiguous()
        x_scales = x_scales.contiguous() if x_scales is not None else None
        topk_idx = topk_idx.contiguous()
        topk_weights = topk_weights.contiguous() if topk_weights is not None else None
        hidden_bytes, num_scales = row_geometry(x, x_scales, "intranode")
        channels, chunk, slots = self._config(config, combine=False)
        slot_bytes = dispatch_slot_bytes(hidden_bytes, num_scales, k, pair_ranks=True)
        self._check_fits(channels, slots, slot_bytes, "expert-major dispatch")
        per_rank, _, per_expert, in_rank = self.get_dispatch_layout(topk_idx, num_experts)
        dev, t, stream = x.device, x.shape[0], self._stream()

        pair_rank = torch.empty(t, k, dtype=torch.int32, device=dev)
        blocks = (t + self._mod.PAIR_RANK_TOKENS - 1) // self._mod.PAIR_RANK_TOKENS
        workspace = torch.empty(max(blocks, 1) * num_experts, dtype=torch.int32, device=dev)
        self._mod.pair_rank(topk_idx.data_ptr(), t, k, num_experts, pair_rank.data_ptr(), workspace.data_ptr(), stream)
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
        px = torch.empty(m, x.shape[1], dtype=x.dtype, device=dev)
        ps = torch.empty(m, num_scales, dtype=x_scales.dtype, device=dev) if x_scales is not None else None
        pw = torch.empty(m, dtype=torch.float32, device=dev) if topk_weights is not None else None
        # One spare element each, so that even empty tables have a non-null address for the kernel.
        pair_row = torch.empty(m + 1, dtype=torch.int32, device=dev)[:m]
        pair_slot = torch.empty(m + 1, dtype=torch.int32, device=dev)[:m]
        inverse = torch.empty((rows + 1) * k, dtype=torch.int32, device=dev)[:rows * k].view(rows, k)
        recv_src = torch.empty(rows, dtype=torch.int32, device=dev)
        self._mod.dispatch(self._ipc, self._timeout_ns, x.data_ptr(), self._ptr(x_scales), topk_idx.data_ptr(),
                           self._ptr(topk_weights), in_rank.data_ptr(), offsets.data_ptr(), 0, 0, 0, 0,
                           recv_src.data_ptr(), t, hidden_bytes, num_scales, k, local, rows,
                           1 if num_worst_tokens else 0, channels, chunk, slots, slot_bytes, stream,
                           em_mode=1, pair_rank=self._present(pair_rank), em_layout=layout.data_ptr(),
                           em_x=self._ptr(px), em_scales=self._ptr(ps), em_weights=self._present(pw),
                           em_pair_row=self._present(pair_row), em_pair_slot=self._present(pair_slot),
                           em_inverse=self._present(inverse), em_topk=k, em_rows=m, protocol=self._protocol)
        r_local = r * local
        tpe = layout[r_local + 2 * local + 1: r_local + 3 * local + 1]
        need = layout[r_local + local]
        dh = DispatchHandle(prefix, in_rank, recv_src, num_recv, t, num_worst_tokens, self.name, self._buffer_token,
                            backend_state=(channels, offsets))
        handle = ExpertMajorHandle(dh, pair_row, pair_slot, tpe, k, backend_state=(inverse, layout, local),
                                   rows_needed=need)
        return px, ps, pw, tpe, counts, handle

    def _wait_counts(self, seq: int) -> int:
        """The host's wait for notify call `seq` (fresh dispatch without num_worst_tokens): rows received."""
        num_recv, flags = self._ipc.wait_notify(seq, self.timeout_s + 30.0)
        if num_recv < 0:
            self._check()
            raise RuntimeError(f"moe_dispatcher intranode: rank {self.rank}: notify gave up")
        if flags & self._mod.FLAG_LAYOUT_MISMATCH:
            raise ValueError("dispatch: num_tokens_per_rank does not match is_token_in_rank on some rank (pass "
                             "the layout that get_dispatch_layout returned for these topk_idx)")
        overflow = self._ipc.take_worst_overflow()
        if overflow is not None:
            raise ValueError(f"dispatch: in an earlier dispatch with num_worst_tokens={overflow[2]}, rank "
                             f"{overflow[0]} received {overflow[1]} rows; the rows past num_worst_tokens were "
                             f"dropped (the compiled backend reports this at the next synchronised dispatch, "
                             f"on every rank; raise num_worst_tokens)")
        return num_recv

    def expert_major_cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                                     handle: ExpertMajorHandle):
        """x [T, H] -> expert-major rows [M, H] along the handle's routing (no count exchange, no host sync)."""
        self._check()
        if handle.backend_state is None:  # the handle came from the composition: do the same here
            rows, row_scales = self.cached_dispatch(x, x_scales, handle.dispatch)
            return gather_rows(rows, handle), (gather_rows(row_scales, handle) if x_scales is not None else None)
        x = x.contiguous()
        x_scales = x_scales.contiguous() if x_scales is not None else None
        hidden_bytes, num_scales = row_geometry(x, x_scales, "intranode")
        inverse, layout, local = handle.backend_state
        dh = handle.dispatch
        channels, offsets = dh.backend_state
        _, chunk, slots = self._config(None, combine=False)
        slot_bytes = dispatch_slot_bytes(hidden_bytes, num_scales, 0)
        self._check_fits(channels, slots, slot_bytes, "expert-major cached dispatch")
        m, rows, dev = handle.pair_row.numel(), dh.recv_src_idx.shape[0], x.device
        px = torch.empty(m, x.shape[1], dtype=x.dtype, device=dev)
        ps = torch.empty(m, num_scales, dtype=x_scales.dtype, device=dev) if x_scales is not None else None
        self._mod.dispatch(self._ipc, self._timeout_ns, x.data_ptr(), self._ptr(x_scales), 0, 0,
                           dh.is_token_in_rank.data_ptr(), offsets.data_ptr(), 0, 0, 0, 0, 0, x.shape[0],
                           hidden_bytes, num_scales, 0, local, rows, 1 if dh.num_worst_tokens else 0, channels, chunk,
                           slots, slot_bytes, self._stream(), em_mode=2, em_layout=layout.data_ptr(),
                           em_x=self._ptr(px), em_scales=self._ptr(ps), em_inverse=self._present(inverse),
                           em_topk=handle.num_topk, em_rows=m, protocol=self._protocol)
        return px, ps

    def expert_major_combine(self, x: torch.Tensor, handle: ExpertMajorHandle, weights: Optional[torch.Tensor],
                             topk_weights: Optional[torch.Tensor], bias: Sequence[torch.Tensor],
                             config: Optional[Config] = None):
        """Expert-major rows [M, H] -> [T, H]: the expert-side sender sums each received row's pairs (slot order,
        float32, rounded to x.dtype) straight from x and sends that through the combine rings; topk_weights [M]
        return to their slot. Returns (combined_x, combined_topk_weights [T, K] or None)."""
        self._check()
        if handle.backend_state is None or x.dtype not in _COMBINE_DTYPES:
            rows, w_rows = unpermute(x, handle, weights, topk_weights)
            return self.combine(rows, handle.dispatch, w_rows, bias, config)
        x = x.contiguous()
        row_bytes = x.shape[1] * x.element_size()
        if row_bytes % 16:
            raise ValueError(f"combine: rows of x must be a multiple of 16 bytes, got {row_bytes}")
        weights = weights.contiguous() if weights is not None else None
        topk_weights = topk_weights.contiguous() if topk_weights is not None else None
        inverse, _, _ = handle.backend_state
        dh = handle.dispatch
        k = handle.num_topk
        num_topk = k if topk_weights is not None else 0
        channels, offsets = dh.backend_state
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
            rows = torch.empty(n, x.shape[1], dtype=x.dtype, device=dev)
            w_rows = torch.empty(n, k, dtype=torch.float32, device=dev) if topk_weights is not None else None
            blocks = min((n + 7) // 8, 4 * self._num_sms)  # 8 warps (rows) per block, grid-stride beyond
            self._mod.em_unpermute(x.data_ptr(), self._present(inverse), self._present(weights),
                                   self._present(topk_weights), offsets.data_ptr(), rows.data_ptr(),
                                   self._present(w_rows), _COMBINE_DTYPES[x.dtype], x.shape[1], n, k, self.num_ranks,
                                   channels, blocks, self._stream())
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
                          self._stream(), em_inverse=self._present(inverse), em_weights=self._present(weights),
                          em_topk_weights=self._present(topk_weights), em_topk=k, protocol=self._protocol)
        return out, out_w

    # ------------------------------------------------------------------ buffer access and lifetime
    def local_buffer_tensor(self, dtype: torch.dtype, size: Optional[Sequence[int]] = None, offset: int = 0,
                            use_rdma_buffer: bool = False) -> torch.Tensor:
        """A typed view of this rank's NVLink buffer from byte `offset` (the RDMA buffer is emulated by a
        plain allocation: this backend has none)."""
        self._check()
        total = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        elem = torch.empty((), dtype=dtype).element_size()
        count = (total - offset) // elem if size is None else int(torch.Size(size).numel())
        if offset < 0 or offset % elem or offset + count * elem > total:
            raise ValueError(f"get_local_buffer_tensor: {count} x {dtype} at offset {offset} does not fit the "
                             f"{total}-byte {'RDMA' if use_rdma_buffer else 'NVLink'} buffer")
        if use_rdma_buffer:
            if self._rdma_emulation is None:
                self._rdma_emulation = torch.zeros(total, dtype=torch.uint8, device=self.device)
            raw = self._rdma_emulation
        else:
            raw = torch.as_tensor(_DeviceMemory(self._ipc.local_ptr, total), device=self.device)
        view = raw[offset: offset + count * elem].view(dtype)
        return view.view(*size) if size is not None else view

    def destroy(self) -> None:
        """Wait for the device, close the peers' mappings, free the buffer and the mailbox (local only)."""
        self._rdma_emulation = None
        if self._ipc.alive:
            self._ipc.destroy()
