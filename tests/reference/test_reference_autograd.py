"""moe_dispatcher.autograd on real ranks vs the single-process math.

Normal mode runs in float64: the gradients are sums of the upstream gradients (exact up to summation order,
checked to 1e-12). Low-latency mode is bf16: checked within bf16 rounding.
"""
from __future__ import annotations

import functools

import oracle
import pytest
import torch
import torch.distributed as dist
from dist import (
    BACKENDS,
    assert_close,
    assert_equal,
    case,
    device,
    make_buffer,
    make_low_latency_buffer,
    per_rank,
    run_distributed,
)
from test_reference_low_latency import check_ll_layout

NORMAL_CASES: list[dict] = [
    {"name": "random", "T": [37, 0, 64, 1], "H": 64, "L": 4, "K": 4, "kind": "random"},
    {"name": "dense", "T": [20, 33, 1, 7], "H": 32, "L": 3, "K": 6, "kind": "dense"},
    {"name": "skewed", "T": [30, 21, 30, 3], "H": 16, "L": 2, "K": 4, "kind": "skewed"},
    {"name": "last-rank-gets-nothing", "T": [12, 12, 0, 12], "H": 16, "L": 2, "K": 3, "kind": "avoid_last_rank"},
    {"name": "all-unused", "T": [4, 0, 3, 1], "H": 8, "L": 1, "K": 1, "kind": "unused"},
]


def _close64(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert_close(got, want, what, rtol=1e-12, atol=1e-12)


def _normal_worker(rank: int, num_ranks: int) -> None:
    from moe_dispatcher import autograd
    dev = device()
    buf = make_buffer(hidden_bytes=64 * 8)
    for ci, c in enumerate(NORMAL_CASES):
        tokens = per_rank(c["T"], num_ranks)
        num_experts = c["L"] * num_ranks
        xs, idxs, ws = [], [], []
        for r in range(num_ranks):
            g = oracle.generator(700 + ci, r)
            idxs.append(oracle.make_topk_idx(g, tokens[r], num_experts, c["K"], num_ranks, c["kind"]))
            xs.append(oracle.make_x(g, tokens[r], c["H"], "randn", torch.float64))
            ws.append(oracle.make_weights(g, idxs[-1]))
        exp = oracle.dispatch(xs, idxs, ws, num_experts)
        most = max(e.num_rows for e in exp)
        for worst in (0, most + 2):
            rows = [worst or e.num_rows for e in exp]
            # upstream gradients of every rank's outputs (padding rows too: they must not leak back)
            gx = [torch.randn(rows[r], c["H"], generator=oracle.generator(720 + ci, r), dtype=torch.float64)
                  for r in range(num_ranks)]
            gw = [torch.randn(rows[r], c["K"], generator=oracle.generator(740 + ci, r)) for r in range(num_ranks)]
            with case(f"{c['name']} dispatch backward (num_worst_tokens={worst})"):
                x = xs[rank].clone().to(dev).requires_grad_()
                w = ws[rank].clone().to(dev).requires_grad_()
                recv_x, _, recv_w, counts, handle = autograd.dispatch(buf, x, idxs[rank].to(dev), w,
                                                                             num_experts, num_worst_tokens=worst)
                n = exp[rank].num_rows
                assert_equal(recv_x[:n].detach(), exp[rank].recv_x, "recv_x")
                assert_equal(recv_w[:n].detach(), exp[rank].recv_topk_weights, "recv_topk_weights")
                if not worst:
                    assert_equal(list(counts), exp[rank].num_recv_tokens_per_expert_list, "counts")
                loss = (recv_x * gx[rank].to(dev)).sum() + (recv_w * gw[rank].to(dev)).sum()
                loss.backward()
                # d/dx[t] = sum over the ranks that got t of their row's gradient; d/dw[t, k] = the gradient at
                # the one rank that owns expert idx[t, k] (elsewhere recv_w is a constant 0)
                masked = [torch.where(e.recv_topk_idx >= 0, gw[r][:e.num_rows], torch.zeros(()))
                          for r, e in enumerate(exp)]
                want = oracle.combine([gx[r][:e.num_rows] for r, e in enumerate(exp)], exp, tokens, masked)[rank]
                _close64(x.grad, want[0], "x.grad")
                assert_close(w.grad, want[1], "topk_weights.grad", rtol=0, atol=0)

            with case(f"{c['name']} combine backward (num_worst_tokens={worst})"):
                y_all = [torch.randn(rows[r], c["H"], generator=oracle.generator(760 + ci, r), dtype=torch.float64)
                         for r in range(num_ranks)]
                gout = [torch.randn(tokens[r], c["H"], generator=oracle.generator(780 + ci, r), dtype=torch.float64)
                        for r in range(num_ranks)]
                y = y_all[rank].to(dev).requires_grad_()
                out = autograd.combine(buf, y, handle)
                want_out = oracle.combine([y_all[r][:e.num_rows] for r, e in enumerate(exp)], exp, tokens)[rank][0]
                _close64(out.detach(), want_out, "combined_x")
                out.backward(gout[rank].to(dev))
                e = exp[rank]
                want_grad = torch.zeros(rows[rank], c["H"], dtype=torch.float64)
                for i in range(e.num_rows):
                    want_grad[i] = gout[int(e.recv_src_rank[i])][int(e.recv_src_idx[i])]
                _close64(y.grad, want_grad, "y.grad (padding rows never reached combine: 0)")

        with case(f"{c['name']} dispatch -> *2 -> combine chain"):
            x = xs[rank].clone().to(dev).requires_grad_()
            recv_x, _, _, _, handle = autograd.dispatch(buf, x, idxs[rank].to(dev), None, num_experts)
            out = autograd.combine(buf, recv_x * 2, handle)
            gout = torch.randn(tokens[rank], c["H"], generator=oracle.generator(800 + ci, rank), dtype=torch.float64)
            out.backward(gout.to(dev))
            reached = oracle.layout(idxs[rank], num_experts, num_ranks).is_token_in_rank.sum(1, keepdim=True)
            _close64(out.detach(), xs[rank] * 2 * reached, "combine(2 * dispatch(x))")
            _close64(x.grad, gout * 2 * reached, "x.grad through the chain")
    dist.barrier()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_autograd_normal(world_size: int, backend: str) -> None:
    """float64 dispatch/combine gradients vs the single-process sums (x and topk_weights; padding rows)."""
    run_distributed(_normal_worker, world_size, backend=backend)


# ------------------------------------------------------------------------------------------- low latency
LL_CASES: list[dict] = [
    {"name": "random", "T": [16, 0, 11, 1], "maxT": 16, "H": 128, "L": 2, "K": 3, "kind": "random"},
    {"name": "dense", "T": [8, 8, 3, 8], "maxT": 8, "H": 256, "L": 2, "K": 4, "kind": "dense"},
    {"name": "skewed", "T": [6, 2, 6, 6], "maxT": 6, "H": 128, "L": 1, "K": 1, "kind": "skewed"},
]


def _slot_rows(s: int, *, idxs: list, table: dict, hidden: int) -> torch.Tensor:
    """bf16 [T_s, K, H]: the table row of (expert of slot k, s, t) for every used slot of source s."""
    t_count, k_count = idxs[s].shape
    out = torch.zeros(t_count, k_count, hidden, dtype=torch.bfloat16)
    for t in range(t_count):
        for k in range(k_count):
            e = int(idxs[s][t, k])
            if e >= 0:
                out[t, k] = table[(e, s)][t]
    return out


def _fill(rows_of: list, *, table: dict, shape: tuple, rank: int) -> torch.Tensor:
    """[L, R*maxT, H] bf16 holding the table row of each valid row in this rank's layout; NaN elsewhere."""
    y = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    for local, owner in enumerate(rows_of):
        for i, (s, t) in enumerate(owner):
            y[local, i] = table[(rank * shape[0] + local, s)][t]
    return y


def _ll_worker(rank: int, num_ranks: int) -> None:
    from moe_dispatcher import autograd
    dev = device()
    reference = dev.type == "cpu"
    buf = make_low_latency_buffer(LL_CASES, num_ranks)
    bf16 = {"rtol": 2 ** -7, "atol": 1e-6}
    for ci, c in enumerate(LL_CASES):
        tokens = per_rank(c["T"], num_ranks)
        num_experts, num_local, max_tokens, hidden = c["L"] * num_ranks, c["L"], c["maxT"], c["H"]
        xs, idxs, ws, gouts = [], [], [], []
        for r in range(num_ranks):
            g = oracle.generator(900 + ci, r)
            idxs.append(oracle.make_topk_idx(g, tokens[r], num_experts, c["K"], num_ranks, c["kind"]))
            xs.append(oracle.make_x(g, tokens[r], hidden, "randn"))
            ws.append(oracle.make_weights(g, idxs[-1]))
            gouts.append(oracle.make_x(g, tokens[r], hidden, "randn"))
        # the value (a gradient, or an expert's output) at the row of (expert e, source s, token t)
        table = {(e, s): oracle.make_x(oracle.generator(950 + ci, e, s), max_tokens, hidden, "randn")
                 for e in range(num_experts) for s in range(num_ranks)}

        slot_rows = functools.partial(_slot_rows, idxs=idxs, table=table, hidden=hidden)
        fill = functools.partial(_fill, table=table, shape=(num_local, num_ranks * max_tokens, hidden), rank=rank)

        with case(f"{c['name']} low_latency_dispatch backward"):
            x = xs[rank].clone().to(dev).requires_grad_()
            recv_x, recv_count, handle = autograd.low_latency_dispatch(buf, x, idxs[rank].to(dev), max_tokens,
                                                                       num_experts)
            rows_of = check_ll_layout(recv_count, handle, idxs, num_experts, max_tokens, hidden, rank, reference,
                                      "autograd low_latency_dispatch")
            grad = fill(rows_of)  # NaN in the invalid rows: they must not be read
            recv_x.backward(grad.to(dev))
            ones = (idxs[rank] >= 0).float()
            # The Buffer's default combine order (per_rank): the backward of dispatch is that combine.
            assert_close(x.grad, oracle.low_latency_combine_per_rank(idxs[rank], ones, slot_rows(rank), num_local),
                         "x.grad", **bf16)

        with case(f"{c['name']} low_latency_combine backward"):
            y = fill(rows_of).to(dev).requires_grad_()
            w = ws[rank].clone().to(dev).requires_grad_()
            out = autograd.low_latency_combine(buf, y, idxs[rank].to(dev), w, handle)
            assert_close(out.detach(),
                         oracle.low_latency_combine_per_rank(idxs[rank], ws[rank], slot_rows(rank), num_local),
                         "combined_x", **bf16)
            out.backward(gouts[rank].to(dev))
            # d/dy at the row of (e, s, t) = w_s[t, k(e)] * gout_s[t]
            want_gy = torch.zeros(num_local, num_ranks * max_tokens, hidden, dtype=torch.bfloat16)
            for local, owner in enumerate(rows_of):
                e = rank * num_local + local
                for i, (s, t) in enumerate(owner):
                    k = (idxs[s][t] == e).nonzero().item()
                    want_gy[local, i] = (ws[s][t, k] * gouts[s][t].float()).to(torch.bfloat16)
            for local, owner in enumerate(rows_of):
                n = len(owner)
                assert_close(y.grad[local, :n], want_gy[local, :n], f"y.grad of local expert {local}", **bf16)
            # d/dw[t, k] = <gout[t], row(t, k)>, 0 on unused slots
            terms = gouts[rank].double().unsqueeze(1) * slot_rows(rank).double()  # [T, K, H]
            want_gw = terms.sum(-1)
            tol = 2 ** -14 * want_gw.abs() + 2 ** -18 * terms.abs().sum(-1) + 1e-30
            err = (w.grad.detach().cpu().double() - want_gw).abs()
            if w.grad.dtype != torch.float32 or bool((err > tol).any()):
                raise AssertionError(f"topk_weights.grad ({w.grad.dtype}) off by up to {err.max().item():.3g}: got "
                                     f"{w.grad.cpu()}, expected {want_gw}")
    dist.barrier()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_autograd_low_latency(world_size: int, backend: str) -> None:
    """bf16 low-latency dispatch/combine gradients (x, expert rows, topk_weights) vs the single-process math."""
    run_distributed(_ll_worker, world_size, backend=backend)
