"""DeepEP V1's Buffer arguments (its last V1 commit): every one is accepted by name and in DeepEP's order, and those
moe_dispatcher does not support raise NotImplementedError naming them, instead of a TypeError or silence."""
from __future__ import annotations

import inspect
import time

import pytest
from dist import run_distributed

from moe_dispatcher import Buffer

# DeepEP V1's Buffer.__init__ parameters, in its order (the API contract).
DEEPEP_V1_ARGUMENTS = ("group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                       "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric", "explicitly_destroy",
                       "enable_shrink", "comm")


def test_deepep_arguments_in_deepep_order():
    params = list(inspect.signature(Buffer.__init__).parameters.values())[1:]
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert tuple(positional[:len(DEEPEP_V1_ARGUMENTS)]) == DEEPEP_V1_ARGUMENTS, positional


@pytest.mark.parametrize("argument", ["allow_mnnvl", "use_fabric", "enable_shrink"])
def test_unsupported_flags_are_refused_by_name(world, argument):
    with pytest.raises(NotImplementedError, match=f"{argument}=True"):
        Buffer(backend="reference", **{argument: True})


def test_an_mpi_communicator_is_refused_and_ignored_beside_a_group(world):
    import torch.distributed as dist
    with pytest.raises(NotImplementedError, match="mpi4py communicator"):
        Buffer(None, comm=object())
    # DeepEP V1 uses the group when both are given; so do we.
    assert Buffer(dist.group.WORLD, comm=object(), backend="reference").group_size == 1


def _comm_on_one_rank(rank: int, world_size: int) -> tuple:
    import torch.distributed as dist

    from moe_dispatcher import CreationFailed
    t0 = time.monotonic()
    try:
        if rank == 1:
            Buffer(None, comm=object(), backend="reference")
        else:
            Buffer(dist.group.WORLD, backend="reference")
        out = ("created", "")
    except (NotImplementedError, CreationFailed) as exc:
        out = (type(exc).__name__, str(exc))
    seconds = time.monotonic() - t0
    store = dist.distributed_c10d._get_default_store()
    store.add("done", 1)  # a rank stays until every rank is done (its peers' collectives need it alive)
    deadline = time.monotonic() + 60
    while int(store.add("done", 0)) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    return (*out, seconds)


def test_a_communicator_passed_on_one_rank_fails_its_peers_fast():
    """The refusal comes after the Buffer's board exists, so the rank posts its abort and its peers, waiting in the
    creation's first round, raise at once naming it (not after MOE_DISPATCHER_TIMEOUT_S)."""
    out = run_distributed(_comm_on_one_rank, 2, env={"MOE_DISPATCHER_TIMEOUT_S": "60"})
    assert out[1][0] == "NotImplementedError" and "mpi4py communicator" in out[1][1], out[1]
    kind, message, seconds = out[0]
    assert kind == "CreationFailed" and "rank 1" in message and "mpi4py communicator" in message, out[0]
    assert seconds < 30, f"rank 0 waited {seconds:.1f} s for the rank that refused"
