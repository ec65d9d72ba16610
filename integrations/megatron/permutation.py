"""Index bookkeeping between Megatron's layouts and the Buffer's.

Megatron hands the dispatcher a dense routing map / probs [T, E] and wants, after communication, the
received tokens in expert-major order ([sum(tokens_per_expert), H], experts in local order, tokens of one
expert in arrival order) with their probs. The Buffer takes top-k indices / weights [T, K] and returns rows
ordered by source rank then source token, each with its top-k slots rebased to local expert ids.

The normal-mode dispatcher gets expert-major rows straight from the Buffer (expert_major_dispatch: the exchange
and the permutation); the low-latency one packs the per-expert slots here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def routing_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int, num_local_experts: int,
                    tp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense routing map / probs [T, E] -> top-k expert ids int64 [T, K*tp] and weights float32 [T, K*tp].

    Ids come from the routing map, not from the probs, so tokens the router dropped (capacity factor) or
    masked (padding) get -1 slots and weight 0. With expert tensor parallelism (tp_size > 1) every expert
    has one copy per expert-TP rank, and a token goes to all of them: global expert e, owned by EP rank
    r = e // num_local_experts, becomes the experts ((r*tp + t) * num_local_experts + e % num_local_experts)
    for t < tp, numbered over the tp_ep group whose rank is r*tp + t (Megatron's rank order, as its flex
    dispatcher assumes). Each copy carries the token's weight; combine sums the partial expert outputs.
    The weights stay differentiable w.r.t. probs.
    """
    num_tokens, num_experts = routing_map.shape
    k = min(topk, num_experts)
    # A bool map is read as its bytes (a view, no cast kernel); topk takes no bool.
    as_bytes = routing_map.view(torch.uint8) if routing_map.dtype == torch.bool else routing_map.to(torch.uint8)
    selected, idx = torch.topk(as_bytes, k, dim=1, sorted=False)
    unused = selected == 0  # a slot past the token's routed experts (one op, not a cast and two negations)
    weights = probs.gather(1, idx).float().masked_fill(unused, 0.0)
    if tp_size > 1:
        owner, local = idx // num_local_experts, idx % num_local_experts
        copies = torch.arange(tp_size, device=idx.device) * num_local_experts
        idx = ((owner * tp_size * num_local_experts + local).unsqueeze(-1) + copies).reshape(num_tokens, k * tp_size)
        unused = unused.repeat_interleave(tp_size, dim=1)
        weights = weights.repeat_interleave(tp_size, dim=1)
    return idx.masked_fill(unused, -1), weights


def padded_counts(counts: Sequence[int], align: int) -> list[int]:
    """Round each expert's row count up to a multiple of `align` (fp8/fp4 grouped GEMMs need 16 or 32)."""
    return [-(-c // align) * align for c in counts] if align > 1 else list(counts)


def _padded_destinations(counts: list[int], padded: list[int], device: torch.device) -> torch.Tensor | None:
    """Row in the padded expert-major tensor of each real row (experts' rows back to back), or None when
    nothing is padded. Expert e's rows move down by the padding of experts 0..e-1."""
    if padded == counts:
        return None
    total = sum(counts)
    shift = torch.tensor([0] + [p - c for p, c in zip(padded[:-1], counts[:-1])], device=device).cumsum(0)
    return torch.arange(total, device=device) + shift.repeat_interleave(torch.tensor(counts, device=device),
                                                                        output_size=total)


@dataclass
class LowLatencyPacking:
    """Low-latency dispatch output [E_local, R*maxT, H] (only the first recv_count[e] rows of expert e are
    valid) <-> the packed expert-major tensor Megatron's experts take.

    src_rows: int64 [n], flat row (e * R*maxT + i) of each real packed row; dst_rows: the packed row of each
    real row when experts are padded (else None); tokens_per_expert: padded counts on the CPU.
    """

    src_rows: torch.Tensor
    dst_rows: torch.Tensor | None
    num_out: int
    tokens_per_expert: torch.Tensor

    @classmethod
    def build(cls, recv_count: torch.Tensor, capacity: int, align: int = 1) -> LowLatencyPacking:
        counts = [int(c) for c in recv_count.tolist()]  # the one host sync: Megatron's experts split on the host
        dev = recv_count.device
        total = sum(counts)
        counts_t = torch.tensor(counts, device=dev)
        starts = torch.arange(len(counts), device=dev) * capacity
        first = torch.cumsum(counts_t, 0) - counts_t
        src_rows = (torch.arange(total, device=dev)
                    + (starts - first).repeat_interleave(counts_t, output_size=total))
        padded = padded_counts(counts, align)
        return cls(src_rows=src_rows, dst_rows=_padded_destinations(counts, padded, dev), num_out=sum(padded),
                   tokens_per_expert=torch.tensor(padded, dtype=torch.int64))

    def pack(self, recv_x: torch.Tensor) -> torch.Tensor:
        rows = recv_x.reshape(-1, recv_x.shape[-1]).index_select(0, self.src_rows)
        if self.dst_rows is None:
            return rows
        return rows.new_zeros((self.num_out, rows.shape[1])).index_copy(0, self.dst_rows, rows)

    def unpack(self, expert_out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.dst_rows is not None:
            expert_out = expert_out.index_select(0, self.dst_rows)
        out = expert_out.new_zeros((shape[0] * shape[1], expert_out.shape[1]))
        return out.index_copy(0, self.src_rows, expert_out).view(shape[0], shape[1], -1)
