"""Shared pieces of the normal-mode GPU tests (test_intranode_gpu, test_internode_gpu, test_expert_major_gpu).

Routing and input builders, the case table of the intranode tests (which the internode tests extend), and the
checks of a kernels Buffer against a reference Buffer on the same group. Where the files differ on purpose (the
internode NVLink domains, tolerances, which checks each backend states) the difference is a parameter that each
caller spells out.
The checks also run with two reference Buffers under gloo (tests/kernels/test_normal_cases.py), so their logic runs on
CPU too: `dev` is where the inputs live, and CUDA synchronisation happens only on CUDA devices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from dist import assert_close, assert_equal, make_buffer

ROUTING_KINDS = ("random", "empty_last", "one_rank", "skewed", "dense")

# Combine tolerances (rtol, atol) of a combine dtype against the reference: one hop sums in float32 like the
# reference (equal within bf16 rounding); the two-hop (internode) sum rounds each domain's partial to the row
# dtype first.
Tolerance = Callable[[torch.dtype], Tuple[float, float]]


def one_hop_tol(dtype: torch.dtype) -> Tuple[float, float]:
    return (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)


def two_hop_tol(dtype: torch.dtype) -> Tuple[float, float]:
    return {torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 1e-2)}.get(dtype, (2e-2, 6e-2))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ routing
def routing(g: torch.Generator, t: int, num_experts: int, k: int, num_ranks: int, kind: str) -> torch.Tensor:
    """topk_idx [t, k] (CPU): 'random' (20% of slots -1), 'empty_last' (the last rank gets nothing),
    'one_rank' (every token goes to rank 0 only), 'skewed' (expert 0 of every rank is popular, rank 0 most of
    all; 20% of slots -1), 'dense' (no -1)."""
    if kind not in ROUTING_KINDS:
        raise ValueError(f"unknown routing kind {kind!r}")
    local = num_experts // num_ranks
    scores = torch.rand(t, num_experts, generator=g)
    if kind == "empty_last":
        scores[:, (num_ranks - 1) * local:] = -1
    if kind == "one_rank":
        scores[:, local:] = -1
    if kind == "skewed":
        scores[:, ::local] += 0.8
        scores[:, :local] += 0.5
    idx = scores.topk(k, dim=1).indices
    if kind in ("random", "empty_last", "skewed"):
        idx[torch.rand(t, k, generator=g) < 0.2] = -1
    return idx


def group_routing(g: torch.Generator, t: int, num_experts: int, k: int, num_ranks: int, nvl: int,
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


# ------------------------------------------------------------------------------------------------- inputs
@dataclass
class CaseInputs:
    """One rank's inputs of a case; `g` goes on to draw the later inputs (cached dispatch, combine)."""

    g: torch.Generator
    t: int
    h: int
    k: int
    num_experts: int
    idx: torch.Tensor
    w: Optional[torch.Tensor]
    x: torch.Tensor
    scales: Optional[torch.Tensor]  # FP8 cases: x is e4m3 and xin = (x, scales)
    xin: object


def case_inputs(c: Dict, seed: int, rank: int, num_ranks: int, dev: torch.device,
                nvl: Optional[int] = None) -> CaseInputs:
    """Case c's inputs on this rank: T from c["T"] (by rank), H, L local experts, K; routing c["kind"] (a
    'groupN' kind needs the NVLink domain size nvl); no top-k weights when c["weights"] is False; dtype
    c["dtype"] or an FP8 tuple with c["fp8"]."""
    t = c["T"][rank % len(c["T"])]
    h, local, k = c["H"], c["L"], c["K"]
    num_experts = local * num_ranks
    g = torch.Generator().manual_seed(seed * 100 + rank)
    kind = c.get("kind", "random")
    if kind.startswith("group"):
        assert nvl is not None, f"case {c['name']}: group-limited routing needs the NVLink domain size"
        idx = group_routing(g, t, num_experts, k, num_ranks, nvl, int(kind[5:])).to(dev)
    else:
        idx = routing(g, t, num_experts, k, num_ranks, kind).to(dev)
    w = torch.rand(t, k, generator=g).to(dev) if c.get("weights", True) else None
    scales = None
    if c.get("fp8"):
        x = (torch.randn(t, h, generator=g) * 50).to(torch.float8_e4m3fn).to(dev)
        scales = torch.rand(t, h // 128, generator=g).to(dev)
        xin = (x, scales)
    else:
        x = torch.randn(t, h, generator=g).to(c.get("dtype", torch.bfloat16)).to(dev)
        xin = x
    return CaseInputs(g, t, h, k, num_experts, idx, w, x, scales, xin)


def cached_input(inp: CaseInputs, dev: torch.device):
    """New data along the same routing for a cached dispatch: fresh rows, or the FP8 rows and scales reversed."""
    if inp.scales is None:
        return (torch.randn(inp.t, inp.h, generator=inp.g) * 3).to(inp.x.dtype).to(dev)
    return (inp.x.view(torch.uint8).flip(0).view(inp.x.dtype), inp.scales.flip(0))


def combine_dtype(c: Dict, inp: CaseInputs) -> torch.dtype:
    return c.get("combine_dtype", torch.bfloat16 if inp.scales is not None else inp.x.dtype)


def combine_inputs(c: Dict, inp: CaseInputs, rows: int, cdtype: torch.dtype, dev: torch.device):
    """(y [rows, H], bias): c["bias"] 1 gives one bias tensor, 2 a pair, else None."""
    g, t, h = inp.g, inp.t, inp.h
    y = torch.randn(rows, h, generator=g).to(cdtype).to(dev)
    bias = None
    if c.get("bias") == 1:
        bias = torch.randn(t, h, generator=g).to(cdtype).to(dev)
    elif c.get("bias") == 2:
        bias = (torch.randn(t, h, generator=g).to(cdtype).to(dev), torch.randn(t, h, generator=g).to(cdtype).to(dev))
    return y, bias


def worst_tokens(c: Dict, num_ranks: int) -> int:
    """num_worst_tokens of a case with c["worst"]: every token of every rank; else 0 (not used)."""
    return sum(c["T"][r % len(c["T"])] for r in range(num_ranks)) if c.get("worst") else 0


def dispatch(buf, x, idx, w, num_experts, align=1, num_worst=0, config=None):
    """get_dispatch_layout + dispatch through the Buffer: (layout, dispatch outputs)."""
    layout = buf.get_dispatch_layout(idx, num_experts)
    out = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                       num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w, expert_alignment=align,
                       num_worst_tokens=num_worst, config=config)
    return layout, out


def poison_allocator(dev: torch.device) -> None:
    """Fill 4 MiB of the caching allocator's blocks with 0xF9, so outputs that reuse them start as garbage."""
    junk = torch.empty(4 << 20, dtype=torch.uint8, device=dev)
    junk.fill_(0xF9)
    del junk


# Cases of the normal-mode tests: T per rank (cycled), H, L local experts per rank, K; optional kind (routing),
# align, bias (1 or 2 tensors), worst (num_worst_tokens), fp8, dtype, combine_dtype.
CASES: List[Dict] = [
    dict(name="random H2048", T=[300, 0, 129, 1], H=2048, L=8, K=6),
    dict(name="random H4096 align128 2 biases", T=[512, 511, 1, 64], H=4096, L=4, K=8, align=128, bias=2),
    dict(name="random H7168 bias", T=[1024, 700, 333, 0], H=7168, L=32, K=8, bias=1),
    dict(name="odd hidden 2056", T=[100, 57, 3, 9], H=2056, L=2, K=3),
    dict(name="empty last rank", T=[200, 150, 100, 50], H=2048, L=4, K=4, kind="empty_last"),
    dict(name="all tokens to rank 0", T=[300, 300, 300, 300], H=2048, L=8, K=4, kind="one_rank"),
    dict(name="T=0 everywhere", T=[0], H=2048, L=4, K=4),
    dict(name="T=1 everywhere, K=1", T=[1], H=7168, L=1, K=1, kind="dense"),
    dict(name="num_worst_tokens", T=[256, 77, 0, 300], H=2048, L=8, K=6, worst=True),
    dict(name="num_worst_tokens fp8", T=[64, 1, 200, 3], H=7168, L=8, K=8, worst=True, fp8=True),
    dict(name="fp8 tuple H7168", T=[500, 250, 0, 31], H=7168, L=16, K=8, fp8=True),
    dict(name="fp8 H2048", T=[200, 7, 64, 0], H=2048, L=4, K=6, fp8=True),  # 16 scales: a round of their own
    dict(name="float32 dispatch + combine", T=[100, 200, 3, 0], H=2048, L=4, K=4, dtype=torch.float32, bias=1),
    dict(name="float16 combine", T=[100, 20, 3, 7], H=1024, L=4, K=4, dtype=torch.float16, bias=2),
    dict(name="small rows H256", T=[300, 40, 0, 77], H=256, L=4, K=4),  # a quarter of a direct send stage
]

# Cases of group-limited routing (internode: tokens limited to some NVLink domains).
GROUP_CASES: List[Dict] = [
    dict(name="group-limited: 1 domain per token", T=[400, 100, 0, 33], H=4096, L=8, K=8, kind="group1"),
    dict(name="group-limited: 2 domains per token, bias", T=[256, 512, 7, 64], H=7168, L=8, K=8, kind="group2",
         bias=1),
    dict(name="group-limited: 2 domains, 2 biases, worst", T=[128, 3, 200, 1], H=2048, L=4, K=6, kind="group2",
         bias=2, worst=True),
]


# ------------------------------------------------------------------------------------------------- checks
def check_case(kb, rb, c: Dict, seed: int, stats: Dict, dev: torch.device, *, combine_tol: Tolerance,
               nvl: Optional[int] = None, poison: bool = False, rdma_layout: bool = False,
               expect_backend: Optional[str] = None, cached_returns_none: bool = False) -> None:
    """Case c through kb (checked) and rb (the reference): fresh dispatch, cached dispatch, combine.

    Dispatch outputs must be bit-identical; combine within combine_tol(dtype), and stats counts the bit-exact
    combines. The cached dispatch and the combine run twice on kb: the first call checks and makes the handle's
    plan (full path), the second takes the Buffer's fast path (one native call) and must give the same bits.
    poison: poison the allocator before the dispatches. rdma_layout: compare num_tokens_per_rdma_rank (several
    domains), else it must be None. expect_backend: the handle's backend. cached_returns_none: a cached
    dispatch returns None for idx, weights, list, handle.
    """
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    inp = case_inputs(c, seed, rank, num_ranks, dev, nvl)
    num_experts, scales = inp.num_experts, inp.scales
    num_worst = worst_tokens(c, num_ranks)
    align = c.get("align", 1)
    if poison:
        poison_allocator(dev)
    lk, ok = dispatch(kb, inp.xin, inp.idx, inp.w, num_experts, align, num_worst)
    lr, ro = dispatch(rb, inp.xin, inp.idx, inp.w, num_experts, align, num_worst)
    names = ((0, "num_tokens_per_rank"), (1, "num_tokens_per_rdma_rank"), (2, "num_tokens_per_expert"),
             (3, "is_token_in_rank"))
    for i, name in names:
        if i != 1 or rdma_layout:
            assert_equal(lk[i], lr[i], f"layout {name}")
    if not rdma_layout:
        assert lk[1] is None, "num_tokens_per_rdma_rank must be None for one domain"
    hk, hr = ok[4], ro[4]
    if expect_backend is not None:
        assert hk.backend == expect_backend, hk.backend
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

    # Cached dispatch of fresh data along the same routing.
    x2in = cached_input(inp, dev)
    cr = rb.dispatch(x2in, handle=hr)
    for call in ("first", "repeated"):
        ck = kb.dispatch(x2in, handle=hk)
        if scales is None:
            assert_equal(ck[0][:n], cr[0][:n], f"cached recv_x ({call} call)")
        else:
            assert_equal(ck[0][0][:n], cr[0][0][:n], f"cached recv_x (fp8, {call} call)")
            assert_equal(ck[0][1][:n], cr[0][1][:n], f"cached recv_x scales ({call} call)")
    if cached_returns_none:
        assert all(v is None for v in ck[1:5]), "cached dispatch returns None for idx, weights, list, handle"

    # Combine: rows of the combine dtype, top-k weights, optional bias.
    cdtype = combine_dtype(c, inp)
    y, bias = combine_inputs(c, inp, rk.shape[0], cdtype, dev)
    yk = kb.combine(y, hk, topk_weights=ok[2], bias=bias)
    yr = rb.combine(y, hr, topk_weights=ro[2], bias=bias)
    yo = kb.combine(y, hk, topk_weights=ok[2], bias=bias)  # the repeated call: the fast path (without a bias)
    assert_equal(yo[0], yk[0], "combined_x (repeated call)")
    if yk[1] is not None:
        assert_equal(yo[1], yk[1], "combined_topk_weights (repeated call)")
    stats["combine_total"] += 1
    stats["combine_bit_exact"] += int(torch.equal(yk[0], yr[0]) and torch.equal(yk[1], yr[1]))
    rtol, atol = combine_tol(cdtype)
    assert_close(yk[0], yr[0], "combined_x", rtol=rtol, atol=atol)
    assert_close(yk[1], yr[1], "combined_topk_weights", rtol=1e-5, atol=1e-5)


def check_graph_replay(kb, rb, rank: int, world_size: int, dev: torch.device, t: int, h: int, e: int, k: int,
                       worst: int, *, combine_tol: Tolerance, check_src_idx: bool,
                       after_replay: Optional[Callable[[], None]] = None) -> None:
    """layout + dispatch(num_worst_tokens) + combine captured in a CUDA graph once, replayed 3 times on new data,
    each replay against the reference. after_replay: called after each replay's synchronisation (e.g. to raise a
    kernel timeout before comparing outputs a timed-out replay left unwritten)."""
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    idx = routing(g, t, e, k, world_size, "random").to(dev)
    w = torch.rand(t, k, generator=g).to(dev)

    def step():
        _, out = dispatch(kb, x, idx, w, e, num_worst=worst)
        comb = kb.combine(out[0], out[4], topk_weights=out[2])
        return out, comb

    step()  # eager warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, comb = step()
    rtol, atol = combine_tol(torch.bfloat16)
    for it in range(3):
        x.copy_(torch.randn(t, h, generator=g).to(torch.bfloat16))
        idx.copy_(routing(g, t, e, k, world_size, "random"))
        w.copy_(torch.rand(t, k, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        if after_replay is not None:
            after_replay()
        _, want = dispatch(rb, x, idx, w, e, num_worst=worst)
        n = int(want[4].rank_prefix_matrix[-1, rank])
        assert_equal(out[4].rank_prefix_matrix, want[4].rank_prefix_matrix, f"replay {it}: prefix matrix")
        assert_equal(out[0][:n], want[0][:n], f"replay {it}: recv_x")
        assert_equal(out[1], want[1], f"replay {it}: recv_topk_idx")
        assert_equal(out[2], want[2], f"replay {it}: recv_topk_weights")
        if check_src_idx:
            assert_equal(out[4].recv_src_idx, want[4].recv_src_idx, f"replay {it}: recv_src_idx")
        want_comb = rb.combine(want[0], want[4], topk_weights=want[2])
        assert_close(comb[0], want_comb[0], f"replay {it}: combined_x", rtol=rtol, atol=atol)
        assert_close(comb[1], want_comb[1], f"replay {it}: combined weights", rtol=1e-5, atol=1e-5)
    del graph


def check_back_to_back(kb, rb, rank: int, dev: torch.device, t: int, h: int, e: int, k: int, *, rounds: int,
                       switch: Optional[Callable[[int], None]] = None,
                       after_loop: Optional[Callable[[], None]] = None) -> None:
    """`rounds` dispatch + combine round trips on fresh data, fresh and cached dispatch alternating, switch(i)
    (when given) called before round trip i. x holds small integers, so every combined row must be exactly
    x * (number of ranks the token went to): counted on the device, checked once after the loop (after
    after_loop()); the last round trip is also checked against the reference."""
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    handle = None
    for i in range(rounds):
        if switch is not None:
            switch(i)
        x = torch.randint(-8, 9, (t, h), device=dev).to(torch.bfloat16)
        if handle is None or i % 2 == 0:
            idx = torch.rand(t, e, device=dev).topk(k, dim=1).indices
            idx[torch.rand(t, k, device=dev) < 0.2] = -1
            _, out = dispatch(kb, x, idx, None, e)
            handle, recv_x = out[4], out[0]
        else:
            recv_x = kb.dispatch(x, handle=handle)[0]
        comb, _, _ = kb.combine(recv_x, handle)
        ranks = handle.is_token_in_rank.sum(1, dtype=torch.float32)[:, None]
        bad += (comb.float() != x.float() * ranks).sum()
    sync(dev)
    if after_loop is not None:
        after_loop()
    assert int(bad) == 0, f"{int(bad)} wrong combined values over {rounds} round trips"
    _, want = dispatch(rb, x, idx, None, e)
    want_recv = rb.dispatch(x, handle=want[4])[0]
    n = int(want[4].rank_prefix_matrix[-1, rank])
    assert_equal(recv_x[:n], want_recv[:n], "last round trip: recv_x")


def check_worst_overflow(kb, dev: torch.device, t: int, h: int, e: int, *, combine_dropped: bool) -> None:
    """More rows than num_worst_tokens (every token to expert 0 on rank 0, num_worst_tokens=1): no host sync at
    that call, so the extra rows are dropped and every rank raises at its next synchronised dispatch; the group
    keeps working afterwards. combine_dropped: also combine the truncated dispatch (the rows past
    num_worst_tokens are not sent back either)."""
    idx0 = torch.zeros(t, 1, dtype=torch.int64, device=dev)
    x0 = torch.randn(t, h, device=dev).to(torch.bfloat16)
    _, dropped = dispatch(kb, x0, idx0, None, e, num_worst=1)
    if combine_dropped:
        kb.combine(dropped[0], dropped[4])
    with pytest.raises(ValueError, match="num_worst_tokens"):
        dispatch(kb, x0, idx0, None, e)
    _, out = dispatch(kb, x0, idx0, None, e)
    assert_equal(kb.combine(out[0], out[4])[0], x0, "round trip after the overflow")


def timeout_inputs(rank: int, world_size: int, dev: torch.device):
    """(t, h, e, idx, x) of the timeout tests: 600 tokens, H=2048, 4 experts per rank, dense top-4 routing."""
    t, h, e = 600, 2048, 4 * world_size
    g = torch.Generator().manual_seed(rank)
    idx = routing(g, t, e, 4, world_size, "dense").to(dev)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    return t, h, e, idx, x


def check_dispatch_timeout(rank: int, idx: torch.Tensor, x: torch.Tensor, e: int, *, phase: str, waiting: str,
                           stays_unusable: bool) -> None:
    """Rank 1 skips a dispatch: every other rank's dispatch raises a timeout naming the rank, `phase` and
    `waiting`; with stays_unusable the Buffer keeps raising afterwards. A fresh kernels Buffer, destroyed after
    a barrier."""
    kb = make_buffer(hidden_bytes=x.shape[1] * 2, backend="kernels", explicitly_destroy=True)
    layout = kb.get_dispatch_layout(idx, e)
    if rank != 1:
        with pytest.raises(RuntimeError) as err:
            kb.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                        num_tokens_per_expert=layout[2], topk_idx=idx)
        msg = str(err.value)
        assert f"rank {rank} timed out" in msg and phase in msg and waiting in msg, msg
        if stays_unusable:
            with pytest.raises(RuntimeError, match="timed out"):  # the Buffer stays unusable
                kb.get_dispatch_layout(idx, e)
    torch.cuda.synchronize()
    dist.barrier()
    kb.destroy()
