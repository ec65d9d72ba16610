"""DeepEP V1's Buffer arguments (its last V1 commit): every one is accepted by name and in DeepEP's order, and those
moe_dispatcher does not support raise NotImplementedError naming them, instead of a TypeError or silence."""
from __future__ import annotations

import inspect

import pytest

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
