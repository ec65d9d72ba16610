"""The host path of cached normal-mode calls (dispatch along a handle, combine) on real GPUs: what one call asks of
the host and what it leaves behind.

Checked per rank, on the compiled intranode kernels (csrc/bindings/cached_call.h):
* a handle's plans are METH_FASTCALL functions that own the native plan (builtins, not pybind11 instances), with a
  peer pool too: along a direct dispatch's handle the combine plan launches in every mode (the fast path's
  synchronous and async_finish calls included), pulling when the input lies in the pool and taking the ring
  otherwise, and the dispatch plan writes directly into outputs it allocates in the pool (the backend keeps the
  latest block), with the full path's bits;
* the fast path gives the bits of the full path (a call with previous_event), for BF16 and FP8 dispatch and for
  combine with and without top-k weights;
* a call with two outputs (FP8 dispatch: rows and scales; combine with weights) makes one allocation: both are
  views of one block (the second 256-byte aligned) that lives while either output does;
* a call made while another GPU is current runs on the Buffer's device, leaves the current device as it was, and
  gives the same bits;
* the plans name a wrongly typed argument in their TypeError and refuse a wrong argument count;
* steady state (torch.profiler's CUDA runtime events over N synchronous cached dispatch + combine pairs): one
  launch per call, and no memset, event, stream wait, allocation or device switch.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from dist import GPU_WORLD_SIZES, assert_equal, case, device, make_buffer, run_distributed

pytestmark = pytest.mark.gpu
T, H, E, K = 256, 7168, 64, 8
PAIRS = 16
POOL_BYTES = 1 << 30
FORBIDDEN = ("Memset", "EventRecord", "EventCreate", "StreamWaitEvent", "Malloc", "FuncSetAttribute",
             "cudaSetDevice")


def _inputs(rank: int):
    dev = device()
    gen = torch.Generator(device=dev).manual_seed(300 + rank)
    x = torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)
    idx = torch.rand(T, E, device=dev, generator=gen).topk(K, dim=1).indices
    w = torch.rand(T, K, device=dev, generator=gen)
    return x, idx, w


def _fresh(buf, x, idx, w):
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank,
                                                   num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                                                   num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    return recv_x, recv_w, handle


def _full_path():
    from moe_dispatcher import EventOverlap
    from moe_dispatcher.event import EventHandle
    return EventOverlap(EventHandle())


def _allocations(dev) -> int:
    return torch.cuda.memory_stats(dev)["allocation.all.allocated"]


def _contract_worker(rank: int, num_ranks: int) -> None:  # noqa: C901 (one world, many cases)
    from moe_dispatcher import Buffer
    from moe_dispatcher.compiled import LAUNCH_SYNC

    dev = device()
    buf = make_buffer(hidden_bytes=H * 2, backend="kernels", explicitly_destroy=True)
    x, idx, w = _inputs(rank)
    scales = torch.rand(T, H // 128, device=dev)
    x8 = x.float().to(torch.float8_e4m3fn)
    recv_x, recv_w, handle = _fresh(buf, x, idx, w)
    y = torch.randn_like(recv_x)
    for _ in range(2):  # the first call of each kind makes its plan, the second takes the fast path
        buf.dispatch(x, handle=handle)
        buf.dispatch((x8, scales), handle=handle)
        buf.combine(y, handle)
        buf.combine(y, handle, topk_weights=recv_w)
    state = handle.backend_state
    with case("a handle's plans are METH_FASTCALL functions"):
        plans = list(state.dispatch_plans) + list(state.combine_plans)
        assert all(isinstance(p, types.BuiltinFunctionType) for p in plans), [type(p) for p in plans]
    with case("the fast path gives the full path's bits"):
        got = buf.dispatch(x, handle=handle)[0]
        want = buf.dispatch(x, handle=handle, previous_event=_full_path())[0]
        (got8, got_s), *_ = buf.dispatch((x8, scales), handle=handle)
        (want8, want_s), *_ = buf.dispatch((x8, scales), handle=handle, previous_event=_full_path())
        out, out_w, _ = buf.combine(y, handle, topk_weights=recv_w)
        ref, ref_w, _ = buf.combine(y, handle, topk_weights=recv_w, previous_event=_full_path())
        plain = buf.combine(y, handle)[0]
        torch.cuda.synchronize()
        assert_equal(got, want, "cached dispatch", bitwise=True)
        assert_equal(got8, want8, "cached FP8 dispatch rows")
        assert_equal(got_s, want_s, "cached FP8 dispatch scales", bitwise=True)
        assert_equal(out, ref, "combine", bitwise=True)
        assert_equal(out_w, ref_w, "combine's top-k weights", bitwise=True)
        assert_equal(plain, ref, "combine without weights", bitwise=True)
    with case("two outputs: one allocation, one block"):
        torch.cuda.synchronize()
        before = _allocations(dev)
        (r8, rs), *_ = buf.dispatch((x8, scales), handle=handle)
        assert _allocations(dev) - before == 1, "an FP8 cached dispatch must make one allocation"
        assert r8.untyped_storage().data_ptr() == rs.untyped_storage().data_ptr(), "rows and scales: one block"
        assert rs.data_ptr() % 256 == 0 and rs.data_ptr() >= r8.data_ptr() + r8.numel()
        assert r8.is_contiguous() and rs.is_contiguous() and r8.device == dev and rs.device == dev
        before = _allocations(dev)
        o, ow, _ = buf.combine(y, handle, topk_weights=recv_w)
        assert _allocations(dev) - before == 1, "a combine with weights must make one allocation"
        assert o.untyped_storage().data_ptr() == ow.untyped_storage().data_ptr()
        assert tuple(o.shape) == (T, H) and tuple(ow.shape) == (T, K) and ow.dtype == torch.float32
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated(dev)
        del o
        assert torch.cuda.memory_allocated(dev) == held, "the block was freed while the weights still live"
        del ow
        assert torch.cuda.memory_allocated(dev) < held, "the block must go with its last output"
        del r8, rs
    if torch.cuda.device_count() > 1:
        with case("a call made while another GPU is current"):
            want = buf.dispatch(x, handle=handle)[0]
            want_c = buf.combine(y, handle)[0]
            other = (dev.index + 1) % torch.cuda.device_count()
            torch.cuda.synchronize()
            with torch.cuda.device(other):
                got = buf.dispatch(x, handle=handle)[0]
                got_c = buf.combine(y, handle)[0]
                assert torch.cuda.current_device() == other
            assert got.device == dev and got_c.device == dev
            torch.cuda.synchronize(dev)
            assert_equal(got, want, "cached dispatch under another current GPU", bitwise=True)
            assert_equal(got_c, want_c, "combine under another current GPU", bitwise=True)
    with case("a plan names a wrongly typed argument"):
        plan = state.dispatch_plans[0]
        with pytest.raises(TypeError, match="x must be a torch.Tensor"):
            plan(handle, "x", None, None, Buffer.num_sms, LAUNCH_SYNC)
        with pytest.raises(TypeError, match="aux must be a torch.Tensor"):
            plan(handle, x, 1, None, Buffer.num_sms, LAUNCH_SYNC)
        with pytest.raises(TypeError, match="num_sms must be an integer"):
            plan(handle, x, None, None, 1.5, LAUNCH_SYNC)
        with pytest.raises(TypeError, match="takes 6 positional arguments, 5 given"):
            plan(handle, x, None, None, Buffer.num_sms)
        assert plan((1, 2), x, None, None, Buffer.num_sms, LAUNCH_SYNC) is None, "not this plan's handle"
    torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()


def _paths(buf) -> tuple:
    return buf._kernels._ipc.path_counters()


def _pool_worker(rank: int, num_ranks: int) -> None:
    from moe_dispatcher import Buffer
    from moe_dispatcher.compiled import LAUNCH_SYNC

    dev = device()
    buf = make_buffer(hidden_bytes=H * 2, backend="kernels", explicitly_destroy=True, num_pool_bytes=POOL_BYTES)
    pool = buf._kernels.peer_pool
    x, idx, w = _inputs(rank)
    recv_x, recv_w, handle = _fresh(buf, x, idx, w)
    y = torch.randn_like(recv_x)
    yp = pool.allocate(tuple(y.shape), y.dtype).copy_(y)
    wp = pool.allocate(tuple(recv_w.shape), torch.float32).copy_(recv_w)
    w_out = recv_w.clone()  # recv_w itself is a direct dispatch's output: in the pool
    assert pool.contains(recv_w) and not pool.contains(w_out) and not pool.contains(y)
    ring = buf.combine(y, handle, topk_weights=recv_w)  # makes the plan (the full path): y is outside the pool
    ring_plain = buf.combine(y, handle)
    torch.cuda.synchronize()
    with case("the combine plan along a direct dispatch's handle is native and serves the fast path"):
        plans = handle.backend_state.combine_plans
        assert all(isinstance(p, types.BuiltinFunctionType) for p in plans), [type(p) for p in plans]
        seen = _paths(buf)
        out = plans[1](handle, yp, wp, None, Buffer.num_sms, LAUNCH_SYNC)
        assert out is not None, "the plan must launch a synchronous call (the Buffer's fast path)"
        torch.cuda.synchronize()
        now = _paths(buf)
        assert (now[2] - seen[2], now[3] - seen[3]) == (1, 0), f"one pull, not missed: {seen} -> {now}"
        assert_equal(out[0], ring[0], "pulled combined_x vs the ring's")
        assert_equal(out[1], ring[1], "pulled combined_topk_weights vs the ring's")
    with case("fast-path combines pull from the pool and take the ring from outside it"):
        for label, inp, weights, missed, want in (("in the pool", yp, wp, 0, ring),
                                                 ("outside the pool", y, w_out, 1, ring),
                                                 ("weights outside the pool", yp, w_out, 1, ring),
                                                 ("no weights, in the pool", yp, None, 0, ring_plain)):
            seen = _paths(buf)
            got, got_w, event = buf.combine(inp, handle, topk_weights=weights)
            torch.cuda.synchronize()
            now = _paths(buf)
            missed_all = torch.tensor([missed], device=dev)
            dist.all_reduce(missed_all, op=dist.ReduceOp.MAX)
            assert (now[2] - seen[2], now[3] - seen[3]) == (1, int(missed_all.item())), (label, seen, now)
            assert event.event is None
            assert_equal(got, want[0], f"combine ({label})")
            if weights is not None:
                assert_equal(got_w, want[1], f"combine's weights ({label})")
    with case("async_finish on the fast path along a direct dispatch's handle"):
        seen = _paths(buf)
        got, got_w, event = buf.combine(yp, handle, topk_weights=wp, async_finish=True)
        assert event.event is not None
        event.current_stream_wait()
        torch.cuda.synchronize()
        now = _paths(buf)
        assert (now[2] - seen[2], now[3] - seen[3]) == (1, 0)
        assert_equal(got, ring[0], "async pulled combined_x")
        assert_equal(got_w, ring[1], "async pulled combined_topk_weights")
    with case("the cached dispatch plan along a direct dispatch's handle is native: outputs in the pool"):
        want = buf.dispatch(x, handle=handle, previous_event=_full_path())[0]  # makes the plan (the full path)
        plan = handle.backend_state.dispatch_plans[0]
        assert isinstance(plan, types.BuiltinFunctionType), type(plan)
        for label in ("sync", "async"):
            seen = _paths(buf)
            got, *_, event = buf.dispatch(x, handle=handle, async_finish=label == "async")
            assert (event.event is not None) == (label == "async")
            event.current_stream_wait()
            torch.cuda.synchronize()
            now = _paths(buf)
            assert (now[0] - seen[0], now[1] - seen[1]) == (1, 0), f"one direct call, not missed ({label})"
            assert pool.contains(got), f"the outputs must be the pool's ({label})"
            latest = buf._kernels._direct_blocks
            assert latest[1] is None and latest[0].untyped_storage().data_ptr() == got.untyped_storage().data_ptr()
            assert_equal(got, want, f"cached direct dispatch ({label}) vs the full path's")
        x8 = x.float().to(torch.float8_e4m3fn)
        scales = torch.rand(T, H // 128, device=dev)
        (want8, want_s), *_ = buf.dispatch((x8, scales), handle=handle, previous_event=_full_path())
        (got8, got_s), *_ = buf.dispatch((x8, scales), handle=handle)
        torch.cuda.synchronize()
        assert pool.contains(got8) and got_s.untyped_storage().data_ptr() == got8.untyped_storage().data_ptr()
        assert_equal(got8, want8, "cached direct FP8 dispatch rows")
        assert_equal(got_s, want_s, "cached direct FP8 dispatch scales")
    del yp, wp
    torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()


def _inventory_worker(rank: int, num_ranks: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    buf = make_buffer(hidden_bytes=H * 2, backend="kernels", explicitly_destroy=True)
    x, idx, w = _inputs(rank)
    recv_x, _, handle = _fresh(buf, x, idx, w)
    y = torch.randn_like(recv_x)

    def pair():
        buf.dispatch(x, handle=handle)
        buf.combine(y, handle)

    for _ in range(8):
        pair()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PAIRS):
            pair()
        torch.cuda.synchronize()
    dist.barrier()
    names = [e.name for e in prof.events()]
    found = {
        "launches": sum(1 for n in names if n.startswith(("cudaLaunchKernel", "cuLaunchKernel"))),
        "forbidden": sorted({n for n in names if n.startswith(("cuda", "cu")) and any(f in n for f in FORBIDDEN)}),
    }
    with case(f"per-call inventory over {PAIRS} cached dispatch + combine pairs: {found}"):
        assert found["launches"] == 2 * PAIRS
        assert not found["forbidden"]
    buf.destroy()
    return found


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cached_host_path_contract(world_size: int) -> None:
    """Plans as functions, the full path's bits, one block for two outputs, another GPU current, typed errors."""
    run_distributed(_contract_worker, world_size, backend="nccl")


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cached_pull_combine_plan(world_size: int) -> None:
    """With a peer pool: the combine plan is native, pulls on the fast path (sync and async), rings from outside; the
    dispatch plan is native, its outputs in the pool."""
    run_distributed(_pool_worker, world_size, backend="nccl")


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cached_host_path_inventory(world_size: int) -> None:
    """Steady-state synchronous cached pairs: one launch per call; no memset, event, stream wait, allocation or
    device switch."""
    run_distributed(_inventory_worker, world_size, backend="nccl")
