"""Internode (two-hop: NVSHMEM across domains, NVLink inside) kernels against the reference backend.

Parametrised by (world size, NVLink domain size): 4 GPUs as 2 emulated domains of 2 and as 4 domains of 1
(MOE_DISPATCHER_NVL_SIZE), 8 GPUs as 2 x 4 and 4 x 2 when present. Each world holds a kernels Buffer (which
must pick the internode backend) and a reference Buffer on the same group; outputs are poisoned first.
Dispatch must be bit-identical; combine equal within bf16 rounding (the two-hop sum rounds each domain's
partial to the row dtype; docs/internode.md), and bit-exact on integer data.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
import dist as dist_helpers
from dist import assert_close, assert_equal, case, make_buffer, run_distributed
from test_intranode_gpu import CASES as INTRANODE_CASES
from test_intranode_gpu import _dispatch, _routing

pytestmark = pytest.mark.gpu
MAX_HIDDEN_BYTES = 7168 * 2
WORLDS = [pytest.param(4, 2, id="4-nvl2"), pytest.param(4, 1, id="4-nvl1"),
          pytest.param(8, 4, id="8-nvl4"), pytest.param(8, 2, id="8-nvl2")]


def _group_routing(g: torch.Generator, t: int, num_experts: int, k: int, num_ranks: int, nvl: int,
                   max_domains: int) -> torch.Tensor:
    """Group-limited routing: each token picks at most `max_domains` domains, then its top-k inside them."""
    num_domains = num_ranks // nvl
    per_domain = num_experts // num_domains
    scores = torch.rand(t, num_experts, generator=g)
    keep = torch.rand(t, num_domains, generator=g).topk(min(max_domains, num_domains), dim=1).indices
    allowed = torch.zeros(t, num_domains, dtype=torch.bool).scatter_(1, keep, True)
    scores[~allowed.repeat_interleave(per_domain, dim=1)] = -1
    idx = scores.topk(k, dim=1).indices
    idx[torch.rand(t, k, generator=g) < 0.1] = -1
    return idx


def _buffers():
    from moe_dispatcher import Buffer
    kernels = make_buffer(hidden_bytes=MAX_HIDDEN_BYTES, backend="kernels", explicitly_destroy=True)
    assert kernels._kernels is not None and kernels._kernels.name == "internode", kernels._kernels_why
    reference = Buffer(backend="reference", explicitly_destroy=True)
    return kernels, reference


def _poison(*tensors) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t.view(torch.uint8).fill_(0xA5) if t.is_floating_point() else t.fill_(-7)


def _check_case(kb, rb, c: Dict, seed: int, stats: Dict) -> None:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    nvl = kb.topology.nvl_size
    dev = torch.device("cuda", torch.cuda.current_device())
    t = c["T"][rank % len(c["T"])]
    h, local, k = c["H"], c["L"], c["K"]
    num_experts = local * num_ranks
    g = torch.Generator().manual_seed(seed * 100 + rank)
    kind = c.get("kind", "random")
    if kind.startswith("group"):
        idx = _group_routing(g, t, num_experts, k, num_ranks, nvl, int(kind[5:])).to(dev)
    else:
        idx = _routing(g, t, num_experts, k, num_ranks, kind).to(dev)
    w = torch.rand(t, k, generator=g).to(dev)
    dtype = c.get("dtype", torch.bfloat16)
    scales = None
    if c.get("fp8"):
        x = (torch.randn(t, h, generator=g) * 50).to(torch.float8_e4m3fn).to(dev)
        scales = torch.rand(t, h // 128, generator=g).to(dev)
        xin = (x, scales)
    else:
        x = torch.randn(t, h, generator=g).to(dtype).to(dev)
        xin = x
    num_worst = sum(c["T"][r % len(c["T"])] for r in range(num_ranks)) if c.get("worst") else 0
    align = c.get("align", 1)
    # Poison the caching allocator's blocks the outputs will reuse.
    junk = torch.empty(4 << 20, dtype=torch.uint8, device=dev)
    _poison(junk)
    del junk
    lk, ok = _dispatch(kb, xin, idx, w, num_experts, align, num_worst)
    lr, ro = _dispatch(rb, xin, idx, w, num_experts, align, num_worst)
    for i, name in ((0, "num_tokens_per_rank"), (1, "num_tokens_per_rdma_rank"), (2, "num_tokens_per_expert"),
                    (3, "is_token_in_rank")):
        assert_equal(lk[i], lr[i], f"layout {name}")
    hk, hr = ok[4], ro[4]
    assert hk.backend == "internode", hk.backend
    n = int(hr.rank_prefix_matrix[-1, rank])
    assert_equal(hk.rank_prefix_matrix, hr.rank_prefix_matrix, "rank_prefix_matrix")
    assert_equal(hk.recv_src_idx, hr.recv_src_idx, "recv_src_idx")
    rk, rr = (ok[0][0], ro[0][0]) if scales is not None else (ok[0], ro[0])
    assert_equal(rk.shape, rr.shape, "recv_x shape")
    assert_equal(rk[:n], rr[:n], "recv_x")
    if scales is not None:
        assert_equal(ok[0][1][:n], ro[0][1][:n], "recv_x scales")
    assert_equal(ok[1], ro[1], "recv_topk_idx")
    assert_equal(ok[2], ro[2], "recv_topk_weights")
    assert_equal(ok[3], ro[3], "num_recv_tokens_per_expert_list")
    if not num_worst:
        assert_equal(hk.num_recv_tokens, hr.num_recv_tokens, "num_recv_tokens")

    x2 = ((torch.randn(t, h, generator=g) * 3).to(x.dtype).to(dev) if scales is None
          else x.view(torch.uint8).flip(0).view(x.dtype))
    x2in = x2 if scales is None else (x2, scales.flip(0))
    ck, cr = kb.dispatch(x2in, handle=hk), rb.dispatch(x2in, handle=hr)
    if scales is None:
        assert_equal(ck[0][:n], cr[0][:n], "cached recv_x")
    else:
        assert_equal(ck[0][0][:n], cr[0][0][:n], "cached recv_x (fp8)")
        assert_equal(ck[0][1][:n], cr[0][1][:n], "cached recv_x scales")

    cdtype = c.get("combine_dtype", torch.bfloat16 if scales is not None else x.dtype)
    y = torch.randn(rk.shape[0], h, generator=g).to(cdtype).to(dev)
    bias = None
    if c.get("bias") == 1:
        bias = torch.randn(t, h, generator=g).to(cdtype).to(dev)
    elif c.get("bias") == 2:
        bias = (torch.randn(t, h, generator=g).to(cdtype).to(dev), torch.randn(t, h, generator=g).to(cdtype).to(dev))
    yk = kb.combine(y, hk, topk_weights=ok[2], bias=bias)
    yr = rb.combine(y, hr, topk_weights=ro[2], bias=bias)
    # Other warp-chunk sizes (1 token; 32, the bound of the progress argument) sum in the same order: the
    # same bits as the default chunk.
    backend = kb._kernels
    first = backend.combine_chunk
    try:
        for chunk in (1, 32):
            backend.combine_chunk = chunk
            yo = kb.combine(y, hk, topk_weights=ok[2], bias=bias)
            assert_equal(yo[0], yk[0], f"combined_x: chunk {chunk} vs chunk {first}")
            if yk[1] is not None:
                assert_equal(yo[1], yk[1], f"combined_topk_weights: chunk {chunk} vs chunk {first}")
    finally:
        backend.combine_chunk = first
    stats["combine_total"] += 1
    stats["combine_bit_exact"] += int(torch.equal(yk[0], yr[0]) and torch.equal(yk[1], yr[1]))
    tol = {torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 1e-2)}.get(cdtype, (2e-2, 6e-2))
    assert_close(yk[0], yr[0], "combined_x", rtol=tol[0], atol=tol[1])
    assert_close(yk[1], yr[1], "combined_topk_weights", rtol=1e-5, atol=1e-5)


CASES: List[Dict] = list(INTRANODE_CASES) + [
    dict(name="group-limited: 1 domain per token", T=[400, 100, 0, 33], H=4096, L=8, K=8, kind="group1"),
    dict(name="group-limited: 2 domains per token, bias", T=[256, 512, 7, 64], H=7168, L=8, K=8, kind="group2",
         bias=1),
    dict(name="group-limited: 2 domains, 2 biases, worst", T=[128, 3, 200, 1], H=2048, L=4, K=6, kind="group2",
         bias=2, worst=True),
]


def _world_matches_reference(rank: int, world_size: int) -> Dict:
    kb, rb = _buffers()
    stats = {"combine_total": 0, "combine_bit_exact": 0}
    for i, c in enumerate(CASES):
        with case(c["name"]):
            _check_case(kb, rb, c, i, stats)
    from moe_dispatcher import Config
    with case("config num_sms=8 chunks 4 rings 64"):
        dev = torch.device("cuda", torch.cuda.current_device())
        g = torch.Generator().manual_seed(77 + rank)
        t, h, e = 333, 2048, 8 * world_size
        idx = _routing(g, t, e, 4, world_size, "random").to(dev)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
        cfg = Config(8, 4, 64, 4, 64)
        backend = kb._kernels
        layout = backend.get_dispatch_layout(idx, e)
        got = backend.dispatch(x, None, idx, None, layout[0], layout[3], layout[2], 1, 0, config=cfg)
        _, want = _dispatch(rb, x, idx, None, e)
        n = int(want[4].rank_prefix_matrix[-1, rank])
        assert_equal(got[0][:n], want[0][:n], "recv_x with Config(8, 4, 64, 4, 64)")
        yk, _ = backend.combine(got[0], got[5], None, (), config=cfg)
        yr = rb.combine(want[0], want[4])[0]
        assert_close(yk, yr, "combine with Config(8, 4, 64, 4, 64)", rtol=2e-2, atol=6e-2)
        # Extreme and odd warp-chunk sizes (1 token; 3, not dividing the 32-token scans; 32 = 2 chunks fill
        # the 64-slot RDMA ring, the bound of the progress argument): the same bits as the default chunk.
        first_chunk = backend.combine_chunk
        try:
            for chunk in (1, 3, 32):
                backend.combine_chunk = chunk
                yc, _ = backend.combine(got[0], got[5], None, (), config=cfg)
                assert_equal(yc, yk, f"combine chunk={chunk} with Config(8, 4, 64, 4, 64)")
        finally:
            backend.combine_chunk = first_chunk
    torch.cuda.synchronize()
    kb.destroy()
    rb.destroy()
    return stats


@pytest.mark.parametrize("world_size,nvl", WORLDS)
def test_matches_reference(world_size: int, nvl: int) -> None:
    stats = run_distributed(_world_matches_reference, world_size, backend="nccl", env=dist_helpers.nvl_env(nvl))
    exact = sum(s["combine_bit_exact"] for s in stats)
    total = sum(s["combine_total"] for s in stats)
    print(f"\n[internode R={world_size} nvl={nvl}] combine bit-exact vs reference: {exact}/{total} (rank, case) pairs")


def _world_graph_and_back_to_back(rank: int, world_size: int) -> None:
    kb, rb = _buffers()
    dev = torch.device("cuda", torch.cuda.current_device())
    t, h, local, k = 384, 2048, 8, 6
    e = local * world_size
    worst = t * world_size

    with case("cuda graph capture + replay (num_worst_tokens)"):
        g = torch.Generator().manual_seed(5 + rank)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
        idx = _routing(g, t, e, k, world_size, "random").to(dev)
        w = torch.rand(t, k, generator=g).to(dev)

        def step():
            _, out = _dispatch(kb, x, idx, w, e, num_worst=worst)
            comb = kb.combine(out[0], out[4], topk_weights=out[2])
            return out, comb

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, comb = step()
        for it in range(3):
            x.copy_(torch.randn(t, h, generator=g).to(torch.bfloat16))
            idx.copy_(_routing(g, t, e, k, world_size, "random"))
            w.copy_(torch.rand(t, k, generator=g))
            graph.replay()
            torch.cuda.synchronize()
            kb._kernels._check()  # a replay that timed out leaves outputs unwritten: name the timeout instead
            _, want = _dispatch(rb, x, idx, w, e, num_worst=worst)
            n = int(want[4].rank_prefix_matrix[-1, rank])
            assert_equal(out[4].rank_prefix_matrix, want[4].rank_prefix_matrix, f"replay {it}: prefix matrix")
            assert_equal(out[0][:n], want[0][:n], f"replay {it}: recv_x")
            assert_equal(out[1], want[1], f"replay {it}: recv_topk_idx")
            assert_equal(out[2], want[2], f"replay {it}: recv_topk_weights")
            want_comb = rb.combine(want[0], want[4], topk_weights=want[2])
            assert_close(comb[0], want_comb[0], f"replay {it}: combined_x", rtol=2e-2, atol=6e-2)
            assert_close(comb[1], want_comb[1], f"replay {it}: combined weights", rtol=1e-5, atol=1e-5)
        del graph

    with case("1000 back-to-back dispatch+combine (combine chunk size switched every 3 calls)"):
        bad = torch.zeros((), dtype=torch.int64, device=dev)
        handle = None
        backend, first = kb._kernels, kb._kernels.combine_chunk
        for i in range(1000):
            backend.combine_chunk = (first, 1, 32)[(i // 3) % 3]
            x = torch.randint(-8, 9, (t, h), device=dev).to(torch.bfloat16)
            if handle is None or i % 2 == 0:
                idx = torch.rand(t, e, device=dev).topk(k, dim=1).indices
                idx[torch.rand(t, k, device=dev) < 0.2] = -1
                _, out = _dispatch(kb, x, idx, None, e)
                handle, recv_x = out[4], out[0]
            else:
                recv_x = kb.dispatch(x, handle=handle)[0]
            comb, _, _ = kb.combine(recv_x, handle)
            ranks = handle.is_token_in_rank.sum(1, dtype=torch.float32)[:, None]
            bad += (comb.float() != x.float() * ranks).sum()
        torch.cuda.synchronize()
        backend.combine_chunk = first
        kb._kernels._check()
        assert int(bad) == 0, f"{int(bad)} wrong combined values over 1000 round trips"
        _, want = _dispatch(rb, x, idx, None, e)
        want_recv = rb.dispatch(x, handle=want[4])[0]
        n = int(want[4].rank_prefix_matrix[-1, rank])
        assert_equal(recv_x[:n], want_recv[:n], "last round trip: recv_x")

    with case("num_worst_tokens overflow"):
        idx0 = torch.zeros(t, 1, dtype=torch.int64, device=dev)
        x0 = torch.randn(t, h, device=dev).to(torch.bfloat16)
        _dispatch(kb, x0, idx0, None, e, num_worst=1)
        with pytest.raises(ValueError, match="num_worst_tokens"):
            _dispatch(kb, x0, idx0, None, e)
        _, out = _dispatch(kb, x0, idx0, None, e)
        assert_equal(kb.combine(out[0], out[4])[0], x0, "round trip after the overflow")
    torch.cuda.synchronize()
    kb.destroy()
    rb.destroy()


@pytest.mark.parametrize("world_size,nvl", WORLDS)
def test_graph_and_back_to_back(world_size: int, nvl: int) -> None:
    run_distributed(_world_graph_and_back_to_back, world_size, backend="nccl", env=dist_helpers.nvl_env(nvl))


def _world_timeout(rank: int, world_size: int) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    t, h, e = 600, 2048, 4 * world_size
    g = torch.Generator().manual_seed(rank)
    idx = _routing(g, t, e, 4, world_size, "dense").to(dev)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    with case("rank 1 skips a dispatch"):
        kb = make_buffer(hidden_bytes=h * 2, backend="kernels", explicitly_destroy=True)
        layout = kb.get_dispatch_layout(idx, e)
        if rank != 1:
            with pytest.raises(RuntimeError) as err:
                kb.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                            num_tokens_per_expert=layout[2], topk_idx=idx)
            msg = str(err.value)
            assert f"rank {rank} timed out" in msg and "internode notify" in msg and "waiting for rank" in msg, msg
        torch.cuda.synchronize()
        dist.barrier()
        kb.destroy()


@pytest.mark.parametrize("world_size,nvl", WORLDS[:2])
def test_timeout_names_rank_and_phase(world_size: int, nvl: int) -> None:
    env = {"MOE_DISPATCHER_TIMEOUT_S": "2", **dist_helpers.nvl_env(nvl)}
    run_distributed(_world_timeout, world_size, backend="nccl", env=env)
