"""The dispatcher's expert-row budget (integrations/megatron/sizing.py): exact by default; with bound sizing
no host sync, a tight M, overflow raised by the step's end."""
from __future__ import annotations

import pytest
import torch

from moe_dispatcher.integrations.megatron import sizing
from tests.helpers.dist import run_distributed


@pytest.fixture
def bound(monkeypatch):
    """$MOE_DISPATCHER_EXPERT_ROWS=bound: the fixed-row sizing these tests exercise."""
    monkeypatch.setenv(sizing.ROWS_ENV, "bound")


class _FakeDispatcher:
    """What the step-end check reads of a dispatcher: its group and its row budget."""
    group = None


def _tracked_dispatcher(guard) -> _FakeDispatcher:
    """A dispatcher the step-end check tracks, its budget tight (headroom 1) and seeded with a need of 100
    rows."""
    d = _FakeDispatcher()
    d._row_budget = sizing.ExpertRowBudget(align=1, headroom=1.0)
    d._row_budget.observe(100)
    guard.track(d)
    return d


def test_first_call_exact_then_high_water_with_headroom(bound):
    b = sizing.ExpertRowBudget(align=1, headroom=1.25)
    assert b.rows_for(4096, 8) == 0  # no history: a synchronised call
    b.observe(1000)
    assert b.rows_for(4096, 8) == 1280  # 1250 rounded up to 128
    b.watch(torch.tensor(1200), 1280)  # read LAG calls later, or at the step's end
    assert b.high_water == 1000
    b.settle()
    assert b.high_water == 1200 and b.rows_for(4096, 8) == 1536


def test_overflow_raises_and_capacity_factor_counts(bound):
    b = sizing.ExpertRowBudget(align=16, headroom=1.0)
    b.observe(100)
    b.watch(torch.tensor(300), 128)
    with pytest.raises(RuntimeError, match="sized for 128"):
        b.settle()
    c = sizing.ExpertRowBudget(align=32, capacity_factor=1.5)
    assert c.rows_for(100, 8) == 1280  # 1200 -> multiple of lcm(128, 32)
    c.watch(torch.tensor(2000), 1280)
    c.settle()
    assert c.dropped_calls == 1


def test_initial_rows_env(monkeypatch, bound):
    monkeypatch.setenv(sizing.INITIAL_ENV, "300")
    assert sizing.ExpertRowBudget(align=1).rows_for(10, 2) == 384


def test_tokens_per_expert_covering():
    tpe = torch.tensor([3, 0, 5], dtype=torch.int32)
    assert sizing.tokens_per_expert_covering(tpe, 12).tolist() == [3, 0, 9]
    assert sizing.tokens_per_expert_covering(tpe, 6).tolist() == [3, 0, 3]  # overflow: still adds up
    # The counts without the tail, for experts that leave it out (GroupedGemmExperts).
    assert sizing.tokens_per_expert_covering(tpe, 12).without_tail.tolist() == [3, 0, 5]
    assert sizing.tokens_per_expert_covering(tpe, 6).without_tail.tolist() == [3, 0, 3]


def test_rows_setting(monkeypatch):
    monkeypatch.delenv(sizing.ROWS_ENV, raising=False)
    assert sizing.rows_setting() == "exact"
    monkeypatch.setenv(sizing.ROWS_ENV, "bound")
    assert sizing.rows_setting() == "bound"
    monkeypatch.setenv(sizing.ROWS_ENV, "sometimes")
    with pytest.raises(ValueError):
        sizing.rows_setting()


def test_default_headroom_and_alignment_slack(bound):
    b = sizing.ExpertRowBudget(align=1, num_local_experts=64)
    b.observe(32892)
    assert b.rows_for(4096, 8) == 36224  # 32892 x 1.1 = 36181.2 -> multiple of 128 (was 41216 at 1.25)
    c = sizing.ExpertRowBudget(align=16, num_local_experts=64, headroom=1.1)
    c.observe(1000)
    assert c.rows_for(4096, 8) == 3072  # 1000 + 2 x 16 x 64 beats 1000 x 1.1


def test_default_sizing_is_exact_in_a_training_step(monkeypatch):
    """Unset, every call is exact (M = 0: a synchronised dispatch), also in a step run by run_step and with a
    high-water mark known. Before: fixed M (mark x 1.1) there on GPUs, an overflow re-running the step."""
    from moe_dispatcher.integrations.megatron import guard

    monkeypatch.delenv(sizing.ROWS_ENV, raising=False)
    d = _tracked_dispatcher(guard)
    assert d._row_budget.rows_for(4096, 8) == 0
    assert guard.run_step(lambda: d._row_budget.rows_for(4096, 8)) == 0
    assert sizing.ExpertRowBudget(align=1, capacity_factor=1.5).rows_for(100, 8) == 1280  # the config's budget


def test_checked_forward_backward(monkeypatch, bound):
    """Megatron's forward_backward functions (guard_training_steps wraps get_forward_backward_func): each call
    runs once, on the data iterator it was given, and its fixed-row calls are checked at its end."""
    from moe_dispatcher.integrations.megatron import guard, registration

    d = _tracked_dispatcher(guard)
    seen = []

    def forward_backward(*, data_iterator, model, num_microbatches, forward_only=False):
        seen.append([next(data_iterator) for _ in range(num_microbatches)])
        for need in seen[-1]:
            d._row_budget.watch(torch.tensor(need), d._row_budget.rows_for(10, 2))
        return seen[-1]

    wrapped = registration.guard_forward_backward(forward_backward)
    assert registration.guard_forward_backward(wrapped) is wrapped
    data = iter([50, 60, 70, 80, 300, 90])
    assert wrapped(data_iterator=data, model=[], num_microbatches=3) == [50, 60, 70] and seen == [[50, 60, 70]]
    with pytest.raises(RuntimeError, match="needed 300 rows"):  # the last call but one: read at the end
        wrapped(data_iterator=data, model=[], num_microbatches=3)
    assert seen[-1] == [80, 300, 90]


def test_bound_overflow_is_read_lag_calls_later(bound):
    """bound sizing: a call's need is read LAG calls later, before that later call's dispatch (every rank
    reads the same call, so all raise alike)."""
    b = sizing.ExpertRowBudget(align=1, headroom=1.0)
    b.observe(100)
    m = b.rows_for(10, 2)
    b.watch(torch.tensor(300), m)  # call 1 overflows
    for _ in range(sizing.LAG):  # calls 2 and 3 (their rows_for read calls up to LAG calls back: none yet)
        b.watch(torch.tensor(50), b.rows_for(10, 2))
    with pytest.raises(RuntimeError, match=f"needed 300 rows .* sized for {m}"):
        b.rows_for(10, 2)  # call 4: reads call 1 before its dispatch


def test_bound_mode_checks_the_last_calls_at_the_step_end(bound):
    """bound sizing: the last LAG calls of a step (and of a run) are read nowhere else, so
    run_step (and check_expert_rows, for loops without it) reads them at the step's end. The overflowing call
    itself must return (its need is only on the device); the error comes from the end of the step."""
    from moe_dispatcher.integrations.megatron import guard

    d = _tracked_dispatcher(guard)
    returned = []

    def step(needs):
        def run():
            for need in needs:
                d._row_budget.watch(torch.tensor(need), d._row_budget.rows_for(10, 2))
                returned.append(need)
            return len(returned)
        return run

    assert guard.run_step(step([50, 60, 70])) == 3  # fits: nothing raised
    with pytest.raises(RuntimeError, match="needed 300 rows"):
        guard.run_step(step([50, 300]))  # the step's last call overflowed
    assert returned[-1] == 300  # the call returned; the step's end raised
    d._row_budget.watch(torch.tensor(400), d._row_budget.rows_for(10, 2))  # the last call of a run
    with pytest.raises(RuntimeError, match="needed 400 rows"):
        guard.check_expert_rows()
    guard.check_expert_rows()  # nothing pending any more


@pytest.mark.gpu
def test_bound_mode_checks_the_last_calls_on_a_gpu(bound):
    """The same on a GPU, where a call's need travels through pinned memory on a side stream: before, the last
    LAG calls of a run were never read."""
    from moe_dispatcher.integrations.megatron import guard

    d = _tracked_dispatcher(guard)

    def step(needs):
        def run():
            for need in needs:
                d._row_budget.watch(torch.tensor(need, device="cuda"), d._row_budget.rows_for(10, 2))
        return run

    guard.run_step(step([50, 60, 70]))
    with pytest.raises(RuntimeError, match="needed 300 rows"):
        guard.run_step(step([50, 60, 300]))
    d._row_budget.watch(torch.tensor(400, device="cuda"), d._row_budget.rows_for(10, 2))
    with pytest.raises(RuntimeError, match="needed 400 rows"):
        guard.check_expert_rows()


def _ranks_size_alike(rank: int, world_size: int) -> tuple[int, bool]:
    """Rank r's exact first call needed 100 * (r + 1) rows; its first fixed M, and whether a group-wide need
    of 230 rows overflowed that M (settle raised)."""
    b = sizing.ExpertRowBudget(align=1, headroom=1.0, group=torch.distributed.group.WORLD)
    b.observe(100 * (rank + 1))
    m = b.rows_for(4096, 8)
    b.watch(torch.tensor(230), m)  # reduced over the group inside watch: 230 on every rank
    try:
        b.settle()
    except RuntimeError:
        return m, True
    return m, False


def test_bound_sizing_gives_every_rank_the_same_m():
    """The mark an exact call seeds is this rank's own count; the first fixed M comes from its maximum over the
    group, so the ranks size alike and an overflow raises on every rank or none (here none: M = 256 covers
    230). With each rank's own mark, rank 0 would take M = 128 and raise alone while rank 1 went on."""
    results = run_distributed(_ranks_size_alike, 2, env={sizing.ROWS_ENV: "bound"})
    assert results == [(256, False), (256, False)], results


def _sizing_variable_on_last_rank(rank: int, world_size: int, name: str, value: str) -> str:
    """`name` = `value` on the last rank only (bound sizing everywhere): the first call's agreement must raise
    on every rank."""
    import os

    if rank == world_size - 1:
        os.environ[name] = value
    b = sizing.ExpertRowBudget(align=1, group=torch.distributed.group.WORLD)
    try:
        b.rows_for(4096, 8)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("name,value", [(sizing.HEADROOM_ENV, "1.5"), (sizing.INITIAL_ENV, "300"),
                                        (sizing.HEADROOM_ENV, "0.5"), (sizing.INITIAL_ENV, "-3")])
def test_sizing_variable_on_one_rank_raises_on_every_rank(name, value):
    """Before, each rank read its own: a headroom set on one rank gave it another M (one rank raising alone on an
    overflow, the other waiting in its next collective), an initial M on one rank made it skip the exact call
    that its peers made. A value only one rank cannot parse is reported alike (a headroom below 1 once raised
    alone, when the budget was made, while its peers went on to wait in the first call's gather)."""
    messages = run_distributed(_sizing_variable_on_last_rank, 2, name, value, env={sizing.ROWS_ENV: "bound"})
    for message in messages:
        assert f"{name} differs" in message and f"rank 1: {value!r}" in message and "rank 0: unset" in message, \
            messages

