"""Expert-major dispatch/combine (the fused-permutation API) against a direct computation from every rank's
inputs (docs/semantics.md, "Expert-major"): row order, padding, weights, round trip, weighted combine,
cached mode, num_worst_tokens and its overflow, autograd."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist import BACKENDS, assert_close, assert_equal, case, device, make_buffer, run_distributed

E, K, H = 8, 3, 16


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _expected(rank: int, xs, idxs, ws, local: int, align: int):
    """Rows, weights and padded counts of each local expert, from all ranks' inputs."""
    rows, weights, counts = [], [], []
    for l in range(local):
        e = rank * local + l
        got = [(xs[s][t], ws[s][t, k]) for s in range(len(xs)) for t in range(idxs[s].shape[0])
               for k in range(idxs[s].shape[1]) if idxs[s][t, k] == e]
        pad = -len(got) % align
        rows += [r for r, _ in got] + [torch.zeros(H, dtype=torch.float64)] * pad
        weights += [float(w) for _, w in got] + [0.0] * pad
        counts.append(len(got) + pad)
    return rows, weights, counts


def _layout_worker(rank: int, world: int) -> None:
    dev = device()
    local = E // world
    buf = make_buffer(hidden_bytes=H * 8)
    g = torch.Generator().manual_seed(100 + rank)
    for t in (0, 1, 7):
        x = torch.randn(t, H, dtype=torch.float64, generator=g)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K, dtype=torch.long)
        if t:
            idx[0, 1] = -1
        w = torch.rand(t, K, generator=g)
        xs, idxs, ws = _gather(x), _gather(idx), _gather(w)
        x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
        valid = idx >= 0
        w_valid = torch.where(valid, w, torch.zeros_like(w))
        for align in (1, 4):
            with case(f"T={t} alignment={align}"):
                rows, weights, counts = _expected(rank, xs, idxs, ws, local, align)
                px, pw, lst, tpe, h, _ = buf.expert_major_dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                                   expert_alignment=align)
                assert lst == counts and tpe.tolist() == counts, (lst, counts)
                want = torch.stack(rows) if rows else torch.zeros(0, H, dtype=torch.float64)
                assert_equal(px.cpu(), want, "permuted rows", bitwise=True)
                assert_equal(pw.cpu(), torch.tensor(weights, dtype=torch.float32), "permuted weights")
                y, yw, _ = buf.expert_major_combine(px, h, topk_weights=pw)
                assert_close(y, x * valid.sum(1, keepdim=True), "round trip", rtol=1e-12, atol=0)
                assert_equal(yw, w_valid, "weights back to their slots")
                y2, _, _ = buf.expert_major_combine(px, h, weights=pw)
                assert_close(y2, x * w_valid.sum(1, keepdim=True).double(), "weighted combine", rtol=1e-6, atol=1e-12)
                cx, *_ = buf.expert_major_dispatch(x, handle=h)
                assert_equal(cx, px, "cached dispatch", bitwise=True)
            with case(f"T={t} alignment={align} num_worst_tokens"):
                wx, _, wl, wt, wh, _ = buf.expert_major_dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                                 expert_alignment=align, num_worst_tokens=64)
                assert wx.shape[0] == 64 and wl == [], (wx.shape, wl)
                assert_equal(wx[:px.shape[0]], px, "rows under num_worst_tokens", bitwise=True)
                assert_equal(wt, tpe, "tokens_per_expert under num_worst_tokens")
                assert_equal(buf.expert_major_combine(wx, wh)[0], buf.expert_major_combine(px, h)[0],
                             "combine under num_worst_tokens", bitwise=True)
        with case(f"T={t} autograd"):
            from moe_dispatcher import autograd as ag
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            px, pw, _, _, h = ag.expert_major_dispatch(buf, xr, idx, wr, E)
            ag.expert_major_combine(buf, px * 3, h, weights=pw).sum().backward()
            assert_close(xr.grad, 3 * w_valid.sum(1, keepdim=True).double().expand_as(x), "grad x", rtol=1e-6, atol=0)
            want_w = torch.where(valid, 3 * x.sum(1, keepdim=True).float().expand(t, K), torch.zeros_like(w))
            assert_close(wr.grad, want_w, "grad topk_weights", rtol=1e-5, atol=1e-5)
    dist.barrier()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2])
def test_expert_major(world_size: int, backend: str) -> None:
    run_distributed(_layout_worker, world_size, backend=backend, timeout=120)


def _overflow_worker(rank: int, world: int) -> None:
    """Rank 0 receives 8 tokens (<= W) but 16 (token, expert) rows (> W): rows_needed says 16 and every rank
    raises at the next synchronised dispatch (on every backend: the reference drops and reports as the
    kernels do, so that a caller can check it at its own step's end), then the group must still work."""
    dev = device()
    buf = make_buffer(hidden_bytes=128 * 2)
    x = torch.randn(4, 128, device=dev).bfloat16()
    idx = torch.tensor([[0, 1]] * 4, device=dev)
    with case("num_worst_tokens=10, 16 rows arrive at rank 0"):
        *_, h, _ = buf.expert_major_dispatch(x, topk_idx=idx, num_experts=2 * world, num_worst_tokens=10)
        assert int(h.rows_needed) == (16 if rank == 0 else 0)
        with pytest.raises(ValueError, match="num_worst_tokens"):
            buf.expert_major_dispatch(x, topk_idx=idx, num_experts=2 * world)
    with case("the group still works"):
        px, _, _, _, h, _ = buf.expert_major_dispatch(x, topk_idx=idx, num_experts=2 * world)
        y, _, _ = buf.expert_major_combine(px, h)
        assert_close(y.float(), 2 * x.float(), "round trip after the overflow", rtol=1e-2, atol=1e-2)
    dist.barrier()


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_major_overflow_raises_everywhere(backend: str) -> None:
    run_distributed(_overflow_worker, 2, backend=backend, timeout=60)


def _hook_snapshot_worker(rank: int, world: int) -> None:
    """With return_recv_hook the call sends: changing x before hook() must not change what arrives."""
    from moe_dispatcher import Buffer
    dev = device()
    e, t, h = 4, 3, 128
    buf = Buffer(None, 0, Buffer.get_low_latency_rdma_size_hint(t, h, world, e), low_latency_mode=True)
    x = torch.randn(t, h, device=dev).bfloat16()
    idx = torch.tensor([[0, 2]] * t, device=dev)
    want, _, _, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
    got, _, _, _, hook = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False, return_recv_hook=True)
    x.fill_(7)
    hook()
    assert_equal(got, want, "rows received through the hook", bitwise=True)
    dist.barrier()


@pytest.mark.parametrize("backend", BACKENDS)
def test_hook_sends_at_the_call(backend: str) -> None:
    run_distributed(_hook_snapshot_worker, 2, backend=backend, timeout=60)


@pytest.mark.parametrize("align,worst", [(1, 0), (4, 0), (1, 40), (4, 24)])
def test_split_dispatch_positions_match_permute(align: int, worst: int) -> None:
    """The split expert-major dispatch (docs/intranode.md) places received row n's slot k, routed to local expert
    l, at start[l] + (rank of (n, k) among the received pairs for l in (row, slot) order), dropping positions at
    or past num_worst_tokens. That must be exactly permute()'s placement (pair_row / pair_slot), which the
    fused dispatch and the reference also produce."""
    from moe_dispatcher.expert_major import permute
    g = torch.Generator().manual_seed(align * 100 + worst)
    n, k, local = 37, 4, 5
    recv_idx = torch.randint(-1, local, (n, k), generator=g)
    recv_idx[3] = -1  # a row whose pairs are all elsewhere cannot arrive, but the placement must not care
    x = torch.randn(n, 8, generator=g)
    *_, pair_row, pair_slot, _, _, need = permute(x, None, recv_idx, None, local, align, worst)
    # The kernels' computation, in torch: counts -> padded starts (notify's layout), ranks (launch_pair_rank).
    flat = recv_idx.reshape(-1)
    counts = torch.bincount(flat[flat >= 0], minlength=local)
    padded = (counts + align - 1) // align * align
    start = padded.cumsum(0) - padded
    onehot = torch.nn.functional.one_hot(flat.clamp_min(0), local) * (flat >= 0).unsqueeze(1)
    rank = (onehot.cumsum(0) - onehot)[torch.arange(flat.numel()), flat.clamp_min(0)]
    pos = torch.where(flat >= 0, start[flat.clamp_min(0)] + rank, -1)
    m = worst or int(padded.sum())
    pos = torch.where(pos < m, pos, -1)
    got_row = torch.full((m,), -1, dtype=torch.int64)
    got_slot = torch.full((m,), -1, dtype=torch.int64)
    placed = pos >= 0
    got_row[pos[placed]] = torch.arange(flat.numel())[placed] // k
    got_slot[pos[placed]] = torch.arange(flat.numel())[placed] % k
    assert_equal(got_row, pair_row.long(), "pair_row")
    assert_equal(got_slot, pair_slot.long(), "pair_slot")
    assert int(need) == int(padded.sum())
