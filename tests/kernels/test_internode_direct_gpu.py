"""The internode NVLink hop's direct writes (kernels/internode/notify.cu, dispatch.cu) on real GPUs.

fwd_row_offset: internode notify's table, at forwarder (d, l), of where each source (x, l)'s rows of channel c start
in the output of each local rank (d, j): it must equal (d, j)'s own recv_channel_offset[(x, l)][c] (gathered over the
group), for routings with empty ranks and channels, num_worst_tokens, and a refused call (all 0).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import dist as dist_helpers
from dist import assert_equal, case, make_buffer, run_distributed
from normal_cases import dispatch as _dispatch
from normal_cases import routing as _routing

pytestmark = pytest.mark.gpu
MAX_HIDDEN_BYTES = 7168 * 2
WORLDS = [pytest.param(4, 2, id="4-nvl2"), pytest.param(4, 1, id="4-nvl1")]


def _routing_tables(handle):
    """(recv_channel_offset int32 [R, C + 1], fwd_row_offset int32 [D, nvl, C]) of an internode handle."""
    routing = handle.backend_state.routing
    return routing[1], routing[5]


def _check_fwd_row_offset(kb, handle, what: str) -> None:
    """fwd_row_offset[x][j][c] here == recv_channel_offset[(x, my local)][c] at rank (my domain, j)."""
    topo = kb.topology
    r, nvl = topo.num_ranks, topo.nvl_size
    offsets, fwd_rows = _routing_tables(handle)
    gathered = [torch.empty_like(offsets) for _ in range(r)]
    dist.all_gather(gathered, offsets.contiguous())
    c = offsets.shape[1] - 1
    d, l = topo.rank // nvl, topo.rank % nvl
    want = torch.empty_like(fwd_rows)
    for x in range(r // nvl):
        for j in range(nvl):
            want[x, j] = gathered[d * nvl + j][x * nvl + l, :c]
    assert_equal(fwd_rows, want, f"fwd_row_offset ({what})")


def _world_fwd_row_offset(rank: int, world_size: int) -> None:
    from moe_dispatcher.signature import SignatureMismatch
    dev = torch.device("cuda", torch.cuda.current_device())
    kb = make_buffer(hidden_bytes=MAX_HIDDEN_BYTES, backend="kernels", explicitly_destroy=True)
    assert kb._kernels is not None and kb._kernels.name == "internode", kb._kernels_why
    h, k = 1024, 6
    e = 8 * world_size
    for seed, (t, kind, worst) in enumerate([(512, "random", 0), (300, "skewed", 0), (77, "empty_last", 0),
                                             (129, "one_rank", 0), (256, "random", 256 * world_size),
                                             (0 if rank == 1 else 64, "random", 0), (5, "dense", 0)]):
        with case(f"{kind}, T={t}, num_worst_tokens={worst}"):
            g = torch.Generator().manual_seed(100 * seed + rank)
            idx = _routing(g, t, e, k, world_size, kind).to(dev)
            x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
            _, out = _dispatch(kb, x, idx, None, e, num_worst=worst)
            _check_fwd_row_offset(kb, out[4], f"{kind} routing")
    with case("a refused call: every word 0"):
        g = torch.Generator().manual_seed(7 + rank)
        t = 200
        idx = _routing(g, t, e, k, world_size, "random").to(dev)
        x = torch.randn(t, h if rank != 0 else 2 * h, generator=g).to(torch.bfloat16).to(dev)  # rank 0's H differs
        worst = t * world_size
        _, out = _dispatch(kb, x, idx, None, e, num_worst=worst)  # num_worst_tokens: no host wait, no raise here
        _, fwd_rows = _routing_tables(out[4])
        assert int(fwd_rows.abs().sum()) == 0, "a refused call's fwd_row_offset must be all 0"
        torch.cuda.synchronize()
        with pytest.raises(SignatureMismatch):  # reported at the next synchronised dispatch, on every rank
            _dispatch(kb, x[:, :h].contiguous(), idx, None, e)
    torch.cuda.synchronize()
    dist.barrier()
    kb.destroy()


@pytest.mark.parametrize("world_size,nvl", WORLDS)
def test_fwd_row_offset(world_size: int, nvl: int) -> None:
    run_distributed(_world_fwd_row_offset, world_size, backend="nccl", env=dist_helpers.nvl_env(nvl))
