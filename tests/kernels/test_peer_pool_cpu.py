"""The peer pool's host side on CPU (moe_dispatcher/compiled/peer_pool.py, Buffer(num_pool_bytes=...)).

Checked: num_pool_bytes is validated like the other sizes and agreed across ranks at Buffer creation (a rank with
another size makes every rank raise SignatureMismatch naming it); Buffer.peer_pool says why there is none; the
intranode backend (over tests/helpers' stub extension) allocates the NVLink buffer with the pool's tail, hands the
PeerPool its IpcBuffer, and closes the pool before its mappings close at destroy(). PeerPool's own glue over a fake
native registry and a fake torch MemPool: the region registered at base = local allocation + pool offset, peer bases
likewise, allocating() naming the region for this thread and restoring the previous one, contexts of two pools
refused, offset_of refusing a tensor outside the pool, a torch OOM turned into PeerPoolExhausted naming the room,
close() idempotent and refusing allocations and peer addresses after. The device side (real tensors in the region,
peer writes, torch's caching, the deferred free) is tests/kernels/test_peer_pool_gpu.py's.
"""
from __future__ import annotations

import contextlib
import types

import pytest
import torch
from dist import case, run_distributed
from stub_extension import attach_stub_backend

from moe_dispatcher import Buffer
from moe_dispatcher.compiled import peer_pool as pp
from moe_dispatcher.signature import SignatureMismatch


def test_num_pool_bytes_is_validated_and_peer_pool_says_why_there_is_none(world):
    for bad in (True, -1, 1.5, torch.tensor(4)):
        with pytest.raises((TypeError, ValueError), match="num_pool_bytes"):
            Buffer(num_nvl_bytes=1 << 22, num_pool_bytes=bad, backend="reference")
    buf = Buffer(num_nvl_bytes=1 << 22, backend="reference")
    assert buf.num_pool_bytes == 0
    with pytest.raises(RuntimeError, match=r"no peer pool \(num_pool_bytes=0\)"):
        buf.peer_pool
    buf.destroy()
    buf = Buffer(num_nvl_bytes=1 << 22, num_pool_bytes=1 << 26, backend="reference")
    with pytest.raises(RuntimeError, match="compiled kernels do not serve this Buffer"):
        buf.peer_pool
    buf.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.peer_pool


def _disagree(rank: int, world_size: int) -> None:
    with case("num_pool_bytes differs on rank 1"):
        try:
            Buffer(num_nvl_bytes=1 << 22, num_pool_bytes=(1 << 26) + (1 << 21) * rank, backend="reference")
        except SignatureMismatch as exc:
            assert "num_pool_bytes differs" in str(exc), str(exc)
        else:
            raise AssertionError("Buffers with different num_pool_bytes were made")
    with case("the group is usable after"):
        Buffer(num_nvl_bytes=1 << 22, num_pool_bytes=1 << 26, backend="reference").destroy()


def test_num_pool_bytes_is_agreed_across_ranks():
    run_distributed(_disagree, 2)


class FakeNative:
    """moe_dispatcher._C.peer_pool's API in Python: regions by base, this thread's active region per device."""

    ALLOC_SYMBOL, FREE_SYMBOL = "moe_peer_pool_alloc", "moe_peer_pool_free"

    def __init__(self) -> None:
        self.regions: dict = {}
        self.active: dict = {}
        self.calls: list = []

    def register_region(self, base, nbytes, device):
        self.calls.append(("register", base, nbytes, device))
        self.regions[base] = {"capacity": nbytes, "in_use": 3 << 21, "peak_in_use": 3 << 21,
                              "largest_free": 1 << 21, "num_blocks": 3, "num_free_ranges": 1, "bad_releases": 0,
                              "closed": False, "retired": False, "base": base, "bytes": nbytes, "device": device}

    def close_region(self, base):
        self.calls.append(("close", base))
        self.regions[base]["closed"] = True

    def set_active_region(self, device, base):
        before = self.active.get(device, 0)
        self.active[device] = base
        return before

    def region_info(self, base):
        return self.regions.get(base)


class FakeIpc:
    pool_offset, pool_bytes = 6 << 20, 64 << 20

    def peer_ptrs(self):
        return [0x10000000, 0x20000000]


@pytest.fixture
def fake_torch_pool(monkeypatch):
    """torch's CUDA pool machinery replaced: MemPool / use_mem_pool / device record what PeerPool does with them;
    torch.empty inside use_mem_pool raises OOM when `oom` is set."""
    state = types.SimpleNamespace(pools=[], entered=[], oom=False, active_seen=[])
    native = FakeNative()

    class MemPool:
        def __init__(self, allocator):
            state.pools.append(self)

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        state.entered.append((pool, device))
        state.active_seen.append(dict(native.active))
        if state.oom:
            raise torch.OutOfMemoryError("CUDA out of memory")
        yield

    monkeypatch.setattr(pp, "_pluggable_allocator", lambda path, n: types.SimpleNamespace(allocator=lambda: "a"))
    monkeypatch.setattr(torch.cuda, "MemPool", MemPool)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return state, native


def test_peer_pool_glue(fake_torch_pool):
    state, native = fake_torch_pool
    dev = torch.device("cuda", 1)
    pool = pp.PeerPool(FakeIpc(), native, "ext.so", dev, 1, 2)
    assert pool.base == 0x20000000 + (6 << 20) and pool.num_bytes == 64 << 20
    assert native.calls == [("register", pool.base, 64 << 20, 1)]
    assert pool.peer_bases == [0x10000000 + (6 << 20), 0x20000000 + (6 << 20)]
    assert not pool.closed and len(state.pools) == 1

    # allocating(): this thread's region on the device is the pool's inside, the previous one after.
    native.active[1] = 0
    with pool.allocating():
        pass
    assert state.active_seen[-1] == {1: pool.base} and native.active[1] == 0
    assert state.entered[-1] == (state.pools[0], dev)
    with pool.allocating(), pool.allocating():  # the same pool nests
        pass
    assert native.active[1] == 0
    native.active[1] = 0x30000000  # another pool's context is active on this device
    with pytest.raises(RuntimeError, match="do not nest"):
        with pool.allocating():
            pass
    assert native.active[1] == 0x30000000
    native.active[1] = 0

    # A torch OOM inside the pool becomes PeerPoolExhausted (still a torch.OutOfMemoryError), naming the room.
    state.oom = True
    with pytest.raises(pp.PeerPoolExhausted, match=r"no room for \(1024, 4096\) torch.bfloat16 \(8388608 bytes\)"
                       r".*6291456 of 67108864 bytes.*largest free range is 2097152.*num_pool_bytes"):
        pool.allocate((1024, 4096), torch.bfloat16)
    assert issubclass(pp.PeerPoolExhausted, torch.OutOfMemoryError)
    assert native.active[1] == 0
    state.oom = False

    # offset_of refuses what is not in the pool (a CPU tensor here).
    assert not pool.contains(torch.zeros(4))
    with pytest.raises(ValueError, match="not in the peer pool of rank 1"):
        pool.offset_of(torch.zeros(4))
    assert pool.stats()["capacity"] == 64 << 20

    pool.close()
    pool.close()
    assert native.calls[1:] == [("close", pool.base)]
    assert pool.closed
    for use in (lambda: pool.allocate((4,), torch.float32), lambda: pool.peer_bases, pool.peer_bases_tensor,
                lambda: pool.peer_view(0, 0, (4,), torch.float32), lambda: pool.allocating().__enter__()):
        with pytest.raises(RuntimeError, match="closed"):
            use()
    native.regions.clear()  # every segment came back: the region is forgotten
    assert pool.stats()["closed"] and pool.stats()["in_use"] == 0


def test_intranode_backend_makes_and_closes_the_pool(world, monkeypatch):
    made = []

    class RecordingPool:
        def __init__(self, ipc, native, path, device, rank, num_ranks):
            self.ipc, self.closed_while_open = ipc, None
            made.append(self)

        def close(self):
            self.closed_while_open = self.ipc.alive  # the mappings must still be open when the pool closes

    from moe_dispatcher.compiled import intranode
    monkeypatch.setattr(intranode, "PeerPool", RecordingPool)
    buf = Buffer(num_nvl_bytes=1 << 22, num_pool_bytes=1 << 26, backend="reference")
    backend = attach_stub_backend(buf, 8, monkeypatch.setattr)
    assert len(made) == 1 and made[0].ipc is backend._ipc
    assert backend._ipc.pool_bytes == 1 << 26
    assert buf.peer_pool is made[0]
    buf.destroy()
    assert made[0].closed_while_open is True
    # Without num_pool_bytes: no pool, and the IpcBuffer is made as before (three arguments).
    buf = Buffer(num_nvl_bytes=1 << 22, backend="reference")
    backend = attach_stub_backend(buf, 8, monkeypatch.setattr)
    assert backend.peer_pool is None and backend._ipc.pool_bytes == 0 and len(made) == 1
    with pytest.raises(RuntimeError, match="num_pool_bytes=0"):
        buf.peer_pool
    buf.destroy()
