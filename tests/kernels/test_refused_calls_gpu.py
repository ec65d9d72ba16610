"""Calls whose ranks disagree move no data (issue 16 item 2), on the compiled kernels: notify refuses the call
on every rank alike (csrc/kernels/common/refused_call.cuh), so its data kernels, and those of the calls along
its handle, return at their start on every rank: no rank waits for a peer's rows, nothing moves through ring
offsets of disagreeing sizes, and no ring counter moves. The calls that do not wait for notify
(num_worst_tokens, rank-major and expert-major) still return at once, with defined outputs (padding rows;
zero combine rows), and the next synchronised dispatch raises SignatureMismatch naming the field on every rank;
the Buffer stays usable (docs/semantics.md, "Agreement across ranks").

MOE_DISPATCHER_TIMEOUT_S is 30 here, so a data phase that waited for a peer (before this, the internode
kernels did until the timeout) cannot pass the time limits below. The last rank is the odd one.
"""
from __future__ import annotations

import time

import pytest
import torch
from agreement_rounds import H, K, L, T
from agreement_rounds import exact_round as _round
from agreement_rounds import routing as _routing
from dist import GPU_WORLD_SIZES, case, make_buffer, nvl_env, run_distributed

pytestmark = pytest.mark.gpu

TIMEOUT_ENV = {"MOE_DISPATCHER_TIMEOUT_S": "30"}
DATA_PHASE_S = 10.0  # the refused calls and the calls along their handles, until the device is idle
CASE_S = 20.0        # the same and the synchronised dispatch that raises (one all-gather of the signatures)


def _zero(t: torch.Tensor, what: str) -> None:
    assert torch.count_nonzero(t) == 0, f"{what}: {torch.count_nonzero(t)} non-zero elements (the call moved rows)"


def _all(t: torch.Tensor, value: int, what: str) -> None:
    assert bool((t == value).all()), f"{what}: {int((t != value).sum())} elements are not {value} (rows moved)"


def _world(rank: int, num_ranks: int, kernels: str, pool_bytes: int = 0) -> list[str]:
    from moe_dispatcher import Buffer
    from moe_dispatcher.signature import SignatureMismatch
    odd = rank == num_ranks - 1
    e = L * num_ranks
    extra = {"num_pool_bytes": pool_bytes} if pool_bytes else {}  # a pool: direct dispatch and pull combine
    buf = make_buffer(hidden_bytes=2 * H * 2, backend="kernels", explicitly_destroy=True, **extra)
    assert buf._kernels is not None and buf._kernels.name == kernels, f"the {kernels} kernels must serve this Buffer"
    config = Buffer.get_dispatch_config(num_ranks)  # one config on every rank: only the case's field differs
    idx = _routing(rank, num_ranks)
    w = torch.rand(T, K, device="cuda")
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    wide = x.repeat(1, 2) if odd else x  # hidden 2H on the odd rank
    out_of_range = idx.clone()
    out_of_range[3, 1] = e + 5
    worst = T * num_ranks

    def synchronised_dispatch() -> None:
        ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, e)
        buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx,
                     topk_weights=w, config=config)

    def rank_major(rows: torch.Tensor, routing: torch.Tensor) -> None:
        ntr, _, nte, itr, _ = buf.get_dispatch_layout(routing, e)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            rows, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=routing,
            topk_weights=w, num_worst_tokens=worst, config=config)
        again, *_ = buf.dispatch(rows, handle=handle)  # cached, along the refused call's handle
        out, out_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        torch.cuda.synchronize()
        assert recv_x.shape[0] == worst
        _zero(recv_x, "recv_x")
        _all(recv_idx, -1, "recv_topk_idx")
        _zero(recv_w, "recv_topk_weights")
        _all(handle.recv_src_idx, -1, "recv_src_idx")
        _zero(again, "cached dispatch along the handle")
        _zero(out, "combine along the handle")
        _zero(out_w, "combined top-k weights")

    def expert_major() -> None:
        px, pw, _, tpe, handle, _ = buf.expert_major_dispatch(wide, topk_idx=idx, topk_weights=w, num_experts=e,
                                                              num_worst_tokens=worst * K, config=config)
        again, *_ = buf.expert_major_dispatch(wide, handle=handle)
        out, out_w, _ = buf.expert_major_combine(px, handle, weights=pw, topk_weights=pw)
        torch.cuda.synchronize()
        _zero(px, "permuted_x")
        _zero(pw, "permuted_weights")
        _zero(tpe, "tokens_per_expert")
        assert int(handle.rows_needed) == 0, f"rows_needed {int(handle.rows_needed)}: the refused call counted rows"
        _zero(again, "cached expert-major dispatch along the handle")
        _zero(out, "expert-major combine along the handle")
        _zero(out_w, "combined top-k weights")

    cases = [
        ("num_worst_tokens dispatch with a different hidden", lambda: rank_major(wide, idx), r"hidden differs: 256 on "
         r"ranks? .*512 on rank"),
        ("num_worst_tokens expert-major dispatch with a different hidden", expert_major,
         r"dispatch: .*hidden differs: 256 on ranks? .*512 on rank"),
        ("num_worst_tokens dispatch with bad expert ids on one rank (its problem word)",
         lambda: rank_major(x, out_of_range if odd else idx),
         rf"on rank {num_ranks - 1}, get_dispatch_layout was given expert ids outside"),
    ]
    seen = []
    for label, refused_calls, pattern in cases:
        with case(label):
            start = time.monotonic()
            refused_calls()  # returns without waiting for notify: nothing to raise yet
            took = time.monotonic() - start
            assert took < DATA_PHASE_S, (f"the refused calls took {took:.1f} s: a kernel waited for a peer "
                                         f"(MOE_DISPATCHER_TIMEOUT_S is 30)")
            with pytest.raises(SignatureMismatch, match=pattern) as info:
                synchronised_dispatch()
            took = time.monotonic() - start
            assert took < CASE_S, f"the case took {took:.1f} s"
            seen.append(f"{label}: {took:.1f} s: {info.value}")
            _round(buf, rank, num_ranks)
    buf.destroy()
    return seen


@pytest.mark.parametrize("pool_bytes", [0, 64 << 20], ids=["ring", "direct"])
@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_refused_calls_move_nothing_intranode(world_size: int, pool_bytes: int) -> None:
    for line in run_distributed(_world, world_size, "intranode", pool_bytes, backend="nccl", env=TIMEOUT_ENV,
                                timeout=180)[0]:
        print(line)


@pytest.mark.parametrize("world_size,nvl", [(2, 1), (4, 2), (4, 1)])
def test_refused_calls_move_nothing_internode(world_size: int, nvl: int) -> None:
    """The same through the internode kernels, NVLink domains of `nvl` emulated with MOE_DISPATCHER_NVL_SIZE (2 x 1:
    both hops between two GPUs)."""
    env = {**TIMEOUT_ENV, **nvl_env(nvl)}
    for line in run_distributed(_world, world_size, "internode", backend="nccl", env=env, timeout=180)[0]:
        print(line)
