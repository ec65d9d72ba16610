"""Low-latency kernels (NVSHMEM) against the reference backend on real GPUs.

Each world holds a Buffer forced onto the compiled kernels and a reference Buffer on the same NCCL group.
Dispatch must deliver the same counts, layout and (source, token) rows as the reference (the kernels also
place them in the reference's order), with payloads equal to the senders'
rows (BF16) or to the CPU oracle's cast of them (FP8 bytes and scales); combine must be bit-identical (the
kernels add float32 products in the reference's order, per-rank or per-expert). Longer runs (1000 alternating
calls, CUDA graph replays) check combine(dispatch(x)) against the locally computed weighted sum.
Every case runs under the three kernel choices a Buffer can make (the runtime picks them per shape, there is no
switch): the default path (dedup dispatch, per-rank combine) with the per-rank reduction, the same Buffer with
the per-expert reduction (per-expert combine kernels), and a Buffer(allow_nvlink_for_low_latency_mode=False),
whose peers are reached through NVSHMEM puts (per-expert dispatch and combine kernels). The loops run under the
same three. A timeout test has one rank skip a call: the others get a RuntimeError naming rank, phase and peer.
"""
from __future__ import annotations

import json
import os
import random
import time

import oracle
import pytest
import torch
import torch.distributed as dist
from dist import GPU_WORLD_SIZES, assert_equal, case, device, make_buffer, run_distributed

from moe_dispatcher.reference.low_latency import weighted_sum_per_rank

pytestmark = pytest.mark.gpu
WORLD_SIZES = GPU_WORLD_SIZES
MAX_T, MAX_H, MAX_E = 128, 7168, 256
# (NVLink to peers, reduction): the default path, the per-expert combine order, the no-NVLink (NVSHMEM put) path.
CONFIGS = [(True, "per_rank"), (True, "per_expert"), (False, "per_rank")]

# T per rank cycles over the ranks; kind: random (20% of slots -1) or skewed (slot 0 = expert 5 everywhere).
CASES = [
    {"name": "bf16 H2048 E32 T=maxT/T=0", "H": 2048, "E": 32, "T": [128, 77, 0, 128], "K": 8, "mode": "plain"},
    {"name": "fp8 H4096 E256 hook", "H": 4096, "E": 256, "T": [100, 128, 3, 128], "K": 8, "fp8": True,
     "mode": "hook"},
    {"name": "fp8 ue8m0 H7168 E256 async", "H": 7168, "E": 256, "T": [128], "K": 8, "fp8": True, "round": True,
     "ue8m0": True, "mode": "async"},
    {"name": "fp8 round H7168 E32 skewed zero-copy out=", "H": 7168, "E": 32, "T": [128, 64, 128, 1], "K": 4,
     "fp8": True, "round": True, "kind": "skewed", "mode": "zero_copy"},
    {"name": "bf16 H2048 E256 T=0 everywhere", "H": 2048, "E": 256, "T": [0], "K": 8, "mode": "plain"},
    {"name": "bf16 H4096 E32 all tokens to one expert hook", "H": 4096, "E": 32, "T": [128, 5, 128, 33], "K": 1,
     "kind": "skewed", "mode": "hook"},
    {"name": "fp8 H7168 E256 T=1", "H": 7168, "E": 256, "T": [1, 0, 1, 1], "K": 8, "fp8": True, "mode": "plain"},
    {"name": "bf16 H2048 one expert per rank (no dedup)", "H": 2048, "E": 0, "T": [128, 90], "K": 2,
     "mode": "async"},
    {"name": "bf16 H128 E1024", "H": 128, "E": 1024, "T": [128, 31, 128, 0], "K": 8, "mode": "plain"},
]


def _routing(g: torch.Generator, t: int, e: int, k: int, kind: str) -> torch.Tensor:
    scores = torch.rand(t, e, generator=g)
    if kind == "skewed":
        scores[:, 5] = 2.0  # expert 5 is every token's first choice
    idx = scores.topk(k, dim=1).indices
    if kind == "random":
        idx[torch.rand(t, k, generator=g) < 0.2] = -1
    return idx


def _kernel_buffer(nvlink: bool = True):
    buf = make_buffer(low_latency=True, max_tokens=MAX_T, hidden=MAX_H, num_experts=MAX_E, backend="kernels",
                      explicitly_destroy=True, allow_nvlink_for_low_latency_mode=nvlink)
    if buf._kernels_ll is None:
        raise AssertionError(f"the low-latency kernels are not available: {buf._kernels_ll_why}")
    return buf


def _reference_buffer(nbytes: int):
    from moe_dispatcher import Buffer
    return Buffer(backend="reference", low_latency_mode=True, num_rdma_bytes=nbytes, explicitly_destroy=True)


def _sorted_rows(recv_count, handle, max_tokens: int):
    """Per local expert, the row order that sorts valid rows by (source rank, token); (order, key, valid)."""
    lr = handle.layout_range
    begin, count = lr >> 32, lr & 0xFFFFFFFF  # [L, R]
    rows = handle.src_info.shape[1]
    j = torch.arange(rows, device=lr.device)
    inside = (j[None, None] >= begin[:, :, None]) & (j[None, None] < (begin + count)[:, :, None])  # [L, R, rows]
    src = (inside * torch.arange(lr.shape[1], device=lr.device)[None, :, None]).sum(1)
    valid = inside.any(1)
    if not bool((valid == (j[None] < recv_count[:, None])).all()):
        raise AssertionError("layout_range does not tile the rows [0, recv_count) of every expert")
    key = torch.where(valid, src * max_tokens + handle.src_info.long(), (1 << 40) + j[None])
    key, order = key.sort(dim=1)
    return order, key, key < (1 << 40)


def _gather(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return torch.gather(t, 1, order[:, :, None].expand(-1, -1, t.shape[2]))


def _compare_dispatch(got, ref, xs_all, opts, max_tokens: int, what: str, casts=None):
    """Counts and (source, token) of the rows against the reference; payloads against the senders' x (BF16)
    or the CPU oracle's cast of it (FP8 bytes and scales), gathered from every rank."""
    (kx, kc, kh), (rc, rh) = got[:3], ref[1:3]
    assert_equal(kc, rc, f"{what}: recv_count")
    assert_equal(kh.layout_range & 0xFFFFFFFF, rh.layout_range & 0xFFFFFFFF, f"{what}: rows per (expert, source)")
    ko, kk, kv = _sorted_rows(kc, kh, max_tokens)
    _, rk, rv = _sorted_rows(rc, rh, max_tokens)
    assert_equal(torch.where(kv, kk, 0), torch.where(rv, rk, 0), f"{what}: (source, token) of the rows")
    # The kernels place rows exactly where the reference does (sources ascending, then tokens).
    assert_equal(kh.layout_range, rh.layout_range, f"{what}: layout_range")
    assert_equal(torch.where(kv, kh.src_info, 0), torch.where(rv, rh.src_info, 0), f"{what}: src_info")
    key = torch.where(kv, kk, 0)
    src, tok = key // max_tokens, key % max_tokens
    if opts["use_fp8"]:
        if casts is None:
            casts = _casts(xs_all, opts)
        want = [torch.stack([c[i] for c in casts]).to(kc.device) for i in (0, 1)]
        pairs = [(kx[0], want[0][src, tok], "FP8 bytes"), (kx[1], want[1][src, tok], "scales")]
    else:
        pairs = [(kx, torch.stack(xs_all).to(kc.device)[src, tok], "data")]
    as_int = {torch.float8_e4m3fn: torch.uint8, torch.bfloat16: torch.int16, torch.float32: torch.int32,
              torch.int32: torch.int32}
    for a, b, name in pairs:
        a = _gather(a.contiguous(), ko).view(as_int[a.dtype])
        diff = (a != b.view(as_int[b.dtype])) & kv[:, :, None]
        if bool(diff.any()):
            raise AssertionError(f"{what}: {name} differ in {int(diff.sum())} elements")


def _casts(xs_all: list, opts: dict) -> list:
    """The CPU oracle's FP8 cast of every rank's x."""
    return [oracle.per_token_cast_to_fp8(x, opts["round_scale"], opts["use_ue8m0"]) for x in xs_all]


def _all_x(x: torch.Tensor, max_tokens: int) -> list:
    """Every rank's x (CPU, padded with zeros to max_tokens rows), indexed by rank."""
    padded = torch.zeros(max_tokens, x.shape[1], dtype=x.dtype, device=x.device)
    padded[:x.shape[0]] = x
    out = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.all_gather(out, padded)
    return [o.cpu() for o in out]


def _expert_outputs(recv_x, recv_count, num_ranks: int, rank: int) -> torch.Tensor:
    """bf16(row * factor of the global expert); rows past recv_count are NaN (they must never be read)."""
    data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    local = data.shape[0]
    factor = torch.tensor([0.5, 1.0, 1.5, 2.0], device=data.device)[(rank * local + torch.arange(local,
                                                                     device=data.device)) % 4]
    y = (data.float() * factor[:, None, None]).to(torch.bfloat16)
    rows = torch.arange(data.shape[1], device=data.device)
    return torch.where((rows[None] < recv_count[:, None])[:, :, None], y, torch.full_like(y, float("nan")))


def _local_combine(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, num_experts: int, num_ranks: int,
                   reduction: str = "per_rank") -> torch.Tensor:
    """What combine(dispatch(x)) returns when experts are the identity: per_expert: bf16(sum_k w_k * x), k
    ascending; per_rank: the reference's per-rank order."""
    if reduction == "per_rank":
        vals = x.float().unsqueeze(1).expand(-1, idx.shape[1], -1)
        return weighted_sum_per_rank(vals, idx, w, num_experts // num_ranks, num_ranks)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for k in range(idx.shape[1]):
        term = w[:, k:k + 1] * xf
        acc = acc + torch.where(idx[:, k:k + 1] >= 0, term, torch.zeros_like(term))
    return acc.to(torch.bfloat16)


def _call(buf, mode: str, fn, **kw):
    """Run a low-latency call in `mode` and return its outputs once they are valid on the current stream."""
    if mode == "hook":
        out = fn(**kw, return_recv_hook=True)
        out[-1]()
        return out
    if mode == "async":
        out = fn(**kw, async_finish=True)
        out[-2].current_stream_wait()
        return out
    return fn(**kw)


def _use(buffers, reduction: str, num_experts: int) -> str:
    """Put every Buffer on `reduction`; the label names the kernels the first (compiled) one runs."""
    for buf in buffers:
        buf.low_latency_combine_reduction = reduction
    ll = buffers[0]._kernels_ll
    nvlink = "nvlink" if ll.nvlink_peers == ll.num_ranks else "no nvlink"
    return f"[{nvlink}, {reduction}, {ll.kernels_for(MAX_T, 2048, num_experts)} at E={num_experts}]"


def _cases_worker(rank: int, num_ranks: int, nvlink: bool) -> None:
    dev = device()
    inputs = {}  # case index -> (every rank's x, their FP8 casts): the same under every configuration
    kb = _kernel_buffer(nvlink)
    rb = _reference_buffer(kb.num_rdma_bytes)
    with case("the kernels the runtime picks"):
        ll = kb._kernels_ll
        want = {True: ("dedup+rank_combine", "per_expert"), False: ("per_expert", "per_expert")}[nvlink]
        got = (ll.kernels_for(MAX_T, 2048, 32), ll.kernels_for(MAX_T, 2048, num_ranks))  # L >= 2, L = 1
        assert got == want, (nvlink, got)
        assert (ll.nvlink_peers == num_ranks) == nvlink, ll.nvlink_peers
    for reduction in [red for nv, red in CONFIGS if nv == nvlink]:
        label = _use((kb, rb), reduction, MAX_E)
        for ci, c in enumerate(CASES):
            _one_case(kb, rb, rank, num_ranks, ci, c, label, inputs)
    with case(f"{_use((kb, rb), 'per_rank', 32)} garbage in the NVSHMEM buffer, clean_low_latency_buffer, "
              "then calls work"):
        h, e = 2048, 32
        kb.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True).fill_(0x5A)
        kb.clean_low_latency_buffer(MAX_T, h, e)
        x = torch.randn(MAX_T, h, device=dev).to(torch.bfloat16)
        idx = torch.rand(MAX_T, e, device=dev).topk(8, dim=1).indices
        w = torch.rand(MAX_T, 8, device=dev)
        recv, _, handle, _, _ = kb.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False)
        assert_equal(kb.low_latency_combine(recv, idx, w, handle)[0], _local_combine(x, idx, w, e, num_ranks),
                     "combine after clean", bitwise=True)
    with case(f"{_use((kb, rb), 'per_rank', 32)} more tokens than blocks (maxT=512: several tokens per block)"):
        t, h, e = 512, 2048, 32
        x = torch.randn(t, h, device=dev).to(torch.bfloat16)
        idx = torch.rand(t, e, device=dev).topk(8, dim=1).indices
        w = torch.rand(t, 8, device=dev)
        for reduction in ("per_rank", "per_expert"):
            kb.low_latency_combine_reduction = reduction
            recv, _, handle, _, _ = kb.low_latency_dispatch(x, idx, t, e, use_fp8=False)
            assert_equal(kb.low_latency_combine(recv, idx, w, handle)[0],
                         _local_combine(x, idx, w, e, num_ranks, reduction), f"maxT=512 {reduction}", bitwise=True)
        kb.low_latency_combine_reduction = "per_rank"
    with case("bad shapes: a clear error before launch (first call and cached key alike)"):
        x = torch.zeros(1, 2048, dtype=torch.bfloat16, device=dev)
        idx = torch.zeros(1, 8, dtype=torch.int64, device=dev)
        for bad in (lambda: kb.low_latency_dispatch(torch.zeros(1, 32768, dtype=torch.bfloat16, device=dev),
                                                    idx, 1, 32),
                    lambda: kb.low_latency_dispatch(x, torch.zeros(1, 64, dtype=torch.int64, device=dev), 1, 32),
                    lambda: kb.low_latency_dispatch(x.float(), idx, 1, 32)):
            with pytest.raises((ValueError, TypeError)):
                bad()
    dist.barrier()
    kb.destroy()
    rb.destroy()


def _one_case(kb, rb, rank: int, num_ranks: int, ci: int, c: dict, label: str, inputs: dict) -> None:
    dev = device()
    g = torch.Generator().manual_seed(1000 * ci + rank)
    t, h, e, k = c["T"][rank % len(c["T"])], c["H"], c["E"] or num_ranks, c["K"]
    fp8, mode = c.get("fp8", False), c["mode"]
    x = (torch.randn(t, h, generator=g) * torch.rand(t, 1, generator=g) * 10).to(torch.bfloat16).to(dev)
    idx = _routing(g, t, e, k, c.get("kind", "random")).to(dev)
    w = torch.rand(t, k, generator=g).to(dev)
    local = e // num_ranks
    cum = torch.zeros(local, dtype=torch.int32, device=dev)
    wait = torch.zeros(num_ranks, dtype=torch.int64, device=dev)
    opts = {"use_fp8": fp8, "round_scale": c.get("round", False), "use_ue8m0": c.get("ue8m0", False)}
    with case(f"{label} {c['name']}: dispatch ({mode})"):
        got = _call(kb, mode, kb.low_latency_dispatch, x=x, topk_idx=idx, num_max_dispatch_tokens_per_rank=MAX_T,
                    num_experts=e, cumulative_local_expert_recv_stats=cum, dispatch_wait_recv_cost_stats=wait,
                    **opts)
        ref = rb.low_latency_dispatch(x, idx, MAX_T, e, **opts)
        if ci not in inputs:  # collective (all_gather): every rank takes this branch at the same case
            xs_all = _all_x(x, MAX_T)
            inputs[ci] = (xs_all, _casts(xs_all, opts) if fp8 else None)
        _compare_dispatch(got, ref, inputs[ci][0], opts, MAX_T, c["name"], inputs[ci][1])
        assert_equal(cum, ref[1], "cumulative_local_expert_recv_stats")
        if bool((wait < 0).any()):
            raise AssertionError(f"dispatch_wait_recv_cost_stats negative: {wait}")
    with case(f"{label} {c['name']}: combine ({mode})"):
        yk = _expert_outputs(got[0], got[1], num_ranks, rank)
        want = rb.low_latency_combine(yk, idx, w, ref[2])[0]  # same layout: the same rows
        cwait = torch.zeros(num_ranks, dtype=torch.int64, device=dev)
        kw = {"x": yk, "topk_idx": idx, "topk_weights": w, "handle": got[2],
              "combine_wait_recv_cost_stats": cwait}
        if mode == "zero_copy":
            kb.get_next_low_latency_combine_buffer(got[2]).copy_(yk)
            out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device=dev)
            kw.update(x=torch.full_like(yk, float("nan")), zero_copy=True, out=out)
        res = _call(kb, mode, kb.low_latency_combine, **kw)[0]
        if mode == "zero_copy" and res.data_ptr() != out.data_ptr() and t:
            raise AssertionError("combine(out=) must return out")
        assert_equal(res, want, f"{c['name']}: combined_x", bitwise=True)
        if bool((cwait < 0).any()):
            raise AssertionError(f"combine_wait_recv_cost_stats negative: {cwait}")



def _loop_worker(rank: int, num_ranks: int, iterations: int, replays: int, nvlink: bool) -> None:
    kb = _kernel_buffer(nvlink)
    for reduction in [red for nv, red in CONFIGS if nv == nvlink]:
        _loops(kb, rank, num_ranks, iterations, replays, reduction)
    kb.destroy()


def _loops(kb, rank: int, num_ranks: int, iterations: int, replays: int, reduction: str) -> None:
    dev = device()
    h, e, k = 2048, 32, 8
    rng = random.Random(rank)
    bad = torch.zeros((), dtype=torch.int64, device=dev)

    def fresh(t):
        x = torch.randn(t, h, device=dev).to(torch.bfloat16)
        idx = torch.rand(t, e, device=dev).topk(k, dim=1).indices
        idx = torch.where(torch.rand(t, k, device=dev) < 0.2, torch.full_like(idx, -1), idx)
        return x, idx, torch.rand(t, k, device=dev)

    for label in [_use((kb,), reduction, e)]:

        def want(x, idx, w):
            return _local_combine(x, idx, w, e, num_ranks, reduction)

        with case(f"{label} {iterations} alternating dispatch/combine calls, fresh data, checked at the end"):
            for it in range(iterations):
                x, idx, w = fresh(rng.randint(0, MAX_T))
                mode = ("plain", "hook", "async", "zero_copy")[it % 4]
                recv, _, handle, _, _ = _call(kb, "hook" if mode == "hook" else "plain", kb.low_latency_dispatch,
                                              x=x, topk_idx=idx, num_max_dispatch_tokens_per_rank=MAX_T,
                                              num_experts=e, use_fp8=False)
                if mode == "zero_copy":
                    kb.get_next_low_latency_combine_buffer(handle).copy_(recv)
                    out = kb.low_latency_combine(recv, idx, w, handle, zero_copy=True)[0]
                else:
                    out = _call(kb, mode, kb.low_latency_combine, x=recv, topk_idx=idx, topk_weights=w,
                                handle=handle)[0]
                bad += (out.view(torch.int16) != want(x, idx, w).view(torch.int16)).sum()
            if int(bad):
                raise AssertionError(f"{int(bad)} combined elements differ over {iterations} iterations")

        with case(f"{label} CUDA graph of dispatch + combine, {replays} replays with fresh inputs"):
            xs, idxs, ws = fresh(MAX_T)
            recv, _, handle, _, _ = kb.low_latency_dispatch(xs, idxs, MAX_T, e, use_fp8=False)  # warm-up
            kb.low_latency_combine(recv, idxs, ws, handle)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                recv, _, handle, _, _ = kb.low_latency_dispatch(xs, idxs, MAX_T, e, use_fp8=False)
                out_s = kb.low_latency_combine(recv, idxs, ws, handle)[0]
            dist.barrier()
            for _ in range(replays):
                x, idx, w = fresh(MAX_T)
                xs.copy_(x)
                idxs.copy_(idx)
                ws.copy_(w)
                graph.replay()
                bad += (out_s.view(torch.int16) != want(x, idx, w).view(torch.int16)).sum()
            if int(bad):
                raise AssertionError(f"{int(bad)} combined elements differ over {replays} graph replays")
        with case(f"{label} calls after the graph"):
            x, idx, w = fresh(MAX_T)
            recv, _, handle, _, _ = kb.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False)
            assert_equal(kb.low_latency_combine(recv, idx, w, handle)[0], want(x, idx, w), "after graph",
                         bitwise=True)
        dist.barrier()
        del graph


def _switch_worker(rank: int, num_ranks: int) -> str:
    dev = device()
    h, e, k = 2048, 32, 4
    buf = make_buffer(hidden_bytes=h * 2, low_latency=True, max_tokens=MAX_T, hidden=h, num_experts=e,
                      explicitly_destroy=True)
    if buf._kernels is None or buf._kernels_ll is None:
        why = buf._kernels_why if buf._kernels is None else buf._kernels_ll_why
        dist.barrier()
        buf.destroy()
        return f"skipped: {why}"
    x = torch.randn(MAX_T, h, device=dev).to(torch.bfloat16)
    idx = torch.rand(MAX_T, e, device=dev).topk(k, dim=1).indices
    w = torch.rand(MAX_T, k, device=dev)
    for rnd in range(2):
        with case(f"round {rnd}: normal dispatch + combine"):
            layout = buf.get_dispatch_layout(idx, e)
            recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                    num_tokens_per_expert=layout[2])
            combined = buf.combine(recv, handle)[0]
            want = (x.float() * layout[3].sum(1, keepdim=True)).to(torch.bfloat16)
            assert_equal(combined, want, "normal combine (sum of identical copies)")
        with case(f"round {rnd}: clean_low_latency_buffer, then low-latency calls"):
            buf.clean_low_latency_buffer(MAX_T, h, e)
            recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False)
            assert_equal(buf.low_latency_combine(recv, idx, w, handle)[0], _local_combine(x, idx, w, e, num_ranks),
                         "low-latency combine after normal use", bitwise=True)
    dist.barrier()
    buf.destroy()
    return "ok"


TIMEOUT_S = 2


def _timeout_worker(rank: int, num_ranks: int) -> None:
    dev = device()
    kb = _kernel_buffer()
    h, e, k = 2048, 32, 4
    x = torch.randn(MAX_T, h, device=dev).to(torch.bfloat16)
    idx = torch.rand(MAX_T, e, device=dev).topk(k, dim=1).indices
    w = torch.rand(MAX_T, k, device=dev)
    with case("a pair every rank makes"):
        recv, _, handle, _, _ = kb.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False)
        kb.low_latency_combine(recv, idx, w, handle)
        torch.cuda.synchronize()
    dist.barrier()
    with case("rank 1 skips a dispatch: the others' next call raises naming rank, phase and peer"):
        if rank != 1:
            start = time.monotonic()
            hook = kb.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False, return_recv_hook=True)[4]
            hook()  # the receive kernel waits for rank 1, records the timeout and exits (no trap)
            torch.cuda.synchronize()
            with pytest.raises(RuntimeError) as err:
                kb.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False)
            elapsed = time.monotonic() - start
            msg = str(err.value)
            assert f"rank {rank} timed out" in msg and "low_latency_dispatch (receive counts)" in msg, msg
            assert "waiting for rank 1" in msg, msg
            assert elapsed < TIMEOUT_S + 10, f"the error took {elapsed:.1f} s (timeout {TIMEOUT_S} s)"
            for call in (hook, lambda: kb.low_latency_combine(recv, idx, w, handle)):  # unusable from now on
                with pytest.raises(RuntimeError, match="timed out"):
                    call()
            torch.ones(1, device=dev).sum().item()  # the CUDA context survived
        torch.cuda.synchronize()
    dist.barrier()
    kb.destroy()


LATE_S = 0.5


def _hooked_send_worker(rank: int, num_ranks: int) -> None:
    """Rank 1 enters its combine LATE_S late. The others' hooked combine send must finish on their GPU without
    it (a send never waits on peers); their hook() then receives rank 1's rows once it sends, and the result
    equals an unhooked combine's, bit for bit."""
    dev = device()
    kb = _kernel_buffer()
    h, e, k = 2048, 32, 4  # L >= 2: the default order's kernels are the per-rank ones
    assert kb._kernels_ll.kernels_for(MAX_T, h, e) == "dedup+rank_combine"
    gen = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(MAX_T, h, device=dev, generator=gen).to(torch.bfloat16)
    idx = torch.rand(MAX_T, e, device=dev, generator=gen).topk(k, dim=1).indices
    w = torch.rand(MAX_T, k, device=dev, generator=gen)
    recv, _, handle, _, _ = kb.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False)
    want = kb.low_latency_combine(recv, idx, w, handle)[0].clone()
    recv, _, handle, _, _ = kb.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False)
    torch.cuda.synchronize()
    dist.barrier()
    with case("a hooked combine send does not wait for a late peer"):
        if rank == 1:
            time.sleep(LATE_S)
        start = time.monotonic()
        out, _, hook = kb.low_latency_combine(recv, idx, w, handle, return_recv_hook=True)
        torch.cuda.synchronize()  # the send phase alone
        sent = time.monotonic() - start
        if rank != 1:
            assert sent < LATE_S / 2, f"rank {rank}: the hooked send took {sent:.3f} s, waiting for rank 1"
        hook()
        torch.cuda.synchronize()
        assert_equal(out, want, "hooked combine vs unhooked", bitwise=True)
    dist.barrier()
    kb.destroy()


def _bench_worker(rank: int, num_ranks: int, num_experts: int, iterations: int) -> dict:
    dev = device()
    kb = _kernel_buffer()
    t, h, k = 128, 7168, 8
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)
    scores = torch.randn(t, num_experts, device=dev).abs() + 1
    idx = scores.topk(k, dim=1).indices
    w = torch.rand(t, k, device=dev)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iterations)]
    y = torch.randn(num_experts // num_ranks, num_ranks * t, h,
                    device=dev).to(torch.bfloat16)
    for _ in range(20):
        handle = kb.low_latency_dispatch(x, idx, t, num_experts, use_fp8=True)[2]
        kb.low_latency_combine(y, idx, w, handle)
    torch.cuda.synchronize()
    dist.barrier()
    for ev in events:
        ev[0].record()
        handle = kb.low_latency_dispatch(x, idx, t, num_experts, use_fp8=True)[2]
        ev[1].record()
        kb.low_latency_combine(y, idx, w, handle)
        ev[2].record()
    torch.cuda.synchronize()
    # Host time of an eager pair: the CPU's enqueue time only (400 launches stay under the launch queue's
    # depth, so the host never waits for the GPU here).
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        handle = kb.low_latency_dispatch(x, idx, t, num_experts, use_fp8=True)[2]
        kb.low_latency_combine(y, idx, w, handle)
    host_us = (time.perf_counter() - start) / iterations * 1e6
    torch.cuda.synchronize()
    d = sorted(a.elapsed_time(b) * 1e3 for a, b, _ in events)
    c = sorted(b.elapsed_time(cc) * 1e3 for _, b, cc in events)
    both = sorted(a.elapsed_time(cc) * 1e3 for a, _, cc in events)
    valid = int((idx >= 0).sum())
    result = {"ranks": num_ranks, "experts": num_experts, "dispatch_us_median": d[len(d) // 2],
              "combine_us_median": c[len(c) // 2], "both_us_median": both[len(both) // 2],
              "dispatch_us_mean": sum(d) / len(d), "combine_us_mean": sum(c) / len(c), "host_us_per_pair": host_us,
              "dispatch_bytes": valid * (h + h // 128 * 4 + 16), "combine_bytes": valid * 2 * h}
    dist.barrier()
    kb.destroy()
    return result


@pytest.mark.parametrize("nvlink", [True, False], ids=["nvlink", "no_nvlink"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_low_latency_cases(world_size: int, nvlink: bool) -> None:
    """BF16/FP8 (round_scale, ue8m0) dispatch and weighted combine vs the reference: -1 slots, T=0, T=maxT,
    skewed routing, hidden 2048/4096/7168, E=32/256/one per rank, hook, async_finish, zero_copy, out=, stats,
    clean; under the default kernels, the per-expert reduction order and the no-NVLink path."""
    run_distributed(_cases_worker, world_size, nvlink, backend="nccl", timeout=600)


@pytest.mark.parametrize("nvlink", [True, False], ids=["nvlink", "no_nvlink"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_low_latency_loop_and_graph(world_size: int, nvlink: bool) -> None:
    """Per configuration (CONFIGS): 1000 alternating calls (plain/hook/async/zero-copy) and 100 CUDA-graph
    replays with fresh inputs."""
    run_distributed(_loop_worker, world_size, 1000, 100, nvlink, backend="nccl", timeout=600)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_low_latency_timeout_names_rank_and_phase(world_size: int) -> None:
    """One rank skips a low-latency call: every other rank's next call raises a RuntimeError naming the waiting
    rank, the phase and the missing peer, within the timeout (no __trap: the CUDA context survives)."""
    run_distributed(_timeout_worker, world_size, backend="nccl", env={"MOE_DISPATCHER_TIMEOUT_S": str(TIMEOUT_S)})


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_low_latency_hooked_send_does_not_wait(world_size: int) -> None:
    """A hooked combine's send phase finishes while a peer has not entered its combine (DeepEP's hook
    semantics), and the hooked result equals the unhooked one bitwise."""
    run_distributed(_hooked_send_worker, world_size, backend="nccl")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_low_latency_normal_switch(world_size: int) -> None:
    """One Buffer used for normal (intranode) and low-latency calls, with clean_low_latency_buffer between."""
    results = run_distributed(_switch_worker, world_size, backend="nccl")
    if results[0].startswith("skipped"):
        pytest.skip(results[0])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("num_experts", [256, 32])
def test_low_latency_timing(world_size: int, num_experts: int) -> None:
    """Timing of the standard low-latency shape (128 tokens, H=7168, top-8, FP8 dispatch), and the host time of
    an eager pair (host_us_per_pair); reports, never fails on speed. MOE_LL_BENCH_OUT=path appends the figures
    as JSON lines."""
    result = run_distributed(_bench_worker, world_size, num_experts, 200, backend="nccl")[0]
    print(f"\nlow-latency {world_size} GPUs E={num_experts}: " + json.dumps(result))
    path = os.environ.get("MOE_LL_BENCH_OUT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(result) + "\n")
