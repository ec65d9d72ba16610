"""The shared checks of the normal-mode GPU tests (tests/helpers/normal_cases.py) run on CPU: two reference Buffers
under gloo stand in for the kernels Buffer and its reference, so every case of the GPU tables goes through the
same input builders and assertions (one domain, and 2 emulated domains of 2 with the group-limited cases).
Two identical backends must agree bit for bit, so every combine counts as bit-exact."""
from __future__ import annotations

import pytest
import torch
from dist import case, device, make_buffer, nvl_env, run_distributed

import normal_cases as nc


def _world_cases(rank: int, world_size: int, nvl: int | None) -> dict:
    checked = make_buffer(backend="reference", explicitly_destroy=True)
    reference = make_buffer(backend="reference", explicitly_destroy=True)
    dev = device()
    stats = {"combine_total": 0, "combine_bit_exact": 0}
    cases = nc.CASES + (nc.GROUP_CASES if nvl else [])
    for i, c in enumerate(cases):
        with case(c["name"]):
            nc.check_case(checked, reference, c, i, stats, dev, combine_tol=nc.two_hop_tol if nvl else nc.one_hop_tol,
                          nvl=nvl, poison=True, rdma_layout=bool(nvl), expect_backend="reference" if nvl else None,
                          cached_returns_none=True)
    with case("back-to-back round trips"):
        seen = []
        nc.check_back_to_back(checked, reference, rank, dev, 64, 128, 4 * world_size, 3, rounds=12,
                              switch=seen.append, after_loop=lambda: seen.append("after"))
        assert seen == list(range(12)) + ["after"], seen
    checked.destroy()
    reference.destroy()
    return stats


@pytest.mark.parametrize("world_size,nvl", [pytest.param(4, None, id="4"), pytest.param(4, 2, id="4-nvl2")])
def test_shared_checks_on_reference(world_size: int, nvl: int | None) -> None:
    stats = run_distributed(_world_cases, world_size, nvl, backend="gloo", env=nvl_env(nvl), timeout=240)
    total = sum(s["combine_total"] for s in stats)
    cases = len(nc.CASES) + (len(nc.GROUP_CASES) if nvl else 0)
    assert total == cases * world_size, (total, cases)
    assert sum(s["combine_bit_exact"] for s in stats) == total


def test_routing_kinds() -> None:
    t, num_ranks, local, k = 500, 4, 8, 4
    e = num_ranks * local
    for kind in nc.ROUTING_KINDS:
        idx = nc.routing(torch.Generator().manual_seed(1), t, e, k, num_ranks, kind)
        assert idx.shape == (t, k) and idx.dtype == torch.int64, kind
        used = idx[idx >= 0]
        assert bool((used < e).all()), kind
        rows = [set(r) - {-1} for r in idx.tolist()]
        assert all(len(r) == len([v for v in row if v >= 0]) for r, row in zip(rows, idx.tolist())), kind
        dropped = float((idx < 0).float().mean())
        if kind == "dense" or kind == "one_rank":
            assert dropped == 0.0, kind
        else:
            assert 0.1 < dropped < 0.3, (kind, dropped)
        if kind == "empty_last":
            assert bool((used < (num_ranks - 1) * local).all())
        if kind == "one_rank":
            assert bool((used < local).all())
        if kind == "skewed":  # expert 0 of rank 0 is the most popular expert
            assert int(torch.bincount(used, minlength=e).argmax()) == 0
    with pytest.raises(ValueError, match="unknown routing kind"):
        nc.routing(torch.Generator(), 4, e, k, num_ranks, "group1")
    nvl, num_domains = 2, num_ranks // 2
    for max_domains in (1, 2):
        idx = nc.group_routing(torch.Generator().manual_seed(2), t, e, k, num_ranks, nvl, max_domains)
        for row in idx.tolist():
            domains = {v // (e // num_domains) for v in row if v >= 0}
            assert len(domains) <= max_domains, (row, max_domains)


def test_case_inputs_and_cached_input() -> None:
    dev = torch.device("cpu")
    for c in nc.CASES:
        inp = nc.case_inputs(c, 3, 1, 4, dev)
        t = c["T"][1 % len(c["T"])]
        assert inp.idx.shape == (t, c["K"]) and inp.num_experts == 4 * c["L"], c["name"]
        assert inp.w is not None and inp.w.shape == (t, c["K"]), c["name"]
        again = nc.case_inputs(c, 3, 1, 4, dev)
        assert torch.equal(inp.idx, again.idx), "inputs depend on (case, seed, rank) only"
        x2 = nc.cached_input(inp, dev)
        if c.get("fp8"):
            assert inp.x.dtype == torch.float8_e4m3fn and inp.xin[1].shape == (t, c["H"] // 128)
            assert torch.equal(x2[0].view(torch.uint8), inp.x.view(torch.uint8).flip(0))
            assert torch.equal(x2[1], inp.scales.flip(0))
        else:
            assert inp.x.dtype == c.get("dtype", torch.bfloat16) and inp.xin is inp.x
            assert x2.shape == inp.x.shape and x2.dtype == inp.x.dtype
        cdtype = nc.combine_dtype(c, inp)
        y, bias = nc.combine_inputs(c, inp, 7, cdtype, dev)
        assert y.shape == (7, c["H"]) and y.dtype == cdtype
        assert (bias is None) == (not c.get("bias")), c["name"]
        if c.get("bias") == 2:
            assert len(bias) == 2
    no_weights = dict(nc.CASES[0], weights=False)
    assert nc.case_inputs(no_weights, 0, 0, 4, dev).w is None
    assert nc.worst_tokens(dict(T=[3, 5], worst=True), 4) == 16
    assert nc.worst_tokens(dict(T=[3, 5]), 4) == 0
