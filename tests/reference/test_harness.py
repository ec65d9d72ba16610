"""The distributed test harness itself: results, environment, error re-raising, hang detection."""
from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist
from dist import CHILD_ENV, DistributedTestFailure, case, run_distributed


def _report(rank: int, world_size: int, key: str) -> tuple:
    dist.barrier()
    env = {k: os.environ.get(k) for k in list(CHILD_ENV) + [key, "CUDA_VISIBLE_DEVICES"]}
    return rank, world_size, dist.get_rank(), dist.get_world_size(), env


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    with case("the failing case"):
        if rank == 1:
            raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 waits here until it is killed


def _die_on_rank_1(rank: int, world_size: int) -> None:
    # Every pair of the group connected first: a rank that dies while gloo still builds its mesh makes the other
    # rank's connect fail, and that error may reach the parent first (seen once under load).
    dist.barrier()
    if rank == 1:
        with case("about to exit"):
            os._exit(3)


def _hang_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        with case("sleeping forever"):
            time.sleep(600)


def test_results_and_environment() -> None:
    results = run_distributed(_report, 2, "MOE_TEST_PROBE", env={"MOE_TEST_PROBE": "yes"})
    assert [r[:4] for r in results] == [(0, 2, 0, 2), (1, 2, 1, 2)]
    for *_, env in results:
        assert env["MOE_TEST_PROBE"] == "yes"
        assert env["NVSHMEM_DISABLE_NVLS"] == env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert env["NCCL_NVLS_ENABLE"] == "0"
        assert env["CUDA_VISIBLE_DEVICES"] == os.environ.get("CUDA_VISIBLE_DEVICES")  # never restricted
    assert "MOE_TEST_PROBE" not in os.environ  # the parent's environment is restored


def test_rank_exception_is_reraised_with_its_traceback() -> None:
    with pytest.raises(ValueError, match="boom on rank 1") as info:
        run_distributed(_fail_on_rank_1, 2, timeout=60)
    cause = str(info.value.__cause__)
    assert "rank 1 of 2" in cause and "_fail_on_rank_1" in cause, cause
    assert any("the failing case" in n for n in getattr(info.value, "__notes__", [])), info.value.__notes__


def test_hang_is_killed_and_named() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure, match=r"did not finish") as info:
        run_distributed(_hang_on_rank_1, 2, timeout=15)
    assert time.monotonic() - start < 60
    assert "1]" in str(info.value) and "sleeping forever" in str(info.value), str(info.value)


def test_dead_rank_is_reported() -> None:
    with pytest.raises(DistributedTestFailure, match=r"rank 1 of 2 .*exited with code 3.*about to exit"):
        run_distributed(_die_on_rank_1, 2, timeout=60)
