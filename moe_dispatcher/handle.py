"""Handles returned by dispatch: what combine (and cached dispatch) need to route rows back.

Both are NamedTuples so DeepEP-style code may index them (`handle[0]` is the rank prefix matrix) while ours
reads fields by name. `buffer_token` ties a handle to the Buffer that made it; `backend_state` holds whatever
a compiled backend keeps beyond the common fields (channel prefix matrices, send heads, device counters).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch


class DispatchHandle(NamedTuple):
    """Normal-mode routing of one dispatch.

    rank_prefix_matrix: int32 [R, R], [i][j] = rows rank j received from ranks 0..i.
    is_token_in_rank:   bool [T, R] on the sending side.
    recv_src_idx:       int32 [N], source token index of each received row (N = rows of recv_x).
    num_recv_tokens:    rows actually received (<= N), or None when only the device knows it.
    num_tokens:         T, the rows combine returns.
    """

    rank_prefix_matrix: torch.Tensor
    is_token_in_rank: torch.Tensor
    recv_src_idx: torch.Tensor
    num_recv_tokens: Optional[int]
    num_tokens: int
    num_worst_tokens: int
    backend: str
    buffer_token: int
    backend_state: Any = None


class LowLatencyHandle(NamedTuple):
    """Low-latency routing of one dispatch.

    src_info:     int32 [L, R * maxT], source token index of each valid row.
    layout_range: int64 [L, R], (begin << 32) | count of the rows each source rank placed at each local expert.
    num_tokens:   T of the dispatch (combine's topk_idx must have that many rows).
    """

    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    backend: str
    buffer_token: int
    backend_state: Any = None
    num_tokens: Optional[int] = None
