"""Ranks that disagree in cached calls, on the compiled intranode kernels (issue 16 item 2): a cached dispatch
(along a handle) and a combine run no notify, so each carries a ring signature (the fields that fix a ring's
slot layout) with the first row of every ring (csrc/kernels/common/ring_signature.cuh). A receiver that finds
its source's signature differing reads none of that source's slots (dispatch: zero rows; combine: the source
is left out of the sums), still consumes its rows so that both sides finish, and records the pair. The next
fresh dispatch's notify carries the finding as the rank's problem word, so every rank refuses that call and
raises SignatureMismatch at its host wait, naming the field, both values and both ranks (from every rank's
recorded pairs). Routing sends token 0 of every rank to every rank, so every rank finds the odd one (and it
finds every other). Afterwards the Buffer is usable: cached calls and a fresh round give exact results.

Before the ring signature, each case below passed without an error (rows read with another rank's slot layout),
ring slots on one rank (num_max_nvl_chunked_recv_tokens, the config field a caller most easily sets per rank)
included; none can hang (row counts agree), and a hang would end in the kernels' 30 s timeout.
The agreeing run makes 500 cached dispatch / combine pairs whose layout changes per call alike on every rank
(hidden, FP8, top-k weights), so a stale signature of the previous call would be caught; nothing is recorded.
"""
from __future__ import annotations

import dataclasses

import pytest
from agreement_rounds import H
from cached_agreement import CachedAgreement
from dist import make_buffer, run_distributed

pytestmark = pytest.mark.gpu

ENV = {"MOE_DISPATCHER_TIMEOUT_S": "30"}  # a case that hangs fails in 30 s
AGREEING_CALLS = 500


def _world(rank: int, num_ranks: int, pool_bytes: int) -> list[str]:
    # With a pool the calls are direct dispatches and pull combines: a disagreeing layout word makes every rank's
    # call go through the ring kernel, whose signature check finds it, as without a pool.
    extra = {"num_pool_bytes": pool_bytes} if pool_bytes else {}
    buf = make_buffer(hidden_bytes=4 * H * 4, backend="kernels", explicitly_destroy=True, **extra)
    assert buf._kernels is not None and buf._kernels.name == "intranode", "the intranode kernels must serve this Buffer"
    s = CachedAgreement(buf, rank, num_ranks)
    x, handle, recv_x, odd = s.x, s.handle, s.recv_x, s.odd
    # The default dispatch config with half its ring slots (rows sit at other slots: read with the default's, they
    # would be other rows).
    default = type(buf).get_dispatch_config(num_ranks)
    fewer_slots = dataclasses.replace(default,
                                      num_max_nvl_chunked_recv_tokens=default.num_max_nvl_chunked_recv_tokens // 2)
    cases = [
        ("cached dispatch: hidden on one rank", lambda: buf.dispatch(x.repeat(1, 2) if odd else x, handle=handle),
         r"cached dispatch: .*hidden differs: (256|512) on rank \d; (512|256) on rank \d"),
        ("cached dispatch: FP8 on one rank", lambda: buf.dispatch((s.x8, s.scales) if odd else x, handle=handle),
         r"cached dispatch: .*x dtype differs: .*x_scales dtype differs"),
        ("cached dispatch: dtype of other row bytes", lambda: buf.dispatch(x.bfloat16() if odd else x, handle=handle),
         r"cached dispatch: .*x dtype differs: (float32|bfloat16) on rank \d; (bfloat16|float32) on rank \d"),
        ("cached dispatch: ring slots on one rank",
         lambda: buf.dispatch(x, handle=handle, config=fewer_slots if odd else None),
         r"cached dispatch: .*config\.num_max_nvl_chunked_recv_tokens differs: \d+ on rank \d; \d+ on rank \d"),
        ("combine: hidden on one rank", lambda: buf.combine(recv_x.repeat(1, 2) if odd else recv_x, handle),
         r"combine: .*hidden differs: (256|512) on rank \d; (512|256) on rank \d"),
        ("combine: topk_weights on one rank",
         lambda: buf.combine(recv_x, handle, topk_weights=s.recv_w if odd else None),
         r"combine: .*topk_weights columns differs: (0|4) on rank \d; (4|0) on rank \d"),
        ("combine: bfloat16 rows of equal bytes on one rank",
         lambda: buf.combine(recv_x.repeat(1, 2).bfloat16() if odd else recv_x, handle),
         r"combine: .*x dtype differs"),
    ]
    # Token 0 of every rank reaches every rank, so every rank finds the odd one (and the odd one every other).
    seen = s.run_cases(cases, reporters=(num_ranks - 1, rank))
    s.run_agreeing(AGREEING_CALLS)
    buf.destroy()
    return seen


@pytest.mark.parametrize("pool_bytes", [0, 64 << 20], ids=["ring", "direct"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_disagreeing_cached_calls_raise_on_every_rank(world_size: int, pool_bytes: int) -> None:
    for line in run_distributed(_world, world_size, pool_bytes, backend="nccl", env=ENV, timeout=300)[0]:
        print(line)
