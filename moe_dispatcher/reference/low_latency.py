"""Low-latency dispatch and combine in plain torch.distributed (docs/semantics.md, "Low-latency").

Rows are packed per local expert: for expert l, the rows from source rank 0 (tokens ascending), then from
rank 1, and so on. The compiled kernels may order rows differently; they are compared through the handle's
src_info and layout_range, which describe any order.
"""
from __future__ import annotations

import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..backend import Backend, Capabilities
from .comm import exchange_rows, pack_rows, unpack_rows
from .fp8 import per_token_cast_to_fp8


def _token_minor(shape_l: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[L, rows, cols] view whose rows are contiguous per column (the layout grouped GEMMs read scales in)."""
    return torch.zeros(shape_l, cols, rows, dtype=dtype, device=device).transpose(1, 2)


class ReferenceLowLatency(Backend):
    """Low-latency backend over `group`: the executable form of the low-latency semantics, any device."""

    name = "reference"
    capabilities = Capabilities(low_latency=True)

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int, buffer_token: int):
        self.group, self.rank, self.num_ranks, self.buffer_token = group, rank, num_ranks, buffer_token

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int, num_experts: int,
                 use_fp8: bool, round_scale: bool, use_ue8m0: bool):
        """Returns (recv_x or (fp8, scales), recv_count int32[L], handle, nanoseconds spent exchanging)."""
        from ..handle import LowLatencyHandle

        r = self.num_ranks
        local = num_experts // r
        t, h = x.shape
        dev = x.device
        # Selections (token, slot) ordered by expert then token: destination rank, then local expert.
        tok, slot = (topk_idx >= 0).nonzero(as_tuple=True)
        expert = topk_idx[tok, slot]
        order = torch.argsort(expert * max(t, 1) + tok, stable=True)
        tok, expert = tok[order], expert[order]
        per_expert = torch.bincount(expert, minlength=num_experts)
        begin_ns = time.perf_counter_ns()
        # counts[s, l]: rows source s sends to my local expert l.
        counts = unpack_rows(exchange_rows(self.group, pack_rows([per_expert.view(r, local)]), [1] * r, [1] * r),
                             [per_expert.view(r, local)])[0].to(torch.int64)
        if use_fp8:
            q, scales = per_token_cast_to_fp8(x, round_scale, use_ue8m0)
            pieces = [q[tok], scales[tok]]
        else:
            pieces = [x[tok]]
        pieces.append(tok.to(torch.int32))
        recv = unpack_rows(exchange_rows(self.group, pack_rows(pieces), per_expert.view(r, local).sum(1).tolist(),
                                         counts.sum(1).tolist()), pieces)
        elapsed = time.perf_counter_ns() - begin_ns
        # Place received blocks (source s, expert l), s-major, at rows begin[s, l] + i of expert l.
        flat = counts.flatten()
        block = torch.repeat_interleave(torch.arange(r * local, device=dev), flat.to(dev))
        within = torch.arange(block.numel(), device=dev) - (flat.cumsum(0) - flat).to(dev)[block]
        begin = (counts.cumsum(0) - counts).to(dev)  # [s, l]
        l_of = block % local
        row_of = begin.flatten()[block] + within
        rows = r * max_tokens
        src_info = torch.full((local, rows), -1, dtype=torch.int32, device=dev)
        src_info[l_of, row_of] = recv[-1]
        layout_range = ((begin.t() << 32) | counts.to(dev).t()).contiguous()
        recv_count = counts.sum(0).to(torch.int32).to(dev)
        if use_fp8:
            recv_q = torch.zeros(local, rows, h, dtype=torch.float8_e4m3fn, device=dev)
            recv_q[l_of, row_of] = recv[0]
            recv_s = _token_minor(local, rows, recv[1].shape[1], recv[1].dtype, dev)
            recv_s[l_of, row_of] = recv[1]
            recv_x = (recv_q, recv_s)
        else:
            recv_x = torch.zeros(local, rows, h, dtype=x.dtype, device=dev)
            recv_x[l_of, row_of] = recv[0]
        handle = LowLatencyHandle(src_info, layout_range, max_tokens, h, num_experts, self.name, self.buffer_token)
        return recv_x, recv_count, handle, elapsed

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                out: Optional[torch.Tensor], rank_partials: bool = False) -> Tuple[torch.Tensor, int]:
        """out[t] = bf16(sum_k w[t,k] * row(t, k)), products rounded to float32 before each addition; with
        rank_partials the per-rank order (weighted_sum_per_rank). Returns (out, nanoseconds exchanging)."""
        r, me = self.num_ranks, self.rank
        local = x.shape[0]
        dev = x.device
        begin = (handle.layout_range >> 32).t()  # [s, l]
        counts = (handle.layout_range & 0xFFFFFFFF).t()
        # Send every valid row back to its source, blocks (s, l) s-major.
        flat = counts.flatten()
        block = torch.repeat_interleave(torch.arange(r * local, device=dev), flat)
        within = torch.arange(block.numel(), device=dev) - (flat.cumsum(0) - flat)[block]
        l_of = block % local
        row_of = begin.flatten()[block] + within
        pieces = [x[l_of, row_of], handle.src_info[l_of, row_of], (me * local + l_of).to(torch.int32)]
        t, k = topk_idx.shape
        per_dst = torch.bincount(topk_idx[topk_idx >= 0] // local, minlength=r)
        begin_ns = time.perf_counter_ns()
        back = unpack_rows(exchange_rows(self.group, pack_rows(pieces), counts.sum(1).tolist(), per_dst.tolist()),
                           pieces)
        elapsed = time.perf_counter_ns() - begin_ns
        rows, src_tok, expert = back[0], back[1].long(), back[2].long()
        slot = (topk_idx[src_tok] == expert.unsqueeze(1)).int().argmax(1)
        vals = torch.zeros(t, k, x.shape[2], dtype=torch.float32, device=dev)
        vals[src_tok, slot] = rows.float()
        if rank_partials:
            result = weighted_sum_per_rank(vals, topk_idx, topk_weights, local, r)
        else:
            acc = torch.zeros(t, x.shape[2], dtype=torch.float32, device=dev)
            for j in range(k):
                term = topk_weights[:, j:j + 1].float() * vals[:, j]
                acc = acc + torch.where((topk_idx[:, j:j + 1] >= 0), term, torch.zeros_like(term))
            result = acc.to(torch.bfloat16)
        if out is not None:
            out.copy_(result)
            result = out
        return result, elapsed


def weighted_sum_per_rank(vals: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, local: int,
                          num_ranks: int) -> torch.Tensor:
    """The per-rank reduction order of low_latency_combine (docs/semantics.md, "Low-latency combine").

    vals float32 [T, K, H]: the row expert topk_idx[t, k] returned for token t; topk_idx [T, K] (-1 = unused),
    topk_weights float32 [T, K]; the expert e lives on rank e // local. For each token, rank d's picks (k
    ascending) give part_d = sum of w_k * row_k in float32 (products rounded before each addition), rounded
    to bf16 when it has two terms or more; out = bf16(sum of part_d over the ranks in the order of their
    first pick). Returns bf16 [T, H].
    """
    t, k, h = vals.shape
    dev = vals.device
    valid = topk_idx >= 0
    rank = torch.where(valid, topk_idx // local, torch.full_like(topk_idx, -1))
    part = torch.zeros(t, num_ranks, h, dtype=torch.float32, device=dev)
    picks = torch.zeros(t, num_ranks, dtype=torch.int64, device=dev)
    tokens = torch.arange(t, device=dev)
    for j in range(k):
        m = valid[:, j]
        ti, di = tokens[m], rank[m, j]
        part[ti, di] = part[ti, di] + topk_weights[m, j:j + 1].float() * vals[m, j]
        picks[ti, di] += 1
    term = torch.where((picks >= 2).unsqueeze(-1), part.to(torch.bfloat16).float(), part)
    acc = torch.zeros(t, h, dtype=torch.float32, device=dev)
    for j in range(k):
        first = valid[:, j] & (rank[:, :j] != rank[:, j:j + 1]).all(1)
        ti = tokens[first]
        acc[ti] = acc[ti] + term[ti, rank[first, j]]
    return acc.to(torch.bfloat16)
