"""Low-latency dispatch and combine on real ranks, checked against the single-process oracle.

Layouts are compared through src_info / layout_range (kernels may order rows differently); the reference
must additionally keep sources ascending and tokens ascending within a source, as the contract says.
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

# Written for 4 ranks (token counts cycle for 2). L: local experts per rank.
LL_DISPATCH_CASES: list[dict] = [
    {"name": "bf16", "T": [37, 0, 64, 1], "maxT": 64, "H": 256, "L": 3, "K": 4, "kind": "random"},
    {"name": "fp8", "T": [50, 17, 3, 64], "maxT": 64, "H": 512, "L": 2, "K": 4, "kind": "random", "fp8": True},
    {"name": "fp8-round-scale", "T": [50, 17, 3, 64], "maxT": 64, "H": 384, "L": 2, "K": 4, "kind": "random", "fp8": True,
     "round_scale": True},
    {"name": "fp8-ue8m0", "T": [20, 1, 33, 0], "maxT": 40, "H": 1024, "L": 2, "K": 3, "kind": "random", "fp8": True,
     "round_scale": True, "ue8m0": True},
    {"name": "skewed", "T": [32, 32, 5, 32], "maxT": 32, "H": 128, "L": 2, "K": 2, "kind": "skewed", "fp8": True},
    {"name": "last-rank-gets-nothing", "T": [16, 9, 0, 16], "maxT": 16, "H": 128, "L": 2, "K": 3, "kind": "avoid_last_rank"},
    {"name": "all-unused", "T": [8, 3, 8, 1], "maxT": 8, "H": 256, "L": 1, "K": 1, "kind": "unused", "fp8": True},
    {"name": "T=0-everywhere", "T": [0], "maxT": 4, "H": 128, "L": 2, "K": 2, "kind": "random", "fp8": True},
    {"name": "T=1-dense", "T": [1], "maxT": 1, "H": 128, "L": 1, "K": 2, "kind": "dense"},
    {"name": "bf16-special-values", "T": [9, 4, 0, 12], "maxT": 12, "H": 128, "L": 2, "K": 2, "kind": "random",
     "x": "special"},
    {"name": "hidden-7168", "T": [3, 1, 2, 0], "maxT": 4, "H": 7168, "L": 1, "K": 2, "kind": "dense", "fp8": True, "round_scale": True},
]


def _routing(c: dict, seed: int, num_ranks: int, x_kind: str):
    tokens = per_rank(c["T"], num_ranks)
    num_experts = c["L"] * num_ranks
    xs, idxs, ws = [], [], []
    for r in range(num_ranks):
        g = oracle.generator(seed, r)
        idx = oracle.make_topk_idx(g, tokens[r], num_experts, c["K"], num_ranks, c["kind"])
        xs.append(oracle.make_x(g, tokens[r], c["H"], x_kind))
        idxs.append(idx)
        ws.append(oracle.make_weights(g, idx, grid=x_kind == "grid"))
    return xs, idxs, ws, num_experts


def _decode(layout_range: torch.Tensor):
    lr = layout_range.cpu().to(torch.int64)
    return lr >> 32, lr & 0xFFFFFFFF


def check_ll_layout(recv_count, handle, idxs, num_experts: int, max_tokens: int, hidden: int, rank: int,
                    reference: bool, what: str) -> list[list[tuple]]:
    """Check recv_count and the handle's src_info / layout_range; return (src rank, src token) of every valid
    row, per local expert, in row order."""
    num_ranks = len(idxs)
    num_local = num_experts // num_ranks
    exp = oracle.low_latency_dispatch(idxs, num_experts)[rank]
    assert_equal(recv_count, exp.recv_count, f"{what}: recv_count")
    if (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts) != (max_tokens, hidden,
                                                                                          num_experts):
        raise AssertionError(f"{what}: handle holds (maxT, hidden, E) = {tuple(handle[2:5])}")
    assert_equal((handle.src_info.dtype, tuple(handle.src_info.shape)),
                 (torch.int32, (num_local, num_ranks * max_tokens)), f"{what}: src_info dtype/shape")
    assert_equal((handle.layout_range.dtype, tuple(handle.layout_range.shape)), (torch.int64, (num_local, num_ranks)),
                 f"{what}: layout_range dtype/shape")
    begin, count = _decode(handle.layout_range)
    src_info = handle.src_info.cpu()
    rows = []
    for local in range(num_local):
        n = int(exp.recv_count[local])
        owner: list[tuple | None] = [None] * n
        for src in range(num_ranks):
            b, k = int(begin[local, src]), int(count[local, src])
            want = exp.from_source(local, src)
            if k != len(want):
                raise AssertionError(f"{what}: expert {local} got {k} rows from rank {src}, expected {len(want)}")
            if k == 0:
                continue
            if b < 0 or b + k > n:
                raise AssertionError(f"{what}: expert {local} rows [{b}, {b + k}) from rank {src} exceed recv_count {n}")
            got = src_info[local, b:b + k].tolist()
            if sorted(got) != want:
                raise AssertionError(f"{what}: expert {local} from rank {src}: src_info {got}, expected tokens {want}")
            if reference:
                earlier = sum(len(exp.from_source(local, s)) for s in range(src))
                if got != want or b != earlier:
                    raise AssertionError(f"{what}: the reference orders sources then tokens ascending; expert {local} "
                                         f"from rank {src} begins at {b} (expected {earlier}) with tokens {got}")
            for i in range(k):
                if owner[b + i] is not None:
                    raise AssertionError(f"{what}: expert {local} row {b + i} claimed by two source ranks")
                owner[b + i] = (src, got[i])
        if None in owner:
            raise AssertionError(f"{what}: expert {local} rows {[i for i, o in enumerate(owner) if o is None]} "
                                 f"belong to no source rank's range")
        rows.append(owner)
    return rows


def check_fp8_bound(deq: torch.Tensor, x: torch.Tensor, scales: torch.Tensor, what: str) -> None:
    """|dequant - x| <= half an e4m3 ulp of the scaled value * scale (per element), and per 128-block
    DeepEP's similarity 1 - 2 sum(ab) / sum(a^2 + b^2) < 2^-7 (blocks above the 1e-4 amax floor)."""
    if x.numel() == 0:
        return
    t = x.shape[0]
    xf = x.float().reshape(t, -1, 128)
    sc = (oracle.unpack_ue8m0(scales) if scales.dtype == torch.int32 else scales.float()).unsqueeze(-1)
    scaled = (xf.double() / sc.double()) * (1 + 2 ** -20)
    bound = oracle.e4m3_half_ulp(scaled) * sc.double() + xf.double().abs() * 2 ** -20 + 1e-30
    err = (deq.double().reshape(t, -1, 128) - xf.double()).abs()
    if bool((err > bound).any()):
        i = (err - bound).flatten().argmax().item()
        raise AssertionError(f"{what}: FP8 cast-back error {err.flatten()[i].item():.3g} exceeds half an ulp "
                             f"({bound.flatten()[i].item():.3g}) at flat index {i}")
    a, b = deq.double().reshape(t, -1, 128), xf.double()
    denom = (a * a + b * b).sum(-1)
    sim = 1 - 2 * (a * b).sum(-1) / denom.clamp_min(1e-300)
    normal = xf.abs().amax(-1) >= 1e-4
    if bool((sim[normal] >= 2 ** -7).any()):
        raise AssertionError(f"{what}: 128-block similarity error {sim[normal].max().item():.3g} >= 2^-7")


def _ll_dispatch_worker(rank: int, num_ranks: int) -> None:
    dev = device()
    reference = dev.type == "cpu"
    buf = make_low_latency_buffer(LL_DISPATCH_CASES, num_ranks)
    for ci, c in enumerate(LL_DISPATCH_CASES):
        fp8, round_scale, ue8m0 = c.get("fp8", False), c.get("round_scale", False), c.get("ue8m0", False)
        xs, idxs, _, num_experts = _routing(c, 300 + ci, num_ranks, c.get("x", "fp8" if fp8 else "randn"))
        num_local, max_tokens, hidden = c["L"], c["maxT"], c["H"]
        casts = [oracle.per_token_cast_to_fp8(x, round_scale, ue8m0) for x in xs] if fp8 else None
        cum = torch.zeros(num_local, dtype=torch.int32, device=dev)
        wait = torch.zeros(num_ranks, dtype=torch.int64, device=dev)
        results = []
        wait_prev = wait.cpu().clone()
        for call in range(2):
            with case(f"{c['name']} call {call}"):
                got = buf.low_latency_dispatch(xs[rank].to(dev), idxs[rank].to(dev), max_tokens, num_experts,
                                               cumulative_local_expert_recv_stats=cum,
                                               dispatch_wait_recv_cost_stats=wait, use_fp8=fp8,
                                               round_scale=round_scale, use_ue8m0=ue8m0)
                if len(got) != 5 or got[4] is not None:
                    raise AssertionError("low_latency_dispatch returns (recv_x, recv_count, handle, event, None)")
                results.append(got)
                recv_count = got[1]
                assert_equal(cum.cpu(), recv_count.cpu() * (call + 1), "cumulative_local_expert_recv_stats")
                wait_now = wait.cpu().clone()
                # the reference adds its whole exchange time to every source; kernels may add 0 for some
                stuck = (wait_now <= wait_prev) if reference else (wait_now < wait_prev)
                if bool(stuck.any()):
                    raise AssertionError(f"dispatch_wait_recv_cost_stats must grow: {wait_prev} -> {wait_now}")
                wait_prev = wait_now
        for call, got in enumerate(results):  # the first result is still intact after the second call
            with case(f"{c['name']} outputs of call {call}"):
                recv_x, recv_count, handle = got[:3]
                rows = check_ll_layout(recv_count, handle, idxs, num_experts, max_tokens, hidden, rank, reference,
                                       "low_latency_dispatch")
                slots = num_ranks * max_tokens
                if not fp8:
                    assert_equal((recv_x.dtype, tuple(recv_x.shape)), (torch.bfloat16, (num_local, slots, hidden)),
                                 "recv_x dtype/shape")
                    for local, owner in enumerate(rows):
                        want = torch.stack([xs[s][t] for s, t in owner]) if owner else xs[0].new_empty(0, hidden)
                        assert_equal(recv_x[local, :len(owner)], want, f"recv_x of local expert {local}",
                                     bitwise=True)
                    continue
                if not isinstance(recv_x, tuple) or len(recv_x) != 2:
                    raise AssertionError("use_fp8 recv_x must be the tuple (fp8 data, scales)")
                data, scales = recv_x
                groups = hidden // 512 if ue8m0 else hidden // 128
                assert_equal((data.dtype, tuple(data.shape)), (torch.float8_e4m3fn, (num_local, slots, hidden)),
                             "recv_x[0] dtype/shape")
                assert_equal((scales.dtype, tuple(scales.shape)),
                             (torch.int32 if ue8m0 else torch.float32, (num_local, slots, groups)),
                             "recv_x[1] (scales) dtype/shape")
                if scales.stride() != (groups * slots, 1, slots):
                    raise AssertionError(f"scales must be token-minor (a transposed [L, G, R*maxT] tensor); strides "
                                         f"{scales.stride()}")
                for local, owner in enumerate(rows):
                    n = len(owner)
                    if not n:
                        continue
                    want_q = torch.stack([casts[s][0][t] for s, t in owner])
                    want_s = torch.stack([casts[s][1][t] for s, t in owner])
                    assert_equal(data[local, :n], want_q, f"FP8 bytes of local expert {local}")
                    assert_equal(scales[local, :n], want_s, f"FP8 scales of local expert {local}")
                    x_rows = torch.stack([xs[s][t] for s, t in owner])
                    deq = oracle.dequant_fp8(data[local, :n].cpu(), scales[local, :n].cpu())
                    check_fp8_bound(deq, x_rows, scales[local, :n].cpu(), f"local expert {local}")
    dist.barrier()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_low_latency_dispatch(world_size: int, backend: str) -> None:
    """Layout (src_info/layout_range), recv_count, payload, FP8 bytes/scales/bound, round_scale, ue8m0, stats."""
    run_distributed(_ll_dispatch_worker, world_size, backend=backend)


# ------------------------------------------------------------------------------------------- combine
LL_COMBINE_CASES: list[dict] = [
    {"name": "random", "T": [37, 0, 64, 1], "maxT": 64, "H": 256, "L": 3, "K": 4, "kind": "random"},
    {"name": "dense", "T": [20, 31, 7, 32], "maxT": 32, "H": 128, "L": 2, "K": 6, "kind": "dense"},
    {"name": "skewed", "T": [32, 32, 5, 32], "maxT": 32, "H": 128, "L": 2, "K": 2, "kind": "skewed"},
    {"name": "last-rank-gets-nothing", "T": [16, 9, 0, 16], "maxT": 16, "H": 512, "L": 2, "K": 3, "kind": "avoid_last_rank"},
    {"name": "all-unused", "T": [8, 3, 8, 1], "maxT": 8, "H": 128, "L": 1, "K": 1, "kind": "unused"},
    {"name": "T=1", "T": [1, 0, 1, 1], "maxT": 1, "H": 1024, "L": 1, "K": 2, "kind": "dense"},
]
FACTORS = [0.5, 1.0, 1.5, 2.0]  # expert e returns bf16(x * FACTORS[e % 4])


def expert_outputs(recv_x: torch.Tensor, rows: list[list[tuple]], rank: int, num_local: int) -> torch.Tensor:
    """What this rank's experts return: bf16(row * factor of the global expert); invalid rows are NaN."""
    y = torch.full(tuple(recv_x.shape), float("nan"), dtype=torch.bfloat16)
    for local, owner in enumerate(rows):
        n = len(owner)
        factor = FACTORS[(rank * num_local + local) % 4]
        y[local, :n] = (recv_x[local, :n].cpu().float() * factor).to(torch.bfloat16)
    return y


def expected_combine(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, reduction: str = "per_expert",
                     num_local: int = 1) -> torch.Tensor:
    k = idx.shape[1]
    slot_rows = torch.zeros(x.shape[0], k, x.shape[1], dtype=torch.bfloat16)
    for t in range(x.shape[0]):
        for j in range(k):
            if int(idx[t, j]) >= 0:
                slot_rows[t, j] = (x[t].float() * FACTORS[int(idx[t, j]) % 4]).to(torch.bfloat16)
    if reduction == "per_rank":
        return oracle.low_latency_combine_per_rank(idx, w, slot_rows, num_local)
    return oracle.low_latency_combine(idx, w, slot_rows)


def _check_combined(out: torch.Tensor, what: str, *, want: torch.Tensor, exact: bool) -> None:
    if exact:
        assert_equal(out, want, what)
    else:  # kernels may fuse multiply-adds: one bf16 rounding step apart at most
        assert_close(out, want, what, rtol=2 ** -7, atol=1e-6)


def _ll_combine_worker(rank: int, num_ranks: int) -> None:
    dev = device()
    reference = dev.type == "cpu"
    buf = make_low_latency_buffer(LL_COMBINE_CASES, num_ranks)
    for ci, c, reduction in [(ci, c, red) for red in ("per_rank", "per_expert") for ci, c in enumerate(LL_COMBINE_CASES)]:
        buf.low_latency_combine_reduction = reduction
        num_local, max_tokens, hidden = c["L"], c["maxT"], c["H"]
        for x_kind in ("grid", "randn"):
            xs, idxs, ws, num_experts = _routing(c, 500 + ci, num_ranks, x_kind)
            x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
            want = expected_combine(xs[rank], idxs[rank], ws[rank], reduction, num_local)
            check = functools.partial(_check_combined, want=want, exact=x_kind == "grid" or reference)

            with case(f"{c['name']} {x_kind} ({reduction}): dispatch + weighted combine"):
                recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, max_tokens, num_experts,
                                                                            use_fp8=False)
                rows = check_ll_layout(recv_count, handle, idxs, num_experts, max_tokens, hidden, rank, reference,
                                       "low_latency_dispatch")
                y = expert_outputs(recv_x, rows, rank, num_local).to(dev)
                out, _, hook = buf.low_latency_combine(y, idx, w, handle)
                if hook is not None:
                    raise AssertionError("low_latency_combine without return_recv_hook returns hook None")
                check(out, "combined_x")
            if x_kind != "grid":
                continue
            with case(f"{c['name']}: weights of unused slots are ignored (NaN there)"):
                w_nan = torch.where(idx >= 0, w, torch.full_like(w, float("nan")))
                check(buf.low_latency_combine(y, idx, w_nan, handle)[0], "combined_x with NaN weights on -1 slots")
            with case(f"{c['name']}: out="):
                out = torch.full((x.shape[0], hidden), float("nan"), dtype=torch.bfloat16, device=dev)
                res = buf.low_latency_combine(y, idx, w, handle, out=out)[0]
                if res.data_ptr() != out.data_ptr() and res.numel():
                    raise AssertionError("low_latency_combine(out=out) must return out")
                check(out, "out")
            with case(f"{c['name']}: zero_copy"):
                send = buf.get_next_low_latency_combine_buffer(handle)
                assert_equal((send.dtype, tuple(send.shape)),
                             (torch.bfloat16, (num_local, num_ranks * max_tokens, hidden)),
                             "get_next_low_latency_combine_buffer dtype/shape")
                send.copy_(y)
                poison = torch.full_like(y, float("nan"))
                check(buf.low_latency_combine(poison, idx, w, handle, zero_copy=True)[0], "zero_copy combined_x")
            with case(f"{c['name']}: return_recv_hook"):
                got = buf.low_latency_dispatch(x, idx, max_tokens, num_experts, use_fp8=False, return_recv_hook=True)
                recv_x, recv_count, handle, _, hook = got
                if not callable(hook):
                    raise AssertionError("return_recv_hook=True must return a callable hook")  # noqa: TRY004
                hook()  # the outputs returned before are filled in place
                rows = check_ll_layout(recv_count, handle, idxs, num_experts, max_tokens, hidden, rank, reference,
                                       "hooked low_latency_dispatch")
                assert_equal(expert_outputs(recv_x, rows, rank, num_local), y.cpu(), "hooked recv_x")
                out, _, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
                hook()
                check(out, "hooked combined_x")
    dist.barrier()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_low_latency_combine(world_size: int, backend: str) -> None:
    """Weighted combine (exact on grid data), NaN-poisoned invalid rows and unused-slot weights, out=, zero_copy,
    return_recv_hook."""
    run_distributed(_ll_combine_worker, world_size, backend=backend)


# -------------------------------------------------------------------------- halves, hooks and statistics
def _ll_halves_worker(rank: int, num_ranks: int, iterations: int) -> None:
    dev = device()
    reference = dev.type == "cpu"
    num_local, max_tokens, hidden, k = 2, 24, 256, 3
    num_experts = num_local * num_ranks
    buf = make_buffer(low_latency=True, max_tokens=max_tokens, hidden=hidden, num_experts=num_experts)
    cum = torch.zeros(num_local, dtype=torch.int32, device=dev)
    expected_cum = torch.zeros(num_local, dtype=torch.int32)
    dispatch_wait = torch.zeros(num_ranks, dtype=torch.int64, device=dev)
    combine_wait = torch.zeros(num_ranks, dtype=torch.int64, device=dev)

    def inputs(seed):
        tokens = [(seed * 7 + 5 * r) % (max_tokens + 1) for r in range(num_ranks)]
        xs, idxs, ws = [], [], []
        for r in range(num_ranks):
            g = oracle.generator(seed, r)
            idxs.append(oracle.make_topk_idx(g, tokens[r], num_experts, k, num_ranks, "random"))
            xs.append(oracle.make_x(g, tokens[r], hidden, "grid"))
            ws.append(oracle.make_weights(g, idxs[-1], grid=True))
        return xs, idxs, ws

    def dispatch(inp, **kw):
        xs, idxs, _ = inp
        return buf.low_latency_dispatch(xs[rank].to(dev), idxs[rank].to(dev), max_tokens, num_experts,
                                        cumulative_local_expert_recv_stats=cum,
                                        dispatch_wait_recv_cost_stats=dispatch_wait, use_fp8=False, **kw)

    def check_dispatch(got, inp, what):
        xs, idxs, _ = inp
        rows = check_ll_layout(got[1], got[2], idxs, num_experts, max_tokens, hidden, rank, reference, what)
        for local, owner in enumerate(rows):
            want = torch.stack([xs[s][t] for s, t in owner]) if owner else torch.empty(0, hidden, dtype=torch.bfloat16)
            assert_equal(got[0][local, :len(owner)], want, f"{what}: recv_x of local expert {local}")
        return rows

    for it in range(iterations):
        a_in, b_in = inputs(2 * it + 1), inputs(2 * it + 2)
        hooked = it % 2 == 1
        with case(f"iteration {it}: two live dispatches{' (hooks)' if hooked else ''}"):
            a = dispatch(a_in, return_recv_hook=hooked)
            b = dispatch(b_in, return_recv_hook=hooked)
            if hooked:  # double-batch overlap: send A, send B, then receive both
                a[4]()
                b[4]()
            rows_a = check_dispatch(a, a_in, "dispatch A (after B)")
            rows_b = check_dispatch(b, b_in, "dispatch B")
            for got in (a, b):
                expected_cum += got[1].cpu()
            assert_equal(cum.cpu(), expected_cum, "cumulative_local_expert_recv_stats")
        with case(f"iteration {it}: zero-copy combines in alternating halves"):
            send_a = buf.get_next_low_latency_combine_buffer(a[2])
            send_a.copy_(expert_outputs(a[0], rows_a, rank, num_local).to(dev))
            out_a = buf.low_latency_combine(torch.full_like(send_a, float("nan")), a_in[1][rank].to(dev),
                                            a_in[2][rank].to(dev), a[2], zero_copy=True,
                                            combine_wait_recv_cost_stats=combine_wait)[0]
            send_b = buf.get_next_low_latency_combine_buffer(b[2])
            if send_b.data_ptr() == send_a.data_ptr():
                raise AssertionError("consecutive low-latency calls must use different buffer halves")
            send_b.copy_(expert_outputs(b[0], rows_b, rank, num_local).to(dev))
            out_b = buf.low_latency_combine(torch.full_like(send_b, float("nan")), b_in[1][rank].to(dev),
                                            b_in[2][rank].to(dev), b[2], zero_copy=True,
                                            combine_wait_recv_cost_stats=combine_wait)[0]
            assert_equal(out_a, expected_combine(a_in[0][rank], a_in[1][rank], a_in[2][rank], "per_rank", num_local),
                         "combine A")
            assert_equal(out_b, expected_combine(b_in[0][rank], b_in[1][rank], b_in[2][rank], "per_rank", num_local),
                         "combine B")
            for name, stats in (("dispatch", dispatch_wait), ("combine", combine_wait)):
                if bool((stats < 0).any()):
                    raise AssertionError(f"{name}_wait_recv_cost_stats went negative: {stats}")

    with case("stale hook: its half was reused by two later calls"):
        s_in = inputs(999)
        stale = dispatch(s_in, return_recv_hook=True)
        later = dispatch(s_in)
        dispatch(s_in)
        with pytest.raises(RuntimeError):
            stale[4]()
        check_dispatch(later, s_in, "a dispatch made after the stale one")
    with case("after a stale hook, calls still work"):
        fresh = dispatch(s_in)
        check_dispatch(fresh, s_in, "dispatch after the stale hook")
    with case("clean_low_latency_buffer, then calls still work"):
        buf.clean_low_latency_buffer(max_tokens, hidden, num_experts)
        check_dispatch(dispatch(s_in), s_in, "dispatch after clean_low_latency_buffer")
    dist.barrier()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_low_latency_halves(world_size: int, backend: str) -> None:
    """Two live results, alternating halves over many iterations, hooks, zero_copy halves, cumulative stats."""
    run_distributed(_ll_halves_worker, world_size, 10 if world_size == 2 else 6, backend=backend)
