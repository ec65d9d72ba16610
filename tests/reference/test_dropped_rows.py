"""No silent loss: a fixed-size dispatch (num_worst_tokens) that drops rows knows the exact rows it needed from
the counts its exchange carried, and the drop is reported (docs/semantics.md, "Expert-major").

The composition of the compiled backends (the internode one, and the intranode one for cases its fused kernels
do not take) bounds the rank-major exchange by num_worst_tokens too: the kernels keep the first M received rows
and drop the rest without an error. `KernelExchange` is that contract on CPU (the reference's exchange, then the
kernels' truncation and device counts), so the composition over it runs here as it runs over the kernels:
with one local pair per received row (top-1 routing, or one expert per rank) the rows kept need exactly M rows,
and only the exchanged counts tell that more were needed. tests/kernels/test_internode_gpu.py runs the same
routings over the real internode kernels.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist import case, device, make_buffer, run_distributed

H, T = 16, 24


def _kernel_exchange_class():
    from moe_dispatcher.backend import Backend
    from moe_dispatcher.handle import DispatchHandle
    from moe_dispatcher.reference.normal import ReferenceNormal

    class KernelExchange(ReferenceNormal):
        """The reference backend with the compiled backends' num_worst_tokens contract: the first W received rows
        are kept (the rest dropped, no error), the per-expert counts come back on the device, and expert-major
        calls are Backend's composition over that exchange."""

        expert_major_dispatch = Backend.expert_major_dispatch

        def dispatch(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                     num_tokens_per_expert, expert_alignment, num_worst_tokens, config=None):
            out = super().dispatch(x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                   num_tokens_per_expert, expert_alignment, 0, config)
            if not num_worst_tokens:
                return out
            w = num_worst_tokens

            def keep(t, fill):
                if t is None:
                    return None
                kept = t.new_full((w,) + tuple(t.shape[1:]), fill)
                kept[:min(w, t.shape[0])] = t[:w]
                return kept

            recv_x, recv_s, recv_idx, recv_w, counts, h = out
            handle = DispatchHandle(h.rank_prefix_matrix, h.is_token_in_rank, keep(h.recv_src_idx, -1), None,
                                    h.num_tokens, w, h.backend, h.buffer_token)
            return (keep(recv_x, 0), keep(recv_s, 0), keep(recv_idx, -1), keep(recv_w, 0),
                    torch.tensor(counts, dtype=torch.int32, device=x.device), handle)

    return KernelExchange


def _routing(kind: str, rank: int, world: int):
    """(topk_idx [T, K], num_experts) with one pair per received row: top-1 sends every token of every rank to
    rank 0 (world * T rows there, none elsewhere); one expert per rank sends every token to every rank."""
    if kind == "top-1":  # K = 1, two experts per rank: tokens alternate between rank 0's two experts
        return (torch.arange(T) % 2).view(T, 1), 2 * world
    # one expert per rank, K = world: each token picks every rank's expert once
    return torch.stack([torch.randperm(world) for _ in range(T)]), world


def _composition_worker(rank: int, world: int) -> None:
    dev = device()
    buf = make_buffer(hidden_bytes=H * 4)
    buf._reference_normal.__class__ = _kernel_exchange_class()  # the kernels' exchange (module docstring)
    torch.manual_seed(rank)
    x = torch.randn(T, H, device=dev)
    worst = 32  # < world * T rows arrive at rank 0
    for kind in ("top-1", "one expert per rank"):
        idx, num_experts = _routing(kind, rank, world)
        idx = idx.to(dev)
        local = num_experts // world
        for align in (1, 4):
            with case(f"{kind}, alignment {align}: rows_needed from the exchanged counts"):
                *_, want_counts, _, _ = buf.expert_major_dispatch(x, topk_idx=idx, num_experts=num_experts,
                                                                 expert_alignment=align)
                assert sum(want_counts) == (world * T if rank == 0 or kind != "top-1" else 0), want_counts
                px, _, lst, tpe, h, _ = buf.expert_major_dispatch(x, topk_idx=idx, num_experts=num_experts,
                                                                  expert_alignment=align, num_worst_tokens=worst)
                assert px.shape[0] == worst and lst == [] and tpe.numel() == local
                assert int(h.rows_needed) == sum(want_counts), (int(h.rows_needed), want_counts)
            with case(f"{kind}, alignment {align}: the drop is reported on every rank"):
                with pytest.raises(ValueError, match="num_worst_tokens"):
                    buf.expert_major_dispatch(x, topk_idx=idx, num_experts=num_experts, expert_alignment=align)
            with case(f"{kind}, alignment {align}: enough rows, nothing reported"):
                buf.expert_major_dispatch(x, topk_idx=idx, num_experts=num_experts, expert_alignment=align,
                                          num_worst_tokens=world * T + 4 * local)
                buf.expert_major_dispatch(x, topk_idx=idx, num_experts=num_experts, expert_alignment=align)
    dist.barrier()


def test_composition_knows_the_rows_its_exchange_dropped() -> None:
    run_distributed(_composition_worker, 2, timeout=120)


def _reference_worker(rank: int, world: int) -> None:
    """The reference backend's expert-major overflow: reported like the kernels' (rows_needed, then the next
    synchronised dispatch), never raised by its exchange, so a caller can check it at its own step's end."""
    dev = device()
    buf = make_buffer(hidden_bytes=H * 4)
    x = torch.randn(T, H, device=dev)
    idx, num_experts = _routing("top-1", rank, world)
    with case("reference: num_worst_tokens below the received rows"):
        px, _, _, _, h, _ = buf.expert_major_dispatch(x, topk_idx=idx.to(dev), num_experts=num_experts,
                                                      num_worst_tokens=32)
        assert px.shape[0] == 32 and int(h.rows_needed) == (world * T if rank == 0 else 0)
        y, _, _ = buf.expert_major_combine(px, h)  # the rows kept still go home
        assert y.shape == x.shape
    with case("reference: a caller that checked the overflow itself forgets it"):
        buf._forget_dropped_rows()
        buf.expert_major_dispatch(x, topk_idx=idx.to(dev), num_experts=num_experts)
    dist.barrier()


def test_reference_reports_instead_of_raising_in_the_exchange() -> None:
    run_distributed(_reference_worker, 2, timeout=120)
