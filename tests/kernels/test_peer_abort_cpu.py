"""The host side of the compiled backends' peer abort (kernels/common/wait.cuh, "Peer abort"), on CPU.

The real Buffer with the real IntranodeBackend / LowLatencyBackend over the stubs of tests/helpers (their IpcBuffer and
runtime record every write of this rank's abort byte: 1 posted, 0 cleared). Checked: a Buffer call that raises on
bad input posts the abort through the backend, once; the next call clears it before it launches (a cached call's
native plan, a low-latency launch), and calls that raise nothing write nothing; errors every rank raises alike
(a peer's abort, a disagreement) post nothing; a recorded peer abort raises PeerError naming the raising rank with
the message it posted on the Board (or "(no message)"), the waiting rank and its phase, and keeps raising.
The device side (the waits giving up) is tests/kernels/test_teardown_gpu.py's.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from stub_extension import attach_stub_backend
from stub_low_latency import attach_stub_low_latency

from moe_dispatcher import Buffer
from moe_dispatcher.compiled import STATUS_PEER_ABORTED, STATUS_TIMEOUT
from moe_dispatcher.reference.board import PeerError

T, H, E, K = 16, 256, 8, 2
ROWS = 24
MAXT = 8
NOTIFY = "notify (barrier before dispatch)"


@pytest.fixture
def world(monkeypatch, tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        buf = Buffer(num_nvl_bytes=1 << 30, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(MAXT, 1024, 1, E),
                     low_latency_mode=True, backend="reference", explicitly_destroy=True)
        backend = attach_stub_backend(buf, ROWS, monkeypatch.setattr)
        ll = attach_stub_low_latency(buf)
        g = torch.Generator().manual_seed(0)
        idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
        x = torch.randn(T, H, generator=g).bfloat16()
        handle = backend.dispatch(x, None, idx, None, torch.full((1,), T, dtype=torch.int32),
                                  torch.ones(T, 1, dtype=torch.bool), torch.zeros(E, dtype=torch.int32), 1, 0)[5]
        yield types.SimpleNamespace(buf=buf, backend=backend, ipc=backend._ipc, rt=ll.runtime, handle=handle, x=x,
                                    idx=idx, w=torch.rand(T, K, generator=g))
        buf.destroy()
    finally:
        dist.destroy_process_group()


def _ll_dispatch(w, x=None):
    return w.buf.low_latency_dispatch(w.x[:5] if x is None else x, w.idx[:5], MAXT, E, use_fp8=False)


def test_a_raising_call_posts_the_abort_and_the_next_call_clears_it(world):
    w = world
    w.buf.dispatch(w.x, handle=w.handle)  # makes the plan
    w.buf.dispatch(w.x, handle=w.handle)  # fast path
    _ll_dispatch(w)
    assert w.ipc.abort_writes == [] and w.rt.abort_writes == []  # calls that raise nothing write nothing
    with pytest.raises(ValueError):
        w.buf.dispatch(w.x[:3], handle=w.handle)  # wrong token count: the Buffer's check raises
    assert w.ipc.abort_writes == [1] and w.rt.abort_writes == [1]  # both compiled backends poked their peers
    assert w.buf._board.abort_message(0) is not None  # and the message is on the Board
    w.buf.dispatch(w.x, handle=w.handle)  # the next call (a cached plan) clears it before launching
    assert w.ipc.abort_writes == [1, 0]
    assert w.buf._board.abort_message(0) is None  # and on the Board (no stale abort for a later Board round)
    assert w.buf._board.last_abort_message(0).startswith("ValueError")  # its message stays, for a peer's wording
    w.buf.dispatch(w.x, handle=w.handle)
    assert w.ipc.abort_writes == [1, 0]  # once
    _ll_dispatch(w)  # the low-latency runtime clears its own at its next launch
    assert w.rt.abort_writes == [1, 0]


def test_a_low_latency_error_posts_and_the_full_path_clears(world):
    w = world
    with pytest.raises(ValueError, match="divisible by 128"):
        _ll_dispatch(w, torch.zeros(5, 200, dtype=torch.bfloat16))
    assert w.rt.abort_writes == [1] and w.ipc.abort_writes == [1]
    # A fresh normal-mode call through the backend's full path clears the NVLink side (backend._check).
    w.backend.dispatch(w.x, None, w.idx, None, torch.full((1,), T, dtype=torch.int32), torch.ones(T, 1, dtype=torch.bool),
                       torch.zeros(E, dtype=torch.int32), 1, 0)
    assert w.ipc.abort_writes == [1, 0]


@pytest.mark.parametrize("posted", [True, False])
def test_a_peer_abort_names_the_rank_and_its_message(world, posted):
    w = world
    if posted:  # what rank 1's Board.post_abort would have written, once it came back (its next call cleared it)
        w.buf._board.store.set("said/1", "ValueError: topk_idx must be int64")
    said = r"rank 1 raised: ValueError: topk_idx must be int64" if posted else r"rank 1 raised \(no message\)"
    w.ipc.timeout = (STATUS_PEER_ABORTED, NOTIFY, 0, 1)
    for _ in range(2):  # and keeps raising
        with pytest.raises(PeerError, match=rf"moe_dispatcher intranode: {said} \(rank 0 was waiting in "
                                            rf"{NOTIFY.replace('(', '.').replace(')', '.')}\).*unusable"):
            w.buf.dispatch(w.x, handle=w.handle)
    assert w.ipc.abort_writes == []  # a rank whose kernels honoured a peer's abort posts none of its own
    w.rt.timeout = (STATUS_PEER_ABORTED, "low_latency_dispatch (receive counts)", 0, 1)
    with pytest.raises(RuntimeError, match=rf"moe_dispatcher low-latency: {said} \(rank 0 was waiting in "
                                           r"low_latency_dispatch \(receive counts\)\)"):
        _ll_dispatch(w)
    assert w.rt.abort_writes == [] and w.ipc.abort_writes == []


def test_a_timeout_still_reads_as_a_timeout_and_is_posted(world):
    w = world
    w.ipc.timeout = (STATUS_TIMEOUT, NOTIFY, 0, 1)
    with pytest.raises(RuntimeError, match=r"rank 0 timed out after .* waiting for rank 1") as err:
        w.buf.dispatch(w.x, handle=w.handle)
    assert not isinstance(err.value, PeerError)
    # This rank's own timeout is news to its peers (one of them may wait for it): posted.
    assert w.ipc.abort_writes == [1]


def test_errors_every_rank_raises_post_nothing(world):
    w = world
    w.buf._post_abort(PeerError("rank 1 raised: ..."))
    err = ValueError("same on every rank")
    err.raised_on_every_rank = True
    w.buf._post_abort(err)
    assert w.ipc.abort_writes == [] and w.rt.abort_writes == []
