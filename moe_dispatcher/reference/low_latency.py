"""Low-latency dispatch and combine in plain torch.distributed (docs/semantics.md, "Low-latency").

Rows are packed per local expert: for expert l, the rows from source rank 0 (tokens ascending), then from
rank 1, and so on. The compiled kernels may order rows differently; they are compared through the handle's
src_info and layout_range, which describe any order.

ReferenceLowLatency is the Backend the Buffer resolves low-latency calls to when the compiled kernels do not
serve them (CPU tensors, no extension, Buffer(backend="reference")). Like the compiled backend it owns the
double buffering (each call takes the half after the previous call's), the hook rules and the zero-copy send
buffers; its exchange itself is synchronous (collectives), so a "send" only snapshots the inputs and the
receive (at once, or in the hook) runs the exchange.
"""
from __future__ import annotations

import time
import weakref
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..backend import Backend, Capabilities
from ..event import EventOverlap
from ..signature import Signature
from .board import Board
from .comm import agree, exchange_rows, pack_rows, unpack_rows
from .fp8 import per_token_cast_to_fp8

_NO_EVENT = EventOverlap()


def _token_minor(shape_l: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[L, rows, cols] view whose rows are contiguous per column (the layout grouped GEMMs read scales in)."""
    return torch.zeros(shape_l, cols, rows, dtype=dtype, device=device).transpose(1, 2)


class ReferenceLowLatency(Backend):
    """Low-latency backend over `group`: the executable form of the low-latency semantics, any device.

    stream_scope: the Buffer's _stream_scope (DeepEP's async_finish semantics on CUDA tensors), held weakly.
    rank_partials: the combine's reduction order (the Buffer's low_latency_combine_reduction == "per_rank").
    """

    name = "reference"
    capabilities = Capabilities(low_latency=True)

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int, buffer_token: int,
                 stream_scope: Optional[Callable] = None, rank_partials: bool = True, board: Optional[Board] = None):
        self.group, self.rank, self.num_ranks, self.buffer_token = group, rank, num_ranks, buffer_token
        self.board = board if board is not None else Board(group, rank, num_ranks)
        self._stream_scope = weakref.WeakMethod(stream_scope) if stream_scope is not None else None
        self.rank_partials = rank_partials
        # Double buffering: each call takes the half after the previous call's; a hook is stale once its half
        # was taken again. Shapes (maxT, hidden, experts) may change only while no hook is pending.
        self._next_half = 0
        self._calls = 0
        self._half_owner = [0, 0]
        self._pending_hooks: set = set()
        self._last_shape: Optional[Tuple[int, int, int]] = None
        self._combine_send: List[Optional[torch.Tensor]] = [None, None]

    def set_rank_partials(self, rank_partials: bool) -> None:
        self.rank_partials = bool(rank_partials)

    # ------------------------------------------------------------------ calls (Backend protocol)
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor],
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor], use_fp8: bool, round_scale: bool,
                             use_ue8m0: bool, async_finish: bool, return_recv_hook: bool):
        """Inputs validated by the Buffer. Outputs are allocated now and filled when receiving."""
        from ..handle import LowLatencyHandle

        t, h = x.shape
        half, call = self._start_call((max_tokens, h, num_experts))
        dev, local = x.device, num_experts // self.num_ranks
        rows = self.num_ranks * max_tokens
        if use_fp8:
            groups = h // 512 if use_ue8m0 else h // 128
            sdtype = torch.int32 if use_ue8m0 else torch.float32
            recv_x = (torch.empty(local, rows, h, dtype=torch.float8_e4m3fn, device=dev),
                      torch.empty(local, groups, rows, dtype=sdtype, device=dev).transpose(1, 2))
        else:
            recv_x = torch.empty(local, rows, h, dtype=torch.bfloat16, device=dev)
        recv_count = torch.empty(local, dtype=torch.int32, device=dev)
        handle = LowLatencyHandle(torch.empty(local, rows, dtype=torch.int32, device=dev),
                                  torch.empty(local, self.num_ranks, dtype=torch.int64, device=dev),
                                  max_tokens, h, num_experts, self.name, self.buffer_token, half, t)
        if return_recv_hook:  # the call "sends": later changes to x must not reach the receiver
            x, topk_idx = x.clone(), topk_idx.clone()
        cum, wait = cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats

        def receive() -> None:
            got_x, got_count, got_handle, ns = self.dispatch_rows(x, topk_idx, max_tokens, num_experts, use_fp8,
                                                                  round_scale, use_ue8m0)
            for dst, src in zip(_flatten((recv_x, recv_count, handle.src_info, handle.layout_range)),
                                _flatten((got_x, got_count, got_handle.src_info, got_handle.layout_range))):
                dst.copy_(src)
            if cum is not None:
                cum.add_(got_count)
            if wait is not None:
                wait.add_(ns)

        hook = self._hook(half, call, receive)
        if return_recv_hook:
            return recv_x, recv_count, handle, _NO_EVENT, hook
        keep = [x, topk_idx] + [v for v in _flatten((recv_x, recv_count, handle.src_info, handle.layout_range, cum,
                                                      wait)) if v is not None]
        event = self._run(dev, async_finish, hook, keep)
        return recv_x, recv_count, handle, event, None

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            zero_copy: bool, async_finish: bool, return_recv_hook: bool, out: Optional[torch.Tensor],
                            combine_wait_recv_cost_stats: Optional[torch.Tensor]):
        """Inputs validated by the Buffer; -> (combined_x bf16 [T, H], EventOverlap, hook or None)."""
        half, call = self._start_call((handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts))
        rows_src = self._combine_buffer(half, handle) if zero_copy else x
        rank_partials = self.rank_partials
        if return_recv_hook:  # the call "sends": snapshot what it sends
            rows_src, topk_idx, topk_weights = rows_src.clone(), topk_idx.clone(), topk_weights.clone()
        t, dev = topk_idx.shape[0], handle.src_info.device
        result = out if out is not None else torch.empty(t, handle.hidden, dtype=torch.bfloat16, device=dev)
        wait = combine_wait_recv_cost_stats

        def receive() -> None:
            got, ns = self.combine_rows(rows_src, topk_idx, topk_weights, handle, None, rank_partials=rank_partials)
            result.copy_(got)
            if wait is not None:
                wait.add_(ns)

        hook = self._hook(half, call, receive)
        if return_recv_hook:
            return result, _NO_EVENT, hook
        keep = [v for v in (x, topk_idx, topk_weights, result, wait) if v is not None]
        return result, self._run(dev, async_finish, hook, keep), None

    def next_combine_buffer(self, handle) -> torch.Tensor:
        """bf16 [L, R*maxT, H]: the rows a zero-copy combine made as the next call sends."""
        return self._combine_buffer(self._next_half, handle)

    def clean_low_latency_buffer(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        """Nothing to reset: the reference keeps no signal words."""

    # ------------------------------------------------------------------ double buffering and hooks
    def _start_call(self, shape: Tuple[int, int, int]) -> Tuple[int, int]:
        """(half, call id) of a new call."""
        # Hooks never called and now stale can no longer block anything.
        self._pending_hooks.intersection_update(self._half_owner)
        if self._last_shape not in (None, shape) and self._pending_hooks:
            raise RuntimeError(f"low-latency call with (max tokens, hidden, experts) {shape} while a hook of a call "
                             f"with {self._last_shape} has not been called: call the hook first")
        self._last_shape = shape
        half = self._next_half
        self._next_half ^= 1
        self._calls += 1
        self._half_owner[half] = self._calls
        return half, self._calls

    def _hook(self, half: int, call: int, receive: Callable[[], None]) -> Callable[[], None]:
        done = []
        self._pending_hooks.add(call)

        def hook() -> None:
            if done:
                raise RuntimeError("this low-latency hook was already called")
            if self._half_owner[half] != call:
                raise RuntimeError("stale low-latency hook: its buffer half was reused by a later call; call each "
                                   "hook before making two more low-latency calls")
            done.append(True)  # before receiving: a receive that raises (a signature mismatch) ends the call too
            self._pending_hooks.discard(call)
            receive()
        return hook

    def _run(self, device: torch.device, async_finish: bool, hook: Callable[[], None], keep: list) -> EventOverlap:
        """Receive now with DeepEP's stream semantics (the Buffer's _stream_scope on CUDA tensors)."""
        scope = self._stream_scope() if self._stream_scope is not None else None
        if device.type != "cuda" or scope is None:
            hook()
            return EventOverlap()
        _, event = scope(device, None, async_finish, False, lambda: (hook(),), keep)
        return event

    def _combine_buffer(self, half: int, handle) -> torch.Tensor:
        local = handle.num_experts // self.num_ranks
        shape = (local, self.num_ranks * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        buf = self._combine_send[half]
        if buf is None or tuple(buf.shape) != shape or buf.device != handle.src_info.device:
            buf = torch.zeros(shape, dtype=torch.bfloat16, device=handle.src_info.device)
            self._combine_send[half] = buf
        return buf

    # ------------------------------------------------------------------ the exchanges
    def dispatch_rows(self, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int, num_experts: int,
                      use_fp8: bool, round_scale: bool, use_ue8m0: bool):
        """The dispatch exchange (synchronous). Returns (recv_x or (fp8, scales), recv_count int32[L], handle,
        nanoseconds spent exchanging)."""
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
        # Agreement first (the counts all-to-all's rows are sized by the expert count): raises on every rank.
        agree(self.board, Signature("low-latency dispatch", (h, max_tokens, num_experts, topk_idx.shape[1], use_fp8,
                                                       round_scale, use_ue8m0)), dev)
        begin_ns = time.perf_counter_ns()
        # counts[s, l]: rows source s sends to my local expert l.
        counts = unpack_rows(exchange_rows(self.board, pack_rows([per_expert.view(r, local)]), [1] * r, [1] * r,
                                           "low-latency dispatch: counts all-to-all"),
                             [per_expert.view(r, local)])[0].to(torch.int64)
        if use_fp8:
            q, scales = per_token_cast_to_fp8(x, round_scale, use_ue8m0)
            pieces = [q[tok], scales[tok]]
        else:
            pieces = [x[tok]]
        pieces.append(tok.to(torch.int32))
        recv = unpack_rows(exchange_rows(self.board, pack_rows(pieces), per_expert.view(r, local).sum(1).tolist(),
                                         counts.sum(1).tolist(), "low-latency dispatch: rows all-to-all"), pieces)
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

    def combine_rows(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                     out: Optional[torch.Tensor], rank_partials: bool = False) -> Tuple[torch.Tensor, int]:
        """The combine exchange (synchronous): out[t] = bf16(sum_k w[t,k] * row(t, k)), products rounded to
        float32 before each addition; with rank_partials the per-rank order (weighted_sum_per_rank). Returns
        (out, nanoseconds exchanging)."""
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
        agree(self.board, Signature("low-latency combine", (
            handle.backend_state if type(handle.backend_state) is int else 0, handle.hidden,
            handle.num_max_dispatch_tokens_per_rank, handle.num_experts, k,
            "per_rank" if rank_partials else "per_expert")), dev)
        begin_ns = time.perf_counter_ns()
        back = unpack_rows(exchange_rows(self.board, pack_rows(pieces), counts.sum(1).tolist(), per_dst.tolist(),
                                         "low-latency combine: rows all-to-all"), pieces)
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


def _flatten(obj) -> list:
    if isinstance(obj, (tuple, list)):
        return [y for item in obj for y in _flatten(item)]
    return [obj]
