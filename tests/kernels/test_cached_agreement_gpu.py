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
import torch
from dist import case, make_buffer, run_distributed

pytestmark = pytest.mark.gpu

T, H, L, K = 64, 256, 4, 4
ENV = {"MOE_DISPATCHER_TIMEOUT_S": "30"}  # a case that hangs fails in 30 s
AGREEING_CALLS = 500


def _routing(rank: int, num_ranks: int) -> torch.Tensor:
    """int64 [T, K]: random experts, token 0 to the first expert of every rank (K >= num_ranks)."""
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(T, L * num_ranks, generator=g).topk(K, dim=1).indices
    idx[0] = torch.tensor([(r % num_ranks) * L + r // num_ranks for r in range(K)])
    return idx.cuda()


def _world(rank: int, num_ranks: int, pool_bytes: int) -> list[str]:
    from moe_dispatcher.signature import SignatureMismatch
    odd = rank == num_ranks - 1
    # With a pool the calls are direct dispatches and pull combines: a disagreeing layout word makes every rank's
    # call go through the ring kernel, whose signature check finds it, as without a pool.
    extra = {"num_pool_bytes": pool_bytes} if pool_bytes else {}
    buf = make_buffer(hidden_bytes=4 * H * 4, backend="kernels", explicitly_destroy=True, **extra)
    assert buf._kernels is not None and buf._kernels.name == "intranode", "the intranode kernels must serve this Buffer"
    idx = _routing(rank, num_ranks)
    # Exact sums: small multiples of 1/16 in float32.
    x = torch.randint(-64, 65, (T, H), generator=torch.Generator().manual_seed(rank)).float().cuda() / 16
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, L * num_ranks)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                              num_tokens_per_expert=nte, topk_idx=idx)
    copies = itr.sum(1, keepdim=True).float()
    rows = recv_x.shape[0]
    recv_w = torch.rand(rows, K, device="cuda")
    scales = torch.ones(T, 4, device="cuda")
    x8 = x.to(torch.float8_e4m3fn)
    # The default dispatch config with half its ring slots (rows sit at other slots: read with the default's, they
    # would be other rows).
    default = type(buf).get_dispatch_config(num_ranks)
    fewer_slots = dataclasses.replace(default,
                                      num_max_nvl_chunked_recv_tokens=default.num_max_nvl_chunked_recv_tokens // 2)

    def fresh_dispatch():
        lay = buf.get_dispatch_layout(idx, L * num_ranks)
        return buf.dispatch(x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                            topk_idx=idx)

    def agreeing_round() -> None:
        """Cached dispatch and combine along the handle, and a fresh round: exact results."""
        got = buf.dispatch(x, handle=handle)[0]
        assert torch.equal(got, recv_x), "cached dispatch after the case gave other rows"
        out, _, _ = buf.combine(got, handle)
        assert torch.equal(out, x * copies), "combine after the case gave wrong sums"
        fresh, _, _, _, h2, _ = fresh_dispatch()
        assert torch.equal(buf.combine(fresh, h2)[0], x * copies), "the fresh round after the case gave wrong sums"

    cases = [
        ("cached dispatch: hidden on one rank", lambda: buf.dispatch(x.repeat(1, 2) if odd else x, handle=handle),
         r"cached dispatch: .*hidden differs: (256|512) on rank \d; (512|256) on rank \d"),
        ("cached dispatch: FP8 on one rank", lambda: buf.dispatch((x8, scales) if odd else x, handle=handle),
         r"cached dispatch: .*x dtype differs: .*x_scales dtype differs"),
        ("cached dispatch: dtype of other row bytes", lambda: buf.dispatch(x.bfloat16() if odd else x, handle=handle),
         r"cached dispatch: .*x dtype differs: (float32|bfloat16) on rank \d; (bfloat16|float32) on rank \d"),
        ("cached dispatch: ring slots on one rank",
         lambda: buf.dispatch(x, handle=handle, config=fewer_slots if odd else None),
         r"cached dispatch: .*config\.num_max_nvl_chunked_recv_tokens differs: \d+ on rank \d; \d+ on rank \d"),
        ("combine: hidden on one rank", lambda: buf.combine(recv_x.repeat(1, 2) if odd else recv_x, handle),
         r"combine: .*hidden differs: (256|512) on rank \d; (512|256) on rank \d"),
        ("combine: topk_weights on one rank", lambda: buf.combine(recv_x, handle, topk_weights=recv_w if odd else None),
         r"combine: .*topk_weights columns differs: (0|4) on rank \d; (4|0) on rank \d"),
        ("combine: bfloat16 rows of equal bytes on one rank",
         lambda: buf.combine(recv_x.repeat(1, 2).bfloat16() if odd else recv_x, handle),
         r"combine: .*x dtype differs"),
    ]
    seen = []
    for label, call, pattern in cases:
        with case(label):
            call()  # moves rows, raises nothing: the receivers record the disagreement
            buf.dispatch(x, handle=handle)  # cached calls go on (no rank raises alone)
            with pytest.raises(SignatureMismatch, match=pattern) as info:
                fresh_dispatch()  # its notify reports the finding on every rank
            text = str(info.value)
            assert f"on rank {num_ranks - 1}, a cached dispatch or combine" in text, text
            assert f"on rank {rank}, a cached dispatch or combine" in text, text
            seen.append(f"{label}: {info.value}")
            agreeing_round()
    with case(f"{AGREEING_CALLS} agreeing cached calls whose layout changes per call alike on every rank"):
        wide = x.repeat(1, 2)
        for i in range(AGREEING_CALLS):
            kind = i % 4
            if kind == 0:
                got = buf.dispatch(x, handle=handle)[0]
                out, w, _ = buf.combine(got, handle)
            elif kind == 1:
                got = buf.dispatch(wide, handle=handle)[0]
                out, w, _ = buf.combine(got, handle, topk_weights=recv_w)
            elif kind == 2:
                got, _ = buf.dispatch((x8, scales), handle=handle)[0]
                out, w, _ = buf.combine(recv_x.bfloat16(), handle)
            else:
                got = buf.dispatch(x.bfloat16(), handle=handle)[0]
                out, w, _ = buf.combine(got.repeat(1, 2), handle, topk_weights=recv_w)
            if i % 50 == kind:
                torch.cuda.synchronize()
                if kind == 0:
                    assert torch.equal(out, x * copies), f"call {i}: wrong sums"
                elif kind == 1:
                    assert torch.equal(out, wide * copies), f"call {i}: wrong sums"
                    assert w is not None and w.shape == (T, K)
        torch.cuda.synchronize()
        assert buf._kernels._ipc.take_ring_mismatch() is None, "an agreeing run recorded a disagreement"
        agreeing_round()  # its fresh dispatch would raise if a receiver had flagged one
    buf.destroy()
    return seen


@pytest.mark.parametrize("pool_bytes", [0, 64 << 20], ids=["ring", "direct"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_disagreeing_cached_calls_raise_on_every_rank(world_size: int, pool_bytes: int) -> None:
    for line in run_distributed(_world, world_size, pool_bytes, backend="nccl", env=ENV, timeout=300)[0]:
        print(line)
