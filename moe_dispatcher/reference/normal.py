"""Normal-mode dispatch and combine in plain torch.distributed: the executable form of docs/semantics.md.

Every exchange is one all_to_all of packed byte rows, so any dtype travels bit-exactly over gloo or NCCL.
Counts go to the host (this backend synchronises freely; the compiled one does not).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..backend import Backend, Capabilities
from ..config import get_combine_config, get_dispatch_config
from ..expert_major import compose_expert_major_dispatch
from ..signature import Signature, config_values, dispatch_signature
from .board import Board
from .comm import agree, all_gather_rows, exchange_rows, pack_rows, unpack_rows


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, nvl_size: int):
    """(num_tokens_per_rank int32[R], num_tokens_per_rdma_rank int32[D] or None, num_tokens_per_expert
    int32[E], is_token_in_rank bool[T, R]) from topk_idx int64 [T, K] (-1 = unused slot)."""
    t = topk_idx.shape[0]
    experts_per_rank = num_experts // num_ranks
    valid = topk_idx >= 0
    rank_of_slot = torch.where(valid, topk_idx // experts_per_rank, num_ranks)  # num_ranks = a spill column
    hit = torch.zeros(t, num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, rank_of_slot, True)
    is_token_in_rank = hit[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    num_tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
    num_domains = num_ranks // nvl_size
    per_domain = None
    if num_domains > 1:
        per_domain = is_token_in_rank.view(t, num_domains, nvl_size).any(-1).sum(0, dtype=torch.int32)
    return num_tokens_per_rank, per_domain, num_tokens_per_expert, is_token_in_rank


def _send_order(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """Source token of each sent row, rows ordered by destination rank then token."""
    return is_token_in_rank.t().nonzero(as_tuple=True)[1]


def _send_matrix(rank_prefix_matrix: torch.Tensor) -> torch.Tensor:
    """[i][j] = rows rank i sent to rank j, from the prefix sums over senders."""
    m = rank_prefix_matrix.to(torch.int64)
    return torch.cat([m[:1], m[1:] - m[:-1]], dim=0)


class ReferenceNormal(Backend):
    """Normal-mode backend over `group` (rank `rank` of `num_ranks`): any device, any dtype, any expert count."""

    name = "reference"
    capabilities = Capabilities(normal=True)

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int, nvl_size: int, buffer_token: int,
                 board: Optional[Board] = None, buffer_cls: Optional[type] = None):
        self.group, self.rank, self.num_ranks, self.nvl_size = group, rank, num_ranks, nvl_size
        self.buffer_token = buffer_token
        self.board = board if board is not None else Board(group, rank, num_ranks)
        self.dispatches = 0  # fresh dispatches so far (the same on every rank: they are collective)
        # The Buffer class, whose get_dispatch_config / get_combine_config (its num_sms) give the Config a call
        # without one runs with: part of the call's signature.
        self.buffer_cls = buffer_cls

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        return dispatch_layout(topk_idx, num_experts, self.num_ranks, self.nvl_size)

    def dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], num_tokens_per_rank: torch.Tensor,
                 is_token_in_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor, expert_alignment: int,
                 num_worst_tokens: int, config=None):
        """Fresh dispatch (`config` is for the kernels; ignored here).

        Returns (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, counts list, handle)."""
        from ..handle import DispatchHandle

        r, me = self.num_ranks, self.rank
        num_experts = num_tokens_per_expert.numel()
        local = num_experts // r
        # 1. Agreement and counts, in one all-gather of a fixed length (so that ranks disagreeing on the expert
        # count still exchange rows of one size): each rank's call signature (moe_dispatcher.signature), what it
        # sends to each rank and its num_worst_tokens. A signature mismatch, or a layout of one rank that does
        # not match its own topk_idx, raises on every rank here, before any row moves.
        sent_by_me = is_token_in_rank.sum(0).to(torch.int64)
        signature = dispatch_signature(
            "dispatch", x, x_scales, topk_idx, topk_weights, num_experts, self._effective(config, combine=False),
            layout_problem(topk_idx, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, r, self.nvl_size))
        dev = sent_by_me.device
        worst = torch.tensor([num_worst_tokens], dtype=torch.int64, device=dev)
        table = agree(self.board, signature, dev, torch.cat([sent_by_me, worst]), "counts all-gather")
        send_matrix = table[:, :r]
        rank_prefix_matrix = send_matrix.cumsum(0).to(torch.int32)
        # Per-expert totals, now that every rank has the same number of experts.
        per_expert = all_gather_rows(self.board, num_tokens_per_expert.to(torch.int64),
                                     "dispatch: per-expert counts all-gather").cpu()
        per_local_expert = per_expert[:, me * local: (me + 1) * local].sum(0)
        self.dispatches += 1
        num_recv = int(rank_prefix_matrix[-1, me])
        # Every rank checks every rank's limit, so all raise together before any rows move.
        received, limits = send_matrix.sum(0), table[:, r]
        over = [(j, int(received[j]), int(limits[j])) for j in range(r) if limits[j] and received[j] > limits[j]]
        if over:
            j, got, limit = over[0]
            raise ValueError(f"dispatch: rank {j} receives {got} tokens, more than its num_worst_tokens={limit}")
        # 2. Rows, destination-major then token order, so they land in (source rank, token) order.
        src = _send_order(is_token_in_rank)
        pieces = [x[src]]
        if x_scales is not None:
            pieces.append(x_scales[src])
        if topk_idx is not None:
            pieces.append(topk_idx[src])
        if topk_weights is not None:
            pieces.append(topk_weights[src])
        pieces.append(src.to(torch.int32))
        recv = exchange_rows(self.board, pack_rows(pieces), send_matrix[me].tolist(), send_matrix[:, me].tolist(),
                             "dispatch: rows all-to-all")
        got = unpack_rows(recv, pieces)
        recv_x = got.pop(0)
        recv_scales = got.pop(0) if x_scales is not None else None
        recv_idx = got.pop(0) if topk_idx is not None else None
        recv_w = got.pop(0) if topk_weights is not None else None
        recv_src_idx = got.pop(0)
        # 3. Rebase top-k to local experts; zero the weights of slots that live elsewhere.
        if recv_idx is not None:
            mine = (recv_idx >= me * local) & (recv_idx < (me + 1) * local)
            recv_idx = torch.where(mine, recv_idx - me * local, torch.full_like(recv_idx, -1))
            if recv_w is not None:
                recv_w = torch.where(mine, recv_w, torch.zeros_like(recv_w))
        a = expert_alignment
        counts = [(int(c) + a - 1) // a * a for c in per_local_expert.tolist()]
        if num_worst_tokens:  # the Backend contract: on the device under num_worst_tokens
            counts = torch.tensor(counts, dtype=torch.int32, device=x.device)
            recv_x, recv_scales, recv_idx, recv_w, recv_src_idx = (
                _pad(t, num_worst_tokens, fill) for t, fill in
                ((recv_x, 0), (recv_scales, 0), (recv_idx, -1), (recv_w, 0), (recv_src_idx, -1)))
        # backend_state: the number of this dispatch in the Buffer, which cached calls exchange in their
        # signature (every rank must pass the handle of the same dispatch).
        handle = DispatchHandle(rank_prefix_matrix.to(x.device), is_token_in_rank, recv_src_idx, num_recv,
                                x.shape[0], num_worst_tokens, self.name, self.buffer_token, self.dispatches)
        return recv_x, recv_scales, recv_idx, recv_w, counts, handle

    def expert_major_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                              topk_weights: Optional[torch.Tensor], num_experts: int, expert_alignment: int,
                              num_worst_tokens: int, config=None):
        """The composition (Backend's), with an exact exchange: this backend has the counts on the host anyway,
        so num_worst_tokens bounds only the expert rows. An expert-major overflow is then what the kernels'
        is: the rows past num_worst_tokens are dropped and rows_needed says so (the Buffer reports it, the
        Megatron integration's step-end check reads it), never an error raised by the exchange."""
        return compose_expert_major_dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts,
                                             num_experts // self.num_ranks, expert_alignment, num_worst_tokens,
                                             config, bounded_exchange=False)

    def _effective(self, config, combine: bool):
        """The Config a compiled backend would run this call with (the Buffer class's default when None)."""
        if config is not None:
            return config
        if self.buffer_cls is None:
            return get_combine_config(self.num_ranks) if combine else get_dispatch_config(self.num_ranks)
        cls = self.buffer_cls
        return cls.get_combine_config(self.num_ranks) if combine else cls.get_dispatch_config(self.num_ranks)

    def cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle, config=None):
        """Dispatch along the routing of `handle`; returns (recv_x, recv_x_scales)."""
        agree(self.board, Signature("cached dispatch", (
            _serial(handle), x.shape[1], x.dtype, x_scales.dtype if x_scales is not None else None,
            x_scales.shape[1] if x_scales is not None else 0, *config_values(self._effective(config, combine=False)))),
            x.device)
        send_matrix = _send_matrix(handle.rank_prefix_matrix.cpu())
        src = _send_order(handle.is_token_in_rank)
        pieces = [x[src]] + ([x_scales[src]] if x_scales is not None else [])
        recv = exchange_rows(self.board, pack_rows(pieces), send_matrix[self.rank].tolist(),
                             send_matrix[:, self.rank].tolist(), "cached dispatch: rows all-to-all")
        got = unpack_rows(recv, pieces) + [None]
        rows = handle.recv_src_idx.shape[0]
        return _pad(got[0], rows, 0), _pad(got[1], rows, 0)

    def combine(self, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor],
                bias: Sequence[torch.Tensor], config=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Sum the rows of each source token over the ranks that received it (ascending rank order)."""
        me = self.rank
        agree(self.board, Signature("combine", (
            _serial(handle), x.shape[1], x.dtype, topk_weights.shape[1] if topk_weights is not None else 0,
            *config_values(self._effective(config, combine=True)))), x.device)
        prefix = handle.rank_prefix_matrix.cpu()
        send_matrix = _send_matrix(prefix)
        # Rows received (a compiled backend's handle may leave it on the device: then the prefix matrix says).
        n = handle.num_recv_tokens if handle.num_recv_tokens is not None else int(prefix[-1, me])
        pieces = [x[:n]] + ([topk_weights[:n]] if topk_weights is not None else [])
        # Received rows are grouped by source rank already: send each group home.
        back = exchange_rows(self.board, pack_rows(pieces), send_matrix[:, me].tolist(), send_matrix[me].tolist(),
                             "combine: rows all-to-all")
        got = unpack_rows(back, pieces)
        src = _send_order(handle.is_token_in_rank)  # token of each returned row, grouped by rank ascending
        acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        t, h = handle.num_tokens, x.shape[1]
        out = torch.zeros(t, h, dtype=acc_dtype, device=x.device)
        for b in bias:
            out += b.to(acc_dtype)
        w_out = None
        if topk_weights is not None:
            w_out = torch.zeros(t, topk_weights.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for count in send_matrix[me].tolist():  # one pass per rank, so the sum order is rank order
            rows = slice(start, start + count)
            out.index_add_(0, src[rows], got[0][rows].to(acc_dtype))
            if w_out is not None:
                w_out.index_add_(0, src[rows], got[1][rows].float())
            start += count
        return out.to(x.dtype), w_out


def _serial(handle) -> int:
    """The dispatch number a handle of this backend carries (0 for a compiled backend's handle)."""
    return handle.backend_state if type(handle.backend_state) is int else 0


def layout_problem(topk_idx: Optional[torch.Tensor], num_tokens_per_rank: torch.Tensor,
                   is_token_in_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor, num_ranks: int,
                   nvl_size: int) -> int:
    """A moe_dispatcher.signature PROBLEMS code for a dispatch's layout (0: consistent). With topk_idx, the
    layout must be exactly get_dispatch_layout's for it (a layout of other routing sends tokens to ranks that
    hold none of their experts); without, its sums must be consistent."""
    sent = is_token_in_rank.sum(0).to(torch.int64).cpu()
    per_rank = num_tokens_per_rank.to(torch.int64).cpu()
    if not torch.equal(sent, per_rank):
        return 1
    per_expert = num_tokens_per_expert.to(torch.int64).cpu()
    if topk_idx is not None:
        want = dispatch_layout(topk_idx, per_expert.numel(), num_ranks, nvl_size)
        same = (torch.equal(want[0].cpu(), num_tokens_per_rank.cpu()) and torch.equal(want[2].cpu(), per_expert.int())
                and torch.equal(want[3].cpu(), is_token_in_rank.cpu()))
        return 0 if same else 2
    local = per_expert.view(num_ranks, -1)
    pairs = local.sum(1)
    return 0 if bool(((pairs >= per_rank) & (pairs <= per_rank * local.shape[1])).all()) else 3


def _pad(t: Optional[torch.Tensor], rows: int, fill: int) -> Optional[torch.Tensor]:
    """t with rows appended up to `rows` (num_worst_tokens padding), filled with `fill`."""
    if t is None or t.shape[0] == rows:
        return t
    out = t.new_zeros((rows,) + tuple(t.shape[1:]))
    if fill:
        out.fill_(fill)
    out[: t.shape[0]] = t
    return out
