"""Direct dispatch (a Buffer with a peer pool) against the reference backend on real GPUs.

With Buffer(num_pool_bytes=N) every dispatch of the compiled intranode backend, fresh and cached, writes the rows
straight into the receivers' outputs, which each rank allocates in its peer pool (kernels/intranode/
dispatch_direct.cu). The outputs must be the reference's bit for bit, as the ring kernel's are: every case of the
normal-mode table, the pool poisoned first. When one rank's pool has no room for its outputs, every rank's call
must fall back to the ring kernel (the verdict is taken in the kernel, from every rank's published outputs) and
still match. Combine along a direct dispatch's handle pulls its rows from the holders' inputs when every rank's
input is in its pool: the ring combine's bits; with one rank's input elsewhere every rank takes the ring.
"""
from __future__ import annotations

from typing import Dict

import pytest
import torch
import torch.distributed as dist
from moe_dispatcher.config import get_dispatch_config
from dist import GPU_WORLD_SIZES, assert_close, assert_equal, case, fill_pool, make_buffer, run_distributed
from normal_cases import (CASES, case_inputs, check_case, check_worst_overflow, combine_dtype, combine_inputs,
                          one_hop_tol, worst_tokens)
from normal_cases import dispatch as _dispatch
from normal_cases import routing as _routing

pytestmark = pytest.mark.gpu
MAX_HIDDEN_BYTES = 7168 * 2
POOL_BYTES = 1 << 30


def _poison_pool(pool) -> None:
    """Fill the whole region with 0xF9 (through this rank's view of it), so outputs start as garbage wherever
    torch places them. Only while no pool tensor of this rank is live."""
    pool.peer_view(pool.rank, 0, (pool.num_bytes,), torch.uint8).fill_(0xF9)
    torch.cuda.synchronize()


def _paths(kb) -> tuple:
    """(direct dispatches, of them missed, pull combines, of them missed) so far on this rank: which kernel moved
    the calls (a missed call is moved by the ring kernel into the same outputs, with the same bits)."""
    return kb._kernels._ipc.path_counters()


def _took(kb, before: tuple, direct: int = 0, missed: int = 0, pulls: int = 0, pulls_missed: int = 0) -> tuple:
    """Assert how many calls of each kind ran since `before`; -> the counters now."""
    now = _paths(kb)
    got = tuple(a - b for a, b in zip(now, before))
    want = (direct, missed, pulls, pulls_missed)
    assert got == want, f"(direct, missed, pulls, pulls missed) since the last check: {got}, expected {want}"
    return now


def _world_direct(rank: int, world_size: int) -> Dict:  # noqa: C901 (one world, many cases)
    from moe_dispatcher import Buffer
    dev = torch.device("cuda", torch.cuda.current_device())
    kb = make_buffer(hidden_bytes=MAX_HIDDEN_BYTES, backend="kernels", explicitly_destroy=True,
                     num_pool_bytes=POOL_BYTES)
    rb = Buffer(backend="reference", explicitly_destroy=True)
    pool = kb._kernels.peer_pool
    assert pool is not None, "Buffer(num_pool_bytes=...) must give the intranode backend a peer pool"
    stats = {"combine_total": 0, "combine_bit_exact": 0}
    for i, c in enumerate(CASES):
        with case(c["name"]):
            _poison_pool(pool)
            check_case(kb, rb, c, i, stats, dev, combine_tol=one_hop_tol, poison=True, cached_returns_none=True)
    # Pull combine over the case table: the combine inputs (and weights) copied into the pool, biases, every combine
    # dtype, ranks without tokens or rows, num_worst_tokens: the ring combine's bits for the same rows, pulled.
    # Both read paths of the pull kernel: staged (cp.async) at 8 SMs (4 channels), register loads at 20 SMs.
    for sms, i, c in [(sms, i, c) for sms in (8, 20) for i, c in enumerate(CASES)]:
        with case(f"pull combine at {sms} SMs: {c['name']}"):
            inp = case_inputs(c, 50 + i, rank, world_size, dev)
            _, ok = _dispatch(kb, inp.xin, inp.idx, inp.w, inp.num_experts, c.get("align", 1),
                              worst_tokens(c, world_size), config=get_dispatch_config(world_size, sms))
            handle = ok[4]
            rows = (ok[0][0] if inp.scales is not None else ok[0]).shape[0]
            y, bias = combine_inputs(c, inp, rows, combine_dtype(c, inp), dev)
            # An input without rows counts as peer-mapped: the call misses when some rank has rows outside its pool
            some_rows = torch.tensor([rows], device=dev)
            dist.all_reduce(some_rows)
            seen = _paths(kb)
            ring = kb.combine(y, handle, topk_weights=ok[2], bias=bias)
            seen = _took(kb, seen, pulls=1, pulls_missed=int(some_rows.item() > 0))
            yp = pool.allocate(tuple(y.shape), y.dtype).copy_(y)
            wp = None if ok[2] is None else pool.allocate(tuple(ok[2].shape), torch.float32).copy_(ok[2])
            pulled = kb.combine(yp, handle, topk_weights=wp, bias=bias)
            _took(kb, seen, pulls=1)
            assert_equal(pulled[0], ring[0], "pulled combined_x vs the ring's")
            if ring[1] is not None:
                assert_equal(pulled[1], ring[1], "pulled combined_topk_weights vs the ring's")
            del ok, handle, y, yp, wp, ring, pulled
    with case("num_worst_tokens padding rows"):
        _poison_pool(pool)
        g = torch.Generator().manual_seed(11 + rank)
        t, h, e, k = 200, 2048, 4 * world_size, 4
        idx = _routing(g, t, e, k, world_size, "random").to(dev)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
        _, out = _dispatch(kb, x, idx, None, e, num_worst=t * world_size)
        _, ref = _dispatch(rb, x, idx, None, e, num_worst=t * world_size)
        n = int(ref[4].rank_prefix_matrix[-1, rank])
        assert pool.contains(out[0]), "num_worst_tokens outputs not in the pool"
        assert_equal(out[0][:n], ref[0][:n], "recv_x")
        assert bool((out[0][n:] == 0).all()), "recv_x rows past the received count must be zero"
        assert_equal(out[1], ref[1], "recv_topk_idx (padding -1)")
        assert_equal(out[4].recv_src_idx, ref[4].recv_src_idx, "recv_src_idx (padding -1)")
        del out, ref

    # Rows of 0 bytes (hidden 0): dispatched directly; their combine takes the ring on every rank (torch gives a
    # tensor without elements no address, so such an input is not peer-mapped, even as a view of a pool tensor),
    # with the top-k weights in the pool or not. The reference's results either way.
    with case("rows of 0 bytes"):
        g0 = torch.Generator().manual_seed(21 + rank)
        t0, e0, k0 = 300, 4 * world_size, 4
        idx0 = _routing(g0, t0, e0, k0, world_size, "random").to(dev)
        x0 = torch.empty(t0, 0, dtype=torch.bfloat16, device=dev)
        w0 = torch.rand(t0, k0, generator=g0).to(dev)
        _, got0 = _dispatch(kb, x0, idx0, w0, e0, config=get_dispatch_config(world_size, 8))
        _, ref0 = _dispatch(rb, x0, idx0, w0, e0)
        assert tuple(got0[0].shape) == tuple(ref0[0].shape), f"recv_x shape {tuple(got0[0].shape)}"
        assert_equal(got0[2], ref0[2], "recv_topk_weights (hidden 0)")
        want0 = rb.combine(ref0[0], ref0[4], topk_weights=ref0[2])
        rows0 = got0[0].shape[0]
        y0p = pool.allocate((max(rows0, 1), 8), torch.bfloat16)[:rows0, :0]
        w0p = pool.allocate(tuple(got0[2].shape), torch.float32).copy_(got0[2])
        some_rows = torch.tensor([rows0], device=dev)
        dist.all_reduce(some_rows)
        for label, w_in in (("weights in the pool", w0p), ("weights outside the pool", got0[2])):
            seen = _paths(kb)
            comb0 = kb.combine(y0p, got0[4], topk_weights=w_in)
            _took(kb, seen, pulls=1, pulls_missed=int(some_rows.item() > 0))
            assert tuple(comb0[0].shape) == (t0, 0), f"combined_x shape {tuple(comb0[0].shape)} ({label})"
            assert_close(comb0[1], want0[1], f"combined weights (hidden 0, {label})", rtol=1e-5, atol=1e-5)
        del got0, ref0, y0p, w0p, comb0

    # The outputs are the pool's (the direct kernel wrote them), fresh and cached.
    g = torch.Generator().manual_seed(5 + rank)
    t, h, e, k = 777, 4096, 8 * world_size, 8
    idx = _routing(g, t, e, k, world_size, "skewed").to(dev)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    w = torch.rand(t, k, generator=g).to(dev)
    with case("outputs in the pool"):
        seen = _paths(kb)
        _, out = _dispatch(kb, x, idx, w, e)
        assert pool.contains(out[0]) and pool.contains(out[4].recv_src_idx), "fresh outputs not in the peer pool"
        assert pool.contains(kb.dispatch(x, handle=out[4])[0]), "cached outputs not in the peer pool"
        seen = _took(kb, seen, direct=2)  # both direct, none missed

    # Pull combine: with every rank's input (and top-k weights) in its pool, each rank reads its tokens' rows from
    # the holders; the same bits as the ring combine of the same rows (the same float32 order), which runs when one
    # rank's input is elsewhere; both within bf16 rounding of the reference.
    with case("pull combine"):
        _, out = _dispatch(kb, x, idx, w, e)
        _, ref = _dispatch(rb, x, idx, w, e)
        y = (out[0].float() * 2 + 1).to(torch.bfloat16)
        yr = (ref[0].float() * 2 + 1).to(torch.bfloat16)
        want = rb.combine(yr, ref[4], topk_weights=ref[2])
        seen = _paths(kb)
        ring = kb.combine(y, out[4], topk_weights=out[2])  # inputs outside the pool on every rank: the ring kernel
        seen = _took(kb, seen, pulls=1, pulls_missed=1)
        yp = pool.allocate(tuple(y.shape), y.dtype)
        yp.copy_(y)
        wp = pool.allocate(tuple(out[2].shape), torch.float32)
        wp.copy_(out[2])
        for call in ("first", "repeated"):
            got = kb.combine(yp, out[4], topk_weights=wp)
            assert_equal(got[0], ring[0], f"pull combine vs ring combine ({call} call)")
            assert_equal(got[1], ring[1], f"pull combined weights vs ring ({call} call)")
            seen = _took(kb, seen, pulls=1)  # pulled
        assert_close(got[0], want[0], "pull combine vs reference", rtol=1e-2, atol=1e-2)
        assert_close(got[1], want[1], "pull combined weights vs reference", rtol=1e-5, atol=1e-5)
        # one rank's input outside its pool: every rank's pull kernel misses the call, the ring kernel moves it
        mixed = kb.combine(y if rank == 0 else yp, out[4], topk_weights=out[2] if rank == 0 else wp)
        assert_equal(mixed[0], ring[0], "combine with rank 0's input outside the pool")
        seen = _took(kb, seen, pulls=1, pulls_missed=1)  # every rank's call missed
        # combine along a direct handle whose dispatch the ring moved (row_of_token still recorded): below

    # One rank's pool full: every rank's call falls back to the ring kernel, with the same results. The outputs
    # here are larger than any free range the hog leaves (> 20 MiB: torch's segments for 1-10 MiB requests).
    t2, h2 = 2048, 7168
    idx2 = _routing(g, t2, e, k, world_size, "dense").to(dev)
    x2 = torch.randn(t2, h2, generator=g).to(torch.bfloat16).to(dev)
    w2 = torch.rand(t2, k, generator=g).to(dev)
    _, want = _dispatch(rb, x2, idx2, w2, e)
    n = int(want[4].rank_prefix_matrix[-1, rank])
    for victim in (0, world_size - 1):
        with case(f"rank {victim}'s pool full"):
            # the pull combine's input, in the pool before it fills up (the same bits as the outputs' rows - 0.5)
            y2 = (want[0].float() - 0.5).to(torch.bfloat16)
            y2p = pool.allocate(tuple(y2.shape), y2.dtype)
            hog = []
            if rank == victim:
                # fill_pool takes the region's largest free range first, as one block of the caller's stream: after
                # `del hog` torch keeps it cached for the pool, so it must serve the next call's outputs.
                hog = fill_pool(pool, (torch.cuda.current_stream(), kb.get_comm_stream()))
            seen = _paths(kb)
            _, got = _dispatch(kb, x2, idx2, w2, e)
            seen = _took(kb, seen, direct=1, missed=1)  # missed on every rank, moved by the ring kernel
            assert_equal(got[0][:n], want[0][:n], "recv_x (ring fallback)")
            assert_equal(got[1], want[1], "recv_topk_idx (ring fallback)")
            assert_equal(got[2], want[2], "recv_topk_weights (ring fallback)")
            assert_equal(got[4].recv_src_idx, want[4].recv_src_idx, "recv_src_idx (ring fallback)")
            if rank == victim:
                assert not pool.contains(got[0]), "the full pool's rank must have its outputs outside the pool"
            cached_got = kb.dispatch(x2, handle=got[4])[0]
            assert_equal(cached_got[:n], want[0][:n], "cached recv_x (ring fallback)")
            # pull combine along this handle (row_of_token was recorded although the ring moved the rows)
            del hog
            y2p.copy_(y2)
            seen = _paths(kb)
            pulled = kb.combine(y2p, got[4])[0]
            seen = _took(kb, seen, pulls=1)
            pushed = kb.combine(y2, got[4])[0]
            _took(kb, seen, pulls=1, pulls_missed=1)
            assert_equal(pulled, pushed, "pull combine along a handle whose dispatch went through the ring")
            del got, cached_got, y2p, y2
            torch.cuda.synchronize()
            dist.barrier()
            # and the next call, with room again everywhere, is direct and right
            seen = _paths(kb)
            _, again = _dispatch(kb, x2, idx2, w2, e)
            assert_equal(again[0][:n], want[0][:n], "recv_x (direct again)")
            assert pool.contains(again[0]), "with room again the outputs must be the pool's"
            _took(kb, seen, direct=1)
            del again

    with case("num_worst_tokens overflow: rows past a destination's count dropped, then every rank raises"):
        check_worst_overflow(kb, dev, 384, 2048, e, combine_dropped=True)
        seen = _paths(kb)
        _, again = _dispatch(kb, x, idx, w, e)
        assert pool.contains(again[0]), "after the overflow the outputs must be the pool's again"
        _took(kb, seen, direct=1)
        del again

    # Many calls in a row (race-prone: the ready / arrival words and the published offsets of back-to-back calls).
    # Other data every call: a write that went missing or elsewhere leaves an earlier call's rows, which differ.
    with case("200 calls back to back"):
        del want
        _, want = _dispatch(rb, x, idx, w, e)
        n = int(want[4].rank_prefix_matrix[-1, rank])
        handle = None
        for i in range(200):
            xi = x + i
            if i % 2 == 0:
                _, got = _dispatch(kb, xi, idx, w, e)
                handle, recv = got[4], got[0]
            else:
                recv = kb.dispatch(xi, handle=handle)[0]
            if i % 10 == 0 or i == 199:
                assert_equal(recv[:n], rb.dispatch(xi, handle=want[4])[0][:n], f"recv_x of call {i}")
    torch.cuda.synchronize()
    dist.barrier()
    kb.destroy()
    rb.destroy()
    return stats


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_direct_dispatch_matches_reference(world_size: int) -> None:
    stats = run_distributed(_world_direct, world_size, backend="nccl", timeout=300.0)
    exact = sum(s["combine_bit_exact"] for s in stats)
    total = sum(s["combine_total"] for s in stats)
    print(f"\n[direct R={world_size}] combine along direct handles bit-exact vs reference: {exact}/{total}")
