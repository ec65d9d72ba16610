"""get_dispatch_layout vs a direct computation, and Topology (hostnames, env override, errors)."""
from __future__ import annotations

import os

import oracle
import pytest
import torch
import torch.distributed as dist
from dist import BACKENDS, NVL_ENV, assert_equal, case, device, per_rank, run_distributed

LAYOUT_CASES = [
    {"name": "random", "T": [37, 0, 64, 1], "L": 4, "K": 4, "kind": "random"},
    {"name": "dense", "T": [20, 33, 1, 7], "L": 3, "K": 6, "kind": "dense"},
    {"name": "T=1,L=1,K=1", "T": [1], "L": 1, "K": 1, "kind": "dense"},
    {"name": "skewed", "T": [50, 41, 50, 3], "L": 2, "K": 4, "kind": "skewed"},
    {"name": "last-rank-gets-nothing", "T": [30, 12, 0, 30], "L": 2, "K": 3, "kind": "avoid_last_rank"},
    {"name": "all-unused", "T": [10, 5, 0, 2], "L": 2, "K": 2, "kind": "unused"},
    {"name": "T=0", "T": [0], "L": 2, "K": 2, "kind": "random"},
    {"name": "many experts", "T": [100, 7, 64, 1], "L": 32, "K": 8, "kind": "random"},
]


def _check_layout(buf, idx: torch.Tensor, num_experts: int, nvl_size: int, what: str) -> None:
    num_ranks = dist.get_world_size()
    got = buf.get_dispatch_layout(idx.to(device()), num_experts)
    if len(got) != 5:
        raise AssertionError(f"{what}: get_dispatch_layout returns 5 values, got {len(got)}")
    want = oracle.layout(idx, num_experts, num_ranks, nvl_size)
    assert_equal(got[0], want.num_tokens_per_rank, f"{what}: num_tokens_per_rank")
    if want.num_tokens_per_rdma_rank is None:
        if got[1] is not None:
            raise AssertionError(f"{what}: num_tokens_per_rdma_rank must be None in a single NVLink domain")
    else:
        assert_equal(got[1], want.num_tokens_per_rdma_rank, f"{what}: num_tokens_per_rdma_rank")
    assert_equal(got[2], want.num_tokens_per_expert, f"{what}: num_tokens_per_expert")
    assert_equal(got[3], want.is_token_in_rank, f"{what}: is_token_in_rank")
    from moe_dispatcher import EventOverlap
    if not isinstance(got[4], EventOverlap):
        raise AssertionError(  # noqa: TRY004
            f"{what}: the last value must be an EventOverlap, got {type(got[4]).__name__}")


def _layout_worker(rank: int, num_ranks: int, env_nvl: int) -> None:
    from moe_dispatcher import Buffer, Topology
    from moe_dispatcher.topology import MAX_NVL_SIZE

    with case(f"topology from the launch env {NVL_ENV}={env_nvl}"):
        topo = Topology.from_group(dist.group.WORLD)
        want = (rank, num_ranks, env_nvl, num_ranks // env_nvl, rank // env_nvl, rank % env_nvl)
        got = (topo.rank, topo.num_ranks, topo.nvl_size, topo.num_domains, topo.domain, topo.local_index)
        assert_equal(got, want, "(rank, num_ranks, nvl_size, num_domains, domain, local_index)")

    with case("topology from hostnames (one host: one domain of every rank)"):
        os.environ.pop(NVL_ENV)
        topo = Topology.from_group(dist.group.WORLD)
        assert_equal((topo.nvl_size, topo.num_domains, topo.domain, topo.local_index), (num_ranks, 1, 0, rank),
                     "single-host topology")

    for bad in [str(num_ranks + 1), "0", "-2", str(num_ranks * 2 * MAX_NVL_SIZE), "three"]:
        with case(f"{NVL_ENV}={bad} is rejected"):
            os.environ[NVL_ENV] = bad
            with pytest.raises(ValueError):
                Topology.from_group(dist.group.WORLD)
            with pytest.raises(ValueError):
                Buffer(dist.group.WORLD)
    if num_ranks < MAX_NVL_SIZE:
        # 16 does divide a group of 16, but a domain may not exceed 8 GPUs (checked on a given size)
        with case("nvl_size above the maximum is rejected"), pytest.raises(ValueError):
            Topology(rank=0, num_ranks=2 * MAX_NVL_SIZE, nvl_size=2 * MAX_NVL_SIZE)

    for nvl in [d for d in range(1, num_ranks + 1) if num_ranks % d == 0]:
        os.environ[NVL_ENV] = str(nvl)
        buf = Buffer(dist.group.WORLD)
        if buf.topology.nvl_size != nvl:
            raise AssertionError(f"Buffer ignored {NVL_ENV}={nvl}: nvl_size {buf.topology.nvl_size}")
        for ci, c in enumerate(LAYOUT_CASES):
            with case(f"layout {c['name']} with NVLink domains of {nvl}"):
                num_experts = c["L"] * num_ranks
                tokens = per_rank(c["T"], num_ranks)
                idx = oracle.make_topk_idx(oracle.generator(400 + ci, rank), tokens[rank], num_experts, c["K"],
                                           num_ranks, c["kind"])
                _check_layout(buf, idx, num_experts, nvl, "get_dispatch_layout")
    os.environ.pop(NVL_ENV)
    dist.barrier()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_layout_and_topology(world_size: int, backend: str) -> None:
    """Layout counts for every NVLink domain size that divides the group; Topology fields, env override, errors."""
    nvl = world_size // 2  # launched with an override, so the harness's env= reaches the ranks
    run_distributed(_layout_worker, world_size, nvl, backend=backend, env={NVL_ENV: str(nvl)})


def test_topology_from_hostnames() -> None:
    """Domains are runs of consecutive ranks on one host, of equal size (no process group needed)."""
    from moe_dispatcher import Topology
    hosts = ["a", "a", "b", "b", "c", "c"]
    topo = Topology.from_hostnames(3, hosts)
    assert (topo.nvl_size, topo.num_domains, topo.domain, topo.local_index) == (2, 3, 1, 1)
    with pytest.raises(ValueError):
        Topology.from_hostnames(0, ["a", "b", "a", "b"])  # a host's ranks are not consecutive
    with pytest.raises(ValueError):
        Topology.from_hostnames(0, ["a", "a", "a", "b"])  # unequal domains
    with pytest.raises(ValueError):
        Topology.from_hostnames(0, ["a"] * 16)  # one domain of 16 GPUs
