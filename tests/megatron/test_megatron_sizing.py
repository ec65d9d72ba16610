"""The dispatcher's expert-row budget (integrations/megatron/sizing.py): no host sync, tight M, overflow."""
from __future__ import annotations

import pytest
import torch

from moe_dispatcher.integrations.megatron import sizing


class _FakeDispatcher:
    """What the guard reads of a dispatcher: its group and its row budget."""
    group = None


def _tracked_dispatcher(guard) -> _FakeDispatcher:
    """A dispatcher the guard tracks, its budget exact (headroom 1) and seeded with a need of 100 rows."""
    d = _FakeDispatcher()
    d._row_budget = sizing.ExpertRowBudget(align=1, headroom=1.0)
    d._row_budget.observe(100)
    guard.track(d)
    return d


def test_first_call_exact_then_high_water_with_headroom():
    b = sizing.ExpertRowBudget(align=1, headroom=1.25)
    assert b.rows_for(4096, 8) == 0  # no history: a synchronised call
    b.observe(1000)
    assert b.rows_for(4096, 8) == 1280  # 1250 rounded up to 128
    b.watch(torch.tensor(1200), 1280)  # read LAG calls later, or at the step's end
    assert b.high_water == 1000
    b.settle()
    assert b.high_water == 1200 and b.rows_for(4096, 8) == 1536


def test_overflow_raises_and_capacity_factor_counts():
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


def test_initial_rows_env(monkeypatch):
    monkeypatch.setenv(sizing.INITIAL_ENV, "300")
    assert sizing.ExpertRowBudget(align=1).rows_for(10, 2) == 384


def test_tokens_per_expert_covering():
    tpe = torch.tensor([3, 0, 5], dtype=torch.int32)
    assert sizing.tokens_per_expert_covering(tpe, 12).tolist() == [3, 0, 9]
    assert sizing.tokens_per_expert_covering(tpe, 6).tolist() == [3, 0, 3]  # overflow: still adds up
    # The counts without the tail, for experts that leave it out (GroupedGemmExperts).
    assert sizing.tokens_per_expert_covering(tpe, 12).without_tail.tolist() == [3, 0, 5]
    assert sizing.tokens_per_expert_covering(tpe, 6).without_tail.tolist() == [3, 0, 3]


def test_overflow_widens_the_headroom():
    b = sizing.ExpertRowBudget(align=1, headroom=1.1)
    for want in (1.21, 1.331, 1.4641, 1.5, 1.5):
        b.widen()
        assert b.headroom == pytest.approx(want)
    c = sizing.ExpertRowBudget(align=1, headroom=2.0)  # a setting above the cap is kept
    c.widen()
    assert c.headroom == 2.0


def test_rows_mode(monkeypatch):
    monkeypatch.delenv(sizing.ROWS_ENV, raising=False)
    assert sizing.rows_mode(torch.device("cpu")) == "exact"
    assert sizing.rows_mode(torch.device("cuda", 0)) == "exact"  # training-safe default (see rows_mode)
    monkeypatch.setenv(sizing.ROWS_ENV, "bound")
    assert sizing.rows_mode(torch.device("cuda", 0)) == "bound"
    monkeypatch.setenv(sizing.ROWS_ENV, "sometimes")
    with pytest.raises(ValueError):
        sizing.rows_mode(torch.device("cuda", 0))


def test_default_headroom_and_alignment_slack():
    b = sizing.ExpertRowBudget(align=1, num_local_experts=64)
    b.observe(32892)
    assert b.rows_for(4096, 8) == 36224  # 32892 x 1.1 = 36181.2 -> multiple of 128 (was 41216 at 1.25)
    c = sizing.ExpertRowBudget(align=16, num_local_experts=64, headroom=1.1)
    c.observe(1000)
    assert c.rows_for(4096, 8) == 3072  # 1000 + 2 x 16 x 64 beats 1000 x 1.1


def test_guard_reruns_an_overflowed_step_exactly(monkeypatch):
    from moe_dispatcher.integrations.megatron import guard

    monkeypatch.delenv(sizing.ROWS_ENV, raising=False)

    d = _tracked_dispatcher(guard)
    modes, zeroed = [], []

    def step(need):
        def run():
            modes.append(sizing.rows_mode(torch.device("cuda", 0)))
            if modes[-1] == "guarded":
                d._row_budget.track(torch.tensor(need), d._row_budget.rows_for(10, 2))
            return len(modes)
        return run

    assert guard.run_step(step(300), lambda: zeroed.append(1)) == 2  # M = 128 < 300: re-run, exact
    assert modes == ["guarded", "exact"] and zeroed == [1] and d._row_budget.high_water == 300
    assert d._row_budget.headroom == pytest.approx(1.1)  # the overflow widened it
    assert guard.run_step(step(300), lambda: zeroed.append(1)) == 3  # M = 384 now: fits, no re-run
    assert modes[2:] == ["guarded"] and zeroed == [1] and d._row_budget.headroom == pytest.approx(1.1)
    assert sizing.rows_mode(torch.device("cuda", 0)) == "exact"  # outside a guard
    assert sizing.rows_mode(torch.device("cpu")) == "exact"
    monkeypatch.setenv(sizing.ROWS_ENV, "exact")  # a chosen mode: run_step only runs the step
    assert guard.run_step(step(10_000), lambda: zeroed.append(1)) == 4 and modes[3] == "exact"


def test_guarded_forward_backward_replays_microbatches(monkeypatch):
    """Megatron's forward_backward functions (guard_training_steps wraps get_forward_backward_func): guarded only when
    the config selects our dispatcher; a re-run sees the same microbatches and cleared gradients."""
    from types import SimpleNamespace

    from moe_dispatcher.integrations.megatron import guard, registration

    monkeypatch.delenv(sizing.ROWS_ENV, raising=False)
    seen, cleared = [], []

    class Chunk:
        def __init__(self, backend):
            self.config = SimpleNamespace(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend)

        def zero_grad_buffer(self):
            cleared.append(1)

    overflow = {"left": 1}
    monkeypatch.setattr(guard, "_check_step", lambda: overflow.update(left=overflow["left"] - 1) or
                        overflow["left"] == 0)

    def forward_backward(*, data_iterator, model, num_microbatches, forward_only=False):
        seen.append([next(data_iterator) for _ in range(num_microbatches)])
        return seen[-1]

    wrapped = registration.guard_forward_backward(forward_backward)
    assert registration.guard_forward_backward(wrapped) is wrapped
    data = iter(range(100))
    out = wrapped(data_iterator=data, model=[Chunk("moe_dispatcher")], num_microbatches=3)
    assert out == [0, 1, 2] and seen == [[0, 1, 2], [0, 1, 2]] and cleared == [1]  # re-run on the same data
    assert next(data) == 3
    seen.clear()
    assert wrapped(data_iterator=data, model=[Chunk("deepep")], num_microbatches=2) == [4, 5] and seen == [[4, 5]]


def test_bound_overflow_is_read_lag_calls_later():
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


def test_bound_mode_checks_the_last_calls_at_the_step_end(monkeypatch):
    """bound sizing without a guard: the last LAG calls of a step (and of a run) are read nowhere else, so
    run_step (and check_expert_rows, for loops without it) reads them at the step's end. The overflowing call
    itself must return (its need is only on the device); the error comes from the end of the step."""
    from moe_dispatcher.integrations.megatron import guard

    monkeypatch.setenv(sizing.ROWS_ENV, "bound")

    d = _tracked_dispatcher(guard)
    returned = []

    def step(needs):
        def run():
            for need in needs:
                d._row_budget.watch(torch.tensor(need), d._row_budget.rows_for(10, 2))
                returned.append(need)
            return len(returned)
        return run

    assert guard.run_step(step([50, 60, 70]), lambda: None) == 3  # fits: nothing raised
    with pytest.raises(RuntimeError, match="needed 300 rows"):
        guard.run_step(step([50, 300]), lambda: None)  # the step's last call overflowed
    assert returned[-1] == 300  # the call returned; the step's end raised
    d._row_budget.watch(torch.tensor(400), d._row_budget.rows_for(10, 2))  # the last call of a run
    with pytest.raises(RuntimeError, match="needed 400 rows"):
        guard.check_expert_rows()
    guard.check_expert_rows()  # nothing pending any more


@pytest.mark.gpu
def test_bound_mode_checks_the_last_calls_on_a_gpu(monkeypatch):
    """The same on a GPU, where a call's need travels through pinned memory on a side stream: before, the last
    LAG calls of a run were never read."""
    from moe_dispatcher.integrations.megatron import guard

    monkeypatch.setenv(sizing.ROWS_ENV, "bound")

    d = _tracked_dispatcher(guard)

    def step(needs):
        def run():
            for need in needs:
                d._row_budget.watch(torch.tensor(need, device="cuda"), d._row_budget.rows_for(10, 2))
        return run

    guard.run_step(step([50, 60, 70]), lambda: None)
    with pytest.raises(RuntimeError, match="needed 300 rows"):
        guard.run_step(step([50, 60, 300]), lambda: None)
    d._row_budget.watch(torch.tensor(400, device="cuda"), d._row_budget.rows_for(10, 2))
    with pytest.raises(RuntimeError, match="needed 400 rows"):
        guard.check_expert_rows()
