"""The dispatcher's expert-row budget (integrations/megatron/sizing.py): no host sync, tight M, overflow."""
from __future__ import annotations

import pytest
import torch

from moe_dispatcher.integrations.megatron import sizing


def test_first_call_exact_then_high_water_with_headroom():
    b = sizing.ExpertRowBudget(align=1, headroom=1.25)
    assert b.rows_for(4096, 8) == 0  # no history: a synchronised call
    b.observe(1000)
    assert b.rows_for(4096, 8) == 1280  # 1250 rounded up to 128
    b.watch(torch.tensor(1200), 1280)  # CPU: settled at once
    assert b.high_water == 1200 and b.rows_for(4096, 8) == 1536


def test_overflow_raises_and_capacity_factor_counts():
    b = sizing.ExpertRowBudget(align=16, headroom=1.0)
    b.observe(100)
    with pytest.raises(RuntimeError, match="sized for 128"):
        b.watch(torch.tensor(300), 128)
    c = sizing.ExpertRowBudget(align=32, capacity_factor=1.5)
    assert c.rows_for(100, 8) == 1280  # 1200 -> multiple of lcm(128, 32)
    c.watch(torch.tensor(2000), 1280)
    assert c.dropped_calls == 1


def test_initial_rows_env(monkeypatch):
    monkeypatch.setenv(sizing.INITIAL_ENV, "300")
    assert sizing.ExpertRowBudget(align=1).rows_for(10, 2) == 384


def test_tokens_per_expert_covering():
    tpe = torch.tensor([3, 0, 5], dtype=torch.int32)
    assert sizing.tokens_per_expert_covering(tpe, 12).tolist() == [3, 0, 9]
    assert sizing.tokens_per_expert_covering(tpe, 6).tolist() == [3, 0, 3]  # overflow: still adds up


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
