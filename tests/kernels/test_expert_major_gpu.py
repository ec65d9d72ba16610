"""The expert-major dispatch/combine of the compiled intranode kernels (rank-major kernels + the em_permute /
em_unpermute passes) against the composition they replace (docs/semantics.md, "Expert-major"), on real GPUs.

Two references per case:
- the same compiled backend's rank-major dispatch + permute() / unpermute() + rank-major combine (the
  composition): everything must be bit-identical, combine included (same float32 sums, same order);
- the reference Buffer (torch.distributed): dispatch outputs bit-identical, combine within rounding.
Outputs are allocated from memory poisoned with 0xFF first, so a row the kernels forget shows up.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

import dist as tdist
from dist import assert_close, assert_equal, case, make_buffer, run_distributed
from normal_cases import cached_input, case_inputs, combine_dtype
from normal_cases import routing as _routing

pytestmark = pytest.mark.gpu
MAX_HIDDEN_BYTES = 7168 * 2


def _poison() -> None:
    """Fill freed allocator blocks with 0xFF so torch.empty outputs start as garbage (NaN for floats)."""
    blocks = [torch.full((n,), 255, dtype=torch.uint8, device="cuda") for n in (1 << 16, 1 << 20, 1 << 24, 1 << 27)]
    del blocks


def _compose(backend, xin, idx, w, num_experts, align, worst):
    from moe_dispatcher.expert_major import compose_expert_major_dispatch
    data, scales = (xin if isinstance(xin, tuple) else (xin, None))
    local = num_experts // dist.get_world_size()
    return compose_expert_major_dispatch(backend, data, scales, idx, w, num_experts, local, align, worst)


def _took(kb, before, want: tuple):
    """With a peer pool: assert which kernels moved the calls since `before` ((direct dispatches, of them missed,
    pull combines, of them missed), IpcBuffer.path_counters()); -> the counters now. Without a pool: None."""
    if before is None:
        return None
    now = kb._kernels._ipc.path_counters()
    got = tuple(a - b for a, b in zip(now, before))
    assert got == want, f"(direct, missed, pulls, pulls missed) since the last check: {got}, expected {want}"
    return now


def _check_case(kb, rb, c: Dict, seed: int, pool: bool) -> None:
    from moe_dispatcher.expert_major import unpermute
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    inp = case_inputs(c, seed, rank, num_ranks, dev)
    g, t, h, e, idx, w, scales, xin = inp.g, inp.t, inp.h, inp.num_experts, inp.idx, inp.w, inp.scales, inp.xin
    align = c.get("align", 1)
    worst = c.get("worst", 0)
    backend = kb._kernels

    _poison()
    seen = kb._kernels._ipc.path_counters() if pool else None
    px, pw, counts, tpe, hk, _ = kb.expert_major_dispatch(xin, topk_idx=idx, topk_weights=w, num_experts=e,
                                                          expert_alignment=align, num_worst_tokens=worst)
    _took(kb, seen, (1, 0, 0, 0))  # with a pool the exchange went direct
    assert hk.backend_state is not None, "the compiled backend must serve this case with its fused kernels"
    cx, cs, cw, ctpe, ccounts, ch = _compose(backend, xin, idx, w, e, align, worst)
    rx, rw, rcounts, rtpe, rh, _ = rb.expert_major_dispatch(xin, topk_idx=idx, topk_weights=w, num_experts=e,
                                                            expert_alignment=align, num_worst_tokens=worst)
    pdata, pscales = (px if scales is not None else (px, None))
    rdata = rx[0] if scales is not None else rx
    for what, want in (("composition", cx), ("reference", rdata)):
        assert_equal(pdata.shape, want.shape, f"permuted_x shape vs {what}")
        assert_equal(pdata.view(torch.uint8), want.view(torch.uint8), f"permuted_x vs {what}", bitwise=True)
    if scales is not None:
        assert_equal(pscales, cs, "permuted scales vs composition", bitwise=True)
        assert_equal(pscales, rx[1], "permuted scales vs reference", bitwise=True)
    if w is not None:
        assert_equal(pw, cw, "permuted_weights vs composition", bitwise=True)
        assert_equal(pw, rw, "permuted_weights vs reference", bitwise=True)
    else:
        assert pw is None
    assert_equal(tpe, ctpe, "tokens_per_expert")
    assert_equal(counts, ccounts, "tokens_per_expert list")
    assert_equal(counts, rcounts, "tokens_per_expert list vs reference")
    assert_equal(hk.pair_row, ch.pair_row, "pair_row")
    assert_equal(hk.pair_slot, ch.pair_slot, "pair_slot")
    assert_equal(hk.dispatch.recv_src_idx, ch.dispatch.recv_src_idx, "recv_src_idx")
    assert int(hk.rows_needed) == int(ch.rows_needed), (int(hk.rows_needed), int(ch.rows_needed))

    # Cached dispatch of new data along the handle.
    x2in = cached_input(inp, dev)
    _poison()
    seen = kb._kernels._ipc.path_counters() if pool else None
    got = kb.expert_major_dispatch(x2in, handle=hk)[0]
    _took(kb, seen, (1, 0, 0, 0))
    want = rb.expert_major_dispatch(x2in, handle=rh)[0]
    if scales is None:
        assert_equal(got.view(torch.uint8), want.view(torch.uint8), "cached permuted_x", bitwise=True)
    else:
        assert_equal(got[0].view(torch.uint8), want[0].view(torch.uint8), "cached permuted_x (fp8)", bitwise=True)
        assert_equal(got[1], want[1], "cached permuted scales", bitwise=True)

    # Combine: plain, weighted, with topk_weights and bias.
    cdtype = combine_dtype(c, inp)
    m = hk.pair_row.numel()
    y = torch.randn(m, h, generator=g).to(cdtype).to(dev)
    y[hk.pair_row < 0] = float("nan")  # padding rows are never read
    weights = torch.rand(m, generator=g).to(dev)
    topk_w = torch.rand(m, generator=g).to(dev)
    bias = torch.randn(t, h, generator=g).to(cdtype).to(dev) if c.get("bias") else None
    for label, kw in (("plain", {}), ("weighted", dict(weights=weights)),
                      ("topk_weights + bias", dict(topk_weights=topk_w, bias=bias)),
                      ("weighted + topk_weights", dict(weights=weights, topk_weights=topk_w))):
        _poison()
        seen = kb._kernels._ipc.path_counters() if pool else None
        yk, wk, _ = kb.expert_major_combine(y, hk, **kw)
        _took(kb, seen, (0, 0, 1, 0))  # with a pool em_unpermute's rows lie in it: pulled
        rows, w_rows = unpermute(y, ch, kw.get("weights"), kw.get("topk_weights"))
        biases = [] if kw.get("bias") is None else [kw["bias"]]
        yc, wc = backend.combine(rows, ch.dispatch, w_rows, biases)
        assert_equal(yk.view(torch.uint8) if yk.dtype != torch.float32 else yk.view(torch.int32),
                     yc.view(torch.uint8) if yc.dtype != torch.float32 else yc.view(torch.int32),
                     f"combine {label} vs composition", bitwise=True)
        if wk is not None or wc is not None:
            assert_equal(wk, wc, f"combined topk_weights {label} vs composition", bitwise=True)
        yr, wr, _ = rb.expert_major_combine(y, rh, **kw)
        tol = 1e-2 if cdtype != torch.float32 else 1e-5
        assert_close(yk, yr, f"combine {label} vs reference", rtol=tol, atol=tol)
        if wk is not None:
            assert_close(wk, wr, f"combined topk_weights {label} vs reference", rtol=1e-5, atol=1e-6)


CASES: List[Dict] = [
    dict(name="random H7168 K8 L32", T=[512, 300, 1, 64], H=7168, L=32, K=8),
    dict(name="random H2048 align16 bias", T=[300, 0, 129, 1], H=2048, L=8, K=6, align=16, bias=True),
    dict(name="skewed H4096", T=[400, 400, 400, 400], H=4096, L=16, K=8, kind="skewed"),
    dict(name="empty last rank, no weights", T=[200, 150, 100, 50], H=2048, L=4, K=4, kind="empty_last",
         weights=False),
    dict(name="T=0 everywhere", T=[0], H=2048, L=4, K=4),
    dict(name="T=1 everywhere K1", T=[1], H=256, L=1, K=1, kind="dense"),
    dict(name="num_worst_tokens", T=[256, 77, 0, 300], H=2048, L=8, K=6, worst=8192),
    dict(name="num_worst_tokens align16", T=[256, 77, 0, 300], H=1024, L=8, K=8, worst=8192, align=16),
    dict(name="fp8 H7168 align16", T=[500, 250, 0, 31], H=7168, L=16, K=8, fp8=True, align=16),
    dict(name="fp8 num_worst_tokens", T=[64, 1, 200, 3], H=7168, L=8, K=8, worst=4096, fp8=True),
    dict(name="float32", T=[100, 200, 3, 0], H=512, L=4, K=4, dtype=torch.float32, bias=True),
    dict(name="float16 odd hidden", T=[100, 20, 3, 7], H=2056, L=4, K=3, dtype=torch.float16),
    dict(name="many local experts", T=[300, 200, 100, 0], H=256, L=256, K=8),
]


def _world_fused_matches(rank: int, world_size: int, pool: bool) -> None:
    from moe_dispatcher import Buffer
    kb = make_buffer(hidden_bytes=MAX_HIDDEN_BYTES, backend="kernels", explicitly_destroy=True,
                     num_pool_bytes=(1 << 30) if pool else 0)
    rb = Buffer(backend="reference", explicitly_destroy=True)
    _check_cases(kb, rb, rank, world_size, pool)
    kb.destroy()
    rb.destroy()


def _check_cases(kb, rb, rank: int, world_size: int, pool: bool = False) -> None:
    """Every case, then the overflow and the CUDA graph checks."""
    for i, c in enumerate(CASES):
        with case(c["name"]):
            _check_case(kb, rb, c, i, pool)
    torch.cuda.synchronize()

    # ---- Overflow: num_worst_tokens below what arrives; reported on every rank at the next synchronised call.
    with case("num_worst_tokens overflow"):
        dev = torch.device("cuda", torch.cuda.current_device())
        xo = torch.randn(64, 256, device=dev).bfloat16()
        io = torch.tensor([[0, 1]] * 64, device=dev)
        # Rank 0 receives 64 R rows (= W) holding 128 R pairs (> W): the pairs past W are dropped.
        kb.expert_major_dispatch(xo, topk_idx=io, num_experts=2 * world_size, num_worst_tokens=64 * world_size)
        with pytest.raises(ValueError, match="num_worst_tokens"):
            kb.expert_major_dispatch(xo, topk_idx=io, num_experts=2 * world_size)
        px, _, _, _, h, _ = kb.expert_major_dispatch(xo, topk_idx=io, num_experts=2 * world_size)
        y, _, _ = kb.expert_major_combine(px, h)
        assert_close(y.float(), 2 * xo.float(), "round trip after the overflow", rtol=1e-2, atol=1e-2)

    # ---- CUDA graph: expert-major dispatch (num_worst_tokens) + combine + cached dispatch, replayed.
    with case("cuda graph capture + replay (expert-major, num_worst_tokens)"):
        dev = torch.device("cuda", torch.cuda.current_device())
        t, h, local, k = 384, 2048, 8, 6
        e, worst = local * world_size, 384 * world_size * 6
        g = torch.Generator().manual_seed(5 + rank)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
        idx = _routing(g, t, e, k, world_size, "random").to(dev)
        w = torch.rand(t, k, generator=g).to(dev)

        def step():
            px, pw, _, tpe, hh, _ = kb.expert_major_dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e,
                                                             expert_alignment=16, num_worst_tokens=worst)
            y, yw, _ = kb.expert_major_combine(px, hh, weights=pw, topk_weights=pw)
            back = kb.expert_major_dispatch(y, handle=hh)[0]
            return px, pw, tpe, y, yw, back

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        for it in range(3):
            x.copy_(torch.randn(t, h, generator=g).to(torch.bfloat16))
            idx.copy_(_routing(g, t, e, k, world_size, "random"))
            w.copy_(torch.rand(t, k, generator=g))
            graph.replay()
            torch.cuda.synchronize()
            want = step()
            torch.cuda.synchronize()
            for name, a, b in zip(("permuted_x", "permuted_weights", "tokens_per_expert", "combined", "combined_w",
                                   "cached"), outs, want):
                assert_equal(a, b, f"replay {it}: {name}", bitwise=True)
        del graph
    torch.cuda.synchronize()


@pytest.mark.parametrize("pool", [False, True], ids=["ring", "peer-pool"])
@pytest.mark.parametrize("world_size", tdist.GPU_WORLD_SIZES)
def test_fused_expert_major_matches(world_size: int, pool: bool) -> None:
    """pool: Buffer(num_pool_bytes=1 GiB): the rank-major part of expert-major dispatch by the direct kernel, and
    em_unpermute's rows in the pool, so that the combine pulls (the same bits as the ring kernels')."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    run_distributed(_world_fused_matches, world_size, pool, backend="nccl", timeout=300)
