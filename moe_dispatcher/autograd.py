"""Differentiable dispatch and combine, built on Buffer.

Normal mode: the backward of dispatch is a combine of the gradients (the top-k weight gradients summed the
same way, restricted to the slots each rank owns), and the backward of combine is a cached dispatch.

Low-latency mode: the backward of dispatch is a low-latency combine with weight 1 on every used slot. The
backward of the weighted combine needs, at each expert row, the weight of that (token, slot) pair, and at each
token the dot products with its expert rows; both travel through the public low-latency calls: the weights
and expert ids ride along with the gradient as extra columns whose bits the bf16 path copies unchanged, and
the dot products come back as hi/lo bf16 pairs in columns no other slot writes.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .buffer import Buffer
from .config import Config
from .expert_major import ExpertMajorHandle
from .handle import DispatchHandle, LowLatencyHandle
from .reference.fp8 import dequantize, per_token_cast_to_fp8

Tensor = torch.Tensor


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, topk_weights: Optional[Tensor], buffer: Buffer, topk_idx: Tensor, num_experts: int,
                expert_alignment: int, num_worst_tokens: int, config: Optional[Config], out: dict):
        n_rank, _, n_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=expert_alignment,
            num_worst_tokens=num_worst_tokens, config=config)
        ctx.buffer, ctx.handle, ctx.config, ctx.has_weights = buffer, handle, config, topk_weights is not None
        ctx.save_for_backward(recv_idx)
        ctx.mark_non_differentiable(recv_idx)
        out["counts"], out["handle"] = counts, handle
        if recv_w is None:
            return recv_x, recv_idx
        return recv_x, recv_idx, recv_w

    @staticmethod
    def backward(ctx, grad_x: Tensor, _grad_idx, grad_w: Optional[Tensor] = None):
        (recv_idx,) = ctx.saved_tensors
        w = None
        if ctx.has_weights and grad_w is not None:
            # recv_w[n, k] is the sender's weight only where the slot is local; elsewhere it is a constant 0.
            w = torch.where(recv_idx >= 0, grad_w, torch.zeros_like(grad_w)).contiguous()
        gx, gw, _ = ctx.buffer.combine(grad_x.contiguous(), ctx.handle, topk_weights=w, config=ctx.config)
        return gx, gw, None, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, buffer: Buffer, handle: DispatchHandle, config: Optional[Config]):
        combined, _, _ = buffer.combine(x, handle, config=config)
        ctx.buffer, ctx.handle, ctx.config = buffer, handle, config
        return combined

    @staticmethod
    def backward(ctx, grad: Tensor):
        recv, *_ = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle, config=ctx.config)
        if ctx.handle.num_recv_tokens is not None and ctx.handle.num_recv_tokens < recv.shape[0]:
            recv[ctx.handle.num_recv_tokens:] = 0  # padding rows of num_worst_tokens never reached combine
        return recv, None, None, None


def dispatch(buffer: Buffer, x: Tensor, topk_idx: Tensor, topk_weights: Optional[Tensor], num_experts: int, *,
             expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None
             ) -> Tuple[Tensor, Tensor, Optional[Tensor], List[int], DispatchHandle]:
    """Differentiable normal-mode dispatch (in x [T, H] and topk_weights float32 [T, K]).

    Returns (recv_x [N, H], recv_topk_idx int64 [N, K] (local ids, -1 elsewhere), recv_topk_weights float32
    [N, K] or None, num_recv_tokens_per_expert_list, handle).
    """
    out: dict = {}
    res = _Dispatch.apply(x, topk_weights, buffer, topk_idx, num_experts, expert_alignment, num_worst_tokens,
                          config, out)
    recv_w = res[2] if len(res) == 3 else None
    return res[0], res[1], recv_w, out["counts"], out["handle"]


def combine(buffer: Buffer, x: Tensor, handle: DispatchHandle, *, config: Optional[Config] = None) -> Tensor:
    """Differentiable normal-mode combine: [N, H] rows in dispatch order -> [T, H] sums per source token."""
    return _Combine.apply(x, buffer, handle, config)


class _ExpertMajorDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, topk_weights: Optional[Tensor], buffer: Buffer, topk_idx: Tensor, num_experts: int,
                expert_alignment: int, num_worst_tokens: int, config: Optional[Config], fp8: bool, out: dict):
        # fp8: the rows travel as e4m3 per 128-channel block with float32 scales (half the bytes of bf16) and are
        # cast back to x's dtype on arrival. The backward treats the cast as the identity (straight-through):
        # the gradient of the received rows goes back through the same combine as without fp8, in its dtype.
        sent = per_token_cast_to_fp8(x) if fp8 else x
        px, pw, counts, tpe, handle, _ = buffer.expert_major_dispatch(
            sent, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
            expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens, config=config)
        if fp8:
            px = dequantize(*px).to(x.dtype)
        ctx.buffer, ctx.handle, ctx.config, ctx.has_weights = buffer, handle, config, topk_weights is not None
        out["counts"], out["tokens_per_expert"], out["handle"] = counts, tpe, handle
        return (px, pw) if pw is not None else (px,)

    @staticmethod
    def backward(ctx, grad_x: Tensor, grad_w: Optional[Tensor] = None):
        gw_pairs = grad_w.contiguous() if ctx.has_weights and grad_w is not None else None
        gx, gw, _ = ctx.buffer.expert_major_combine(grad_x.contiguous(), ctx.handle, topk_weights=gw_pairs,
                                                    config=ctx.config)
        return gx, gw, None, None, None, None, None, None, None, None


class _ExpertMajorCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weights: Optional[Tensor], buffer: Buffer, handle: ExpertMajorHandle,
                config: Optional[Config]):
        combined, _, _ = buffer.expert_major_combine(x, handle, weights=weights, config=config)
        ctx.buffer, ctx.handle, ctx.config, ctx.x_dtype = buffer, handle, config, x.dtype
        # x [M, H] is kept only for the weights' gradient (an unweighted combine keeps no activation).
        ctx.save_for_backward(x if weights is not None and ctx.needs_input_grad[1] else None, weights)
        return combined

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weights = ctx.saved_tensors
        rows, *_ = ctx.buffer.expert_major_dispatch(grad.contiguous(), handle=ctx.handle, config=ctx.config)
        gx = rows if weights is None else (rows.to(torch.float32) * weights.unsqueeze(1)).to(ctx.x_dtype)
        gw = None
        if weights is not None and ctx.needs_input_grad[1]:
            gw = (rows.to(torch.float32) * x.to(torch.float32)).sum(1)
        return gx, gw, None, None, None


def expert_major_dispatch(buffer: Buffer, x: Tensor, topk_idx: Tensor, topk_weights: Optional[Tensor],
                          num_experts: int, *, expert_alignment: int = 1, num_worst_tokens: int = 0,
                          config: Optional[Config] = None, fp8: bool = False
                          ) -> Tuple[Tensor, Optional[Tensor], List[int], Tensor, ExpertMajorHandle]:
    """Differentiable dispatch into expert-major layout (in x [T, H] and topk_weights float32 [T, K]).

    fp8: send x as e4m3 [T, H] with float32 scales [T, H/128] (amax / 448 per 128-channel block,
    moe_dispatcher.reference.fp8; H a multiple of 128) and cast the received rows back to x's dtype; the
    backward (a combine of the gradient, in its own dtype) is the same as without fp8 (straight-through).

    Returns (permuted_x [M, H] in x's dtype, permuted_weights float32 [M] or None, tokens_per_expert_list
    (python ints; empty with num_worst_tokens), tokens_per_expert int32 [L] on the device, handle).
    """
    out: dict = {}
    res = _ExpertMajorDispatch.apply(x, topk_weights, buffer, topk_idx, num_experts, expert_alignment,
                                     num_worst_tokens, config, fp8, out)
    pw = res[1] if len(res) == 2 else None
    return res[0], pw, out["counts"], out["tokens_per_expert"], out["handle"]


def expert_major_combine(buffer: Buffer, x: Tensor, handle: ExpertMajorHandle, weights: Optional[Tensor] = None, *,
                         config: Optional[Config] = None) -> Tensor:
    """Differentiable expert-major combine: [M, H] rows (times weights [M] when given) -> [T, H] per token."""
    return _ExpertMajorCombine.apply(x, weights, buffer, handle, config)


class _LowLatencyDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, buffer: Buffer, topk_idx: Tensor, max_tokens: int, num_experts: int, out: dict):
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, max_tokens, num_experts,
                                                                       use_fp8=False)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.save_for_backward(topk_idx)
        ctx.mark_non_differentiable(recv_count)
        out["handle"] = handle
        return recv_x, recv_count

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_count):
        (topk_idx,) = ctx.saved_tensors
        ones = (topk_idx >= 0).float()
        gx, _, _ = ctx.buffer.low_latency_combine(grad.contiguous(), topk_idx, ones, ctx.handle)
        return gx, None, None, None, None, None


def _bits_as_bf16(t: Tensor) -> Tensor:
    """[T, K] 32-bit values -> [T, 2K] bf16 carrying the same bits (copied, never computed on)."""
    return t.contiguous().view(torch.bfloat16)


def _row_keys(handle: LowLatencyHandle) -> Tensor:
    """[L, R*maxT] int64: source_rank * maxT + source_token of each valid row, -1 for unused rows.

    A (local expert, key) pair names one received row whatever order a dispatch placed rows in."""
    local, rows = handle.src_info.shape
    begin = handle.layout_range >> 32                     # [L, R]
    count = handle.layout_range & 0xFFFFFFFF
    pos = torch.arange(rows, device=begin.device).view(1, 1, rows)
    inside = (pos >= begin.unsqueeze(-1)) & (pos < (begin + count).unsqueeze(-1))  # [L, R, rows]
    rank = torch.where(inside.any(1), inside.int().argmax(1), torch.full((local, rows), -1, device=begin.device))
    key = rank.long() * handle.num_max_dispatch_tokens_per_rank + handle.src_info.long()
    return torch.where(rank >= 0, key, torch.full_like(key, -1))


def _into_layout(rows_of: Tensor, made_by: LowLatencyHandle, target: LowLatencyHandle) -> Tensor:
    """Reorder [L, R*maxT, C] rows placed by one dispatch (`made_by`) into the row layout of another
    (`target`) of the same routing. Rows that are unused in `target` come out as zeros."""
    local, rows = target.src_info.shape
    src_keys, dst_keys = _row_keys(made_by), _row_keys(target)
    where = torch.zeros(local, rows + 1, dtype=torch.int64, device=rows_of.device)  # key -> row in made_by
    valid = src_keys >= 0
    lidx = torch.arange(local, device=rows_of.device).view(local, 1).expand(local, rows)
    where[lidx[valid], src_keys[valid]] = torch.arange(rows, device=rows_of.device).expand(local, rows)[valid]
    gather = where.gather(1, dst_keys.clamp_min(0))
    out = rows_of.gather(1, gather.unsqueeze(-1).expand(-1, -1, rows_of.shape[-1]))
    return torch.where((dst_keys >= 0).unsqueeze(-1), out, torch.zeros_like(out))


class _LowLatencyCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, topk_weights: Tensor, buffer: Buffer, topk_idx: Tensor, handle: LowLatencyHandle):
        combined, _, _ = buffer.low_latency_combine(x, topk_idx, topk_weights, handle)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.save_for_backward(x, topk_weights, topk_idx)
        return combined

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w, topk_idx = ctx.saved_tensors
        buffer, handle = ctx.buffer, ctx.handle
        local, rows, h = x.shape
        t, k = topk_idx.shape
        max_tokens, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.num_experts
        # 1. grad[t] to every expert of t; then (weights, expert ids) as raw bits in a side payload.
        g, _, g_handle, _, _ = buffer.low_latency_dispatch(grad.to(torch.bfloat16).contiguous(), topk_idx,
                                                           max_tokens, num_experts, use_fp8=False)
        # Same hidden size as the forward (h >= 128 >= 4K): a compiled backend keeps its buffer layout.
        side = torch.zeros(t, h, dtype=torch.bfloat16, device=grad.device)
        side[:, :2 * k] = _bits_as_bf16(w.float())
        side[:, 2 * k:4 * k] = _bits_as_bf16(topk_idx.to(torch.int32))
        s, _, s_handle, _, _ = buffer.low_latency_dispatch(side, topk_idx, max_tokens, num_experts, use_fp8=False)
        g_rows = _into_layout(g, g_handle, handle).float()                      # [L, rows, H], forward layout
        s_rows = _into_layout(s, s_handle, handle)
        side_w = s_rows[..., :2 * k].contiguous().view(torch.float32)           # [L, rows, K]
        side_e = s_rows[..., 2 * k:4 * k].contiguous().view(torch.int32)
        expert = (buffer.rank * local + torch.arange(local, device=grad.device)).view(local, 1, 1)
        valid = (_row_keys(handle) >= 0).unsqueeze(-1)
        slot_hit = (side_e == expert) & valid                                   # which slot each row is
        row_w = torch.where(slot_hit, side_w, torch.zeros_like(side_w)).sum(-1)
        grad_x = (g_rows * row_w.unsqueeze(-1)).to(x.dtype)
        # 2. d out[t] / d w[t, k] = <grad[t], row(t, k)>: computed at the expert, sent home as a hi/lo bf16 pair
        #    in columns 2k, 2k+1 (no other slot of the token writes there, so the unweighted sum is exact).
        dots = (g_rows * x.float()).sum(-1)                                     # [L, rows]
        hi = dots.to(torch.bfloat16)
        lo = (dots - hi.float()).to(torch.bfloat16)
        cols = torch.zeros(local, rows, h, dtype=torch.bfloat16, device=grad.device)  # h >= 128 >= 2K columns
        slot = slot_hit.int().argmax(-1, keepdim=True)                          # [L, rows, 1]
        hit = slot_hit.any(-1, keepdim=True)
        cols.scatter_(2, 2 * slot, torch.where(hit, hi.unsqueeze(-1), torch.zeros_like(hi.unsqueeze(-1))))
        cols.scatter_(2, 2 * slot + 1, torch.where(hit, lo.unsqueeze(-1), torch.zeros_like(lo.unsqueeze(-1))))
        back, _, _ = buffer.low_latency_combine(cols, topk_idx, (topk_idx >= 0).float(), handle)
        pairs = back[:, :2 * k].float().view(t, k, 2)
        grad_w = (pairs[..., 0] + pairs[..., 1]) * (topk_idx >= 0)
        return grad_x, grad_w, None, None, None


def low_latency_dispatch(buffer: Buffer, x: Tensor, topk_idx: Tensor, num_max_dispatch_tokens_per_rank: int,
                         num_experts: int) -> Tuple[Tensor, Tensor, LowLatencyHandle]:
    """Differentiable low-latency dispatch (bf16 payload). Returns (recv_x [L, R*maxT, H], recv_count, handle)."""
    out: dict = {}
    recv_x, recv_count = _LowLatencyDispatch.apply(x, buffer, topk_idx, num_max_dispatch_tokens_per_rank,
                                                   num_experts, out)
    return recv_x, recv_count, out["handle"]


def low_latency_combine(buffer: Buffer, x: Tensor, topk_idx: Tensor, topk_weights: Tensor,
                        handle: LowLatencyHandle) -> Tensor:
    """Differentiable weighted low-latency combine (in x [L, R*maxT, H] and topk_weights [T, K]) -> [T, H]."""
    return _LowLatencyCombine.apply(x, topk_weights, buffer, topk_idx, handle)
