"""The low-latency combine's two reduction orders (docs/semantics.md, "Low-latency combine"), on CPU.

The reference backend's per-rank sum (moe_dispatcher.reference.low_latency.weighted_sum_per_rank, vectorised)
against the loop oracle (tests/helpers/oracle.py); the two orders differ on random data (so the bitwise tests of
either one can tell them apart) and agree whenever no rank holds two picks of a token; the Buffer option.
"""
from __future__ import annotations

import pytest
import torch

from moe_dispatcher.buffer import LL_COMBINE_ENV, Buffer
from moe_dispatcher.reference.low_latency import weighted_sum_per_rank

import oracle


def _inputs(seed: int, t: int, k: int, num_ranks: int, local: int, h: int, unused: float = 0.2):
    g = torch.Generator().manual_seed(seed)
    e = num_ranks * local
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.empty(0, k)
    idx = idx.long()
    idx[torch.rand(t, k, generator=g) < unused] = -1
    w = torch.rand(t, k, generator=g) + 0.1
    rows = torch.randn(t, k, h, generator=g).to(torch.bfloat16)
    return idx, w, rows


@pytest.mark.parametrize("t,k,num_ranks,local,h", [(37, 8, 4, 8, 64), (16, 4, 2, 3, 128), (1, 6, 4, 2, 32),
                                                    (0, 4, 2, 2, 32), (24, 1, 3, 2, 16)])
def test_reference_matches_oracle(t: int, k: int, num_ranks: int, local: int, h: int) -> None:
    idx, w, rows = _inputs(t * 31 + k, t, k, num_ranks, local, h)
    got = weighted_sum_per_rank(rows.float(), idx, w, local, num_ranks)
    want = oracle.low_latency_combine_per_rank(idx, w, rows, local)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_orders_differ_on_random_data() -> None:
    """Two picks on one rank: the bf16 rounding of their partial sum shows in some outputs."""
    idx, w, rows = _inputs(7, 64, 8, 4, 8, 256, unused=0.0)
    per_rank = oracle.low_latency_combine_per_rank(idx, w, rows, 8)
    per_expert = oracle.low_latency_combine(idx, w, rows)
    differ = (per_rank.view(torch.int16) != per_expert.view(torch.int16)).sum().item()
    assert differ > 0
    # ... by rounding steps of bf16 (2^-9 relative) of the partial sums and of the output, no more: bounded by
    # 2^-7 of the sum of the terms' magnitudes.
    scale = (w.unsqueeze(-1) * rows.float()).abs().sum(1)
    assert bool(((per_rank.float() - per_expert.float()).abs() <= 2 ** -7 * scale + 1e-30).all())


def test_orders_agree_with_one_pick_per_rank() -> None:
    """One expert per rank (or picks on distinct ranks): the per-rank order is the top-k order, bit for bit."""
    idx, w, rows = _inputs(11, 40, 4, 8, 1, 128)
    assert torch.equal(oracle.low_latency_combine_per_rank(idx, w, rows, 1).view(torch.int16),
                       oracle.low_latency_combine(idx, w, rows).view(torch.int16))
    assert torch.equal(weighted_sum_per_rank(rows.float(), idx, w, 1, 8).view(torch.int16),
                       oracle.low_latency_combine(idx, w, rows).view(torch.int16))


def test_buffer_option(monkeypatch) -> None:
    """The Buffer keyword beats the environment, the default is per_rank, bad values are refused."""
    buf = Buffer.__new__(Buffer)  # the property alone (no process group needed)
    buf._kernels_ll = None
    buf.low_latency_combine_reduction = "per_expert"
    assert buf.low_latency_combine_reduction == "per_expert"
    with pytest.raises(ValueError, match="low_latency_combine_reduction"):
        buf.low_latency_combine_reduction = "fast"
    assert LL_COMBINE_ENV == "MOE_DISPATCHER_LL_COMBINE"
