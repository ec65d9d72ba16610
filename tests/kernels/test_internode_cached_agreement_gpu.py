"""Ranks that disagree in cached calls, on the compiled internode kernels (issue 16 item 2): 4 GPUs as 2 emulated
NVLink domains of 2 (MOE_DISPATCHER_NVL_SIZE=2). A cached dispatch (along a handle) and a combine run no notify,
so each carries a ring signature per hop (the fields that fix the slot layout of that hop's rings:
docs/internode.md, "Cached calls: ring signatures"). A forwarder or receiver that finds its source's word
differing reads none of that source's slots (dispatch: the forwarder sends zero rows where the handle routed them,
the receiver writes zero rows; combine: the source is left out of the sums), still consumes its rows so that
both sides finish, and records the pair. The next fresh dispatch's notify carries the finding as the rank's
problem word, so every rank refuses that call and raises SignatureMismatch at its host wait, naming the field,
both values and both ranks. The odd rank is the last (domain 1): its rows to domain 0 are caught by its team
member there (RDMA hop), its rows to its domain peer and the rows forwarded to it by that peer on the NVLink
hop. Routing sends token 0 of every rank to every rank. Afterwards the Buffer is usable: cached calls and a fresh
round give exact results.

With a peer pool (the NVLink hop's direct dispatch) the same: a cached dispatch's layout word is its NVLink ring
signature, so a domain where one rank's differs takes the FIFO path (whose receivers catch it), and the forwarders
catch an RDMA-hop difference in either mode; the agreeing run then also races the direct calls' words.

Before the internode ring signatures, no case raised SignatureMismatch: rows were read with another rank's slot
layout (a forwarder read its routing masks from the wrong bytes and ended in the kernels' 30 s timeout, or
combine summed misread rows without an error). The agreeing run makes cached dispatch / combine pairs whose
layout changes per call alike on every rank (hidden, FP8, top-k weights), so a stale word of the previous call
would be caught; nothing is recorded.
"""
from __future__ import annotations

import dataclasses

import pytest
import dist as dist_helpers
from agreement_rounds import H
from cached_agreement import CachedAgreement
from dist import make_buffer, run_distributed

pytestmark = pytest.mark.gpu(4)

WORLD, NVL = 4, 2
ENV = {"MOE_DISPATCHER_TIMEOUT_S": "30", **dist_helpers.nvl_env(NVL)}  # a case that hangs fails in 30 s
AGREEING_CALLS = 300


def _world(rank: int, num_ranks: int, pool_bytes: int) -> list[str]:
    extra = {"num_pool_bytes": pool_bytes} if pool_bytes else {}  # a pool: the NVLink hop's direct dispatch
    buf = make_buffer(hidden_bytes=4 * H * 4, backend="kernels", explicitly_destroy=True, **extra)
    assert buf._kernels is not None and buf._kernels.name == "internode", buf._kernels_why
    assert buf._kernels.nvl_size == NVL and buf._kernels.num_domains == num_ranks // NVL
    # Exact sums: each domain's partial is exact in float32 too.
    s = CachedAgreement(buf, rank, num_ranks)
    x, handle, recv_x, odd = s.x, s.handle, s.recv_x, s.odd
    # The default dispatch config with half the slots of one hop's rings (rows sit at other slots: read with the
    # default's, they would be other rows).
    default = type(buf).get_dispatch_config(num_ranks)
    fewer_rdma = dataclasses.replace(default,
                                     num_max_rdma_chunked_recv_tokens=default.num_max_rdma_chunked_recv_tokens // 2)
    fewer_nvl = dataclasses.replace(default,
                                    num_max_nvl_chunked_recv_tokens=default.num_max_nvl_chunked_recv_tokens // 2)
    cases = [
        ("cached dispatch: hidden on one rank", lambda: buf.dispatch(x.repeat(1, 2) if odd else x, handle=handle),
         r"cached dispatch: .*hidden differs: (256|512) on rank \d; (512|256) on rank \d"),
        ("cached dispatch: FP8 on one rank", lambda: buf.dispatch((s.x8, s.scales) if odd else x, handle=handle),
         r"cached dispatch: .*x dtype differs: .*x_scales dtype differs"),
        ("cached dispatch: dtype of equal row bytes on one rank",
         lambda: buf.dispatch(x.repeat(1, 2).bfloat16() if odd else x, handle=handle),
         r"cached dispatch: .*x dtype differs: (float32|bfloat16) on rank \d; (bfloat16|float32) on rank \d"),
        ("cached dispatch: RDMA ring slots on one rank",
         lambda: buf.dispatch(x, handle=handle, config=fewer_rdma if odd else None),
         r"cached dispatch: .*config\.num_max_rdma_chunked_recv_tokens differs: \d+ on rank \d; \d+ on rank \d"),
        ("cached dispatch: NVLink ring slots on one rank",
         lambda: buf.dispatch(x, handle=handle, config=fewer_nvl if odd else None),
         r"cached dispatch: .*config\.num_max_nvl_chunked_recv_tokens differs: \d+ on rank \d; \d+ on rank \d"),
        ("combine: hidden on one rank", lambda: buf.combine(recv_x.repeat(1, 2) if odd else recv_x, handle),
         r"combine: .*hidden differs: (256|512) on rank \d; (512|256) on rank \d"),
        ("combine: topk_weights on one rank",
         lambda: buf.combine(recv_x, handle, topk_weights=s.recv_w if odd else None),
         r"combine: .*topk_weights columns differs: (0|4) on rank \d; (4|0) on rank \d"),
        ("combine: bfloat16 rows of equal bytes on one rank",
         lambda: buf.combine(recv_x.repeat(1, 2).bfloat16() if odd else recv_x, handle),
         r"combine: .*x dtype differs: (float32|bfloat16) on rank \d; (bfloat16|float32) on rank \d"),
    ]
    # The odd rank receives rows from both hops' disagreeing peers, so it always reports.
    seen = s.run_cases(cases, reporters=(num_ranks - 1,))
    s.run_agreeing(AGREEING_CALLS)
    buf.destroy()
    return seen


@pytest.mark.parametrize("pool_bytes", [0, 1 << 28], ids=["rings", "pool"])
def test_disagreeing_internode_cached_calls_raise_on_every_rank(pool_bytes: int) -> None:
    for line in run_distributed(_world, WORLD, pool_bytes, backend="nccl", env=ENV, timeout=300)[0]:
        print(line)
