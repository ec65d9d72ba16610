"""The few collectives the reference backend is built from, on whatever device the group's backend needs.

Each runs under its Buffer's Board (board.py): a deadline, and names for the ranks that did not arrive."""
from __future__ import annotations

import math
from typing import List, Sequence

import torch
import torch.distributed as dist

from .board import Board


def comm_device(group: dist.ProcessGroup, like: torch.device) -> torch.device:
    """The device collectives of `group` run on: CUDA for NCCL, else the CPU (gloo)."""
    backend = str(dist.get_backend(group)).lower()
    if like.type == "cuda" and "nccl" in backend:
        return like
    if "gloo" in backend or "cpu" in backend or like.type == "cpu":
        return torch.device("cpu")
    return like


def all_gather_rows(board: Board, row: torch.Tensor, phase: str) -> torch.Tensor:
    """Each rank of board.group gives a 1-D int64 tensor of the same length; returns [R, len] on row's device.
    phase names the step in timeout messages."""
    dev = comm_device(board.group, row.device)
    r = row.to(dev, torch.int64)
    parts = [torch.empty_like(r) for _ in range(board.num_ranks)]
    board.run(phase, lambda: dist.all_gather(parts, r, group=board.group, async_op=True))
    return torch.stack(parts).to(row.device)


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def pack_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate the bytes of per-row tensors ([N, ...] each) into one uint8 [N, B] matrix."""
    n = tensors[0].shape[0]
    return torch.cat([t.contiguous().view(-1).view(torch.uint8).reshape(n, _row_bytes(t)) for t in tensors], dim=1)


def unpack_rows(packed: torch.Tensor, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Inverse of pack_rows: `like` gives the dtype and per-row shape of each piece."""
    out, col, n = [], 0, packed.shape[0]
    for t in like:
        nbytes = _row_bytes(t)
        piece = packed[:, col:col + nbytes].clone().view(-1)  # clone: fresh storage, aligned for any dtype
        out.append(piece.view(t.dtype).reshape((n,) + tuple(t.shape[1:])))
        col += nbytes
    return out


def exchange_rows(board: Board, rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                  phase: str) -> torch.Tensor:
    """all_to_all of uint8 rows [N, B] over board.group: the first send_counts[0] rows go to rank 0, and so on.
    phase names the step in timeout messages."""
    dev = comm_device(board.group, rows.device)
    out = torch.empty(int(sum(recv_counts)), rows.shape[1], dtype=torch.uint8, device=dev)
    send = rows.to(dev)
    board.run(phase, lambda: dist.all_to_all_single(out, send, [int(c) for c in recv_counts],
                                                    [int(c) for c in send_counts], group=board.group, async_op=True))
    return out.to(rows.device)
