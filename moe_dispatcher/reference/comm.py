"""The few collectives the reference backend is built from, on whatever device the group's backend needs."""
from __future__ import annotations

import math
from typing import List, Sequence

import torch
import torch.distributed as dist


def comm_device(group: dist.ProcessGroup, like: torch.device) -> torch.device:
    """The device collectives of `group` run on: CUDA for NCCL, else the CPU (gloo)."""
    backend = str(dist.get_backend(group)).lower()
    if like.type == "cuda" and "nccl" in backend:
        return like
    if "gloo" in backend or "cpu" in backend or like.type == "cpu":
        return torch.device("cpu")
    return like


def all_gather_rows(group: dist.ProcessGroup, row: torch.Tensor) -> torch.Tensor:
    """Each rank gives a 1-D int64 tensor of the same length; returns [R, len] on row's device."""
    dev = comm_device(group, row.device)
    r = row.to(dev, torch.int64)
    parts = [torch.empty_like(r) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, r, group=group)
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


def exchange_rows(group: dist.ProcessGroup, rows: torch.Tensor, send_counts: Sequence[int],
                  recv_counts: Sequence[int]) -> torch.Tensor:
    """all_to_all of uint8 rows [N, B]: the first send_counts[0] rows go to rank 0, and so on."""
    dev = comm_device(group, rows.device)
    out = torch.empty(int(sum(recv_counts)), rows.shape[1], dtype=torch.uint8, device=dev)
    dist.all_to_all_single(out, rows.to(dev), [int(c) for c in recv_counts], [int(c) for c in send_counts],
                           group=group)
    return out.to(rows.device)
