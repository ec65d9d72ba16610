"""The Megatron integration's environment variables (issue 16 item 5), through their readers: garbage, nan and
inf raise ValueError naming the variable, the value and what is accepted; unset or empty is the default."""
from __future__ import annotations

import re

import pytest
from moe_dispatcher.integrations.megatron import buffers, sizing
from moe_dispatcher.integrations.megatron.dispatcher import LL_MAX_TOKENS_ENV, fixed_max_tokens_per_rank


def _raises(name: str, raw: str, accepted: str, call) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{name}={raw!r}") + ".*" + re.escape(accepted)):
        call()


@pytest.mark.parametrize("raw", ["sometimes", "exactly", "1"])
def test_expert_rows_mode(monkeypatch, raw):
    monkeypatch.setenv(sizing.ROWS_ENV, raw)
    _raises(sizing.ROWS_ENV, raw, "one of exact, bound", sizing.rows_setting)


@pytest.mark.parametrize("raw", ["auto", "AUTO"])
def test_expert_rows_auto_is_refused(monkeypatch, raw):
    """The guarded fixed-row mode is gone (exact sizing measured faster): its name is refused, naming the
    variable and the accepted values, by the setting and by a dispatch's sizing. Before: 'auto' was the
    default mode."""
    monkeypatch.setenv(sizing.ROWS_ENV, raw)
    _raises(sizing.ROWS_ENV, raw, "one of exact, bound", sizing.rows_setting)
    budget = sizing.ExpertRowBudget(align=1)
    budget.observe(100)
    _raises(sizing.ROWS_ENV, raw, "one of exact, bound", lambda: budget.rows_for(10, 2))


def test_expert_rows_mode_valid(monkeypatch):
    for raw, want in (("", "exact"), ("BOUND", "bound"), (" exact ", "exact")):
        monkeypatch.setenv(sizing.ROWS_ENV, raw)
        assert sizing.rows_setting() == want


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "0.9", "1.1x", "abc"])
def test_headroom(monkeypatch, raw):
    """Before: nan and inf were accepted (nan < 1 is False) and garbage failed in float() without the name. Parsed
    at the budget's first call, after the ranks agreed on the raw value (sizing.ExpertRowBudget._agree_settings)."""
    monkeypatch.setenv(sizing.HEADROOM_ENV, raw)
    budget = sizing.ExpertRowBudget(align=1)
    _raises(sizing.HEADROOM_ENV, raw, "a finite number >= 1.0", lambda: budget.rows_for(10, 2))


@pytest.mark.parametrize("headroom", [float("nan"), float("inf"), 0.5])
def test_headroom_argument(headroom):
    with pytest.raises(ValueError, match="headroom must be a finite number >= 1"):
        sizing.ExpertRowBudget(align=1, headroom=headroom)


def _headroom_after_first_call() -> float:
    budget = sizing.ExpertRowBudget(align=1)
    budget.rows_for(10, 2)
    return budget.headroom


def test_headroom_valid(monkeypatch):
    monkeypatch.setenv(sizing.HEADROOM_ENV, "1.25")
    assert _headroom_after_first_call() == 1.25
    monkeypatch.delenv(sizing.HEADROOM_ENV)
    assert _headroom_after_first_call() == sizing.DEFAULT_HEADROOM
    monkeypatch.setenv(sizing.HEADROOM_ENV, "")  # empty is unset (before: float('') raised)
    assert _headroom_after_first_call() == sizing.DEFAULT_HEADROOM


@pytest.mark.parametrize("raw", ["200.5", "-1", "nan", "inf", "lots"])
def test_initial_rows(monkeypatch, raw):
    monkeypatch.setenv(sizing.ROWS_ENV, "bound")  # the initial row count is bound sizing's
    monkeypatch.setenv(sizing.INITIAL_ENV, raw)
    budget = sizing.ExpertRowBudget(align=1)
    _raises(sizing.INITIAL_ENV, raw, "an integer >= 0", lambda: budget.rows_for(10, 2))


def test_initial_rows_valid(monkeypatch):
    monkeypatch.setenv(sizing.ROWS_ENV, "bound")
    monkeypatch.setenv(sizing.INITIAL_ENV, "0")
    assert sizing.ExpertRowBudget(align=1).rows_for(10, 2) == 0  # 0: the first call is exact
    monkeypatch.setenv(sizing.INITIAL_ENV, "200")
    assert sizing.ExpertRowBudget(align=1).rows_for(10, 2) == 256
    monkeypatch.setenv(sizing.INITIAL_ENV, "")  # empty is unset (before: int('') raised)
    assert sizing.ExpertRowBudget(align=1).rows_for(10, 2) == 0


@pytest.mark.parametrize("raw", ["0", "-4", "4096.0", "nan", "inf", "many"])
def test_ll_max_tokens(monkeypatch, raw):
    monkeypatch.setenv(LL_MAX_TOKENS_ENV, raw)
    _raises(LL_MAX_TOKENS_ENV, raw, "an integer >= 1", fixed_max_tokens_per_rank)


def test_ll_max_tokens_valid(monkeypatch):
    monkeypatch.setenv(LL_MAX_TOKENS_ENV, "4096")
    assert fixed_max_tokens_per_rank() == 4096
    monkeypatch.setenv(LL_MAX_TOKENS_ENV, "")
    assert fixed_max_tokens_per_rank() is None
    monkeypatch.setenv(LL_MAX_TOKENS_ENV, "0")  # before: 0 was taken as the bound
    _raises(LL_MAX_TOKENS_ENV, "0", "an integer >= 1", fixed_max_tokens_per_rank)


def test_buffer_backend(monkeypatch):
    monkeypatch.setenv("MOE_DISPATCHER_BACKEND", "kernel")
    _raises("MOE_DISPATCHER_BACKEND", "kernel", "one of auto, reference, kernels", buffers.buffer_backend)
    monkeypatch.setenv("MOE_DISPATCHER_BACKEND", "kernels")
    assert buffers.buffer_backend() == "kernels"
    monkeypatch.setenv("MOE_DISPATCHER_BACKEND", "auto")
    assert buffers.buffer_backend() is None


def _ll_max_tokens_on_last_rank(rank: int, world_size: int) -> str:
    """$MOE_DISPATCHER_LL_MAX_TOKENS_PER_RANK on the last rank only: the low-latency dispatcher's first call must
    raise on every rank (before, that rank skipped the per-call all-reduce its peers waited in)."""
    import os
    import types

    import torch.distributed as dist
    from moe_dispatcher.integrations.megatron.dispatcher import MoEDispatcherLowLatencyTokenDispatcher

    if rank == world_size - 1:
        os.environ[LL_MAX_TOKENS_ENV] = "64"
    dispatcher = types.SimpleNamespace(group=dist.group.WORLD, _max_tokens_agreed=False)
    try:
        MoEDispatcherLowLatencyTokenDispatcher._agree_fixed_max_tokens(dispatcher)
    except ValueError as e:
        return str(e)
    return "no error"


def test_ll_max_tokens_on_one_rank_raises_on_every_rank():
    from tests.helpers.dist import run_distributed

    for message in run_distributed(_ll_max_tokens_on_last_rank, 2):
        assert f"{LL_MAX_TOKENS_ENV} differs" in message and "rank 1: '64'" in message and "rank 0: unset" in message, \
            message
