"""Internode (two-hop: NVSHMEM across domains, NVLink inside) kernels against the reference backend.

Parametrised by (world size, NVLink domain size): 2 GPUs as 2 emulated domains of 1, 4 GPUs as 2 domains of 2 and as
4 domains of 1 (MOE_DISPATCHER_NVL_SIZE), 8 GPUs as 2 x 4 and 4 x 2 when present. Each world holds a kernels Buffer
(which must pick the internode backend) and a reference Buffer on the same group; outputs are poisoned first.
Dispatch must be bit-identical; combine equal within bf16 rounding (the two-hop sum rounds each domain's
partial to the row dtype; docs/internode.md), and bit-exact on integer data.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import dist as dist_helpers
from dist import assert_close, assert_equal, case, make_buffer, run_distributed
from normal_cases import CASES as INTRANODE_CASES
from normal_cases import (GROUP_CASES, check_back_to_back, check_case, check_dispatch_timeout, check_graph_replay,
                          check_worst_overflow, timeout_inputs, two_hop_tol)
from normal_cases import dispatch as _dispatch
from normal_cases import routing as _routing

pytestmark = pytest.mark.gpu
MAX_HIDDEN_BYTES = 7168 * 2
# 2-nvl1: the smallest internode world (every row crosses the RDMA hop or stays on its rank), which 2 GPUs run.
WORLDS = [pytest.param(2, 1, id="2-nvl1"), pytest.param(4, 2, id="4-nvl2"), pytest.param(4, 1, id="4-nvl1"),
          pytest.param(8, 4, id="8-nvl4"), pytest.param(8, 2, id="8-nvl2")]


def _buffers():
    from moe_dispatcher import Buffer
    kernels = make_buffer(hidden_bytes=MAX_HIDDEN_BYTES, backend="kernels", explicitly_destroy=True)
    assert kernels._kernels is not None and kernels._kernels.name == "internode", kernels._kernels_why
    reference = Buffer(backend="reference", explicitly_destroy=True)
    return kernels, reference


CASES: List[Dict] = list(INTRANODE_CASES) + GROUP_CASES


def _world_matches_reference(rank: int, world_size: int) -> Dict:
    kb, rb = _buffers()
    stats = {"combine_total": 0, "combine_bit_exact": 0}
    for i, c in enumerate(CASES):
        with case(c["name"]):
            check_case(kb, rb, c, i, stats, torch.device("cuda", torch.cuda.current_device()),
                       combine_tol=two_hop_tol, nvl=kb.topology.nvl_size, poison=True, rdma_layout=True,
                       expect_backend="internode")
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
        # A replay that timed out leaves outputs unwritten: name the timeout instead.
        check_graph_replay(kb, rb, rank, world_size, dev, t, h, e, k, worst, combine_tol=two_hop_tol,
                           check_src_idx=False, after_replay=kb._kernels._check)

    with case("1000 back-to-back dispatch+combine"):
        check_back_to_back(kb, rb, rank, dev, t, h, e, k, rounds=1000, after_loop=kb._kernels._check)

    with case("num_worst_tokens overflow"):
        check_worst_overflow(kb, dev, t, h, e, combine_dropped=False)
    torch.cuda.synchronize()
    kb.destroy()
    rb.destroy()


@pytest.mark.parametrize("world_size,nvl", WORLDS)
def test_graph_and_back_to_back(world_size: int, nvl: int) -> None:
    run_distributed(_world_graph_and_back_to_back, world_size, backend="nccl", env=dist_helpers.nvl_env(nvl))


def _world_timeout(rank: int, world_size: int) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    _, _, e, idx, x = timeout_inputs(rank, world_size, dev)
    with case("rank 1 skips a dispatch"):
        check_dispatch_timeout(rank, idx, x, e, phase="internode notify", waiting="waiting for rank",
                               stays_unusable=False)


def _world_dropped_rows(rank: int, world_size: int) -> None:
    """No silent loss in the internode expert-major composition (rank-major exchange + permute): with one local
    pair per received row (top-1 routing; one expert per rank) the M rows kept need exactly M rows, so
    rows_needed must come from the counts notify exchanged. Then the drop is reported once, at the next
    synchronised dispatch, and a caller that checked the drop itself (the Megatron integration's step-end
    check) forgets it and lets the next synchronised dispatch through."""
    kb, rb = _buffers()
    dev = torch.device("cuda", torch.cuda.current_device())
    t, h = 256, 2048
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    routings = {"top-1 (every token to rank 0)": ((torch.arange(t) % 2).view(t, 1), 2 * world_size),
                "one expert per rank": (torch.stack([torch.randperm(world_size, generator=g) for _ in range(t)]),
                                        world_size)}
    worst = 128  # < the rows a rank receives (world_size * t at rank 0, or at every rank)
    for name, (idx, e) in routings.items():
        idx = idx.to(dev)
        for align in (1, 16):
            with case(f"{name}, alignment {align}"):
                assert kb._kernels.name == "internode"
                *_, want, _, _, _ = rb.expert_major_dispatch(x, topk_idx=idx, num_experts=e, expert_alignment=align)
                px, _, _, tpe, hk, _ = kb.expert_major_dispatch(x, topk_idx=idx, num_experts=e,
                                                                expert_alignment=align, num_worst_tokens=worst)
                assert hk.backend_state is None, "the composition must serve the internode backend"
                assert px.shape[0] == worst
                assert int(hk.rows_needed) == sum(want), (int(hk.rows_needed), want)
                with pytest.raises(ValueError, match="num_worst_tokens"):
                    kb.expert_major_dispatch(x, topk_idx=idx, num_experts=e, expert_alignment=align)
                px, _, counts, _, hk, _ = kb.expert_major_dispatch(x, topk_idx=idx, num_experts=e,
                                                                   expert_alignment=align)  # reported once
                assert counts == want
                y = kb.expert_major_combine(px, hk)[0]
                assert_equal(y, x * (idx >= 0).sum(1, keepdim=True).to(x.dtype), "round trip after the drop")
            with case(f"{name}, alignment {align}: a synchronised dispatch after forgetting the drop"):
                kb.expert_major_dispatch(x, topk_idx=idx, num_experts=e, expert_alignment=align,
                                         num_worst_tokens=worst)
                torch.cuda.synchronize()
                kb._forget_dropped_rows()
                *_, counts, _, _, _ = kb.expert_major_dispatch(x, topk_idx=idx, num_experts=e, expert_alignment=align)
                assert counts == want
    torch.cuda.synchronize()
    kb.destroy()
    rb.destroy()


@pytest.mark.parametrize("world_size,nvl", WORLDS[:3])
def test_composition_reports_dropped_rows(world_size: int, nvl: int) -> None:
    run_distributed(_world_dropped_rows, world_size, backend="nccl", env=dist_helpers.nvl_env(nvl))


@pytest.mark.parametrize("world_size,nvl", WORLDS[:3])
def test_timeout_names_rank_and_phase(world_size: int, nvl: int) -> None:
    env = {"MOE_DISPATCHER_TIMEOUT_S": "2", **dist_helpers.nvl_env(nvl)}
    run_distributed(_world_timeout, world_size, backend="nccl", env=env)


@pytest.mark.parametrize("num_ranks,nvl", [(2, 1), (4, 2), (4, 1), (8, 4), (8, 2), (16, 8), (64, 1)])
def test_size_hints_cover_the_extension_layout(num_ranks: int, nvl: int) -> None:
    """Config's size hints repeat the headers' arithmetic of the extension's buffer layout (so that they work
    without it): the layout the kernels get from a hinted buffer holds the config's rings. Needs the extension
    only (no GPU)."""
    from moe_dispatcher import _ext
    from moe_dispatcher.config import (Config, get_combine_config, get_dispatch_config, internode_nvl_header_bytes,
                                       internode_rdma_header_bytes)
    mod = _ext.load()
    if mod is None or not hasattr(mod, "internode"):
        pytest.skip("the extension with the internode kernels is not built")
    hidden_bytes = 7168 * 2
    for cfg in (get_dispatch_config(num_ranks, 24), get_combine_config(num_ranks, 24), Config(64, 32, 256, 32, 256)):
        rdma = cfg.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, nvl)
        nvl_bytes = cfg.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)
        lay = mod.internode.buffer_layout(num_ranks, nvl, rdma, nvl_bytes)
        assert lay["rdma_recv_offset"] == internode_rdma_header_bytes(num_ranks, nvl)
        assert lay["nvl_rings_offset"] == internode_nvl_header_bytes(num_ranks)
        slot = Config.slot_bytes(hidden_bytes)
        assert lay["rdma_domain_bytes"] >= cfg.num_channels * cfg.num_max_rdma_chunked_recv_tokens * slot
        assert lay["rdma_send_offset"] + num_ranks // nvl * lay["rdma_domain_bytes"] <= rdma
        assert lay["nvl_src_block_bytes"] >= cfg.num_channels * cfg.num_max_nvl_chunked_recv_tokens * slot
        assert lay["rdma_msg_ints"] >= 1 + num_ranks + 32 + nvl * (32 + 1024)
