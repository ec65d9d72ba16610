"""Expert-major layout over a normal dispatch: the semantics of the fused permutation (docs/semantics.md).

A compiled backend that fuses the permutation into its kernels provides expert_major_dispatch /
expert_major_combine itself; otherwise Buffer composes the normal dispatch/combine of whatever backend serves
the call with the two local reorderings below.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .handle import DispatchHandle

Tensor = torch.Tensor


class ExpertMajorHandle(NamedTuple):
    """Routing of one expert-major dispatch.

    dispatch:          the rank-major DispatchHandle underneath.
    pair_row:          int32 [M], received row of each permuted row (-1 on padding rows).
    pair_slot:         int32 [M], top-k slot of each permuted row (-1 on padding rows).
    tokens_per_expert: int32 [L], rows per local expert including alignment padding.
    """

    dispatch: DispatchHandle
    pair_row: Tensor
    pair_slot: Tensor
    tokens_per_expert: Tensor
    num_topk: int
    backend_state: object = None


def permute(recv_x: Tensor, recv_scales: Optional[Tensor], recv_idx: Tensor, recv_w: Optional[Tensor],
            num_local_experts: int, expert_alignment: int, num_worst_rows: int):
    """Rank-major received rows -> expert-major rows, with fixed-shape operations only (no host sync when
    num_worst_rows is given).

    Returns (permuted_x, permuted_scales or None, permuted_weights [M] or None, tokens_per_expert int32 [L],
    pair_row int32 [M], pair_slot int32 [M]).
    """
    n_rows, k = recv_idx.shape
    dev, local = recv_idx.device, num_local_experts
    key = torch.where(recv_idx >= 0, recv_idx, local).reshape(-1)   # unused slots sort last, as "expert L"
    order = torch.argsort(key, stable=True)                          # stable: (row, slot) order per expert
    sorted_key = key[order]
    counts = torch.zeros(local + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + expert_alignment - 1) // expert_alignment * expert_alignment
    padded[local] = 0
    starts = padded.cumsum(0) - padded
    rank_in_expert = torch.arange(key.numel(), device=dev) - (counts.cumsum(0) - counts)[sorted_key]
    if num_worst_rows:
        total = num_worst_rows
        need = padded.sum()
        if dev.type == "cuda":
            torch._assert_async(need <= total, "expert_major_dispatch: more expert rows arrive than num_worst_tokens")
        elif int(need) > total:
            raise ValueError(f"expert_major_dispatch: {int(need)} expert rows arrive, more than num_worst_tokens="
                             f"{total}")
    else:
        total = int(padded.sum())
    pos = torch.where(sorted_key < local, starts[sorted_key] + rank_in_expert, total)  # row `total`: discarded
    pos = pos.clamp_max(total)
    row, slot = order // k, order % k

    def scatter(values: Tensor, fill: int) -> Tensor:
        out = values.new_zeros((total + 1,) + tuple(values.shape[1:]))
        if fill:
            out.fill_(fill)
        out[pos] = values
        return out[:total]

    pair_row = scatter(row.to(torch.int32), -1)
    pair_slot = scatter(slot.to(torch.int32), -1)
    out_x = scatter(recv_x[row], 0)
    out_s = scatter(recv_scales[row], 0) if recv_scales is not None else None
    out_w = scatter(recv_w[row, slot].float(), 0) if recv_w is not None else None
    return out_x, out_s, out_w, padded[:local].to(torch.int32), pair_row, pair_slot


def gather_rows(rows: Tensor, handle: ExpertMajorHandle) -> Tensor:
    """Rank-major rows [N, ...] -> expert-major rows [M, ...] along a handle (cached dispatch)."""
    valid = handle.pair_row >= 0
    out = rows[handle.pair_row.clamp_min(0).long()]
    return torch.where(valid.view((-1,) + (1,) * (rows.dim() - 1)), out, torch.zeros_like(out))


def unpermute(x: Tensor, handle: ExpertMajorHandle, weights: Optional[Tensor],
              topk_weights: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """Expert-major rows [M, H] -> per received row partial sums [N, H] (x.dtype), slot by slot, and the
    per-pair topk_weights [M] -> [N, K]. Fixed-shape: unused rows go to a discarded row N."""
    n_rows = handle.dispatch.recv_src_idx.shape[0]
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = torch.zeros(n_rows + 1, x.shape[1], dtype=acc_dtype, device=x.device)
    pair_row, pair_slot = handle.pair_row.long(), handle.pair_slot.long()
    term = x.to(acc_dtype)
    if weights is not None:
        term = term * weights.to(acc_dtype).unsqueeze(1)
    for k in range(handle.num_topk):  # a row appears at most once per slot, so each pass is order-free
        target = torch.where(pair_slot == k, pair_row, n_rows)
        rows.index_add_(0, target, torch.where((pair_slot == k).unsqueeze(1), term, torch.zeros_like(term)))
    w_rows = None
    if topk_weights is not None:
        w_rows = torch.zeros(n_rows + 1, handle.num_topk + 1, dtype=torch.float32, device=x.device)
        valid = pair_row >= 0
        w_rows[torch.where(valid, pair_row, n_rows), torch.where(valid, pair_slot, handle.num_topk)] = topk_weights
        w_rows = w_rows[:n_rows, :handle.num_topk].contiguous()
    return rows[:n_rows].to(x.dtype), w_rows
