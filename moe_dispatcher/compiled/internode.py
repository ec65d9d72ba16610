"""Normal-mode internode backend: two-hop dispatch/combine across NVLink domains (docs/internode.md).

One InternodeBackend belongs to one Buffer whose topology has more than one NVLink domain. It owns:
- the NVLink buffer of its domain: an intranode.IpcBuffer over the domain's ranks (CUDA IPC handles are
  exchanged over the whole group in the Buffer's creation rounds, each rank opens only its domain's; nothing
  assumes two domains share a host);
- one NVSHMEM symmetric allocation of num_rdma_bytes (moe_dispatcher.runtime.nvshmem bootstrap over the
  Buffer's group; PE id == group rank). Across domains the kernels use public NVSHMEM calls only;
- with Buffer(num_pool_bytes=N), the Buffer's PeerPool (peer_pool.py): the tail of the NVLink buffer's allocation,
  mapped by the GPUs of the domain (PeerPool rank = local index, num_ranks = nvl_size), closed here before the
  mappings close.

Same methods and host-synchronisation rules as IntranodeBackend: only a fresh dispatch without
num_worst_tokens waits (mapped mailbox) for the receive counts; cached dispatch, num_worst_tokens dispatch
(CUDA-graph capturable), layout and combine never do. A call whose ranks disagree is refused by notify on every
rank, moves nothing (nor do the calls along its handle) and raises SignatureMismatch at the notify wait or the
next synchronised dispatch, or at check_refused_calls (docs/internode.md, "Notify"). Timeouts name rank, phase and
peer. Cached calls run from native plans kept in the handle's HandleState, as the intranode backend's (the Buffer's
fast path calls them).
"""
from __future__ import annotations

import socket
import weakref
from typing import List, Optional, Sequence, Tuple

import torch

from .. import _ext
from ..backend import Backend, Capabilities
from ..config import Config, align_slot
from ..handle import DispatchHandle
from ..reference.board import PeerError
from ..signature import KeptSignatures, dispatch_signature, raise_disagreement, ring_signature_word, signature_hash
from . import (LAUNCH_CURRENT, STATUS_PEER_ABORTED, TIMEOUT_ENV, HandleState, NvlinkMappings, buffer_view,
               combine_tensors, kernel_timeout_s, posted_by_peer, raise_refused_calls, recv_tensors, run_cached,
               timeout_message, wait_counts)
from .intranode import (COMBINE_DTYPES, KEPT_SIGNATURES, _columns, _contiguous, _DeviceMemory, _row_bytes,
                        combine_slot_bytes)
from .peer_pool import PeerPool


def dispatch_slot_bytes(hidden_bytes: int, num_scales: int, num_topk: int) -> int:
    """Bytes of one internode dispatch slot (RDMA and NVLink alike): payload, 4-byte scales, top-k ids
    (int32) and weights, source token, and one more int32 (local-rank mask, or source domain); rounded by
    align_slot."""
    return align_slot(hidden_bytes + num_scales * 4 + num_topk * 8 + 8)


def ring_signatures(operation: str, x: torch.Tensor, scales: Optional[torch.Tensor],
                    topk_weights: Optional[torch.Tensor], geometry: Sequence[int]) -> List[int]:
    """The ring signatures of a cached call (docs/internode.md, "Cached calls: ring signatures"): [RDMA hop, NVLink
    hop], the same fields with each hop's slot count (geometry: _geometry's list). operation: "cached dispatch"
    (scales [T, S] or None, no weights) or "combine" (topk_weights [N, K] or None, no scales)."""
    scales_dtype = scales.dtype if scales is not None else None
    return [ring_signature_word(operation, x.shape[1], x.dtype, scales_dtype, _columns(scales), _columns(topk_weights),
                                slots) for slots in (geometry[5], geometry[2])]


class _DirectDispatchPlan:
    """The plan of a cached dispatch along the handle of a Buffer with a peer pool (InternodeBackend._direct_dispatch,
    cached), called as the native plans are (csrc/bindings/cached_call.h): plan(handle, x, aux, config, num_sms,
    mode) -> (recv_x, recv_scales or None, None), or None for a call unlike its own (the Buffer then takes its full
    path). It launches on the current stream only (the full path's LAUNCH_CURRENT, inside the Buffer's stream
    scope); the fast path's modes answer None. Its ring is the geometry, its word the two ring signatures."""

    __slots__ = ("backend", "in_rank", "num_tokens", "num_worst_tokens", "x_spec", "aux_spec", "config", "num_sms",
                 "ring", "word")

    def __init__(self, backend, handle: DispatchHandle, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                 config: Optional[Config], num_sms: int, ring: Sequence[int], word: Sequence[int]) -> None:
        self.backend = backend
        self.in_rank, self.num_tokens, self.num_worst_tokens = (handle.is_token_in_rank, handle.num_tokens,
                                                                handle.num_worst_tokens)
        self.x_spec = (x.dtype, tuple(x.shape), x.device)
        self.aux_spec = None if x_scales is None else (x_scales.dtype, tuple(x_scales.shape), x_scales.device)
        self.config, self.num_sms, self.ring, self.word = config, num_sms, ring, word

    def _matches(self, handle, x: torch.Tensor, aux: Optional[torch.Tensor], config, num_sms: int) -> bool:
        if (handle.is_token_in_rank is not self.in_rank or handle.num_tokens != self.num_tokens
                or handle.num_worst_tokens != self.num_worst_tokens or not x.is_contiguous()
                or (x.dtype, tuple(x.shape), x.device) != self.x_spec):
            return False
        if (aux is None) != (self.aux_spec is None) or (aux is not None and (
                (aux.dtype, tuple(aux.shape), aux.device) != self.aux_spec or not aux.is_contiguous())):
            return False
        if (config is None) != (self.config is None):
            return False
        return num_sms == self.num_sms if config is None else (config is self.config or config == self.config)

    def __call__(self, handle, x: torch.Tensor, aux: Optional[torch.Tensor], config, num_sms: int, mode: int):
        if mode != LAUNCH_CURRENT or not self._matches(handle, x, aux, config, num_sms):
            return None
        try:
            self.backend._check()
        except RuntimeError:  # the full path takes the call and says why
            return None
        return self._run(handle, x, aux)

    def _run(self, handle, x: torch.Tensor, aux: Optional[torch.Tensor]) -> tuple:
        out = self.backend._cached_direct_dispatch(x, aux, handle, self.ring, self.word)
        return out[0], out[1], None


class _PullCombinePlan(_DirectDispatchPlan):
    """The plan of a combine along the handle of a Buffer with a peer pool (InternodeBackend._combine_along: the
    pull NVLink hop, or the FIFOs when some rank of the domain has its input outside its pool): the dispatch plan's
    contract, with the top-k weights as its aux tensor. -> (combined_x, combined_topk_weights or None, None)."""

    __slots__ = ()

    def __init__(self, backend, handle: DispatchHandle, x: torch.Tensor, topk_weights: Optional[torch.Tensor],
                 config: Optional[Config], num_sms: int, ring: Sequence[int]) -> None:
        super().__init__(backend, handle, x, topk_weights, config, num_sms, ring, ())

    def _run(self, handle, x: torch.Tensor, aux: Optional[torch.Tensor]) -> tuple:
        out, out_w, _, _ = combine_tensors(self.num_tokens, x, aux, ())
        self.backend._combine_along(x, aux, None, None, handle, out, out_w, self.ring)
        return out, out_w, None


class InternodeBackend(NvlinkMappings, Backend):
    """Compiled internode normal-mode backend for one Buffer (see the module docstring)."""

    name = "internode"

    def __init__(self, buffer) -> None:
        mod = _ext.require("the internode kernels")
        self._mod, self._intra = mod.internode, mod.intranode
        topo = buffer.topology
        self.group = buffer.group
        self.rank, self.num_ranks = buffer.rank, buffer.group_size
        self.nvl_size, self.num_domains = topo.nvl_size, topo.num_domains
        self.num_nvl_bytes, self.num_rdma_bytes = buffer.num_nvl_bytes, buffer.num_rdma_bytes
        self._buffer_token = buffer._token
        self._buffer_cls = type(buffer)
        self.capabilities = Capabilities(normal=True, combine_dtypes=COMBINE_DTYPES,
                                         max_local_experts=self._mod.MAX_LOCAL_EXPERTS, devices=frozenset({"cuda"}))
        if self.num_ranks > self._mod.MAX_RANKS:
            raise ValueError(f"the internode kernels serve at most {self._mod.MAX_RANKS} ranks, got {self.num_ranks}")
        self.timeout_s = kernel_timeout_s()
        self._timeout_ns = int(self.timeout_s * 1e9)
        # The buffers' layout, computed by the extension from the sizes (the kernels read the same one).
        self._layout = self._mod.buffer_layout(self.num_ranks, self.nvl_size, self.num_rdma_bytes, self.num_nvl_bytes)
        need = self._layout["rdma_recv_offset"] + 2 * self.num_domains * 128
        if self.num_rdma_bytes < need:
            raise ValueError(f"num_rdma_bytes={self.num_rdma_bytes} is too small for the internode kernels ({self.num_domains} "
                             f"NVLink domains need far more than {need}); size it with "
                             f"Config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, nvl_size)")
        if self.num_nvl_bytes < self._layout["nvl_rings_offset"] + self.nvl_size * 128:
            raise ValueError(f"num_nvl_bytes={self.num_nvl_bytes} is too small for the internode kernels; size it with "
                             f"Config.get_nvl_buffer_size_hint")
        self.device = torch.device("cuda", torch.cuda.current_device())
        # NVLink buffer of the domain: handles gathered over the group, only the domain's opened. With
        # num_pool_bytes the allocation has the peer pool's region as its tail (exported with the buffer), mapped by
        # the domain's GPUs only.
        self.num_pool_bytes = buffer.num_pool_bytes
        self._ipc = (self._intra.IpcBuffer(topo.local_index, self.nvl_size, self.num_nvl_bytes, self.num_pool_bytes)
                     if self.num_pool_bytes else self._intra.IpcBuffer(topo.local_index, self.nvl_size,
                                                                        self.num_nvl_bytes))
        self._domain_ranks, self._local_index = topo.domain_ranks(), topo.local_index
        self._peer_pool_native = (mod.peer_pool, mod.__file__)
        self.peer_pool: Optional[PeerPool] = None  # made by connect()
        self._direct_blocks: Tuple[Optional[torch.Tensor], ...] = ()  # the latest pool dispatch's output blocks
        self._single_host = False  # set by connect()
        # The Buffer's comm stream, with the events that join it to the caller's stream in cached calls.
        self._comm = self._intra.CommStream(buffer.get_comm_stream())
        self.launch_order = self._comm
        self.layout_call, self.layout_args = self._mod.layout_call, (self.num_ranks, self.nvl_size, self._ipc)
        self._board = buffer._board  # the message of a peer's abort (timeout_message); NVSHMEM's unique id (start)

    # ------------------------------------------------------------------ creation (compiled.create_backends)
    def creation_payload(self) -> tuple:
        """What the peers need of this rank: (the CUDA IPC handle of its NVLink buffer, its hostname)."""
        return self._ipc.ipc_handle(), socket.gethostname()

    def connect(self, payloads: Sequence[tuple]) -> None:
        """Local, once every rank allocated: map the domain peers' NVLink buffers (payloads: each rank's
        creation_payload) and make the peer pool."""
        self._ipc.open_peers([payloads[r][0] for r in self._domain_ranks])
        self._single_host = len({p[1] for p in payloads}) == 1  # only chooses NVSHMEM's transports (P2P here)
        if self.num_pool_bytes:
            native, path = self._peer_pool_native
            self.peer_pool = PeerPool(self._ipc, native, path, self.device, self._local_index, self.nvl_size)

    def start(self) -> None:
        """Collective, after every rank connected: bring NVSHMEM up (its unique id goes through a bounded creation
        round of the Buffer's board), allocate and zero the NVSHMEM buffer, wait for every PE."""
        from ..runtime import nvshmem
        self._state = nvshmem.bootstrap(self.group, self.device.index, single_host=self._single_host,
                                        board=self._board)
        try:
            self._rdma_ptr = self._state.malloc(self.num_rdma_bytes)
        except Exception:
            self._state.finalize()
            self.abandon()  # the domain peers opened the NVLink buffer (connect): never free it under them
            raise
        memory = _DeviceMemory(self._rdma_ptr, self.num_rdma_bytes)
        self._rdma_memory = weakref.ref(memory)  # alive while a view of the NVSHMEM buffer is (views_alive)
        self._rdma_raw = torch.as_tensor(memory, device=self.device)
        self._rdma_raw.zero_()  # every counter starts at 0 on every PE
        self._ctx = self._mod.make_context(self._ipc, self._rdma_ptr, self.rank, self.num_ranks, self.nvl_size,
                                           self.num_rdma_bytes)
        # The peer abort (kernels/common/wait.cuh): this rank's byte of RdmaControl::peer_aborted on every rank of
        # the group, through NVSHMEM's mapping of its buffer (0: not mapped here, that rank falls back to its
        # timeout); it replaces the domain's targets open_peers set.
        aborts = [self._state.peer_ptr(self._rdma_ptr + self._mod.RDMA_ABORT_OFFSET, pe) if pe != self.rank else 0
                  for pe in range(self.num_ranks)]
        self._ipc.set_abort_targets([p + self.rank if p else 0 for p in aborts])
        self._abort_posted = False  # this rank posted an abort: its next full-path call clears it first
        self._peer_aborted = False  # what _broken says: a peer's abort (PeerError) rather than a timeout
        self._state.barrier()  # nobody sends before every PE zeroed its buffer
        torch.cuda.current_stream().synchronize()
        self._seq = 0
        self._notified = 0  # seq of the latest notify launched (check_refused_calls waits for it)
        # The signatures of the latest fresh calls by seq, for the error of a disagreement notify recorded.
        self._signatures = KeptSignatures(KEPT_SIGNATURES)
        self._broken: Optional[str] = None
        self._alive = True

    # ------------------------------------------------------------------ errors
    def check_refused_calls(self) -> None:
        """Backend.check_refused_calls: raise now what the next synchronised dispatch would raise for the calls
        that did not wait for notify (compiled.raise_refused_calls)."""
        raise_refused_calls(self)

    def _raise_disagreement(self) -> None:
        """After a completed notify wait: raise SignatureMismatch (collective, every rank alike) if notify recorded
        a disagreement since the last report (the flags words of internode notify carry the signatures)."""
        mismatch = self._ipc.take_signature_mismatch(self.num_ranks)
        if mismatch is not None:
            raise_disagreement(self.group, self.device, self._signatures, *mismatch,
                               ring_records=lambda: self._ipc.take_ring_mismatch() or [], nvl_size=self.nvl_size)

    def _check(self) -> None:
        """Raise if no call may be made (destroyed, or a kernel recorded a timeout or a peer's abort); clear this
        rank's own abort first when it posted one (the cached plans clear it natively)."""
        if self._broken is not None:
            raise (PeerError if self._peer_aborted else RuntimeError)(self._broken)
        if not self._alive:
            raise RuntimeError("the internode backend was destroyed")
        if self._abort_posted:
            self._abort_posted = False
            self._ipc.clear_abort_if_posted()
        info = self._mod.timeout_info(self._ipc)
        if info is not None:
            self._broken = timeout_message(self.name, info, self.timeout_s, TIMEOUT_ENV, self._board)
            self._peer_aborted = info[0] == STATUS_PEER_ABORTED
            raise (PeerError if self._peer_aborted else RuntimeError)(self._broken)

    def post_abort(self) -> None:
        """Backend.post_abort: this rank's abort byte on every rank of the group (not after this rank's kernels
        honoured a peer's abort, nor once closed)."""
        if self._alive and self._ipc.alive and not posted_by_peer(self._mod.timeout_info(self._ipc)):
            self._ipc.post_abort()
            self._abort_posted = True

    def refused(self) -> None:
        """A plan did not launch: raise why (destroyed, or a timeout recorded)."""
        self._check()
        raise RuntimeError("moe_dispatcher internode: the launch was refused")

    def _geometry(self, config: Optional[Config], combine: bool, slot_bytes: int, channels: Optional[int] = None,
                  what: str = "dispatch") -> List[int]:
        """[channels, nvl_chunk, nvl_slots, nvl_slot_bytes, rdma_chunk, rdma_slots, rdma_slot_bytes], checked."""
        if config is None:
            config = (self._buffer_cls.get_combine_config if combine else self._buffer_cls.get_dispatch_config)(
                self.num_ranks)
        c = config.num_channels if channels is None else channels
        nvl_chunk, nvl_slots = config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens
        rdma_chunk, rdma_slots = config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens
        if c > self._mod.MAX_CHANNELS:
            raise ValueError(f"Config.num_sms={config.num_sms}: the internode kernels use at most "
                             f"{2 * self._mod.MAX_CHANNELS} SMs' worth of channels")
        if nvl_chunk > self._mod.MAX_CHUNK or rdma_chunk > self._mod.MAX_CHUNK:
            raise ValueError(f"Config chunk sizes must be at most {self._mod.MAX_CHUNK}")
        if combine and (nvl_slots < nvl_chunk + 32 or rdma_slots < 64):
            raise ValueError("combine needs num_max_nvl_chunked_recv_tokens >= num_max_nvl_chunked_send_tokens + 32 "
                             "and num_max_rdma_chunked_recv_tokens >= 64")
        nvl_block, rdma_block = self._layout["nvl_src_block_bytes"], self._layout["rdma_domain_bytes"]
        if c * nvl_slots * slot_bytes > nvl_block:
            raise ValueError(f"{what}: num_nvl_bytes={self.num_nvl_bytes} is too small for {c} channels x {nvl_slots} "
                             f"slots of {slot_bytes} bytes per local rank; size it with Config.get_nvl_buffer_size_hint")
        if c * rdma_slots * slot_bytes > rdma_block:
            raise ValueError(f"{what}: num_rdma_bytes={self.num_rdma_bytes} is too small for {c} channels x {rdma_slots} "
                             f"slots of {slot_bytes} bytes per domain; size it with "
                             f"Config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, nvl_size)")
        return [c, nvl_chunk, nvl_slots, slot_bytes, rdma_chunk, rdma_slots, slot_bytes]

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        self._check()
        out = self.layout_call(topk_idx.contiguous(), num_experts, *self.layout_args)
        if out is None:  # the Buffer validated topk_idx and num_experts first
            raise ValueError(f"get_dispatch_layout: topk_idx {tuple(topk_idx.shape)} {topk_idx.dtype} with "
                             f"{num_experts} experts is not a routing the layout kernel takes")
        return out

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], num_tokens_per_rank: torch.Tensor,
                 is_token_in_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor, expert_alignment: int,
                 num_worst_tokens: int, config: Optional[Config] = None):
        """Fresh dispatch; returns what ReferenceNormal.dispatch returns."""
        self._check()
        r = self.num_ranks
        x, x_scales, topk_idx, topk_weights = x.contiguous(), _contiguous(x_scales), _contiguous(topk_idx), \
            _contiguous(topk_weights)
        hidden_bytes, num_scales, num_topk = _row_bytes(x), _columns(x_scales), _columns(topk_idx)
        num_experts = num_tokens_per_expert.numel()
        local = num_experts // r
        geo = self._geometry(config, False, dispatch_slot_bytes(hidden_bytes, num_scales, num_topk))
        channels = geo[0]
        is_token_in_rank = is_token_in_rank.contiguous()
        num_tokens_per_rank = num_tokens_per_rank.contiguous()
        num_tokens_per_expert = num_tokens_per_expert.contiguous()
        dev, t = x.device, x.shape[0]

        prefix = torch.empty(r, r, dtype=torch.int32, device=dev)
        offsets = torch.empty(r, channels + 1, dtype=torch.int32, device=dev)
        fwd_offset = torch.empty(self.num_domains, channels + 1, dtype=torch.int32, device=dev)
        fwd_row_offset = torch.empty(self.num_domains, self.nvl_size, channels, dtype=torch.int32, device=dev)
        self._seq = self._seq % 2_000_000_000 + 1
        seq = self._seq
        signature = dispatch_signature("dispatch", x, x_scales, topk_idx, topk_weights, num_experts,
                                       config or self._buffer_cls.get_dispatch_config(r))
        self._signatures.add(seq, signature)
        # With num_worst_tokens the per-expert counts stay on the device (Backend.dispatch): notify writes them.
        device_counts = torch.empty(local, dtype=torch.int32, device=dev) if num_worst_tokens else None
        self._mod.notify(self._ctx, self._timeout_ns, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert,
                         channels, expert_alignment, num_worst_tokens, seq, prefix, offsets, fwd_offset, fwd_row_offset,
                         device_counts,
                         signature_hash=signature_hash(signature), problem=signature.problem)
        self._notified = seq
        counts = device_counts
        num_recv: Optional[int] = None
        if num_worst_tokens:
            rows = num_worst_tokens
            # Each forwarded token reaches >= 1 rank of this domain, each of which receives <= W rows.
            fwd_capacity = self.nvl_size * num_worst_tokens
        else:
            try:
                num_recv = wait_counts(self, seq, self._intra.FLAG_LAYOUT_MISMATCH)
            except ValueError:  # an all-rank verdict of notify: a disagreement explains it first
                self._raise_disagreement()
                raise
            self._raise_disagreement()
            counts = self._ipc.expert_counts(local)
            rows = num_recv
            fwd_capacity = self._mod.num_forward(self._ipc)

        fwd_mask = torch.zeros(max(fwd_capacity, 1), dtype=torch.int32, device=dev)
        fwd_rows = None
        if self.peer_pool is not None:
            # The NVLink hop writes straight into the domain peers' outputs (pool blocks), or takes the FIFOs when
            # some rank of the domain has no room (dispatch.cu, "Direct mode"); fwd_rows: where each forwarded
            # token landed at each local rank (-1: not there), every entry of a forwarded token written either way.
            fwd_rows = torch.empty((max(fwd_capacity, 1), self.nvl_size), dtype=torch.int32, device=dev)
            recv_x, recv_scales, recv_idx, recv_w, recv_src = self._direct_dispatch(
                x, x_scales, topk_idx, topk_weights, is_token_in_rank, offsets, fwd_offset, fwd_row_offset, fwd_mask,
                fwd_capacity, fwd_rows, rows, local, bool(num_worst_tokens), geo)
        else:
            recv_x, recv_scales, recv_idx, recv_w, recv_src = recv_tensors(
                rows, x, x_scales, num_scales, num_topk if topk_idx is not None else None)
            self._mod.dispatch(self._ctx, self._timeout_ns, x, x_scales, topk_idx, topk_weights, is_token_in_rank,
                               offsets, fwd_offset, fwd_mask, fwd_capacity, recv_x, recv_scales, recv_idx, recv_w,
                               recv_src, local, bool(num_worst_tokens), geo)
        if topk_weights is None:
            recv_w = None
        handle = DispatchHandle(prefix, is_token_in_rank, recv_src, num_recv, t, num_worst_tokens, self.name,
                                self._buffer_token,
                                backend_state=HandleState((channels, offsets, fwd_offset, fwd_mask, fwd_capacity,
                                                           fwd_row_offset, fwd_rows)))
        return recv_x, recv_scales, recv_idx, recv_w, counts, handle

    def _direct_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                         topk_weights: Optional[torch.Tensor], is_token_in_rank: torch.Tensor, offsets: torch.Tensor,
                         fwd_offset: torch.Tensor, fwd_row_offset: torch.Tensor, fwd_mask: Optional[torch.Tensor],
                         fwd_capacity: int, fwd_rows: Optional[torch.Tensor], rows: int, local: int, pad_rows: bool,
                         geo: Sequence[int], ring_signatures: Sequence[int] = (),
                         handle_fwd_mask: Optional[torch.Tensor] = None) -> list:
        """Dispatch of a Buffer with a peer pool into outputs allocated in the pool: a payload block carved natively
        into recv_x [rows, H] and recv_scales [rows, S] or None, and in a fresh call (no ring_signatures) a meta
        block carved into recv_topk_idx / recv_topk_weights [rows, K] (or None without topk_idx) and recv_src_idx
        [rows] (None cached), as the intranode direct dispatch lays them out. A block the pool has no room for (or
        any block while a CUDA graph is being captured) comes from torch's allocator, and the rank says so to its
        domain peers in the kernel: then the domain's NVLink hop takes the FIFOs (the same outputs). The blocks of
        the latest call stay referenced here: a peer that is late with it writes into them, never into memory
        handed out again."""
        payload, out_offset = self._pool_block(self._intra.direct_payload_bytes(rows, _row_bytes(x),
                                                                                _columns(x_scales)), x.device)
        meta, meta_offset = None, 0
        if not ring_signatures:
            meta, meta_offset = self._pool_block(self._intra.direct_meta_bytes(rows, _columns(topk_idx)), x.device)
        self._direct_blocks = (payload, meta)
        return list(self._mod.direct_dispatch(self._ctx, self._timeout_ns, x, x_scales, topk_idx, topk_weights,
                                              is_token_in_rank, offsets, fwd_offset, fwd_row_offset, fwd_mask,
                                              fwd_capacity, fwd_rows, payload, out_offset, meta, meta_offset, rows,
                                              local, pad_rows, list(geo), ring_signatures=list(ring_signatures),
                                              handle_fwd_mask=handle_fwd_mask))

    def _cached_direct_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle,
                                geo: Sequence[int], ring_signatures: Sequence[int]) -> list:
        """A cached dispatch along a pool Buffer's handle (_DirectDispatchPlan): payload and scales only."""
        _, offsets, fwd_offset, fwd_mask, fwd_capacity, fwd_row_offset, _ = handle.backend_state.routing
        rows = handle.num_worst_tokens or handle.num_recv_tokens
        return self._direct_dispatch(x, x_scales, None, None, handle.is_token_in_rank, offsets, fwd_offset,
                                     fwd_row_offset, None, fwd_capacity, None, rows, 1, bool(handle.num_worst_tokens),
                                     geo, ring_signatures, fwd_mask)

    def _pool_block(self, nbytes: int, device: torch.device) -> Tuple[torch.Tensor, int]:
        """A uint8 block of at least `nbytes` bytes for a dispatch's outputs and its offset in this rank's NVLink
        buffer: from the peer pool, its size rounded up to a power of two (2 MiB at least) so that torch's cached
        blocks serve the next calls, whose sizes vary; or from torch's own allocator with offset -1 when the pool
        has no room, a CUDA graph is being captured (the graph's allocations are its own pool's) or the pool is
        closed. The intranode backend's native rule (pool_block in csrc/intranode_bindings.cpp) over the domain's
        IpcBuffer: one rule for both backends."""
        if self.peer_pool.closed:
            return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device), -1
        return self._intra.pool_block(self._ipc, device.index, self.peer_pool.mem_pool_id, nbytes)

    def cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle,
                        config: Optional[Config] = None):
        """Dispatch along the routing of `handle` with no count exchange and no host sync, on the current stream."""
        self._check()
        x, x_scales = x.contiguous(), _contiguous(x_scales)
        return run_cached(self, handle.backend_state.dispatch_plans, x_scales is not None, self._dispatch_plan, handle,
                          x, x_scales, config)

    def _dispatch_plan(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle,
                       config: Optional[Config]):
        """The checks of a cached dispatch, then its native plan."""
        channels, offsets, fwd_offset, fwd_mask, fwd_capacity, _, fwd_rows = handle.backend_state.routing
        geo = self._geometry(config, False, dispatch_slot_bytes(_row_bytes(x), _columns(x_scales), 0), channels,
                             "cached dispatch")
        words = ring_signatures("cached dispatch", x, x_scales, None, geo)
        if fwd_rows is not None:  # the handle of a Buffer with a peer pool: outputs in the pool
            return _DirectDispatchPlan(self, handle, x, x_scales, config, self._buffer_cls.num_sms, geo, words)
        return self._mod.cached_dispatch(self._ctx, self._ipc, self._comm, self._timeout_ns, handle, offsets,
                                         fwd_offset, fwd_mask, fwd_capacity, x, x_scales, geo, config,
                                         self._buffer_cls.num_sms, ring_signatures=words)

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                bias: Sequence[torch.Tensor], config: Optional[Config] = None):
        """Reduce the rows of each source token in two hops; returns (combined_x, combined_topk_weights or None).

        Order: out = cast(bias0 + bias1 + sum over domains ascending of partial_domain), float32, where a
        partial is the float32 sum of that domain's rows (ranks ascending) rounded to x.dtype; the same whether
        the NVLink hop pulls (inputs in the peer pool along a pool handle) or takes the FIFOs."""
        self._check()
        x, topk_weights = x.contiguous(), _contiguous(topk_weights)
        if not bias:
            return run_cached(self, handle.backend_state.combine_plans, topk_weights is not None, self._combine_plan,
                              handle, x, topk_weights, config)
        # With a bias (rare: no plan, and the Buffer's fast path does not take it).
        channels = handle.backend_state.routing[0]
        geo = self._geometry(config, True, combine_slot_bytes(_row_bytes(x), _columns(topk_weights)), channels,
                             "combine")
        out, out_w, bias0, bias1 = combine_tensors(handle.num_tokens, x, topk_weights, bias)
        self._combine_along(x, topk_weights, bias0, bias1, handle, out, out_w, geo)
        return out, out_w

    def _combine_along(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor], bias0, bias1, handle,
                       out: torch.Tensor, out_w: Optional[torch.Tensor], geo: Sequence[int]) -> None:
        """Launch the combine of x along `handle` into out / out_w. Along the handle of a Buffer with a peer pool
        (its fwd_rows) the kernel runs the pull NVLink hop's protocol: it reads the domain's rows in place when every
        rank of the domain has its input in its pool (_pull_offsets), else takes the FIFOs (combine.cu, "Pull
        mode")."""
        _, offsets, fwd_offset, fwd_mask, fwd_capacity, _, fwd_rows = handle.backend_state.routing
        pull = {} if fwd_rows is None else {"fwd_rows": fwd_rows, **self._pull_offsets(x, topk_weights)}
        self._mod.combine(self._ctx, self._timeout_ns, x, topk_weights, bias0, bias1, handle.is_token_in_rank, offsets,
                          fwd_offset, fwd_mask, fwd_capacity, out, out_w, list(geo),
                          ring_signatures=ring_signatures("combine", x, None, topk_weights, geo), **pull)

    def _pull_offsets(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor]) -> dict:
        """Where a combine's x and topk_weights lie in this rank's NVLink buffer (its peer pool), or -1 for both when
        either is elsewhere (then the domain's call takes the FIFOs: the kernel's verdict); an x without rows counts
        as peer-mapped, an x of rows of 0 bytes does not (torch gives it no address)."""
        pool = self.peer_pool
        if pool is None or pool.closed or torch.cuda.is_current_stream_capturing():
            return {"x_offset": -1, "w_offset": -1}
        if x.shape[0] == 0:  # no rows (nor weights): nobody reads this input, wherever it lies
            return {"x_offset": 0, "w_offset": 0}
        if x.numel() == 0:  # rows of 0 bytes: torch gives a tensor without elements no address (data_ptr() 0)
            return {"x_offset": -1, "w_offset": -1}
        if pool.contains(x) and (topk_weights is None or pool.contains(topk_weights)):
            w_offset = -1 if topk_weights is None else self._ipc.pool_offset + pool.offset_of(topk_weights)
            return {"x_offset": self._ipc.pool_offset + pool.offset_of(x), "w_offset": w_offset}
        return {"x_offset": -1, "w_offset": -1}

    def _combine_plan(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor], handle: DispatchHandle,
                      config: Optional[Config]):
        """The checks of a combine (x of a kernel dtype), then its plan: native, or along the handle of a Buffer with
        a peer pool the pull plan (_combine_along, whose offsets are the call's own)."""
        channels, offsets, fwd_offset, fwd_mask, fwd_capacity, _, fwd_rows = handle.backend_state.routing
        geo = self._geometry(config, True, combine_slot_bytes(_row_bytes(x), _columns(topk_weights)), channels,
                             "combine")
        if fwd_rows is not None:
            return _PullCombinePlan(self, handle, x, topk_weights, config, self._buffer_cls.num_sms, geo)
        return self._mod.cached_combine(self._ctx, self._ipc, self._comm, self._timeout_ns, handle, offsets, fwd_offset,
                                        fwd_mask, fwd_capacity, x, topk_weights, geo, config,
                                        self._buffer_cls.num_sms,
                                        ring_signatures=ring_signatures("combine", x, None, topk_weights, geo))

    # ------------------------------------------------------------------ buffer access and lifetime
    def local_buffer_tensor(self, dtype: torch.dtype, size: Optional[Sequence[int]] = None, offset: int = 0,
                            use_rdma_buffer: bool = False) -> torch.Tensor:
        """A typed view of this rank's NVLink buffer, or of its NVSHMEM buffer, from byte `offset`."""
        self._check()
        total = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes

        def raw() -> torch.Tensor:
            if use_rdma_buffer:
                return self._rdma_raw
            return torch.as_tensor(_DeviceMemory(self._ipc.local_ptr, total, self._ipc), device=self.device)
        return buffer_view(raw, total, dtype, size, offset, "RDMA" if use_rdma_buffer else "NVLink")

    def forget_overflow(self) -> None:
        self._ipc.take_worst_overflow()

    # Teardown (moe_dispatcher/runtime/release.py runs these, never one rank alone for the frees).
    symmetric = True  # the RDMA buffer is NVSHMEM memory: freed collectively

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def quiesce(self) -> None:
        """Local: note a recorded timeout, wait for the device, close this rank's mappings of the domain peers'
        NVLink buffers, drop this backend's view of the NVSHMEM buffer; later calls raise."""
        if self._ipc.alive and self._broken is None:
            info = self._mod.timeout_info(self._ipc)
            if info is not None:
                self._broken = timeout_message(self.name, info, self.timeout_s, TIMEOUT_ENV, self._board)
        self._alive = False
        self._rdma_raw = None
        if self._broken is None:  # every pool dispatch completed (its kernel saw every peer's writes): nobody writes
            self._direct_blocks = ()  # into them any more; a broken backend keeps them (a late peer might)
        if self.peer_pool is not None:  # before the mappings its peer addresses point into close
            self.peer_pool.close()
        self._ipc.close()

    def views_alive(self) -> bool:
        """A tensor viewing the NVSHMEM buffer (get_local_buffer_tensor) is still alive."""
        return self._rdma_memory() is not None

    def free(self, symmetric: bool) -> None:
        """Every rank stopped: the NVLink buffer goes with its last reference (IpcBuffer); symmetric: every rank's
        views of the NVSHMEM buffer are gone: free it (collective) and drop this backend's NVSHMEM reference, else
        it stays allocated for the views until the process exits."""
        if symmetric:
            self._state.release(self._rdma_ptr, self.device)

    def abandon(self) -> None:
        """A rank never confirmed: both buffers stay allocated until the process exits (the pool's region too)."""
        if self.peer_pool is not None:
            self.peer_pool.close()
        self._ipc.abandon()
