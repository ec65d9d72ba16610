"""A stand-in for the extension's intranode module (moe_dispatcher._C.intranode) on a machine without GPUs, and for
the cached-call part of its internode module (stub_internode / attach_stub_internode).

attach_stub_backend() gives a Buffer the real IntranodeBackend (its Python: checks, plan making, allocation) over a
module with the native API of csrc/intranode_bindings.cpp whose launchers launch nothing and record their
arguments, so the host side of the compiled backend runs on CPU tensors: tests/kernels/test_cached_plans_cpu.py checks
what the cached-call fast path skips and what it still checks, and tools/host_glue_cpu.py times the Python glue.
The cached plans (CachedDispatch / CachedCombine) follow the native ones: the same "not mine" rules (handle
fields, tensor dtype / shape / contiguity, config), the same outputs, and None once the buffer is destroyed or a
timeout is recorded. Constants are those of csrc/kernels/intranode/protocol.h (RINGS_OFFSET rounded: only size
checks read it).
"""
from __future__ import annotations

import contextlib
import types
from typing import Callable, List, Optional, Tuple

import torch

# DispatchHandle fields a plan depends on, by position (HandleField in csrc/intranode_bindings.cpp).
_IS_TOKEN_IN_RANK, _RECV_SRC_IDX, _NUM_TOKENS, _NUM_WORST_TOKENS = 1, 2, 4, 5
LAUNCH_ASYNC = 1


class StubEvent:
    """CommEvent: what an async_finish call returns (never waits on CPU)."""

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def stub_intranode(rows: int) -> types.SimpleNamespace:
    """The stub module; its notify reports `rows` received rows. `launches` lists (kind, args) of every launch
    (plans: (kind, (x, aux, output, aux output, launch mode))), `plans` (kind, make args) of every plan made."""
    launches: List[Tuple[str, tuple]] = []
    plans: List[Tuple[str, tuple]] = []

    class IpcBuffer:
        local_ptr = 0

        def __init__(self, rank, num_ranks, num_bytes, num_pool_bytes=0):
            self.alive = True
            self.pool_bytes, self.pool_offset = num_pool_bytes, num_bytes  # the peer pool's tail (ipc_buffer.h)
            self.timeout: Optional[tuple] = None  # what timeout_info() reports (a test sets it)
            self.ring_mismatch: Optional[list] = None  # what take_ring_mismatch() reports (a test sets it)
            self.signature_mismatch: Optional[tuple] = None  # what take_signature_mismatch() reports (a test sets it)
            # The mailbox's seq (the latest call whose notify published its results) and the seqs the host waited
            # for (wait_notify), in order.
            self.seq = 0
            self.waits: List[int] = []
            # The peer abort as the native IpcBuffer keeps it: whether this rank's abort bytes are posted on its
            # peers, and every write in order (1: post_abort, 0: cleared at the next launch).
            self.abort_posted = False
            self.abort_writes: List[int] = []

        def post_abort(self):
            if self.alive:
                self.abort_posted = True
                self.abort_writes.append(1)

        def clear_abort_if_posted(self):
            if self.alive and self.abort_posted:
                self.abort_posted = False
                self.abort_writes.append(0)

        def ipc_handle(self):
            return b""

        def open_peers(self, handles):
            pass

        def timeout_info(self):
            return self.timeout

        def wait_notify(self, seq, timeout_s):
            self.waits.append(seq)
            if seq != self.seq:  # the native wait spins until its host timeout
                raise RuntimeError(f"stub: the host waited for notify {seq}, but the mailbox holds {self.seq}")
            return rows, 0

        def take_worst_overflow(self):
            return None

        def take_signature_mismatch(self, num_ranks):
            # What the native notify recorded (a test sets signature_mismatch: (seq, problems)); cleared once taken.
            mismatch, self.signature_mismatch = self.signature_mismatch, None
            return mismatch

        def take_ring_mismatch(self):
            # What the native IpcBuffer's receivers recorded (a test sets ring_mismatch); cleared once taken.
            records, self.ring_mismatch = self.ring_mismatch, None
            return records

        def expert_counts(self, n):
            return [0] * n

        def close(self):
            self.alive = False
            self.closed = True

        def destroy(self):
            self.alive = False

        def abandon(self):
            self.alive = False
            self.abandoned = True

    class CommStream:
        def __init__(self, stream):
            self.stream = stream

    def spec(t: torch.Tensor, rows_: int) -> tuple:
        return t.dtype, rows_, t.shape[1]

    def fits(t: torch.Tensor, want: tuple) -> bool:
        return (t.dtype, *t.shape) == want and t.dim() == 2 and t.is_contiguous()

    class CachedCall:  # CachedCall of csrc/intranode_bindings.cpp
        kind = ""

        def __init__(self, buffer, handle, input_spec, aux_spec, out_spec, aux_out_spec, config, num_sms):
            self.buffer, self.config, self.num_sms = buffer, config, num_sms
            self.fields = (handle[_IS_TOKEN_IN_RANK], handle[_RECV_SRC_IDX], handle[_NUM_TOKENS],
                           handle[_NUM_WORST_TOKENS])
            self.input, self.aux, self.out, self.aux_out = input_spec, aux_spec, out_spec, aux_out_spec

        def matches(self, handle, x, aux, config, num_sms) -> bool:
            if not isinstance(handle, tuple) or len(handle) != 9:
                return False
            mine = self.fields
            if (handle[_IS_TOKEN_IN_RANK] is not mine[0] or handle[_RECV_SRC_IDX] is not mine[1]
                    or handle[_NUM_TOKENS] != mine[2] or handle[_NUM_WORST_TOKENS] != mine[3]):
                return False
            if (config is None) != (self.config is None):
                return False
            if config is None and num_sms != self.num_sms:
                return False
            if config is not None and config is not self.config and not config == self.config:
                return False
            if not fits(x, self.input) or (aux is None) != (self.aux is None):
                return False
            return aux is None or fits(aux, self.aux)

        def __call__(self, handle, x, aux, config, num_sms, mode):
            if not self.matches(handle, x, aux, config, num_sms):
                return None
            if not self.buffer.alive or self.buffer.timeout is not None:
                return None  # refused, as the native plans do
            self.buffer.clear_abort_if_posted()  # usable(): a rank that posted an abort clears it before launching
            out = torch.empty(self.out[1:], dtype=self.out[0])
            aux_out = torch.empty(self.aux_out[1:], dtype=self.aux_out[0]) if self.aux_out is not None else None
            launches.append((self.kind, (x, aux, out, aux_out, mode)))
            return out, aux_out, (StubEvent() if mode == LAUNCH_ASYNC else None)

    class CachedDispatch(CachedCall):
        kind = "CachedDispatch"

    class CachedCombine(CachedCall):
        kind = "CachedCombine"

    def cached_dispatch(buffer, comm, timeout_ns, handle, recv_channel_offset, x, scales, num_channels, chunk,
                        num_slots, slot_bytes, config, num_sms, ring_signature):
        plans.append(("CachedDispatch", (timeout_ns, recv_channel_offset, x.dtype, tuple(x.shape),
                                         None if scales is None else tuple(scales.shape), num_channels, chunk,
                                         num_slots, slot_bytes, config, num_sms, ring_signature)))
        n = handle[_RECV_SRC_IDX].shape[0]
        return CachedDispatch(buffer, handle, spec(x, x.shape[0]), None if scales is None else spec(scales, x.shape[0]),
                              spec(x, n), None if scales is None else spec(scales, n), config, num_sms)

    def cached_combine(buffer, comm, timeout_ns, handle, recv_channel_offset, x, topk_weights, num_channels, chunk,
                       num_slots, slot_bytes, config, num_sms, ring_signature):
        plans.append(("CachedCombine", (timeout_ns, recv_channel_offset, x.dtype, tuple(x.shape),
                                        None if topk_weights is None else tuple(topk_weights.shape), num_channels,
                                        chunk, num_slots, slot_bytes, config, num_sms, ring_signature)))
        t = handle[_NUM_TOKENS]
        w = None if topk_weights is None else spec(topk_weights, x.shape[0])
        w_out = None if topk_weights is None else (torch.float32, t, topk_weights.shape[1])
        return CachedCombine(buffer, handle, spec(x, x.shape[0]), w, spec(x, t), w_out, config, num_sms)

    class CachedDirectDispatch(CachedCall):
        kind = "CachedDirectDispatch"

    def cached_direct_dispatch(buffer, comm, timeout_ns, handle, recv_channel_offset, send_row_offset, x, scales,
                               num_channels, chunk, num_slots, slot_bytes, config, num_sms, ring_signature, pool_id,
                               latest):
        plans.append(("CachedDirectDispatch", (timeout_ns, recv_channel_offset, send_row_offset, x.dtype,
                                               tuple(x.shape), None if scales is None else tuple(scales.shape),
                                               num_channels, chunk, num_slots, slot_bytes, config, num_sms,
                                               ring_signature, pool_id, latest)))
        n = handle[_RECV_SRC_IDX].shape[0]
        return CachedDirectDispatch(buffer, handle, spec(x, x.shape[0]),
                                    None if scales is None else spec(scales, x.shape[0]), spec(x, n),
                                    None if scales is None else spec(scales, n), config, num_sms)

    class CachedPullCombine(CachedCall):
        kind = "CachedPullCombine"

    def cached_pull_combine(buffer, comm, timeout_ns, handle, recv_channel_offset, row_of_token, x, topk_weights,
                            num_channels, chunk, num_slots, slot_bytes, config, num_sms, ring_signature):
        plans.append(("CachedPullCombine", (timeout_ns, recv_channel_offset, row_of_token, x.dtype, tuple(x.shape),
                                            None if topk_weights is None else tuple(topk_weights.shape),
                                            num_channels, chunk, num_slots, slot_bytes, config, num_sms,
                                            ring_signature)))
        t = handle[_NUM_TOKENS]
        w = None if topk_weights is None else spec(topk_weights, x.shape[0])
        w_out = None if topk_weights is None else (torch.float32, t, topk_weights.shape[1])
        return CachedPullCombine(buffer, handle, spec(x, x.shape[0]), w, spec(x, t), w_out, config, num_sms)

    def layout_call(topk_idx, num_experts, num_ranks, nvl_size, buffer=None):
        if buffer is not None and (not buffer.alive or buffer.timeout is not None):
            return None  # refused, as the native call does: the Buffer's full path raises why
        launches.append(("layout", (topk_idx, num_experts, num_ranks, nvl_size, buffer)))
        return (torch.zeros(num_ranks, dtype=torch.int32), None, torch.zeros(num_experts, dtype=torch.int32),
                torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.bool))

    def notify(ipc, timeout_ns, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, channels, alignment,
               num_worst_tokens, seq, prefix, offsets, em_layout=None, **kwargs):
        """Records the launch and publishes its seq in the mailbox. verdict(ipc, seq, signature_hash, problem) ->
        bool (refused), when a test sets the module's, stands for the exchange of every rank's notify message and
        records a refusal in the mailbox as the native notify does; notify then writes the tables of a call that
        received nothing (refused_call.cuh: rows_needed 0), with kRefusedCall when refused. Without a verdict it
        writes nothing (no torch op: tests/megatron/test_megatron_host_ops.py counts them)."""
        launches.append(("notify", (ipc, timeout_ns, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert,
                                    channels, alignment, num_worst_tokens, seq, prefix, offsets, em_layout,
                                    *kwargs.values())))
        if module.verdict is not None:
            for t in (prefix, offsets, em_layout):
                if t is not None:
                    t.zero_()
            if module.verdict(ipc, seq, kwargs["signature_hash"], kwargs["problem"]):
                offsets.view(-1)[0] = -1  # kRefusedCall
        ipc.seq = seq

    def recorder(kind: str) -> Callable:
        def launch(*args, **kwargs) -> None:
            launches.append((kind, args + tuple(kwargs.values())))
        return launch

    module = types.SimpleNamespace(
        MAX_RANKS=8, MAX_CHANNELS=32, MAX_LOCAL_EXPERTS=1024, MAX_TOPK=16, MAX_CHUNK=32,
        RINGS_OFFSET=1 << 20, FLAG_LAYOUT_MISMATCH=1, IpcBuffer=IpcBuffer, CommStream=CommStream,
        CachedDispatch=CachedDispatch, CachedCombine=CachedCombine, cached_dispatch=cached_dispatch,
        cached_combine=cached_combine, cached_pull_combine=cached_pull_combine,
        cached_direct_dispatch=cached_direct_dispatch, em_layout_words=lambda r, l: r * l + 3 * l + 1,
        layout_call=layout_call, notify=notify, verdict=None, dispatch=recorder("dispatch"),
        combine=recorder("combine"), em_permute=recorder("em_permute"), em_unpermute=recorder("em_unpermute"),
        pair_rank=recorder("pair_rank"), launches=launches, plans=plans)
    return module


def attach_stub_backend(buf, rows: int, patch: Callable = setattr):
    """Give `buf` (a Buffer of a gloo group) an IntranodeBackend over the stub module, serving handles made by
    its dispatch (call backend.dispatch directly: the Buffer routes fresh CPU calls to the reference).
    patch(obj, name, value) replaces module attributes (pytest's monkeypatch.setattr undoes them)."""
    from moe_dispatcher import _ext
    # peer_pool / __file__: what the backend hands a PeerPool (a test that makes one replaces PeerPool).
    ext = types.SimpleNamespace(intranode=stub_intranode(rows), peer_pool=None, __file__="stub")
    patch(_ext, "load", lambda: ext)
    patch(torch.cuda, "current_device", lambda: 0)
    patch(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(multi_processor_count=132))
    buf._comm_stream = types.SimpleNamespace()  # the comm stream the backend's CommStream takes (never used on CPU)
    from moe_dispatcher.compiled import intranode
    buf._kernels = intranode.IntranodeBackend(buf)
    buf._kernels.connect([buf._kernels.creation_payload()] * buf.group_size)  # the stub opens nothing
    return buf._kernels


def stub_internode(intra: types.SimpleNamespace) -> types.SimpleNamespace:
    """The cached-call API of csrc/internode_bindings.cpp over the intranode stub `intra` (its IpcBuffer is the
    domain's, its plan classes and its `launches` / `plans` lists are shared): cached_dispatch / cached_combine
    record their make arguments in intra.plans, combine (with a bias) its launch arguments in intra.launches."""
    plans, launches = intra.plans, intra.launches

    def cached_dispatch(ctx, ipc, comm, timeout_ns, handle, recv_channel_offset, fwd_offset, fwd_mask, fwd_capacity, x,
                        scales, geometry, config, num_sms, ring_signatures):
        plans.append(("CachedDispatch", (timeout_ns, recv_channel_offset, fwd_offset, fwd_mask, fwd_capacity, x.dtype,
                                         tuple(x.shape), None if scales is None else tuple(scales.shape),
                                         list(geometry), config, num_sms, list(ring_signatures))))
        n = handle[_RECV_SRC_IDX].shape[0]
        spec = lambda t, rows: (t.dtype, rows, t.shape[1])
        aux, aux_out = (None, None) if scales is None else (spec(scales, x.shape[0]), spec(scales, n))
        return intra.CachedDispatch(ipc, handle, spec(x, x.shape[0]), aux, spec(x, n), aux_out, config, num_sms)

    def cached_combine(ctx, ipc, comm, timeout_ns, handle, recv_channel_offset, fwd_offset, fwd_mask, fwd_capacity, x,
                       topk_weights, geometry, config, num_sms, ring_signatures):
        plans.append(("CachedCombine", (timeout_ns, recv_channel_offset, fwd_offset, fwd_mask, fwd_capacity, x.dtype,
                                        tuple(x.shape), None if topk_weights is None else tuple(topk_weights.shape),
                                        list(geometry), config, num_sms, list(ring_signatures))))
        t = handle[_NUM_TOKENS]
        w = None if topk_weights is None else (torch.float32, x.shape[0], topk_weights.shape[1])
        w_out = None if topk_weights is None else (torch.float32, t, topk_weights.shape[1])
        return intra.CachedCombine(ipc, handle, (x.dtype, x.shape[0], x.shape[1]), w, (x.dtype, t, x.shape[1]), w_out,
                                   config, num_sms)

    def combine(ctx, timeout_ns, x, topk_weights, bias0, bias1, is_token_in_rank, recv_channel_offset, fwd_offset,
                fwd_mask, fwd_capacity, out, out_topk_weights, geometry, ring_signatures):
        launches.append(("internode combine", (x, topk_weights, bias0, bias1, list(geometry), list(ring_signatures))))

    return types.SimpleNamespace(
        MAX_RANKS=64, MAX_DOMAINS=64, MAX_NVL=8, MAX_CHANNELS=32, MAX_LOCAL_EXPERTS=1024, MAX_TOPK=16, MAX_CHUNK=32,
        timeout_info=lambda ipc: ipc.timeout, cached_dispatch=cached_dispatch, cached_combine=cached_combine,
        combine=combine)


def attach_stub_internode(buf, rank: int, num_ranks: int, nvl_size: int, patch: Callable = setattr):
    """An InternodeBackend for `buf` (a Buffer of a gloo group) over the stub modules, made without its
    constructor (which bootstraps NVSHMEM): the attributes its cached calls, fresh dispatch's host wait and
    errors read, for rank `rank` of `num_ranks` in NVLink domains of `nvl_size` (the gloo group may be smaller:
    only the ranks' numbers matter to these paths). Rings of every geometry fit (large buffer blocks)."""
    from moe_dispatcher.compiled import internode
    from moe_dispatcher.compiled.intranode import KEPT_SIGNATURES
    from moe_dispatcher.signature import KeptSignatures
    intra = stub_intranode(0)
    patch(torch.cuda, "current_device", lambda: 0)
    b = object.__new__(internode.InternodeBackend)
    b._mod, b._intra = stub_internode(intra), intra
    b.group, b.rank, b.num_ranks = None, rank, num_ranks
    b.nvl_size, b.num_domains = nvl_size, num_ranks // nvl_size
    b._buffer_cls = type(buf)
    b.timeout_s, b._timeout_ns = 30.0, 30 * 10**9
    b._layout = {"nvl_src_block_bytes": 1 << 40, "rdma_domain_bytes": 1 << 40}
    b.device = torch.device("cpu")
    b._ipc = intra.IpcBuffer(rank % nvl_size, nvl_size, 1 << 30)
    b._comm = intra.CommStream(None)
    b._ctx = None
    b._board = None
    b._abort_posted = b._peer_aborted = False
    b._seq = b._notified = 0
    b._signatures = KeptSignatures(KEPT_SIGNATURES)
    b._broken = None
    b._alive = True
    return b


@contextlib.contextmanager
def single_rank_stub(store_path: str, rows: int, patch: Callable = setattr, tokens: int = 16, hidden: int = 256,
                     experts: int = 8, topk: int = 2):
    """One gloo rank (FileStore at `store_path`), a Buffer with the stub IntranodeBackend attached
    (attach_stub_backend(buf, rows, patch)) and a seeded routing: yields (buf, backend, generator, x bf16
    [tokens, hidden], topk_idx int64 [tokens, topk] of `experts`); destroys the Buffer and the group after."""
    import torch
    import torch.distributed as dist
    from moe_dispatcher import Buffer
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    try:
        buf = Buffer(num_nvl_bytes=1 << 30, backend="reference", explicitly_destroy=True)
        backend = attach_stub_backend(buf, rows, patch)
        g = torch.Generator().manual_seed(0)
        idx = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices
        x = torch.randn(tokens, hidden, generator=g).bfloat16()
        yield buf, backend, g, x, idx
        buf.destroy()
    finally:
        dist.destroy_process_group()
