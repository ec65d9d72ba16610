"""Shared by the GPU agreement tests (tests/kernels/test_agreement_gpu.py, test_refused_calls_gpu.py, and through
cached_agreement.py the cached-call ones): their shapes, a seeded routing, exact rows and one correct fresh
dispatch + combine round whose sums are exact."""
from __future__ import annotations

import torch

T, H, L, K = 64, 256, 4, 4  # tokens per rank, hidden, local experts per rank, top-k


def routing(rank: int, num_ranks: int, seed: int = 0) -> torch.Tensor:
    """int64 [T, K] distinct expert ids of L * num_ranks, on the current CUDA device."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.rand(T, L * num_ranks, generator=g).topk(K, dim=1).indices.cuda()


def exact_rows(rank: int) -> torch.Tensor:
    """float32 [T, H] of small multiples of 1/16, on the current CUDA device: every sum of them is exact."""
    return torch.randint(-64, 65, (T, H), generator=torch.Generator().manual_seed(rank)).float().cuda() / 16


def exact_round(buf, rank: int, num_ranks: int) -> None:
    """A correct fresh dispatch and combine of float32 rows (multiples of 1/16: the sums are exact), so the
    rings' counters are where every rank expects them; raises AssertionError on wrong sums."""
    idx = routing(rank, num_ranks)
    x = exact_rows(rank)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, L * num_ranks)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                              num_tokens_per_expert=nte, topk_idx=idx)
    out, _, _ = buf.combine(recv_x, handle)
    assert torch.equal(out, x * itr.sum(1, keepdim=True).float()), "the round after the case gave wrong sums"
