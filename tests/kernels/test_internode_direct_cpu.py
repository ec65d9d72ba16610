"""The host side of the internode direct NVLink hop (a Buffer with a peer pool), on CPU: the real InternodeBackend's
Python over the stub modules of tests/helpers/stub_extension.py, with a stand-in for the PeerPool.

Checked: a cached dispatch along the handle of a pool Buffer (fwd_rows in its routing) takes a Python plan that
launches direct_dispatch with outputs in pool blocks from the intranode backend's native rule (pool_block over the
domain's IpcBuffer and the pool's MemPool id; their offsets in the NVLink buffer), torch's memory with offset -1
once the pool is closed, the handle's fwd_row_offset and fwd_mask (read only, as the handle's: fwd_mask None), no
fwd_rows, the two ring signatures the native plan would get, and the handle's row count; a pool without room (or a
CUDA graph capture) gives blocks from torch with offset -1. A handle without fwd_rows keeps the native plan.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from stub_extension import attach_stub_internode

from moe_dispatcher import Buffer
from moe_dispatcher.compiled import HandleState
from moe_dispatcher.compiled.internode import ring_signatures
from moe_dispatcher.handle import DispatchHandle

T, H, ROWS = 16, 256, 24
RANKS, NVL = 4, 2


class _Pool:
    """PeerPool's allocation surface: blocks from a CPU arena at known offsets, or none (full)."""

    mem_pool_id = (7, 8)

    def __init__(self, full: bool) -> None:
        self.closed, self.full, self.blocks = False, full, []

    def allocate(self, shape, dtype):
        if self.full:
            raise torch.OutOfMemoryError("no room")
        block = torch.empty(shape, dtype=dtype)
        self.blocks.append(block)
        return block

    def offset_of(self, tensor) -> int:
        return 4096 * (1 + next(i for i, b in enumerate(self.blocks) if b is tensor))


@pytest.fixture
def backend(monkeypatch, tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        buf = Buffer(backend="reference", explicitly_destroy=True)
        b = attach_stub_internode(buf, 0, RANKS, NVL, monkeypatch.setattr)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        calls = []

        def direct_dispatch(ctx, timeout_ns, x, scales, topk_idx, topk_weights, is_token_in_rank, offsets,
                            fwd_offset, fwd_row_offset, fwd_mask, fwd_capacity, fwd_rows, payload, out_offset, meta,
                            meta_offset, rows, experts_per_rank, pad_rows, geometry, ring_signatures=(),
                            handle_fwd_mask=None):
            calls.append(dict(fwd_row_offset=fwd_row_offset, fwd_mask=fwd_mask, fwd_capacity=fwd_capacity,
                              fwd_rows=fwd_rows, payload=payload, out_offset=out_offset, meta=meta, rows=rows,
                              pad_rows=pad_rows, geometry=list(geometry), ring_signatures=list(ring_signatures),
                              handle_fwd_mask=handle_fwd_mask))
            return [torch.zeros(rows, x.shape[1], dtype=x.dtype), None, None, None, None]

        b._mod.direct_dispatch = direct_dispatch
        blocks = []

        def pool_block(ipc, device, pool_id, nbytes):
            """The native rule's outcome (csrc/intranode_bindings.cpp): a pool block, or torch's memory with -1."""
            blocks.append(dict(ipc=ipc, device=device, pool_id=pool_id, nbytes=nbytes))
            if b.peer_pool.full or torch.cuda.is_current_stream_capturing():
                return torch.empty(max(nbytes, 1), dtype=torch.uint8), -1
            block = b.peer_pool.allocate((max(2 << 20, nbytes),), torch.uint8)
            return block, b._ipc.pool_offset + b.peer_pool.offset_of(block)

        b._intra.pool_block = pool_block
        b.pool_block_calls = blocks
        b._intra.direct_payload_bytes = lambda rows, row_bytes, num_scales: rows * (row_bytes + 4 * num_scales)
        b._intra.direct_meta_bytes = lambda rows, num_topk: rows * (12 * num_topk + 4)
        b.direct_calls = calls
        b._direct_blocks = ()
        yield b
        buf.destroy()
    finally:
        dist.destroy_process_group()


def _handle(channels: int, pooled: bool) -> DispatchHandle:
    """A handle as the internode fresh dispatch makes it; pooled: a Buffer with a peer pool (fwd_rows kept)."""
    fwd_rows = torch.full((10, NVL), -1, dtype=torch.int32) if pooled else None
    routing = (channels, torch.zeros(RANKS, channels + 1, dtype=torch.int32),
               torch.zeros(RANKS // NVL, channels + 1, dtype=torch.int32), torch.ones(10, dtype=torch.int32), 10,
               torch.zeros(RANKS // NVL, NVL, channels, dtype=torch.int32), fwd_rows)
    return DispatchHandle(torch.zeros(RANKS, RANKS, dtype=torch.int32), torch.ones(T, RANKS, dtype=torch.bool),
                          torch.zeros(ROWS, dtype=torch.int32), ROWS, T, 0, "internode", 0,
                          backend_state=HandleState(routing))


@pytest.mark.parametrize("full,capturing,closed", [(False, False, False), (True, False, False),
                                                   (False, True, False), (False, False, True)],
                         ids=["room", "pool full", "graph capture", "pool closed"])
def test_cached_dispatch_of_a_pool_handle_writes_pool_blocks(backend, monkeypatch, full: bool,
                                                             capturing: bool, closed: bool) -> None:
    b = backend
    b.peer_pool = _Pool(full)
    b.peer_pool.closed = closed
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    h = _handle(Buffer.get_dispatch_config(RANKS).num_channels, pooled=True)
    x = torch.randn(T, H).bfloat16()
    out = b.cached_dispatch(x, None, h)[0]
    assert tuple(out.shape) == (ROWS, H) and not b._intra.plans, "a pool handle must not make a native plan"
    (call,) = b.direct_calls
    _, _, _, fwd_mask, capacity, fwd_row_offset, _ = h.backend_state.routing
    assert call["handle_fwd_mask"] is fwd_mask and call["fwd_mask"] is None and call["fwd_rows"] is None
    assert call["fwd_row_offset"] is fwd_row_offset and call["fwd_capacity"] == capacity
    assert call["rows"] == ROWS and call["pad_rows"] is False and call["meta"] is None
    geo = call["geometry"]
    assert call["ring_signatures"] == ring_signatures("cached dispatch", x, None, None, geo)
    if closed:  # no native rule: torch's memory
        assert call["out_offset"] == -1 and not b.peer_pool.blocks and not b.pool_block_calls
    else:  # the intranode backend's native rule over the domain's IpcBuffer and the pool's MemPool
        (asked,) = b.pool_block_calls
        assert asked["ipc"] is b._ipc and asked["pool_id"] == (7, 8) and asked["nbytes"] == ROWS * H * 2
    if full or capturing or closed:
        assert call["out_offset"] == -1 and not b.peer_pool.blocks
    else:
        assert call["payload"] is b.peer_pool.blocks[0]
        assert call["out_offset"] == b._ipc.pool_offset + 4096
    b.cached_dispatch(x, None, h)  # the handle's plan again (same arguments): direct again
    assert len(b.direct_calls) == 2


def test_handle_without_pool_keeps_the_native_plan(backend) -> None:
    b = backend
    b.peer_pool = None
    h = _handle(Buffer.get_dispatch_config(RANKS).num_channels, pooled=False)
    b.cached_dispatch(torch.randn(T, H).bfloat16(), None, h)
    assert not b.direct_calls and [kind for kind, _ in b._intra.plans] == ["CachedDispatch"]


class _InputPool(_Pool):
    """_Pool with the membership test of a combine's inputs (PeerPool.contains)."""

    def contains(self, tensor) -> bool:
        return any(b is tensor for b in self.blocks)


def _record_combines(b) -> list:
    calls = []

    def combine(ctx, timeout_ns, x, topk_weights, bias0, bias1, is_token_in_rank, offsets, fwd_offset, fwd_mask,
                fwd_capacity, out, out_w, geometry, ring_signatures, fwd_rows=None, x_offset=-1, w_offset=-1):
        calls.append(dict(x=x, bias0=bias0, fwd_rows=fwd_rows, x_offset=x_offset, w_offset=w_offset,
                          geometry=list(geometry), ring_signatures=list(ring_signatures)))

    b._mod.combine = combine
    return calls


@pytest.mark.parametrize("where", ["pool", "outside", "no rows", "graph capture"])
@pytest.mark.parametrize("bias", [False, True], ids=["plan", "bias"])
def test_combine_of_a_pool_handle_passes_fwd_rows_and_input_offsets(backend, monkeypatch, where: str,
                                                                    bias: bool) -> None:
    """Along a pool handle, a combine (its Python plan, or the bias path) launches the kernel with the handle's
    fwd_rows and where x / topk_weights lie in the NVLink buffer: pool_offset + their pool offsets when both are
    pool blocks, 0 for an x without rows, -1 for both otherwise (outside the pool, or a graph capture)."""
    b = backend
    b.peer_pool = _InputPool(False)
    calls = _record_combines(b)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: where == "graph capture")
    h = _handle(Buffer.get_combine_config(RANKS).num_channels, pooled=True)
    rows = 0 if where == "no rows" else ROWS
    if where in ("pool", "graph capture"):
        x = b.peer_pool.allocate((rows, H), torch.bfloat16)
        w = b.peer_pool.allocate((rows, 8), torch.float32)
    else:
        x, w = torch.randn(rows, H).bfloat16(), torch.rand(rows, 8)
    extra = [torch.randn(T, H).bfloat16()] if bias else []
    b.combine(x, h, w, extra)
    (call,) = calls
    assert call["fwd_rows"] is h.backend_state.routing[6] and not b._intra.plans
    assert (call["bias0"] is not None) == bias
    if where == "pool":
        assert (call["x_offset"], call["w_offset"]) == (b._ipc.pool_offset + 4096, b._ipc.pool_offset + 8192)
    elif where == "no rows":
        assert (call["x_offset"], call["w_offset"]) == (0, 0)
    else:
        assert (call["x_offset"], call["w_offset"]) == (-1, -1)
    assert call["ring_signatures"] == ring_signatures("combine", x, None, w, call["geometry"])
    if not bias:
        b.combine(x, h, w, [])  # the handle's plan again: the same launch
        assert len(calls) == 2 and calls[1]["x_offset"] == call["x_offset"]


def test_combine_of_a_handle_without_pool_keeps_the_native_plan(backend) -> None:
    b = backend
    b.peer_pool = None
    calls = _record_combines(b)
    h = _handle(Buffer.get_combine_config(RANKS).num_channels, pooled=False)
    b.combine(torch.randn(ROWS, H).bfloat16(), h, None, [])
    assert not calls and [kind for kind, _ in b._intra.plans] == ["CachedCombine"]
