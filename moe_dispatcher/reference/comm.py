"""The few collectives the reference backend is built from, on whatever device the group's backend needs.

Each runs under its Buffer's Board (board.py): a deadline, and names for the ranks that did not arrive."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..signature import SIGNATURE_WORDS, Signature, check_agreement
from .board import Board


def comm_device(group: dist.ProcessGroup, like: torch.device) -> torch.device:
    """The device collectives of `group` run on: CUDA for NCCL, else the CPU (gloo)."""
    backend = str(dist.get_backend(group)).lower()
    if like.type == "cuda" and "nccl" in backend:
        return like
    if "gloo" in backend or "cpu" in backend or like.type == "cpu":
        return torch.device("cpu")
    return like


def all_gather_rows(board: Board, row: torch.Tensor, phase: str, timeout_s: Optional[float] = None) -> torch.Tensor:
    """Each rank of board.group gives a 1-D int64 tensor of the same length; returns [R, len] on row's device.
    phase names the step in timeout messages; timeout_s: its deadline (default: the Board's)."""
    dev = comm_device(board.group, row.device)
    r = row.to(dev, torch.int64)
    parts = [torch.empty_like(r) for _ in range(board.num_ranks)]
    board.run(phase, lambda: dist.all_gather(parts, r, group=board.group, async_op=True), timeout_s)
    return torch.stack(parts).to(row.device)


def agree(board: Board, signature: Signature, device: torch.device, payload: Optional[torch.Tensor] = None,
          phase: str = "signature all-gather", timeout_s: Optional[float] = None) -> torch.Tensor:
    """Collective: all-gather this rank's call `signature` (moe_dispatcher.signature) with an optional int64
    `payload` of at most num_ranks + 1 words, and raise SignatureMismatch on every rank when the signatures
    differ. Every agreement of the reference backend gathers rows of one length (SIGNATURE_WORDS + num_ranks
    + 1), whatever the call, so ranks in different calls exchange rows of equal size and learn it. phase names
    the step in timeout messages (after the operation's name); timeout_s its deadline (default: the Board's).
    Returns the ranks' payloads, int64 [R, num_ranks + 1] on the CPU (zero-padded)."""
    width = board.num_ranks + 1
    row = torch.zeros(SIGNATURE_WORDS + width, dtype=torch.int64, device=device)
    row[:SIGNATURE_WORDS] = signature.tensor(device)
    if payload is not None:
        row[SIGNATURE_WORDS: SIGNATURE_WORDS + payload.numel()] = payload.to(device, torch.int64)
    table = all_gather_rows(board, row, f"{signature.operation}: {phase}", timeout_s).cpu()
    check_agreement(table[:, :SIGNATURE_WORDS])
    return table[:, SIGNATURE_WORDS:]


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
