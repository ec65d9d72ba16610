"""The internode NVLink hop's direct writes (kernels/internode/notify.cu, dispatch.cu) on real GPUs.

fwd_row_offset: internode notify's table, at forwarder (d, l), of where each source (x, l)'s rows of channel c start
in the output of each local rank (d, j): it must equal (d, j)'s own recv_channel_offset[(x, l)][c] (gathered over the
group), for routings with empty ranks and channels, num_worst_tokens, and a refused call (all 0).

Direct dispatch (a Buffer with a peer pool; 4 GPUs as 2 emulated NVLink domains of 2 or 4 of 1, 2 GPUs as 2 of 1):
the forwarders write the NVLink hop's rows straight into the domain peers' outputs (pool blocks) and each rank
writes its own domain's rows from its inputs. Every case of the normal-mode table (pool poisoned first) must be the
reference's bits, fresh and cached, every call direct (path counters). One rank's pool full: its domain's calls take
the FIFO path (missed on both of its ranks), the other domain's stay direct, the outputs the same. fwd_rows (the
pull combine's map) names exactly the rows each local rank received from this rank's team, in both modes. A CUDA
graph's replays are missed (its outputs are the graph's memory) and still right. 100 calls back to back.

Pull combine (2 x 2, 2 x 1, and 4 x 1, where each forwarder serves three remote source domains): along the handles of
direct dispatches, a combine whose input x (and topk_weights) lies in every rank's pool reads the domain's rows in
place (pull counters: a call, none missed) and must give the bits of the same combine with the inputs outside the
pool (every domain missed: today's FIFO kernel), for every combine dtype, with and without top-k weights and
biases, and the reference's values within the two-hop tolerance. One rank's input outside its pool: only its domain
misses, the outputs the same bits. Along the handle of a dispatch whose domain took the FIFOs the pull combine reads
the same rows. With 2 channels and a 64-slot RDMA ring (T = 4096, every token to both domains nearly), the forwarder
laps the ring many times within one call (asserted from the handle's fwd_offset): the same bits as FIFO mode again.
T = 4096 over the default channels (more than 15 receiver chunks a channel: block 3c is a second source receiver
block): the same bits as FIFO mode. 100 calls back to back.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import dist as dist_helpers
from dist import assert_equal, case, fill_pool, make_buffer, run_distributed
from normal_cases import CASES as INTRANODE_CASES
from normal_cases import GROUP_CASES, check_case, check_graph_replay, check_worst_overflow, two_hop_tol
from normal_cases import dispatch as _dispatch
from normal_cases import routing as _routing

pytestmark = pytest.mark.gpu
MAX_HIDDEN_BYTES = 7168 * 2
MAX_COMBINE_ROW_BYTES = 7168 * 4  # the pull test combines float32 rows of hidden 7168
WORLDS = [pytest.param(2, 1, id="2-nvl1"), pytest.param(4, 2, id="4-nvl2"), pytest.param(4, 1, id="4-nvl1")]
POOL_BYTES = 1 << 30


def _routing_tables(handle):
    """(recv_channel_offset int32 [R, C + 1], fwd_row_offset int32 [D, nvl, C]) of an internode handle."""
    routing = handle.backend_state.routing
    return routing[1], routing[5]


def _check_fwd_row_offset(kb, handle, what: str) -> None:
    """fwd_row_offset[x][j][c] here == recv_channel_offset[(x, my local)][c] at rank (my domain, j)."""
    topo = kb.topology
    r, nvl = topo.num_ranks, topo.nvl_size
    offsets, fwd_rows = _routing_tables(handle)
    gathered = [torch.empty_like(offsets) for _ in range(r)]
    dist.all_gather(gathered, offsets.contiguous())
    c = offsets.shape[1] - 1
    d, l = topo.rank // nvl, topo.rank % nvl
    want = torch.empty_like(fwd_rows)
    for x in range(r // nvl):
        for j in range(nvl):
            want[x, j] = gathered[d * nvl + j][x * nvl + l, :c]
    assert_equal(fwd_rows, want, f"fwd_row_offset ({what})")


def _world_fwd_row_offset(rank: int, world_size: int) -> None:
    from moe_dispatcher.signature import SignatureMismatch
    dev = torch.device("cuda", torch.cuda.current_device())
    kb = make_buffer(hidden_bytes=MAX_HIDDEN_BYTES, backend="kernels", explicitly_destroy=True)
    assert kb._kernels is not None and kb._kernels.name == "internode", kb._kernels_why
    h, k = 1024, 6
    e = 8 * world_size
    for seed, (t, kind, worst) in enumerate([(512, "random", 0), (300, "skewed", 0), (77, "empty_last", 0),
                                             (129, "one_rank", 0), (256, "random", 256 * world_size),
                                             (0 if rank == 1 else 64, "random", 0), (5, "dense", 0)]):
        with case(f"{kind}, T={t}, num_worst_tokens={worst}"):
            g = torch.Generator().manual_seed(100 * seed + rank)
            idx = _routing(g, t, e, k, world_size, kind).to(dev)
            x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
            _, out = _dispatch(kb, x, idx, None, e, num_worst=worst)
            _check_fwd_row_offset(kb, out[4], f"{kind} routing")
    with case("a refused call: every word 0"):
        g = torch.Generator().manual_seed(7 + rank)
        t = 200
        idx = _routing(g, t, e, k, world_size, "random").to(dev)
        x = torch.randn(t, h if rank != 0 else 2 * h, generator=g).to(torch.bfloat16).to(dev)  # rank 0's H differs
        worst = t * world_size
        _, out = _dispatch(kb, x, idx, None, e, num_worst=worst)  # num_worst_tokens: no host wait, no raise here
        _, fwd_rows = _routing_tables(out[4])
        assert int(fwd_rows.abs().sum()) == 0, "a refused call's fwd_row_offset must be all 0"
        torch.cuda.synchronize()
        with pytest.raises(SignatureMismatch):  # reported at the next synchronised dispatch, on every rank
            _dispatch(kb, x[:, :h].contiguous(), idx, None, e)
    torch.cuda.synchronize()
    dist.barrier()
    kb.destroy()


@pytest.mark.parametrize("world_size,nvl", WORLDS)
def test_fwd_row_offset(world_size: int, nvl: int) -> None:
    run_distributed(_world_fwd_row_offset, world_size, backend="nccl", env=dist_helpers.nvl_env(nvl))


def _poison_pool(pool) -> None:
    """Fill this rank's whole region with 0xF9, so outputs start as garbage wherever torch places them. Only while no
    pool tensor of this rank is live."""
    pool.peer_view(pool.rank, 0, (pool.num_bytes,), torch.uint8).fill_(0xF9)
    torch.cuda.synchronize()


def _paths(kb) -> tuple:
    """(dispatches that ran the direct-call protocol, of them missed) so far on this rank (the NVLink buffer's
    Control::direct words; a combine counts in the pull words: _pulls)."""
    return tuple(kb._kernels._ipc.path_counters()[:2])


def _pulls(kb) -> tuple:
    """(combines that ran the pull protocol, of them missed) so far on this rank (Control::pull words)."""
    return tuple(kb._kernels._ipc.path_counters()[2:4])


def _pulled(kb, before: tuple, calls: int, missed: int = 0) -> tuple:
    now = _pulls(kb)
    got = tuple(a - b for a, b in zip(now, before))
    assert got == (calls, missed), f"(combines, of them missed) since the last check: {got}, expected {(calls, missed)}"
    return now


def _took(kb, before: tuple, direct: int, missed: int = 0) -> tuple:
    now = _paths(kb)
    got = tuple(a - b for a, b in zip(now, before))
    assert got == (direct, missed), f"(dispatches, of them missed) since the last check: {got}, expected {(direct, missed)}"
    return now


def _check_fwd_rows(kb, handle, what: str) -> None:
    """At forwarder (d, l): fwd_rows[idx][j] >= 0 exactly where fwd_mask[idx] has bit j (no row dropped here: no
    num_worst_tokens overflow), and in idx order the rows of local rank j are those (d, j) received from the team
    sources (x, l), x ascending (rank_prefix_matrix: source s's rows at rank r are [rpm[s - 1][r], rpm[s][r]))."""
    topo = kb.topology
    nvl = topo.nvl_size
    d, l = topo.rank // nvl, topo.rank % nvl
    _, _, fwd_offset, fwd_mask, _, _, fwd_rows = handle.backend_state.routing
    n = int(fwd_offset[-1, -1])  # tokens forwarded here (the last domain's end)
    rows, mask = fwd_rows[:n].cpu(), fwd_mask[:n].cpu()
    rpm = handle.rank_prefix_matrix.cpu()
    for j in range(nvl):
        sent = ((mask >> j) & 1).bool()
        assert torch.equal(rows[:, j] >= 0, sent), f"fwd_rows[:, {j}] set where fwd_mask lacks bit {j} ({what})"
        dest = d * nvl + j
        want = torch.cat([torch.arange(int(rpm[s - 1, dest]) if s else 0, int(rpm[s, dest]))
                          for s in range(l, topo.num_ranks, nvl)])
        assert torch.equal(rows[sent, j].long(), want), f"fwd_rows[:, {j}]: not the rows of ({d}, {j}) ({what})"


def _world_direct(rank: int, world_size: int) -> None:  # noqa: C901 (one world, many cases)
    from moe_dispatcher import Buffer
    dev = torch.device("cuda", torch.cuda.current_device())
    kb = make_buffer(hidden_bytes=MAX_HIDDEN_BYTES, backend="kernels", explicitly_destroy=True,
                     num_pool_bytes=POOL_BYTES)
    rb = Buffer(backend="reference", explicitly_destroy=True)
    assert kb._kernels is not None and kb._kernels.name == "internode", kb._kernels_why
    pool = kb.peer_pool
    nvl = kb.topology.nvl_size
    assert (pool.rank, pool.num_ranks) == (rank % nvl, nvl)
    stats = {"combine_total": 0, "combine_bit_exact": 0}
    for i, c in enumerate(list(INTRANODE_CASES) + GROUP_CASES):
        with case(c["name"]):
            _poison_pool(pool)
            seen = _paths(kb)
            check_case(kb, rb, c, i, stats, dev, combine_tol=two_hop_tol, nvl=nvl, poison=True, rdma_layout=True,
                       expect_backend="internode", cached_returns_none=True)
            _took(kb, seen, direct=3)  # the fresh dispatch and both cached ones, all direct

    g = torch.Generator().manual_seed(5 + rank)
    t, h, e, k = 777, 4096, 8 * world_size, 8
    idx = _routing(g, t, e, k, world_size, "skewed").to(dev)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    w = torch.rand(t, k, generator=g).to(dev)
    with case("outputs in the pool, fwd_rows"):
        seen = _paths(kb)
        _, out = _dispatch(kb, x, idx, w, e)
        assert pool.contains(out[0]) and pool.contains(out[4].recv_src_idx), "fresh outputs not in the peer pool"
        assert pool.contains(kb.dispatch(x, handle=out[4])[0]), "cached outputs not in the peer pool"
        _took(kb, seen, direct=2)
        _check_fwd_rows(kb, out[4], "direct")
        del out

    # One rank's pool full: its domain's calls take the FIFOs (every rank of that domain counts a miss), the other
    # domain's stay direct; the same results. The outputs are larger than any free range the hog leaves.
    t2, h2 = 2048, 7168
    idx2 = _routing(g, t2, e, k, world_size, "dense").to(dev)
    x2 = torch.randn(t2, h2, generator=g).to(torch.bfloat16).to(dev)
    w2 = torch.rand(t2, k, generator=g).to(dev)
    _, want = _dispatch(rb, x2, idx2, w2, e)
    n = int(want[4].rank_prefix_matrix[-1, rank])
    for victim in (0, world_size - 1):
        with case(f"rank {victim}'s pool full"):
            hog = []
            if rank == victim:
                hog = fill_pool(pool, (torch.cuda.current_stream(), kb.get_comm_stream()))
            missed = int(rank // nvl == victim // nvl)
            before = pool.stats()
            seen = _paths(kb)
            _, got = _dispatch(kb, x2, idx2, w2, e)
            try:
                seen = _took(kb, seen, direct=1, missed=missed)
            except AssertionError as exc:  # what the pool held: enough to tell a hog that left room from a kernel
                raise AssertionError(f"{exc}; pool before the call {before}, after {pool.stats()}; outputs in the "
                                     f"pool: {pool.contains(got[0])}, {len(hog)} hog blocks of "
                                     f"{sum(b.numel() for b in hog)} B") from None
            assert_equal(got[0][:n], want[0][:n], "recv_x (FIFO fallback)")
            assert_equal(got[1], want[1], "recv_topk_idx (FIFO fallback)")
            assert_equal(got[2], want[2], "recv_topk_weights (FIFO fallback)")
            assert_equal(got[4].recv_src_idx, want[4].recv_src_idx, "recv_src_idx (FIFO fallback)")
            if rank == victim:
                assert not pool.contains(got[0]), "the full pool's rank must have its outputs outside the pool"
            _check_fwd_rows(kb, got[4], "FIFO fallback" if missed else "direct beside a FIFO domain")
            if rank == victim:  # the call let the blocks of the latest one go (the backend keeps only its own):
                hog += fill_pool(pool, (torch.cuda.current_stream(), kb.get_comm_stream()))  # room again, taken
            cached = kb.dispatch(x2, handle=got[4])[0]
            _took(kb, seen, direct=1, missed=missed)
            assert_equal(cached[:n], want[0][:n], "cached recv_x (FIFO fallback)")
            del hog, got, cached
            torch.cuda.synchronize()
            dist.barrier()
            seen = _paths(kb)
            _, again = _dispatch(kb, x2, idx2, w2, e)  # room again everywhere: direct
            assert_equal(again[0][:n], want[0][:n], "recv_x (direct again)")
            assert pool.contains(again[0]), "with room again the outputs must be the pool's"
            _took(kb, seen, direct=1)
            del again

    with case("cuda graph capture + replay: missed on every rank (the graph's outputs are not pool blocks)"):
        seen = _paths(kb)
        check_graph_replay(kb, rb, rank, world_size, dev, 384, 2048, e, 6, 384 * world_size, combine_tol=two_hop_tol,
                           check_src_idx=False, after_replay=kb._kernels._check)
        _took(kb, seen, direct=4, missed=3)  # the eager warm-up direct, the 3 replays missed

    with case("num_worst_tokens overflow: rows past a destination's count dropped, then every rank raises"):
        check_worst_overflow(kb, dev, 384, 2048, e, combine_dropped=True)
        seen = _paths(kb)
        _, again = _dispatch(kb, x, idx, w, e)
        _took(kb, seen, direct=1)
        del again

    with case("100 calls back to back"):
        del want
        _, want = _dispatch(rb, x, idx, w, e)
        n = int(want[4].rank_prefix_matrix[-1, rank])
        handle = None
        seen = _paths(kb)
        for i in range(100):
            xi = x + i  # other data every call: a write that went missing or elsewhere leaves an earlier call's rows
            if i % 2 == 0:
                _, got = _dispatch(kb, xi, idx, w, e)
                handle, recv = got[4], got[0]
            else:
                recv = kb.dispatch(xi, handle=handle)[0]
            if i % 10 == 0 or i == 99:
                assert_equal(recv[:n], rb.dispatch(xi, handle=want[4])[0][:n], f"recv_x of call {i}")
        _took(kb, seen, direct=100)
    torch.cuda.synchronize()
    dist.barrier()
    kb.destroy()
    rb.destroy()


@pytest.mark.parametrize("world_size,nvl", WORLDS)
def test_direct_dispatch_matches_reference(world_size: int, nvl: int) -> None:
    run_distributed(_world_direct, world_size, backend="nccl", timeout=300.0, env=dist_helpers.nvl_env(nvl))


def _in_pool(pool, t: torch.Tensor) -> torch.Tensor:
    """A copy of t in this rank's peer pool (t itself when it has no elements: an input without rows counts as
    peer-mapped wherever it lies)."""
    if t.numel() == 0:
        return t
    out = pool.allocate(tuple(t.shape), t.dtype)
    out.copy_(t)
    assert pool.contains(out)
    return out


def _world_pull(rank: int, world_size: int) -> None:  # noqa: C901 (one world, many cases)
    from moe_dispatcher import Buffer
    dev = torch.device("cuda", torch.cuda.current_device())
    kb = make_buffer(hidden_bytes=MAX_COMBINE_ROW_BYTES, backend="kernels", explicitly_destroy=True,
                     num_pool_bytes=POOL_BYTES)
    rb = Buffer(backend="reference", explicitly_destroy=True)
    assert kb._kernels is not None and kb._kernels.name == "internode", kb._kernels_why
    pool = kb.peer_pool
    nvl = kb.topology.nvl_size
    g = torch.Generator().manual_seed(11 + rank)
    e, k = 8 * world_size, 8

    def combine_both(y, handle, w, bias, what: str, config=None):
        """The combine (Config `config`, None: the default) with inputs outside the pool (its domain missed: the FIFO
        kernel, unless no rank of the domain holds a row, as an input without rows counts as peer-mapped), then in
        the pool (pulled): the same bits. Returns the pulled outputs."""
        held = handle.rank_prefix_matrix[-1].cpu()  # rows each rank received (its combine input's rows)
        d = rank // nvl
        seen = _pulls(kb)
        ring = kb.combine(y.clone(), handle, topk_weights=None if w is None else w.clone(), bias=bias, config=config)
        seen = _pulled(kb, seen, 1, int(bool((held[d * nvl:(d + 1) * nvl] > 0).any())))
        yp, wp = _in_pool(pool, y), None if w is None else _in_pool(pool, w)
        pulled = kb.combine(yp, handle, topk_weights=wp, bias=bias, config=config)
        _pulled(kb, seen, 1, 0)
        assert_equal(pulled[0], ring[0], f"combined x, pulled vs FIFO ({what})")
        if w is not None:
            assert_equal(pulled[1], ring[1], f"combined weights, pulled vs FIFO ({what})")
        del yp, wp
        return pulled

    def check_combine(disp, disp_ref, dtype, with_w: bool, bias, what: str, config=None):
        """combine_both of the kernels' dispatch `disp` (its rows scaled, in `dtype`; its top-k weights if with_w),
        then against the reference's combine of `disp_ref` (the same routing and inputs): combined x within the two
        hops' rounding, weights within 1e-5."""
        y = (disp[0].float() * 0.5 + 0.25).to(dtype)
        got = combine_both(y, disp[4], disp[2] if with_w else None, bias, what, config=config)
        want = rb.combine((disp_ref[0].float() * 0.5 + 0.25).to(dtype), disp_ref[4],
                          topk_weights=disp_ref[2] if with_w else None, bias=bias)
        atol, rtol = two_hop_tol(dtype)
        torch.testing.assert_close(got[0].float(), want[0].float(), atol=atol * 4, rtol=rtol,
                                   msg=lambda m: f"{what}: combined x vs reference: {m}")
        if with_w:
            torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)

    for t, h, kind in [(512, 4096, "random"), (300, 7168, "skewed"), (77, 1024, "empty_last"), (129, 2048, "one_rank"),
                       (0 if rank == 1 else 64, 1024, "random"), (5, 512, "dense")]:
        idx = _routing(g, t, e, k, world_size, kind).to(dev)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
        w = torch.rand(t, k, generator=g).to(dev)
        _, out = _dispatch(kb, x, idx, w, e)
        _, ref = _dispatch(rb, x, idx, w, e)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for with_w in (False, True):
                for nbias in (0, 1, 2):
                    what = f"{kind}, T={t}, H={h}, {dtype}, weights={with_w}, biases={nbias}"
                    with case(what):
                        biases = [torch.randn(t, h, generator=g).to(dtype).to(dev) for _ in range(nbias)]
                        bias = None if nbias == 0 else (biases[0] if nbias == 1 else tuple(biases))
                        check_combine(out, ref, dtype, with_w, bias, what)
        del out, ref

    # One rank's input outside its pool (as when its pool is full): its domain misses, the other pulls.
    t, h = 1024, 7168
    idx = _routing(g, t, e, k, world_size, "dense").to(dev)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    w = torch.rand(t, k, generator=g).to(dev)
    _, out = _dispatch(kb, x, idx, w, e)
    seen = _pulls(kb)
    want = kb.combine(out[0].clone(), out[4], topk_weights=out[2].clone())
    seen = _pulled(kb, seen, 1, 1)
    for victim in (0, world_size - 1):
        with case(f"rank {victim}'s input outside its pool"):
            y = out[0].clone() if rank == victim else _in_pool(pool, out[0])
            yw = out[2].clone() if rank == victim else _in_pool(pool, out[2])
            got = kb.combine(y, out[4], topk_weights=yw)
            seen = _pulled(kb, seen, 1, int(rank // nvl == victim // nvl))
            assert_equal(got[0], want[0], "combined x (one domain FIFO)")
            assert_equal(got[1], want[1], "combined weights (one domain FIFO)")
            del y, yw, got

    # Along the handle of a dispatch whose domain took the FIFOs (rank 0's pool full then): fwd_rows is the FIFO
    # forwarder's, and the pull combine must read the same rows.
    with case("pull combine along a missed dispatch's handle"):
        hog = []
        if rank == 0:
            hog = fill_pool(pool, (torch.cuda.current_stream(), kb.get_comm_stream()))
        seen = _paths(kb)
        _, fifo = _dispatch(kb, x, idx, w, e)
        _took(kb, seen, direct=1, missed=int(rank // nvl == 0))
        del hog
        torch.cuda.synchronize()
        dist.barrier()
        combine_both(fifo[0].clone(), fifo[4], fifo[2].clone(), None, "along a missed dispatch's handle")
        del fifo

    # The forwarder laps the RDMA ring within one call: with 2 channels and the smallest ring a combine takes (64
    # slots), every (channel, remote source domain) carries far more partials than slots, so forwarder chunks wait
    # for the credit of slots whose older chunks the source has yet to consume (pull mode with mapped domains:
    # written in place into the source's ring, combine.cu forward_commit<kPullDirect>) and the tails lap the ring too.
    with case("pull combine lapping a 64-slot RDMA ring, 2 channels, T=4096"):
        slots, t3, h3 = 64, 4096, 2048
        few = dataclasses.replace(Buffer.get_dispatch_config(world_size), num_sms=4)
        small_ring = dataclasses.replace(Buffer.get_combine_config(world_size), num_sms=4,
                                         num_max_rdma_chunked_recv_tokens=slots)
        idx3 = _routing(g, t3, e, k, world_size, "dense").to(dev)
        x3 = torch.randn(t3, h3, generator=g).to(torch.bfloat16).to(dev)
        w3 = torch.rand(t3, k, generator=g).to(dev)
        _, lap = _dispatch(kb, x3, idx3, w3, e, config=few)
        _, lap_ref = _dispatch(rb, x3, idx3, w3, e)
        routing = lap[4].backend_state.routing
        assert routing[0] == few.num_channels, f"the handle's channels: {routing[0]}"
        served = (routing[2][:, 1:] - routing[2][:, :-1]).cpu()  # [D, C]: tokens forwarded here per domain, channel
        remote = torch.cat([served[:rank // nvl], served[rank // nvl + 1:]])
        assert int(remote.min()) > 4 * slots, f"tokens per (remote source domain, channel) here: {remote.tolist()}"
        for dtype, with_w in ((torch.bfloat16, True), (torch.float32, False)):
            check_combine(lap, lap_ref, dtype, with_w, None, f"lapping ring, {dtype}, weights={with_w}",
                          config=small_ring)
        del lap, lap_ref

    # Block 3c as a second source receiver (combine.cu, "second source receiver": on one host every remote source
    # domain is mapped, so no channel has a chunk to put). Its warps take receiver chunks only where a channel has more
    # than 15 chunks, i.e. more than 15 x 4 tokens (the chunk size's cap, kCombineChunkCap); some cases above do too.
    # T = 4096 over the default channels (about 340 tokens a channel, 86 chunks): chunks k with k mod 30 >= 15 are
    # block 3c's, the rest block 3c+2's, credited in order by one commit warp, and the bits must be FIFO mode's.
    with case("pull combine, block 3c as a second receiver, default channels, T=4096"):
        t4, h4 = 4096, 4096
        idx4 = _routing(g, t4, e, k, world_size, "random").to(dev)
        x4 = torch.randn(t4, h4, generator=g).to(torch.bfloat16).to(dev)
        w4 = torch.rand(t4, k, generator=g).to(dev)
        _, big = _dispatch(kb, x4, idx4, w4, e)
        _, big_ref = _dispatch(rb, x4, idx4, w4, e)
        channels = big[4].backend_state.routing[0]
        assert (t4 + channels - 1) // channels > 15 * 4, f"tokens per channel: {t4} over {channels} channels"
        for dtype, with_w, nbias in ((torch.bfloat16, True, 2), (torch.float32, False, 0)):
            biases = [torch.randn(t4, h4, generator=g).to(dtype).to(dev) for _ in range(nbias)]
            check_combine(big, big_ref, dtype, with_w, None if nbias == 0 else tuple(biases),
                          f"second receiver, {dtype}, weights={with_w}, biases={nbias}")
        del big, big_ref

    with case("100 calls back to back"):
        yp = _in_pool(pool, out[0])
        seen = _pulls(kb)
        for i in range(100):
            yp.copy_(out[0] + i)  # other data every call: a read of the wrong call's rows shows
            got = kb.combine(yp, out[4])[0]
            if i % 10 == 0 or i == 99:
                ring = kb.combine((out[0] + i).contiguous(), out[4])[0]
                assert_equal(got, ring, f"combined x of call {i}")
        _pulled(kb, seen, 100 + 11, 11)
    torch.cuda.synchronize()
    dist.barrier()
    kb.destroy()
    rb.destroy()


# 4 x 1: every domain one GPU, so a forwarder serves three remote source domains per channel: its chunk sequence
# spans domains and its commit warp publishes the tails of each in order (combine.cu forward_commit; on one host every
# domain is mapped, so the chunks are written in place, never staged).
@pytest.mark.parametrize("world_size,nvl", WORLDS)
def test_pull_combine_matches_fifo_combine(world_size: int, nvl: int) -> None:
    run_distributed(_world_pull, world_size, backend="nccl", timeout=300.0, env=dist_helpers.nvl_env(nvl))
