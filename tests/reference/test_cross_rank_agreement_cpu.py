"""Ranks that disagree (issue 16, items 2 and 6): every class of bad input, on 2 and 4 gloo ranks, with every
rank off ("all": each rank's value depends on its rank, or every rank passes the bad input) and with one rank
off ("one": the last rank only).

Arguments that must agree across ranks (sizes, dtypes, top-k, experts, FP8, config, the handle, the call
itself) travel as a signature in the call's first exchange (moe_dispatcher.signature): every rank raises the
same SignatureMismatch naming the field, the values and the ranks, and the group stays usable, which each case
proves by a correct dispatch / combine round afterwards. A layout that does not match its own topk_idx is a
problem of one rank, raised on every rank through the same exchange. Expert ids out of range and repeated ids
are found by get_dispatch_layout on the rank that passes them (no collective: its peers are not involved).
"""
from __future__ import annotations

import os
from collections.abc import Callable

import oracle
import pytest
import torch
import torch.distributed as dist
from dist import case, make_buffer, run_distributed

T, H, L, K, MAX_T = 8, 128, 2, 2, 8
ENV = {"MOE_DISPATCHER_TIMEOUT_S": "30"}  # a case that hangs fails in 30 s, not the process group's timeout


class _Ctx:
    """One rank's inputs: routing over E = L * R experts, its layout, activations."""

    def __init__(self, rank: int, num_ranks: int) -> None:
        self.rank, self.num_ranks, self.e = rank, num_ranks, L * num_ranks
        self.idx = oracle.make_topk_idx(oracle.generator(1, rank), T, self.e, K, num_ranks, "dense")
        self.other_idx = oracle.make_topk_idx(oracle.generator(9, rank), T, self.e, K, num_ranks, "dense")
        self.w = oracle.make_weights(oracle.generator(3, rank), self.idx, grid=True)
        self.x = oracle.make_x(oracle.generator(2, rank), T, H, "grid")


def _layout(buf, idx: torch.Tensor, e: int) -> dict:
    ntr, ntrr, nte, itr, _ = buf.get_dispatch_layout(idx, e)
    return dict(num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=ntrr, num_tokens_per_expert=nte,
                is_token_in_rank=itr)


def _round(buf, c: _Ctx) -> None:
    """A correct dispatch / combine: each token comes back summed over the ranks it went to."""
    lay = _layout(buf, c.idx, c.e)
    recv_x, _, _, _, handle, _ = buf.dispatch(c.x, topk_idx=c.idx, topk_weights=c.w, **lay)
    out, _, _ = buf.combine(recv_x, handle)
    want = c.x.float() * lay["is_token_in_rank"].sum(1, keepdim=True).float()
    assert torch.equal(out.float(), want), "the round after the case gave wrong sums"


def _ll_round(la, c: _Ctx) -> None:
    x = c.x.to(torch.bfloat16)
    recv, _, handle, _, _ = la.low_latency_dispatch(x, c.idx, MAX_T, c.e, use_fp8=False)
    out, _, _ = la.low_latency_combine(recv, c.idx, c.w, handle)
    assert out.shape == (T, H), "the low-latency round after the case failed"


def _cases(c: _Ctx, a, la) -> list[tuple[str, str, Callable[[bool], object], str]]:
    """(class of bad input, kind, call(bad), regex of the error). kind "agree": every rank raises
    SignatureMismatch; "local": the ranks passing bad input raise ValueError, the others succeed."""
    e, x, idx, w = c.e, c.x, c.idx, c.w
    scale = 1 + c.rank  # "all" variants: each rank's own value

    def odd(bad: bool) -> bool:
        """For inputs of two kinds (a flag, a handle): "all" gives the odd ranks the other kind, "one" the bad rank."""
        return bad and (c.variant == "one" or c.rank % 2 == 1)
    lay = _layout(a, idx, e)

    def dispatch(x_=x, idx_=idx, w_=w, layout=None, **kw):
        return a.dispatch(x_, topk_idx=idx_, topk_weights=w_, **(layout or lay), **kw)

    def wider_idx(extra: int) -> torch.Tensor:  # top-k + extra slots, the extra ones unused
        return torch.cat([idx, torch.full((T, extra), -1, dtype=torch.int64)], dim=1)

    def fp8_x():  # FP8 rows of the same bytes as the bf16 rows (2H e4m3 values), with scales
        return (torch.zeros(T, 2 * H, dtype=torch.float8_e4m3fn), torch.ones(T, 2, dtype=torch.float32))

    fresh = dispatch()
    recv_x, recv_w, handle = fresh[0], fresh[2], fresh[4]
    second = dispatch()
    recv2, handle2 = second[0], second[4]
    out_of_range, twice = idx.clone(), idx.clone()
    out_of_range[0, 0] = e
    twice[0, 1] = twice[0, 0]
    from moe_dispatcher import Config

    def ll_dispatch(bad_hidden=1, bad_e=1, bad_k=0, use_fp8=False):
        xx = torch.zeros(T, H * bad_hidden, dtype=torch.bfloat16)
        ii = idx if not bad_k else torch.cat([idx, torch.full((T, bad_k), -1, dtype=torch.int64)], dim=1)
        return la.low_latency_dispatch(xx, ii, MAX_T, e * bad_e, use_fp8=use_fp8)

    def ll_combine_with(reduction: str):
        recv, _, h, _, _ = la.low_latency_dispatch(x.to(torch.bfloat16), idx, MAX_T, e, use_fp8=False)
        la.low_latency_combine_reduction = reduction
        try:
            return la.low_latency_combine(recv, idx, w, h)
        finally:
            la.low_latency_combine_reduction = "per_rank"

    def new_buffer(**kw):
        b = make_buffer(hidden_bytes=H * 2, **kw)
        b.destroy()

    def nvl_env_buffer(bad: bool):
        os.environ["MOE_DISPATCHER_NVL_SIZE"] = str(1 + c.rank % 2 if c.variant == "all" else 1) if bad else ""
        try:
            new_buffer()
        finally:
            os.environ.pop("MOE_DISPATCHER_NVL_SIZE", None)

    def check_layout_env_buffer(bad: bool):
        os.environ["MOE_DISPATCHER_CHECK_LAYOUT"] = "1" if odd(bad) else ""
        try:
            new_buffer()
        finally:
            os.environ.pop("MOE_DISPATCHER_CHECK_LAYOUT", None)

    return [
        # ---- Buffer creation
        ("Buffer: num_nvl_bytes", "agree",
         lambda bad: _buffer_of_nvl_bytes(bad, c), r"Buffer creation: .*num_nvl_bytes differs"),
        ("Buffer: MOE_DISPATCHER_NVL_SIZE", "agree", nvl_env_buffer, r"Buffer creation: .*NVLink domain size differs"),
        ("Buffer: MOE_DISPATCHER_CHECK_LAYOUT", "agree", check_layout_env_buffer,
         r"Buffer creation: .*MOE_DISPATCHER_CHECK_LAYOUT differs"),
        ("Buffer: low_latency_mode", "agree",
         lambda bad: new_buffer(low_latency=odd(bad), max_tokens=MAX_T,
                                hidden=H, num_experts=e), r"low_latency_mode differs"),
        ("Buffer: backend", "agree",
         lambda bad: new_buffer(backend="reference" if odd(bad) else "auto"),
         r"backend differs: (auto|reference) on rank"),
        # ---- dispatch
        ("dispatch: hidden", "agree", lambda bad: dispatch(x_=x.repeat(1, scale if bad else 1)),
         r"dispatch: .*hidden differs"),
        ("dispatch: dtype of equal row bytes", "agree",
         lambda bad: dispatch(x_=x.half() if odd(bad) else x),
         r"x dtype differs: .*(float16|bfloat16)"),
        ("dispatch: FP8 on some ranks", "agree",
         lambda bad: dispatch(x_=fp8_x() if odd(bad) else x),
         r"x dtype differs: .*float8_e4m3fn.*x_scales dtype differs"),
        ("dispatch: top-k", "agree",
         lambda bad: dispatch(idx_=wider_idx(scale), w_=torch.cat([w, torch.zeros(T, scale)], 1)) if bad else
         dispatch(), r"top-k differs"),
        ("dispatch: topk_weights on some ranks", "agree",
         lambda bad: dispatch(w_=None if odd(bad) else w),
         r"topk_weights given differs: (yes|no) on rank"),
        ("dispatch: num_experts", "agree",
         lambda bad: dispatch(layout=_layout(a, idx, e * scale)) if bad else dispatch(), r"num_experts differs"),
        ("dispatch: config", "agree",
         lambda bad: dispatch(config=Config(num_sms=20 + 2 * scale) if bad else None),
         r"config.num_sms differs"),
        ("dispatch: layout of another topk_idx", "agree",
         lambda bad: dispatch(layout=_layout(a, c.other_idx, e) if bad else None),
         r"on rank \d+, the layout .* is not the one get_dispatch_layout gives"),
        ("dispatch: num_tokens_per_expert of 2E experts", "agree",
         lambda bad: dispatch(layout=dict(lay, num_tokens_per_expert=_layout(a, idx, 2 * e)["num_tokens_per_expert"])
                              if bad else None), r"(num_experts differs|on rank \d+, the layout)"),
        ("dispatch: layout sums, no topk_idx", "agree",
         lambda bad: a.dispatch(x, **dict(lay, num_tokens_per_expert=torch.zeros_like(lay["num_tokens_per_expert"])
                                          if bad else lay["num_tokens_per_expert"])),
         r"on rank \d+, num_tokens_per_expert does not add up"),
        ("ranks in different calls", "agree",
         lambda bad: a.combine(recv_x, handle) if odd(bad) else dispatch(),
         r"the ranks are in different calls: dispatch on rank"),
        # ---- cached dispatch and combine
        ("cached dispatch: hidden", "agree", lambda bad: a.dispatch(x.repeat(1, scale if bad else 1), handle=handle),
         r"cached dispatch: .*hidden differs"),
        ("cached dispatch: handle of another dispatch", "agree",
         lambda bad: a.dispatch(x, handle=handle if odd(bad) else handle2), r"cached dispatch: .*handle differs"),
        ("combine: hidden", "agree", lambda bad: a.combine(recv_x.repeat(1, scale if bad else 1), handle),
         r"combine: .*hidden differs"),
        ("combine: dtype of equal row bytes", "agree",
         lambda bad: a.combine(recv_x.half() if odd(bad) else recv_x, handle),
         r"combine: .*x dtype differs"),
        ("combine: topk_weights on some ranks", "agree",
         lambda bad: a.combine(recv_x, handle, topk_weights=None if odd(bad)
                               else recv_w), r"combine: .*topk_weights columns differs"),
        ("combine: handle of another dispatch", "agree",
         lambda bad: a.combine(recv_x if odd(bad) else recv2, handle if odd(bad) else handle2),
         r"combine: .*handle differs"),
        # ---- low-latency
        ("LL dispatch: use_fp8 on some ranks", "agree",
         lambda bad: ll_dispatch(use_fp8=odd(bad)), r"use_fp8 differs"),
        ("LL dispatch: hidden", "agree", lambda bad: ll_dispatch(bad_hidden=scale if bad else 1),
         r"low-latency dispatch: .*hidden differs"),
        ("LL dispatch: num_experts", "agree", lambda bad: ll_dispatch(bad_e=scale if bad else 1),
         r"num_experts differs"),
        ("LL dispatch: top-k", "agree", lambda bad: ll_dispatch(bad_k=scale if bad else 0), r"top-k differs"),
        ("LL combine: reduction order", "agree",
         lambda bad: ll_combine_with("per_expert" if odd(bad) else "per_rank"),
         r"reduction differs"),
        # ---- expert ids (found by the rank that passes them)
        ("layout: expert id == num_experts", "local",
         lambda bad: a.get_dispatch_layout(out_of_range if bad else idx, e),
         r"expert id"),
        ("layout: an expert twice in a token", "local", lambda bad: a.get_dispatch_layout(twice if bad else idx, e),
         r"same expert twice"),
    ]


def _buffer_of_nvl_bytes(bad: bool, c: _Ctx) -> None:
    from moe_dispatcher import Buffer
    size = 1 << 22
    if bad:
        size += 4096 * (c.rank + 1 if c.variant == "all" else 1)
    Buffer(num_nvl_bytes=size, backend="reference").destroy()


def _worker(rank: int, num_ranks: int, variant: str) -> list[tuple[str, str]]:
    from moe_dispatcher.signature import SignatureMismatch
    c = _Ctx(rank, num_ranks)
    c.variant = variant
    a = make_buffer(hidden_bytes=H * 4)
    la = make_buffer(low_latency=True, max_tokens=MAX_T, hidden=4 * H, num_experts=4 * c.e)
    outcomes = []
    for label, kind, call, pattern in _cases(c, a, la):
        bad = variant == "all" or rank == num_ranks - 1
        with case(f"{label} ({variant})"):
            if kind == "agree":
                with pytest.raises(SignatureMismatch, match=pattern) as info:
                    call(bad)
                if variant == "one":  # the odd rank is named, and so are the others
                    assert f"rank {num_ranks - 1}" in str(info.value), f"{label}: {info.value}"
                outcome = "SignatureMismatch on every rank"
            else:
                if bad:
                    with pytest.raises(ValueError, match=pattern):
                        call(bad)
                else:
                    call(bad)
                outcome = "ValueError on the ranks passing it, peers unaffected"
            _round(a, c)
            _ll_round(la, c)
            if rank == 0:
                outcomes.append((label, outcome))
    dist.barrier()
    return outcomes


@pytest.mark.parametrize("variant", ["all", "one"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_disagreeing_ranks_raise_on_every_rank(world_size: int, variant: str) -> None:
    """Every class of disagreeing or bad input raises by name (field, values, ranks), never hangs or crashes,
    and leaves the group usable."""
    outcomes = run_distributed(_worker, world_size, variant, env=ENV, timeout=280)[0]
    for label, outcome in outcomes:
        print(f"| {label} | {world_size} ranks, {variant} | {outcome} |")


def _topology_with_nvl_size_on_last_rank(rank: int, num_ranks: int) -> str:
    """MOE_DISPATCHER_NVL_SIZE set on the last rank only: Topology.from_group must raise on every rank (before,
    the last rank took the variable and the others waited alone in the hostname gather)."""
    from moe_dispatcher.topology import NVL_SIZE_ENV, Topology

    os.environ.pop(NVL_SIZE_ENV, None)
    if rank == num_ranks - 1:
        os.environ[NVL_SIZE_ENV] = "1"
    try:
        Topology.from_group(dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_nvl_size_variable_on_one_rank_raises_on_every_rank(num_ranks):
    messages = run_distributed(_topology_with_nvl_size_on_last_rank, num_ranks, env=ENV, timeout=60)
    for rank, message in enumerate(messages):
        assert "MOE_DISPATCHER_NVL_SIZE differs" in message and f"rank {num_ranks - 1}: '1'" in message \
            and "rank 0: unset" in message, (rank, message)
