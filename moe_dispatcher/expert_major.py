"""Expert-major layout over a normal dispatch: the semantics of the fused permutation (docs/semantics.md).

A compiled backend that fuses the permutation into its kernels provides expert_major_dispatch /
expert_major_combine itself; otherwise Buffer composes the normal dispatch/combine of whatever backend serves
the call with the two local reorderings below.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from .handle import DispatchHandle

Tensor = torch.Tensor


class ExpertMajorHandle(NamedTuple):
    """Routing of one expert-major dispatch.

    dispatch:          the rank-major DispatchHandle underneath.
    pair_row:          int32 [M], received row of each permuted row (-1 on padding rows).
    pair_slot:         int32 [M], top-k slot of each permuted row (-1 on padding rows).
    tokens_per_expert: int32 [L], rows per local expert including alignment padding.
    slot_order:        int64 [P], the permuted rows that hold a pair, grouped by slot (ascending), or None
                       when the counts are only on the device (num_worst_tokens).
    slot_offsets:      python ints [K + 1], where each slot's group starts in slot_order (or None).
    backend_state:     what a fused backend keeps (the compiled intranode one: the inverse table
                       (received row, slot) -> row, its layout table, the local expert count, the alignment,
                       and the device count of rows received (int32 [1], a view of the dispatch's
                       recv_channel_offset, taken once so that cached calls do not index it again)).
    rows_needed:       0-d int64 device tensor: rows this rank needed (padded), from the counts the dispatch
                       exchanged (never from the rows kept); above M with num_worst_tokens means rows were
                       dropped (the Buffer reports it; a caller may read it asynchronously).
    """

    dispatch: DispatchHandle
    pair_row: Tensor
    pair_slot: Tensor
    tokens_per_expert: Tensor
    num_topk: int
    slot_order: Optional[Tensor] = None
    slot_offsets: Optional[Tuple[int, ...]] = None
    backend_state: object = None
    rows_needed: Optional[Tensor] = None


def _gather_or_zero(rows: Tensor, index: Tensor, padded: bool = True) -> Tensor:
    """rows[index] for index >= 0, zero rows where index < 0 (any dtype, FP8 included; fixed-shape).
    padded=False promises that no index is negative (skips the zeroing pass)."""
    n = rows.shape[0]
    if n == 0 or index.numel() == 0:
        return rows.new_zeros((index.numel(),) + tuple(rows.shape[1:]))
    out = rows.index_select(0, index.long().clamp(0, n - 1))
    if padded:
        out.view(torch.uint8).view(index.numel(), -1).masked_fill_((index < 0).unsqueeze(1), 0)
    return out


def permute(recv_x: Tensor, recv_scales: Optional[Tensor], recv_idx: Tensor, recv_w: Optional[Tensor],
            num_local_experts: int, expert_alignment: int, num_worst_rows: int):
    """Rank-major received rows -> expert-major rows. Only index arrays are reordered; the payload is read
    once, row by row of the output. Fixed-shape (no host sync) when num_worst_rows is given.

    Returns (permuted_x, permuted_scales or None, permuted_weights [M] or None, tokens_per_expert int32 [L],
    the same as python ints (empty with num_worst_rows), pair_row int32 [M], pair_slot int32 [M],
    slot_order or None, slot_offsets or None, the rows the given rows need (a 0-d device tensor; a caller
    whose exchange may have dropped rows takes the need from its exchanged counts instead)). Rows past
    num_worst_rows are dropped here; the caller reports that on every rank.
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
    need = padded.sum()  # rows this rank needs; under num_worst_rows the caller checks it against the limit
    total = num_worst_rows if num_worst_rows else int(need)
    pos = torch.where(sorted_key < local, starts[sorted_key] + rank_in_expert, total).clamp_max(total)

    def place(values: Tensor) -> Tensor:  # [N*K] per-slot values -> [total], -1 where no pair lands
        out = torch.full((total + 1,), -1, dtype=values.dtype, device=dev)
        out[pos] = values
        return out[:total]

    pair_row = place((order // k).to(torch.int32))
    pair_slot = place((order % k).to(torch.int32))
    has_padding = bool(num_worst_rows) or bool((padded[:local] != counts[:local]).any())
    out_x = _gather_or_zero(recv_x, pair_row, has_padding)
    out_s = _gather_or_zero(recv_scales, pair_row, has_padding) if recv_scales is not None else None
    out_w = None
    if recv_w is not None and recv_w.numel() == 0:
        out_w = torch.zeros(total, dtype=torch.float32, device=dev)
    elif recv_w is not None:
        out_w = recv_w.reshape(-1).float().index_select(0, (pair_row.long() * k + pair_slot.long()).clamp_min(0))
        out_w = torch.where(pair_row >= 0, out_w, torch.zeros_like(out_w))
    slot_order = slot_offsets = None
    counts_list: List[int] = []
    if not num_worst_rows:  # the counts are on the host already: group the pairs by slot for unpermute
        counts_list = [int(c) for c in padded[:local].tolist()]
        slot_key = torch.where(pair_slot >= 0, pair_slot.long(), k)
        slot_order = torch.argsort(slot_key, stable=True)
        per_slot = torch.bincount(slot_key, minlength=k + 1).tolist()
        offsets = [0]
        for c in per_slot[:k]:
            offsets.append(offsets[-1] + c)
        slot_order, slot_offsets = slot_order[:offsets[-1]], tuple(offsets)
    return (out_x, out_s, out_w, padded[:local].to(torch.int32), counts_list, pair_row, pair_slot, slot_order,
            slot_offsets, need)


def gather_rows(rows: Tensor, handle: ExpertMajorHandle) -> Tensor:
    """Rank-major rows [N, ...] -> expert-major rows [M, ...] along a handle (cached dispatch)."""
    unpadded = handle.slot_offsets is not None and handle.slot_offsets[-1] == handle.pair_row.numel()
    return _gather_or_zero(rows, handle.pair_row, not unpadded)


def unpermute(x: Tensor, handle: ExpertMajorHandle, weights: Optional[Tensor],
              topk_weights: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """Expert-major rows [M, H] -> per received row partial sums [N, H] (x.dtype), added slot by slot, and the
    per-pair topk_weights [M] -> [N, K].

    A received row holds at most one pair per slot, so each slot's pass writes every row at most once: the
    result is deterministic and in slot order even where the additions are atomic."""
    n_rows = handle.dispatch.recv_src_idx.shape[0]
    k = handle.num_topk
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    pair_row, pair_slot = handle.pair_row.long(), handle.pair_slot.long()
    rows = torch.zeros(n_rows, x.shape[1], dtype=acc_dtype, device=x.device)
    if handle.slot_offsets is not None:
        for j in range(k):
            sel = handle.slot_order[handle.slot_offsets[j]:handle.slot_offsets[j + 1]]
            term = x.index_select(0, sel).to(acc_dtype)
            if weights is not None:
                term = term * weights.index_select(0, sel).to(acc_dtype).unsqueeze(1)
            rows.index_add_(0, pair_row.index_select(0, sel), term)
    else:
        # No host-side counts (num_worst_tokens): per slot, gather each row's pair through an inverse table.
        m = x.shape[0]
        inverse = torch.full(((n_rows + 1) * (k + 1),), m, dtype=torch.int64, device=x.device)
        target = torch.where(pair_row >= 0, pair_row * (k + 1) + pair_slot, n_rows * (k + 1) + k)
        inverse[target] = torch.arange(m, device=x.device)
        inverse = inverse.view(n_rows + 1, k + 1)[:n_rows, :k]
        term = torch.zeros(m + 1, x.shape[1], dtype=acc_dtype, device=x.device)  # row m stays zero
        term[:m] = x
        if weights is not None:
            term[:m] *= weights.to(acc_dtype).unsqueeze(1)
        for j in range(k):
            rows += term.index_select(0, inverse[:, j])
    w_rows = None
    if topk_weights is not None:
        w_rows = torch.zeros(n_rows + 1, k + 1, dtype=torch.float32, device=x.device)
        valid = pair_row >= 0
        w_rows[torch.where(valid, pair_row, n_rows), torch.where(valid, pair_slot, k)] = topk_weights
        w_rows = w_rows[:n_rows, :k].contiguous()
    return rows.to(x.dtype), w_rows


def compose_expert_major_dispatch(backend, data: Tensor, scales: Optional[Tensor], topk_idx: Tensor,
                                  topk_weights: Optional[Tensor], num_experts: int, num_local_experts: int,
                                  expert_alignment: int, num_worst_tokens: int, config=None,
                                  bounded_exchange: bool = True):
    """Expert-major dispatch as a normal dispatch of `backend` followed by permute() (what a backend without
    fused kernels, or a case its kernels do not cover, does). Returns (permuted_x, permuted_scales,
    permuted_weights, tokens_per_expert, counts, handle).

    With num_worst_tokens = M the expert rows are M. bounded_exchange (the kernels, which size their receive
    buffers without a host sync): the rank-major exchange is bounded by M too (a received row holds at least
    one pair, so M covers the rows whenever it covers the pairs); an overflow drops received rows there, and
    permute sees only the first M. So the rows needed are never counted over the received rows: they are the
    padded per-expert counts the exchange itself carried (the dispatch's `counts`, an int32 [L] device tensor
    under num_worst_tokens), summed on the device, which count the dropped rows too (one pair per row, as with
    top-1 routing or one expert per rank, would otherwise read exactly M). bounded_exchange=False (the
    reference, which synchronises anyway): the exchange is exact and only permute drops, past M, expert rows
    whose need the host counts already know."""
    n_rank, _, n_expert, in_rank = backend.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_s, recv_idx, recv_w, counts, dh = backend.dispatch(
        data, scales, topk_idx, topk_weights, n_rank, in_rank, n_expert, expert_alignment,
        num_worst_tokens if bounded_exchange else 0, config)
    px, ps, pw, tpe, permuted_counts, prow, pslot, order, offsets, need = permute(
        recv_x, recv_s, recv_idx, recv_w, num_local_experts, expert_alignment, num_worst_tokens)
    if num_worst_tokens:  # the exchanged counts (padded to the alignment), not the rows that were kept
        need = (counts.sum(dtype=torch.int64) if isinstance(counts, Tensor)
                else torch.tensor(sum(counts), dtype=torch.int64, device=tpe.device))
    handle = ExpertMajorHandle(dh, prow, pslot, tpe, topk_idx.shape[1], order, offsets, rows_needed=need)
    return px, ps, pw, tpe, permuted_counts, handle
