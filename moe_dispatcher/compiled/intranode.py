"""Normal-mode intranode backend: dispatch and combine over NVLink with the compiled kernels.

One IntranodeBackend belongs to one Buffer whose group is a single NVLink domain of 2..8 GPUs. It owns
the rank's NVLink buffer (cudaMalloc'd, shared with the peers through CUDA IPC handles exchanged in the
Buffer's creation rounds: compiled.create_backends) and a host-mapped mailbox. The Buffer validates the user's
inputs (moe_dispatcher.validation) and runs every method inside its comm stream with the previous_event /
async_finish / allocate_on_comm_stream semantics; methods here check what depends on the kernels (config limits,
ring sizes), allocate outputs on the current stream and launch. Cached calls (dispatch along a handle, combine)
run from native plans kept in the handle's state: the Buffer's fast path calls a plan directly, once its first
call made it (CachedPlans). docs/intranode.md describes the protocol and the host path.
With Buffer(num_pool_bytes=N) the allocation has a tail of N bytes past the kernels' buffer, the region of the
Buffer's PeerPool (peer_pool.py): torch tensors every peer has mapped, closed here before the mappings close.

Host synchronisation: a fresh dispatch without num_worst_tokens waits (spinning on mapped memory) for
notify's receive counts; cached dispatch, dispatch with num_worst_tokens, layout and combine never do.
So a rank receiving more than num_worst_tokens rows cannot raise at that call: its extra rows are dropped
(nothing hangs) and every rank raises ValueError at its next synchronised (fresh, no num_worst_tokens)
dispatch.
Agreement: notify compares every rank's signature hash and problem word (moe_dispatcher.signature, bad expert
ids flagged by the layout kernel included); a disagreement raises SignatureMismatch on every rank at the same
host wait (num_worst_tokens calls: at the next synchronised dispatch, or earlier where the caller asks with
check_refused_calls, as the Megatron integration's step-end check does). Notify refuses such a call on every rank
alike, so its kernels and those of the calls along its handle move nothing and return padding / zero rows
(csrc/kernels/common/refused_call.cuh). Cached calls (dispatch along a handle, combine) carry a ring signature
(signature.ring_signature_word: the fields that fix the slot layout) with the first row of every ring; a
receiver that finds its source's differing reads none of that source's slots and records the pair; the next
fresh dispatch's notify reports it as this rank's problem word, so every rank refuses that call and raises
SignatureMismatch alike, the fields named from every rank's records (csrc/kernels/common/ring_signature.cuh).
A spin-wait that exceeds MOE_DISPATCHER_TIMEOUT_S seconds (default 10) in a kernel records the phase, the waiting
rank and the peer; the next call (or the notify wait) raises RuntimeError naming them. A rank that raises in a
Buffer call writes its abort byte on every peer (post_abort), and a peer's kernel waiting for it gives up after
seeing it at two looks ~1 s apart: its next call (or notify wait) raises PeerError "rank r raised: ..." with the
message the raising rank posted on the Board (docs/intranode.md, "Errors on one rank: the peer abort").
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .. import _ext
from ..backend import Backend, Capabilities
from ..reference.board import PeerError
from ..config import Config, align_slot
from ..expert_major import ExpertMajorHandle, compose_expert_major_dispatch, gather_rows, unpermute
from ..handle import DispatchHandle
from ..signature import (KeptSignatures, Signature, dispatch_signature, raise_disagreement, ring_signature_word,
                         signature_hash)
from .peer_pool import PeerPool
from . import (STATUS_PEER_ABORTED, TIMEOUT_ENV, HandleState, NvlinkMappings, buffer_view, combine_tensors,
               kernel_timeout_s, posted_by_peer, raise_refused_calls, recv_tensors, run_cached, timeout_message,
               wait_counts)

# Dtypes of combine input the kernels reduce (others go to the reference backend: capabilities.combine_dtypes).
COMBINE_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})
# Signatures of fresh calls kept for the error of a disagreement reported later (num_worst_tokens calls do not
# wait for notify; the next synchronised dispatch or check_refused_calls reports): the latest this many runs of
# equal signatures (signature.KeptSignatures).
KEPT_SIGNATURES = 64


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def dispatch_slot_bytes(hidden_bytes: int, num_scales: int, num_topk: int) -> int:
    """Bytes of one dispatch ring slot: payload, 4-byte scales, top-k ids (int32) and weights, source index;
    rounded by align_slot."""
    return align_slot(hidden_bytes + num_scales * 4 + num_topk * 8 + 4)


def combine_slot_bytes(row_bytes: int, num_topk: int) -> int:
    """Bytes of one combine ring slot: the row and its top-k weights; rounded by align_slot."""
    return align_slot(row_bytes + num_topk * 4)


def required_nvl_bytes(num_ranks: int, num_channels: int, num_slots: int, slot_bytes: int, rings_offset: int) -> int:
    """Smallest num_nvl_bytes whose rings hold `num_slots` slots per (channel, source rank)."""
    return rings_offset + num_ranks * _align16(num_channels * num_slots * slot_bytes + 127)


def _row_bytes(x: torch.Tensor) -> int:
    return x.shape[1] * x.element_size()


def _columns(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.shape[1]


def _contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def _combine_ring_signature(x: torch.Tensor, topk_weights: Optional[torch.Tensor], slots: int) -> int:
    """The ring signature of a combine of x [N, H] with top-k weights [N, K] or None over rings of `slots`."""
    return ring_signature_word("combine", x.shape[1], x.dtype, None, 0, _columns(topk_weights), slots)


class _DeviceMemory:
    """Exposes a raw device range to torch.as_tensor through __cuda_array_interface__. The tensor holds this object
    until its storage is freed, and this object holds `owner` (the native buffer whose memory the range is): the
    memory outlives every view (runtime/release.py)."""

    def __init__(self, ptr: int, nbytes: int, owner: object = None) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class IntranodeBackend(NvlinkMappings, Backend):
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
        self._board = buffer._board  # the message of a peer's abort (timeout_message)
        self._abort_posted = False  # this rank posted an abort: its next full-path call clears it first
        self.capabilities = Capabilities(normal=True, expert_major=True, combine_dtypes=COMBINE_DTYPES,
                                         max_local_experts=self._mod.MAX_LOCAL_EXPERTS, devices=frozenset({"cuda"}))
        self.timeout_s = kernel_timeout_s()
        self._timeout_ns = int(self.timeout_s * 1e9)
        minimum = self._mod.RINGS_OFFSET + self.num_ranks * 128
        if self.num_nvl_bytes < minimum:
            raise ValueError(f"num_nvl_bytes={self.num_nvl_bytes} is too small for the intranode kernels (at least "
                             f"{minimum}; use Config.get_nvl_buffer_size_hint)")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.num_pool_bytes = buffer.num_pool_bytes
        # With num_pool_bytes the allocation has the peer pool's region as its tail (exported with the buffer).
        self._ipc = (self._mod.IpcBuffer(self.rank, self.num_ranks, self.num_nvl_bytes, self.num_pool_bytes)
                     if self.num_pool_bytes else self._mod.IpcBuffer(self.rank, self.num_ranks, self.num_nvl_bytes))
        self._peer_pool_native = (mod.peer_pool, mod.__file__)
        self.peer_pool: Optional[PeerPool] = None  # made by connect()
        # The latest direct dispatch's output blocks [payload, meta] (one list for the backend's life: the native plans
        # of cached direct dispatches set its items too).
        self._direct_blocks: List[Optional[torch.Tensor]] = [None, None]
        # The Buffer's comm stream, with the events that join it to the caller's stream in cached calls.
        self._comm = self._mod.CommStream(buffer.get_comm_stream())
        self.launch_order = self._comm
        self.layout_call, self.layout_args = self._mod.layout_call, (self.num_ranks, self.num_ranks, self._ipc)
        self._seq = 0
        self._notified = 0  # seq of the latest notify launched (check_refused_calls waits for it)
        # Agreement (moe_dispatcher.signature): the signatures of the latest fresh calls by seq, for the error of
        # a disagreement that notify recorded (one all-gather of them then names the fields).
        self._signatures = KeptSignatures(KEPT_SIGNATURES)
        self._broken: Optional[str] = None
        self._peer_aborted = False  # what _broken says: a peer's abort (PeerError) rather than a timeout
        self._rdma_emulation: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ creation (compiled.create_backends)
    def creation_payload(self) -> bytes:
        """What the peers need of this rank: the CUDA IPC handle of its buffer."""
        return self._ipc.ipc_handle()

    def connect(self, payloads: Sequence[bytes]) -> None:
        """Local, once every rank allocated: map every peer's buffer (payloads: each rank's creation_payload) and
        make the peer pool."""
        self._ipc.open_peers(list(payloads))
        if self.num_pool_bytes:
            native, path = self._peer_pool_native
            self.peer_pool = PeerPool(self._ipc, native, path, self.device, self.rank, self.num_ranks)

    # ------------------------------------------------------------------ errors
    def _check(self) -> None:
        """Raise if no call may be made (destroyed, or a kernel recorded a timeout or a peer's abort); clear this
        rank's own abort first when it posted one (the cached plans clear it natively)."""
        if self._broken is not None:
            raise (PeerError if self._peer_aborted else RuntimeError)(self._broken)
        if not self._ipc.alive:
            raise RuntimeError("the intranode backend was destroyed")
        if self._abort_posted:
            self._abort_posted = False
            self._ipc.clear_abort_if_posted()
        info = self._ipc.timeout_info()
        if info is not None:
            self._fail(info)

    def _fail(self, info) -> None:
        self._broken = timeout_message(self.name, info, self.timeout_s, TIMEOUT_ENV, self._board)
        self._peer_aborted = info[0] == STATUS_PEER_ABORTED
        raise (PeerError if self._peer_aborted else RuntimeError)(self._broken)

    def post_abort(self) -> None:
        """Backend.post_abort: this rank's abort byte on every domain peer (not after this rank's kernels
        honoured a peer's abort, nor once closed)."""
        if self._ipc.alive and not posted_by_peer(self._ipc.timeout_info()):
            self._ipc.post_abort()
            self._abort_posted = True

    def refused(self) -> None:
        """A plan did not launch: raise why (destroyed, or a timeout recorded)."""
        self._check()
        raise RuntimeError("moe_dispatcher intranode: the launch was refused")

    # ------------------------------------------------------------------ kernel limits
    def _config(self, config: Optional[Config], combine: bool) -> Tuple[int, int, int]:
        """(channels, send chunk, ring slots) of `config` (None: the Buffer's default), checked against the
        kernels' limits."""
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

    def _ring(self, config: Optional[Config], combine: bool, slot_bytes: int, what: str,
              channels: Optional[int] = None) -> Tuple[int, int, int, int]:
        """(channels, chunk, slots, slot_bytes) of a call, checked; channels: the handle's, when it has them."""
        own, chunk, slots = self._config(config, combine)
        channels = own if channels is None else channels
        self._check_fits(channels, slots, slot_bytes, what)
        return channels, chunk, slots, slot_bytes

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        self._check()
        out = self.layout_call(topk_idx.contiguous(), num_experts, *self.layout_args)
        if out is None:  # the Buffer validated topk_idx and num_experts first
            raise ValueError(f"get_dispatch_layout: topk_idx {tuple(topk_idx.shape)} {topk_idx.dtype} with "
                             f"{num_experts} experts is not a routing the layout kernel takes")
        return out

    # ------------------------------------------------------------------ dispatch
    def _notify(self, is_token_in_rank: torch.Tensor, num_tokens_per_rank: torch.Tensor,
                num_tokens_per_expert: torch.Tensor, channels: int, expert_alignment: int, num_worst_tokens: int,
                signature: Signature, em_layout: Optional[torch.Tensor] = None,
                send_row_offset: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """Launch notify, which also compares every rank's `signature`: -> (rank_prefix_matrix int32 [R, R],
        recv_channel_offset int32 [R, C + 1], its seq). send_row_offset (int32 [R, C], direct dispatch) receives
        where this rank's rows of each channel start in each destination's outputs."""
        r, dev = self.num_ranks, is_token_in_rank.device
        prefix = torch.empty(r, r, dtype=torch.int32, device=dev)
        offsets = torch.empty(r, channels + 1, dtype=torch.int32, device=dev)
        self._seq = self._seq % 2_000_000_000 + 1
        self._signatures.add(self._seq, signature)
        self._mod.notify(self._ipc, self._timeout_ns, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert,
                         channels, expert_alignment, num_worst_tokens, self._seq, prefix, offsets, em_layout,
                         signature_hash=signature_hash(signature), problem=signature.problem,
                         send_row_offset=send_row_offset)
        self._notified = self._seq
        return prefix, offsets, self._seq

    def dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], num_tokens_per_rank: torch.Tensor,
                 is_token_in_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor, expert_alignment: int,
                 num_worst_tokens: int, config: Optional[Config] = None):
        """Fresh dispatch; returns what ReferenceNormal.dispatch returns."""
        self._check()
        x, x_scales, topk_idx, topk_weights = x.contiguous(), _contiguous(x_scales), _contiguous(topk_idx), \
            _contiguous(topk_weights)
        local = num_tokens_per_expert.numel() // self.num_ranks
        num_topk = _columns(topk_idx)
        channels, chunk, slots, slot_bytes = self._ring(
            config, False, dispatch_slot_bytes(_row_bytes(x), _columns(x_scales), num_topk), "dispatch")
        is_token_in_rank = is_token_in_rank.contiguous()
        # With num_worst_tokens the per-expert counts stay on the device (Backend.dispatch): notify's
        # expert-major table holds them.
        layout = (torch.empty(self._mod.em_layout_words(self.num_ranks, local), dtype=torch.int32, device=x.device)
                  if num_worst_tokens else None)
        signature = dispatch_signature("dispatch", x, x_scales, topk_idx, topk_weights, num_tokens_per_expert.numel(),
                                       config or self._buffer_cls.get_dispatch_config(self.num_ranks))
        # With a peer pool (the same on every rank: agreed at creation) the rows go straight into the receivers'
        # outputs (_direct_dispatch); notify tells each rank where its rows start there.
        send_rows = (torch.empty(self.num_ranks, channels, dtype=torch.int32, device=x.device)
                     if self.peer_pool is not None else None)
        prefix, offsets, seq = self._notify(is_token_in_rank, num_tokens_per_rank.contiguous(),
                                            num_tokens_per_expert.contiguous(), channels, expert_alignment,
                                            num_worst_tokens, signature, layout, send_rows)
        counts: List[int] = []
        num_recv: Optional[int] = None
        if num_worst_tokens:
            rows = num_worst_tokens
            padded = self.num_ranks * local + 2 * local + 1  # ExpertMajorLayout::padded(0)
            counts = layout[padded:padded + local]
        else:
            num_recv = self._wait_counts(seq)
            counts = self._ipc.expert_counts(local)
            rows = num_recv

        direct = None
        if send_rows is not None:
            row_of_token = torch.full((x.shape[0], self.num_ranks), -1, dtype=torch.int32, device=x.device)
            direct = (send_rows, row_of_token)
            recv_x, recv_scales, recv_idx, recv_w, recv_src = self._direct_dispatch(
                x, x_scales, topk_idx, topk_weights, is_token_in_rank, offsets, send_rows, rows, local,
                bool(num_worst_tokens), (channels, chunk, slots, slot_bytes), row_of_token)
        else:
            recv_x, recv_scales, recv_idx, recv_w, recv_src = recv_tensors(
                rows, x, x_scales, _columns(x_scales), num_topk if topk_idx is not None else None)
            self._mod.dispatch(self._ipc, self._timeout_ns, x, x_scales, topk_idx, topk_weights, is_token_in_rank,
                               offsets, recv_x, recv_scales, recv_idx, recv_w, recv_src, local, bool(num_worst_tokens),
                               channels, chunk, slots, slot_bytes)
        if topk_weights is None:
            recv_w = None
        handle = DispatchHandle(prefix, is_token_in_rank, recv_src, num_recv, x.shape[0], num_worst_tokens, self.name,
                                self._buffer_token, backend_state=HandleState((channels, offsets, direct)))
        return recv_x, recv_scales, recv_idx, recv_w, counts, handle

    def _direct_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                         topk_weights: Optional[torch.Tensor], is_token_in_rank: torch.Tensor, offsets: torch.Tensor,
                         send_rows: torch.Tensor, rows: int, local: int, pad_rows: bool,
                         ring: Tuple[int, int, int, int], row_of_token: torch.Tensor) -> list:
        """A fresh dispatch by the direct kernel (kernels/intranode/dispatch_direct.cu) into outputs allocated in the
        peer pool: a payload block carved natively into recv_x [rows, H] and recv_scales [rows, S] or None, and a
        meta block carved into recv_topk_idx [rows, K] and recv_topk_weights [rows, K] (or None without topk_idx)
        and recv_src_idx [rows], apart so that the handle, which keeps the source index, does not keep the
        payload's memory; row_of_token (int32 [T, R], -1 first) receives where each token landed at each rank, the
        pull combine's map (a cached dispatch along such a handle runs from its native plan, cached_direct_dispatch).
        A block the pool has no room for (or any block while a CUDA graph is being captured: the graph's allocations
        are its own pool's) comes from torch's allocator, and the rank says so to its peers in the kernel: then no
        rank writes directly and the ring kernel queued after it moves the call on every rank (the same outputs). The
        blocks of the latest call stay referenced here: a peer that is late with it (or runs it after this rank gave
        up) writes into them, never into memory handed out again."""
        payload_bytes = self._mod.direct_payload_bytes(rows, _row_bytes(x), _columns(x_scales))
        payload, out_offset = self._pool_block(payload_bytes, x.device)
        meta, meta_offset = self._pool_block(self._mod.direct_meta_bytes(rows, _columns(topk_idx)), x.device)
        self._direct_blocks[:] = (payload, meta)
        return list(self._mod.direct_dispatch(self._ipc, self._timeout_ns, x, x_scales, topk_idx, topk_weights,
                                              is_token_in_rank, offsets, send_rows, payload, out_offset, meta,
                                              meta_offset, rows, local, pad_rows, *ring, row_of_token=row_of_token))

    def _pool_block(self, nbytes: int, device: torch.device) -> Tuple[torch.Tensor, int]:
        """A uint8 block of at least `nbytes` bytes for a direct dispatch's outputs and its offset in this rank's
        NVLink buffer: from the peer pool, its size rounded up to a power of two (2 MiB at least) so that torch's
        cached blocks serve the next calls, whose sizes vary (torch cannot hand a live pool's cached segments back
        to the region); or from torch's own allocator with offset -1 when the pool has no room or a CUDA graph is
        being captured. One native rule (pool_block in csrc/intranode_bindings.cpp), which the cached direct
        dispatch's plan follows too."""
        block, offset = self._mod.pool_block(self._ipc, device.index, self.peer_pool.mem_pool_id, nbytes)
        return block, offset

    def _combine_along(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor], bias0, bias1, handle,
                       out: torch.Tensor, out_w: Optional[torch.Tensor], ring: Tuple[int, int, int, int]) -> None:
        """Launch the combine of x along `handle` into out / out_w: the ring kernel, or along a direct dispatch's
        handle the pull kernel (then the ring kernel moves the call only if some rank's input is not in its pool: the
        binding finds where x and topk_weights lie)."""
        _, offsets, direct = handle.backend_state.routing
        pull = {} if direct is None else {"row_of_token": direct[1]}
        self._mod.combine(self._ipc, self._timeout_ns, x, topk_weights, bias0, bias1, handle.is_token_in_rank,
                          offsets, out, out_w, *ring, ring_signature=_combine_ring_signature(x, topk_weights, ring[2]),
                          **pull)

    def _wait_counts(self, seq: int) -> int:
        """The host's wait for notify call `seq` (fresh dispatch without num_worst_tokens): rows received (one
        method, so that tools/profile_round_trip.py can count the waits). Raises SignatureMismatch on every rank
        when notify recorded a disagreement in this call or an earlier unsynchronised one."""
        try:
            num_recv = wait_counts(self, seq, self._mod.FLAG_LAYOUT_MISMATCH)
        except ValueError:  # an all-rank verdict of notify (layout, overflow): a disagreement explains it first
            self._raise_disagreement()
            raise
        self._raise_disagreement()
        return num_recv

    def check_refused_calls(self) -> None:
        """Backend.check_refused_calls: raise now what the next synchronised dispatch would raise for the calls
        that did not wait for notify (compiled.raise_refused_calls)."""
        raise_refused_calls(self)

    def _raise_disagreement(self) -> None:
        """After a completed notify wait: raise SignatureMismatch (collective, every rank alike) if notify recorded
        a disagreement since the last report."""
        mismatch = self._ipc.take_signature_mismatch(self.num_ranks)
        if mismatch is not None:
            raise_disagreement(self.group, self.device, self._signatures, *mismatch,
                               ring_records=lambda: self._ipc.take_ring_mismatch() or [])

    # ------------------------------------------------------------------ cached calls
    def cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle,
                        config: Optional[Config] = None):
        """Dispatch along the routing of `handle` with no count exchange and no host sync, on the current stream."""
        self._check()
        x, x_scales = x.contiguous(), _contiguous(x_scales)
        return run_cached(self, handle.backend_state.dispatch_plans, x_scales is not None, self._dispatch_plan, handle,
                          x, x_scales, config)

    def _dispatch_plan(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle,
                       config: Optional[Config]):
        """The checks of a cached dispatch, then its native plan: the ring dispatch, or along a handle of a direct
        dispatch the direct kernel into outputs in the peer pool (the ring kernel after it)."""
        channels, offsets, direct = handle.backend_state.routing
        ring = self._ring(config, False, dispatch_slot_bytes(_row_bytes(x), _columns(x_scales), 0), "cached dispatch",
                          channels)
        word = ring_signature_word("cached dispatch", x.shape[1], x.dtype,
                                   x_scales.dtype if x_scales is not None else None, _columns(x_scales), 0, ring[2])
        if direct is not None:
            return self._mod.cached_direct_dispatch(self._ipc, self._comm, self._timeout_ns, handle, offsets, direct[0],
                                                    x, x_scales, *ring, config, self._buffer_cls.num_sms, word,
                                                    self.peer_pool.mem_pool_id, self._direct_blocks)
        return self._mod.cached_dispatch(self._ipc, self._comm, self._timeout_ns, handle, offsets, x, x_scales, *ring,
                                         config, self._buffer_cls.num_sms, ring_signature=word)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                bias: Sequence[torch.Tensor], config: Optional[Config] = None):
        """Reduce the rows of each source token on the current stream; returns (combined_x, combined_topk_weights
        or None)."""
        self._check()
        x, topk_weights = x.contiguous(), _contiguous(topk_weights)
        if not bias:
            return run_cached(self, handle.backend_state.combine_plans, topk_weights is not None, self._combine_plan,
                              handle, x, topk_weights, config)
        # With a bias (rare: no plan, and the Buffer's fast path does not take it).
        channels = handle.backend_state.routing[0]
        ring = self._ring(config, True, combine_slot_bytes(_row_bytes(x), _columns(topk_weights)), "combine", channels)
        out, out_w, bias0, bias1 = combine_tensors(handle.num_tokens, x, topk_weights, bias)
        self._combine_along(x, topk_weights, bias0, bias1, handle, out, out_w, ring)
        return out, out_w

    def _combine_plan(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor], handle: DispatchHandle,
                      config: Optional[Config]):
        """The checks of a combine (x of a kernel dtype), then its native plan: the ring combine, or along a direct
        dispatch's handle the pull combine (the ring one after it)."""
        channels, offsets, direct = handle.backend_state.routing
        ring = self._ring(config, True, combine_slot_bytes(_row_bytes(x), _columns(topk_weights)), "combine", channels)
        word = _combine_ring_signature(x, topk_weights, ring[2])
        if direct is not None:
            return self._mod.cached_pull_combine(self._ipc, self._comm, self._timeout_ns, handle, offsets, direct[1], x,
                                                 topk_weights, *ring, config, self._buffer_cls.num_sms,
                                                 ring_signature=word)
        return self._mod.cached_combine(self._ipc, self._comm, self._timeout_ns, handle, offsets, x, topk_weights,
                                        *ring, config, self._buffer_cls.num_sms, ring_signature=word)

    # ------------------------------------------------------------------ expert-major (local passes)
    def expert_major_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                              topk_weights: Optional[torch.Tensor], num_experts: int, expert_alignment: int,
                              num_worst_tokens: int, config: Optional[Config] = None):
        """Dispatch into expert-major rows (docs/intranode.md, "Expert-major dispatch"). notify turns every
        source's per-expert counts into the layout table (each expert's first row); the rank-major dispatch kernel
        moves the rows; then pair ranks over the received top-k and em_permute, which copies each received row to
        its expert-major rows over the whole GPU (with a peer pool the rank-major rows move by the direct kernel,
        into a pool block). Returns (permuted_x, permuted_scales, permuted_weights,
        tokens_per_expert int32 [L] (device), counts (python ints; empty with num_worst_tokens),
        ExpertMajorHandle). No host sync with num_worst_tokens; otherwise one wait for notify's counts, like
        dispatch."""
        self._check()
        r = self.num_ranks
        local = num_experts // r
        k = topk_idx.shape[1]
        if local > self._mod.MAX_LOCAL_EXPERTS or k > self._mod.MAX_TOPK or k == 0:
            return compose_expert_major_dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts, local,
                                                 expert_alignment, num_worst_tokens, config)
        x, x_scales, topk_idx, topk_weights = x.contiguous(), _contiguous(x_scales), topk_idx.contiguous(), \
            _contiguous(topk_weights)
        channels, chunk, slots, slot_bytes = self._ring(
            config, False, dispatch_slot_bytes(_row_bytes(x), _columns(x_scales), k), "expert-major dispatch")
        per_rank, _, per_expert, in_rank = self.get_dispatch_layout(topk_idx, num_experts)
        dev = x.device
        layout = torch.empty(self._mod.em_layout_words(r, local), dtype=torch.int32, device=dev)
        # num_worst_tokens bounds the expert-major rows here, not the received rows (fewer: each holds at least
        # one pair), so notify's received-rows check is off (0); the Buffer checks rows_needed instead.
        signature = dispatch_signature("expert-major dispatch", x, x_scales, topk_idx, topk_weights, num_experts,
                                       config or self._buffer_cls.get_dispatch_config(self.num_ranks))
        # With a peer pool the rank-major rows go straight into the receivers' temporaries (direct dispatch), and
        # the handle keeps where each token landed, so the combine can pull (see expert_major_combine).
        send_rows = torch.empty(r, channels, dtype=torch.int32, device=dev) if self.peer_pool is not None else None
        prefix, offsets, seq = self._notify(in_rank, per_rank, per_expert, channels, expert_alignment, 0, signature,
                                            layout, send_rows)
        counts: List[int] = []
        num_recv: Optional[int] = None
        if num_worst_tokens:
            rows = m = num_worst_tokens
        else:
            num_recv = self._wait_counts(seq)
            counts = self._ipc.expert_counts(local)
            rows, m = num_recv, sum(counts)
        received = offsets[-1, -1:]  # rows received, on the device (rows past it in num_worst_tokens tables)
        # Rank-major rows in (source rank, token) order, top-k as local experts; no padding rows (pad_rows off):
        # the passes below read only the rows received. Launched before the other outputs are allocated, so
        # after a host sync the GPU starts on the transfer first.
        direct = None
        if send_rows is not None:
            row_of_token = torch.full((x.shape[0], r), -1, dtype=torch.int32, device=dev)
            direct = (send_rows, row_of_token)
            recv_x, recv_s, recv_idx, recv_w, recv_src = self._direct_dispatch(
                x, x_scales, topk_idx, topk_weights, in_rank, offsets, send_rows, rows, local, False,
                (channels, chunk, slots, slot_bytes), row_of_token)
        else:
            recv_x, recv_s, recv_idx, recv_w, recv_src = recv_tensors(rows, x, x_scales, _columns(x_scales), k)
            self._mod.dispatch(self._ipc, self._timeout_ns, x, x_scales, topk_idx, topk_weights, in_rank, offsets,
                               recv_x, recv_s, recv_idx, recv_w, recv_src, local, False, channels, chunk, slots,
                               slot_bytes)
        px = torch.empty(m, x.shape[1], dtype=x.dtype, device=dev)
        ps = torch.empty(m, _columns(x_scales), dtype=x_scales.dtype, device=dev) if x_scales is not None else None
        pw = torch.empty(m, dtype=torch.float32, device=dev) if topk_weights is not None else None
        pair_row = torch.empty(m, dtype=torch.int32, device=dev)
        pair_slot = torch.empty(m, dtype=torch.int32, device=dev)
        inverse = torch.empty(rows, k, dtype=torch.int32, device=dev)
        recv_rank = torch.empty(rows, k, dtype=torch.int32, device=dev)
        self._mod.pair_rank(recv_idx, local, recv_rank, received)
        self._em_permute(recv_x, recv_s, inverse, layout, local, expert_alignment, received, px, ps,
                         num_worst_tokens > 0, fresh=(recv_idx, recv_w, recv_rank, pw, pair_row, pair_slot, recv_src))
        r_local = r * local
        tpe = layout[r_local + 2 * local + 1: r_local + 3 * local + 1]
        need = layout[r_local + local]
        dh = DispatchHandle(prefix, in_rank, recv_src, num_recv, x.shape[0], num_worst_tokens, self.name,
                            self._buffer_token, backend_state=HandleState((channels, offsets, direct)))
        handle = ExpertMajorHandle(dh, pair_row, pair_slot, tpe, k, rows_needed=need,
                                   backend_state=(inverse, layout, local, expert_alignment, received))
        return px, ps, pw, tpe, counts, handle

    def _em_permute(self, rows_x: torch.Tensor, rows_s: Optional[torch.Tensor], inverse: torch.Tensor,
                    layout: torch.Tensor, local: int, alignment: int, received: torch.Tensor, px: torch.Tensor,
                    ps: Optional[torch.Tensor], bounded: bool, fresh=None) -> None:
        """Rank-major received rows [N, ...] -> expert-major rows px [M, ...] (the local pass of expert-major
        dispatch): fresh = (received top-k, received weights, pair ranks, permuted weights or None, pair_row,
        pair_slot, source indices) places the pairs and fills the tables; None (cached) follows inverse.
        received: the device count of rows that arrived (offsets[-1, -1:]). bounded: M is num_worst_tokens (rows
        past the last expert's are padding)."""
        m = px.shape[0]
        # Padding rows: each expert's alignment rows, and with num_worst_tokens the rows past the last expert's.
        pad_blocks = min(self._num_sms, (m + 7) // 8) if (alignment > 1 or bounded) else 0
        idx, w, rank, pw, pair_row, pair_slot, src = fresh if fresh is not None else (None,) * 7
        self._mod.em_permute(rows_x, rows_s, idx, w, rank, layout, received, px, ps, pw, pair_row, pair_slot, inverse,
                             src, self.num_ranks, local, alignment, pad_blocks)

    def expert_major_cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                                     handle: ExpertMajorHandle, config: Optional[Config] = None):
        """x [T, H] -> expert-major rows [M, H] along the handle's routing (no count exchange, no host sync): the
        rank-major cached dispatch, then em_permute along the handle's inverse table."""
        self._check()
        rows, row_scales = self.cached_dispatch(x, x_scales, handle.dispatch, config)
        if handle.backend_state is None:  # the handle came from the composition: do the same here
            return gather_rows(rows, handle), (gather_rows(row_scales, handle) if x_scales is not None else None)
        return self.em_permute(rows, row_scales, handle)

    def em_permute(self, rows_x: torch.Tensor, rows_s: Optional[torch.Tensor], handle: ExpertMajorHandle):
        """The local pass of expert-major dispatch along a handle of this backend: rank-major received rows
        [N, ...] (N rows of the handle's tables; only those received are read) -> (expert-major rows [M, ...],
        scales or None)."""
        inverse, layout, local, alignment, received = handle.backend_state
        dh = handle.dispatch
        rows_x, rows_s = rows_x.contiguous(), _contiguous(rows_s)
        m, dev = handle.pair_row.numel(), rows_x.device
        px = torch.empty(m, rows_x.shape[1], dtype=rows_x.dtype, device=dev)
        ps = torch.empty(m, rows_s.shape[1], dtype=rows_s.dtype, device=dev) if rows_s is not None else None
        self._em_permute(rows_x, rows_s, inverse, layout, local, alignment, received, px, ps,
                         bool(dh.num_worst_tokens))
        return px, ps

    def em_unpermute(self, x: torch.Tensor, handle: ExpertMajorHandle, weights: Optional[torch.Tensor],
                     topk_weights: Optional[torch.Tensor]):
        """The local pass of expert-major combine: expert-major rows x [M, H] (bf16/fp16/fp32) -> each received
        row's sum of its pairs [N, H] (slot order, float32, rounded to x.dtype: unpermute()'s numbers) and, with
        topk_weights [M], the per-slot weights [N, K]. Rows past the received count (num_worst_tokens tables)
        are not written."""
        inverse, received = handle.backend_state[0], handle.backend_state[4]
        n, k = inverse.shape
        x, weights, topk_weights = x.contiguous(), _contiguous(weights), _contiguous(topk_weights)
        pooled = handle.dispatch.backend_state.routing[2] is not None  # the combine of a direct dispatch pulls
        rows = self._combine_input((n, x.shape[1]), x.dtype, x.device, pooled)
        w_rows = self._combine_input((n, k), torch.float32, x.device, pooled) if topk_weights is not None else None
        self._mod.em_unpermute(x, inverse, weights, topk_weights, received, rows, w_rows)
        return rows, w_rows

    def _combine_input(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device,
                       pooled: bool) -> torch.Tensor:
        """An uninitialised tensor for rows a combine sends: in the peer pool when `pooled` (the handle's dispatch
        was direct, so the combine pulls its rows from every holder's pool), unless the pool is closed or has no
        room or a CUDA graph is being captured (then torch's memory: the ring kernel moves that combine). A pool
        tensor is a view of a block whose size is rounded up to a power of two."""
        pool = self.peer_pool
        if pooled and pool is not None and not pool.closed:
            numel = 1
            for n in shape:
                numel *= n
            nbytes = numel * dtype.itemsize
            # A block rounded as the dispatch's (_pool_block): the row count varies from call to call, and torch
            # cannot hand a live pool's cached segments of other sizes back to the region.
            block, _ = self._pool_block(nbytes, device)  # torch's memory when the pool has no room (or capture)
            return block[:nbytes].view(dtype).view(shape)
        return torch.empty(shape, dtype=dtype, device=device)

    def expert_major_combine(self, x: torch.Tensor, handle: ExpertMajorHandle, weights: Optional[torch.Tensor],
                             topk_weights: Optional[torch.Tensor], bias: Sequence[torch.Tensor],
                             config: Optional[Config] = None):
        """Expert-major rows [M, H] -> [T, H]: em_unpermute sums each received row's pairs (slot order, float32,
        rounded to x.dtype) over the whole GPU, then the rank-major combine sends them; topk_weights [M] return to
        their slot. Returns (combined_x, combined_topk_weights [T, K] or None)."""
        self._check()
        if handle.backend_state is None or x.dtype not in COMBINE_DTYPES:
            rows, w_rows = unpermute(x, handle, weights, topk_weights)
        else:
            rows, w_rows = self.em_unpermute(x, handle, weights, topk_weights)
        return self.combine(rows, handle.dispatch, w_rows, bias, config)

    # ------------------------------------------------------------------ buffer access and lifetime
    def forget_overflow(self) -> None:
        self._ipc.take_worst_overflow()

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
            return torch.as_tensor(_DeviceMemory(self._ipc.local_ptr, total, self._ipc), device=self.device)
        return buffer_view(raw, total, dtype, size, offset, "RDMA" if use_rdma_buffer else "NVLink")

    # Teardown (moe_dispatcher/runtime/release.py runs these, never one rank alone for the free).
    symmetric = False  # no NVSHMEM memory

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def quiesce(self) -> None:
        """Local: note a recorded timeout, wait for the device, close this rank's mappings of the peers' buffers;
        later calls raise."""
        if self._ipc.alive and self._broken is None and self._ipc.timeout_info() is not None:
            self._broken = timeout_message(self.name, self._ipc.timeout_info(), self.timeout_s, TIMEOUT_ENV,
                                           self._board)
        self._rdma_emulation = None
        if self._broken is None:  # every direct call completed (its kernel saw every peer's writes): nobody writes
            self._direct_blocks[:] = (None, None)  # into them any more; a broken backend keeps them (a late peer
            # might)
        if self.peer_pool is not None:  # before the mappings its peer addresses point into close
            self.peer_pool.close()
        self._ipc.close()

    def views_alive(self) -> bool:
        return False

    def free(self, symmetric: bool) -> None:
        """Every peer closed its mapping: the buffer may go. The native IpcBuffer frees it with its last reference
        (this backend's, the views', the plans')."""

    def abandon(self) -> None:
        """A peer never confirmed: leave the buffer allocated until the process exits (the pool's region too)."""
        if self.peer_pool is not None:
            self.peer_pool.close()
        self._ipc.abandon()
