"""Ranks that disagree, on the compiled intranode kernels (issue 16 item 2): the notify of a fresh dispatch
compares every rank's signature hash and problem word, so a call whose ranks pass different arguments raises
the same SignatureMismatch on every rank (naming the field, the values and the ranks, after one all-gather of
the full signatures), before any row moves; the Buffer stays usable. Bad expert ids given to the GPU layout
kernel are reported by the next dispatch on every rank. Calls with num_worst_tokens, which do not wait for
notify, move nothing and report at the next dispatch without it. MOE_DISPATCHER_CHECK_LAYOUT=1 adds the full
layout check. The same world runs on the internode kernels (two emulated NVLink domains).

The last rank is the odd one in every case (the CPU matrix, tests/reference/test_cross_rank_agreement_cpu.py,
also covers every rank off).
"""
from __future__ import annotations

import os

import pytest
import torch
from agreement_rounds import H, K, L, T
from agreement_rounds import exact_round as _round
from agreement_rounds import routing as _routing
from dist import GPU_WORLD_SIZES, case, make_buffer, nvl_env, run_distributed

pytestmark = pytest.mark.gpu

CHECK_LAYOUT_ENV = "MOE_DISPATCHER_CHECK_LAYOUT"


def _world(rank: int, num_ranks: int, kernels: str) -> list[str]:
    from moe_dispatcher import Config
    from moe_dispatcher.signature import SignatureMismatch
    odd = rank == num_ranks - 1
    e = L * num_ranks
    buf = make_buffer(hidden_bytes=4 * H * 4, backend="kernels", explicitly_destroy=True)
    assert buf._kernels is not None and buf._kernels.name == kernels, f"the {kernels} kernels must serve this Buffer"
    idx = _routing(rank, num_ranks)
    w = torch.rand(T, K, device="cuda")
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)

    def dispatch(x_=x, idx_=idx, w_=w, num_experts=e, layout_idx=None, **kw):
        ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx_ if layout_idx is None else layout_idx, num_experts)
        return buf.dispatch(x_, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte,
                            topk_idx=idx_, topk_weights=w_, **kw)

    out_of_range, twice = idx.clone(), idx.clone()
    out_of_range[3, 1] = e + 5
    twice[5, 1] = twice[5, 0]
    cases = [
        ("hidden", lambda: dispatch(x_=x.repeat(1, 2) if odd else x), r"hidden differs: 256 on ranks? .*512 on rank"),
        ("dtype of equal row bytes", lambda: dispatch(x_=x.half() if odd else x), r"x dtype differs: bfloat16"),
        ("FP8 on one rank", lambda: dispatch(x_=(torch.zeros(T, 2 * H, device="cuda").to(torch.float8_e4m3fn),
                                                 torch.ones(T, 4, device="cuda")) if odd else x),
         r"x dtype differs: .*float8_e4m3fn"),
        ("top-k", lambda: dispatch(idx_=torch.cat([idx, torch.full_like(idx[:, :1], -1)], 1) if odd else idx,
                                   w_=torch.cat([w, w[:, :1]], 1) if odd else w), r"top-k differs: 4 on"),
        ("topk_weights on one rank", lambda: dispatch(w_=None if odd else w), r"topk_weights given differs"),
        ("num_experts", lambda: dispatch(num_experts=2 * e if odd else e), r"num_experts differs"),
        ("config", lambda: dispatch(config=Config(num_sms=8) if odd else None), r"config.num_sms differs"),
        ("expert id out of range", lambda: dispatch(idx_=out_of_range if odd else idx),
         rf"on rank {num_ranks - 1}, get_dispatch_layout was given expert ids outside"),
        ("an expert twice in a token", lambda: dispatch(idx_=twice if odd else idx),
         rf"on rank {num_ranks - 1}, get_dispatch_layout was given a token naming one expert twice"),
    ]
    seen = []
    for label, call, pattern in cases:
        with case(label):
            with pytest.raises(SignatureMismatch, match=pattern) as info:
                call()
            assert f"rank {num_ranks - 1}" in str(info.value), str(info.value)
            seen.append(f"{label}: {info.value}")
            _round(buf, rank, num_ranks)
    # Notify refuses the call on every rank, so its data kernels move nothing (tests/kernels/test_refused_calls_gpu.py
    # checks its outputs and time); before that, the internode kernels' two hops ran into a timeout here.
    with case("num_worst_tokens call with a different hidden: reported by the next synchronised dispatch"):
        dispatch(x_=x.repeat(1, 2) if odd else x, num_worst_tokens=T * num_ranks)  # does not wait: no error yet
        with pytest.raises(SignatureMismatch, match=r"hidden differs"):
            dispatch()
        _round(buf, rank, num_ranks)
    with case("expert-major dispatch with a different hidden"):
        # (internode composes expert-major calls from its rank-major dispatch: its operation reads "dispatch")
        with pytest.raises(SignatureMismatch, match=r"dispatch: .*hidden differs"):
            buf.expert_major_dispatch(x.repeat(1, 2) if odd else x, topk_idx=idx, topk_weights=w, num_experts=e)
        _round(buf, rank, num_ranks)
    with case("Buffer creation: num_nvl_bytes on one rank"):
        with pytest.raises(SignatureMismatch, match=r"num_nvl_bytes differs"):
            make_buffer(hidden_bytes=(8 if odd else 4) * H * 4, backend="kernels", explicitly_destroy=True)
        _round(buf, rank, num_ranks)
    buf.destroy()
    with case(f"{CHECK_LAYOUT_ENV}=1: a layout of another topk_idx on one rank"):
        os.environ[CHECK_LAYOUT_ENV] = "1"
        try:
            checked = make_buffer(hidden_bytes=4 * H * 4, backend="kernels", explicitly_destroy=True)
        finally:
            del os.environ[CHECK_LAYOUT_ENV]
        with pytest.raises(SignatureMismatch, match=rf"on rank {num_ranks - 1}, the layout .* is not the one"):
            ntr, _, nte, itr, _ = checked.get_dispatch_layout(_routing(rank, num_ranks, 7) if odd else idx, e)
            checked.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte,
                             topk_idx=idx, topk_weights=w)
        _round(checked, rank, num_ranks)
        checked.destroy()
    return seen


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_disagreeing_ranks_raise_on_every_rank(world_size: int) -> None:
    for line in run_distributed(_world, world_size, "intranode", backend="nccl", timeout=300)[0]:
        print(line)


@pytest.mark.parametrize("world_size", [4])
def test_disagreeing_ranks_raise_on_every_rank_internode(world_size: int) -> None:
    """The same through the internode kernels (2 NVLink domains of 2 emulated with MOE_DISPATCHER_NVL_SIZE):
    their notify carries the signature in each source's flags word."""
    for line in run_distributed(_world, world_size, "internode", backend="nccl", env=nvl_env(2), timeout=300)[0]:
        print(line)
