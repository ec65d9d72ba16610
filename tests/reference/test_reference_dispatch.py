"""Normal-mode dispatch and combine on real ranks, checked against the single-process oracle.

One spawned world per (test, backend, world size); the cases loop inside the ranks. Every rank generates
every rank's inputs from the same seeds, so each can compute the oracle for itself.
"""
from __future__ import annotations

import os

import oracle
import pytest
import torch
import torch.distributed as dist
from dist import (
    BACKENDS,
    NVL_ENV,
    WORLDS,
    assert_equal,
    case,
    device,
    make_buffer,
    nvl_env,
    per_rank,
    run_distributed,
)

# Cases are written for 4 ranks; `per_rank` cycles the token counts for 2. E is per rank (L local experts).
DISPATCH_CASES: list[dict] = [
    {"name": "random", "T": [37, 0, 64, 1], "H": 128, "L": 4, "K": 4, "kind": "random", "dtype": torch.bfloat16},
    {"name": "dense-f32", "T": [20, 33, 1, 7], "H": 64, "L": 3, "K": 6, "kind": "dense", "dtype": torch.float32},
    {"name": "T=1,L=1,K=1", "T": [1, 1, 1, 1], "H": 256, "L": 1, "K": 1, "kind": "dense", "dtype": torch.bfloat16},
    {"name": "skewed", "T": [50, 41, 50, 3], "H": 128, "L": 2, "K": 4, "kind": "skewed", "dtype": torch.bfloat16},
    {"name": "last-rank-gets-nothing", "T": [30, 12, 0, 30], "H": 96, "L": 2, "K": 3, "kind": "avoid_last_rank",
     "dtype": torch.bfloat16},
    {"name": "all-unused", "T": [10, 5, 0, 2], "H": 128, "L": 2, "K": 2, "kind": "unused", "dtype": torch.bfloat16},
    {"name": "all-T=0", "T": [0], "H": 128, "L": 2, "K": 2, "kind": "random", "dtype": torch.bfloat16},
    {"name": "fp8-f32-scales", "T": [40, 3, 0, 25], "H": 256, "L": 4, "K": 4, "kind": "random", "fp8": "float"},
    {"name": "fp8-int32-scales", "T": [9, 16, 5, 0], "H": 1024, "L": 2, "K": 2, "kind": "random", "fp8": "int"},
    {"name": "f64", "T": [13, 2, 7, 21], "H": 24, "L": 2, "K": 2, "kind": "random", "dtype": torch.float64},
    {"name": "wide", "T": [5, 9, 2, 0], "H": 2048, "L": 8, "K": 8, "kind": "random", "dtype": torch.bfloat16},
    {"name": "special-values-bf16", "T": [11, 30, 0, 4], "H": 64, "L": 2, "K": 2, "kind": "random",
     "x": "special", "dtype": torch.bfloat16},
    {"name": "special-values-f32", "T": [7, 3, 19, 4], "H": 32, "L": 2, "K": 2, "kind": "random",
     "x": "special", "dtype": torch.float32},
    {"name": "special-values-f64", "T": [3, 17, 8, 0], "H": 16, "L": 1, "K": 1, "kind": "dense",
     "x": "special", "dtype": torch.float64},
    {"name": "no-weights", "T": [25, 7, 11, 3], "H": 64, "L": 2, "K": 3, "kind": "random", "dtype": torch.bfloat16,
     "weights": False},
]
ALIGNMENTS = [1, 4, 128]


def _inputs(c: dict, seed: int, num_ranks: int):
    """All ranks' (x, topk_idx, topk_weights) for case c (CPU tensors)."""
    tokens = per_rank(c["T"], num_ranks)
    num_experts = c["L"] * num_ranks
    xs, idxs, ws = [], [], []
    for r in range(num_ranks):
        g = oracle.generator(seed, r)
        idx = oracle.make_topk_idx(g, tokens[r], num_experts, c["K"], num_ranks, c["kind"])
        w = oracle.make_weights(g, idx)
        if c.get("fp8"):
            data = (torch.randn(tokens[r], c["H"], generator=g) * 50).to(torch.float8_e4m3fn)
            if c["fp8"] == "float":
                scales = torch.rand(tokens[r], c["H"] // 128, generator=g)
            else:
                scales = torch.randint(-2 ** 31, 2 ** 31 - 1, (tokens[r], c["H"] // 512), generator=g,
                                       dtype=torch.int64).to(torch.int32)
            x = (data, scales)
        else:
            x = oracle.make_x(g, tokens[r], c["H"], c.get("x", "randn"), c["dtype"])
        xs.append(x)
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, (ws if c.get("weights", True) else None), num_experts


def _to(x, dev):
    return tuple(p.to(dev) for p in x) if isinstance(x, tuple) else x.to(dev)


def _rows_of(payload, n: int):
    return tuple(p[:n] for p in payload) if isinstance(payload, tuple) else payload[:n]


def _layout(buf, idx, num_experts):
    ntr, ntrr, nte, itr, _ = buf.get_dispatch_layout(idx, num_experts)
    return {"num_tokens_per_rank": ntr, "num_tokens_per_rdma_rank": ntrr, "num_tokens_per_expert": nte,
                "is_token_in_rank": itr}


def check_received(got, exp: oracle.Received, itr: torch.Tensor, worst: int, what: str) -> None:
    """Compare a dispatch's outputs with the oracle; with num_worst_tokens `worst` > 0, check the padding."""
    recv_x, recv_idx, recv_w, counts, handle, event = got
    n = exp.num_rows
    rows = worst if worst else n
    lead = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    if isinstance(recv_x, tuple) != isinstance(exp.recv_x, tuple):
        raise AssertionError(f"{what}: recv_x should {'' if isinstance(exp.recv_x, tuple) else 'not '}be a tuple")
    if lead.shape[0] != rows:
        raise AssertionError(f"{what}: recv_x has {lead.shape[0]} rows, expected {rows} "
                             f"(received {n}, num_worst_tokens {worst})")
    assert_equal(_rows_of(recv_x, n), exp.recv_x, f"{what}: recv_x", bitwise=True)
    from moe_dispatcher import EventOverlap
    if not isinstance(event, EventOverlap):
        raise AssertionError(  # noqa: TRY004
            f"{what}: the last value must be an EventOverlap, got {type(event).__name__}")
    assert_equal(recv_idx[:n], exp.recv_topk_idx, f"{what}: recv_topk_idx")
    if exp.recv_topk_weights is None:
        if recv_w is not None:
            raise AssertionError(f"{what}: recv_topk_weights should be None without topk_weights")
    else:
        assert_equal(recv_w[:n], exp.recv_topk_weights, f"{what}: recv_topk_weights")
    if worst:
        assert_equal(recv_idx[n:], torch.full((rows - n, recv_idx.shape[1]), -1, dtype=torch.int64),
                     f"{what}: recv_topk_idx padding rows")
        if recv_w is not None:
            assert_equal(recv_w[n:], torch.zeros(rows - n, recv_w.shape[1]), f"{what}: recv_topk_weights padding rows")
        assert_equal(list(counts), [], f"{what}: num_recv_tokens_per_expert_list with num_worst_tokens")
    else:
        assert_equal(list(counts), exp.num_recv_tokens_per_expert_list, f"{what}: num_recv_tokens_per_expert_list")
        if not all(type(v) is int for v in counts):
            raise AssertionError(f"{what}: num_recv_tokens_per_expert_list must hold python ints, got {counts}")
    assert_equal(handle[0], exp.rank_prefix_matrix, f"{what}: handle[0] (rank_prefix_matrix)")
    assert_equal(handle.rank_prefix_matrix, exp.rank_prefix_matrix, f"{what}: handle.rank_prefix_matrix")
    assert_equal(handle.recv_src_idx[:n].long().cpu(), exp.recv_src_idx, f"{what}: handle.recv_src_idx")
    if handle.num_recv_tokens not in (None, n):
        raise AssertionError(f"{what}: handle.num_recv_tokens is {handle.num_recv_tokens}, received {n}")
    assert_equal(handle.is_token_in_rank, itr, f"{what}: handle.is_token_in_rank")


def _check_domains(buf) -> None:
    """The buffer sees the NVLink domains the test launched (MOE_DISPATCHER_NVL_SIZE, else one host)."""
    want = int(os.environ.get(NVL_ENV, buf.group_size))
    if buf.topology.nvl_size != want:
        raise AssertionError(f"Buffer topology has NVLink domains of {buf.topology.nvl_size}, launched with {want}")


def _dispatch_worker(rank: int, num_ranks: int) -> None:
    dev = device()
    buf = make_buffer(hidden_bytes=2048 * 8)
    _check_domains(buf)
    for ci, c in enumerate(DISPATCH_CASES):
        xs, idxs, ws, num_experts = _inputs(c, ci, num_ranks)
        for ai, align in enumerate(ALIGNMENTS):
            with case(f"{c['name']} expert_alignment={align}"):
                exp = oracle.dispatch(xs, idxs, ws, num_experts, align)[rank]
                lay = _layout(buf, idxs[rank].to(dev), num_experts)
                got = buf.dispatch(_to(xs[rank], dev), topk_idx=idxs[rank].to(dev),
                                   topk_weights=ws[rank].to(dev) if ws else None, expert_alignment=align, **lay)
                check_received(got, exp, lay["is_token_in_rank"], 0, "dispatch")
                handle = got[4]
            if ai:
                continue
            with case(f"{c['name']} cached dispatch"):
                xs2 = _inputs(c, 1000 + ci, num_ranks)[0]  # new data, the same shapes
                exp2 = oracle.dispatch(xs2, idxs, ws, num_experts)[rank]
                cached = buf.dispatch(_to(xs2[rank], dev), handle=handle)
                if len(cached) != 6 or any(v is not None for v in cached[1:5]):
                    raise AssertionError(f"cached dispatch must return (recv_x, None, None, None, None, event), got "
                                         f"{[type(v).__name__ for v in cached]}")
                assert_equal(cached[0], exp2.recv_x, "cached recv_x", bitwise=True)
            # num_worst_tokens: the same W on every rank, tight (= the most any rank receives) and loose
            received = [len(r.recv_src_idx) for r in oracle.dispatch(xs, idxs, ws, num_experts)]
            for worst in sorted({max(received) or 1, max(received) + 5}):
                with case(f"{c['name']} num_worst_tokens={worst}"):
                    got = buf.dispatch(_to(xs[rank], dev), topk_idx=idxs[rank].to(dev),
                                       topk_weights=ws[rank].to(dev) if ws else None, num_worst_tokens=worst, **lay)
                    check_received(got, exp, lay["is_token_in_rank"], worst, "dispatch")
                with case(f"{c['name']} cached dispatch from a num_worst_tokens={worst} handle"):
                    cached = buf.dispatch(_to(xs2[rank], dev), handle=got[4])
                    lead = cached[0][0] if isinstance(cached[0], tuple) else cached[0]
                    if lead.shape[0] != worst:
                        raise AssertionError(f"cached recv_x has {lead.shape[0]} rows, expected {worst}")
                    assert_equal(_rows_of(cached[0], exp2.num_rows), exp2.recv_x, "cached recv_x",
                                 bitwise=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size,nvl", WORLDS)
def test_dispatch(world_size: int, nvl: int | None, backend: str) -> None:
    """Data, order, rebased top-k, counts, prefix matrix, alignment, num_worst_tokens, cached mode, FP8 tuple."""
    run_distributed(_dispatch_worker, world_size, backend=backend, env=nvl_env(nvl))


# ------------------------------------------------------------------------------------------------ combine
COMBINE_CASES: list[dict] = [
    {"name": "random-bf16", "T": [37, 0, 64, 1], "H": 128, "L": 4, "K": 4, "kind": "random", "dtype": torch.bfloat16},
    {"name": "dense-f32", "T": [20, 33, 1, 7], "H": 64, "L": 3, "K": 6, "kind": "dense", "dtype": torch.float32},
    {"name": "f64", "T": [13, 2, 7, 21], "H": 24, "L": 2, "K": 2, "kind": "random", "dtype": torch.float64},
    {"name": "skewed", "T": [50, 41, 50, 3], "H": 128, "L": 2, "K": 4, "kind": "skewed", "dtype": torch.bfloat16},
    {"name": "last-rank-gets-nothing", "T": [30, 12, 0, 30], "H": 96, "L": 2, "K": 3, "kind": "avoid_last_rank",
     "dtype": torch.bfloat16},
    {"name": "all-unused", "T": [10, 5, 0, 2], "H": 128, "L": 2, "K": 2, "kind": "unused", "dtype": torch.bfloat16},
    {"name": "T=1", "T": [1, 1, 1, 1], "H": 1024, "L": 1, "K": 1, "kind": "dense", "dtype": torch.bfloat16},
]


def _combine_worker(rank: int, num_ranks: int) -> None:
    dev = device()
    # The reference backend, also over NCCL: the oracle's flat order is its order. (On GPUs with several NVLink
    # domains `auto` would pick the internode kernels, whose combine sums per domain first: bf16 rounding apart
    # from this order, checked in tests/kernels/test_internode_gpu.py.)
    buf = make_buffer(hidden_bytes=2048 * 8, backend="reference")
    _check_domains(buf)
    for ci, c in enumerate(COMBINE_CASES):
        tokens = per_rank(c["T"], num_ranks)
        _, idxs, ws, num_experts = _inputs(c, 50 + ci, num_ranks)
        grid = [oracle.make_x(oracle.generator(70 + ci, r), tokens[r], c["H"], "grid", c["dtype"])
                for r in range(num_ranks)]
        exp = oracle.dispatch(grid, idxs, ws, num_experts)
        lay = _layout(buf, idxs[rank].to(dev), num_experts)
        ranks_per_token = lay["is_token_in_rank"].sum(dim=1, keepdim=True).cpu()

        with case(f"{c['name']} round trip"):
            got = buf.dispatch(grid[rank].to(dev), topk_idx=idxs[rank].to(dev), topk_weights=ws[rank].to(dev), **lay)
            recv_x, _, recv_w, _, handle, _ = got
            combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
            expected = (grid[rank].double() * ranks_per_token).to(c["dtype"])  # exact on the grid
            assert_equal(combined, expected, "combine(dispatch(x)) == x * ranks the token went to")
            # each slot's weight reaches only the rank of its expert: the sum restores it where idx >= 0
            assert_equal(combined_w, torch.where(idxs[rank] >= 0, ws[rank], torch.zeros(())),
                         "combined_topk_weights of the received weights")
            want = oracle.combine([r.recv_x for r in exp], exp, tokens, [r.recv_topk_weights for r in exp])[rank]
            assert_equal(combined, want[0], "combine vs oracle")
            assert_equal(combined_w, want[1], "combined_topk_weights vs oracle")

        with case(f"{c['name']} round trip through cached dispatch"):
            cached_x = buf.dispatch((grid[rank] * 2).to(dev), handle=handle)[0]
            combined, combined_w, _ = buf.combine(cached_x, handle)
            if combined_w is not None:
                raise AssertionError("combined_topk_weights must be None without topk_weights")
            assert_equal(combined, (grid[rank].double() * 2 * ranks_per_token).to(c["dtype"]), "cached round trip")

        # arbitrary returned rows (random data), returned weights and 0/1/2 biases, vs the oracle
        rows = [oracle.make_x(oracle.generator(90 + ci, r), exp[r].num_rows, c["H"], "randn", c["dtype"])
                for r in range(num_ranks)]
        row_w = [torch.randn(exp[r].num_rows, c["K"], generator=oracle.generator(110 + ci, r))
                 for r in range(num_ranks)]
        biases = [[oracle.make_x(oracle.generator(130 + ci, r, b), tokens[r], c["H"], "randn", c["dtype"])
                   for b in range(2)] for r in range(num_ranks)]
        for nb in (0, 1, 2):
            with case(f"{c['name']} combine with {nb} bias tensors"):
                bias = None if nb == 0 else biases[rank][0].to(dev) if nb == 1 else \
                    tuple(b.to(dev) for b in biases[rank])
                combined, combined_w, _ = buf.combine(rows[rank].to(dev), handle, topk_weights=row_w[rank].to(dev),
                                                      bias=bias)
                want = oracle.combine(rows, exp, tokens, row_w, [b[:nb] for b in biases])[rank]
                assert_equal(combined, want[0], "combined_x")
                assert_equal(combined_w, want[1], "combined_topk_weights")

        # num_worst_tokens: only the received rows are read (the padding rows are poisoned)
        worst = max(r.num_rows for r in exp) + 3
        with case(f"{c['name']} combine after num_worst_tokens={worst}"):
            got = buf.dispatch(grid[rank].to(dev), topk_idx=idxs[rank].to(dev), topk_weights=ws[rank].to(dev),
                               num_worst_tokens=worst, **lay)
            n = exp[rank].num_rows
            padded = torch.full((worst, c["H"]), float("nan"), dtype=c["dtype"])
            padded[:n] = rows[rank]
            padded_w = torch.full((worst, c["K"]), float("nan"))
            padded_w[:n] = row_w[rank]
            combined, combined_w, _ = buf.combine(padded.to(dev), got[4], topk_weights=padded_w.to(dev))
            want = oracle.combine(rows, exp, tokens, row_w)[rank]
            assert_equal(combined, want[0], "combined_x (padding rows must not be read)")
            assert_equal(combined_w, want[1], "combined_topk_weights (padding rows must not be read)")
    dist.barrier()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size,nvl", WORLDS)
def test_combine(world_size: int, nvl: int | None, backend: str) -> None:
    """Round trip x * (ranks reached), weight reduction, 0/1/2 bias, float32/64 accumulation, worst-token padding."""
    run_distributed(_combine_worker, world_size, backend=backend, env=nvl_env(nvl))


def _worst_overflow_worker(rank: int, num_ranks: int) -> None:
    dev = device()
    buf = make_buffer(hidden_bytes=128 * 2)
    num_experts, tokens = 2 * num_ranks, 6
    x = oracle.make_x(oracle.generator(7, rank), tokens, 128, "grid").to(dev)
    idx = torch.zeros(tokens, 1, dtype=torch.int64, device=dev)  # every token to expert 0: rank 0 gets them all
    lay = _layout(buf, idx, num_experts)
    with case("num_worst_tokens=1: rank 0 receives more, the others receive nothing"):
        raised = None
        try:
            buf.dispatch(x, topk_idx=idx, num_worst_tokens=1, **lay)
            if buf._kernels is not None:
                # The compiled backend does not synchronise under num_worst_tokens: it reports the overflow, on
                # every rank, at the next dispatch that does (docs/semantics.md).
                buf.dispatch(x, topk_idx=idx, **lay)
        except ValueError as exc:
            raised = exc
        if raised is None or "num_worst_tokens" not in str(raised):
            raise AssertionError(f"rank 0 receives {tokens * num_ranks} rows > num_worst_tokens=1: every rank must "
                                 f"raise a ValueError naming num_worst_tokens; got {raised!r}")
    with case("the group still works afterwards (nothing left pending)"):
        recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, **lay)
        combined = buf.combine(recv_x, handle)[0]
        assert_equal(combined, x, "round trip after the overflow")
    dist.barrier()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2])
def test_num_worst_tokens_overflow(world_size: int, backend: str) -> None:
    """More rows than num_worst_tokens is an error on the receiving rank, and it leaves no peer hanging."""
    run_distributed(_worst_overflow_worker, world_size, backend=backend, timeout=40)
