"""Ranks that stall (issue 16, item 3): the reference backend honours MOE_DISPATCHER_TIMEOUT_S.

* One rank skips a dispatch: its peers raise after the timeout (not the process group's), naming the rank that
  did not arrive and the phase they waited in.
* One rank raises alone on a bad argument (normal dispatch), or on too many low-latency tokens: its peers,
  already waiting in that call's collective, raise "rank r raised: ..." well before the timeout.

A rank that gave up leaves its collective pending, so every world here ends after the failure: the culprit
waits on a store key until its peers have raised (a rank that left early would break the peers' collective
with a connection error instead of the timeout under test).
"""
from __future__ import annotations

import time

import oracle
import pytest
import torch
import torch.distributed as dist
from dist import case, make_buffer, run_distributed

T, H, L, K, MAX_T = 8, 128, 2, 2, 8
TIMEOUT_S = 6.0  # MOE_DISPATCHER_TIMEOUT_S of these worlds
FAST_S = 3.0  # a peer that raised must be reported within this (half the timeout)
ENV = {"MOE_DISPATCHER_TIMEOUT_S": str(TIMEOUT_S)}


def _inputs(rank: int, num_ranks: int):
    e = L * num_ranks
    idx = oracle.make_topk_idx(oracle.generator(1, rank), T, e, K, num_ranks, "dense")
    x = oracle.make_x(oracle.generator(2, rank), T, H, "grid")
    w = oracle.make_weights(oracle.generator(3, rank), idx)
    return x, idx, w, e


def _peers_done(store, rank: int, num_ranks: int, culprit: int) -> None:
    """Peers say they have raised; the culprit waits for all of them before its rank ends."""
    if rank != culprit:
        store.set(f"test/done/{rank}", "1")
    else:
        store.wait([f"test/done/{q}" for q in range(num_ranks) if q != culprit])


def _expect_peer_error(call, match: str, within: float, what: str) -> float:
    """call() must raise RuntimeError matching `match` within `within` seconds; returns the seconds taken."""
    begin = time.monotonic()
    with pytest.raises(RuntimeError, match=match):
        call()
    took = time.monotonic() - begin
    assert took < within, f"{what}: raised after {took:.1f} s, expected within {within:.1f} s"
    return took


def _skip_worker(rank: int, num_ranks: int, culprit: int) -> float:
    x, idx, w, e = _inputs(rank, num_ranks)
    a = make_buffer(hidden_bytes=H * 2)
    lay = a.get_dispatch_layout(idx, e)[:4]
    store = dist.distributed_c10d._get_default_store()
    took = 0.0
    with case(f"rank {culprit} skips a dispatch"):
        if rank != culprit:
            took = _expect_peer_error(
                lambda: a.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=lay[0],
                                   num_tokens_per_rdma_rank=lay[1], num_tokens_per_expert=lay[2],
                                   is_token_in_rank=lay[3]),
                rf"rank {rank} timed out after {TIMEOUT_S:g} s in dispatch: counts all-gather .*"
                rf"waiting for ranks \[{culprit}\]", TIMEOUT_S + 5.0, "skipped dispatch")
            assert took >= TIMEOUT_S - 0.5, f"raised after {took:.1f} s, before the {TIMEOUT_S} s timeout"
        _peers_done(store, rank, num_ranks, culprit)
    return took


def _bad_argument_worker(rank: int, num_ranks: int, culprit: int) -> float:
    x, idx, w, e = _inputs(rank, num_ranks)
    a = make_buffer(hidden_bytes=H * 2)
    ntr, ntrr, nte, itr, _ = a.get_dispatch_layout(idx, e)
    store = dist.distributed_c10d._get_default_store()
    weights = w.double() if rank == culprit else w  # the culprit's topk_weights have the wrong dtype
    took = 0.0
    with case(f"rank {culprit} passes float64 topk_weights"):
        if rank == culprit:
            with pytest.raises(TypeError, match="topk_weights"):
                a.dispatch(x, topk_idx=idx, topk_weights=weights, num_tokens_per_rank=ntr,
                           num_tokens_per_rdma_rank=ntrr, num_tokens_per_expert=nte, is_token_in_rank=itr)
        else:
            took = _expect_peer_error(
                lambda: a.dispatch(x, topk_idx=idx, topk_weights=weights, num_tokens_per_rank=ntr,
                                   num_tokens_per_rdma_rank=ntrr, num_tokens_per_expert=nte, is_token_in_rank=itr),
                rf"rank {culprit} raised: TypeError: .*topk_weights.*rank {rank} was waiting in dispatch: counts "
                r"all-gather", FAST_S, "bad argument")
        _peers_done(store, rank, num_ranks, culprit)
    return took


def _low_latency_worker(rank: int, num_ranks: int, culprit: int) -> float:
    x, idx, _, e = _inputs(rank, num_ranks)
    la = make_buffer(low_latency=True, max_tokens=MAX_T, hidden=H, num_experts=e)
    store = dist.distributed_c10d._get_default_store()
    if rank == culprit:  # one token more than the buffer's maximum
        x = torch.cat([x, x[:1]])
        idx = torch.cat([idx, idx[:1]])
    x = x.to(torch.bfloat16)
    took = 0.0
    with case(f"rank {culprit} sends {MAX_T + 1} low-latency tokens"):
        if rank == culprit:
            with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
                la.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False)
        else:
            took = _expect_peer_error(
                lambda: la.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False),
                rf"rank {culprit} raised: ValueError: x has {MAX_T + 1} tokens.*rank {rank} was waiting in "
                r"low-latency dispatch: signature all-gather", FAST_S, "low-latency tokens")
        _peers_done(store, rank, num_ranks, culprit)
    return took


@pytest.mark.parametrize("world_size", [2, 4])
def test_skipped_dispatch_times_out_naming_the_rank(world_size: int) -> None:
    """Peers of a rank that skips a dispatch raise after MOE_DISPATCHER_TIMEOUT_S, naming it and the phase."""
    run_distributed(_skip_worker, world_size, world_size - 1, env=ENV, timeout=60)


@pytest.mark.parametrize("world_size", [2, 4])
def test_bad_argument_on_one_rank_fails_peers_fast(world_size: int) -> None:
    """Peers of a rank that raised on a bad dispatch argument report that error well before the timeout."""
    run_distributed(_bad_argument_worker, world_size, 0, env=ENV, timeout=60)


@pytest.mark.parametrize("world_size", [2, 4])
def test_too_many_low_latency_tokens_on_one_rank_fails_peers_fast(world_size: int) -> None:
    """Peers of a rank with more low-latency tokens than the maximum report its error well before the timeout."""
    run_distributed(_low_latency_worker, world_size, 1, env=ENV, timeout=60)
