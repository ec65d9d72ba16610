"""Intranode (NVLink) kernels against the reference backend on real GPUs.

Each world holds two Buffers on the same NCCL group: one forced onto the compiled kernels
(backend="kernels"), one on the reference backend. Dispatch outputs must be bit-identical (data, order,
top-k, counts, prefix matrix, source indices); combine must agree within bf16 rounding (it is designed to be
bit-exact: same float32 summation order), and the tests report how many combine outputs were bit-exact.
"""
from __future__ import annotations

from typing import Dict

import pytest
import torch
import torch.distributed as dist
from dist import GPU_WORLD_SIZES, assert_close, assert_equal, case, make_buffer, run_distributed
from normal_cases import (CASES, check_back_to_back, check_case, check_dispatch_timeout, check_graph_replay,
                          check_worst_overflow, one_hop_tol, timeout_inputs)
from normal_cases import dispatch as _dispatch
from normal_cases import routing as _routing

pytestmark = pytest.mark.gpu
WORLD_SIZES = GPU_WORLD_SIZES
MAX_HIDDEN_BYTES = 7168 * 2


def _buffers(**kwargs):
    from moe_dispatcher import Buffer
    kernels = make_buffer(hidden_bytes=MAX_HIDDEN_BYTES, backend="kernels", explicitly_destroy=True, **kwargs)
    reference = Buffer(backend="reference", explicitly_destroy=True)
    return kernels, reference


def _world_matches_reference(rank: int, world_size: int) -> Dict:
    kb, rb = _buffers()
    stats = {"combine_total": 0, "combine_bit_exact": 0}
    for i, c in enumerate(CASES):
        with case(c["name"]):
            check_case(kb, rb, c, i, stats, torch.device("cuda", torch.cuda.current_device()),
                       combine_tol=one_hop_tol, cached_returns_none=True)
    # Config honoured: fewer channels and smaller rings (the senders wait for free slots), through the backend
    # directly (same stream rules).
    from moe_dispatcher import Config
    backend = kb._kernels
    for cfg in (Config(8, 4, 64), Config(4, 1, 33)):
        for attempt in ("first", "repeated"):  # the repeated cached calls run from the handle's plans
            with case(f"config {cfg} ({attempt})"):
                dev = torch.device("cuda", torch.cuda.current_device())
                g = torch.Generator().manual_seed(77 + rank)
                t, h, e = 333, 2048, 8 * world_size
                idx = _routing(g, t, e, 4, world_size, "random").to(dev)
                x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
                w = torch.rand(t, 4, generator=g).to(dev)
                layout = backend.get_dispatch_layout(idx, e)
                got = backend.dispatch(x, None, idx, w, layout[0], layout[3], layout[2], 1, 0, config=cfg)
                _, want = _dispatch(rb, x, idx, w, e)
                n = int(want[4].rank_prefix_matrix[-1, rank])
                assert_equal(got[0][:n], want[0][:n], f"recv_x with {cfg}")
                assert_equal(got[2], want[1], f"recv_topk_idx with {cfg}")
                assert_equal(got[3], want[2], f"recv_topk_weights with {cfg}")
                assert_equal(got[5].recv_src_idx, want[4].recv_src_idx, f"recv_src_idx with {cfg}")
                cached = backend.cached_dispatch(x, None, got[5], config=cfg)[0]
                assert_equal(cached[:n], want[0][:n], f"cached recv_x with {cfg}")
                yk, wk = backend.combine(got[0], got[5], got[3], (), config=cfg)
                yr, wr, _ = rb.combine(want[0], want[4], topk_weights=want[2])
                assert_close(yk, yr, f"combine with {cfg}", rtol=1e-2, atol=1e-2)
                assert_close(wk, wr, f"combined weights with {cfg}", rtol=1e-5, atol=1e-5)
    torch.cuda.synchronize()
    kb.destroy()
    rb.destroy()
    return stats


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_matches_reference(world_size: int) -> None:
    stats = run_distributed(_world_matches_reference, world_size, backend="nccl")
    exact = sum(s["combine_bit_exact"] for s in stats)
    total = sum(s["combine_total"] for s in stats)
    print(f"\n[intranode R={world_size}] combine bit-exact vs reference: {exact}/{total} (rank, case) pairs")


def _world_graph_and_back_to_back(rank: int, world_size: int) -> None:
    kb, rb = _buffers()
    dev = torch.device("cuda", torch.cuda.current_device())
    t, h, local, k = 384, 2048, 8, 6
    e = local * world_size
    worst = t * world_size

    # ---- CUDA graph: layout + dispatch(num_worst_tokens) + combine captured once, replayed on new data.
    with case("cuda graph capture + replay"):
        check_graph_replay(kb, rb, rank, world_size, dev, t, h, e, k, worst, combine_tol=one_hop_tol,
                           check_src_idx=True)

    # ---- 1000 back-to-back dispatch + combine (fresh and cached alternating) with fresh data; each round trip
    # is checked on the device (x holds small integers, so x * ranks is exact), the last one against the
    # reference.
    with case("1000 back-to-back dispatch+combine"):
        check_back_to_back(kb, rb, rank, dev, t, h, e, k, rounds=1000)

    # More rows than num_worst_tokens: no host sync at that call, so the extra rows are dropped and every
    # rank raises at its next synchronised dispatch; the group keeps working afterwards.
    with case("num_worst_tokens overflow"):
        check_worst_overflow(kb, dev, t, h, e, combine_dropped=True)
    torch.cuda.synchronize()
    kb.destroy()
    rb.destroy()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_graph_and_back_to_back(world_size: int) -> None:
    run_distributed(_world_graph_and_back_to_back, world_size, backend="nccl")


def _world_fast_path(rank: int, world_size: int) -> None:
    """Repeated cached calls (the fast path: the handle's plan launched with its stream joins in one native call)
    give the bits of the full path and of the reference, with every stream option, in a CUDA graph, and with
    their inputs dropped before an async_finish event fires."""
    kb, rb = _buffers()
    dev = torch.device("cuda", torch.cuda.current_device())
    t, h, local, k = (300, 77, 0, 129)[rank % 4], 2048, 4, 6
    e = local * world_size
    g = torch.Generator().manual_seed(31 + rank)
    idx = _routing(g, t, e, k, world_size, "random").to(dev)
    w = torch.rand(t, k, generator=g).to(dev)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    _, ok = _dispatch(kb, x, idx, w, e)
    _, ro = _dispatch(rb, x, idx, w, e)
    hk, hr, rows = ok[4], ro[4], ok[0].shape[0]
    n = int(hr.rank_prefix_matrix[-1, rank])

    def fresh_x():
        return torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)

    def fresh_y():
        return torch.randn(rows, h, generator=g).to(torch.bfloat16).to(dev)

    def check_dispatch(got, xin, what):
        want = rb.dispatch(xin, handle=hr)[0]
        if isinstance(got, tuple):
            assert_equal(got[0][:n], want[0][:n], what)
            assert_equal(got[1][:n], want[1][:n], what + " (scales)")
        else:
            assert_equal(got[:n], want[:n], what)

    def check_combine(got, y, weights, what):
        want = rb.combine(y, hr, topk_weights=weights)
        assert_close(got[0], want[0], what, rtol=1e-2, atol=1e-2)
        if weights is not None:
            assert_close(got[1], want[1], what + " (weights)", rtol=1e-5, atol=1e-5)

    with case("fast path = full path = reference"):
        for i in range(4):  # the first call of each kind makes the plan, the later ones launch it
            x2, y = fresh_x(), fresh_y()
            fast = kb.dispatch(x2, handle=hk)[0]
            full = kb.dispatch(x2, handle=hk, previous_event=kb.capture())[0]  # previous_event: the full path
            assert torch.equal(fast, full), f"call {i}: cached dispatch, fast path != full path"
            check_dispatch(fast, x2, f"call {i}: cached dispatch")
            for weights in (None, ok[2]):
                fast = kb.combine(y, hk, topk_weights=weights)
                full = kb.combine(y, hk, topk_weights=weights, previous_event=kb.capture())
                assert torch.equal(fast[0], full[0]), f"call {i}: combine, fast path != full path"
                if weights is not None:
                    assert torch.equal(fast[1], full[1]), f"call {i}: combine weights, fast path != full path"
                check_combine(fast, y, weights, f"call {i}: combine (weights: {weights is not None})")
        plans = hk.backend_state
        assert all(p is not None for p in plans.dispatch_plans[:1] + plans.combine_plans), "plans were made"

    with case("fp8 fast path"):
        for i in range(3):
            x8 = ((torch.randn(t, h, generator=g) * 50).to(torch.float8_e4m3fn).to(dev),
                  torch.rand(t, h // 128, generator=g).to(dev))
            check_dispatch(kb.dispatch(x8, handle=hk)[0], x8, f"call {i}: fp8 cached dispatch")

    with case("async_finish, inputs dropped before the event"):
        for i in range(3):
            x2, y = fresh_x(), fresh_y()
            x_keep, y_keep = x2.clone(), y.clone()
            recv, *_, ev_d = kb.dispatch(x2, handle=hk, async_finish=True)
            comb, _, ev_c = kb.combine(y, hk, async_finish=True)
            del x2, y
            junk = [torch.full((t, h), 7.0, dtype=torch.bfloat16, device=dev),
                    torch.full((rows, h), 7.0, dtype=torch.bfloat16, device=dev)]  # may reuse freed blocks
            ev_d.current_stream_wait()
            ev_c.current_stream_wait()
            del junk
            check_dispatch(recv, x_keep, f"call {i}: async cached dispatch")
            check_combine((comb, None), y_keep, None, f"call {i}: async combine")

    with case("previous_event, allocate_on_comm_stream, another current stream"):
        x2, y = fresh_x(), fresh_y()
        got = kb.dispatch(x2, handle=hk, previous_event=kb.capture(), async_finish=True,
                          allocate_on_comm_stream=True)
        got[5].current_stream_wait()
        check_dispatch(got[0], x2, "cached dispatch with previous_event")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            recv = kb.dispatch(x2, handle=hk)[0]
            comb = kb.combine(y, hk)
        torch.cuda.current_stream().wait_stream(side)
        check_dispatch(recv, x2, "cached dispatch on a side stream")
        check_combine(comb, y, None, "combine on a side stream")
        # The fast path's native event (async_finish) as another call's previous_event, and its host methods.
        _, *_, ev = kb.dispatch(x2, handle=hk, async_finish=True)
        got = kb.dispatch(x2, handle=hk, previous_event=ev)
        check_dispatch(got[0], x2, "cached dispatch after a native event")
        ev.event.synchronize()
        assert ev.event.query(), "a synchronised event has fired"

    with case("back-to-back calls from three streams, no joins between them"):
        # Synchronous calls launch on the caller's stream, async ones on the comm stream, full-path ones on the
        # comm stream: the Buffer's launch order (stream_join.h) alone keeps two of its kernels from running at
        # once. The calls are queued without any join of the test's own (inputs are made first, every stream
        # waits for them once, results are checked after the end), so a missing order would mix rings.
        streams = [torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()]
        pick = torch.Generator().manual_seed(11)  # the same call sequence on every rank
        plan = [(int(torch.randint(3, (1,), generator=pick)), int(torch.randint(4, (1,), generator=pick)))
                for _ in range(48)]
        inputs = [(fresh_x(), fresh_y()) for _ in plan]
        for s in streams[1:]:
            s.wait_stream(torch.cuda.current_stream())
        results, events = [], []
        for (si, kind), (x2, y) in zip(plan, inputs):
            with torch.cuda.stream(streams[si]):
                if kind == 0:
                    results.append(kb.dispatch(x2, handle=hk)[0])
                elif kind == 1:
                    recv, *_, ev = kb.dispatch(x2, handle=hk, async_finish=True)
                    results.append(recv)
                    events.append(ev)
                elif kind == 2:
                    results.append(kb.combine(y, hk)[0])
                else:
                    results.append(kb.dispatch(x2, handle=hk, previous_event=kb.capture())[0])
        for ev in events:
            ev.current_stream_wait()
        for s in streams[1:]:
            torch.cuda.current_stream().wait_stream(s)
        for i, ((si, kind), (x2, y), got) in enumerate(zip(plan, inputs, results)):
            if kind == 2:
                check_combine((got, None), y, None, f"call {i} (stream {si}): combine")
            else:
                check_dispatch(got, x2, f"call {i} (stream {si}, kind {kind}): cached dispatch")

    with case("repeated cached calls in a CUDA graph"):
        x_in, y_in = fresh_x(), fresh_y()
        kb.dispatch(x_in, handle=hk)
        kb.combine(y_in, hk)  # eager: the plans exist, so the captured calls take the fast path
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recv = kb.dispatch(x_in, handle=hk)[0]
            comb = kb.combine(y_in, hk)
        for i in range(3):
            x_in.copy_(fresh_x())
            y_in.copy_(fresh_y())
            graph.replay()
            torch.cuda.synchronize()
            check_dispatch(recv, x_in, f"replay {i}: cached dispatch")
            check_combine(comb, y_in, None, f"replay {i}: combine")
        del graph
    torch.cuda.synchronize()
    kb.destroy()
    rb.destroy()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fast_path_of_repeated_cached_calls(world_size: int) -> None:
    run_distributed(_world_fast_path, world_size, backend="nccl")


def _world_timeout(rank: int, world_size: int) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    t, h, e, idx, x = timeout_inputs(rank, world_size, dev)

    with case("rank 1 skips a dispatch"):
        check_dispatch_timeout(rank, idx, x, e, phase="notify", waiting="waiting for rank 1", stays_unusable=True)

    # A ring of 36 slots, so the senders to rank 1 wait for slots as well.
    from moe_dispatcher import Config
    with case("rank 1 skips a combine"):
        kb = make_buffer(hidden_bytes=h * 2, backend="kernels", explicitly_destroy=True)
        _, out = _dispatch(kb, x, idx, None, e)
        if rank != 1:
            cfg = Config(20, 4, 36)
            kb.combine(out[0], out[4], config=cfg)
            torch.cuda.synchronize()  # the kernel gives up after the timeout and exits
            with pytest.raises(RuntimeError) as err:
                kb.get_dispatch_layout(idx, e)
            msg = str(err.value)
            assert f"rank {rank} timed out" in msg and "combine" in msg, msg
            with pytest.raises(RuntimeError, match="timed out"):  # a repeated call (its plan made) too
                kb.combine(out[0], out[4], config=cfg)
        torch.cuda.synchronize()
        dist.barrier()
        kb.destroy()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_timeout_names_rank_and_phase(world_size: int) -> None:
    run_distributed(_world_timeout, world_size, backend="nccl", env={"MOE_DISPATCHER_TIMEOUT_S": "2"})


def _world_no_leak(rank: int, world_size: int) -> int:
    dev = torch.device("cuda", torch.cuda.current_device())
    idx = torch.rand(64, 4 * world_size, device=dev).topk(2, dim=1).indices
    x = torch.randn(64, 2048, device=dev).to(torch.bfloat16)
    # a first cycle with calls loads the kernels' modules (lazy loading): memory that stays for the process, not
    # per Buffer, so it is taken before the first reading
    kb = make_buffer(hidden_bytes=MAX_HIDDEN_BYTES, backend="kernels", explicitly_destroy=True)
    _, out = _dispatch(kb, x, idx, None, 4 * world_size)
    kb.combine(out[0], out[4])
    kb.destroy()
    del out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    for i in range(50):
        with case(f"create/destroy {i}"):
            kb = make_buffer(hidden_bytes=MAX_HIDDEN_BYTES, backend="kernels", explicitly_destroy=True)
            if i % 10 == 0:
                _, out = _dispatch(kb, x, idx, None, 4 * world_size)
                kb.combine(out[0], out[4])
                del out  # what a call returns may keep its Buffer's memory alive (by design): not a leak
            kb.destroy()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    leaked = free_before - torch.cuda.mem_get_info()[0]
    assert leaked < 64 << 20, f"{leaked / 2 ** 20:.1f} MiB of GPU memory lost over 50 create/destroy cycles"
    return leaked


@pytest.mark.parametrize("world_size", [2])
def test_create_destroy_does_not_leak(world_size: int) -> None:
    leaked = run_distributed(_world_no_leak, world_size, backend="nccl")
    print(f"\n[intranode] GPU memory change over 50 create/destroy cycles per rank: "
          f"{[round(v / 2 ** 20, 1) for v in leaked]} MiB")


def _time(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def _world_speed(rank: int, world_size: int, num_sms: int) -> Dict:
    from moe_dispatcher import Buffer
    Buffer.set_num_sms(num_sms)
    kb = make_buffer(hidden_bytes=MAX_HIDDEN_BYTES, backend="kernels", explicitly_destroy=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    t, h, e, k = 4096, 7168, 256, 8
    torch.manual_seed(rank)
    idx = (torch.randn(t, e, device=dev).abs() + 1).topk(k, dim=1).indices
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)
    _, out = _dispatch(kb, x, idx, None, e)
    handle, recv_x = out[4], out[0]
    nbytes = recv_x.numel() * 2
    n_self = int(handle.rank_prefix_matrix[rank, rank] - (handle.rank_prefix_matrix[rank - 1, rank] if rank else 0))
    phys = (recv_x.shape[0] - n_self) * h * 2
    res = {"recv_rows": recv_x.shape[0]}
    res["dispatch_s"] = _time(lambda: kb.dispatch(x, handle=handle))
    res["combine_s"] = _time(lambda: kb.combine(recv_x, handle))
    xf = (x.float().clamp(-400, 400).to(torch.float8_e4m3fn), torch.rand(t, h // 128, device=dev))
    _, out8 = _dispatch(kb, xf, idx, None, e)
    res["dispatch_fp8_s"] = _time(lambda: kb.dispatch(xf, handle=out8[4]))
    res["dispatch_gbs"] = nbytes / 1e9 / res["dispatch_s"]
    res["dispatch_fp8_gbs"] = nbytes * (1 + 4 / 128) / 2 / 1e9 / res["dispatch_fp8_s"]
    res["combine_gbs"] = nbytes / 1e9 / res["combine_s"]
    res["dispatch_phys_gbs"] = phys / 1e9 / res["dispatch_s"]
    res["combine_phys_gbs"] = phys / 1e9 / res["combine_s"]
    # Sweep of num_sms and chunk sizes through the backend directly (the ring stays 256 slots).
    from moe_dispatcher import Config
    backend, sweep = kb._kernels, {}
    layout = backend.get_dispatch_layout(idx, e)
    for sms in (16, 24):
        got = backend.dispatch(x, None, idx, None, layout[0], layout[3], layout[2], 1, 0, config=Config(sms, 12, 256))
        h_sms, recv_sms = got[5], got[0]
        for chunk in (4, 8, 16, 32):
            cfg = Config(sms, chunk, 256)
            td = _time(lambda h_=h_sms, c_=cfg: backend.cached_dispatch(x, None, h_, config=c_))
            tc = _time(lambda r_=recv_sms, h_=h_sms, c_=cfg: backend.combine(r_, h_, None, (), config=c_))
            sweep[(sms, chunk)] = (nbytes / 1e9 / td, nbytes / 1e9 / tc)
    res["sweep"] = sweep
    torch.cuda.synchronize()
    kb.destroy()
    return res


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("num_sms", [24])
def test_speed_report(world_size: int, num_sms: int) -> None:
    """Not a pass/fail target: prints GB/s (DeepEP's formula, bench/README.md) for the standard shape."""
    res = run_distributed(_world_speed, world_size, num_sms, backend="nccl")
    r0 = res[0]
    print(f"\n[intranode R={world_size} num_sms={num_sms}] T=4096 H=7168 E=256 K=8, rank 0 receives "
          f"{r0['recv_rows']} rows: dispatch BF16 {r0['dispatch_s'] * 1e6:.0f} us = {r0['dispatch_gbs']:.0f} GB/s "
          f"(physical {r0['dispatch_phys_gbs']:.0f}), dispatch FP8 {r0['dispatch_fp8_s'] * 1e6:.0f} us = "
          f"{r0['dispatch_fp8_gbs']:.0f} GB/s, combine BF16 {r0['combine_s'] * 1e6:.0f} us = "
          f"{r0['combine_gbs']:.0f} GB/s (physical {r0['combine_phys_gbs']:.0f})")
    for (sms, chunk), (d, c) in sorted(r0["sweep"].items()):
        print(f"[intranode R={world_size}] sweep num_sms={sms} chunk={chunk} ring=256: dispatch {d:.0f} GB/s, "
              f"combine {c:.0f} GB/s")
