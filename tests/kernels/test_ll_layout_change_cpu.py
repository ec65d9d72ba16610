"""The compiled low-latency backend's layout change on CPU: 2 gloo ranks, the real Buffer and LowLatencyBackend glue
over the stub runtime (tests/helpers/stub_low_latency.py), which calls the backend's layout_round function where
the native runtime's clean_layout does (compiled/low_latency.py; docs/low_latency.md, "Layout change").

Checked, each within a bounded time (a hang fails the world's timeout):
- one rank's call changes (max tokens, hidden, experts) and its peer's does not: the changing rank raises a
  timeout naming the round ("low-latency layout change: agreement") and the missing rank, clears nothing, and
  posts its abort (the Board's message and the runtime's abort bytes), so the peer, whose kernel waits for it,
  raises "rank 1 raised: ..." with that message;
- the ranks change to different layouts (at a call, or in clean_low_latency_buffer): every rank raises the same
  SignatureMismatch naming the field and each rank's value, clears nothing, posts nothing; the Buffer stays
  usable (the old layout's calls, then an agreed change with its clear between the two rounds).
Before the rounds, the change was an NVSHMEM barrier (no deadline): the lone rank waited for ever and the
disagreeing ranks cleared and went on.
"""
from __future__ import annotations

import time

import pytest
import torch
from dist import case, run_distributed

TIMEOUT_S = 3.0
ENV = {"MOE_DISPATCHER_TIMEOUT_S": str(TIMEOUT_S)}
MAXT, H, E, K, T = 8, 256, 16, 4, 5


def _world(rank: int):
    from stub_low_latency import attach_stub_low_latency

    from moe_dispatcher import Buffer
    buf = Buffer(num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(MAXT, 4 * H, 2, E), low_latency_mode=True,
                 backend="reference", explicitly_destroy=True)
    backend = attach_stub_low_latency(buf)
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    return buf, backend.runtime, idx


def _dispatch(buf, idx, hidden: int):
    return buf.low_latency_dispatch(torch.zeros(T, hidden, dtype=torch.bfloat16), idx, MAXT, E, use_fp8=False)


def _change_alone(buf, idx):
    """This rank's dispatch with a new hidden size that no peer makes -> (the RuntimeError it raised, seconds taken)."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        _dispatch(buf, idx, 2 * H)
    return err.value, time.monotonic() - start


def _lone_change_worker(rank: int, num_ranks: int) -> None:
    from moe_dispatcher.compiled import STATUS_PEER_ABORTED
    from moe_dispatcher.reference.board import PeerError
    buf, rt, idx = _world(rank)
    with case("both ranks call with one layout"):
        _dispatch(buf, idx, H)
    with case("rank 1 changes hidden, rank 0 does not"):
        if rank == 1:
            error, elapsed = _change_alone(buf, idx)
            msg = str(error)
            assert "rank 1 timed out" in msg and "low-latency layout change: agreement" in msg, msg
            assert "waiting for ranks [0]" in msg, msg
            assert not isinstance(error, PeerError), type(error)  # its own timeout: news to its peers
            assert elapsed < TIMEOUT_S + 5, f"the lone layout change took {elapsed:.1f} s (deadline {TIMEOUT_S} s)"
            assert rt.cleans == [], rt.cleans  # nothing cleared
            assert rt.abort_writes == [1], rt.abort_writes  # its abort bytes posted on the peers
            said = buf._board.abort_message(1)
            assert said is not None and "low-latency layout change" in said, said
        else:
            _dispatch(buf, idx, H)  # its layout did not change: no round, the kernel launches and waits for rank 1
            # What rank 0's kernel does on the GPU: it sees rank 1's abort bytes and gives up, recording the peer
            # abort. Here the stub records it once rank 1's abort is on the Board (posted with the bytes).
            deadline = time.monotonic() + 4 * TIMEOUT_S + 10
            while buf._board.abort_message(1) is None:
                assert time.monotonic() < deadline, "rank 1 never posted its abort"
                time.sleep(0.05)
            rt.timeout = (STATUS_PEER_ABORTED, "low_latency_dispatch (receive counts)", 0, 1)
            with pytest.raises(RuntimeError) as err:
                _dispatch(buf, idx, H)
            msg = str(err.value)
            assert "rank 1 raised: RuntimeError:" in msg and "low-latency layout change: agreement" in msg, msg
            assert "(rank 0 was waiting in low_latency_dispatch (receive counts))" in msg, msg
            assert rt.abort_writes == [], rt.abort_writes  # a peer's abort is not posted again


def _different_changes_worker(rank: int, num_ranks: int) -> None:
    from moe_dispatcher.signature import SignatureMismatch
    buf, rt, idx = _world(rank)
    with case("both ranks call with one layout"):
        _dispatch(buf, idx, H)
    with case("the ranks change to different hidden sizes"):
        start = time.monotonic()
        with pytest.raises(SignatureMismatch) as err:
            _dispatch(buf, idx, (2 if rank == 0 else 4) * H)
        elapsed = time.monotonic() - start
        msg = str(err.value)
        assert msg.startswith(f"low-latency layout change: the ranks' calls do not agree: hidden differs: {2 * H} "
                              f"on rank 0; {4 * H} on rank 1"), msg
        assert "num_experts differs" not in msg and "tokens_per_rank differs" not in msg, msg
        assert elapsed < TIMEOUT_S, f"the disagreement took {elapsed:.1f} s: a timeout passed for it"
        assert rt.cleans == [] and rt.abort_writes == [], (rt.cleans, rt.abort_writes)
    with case("the Buffer stays usable: the old layout, then an agreed change"):
        _dispatch(buf, idx, H)  # still the old layout: no round
        assert rt.cleans == [], rt.cleans
        _dispatch(buf, idx, 2 * H)
        assert rt.cleans == [(MAXT, 2 * H, E)], rt.cleans
        _dispatch(buf, idx, 2 * H)
        assert len(rt.launches) == 4, rt.launches  # the first call and these three: none refused
    with case("clean_low_latency_buffer with different shapes"):
        with pytest.raises(SignatureMismatch, match=rf"hidden differs: {H} on rank 0; {2 * H} on rank 1"):
            buf.clean_low_latency_buffer(MAXT, (1 + rank) * H, E)
        assert rt.cleans == [(MAXT, 2 * H, E)] and rt.abort_writes == [], (rt.cleans, rt.abort_writes)
        buf.clean_low_latency_buffer(MAXT, 2 * H, E)  # agreed: cleared
        assert rt.cleans == [(MAXT, 2 * H, E)] * 2, rt.cleans
    buf.destroy()


def _stale_abort_worker(rank: int, num_ranks: int) -> None:
    buf, rt, idx = _world(rank)
    with case("both ranks call with one layout"):
        _dispatch(buf, idx, H)
    with case("rank 1 raises alone in a compiled call (the runtime's check), then both ranks call again"):
        if rank == 1:
            with pytest.raises(ValueError, match="more than num_max_dispatch_tokens_per_rank"):
                buf.low_latency_dispatch(torch.zeros(MAXT + 1, H, dtype=torch.bfloat16),
                                         torch.zeros(MAXT + 1, K, dtype=torch.int64), MAXT, E, use_fp8=False)
            assert buf._board.abort_message(1) is not None
        _dispatch(buf, idx, H)
    with case("a layout change that rank 1 comes to late"):
        if rank == 1:
            time.sleep(TIMEOUT_S / 2)  # rank 0 waits in the round meanwhile: it must not take the old abort for news
        _dispatch(buf, idx, 2 * H)
        assert rt.cleans == [(MAXT, 2 * H, E)], rt.cleans


def _round_deadline_worker(rank: int, num_ranks: int) -> None:
    import torch.distributed as dist
    buf, rt, idx = _world(rank)
    # By default the reference backend's deadline (the Board's, 300 s) is far longer than the kernels' (10 s); the
    # same here, from the one setting the kernels read (MOE_DISPATCHER_TIMEOUT_S = TIMEOUT_S).
    buf._board.timeout_s = 10 * TIMEOUT_S
    store = dist.distributed_c10d._get_default_store()
    with case("both ranks call with one layout"):
        _dispatch(buf, idx, H)
    with case("rank 1 changes hidden alone: its round ends after the kernels' timeout, not the Board's"):
        if rank == 1:
            error, elapsed = _change_alone(buf, idx)
            msg = str(error)
            assert f"rank 1 timed out after {TIMEOUT_S:g} s" in msg and "waiting for ranks [0]" in msg, msg
            assert "low-latency layout change: agreement" in msg, msg
            assert elapsed < TIMEOUT_S + 3, f"the lone layout change took {elapsed:.1f} s (kernels: {TIMEOUT_S} s)"
            store.set("lone change done", "1")
        else:
            _dispatch(buf, idx, H)  # no change here: its kernel would wait for rank 1
            store.wait(["lone change done"])  # stays until rank 1 is done (its round reads this rank's posts)


def test_a_lone_layout_change_ends_after_the_kernels_timeout() -> None:
    """The layout change's rounds wait as long as the kernels do (MOE_DISPATCHER_TIMEOUT_S as the backend reads it),
    not the reference backend's longer deadline: the lone rank is not left waiting after its peer's kernel gave up."""
    run_distributed(_round_deadline_worker, 2, env=ENV, timeout=60)


def test_an_abort_of_an_earlier_call_is_cleared_at_the_next_compiled_call() -> None:
    """A rank that raised in a compiled low-latency call and then called again successfully is back: a peer waiting
    for it later in a Board collective (here a layout change's round) waits for it rather than raising its old
    error."""
    run_distributed(_stale_abort_worker, 2, env=ENV, timeout=90)


def test_a_lone_layout_change_times_out_and_its_peer_raises_its_error() -> None:
    run_distributed(_lone_change_worker, 2, env=ENV, timeout=90)


def test_different_layout_changes_raise_signature_mismatch_on_every_rank() -> None:
    run_distributed(_different_changes_worker, 2, env=ENV, timeout=90)
