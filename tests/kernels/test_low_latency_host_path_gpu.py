"""The eager low-latency host path on real GPUs: what one call leaves behind and what it asks of the CUDA runtime.

Checked per rank, on the compiled kernels (docs/low_latency.md, "Host path"):
* the outputs keep DeepEP V1's contract: dtypes, shapes and strides of recv_x (BF16, or FP8 with float32 / UE8M0
  int32 scales, token-minor), recv_count, the handle's src_info and layout_range, and the combine's output, all
  on the Buffer's device; the dispatch's outputs are views of one block (one storage) that stays valid while any
  of them lives; the handle is a LowLatencyHandle whose backend_state is the runtime's capsule;
* the dispatch's block lives while any of its outputs (or the handle) does and is freed with the last one
  (torch.cuda.memory_allocated: nothing freed before, about the block's bytes after);
* combine reads the routing from the dispatch's block, not through the handle's tensors (a src_info moved to
  other memory with set_ changes nothing);
* a call made while another GPU is current, and one made from a thread where c10's (deferred) current device is
  not CUDA's, runs on the Buffer's device and gives the same bits;
* the runtime's calls (METH_FASTCALL functions) name a wrongly typed argument in their TypeError, take flags by
  pybind11's rule (True, False, None, numpy.bool_; not a str or a list) and integers by pybind11's int64 rule
  (an object with __int__ only; out of int64 a TypeError), and refuse a count outside int's range (ValueError)
  instead of truncating it;
* a repeated call shape is not validated again, a refused call posts the abort once, the handle (built in C)
  equals and hashes as the tuple of its fields, and a call after destroy() raises "destroyed";
* a caching-allocator OOM inside a call reaches Python as torch.OutOfMemoryError;
* the per-call inventory in steady state (torch.profiler's CUDA runtime events over N eager pairs): N launches per
  call kind, exactly one kernel whose name holds "dispatch" per dispatch and one holding "combine" per combine,
  and no memset, event, stream-wait, allocation or function-attribute call.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist import GPU_WORLD_SIZES, assert_equal, case, device, make_buffer, run_distributed

from moe_dispatcher.handle import LowLatencyHandle

pytestmark = pytest.mark.gpu
MAX_T, H, E, K = 128, 7168, 256, 8
PAIRS = 16  # profiled eager pairs
# CUDA runtime / driver calls an eager, synchronous call must not make (steady state; the profiled loop's own
# torch.cuda.synchronize makes a cudaDeviceSynchronize, not listed).
FORBIDDEN = ("Memset", "EventRecord", "EventCreate", "StreamWaitEvent", "Malloc", "FuncSetAttribute",
             "cudaSetDevice")


def _inputs(rank: int, t: int):
    dev = device()
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    x = torch.randn(t, H, device=dev, generator=gen).to(torch.bfloat16)
    idx = torch.rand(t, E, device=dev, generator=gen).topk(K, dim=1).indices
    w = torch.rand(t, K, device=dev, generator=gen)
    return x, idx, w


def _check_dispatch_outputs(buf, recv_x, count, handle, num_ranks: int, fp8: bool, ue8m0: bool) -> None:
    dev = device()
    local, rows = E // num_ranks, num_ranks * MAX_T
    data, scales = recv_x if fp8 else (recv_x, None)
    assert data.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
    assert data.shape == (local, rows, H) and data.stride() == (rows * H, H, 1) and data.device == dev
    if fp8:
        groups = H // 512 if ue8m0 else H // 128
        assert scales.dtype == (torch.int32 if ue8m0 else torch.float32)
        assert scales.shape == (local, rows, groups) and scales.stride() == (groups * rows, 1, rows)
        assert scales.device == dev
    assert count.dtype == torch.int32 and count.shape == (local,) and count.is_contiguous() and count.device == dev
    assert type(handle) is LowLatencyHandle and handle.backend == "low_latency"
    assert (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts) == (MAX_T, H, E)
    assert handle.buffer_token == buf._token
    assert type(handle.backend_state).__name__ == "PyCapsule"
    assert handle.src_info.dtype == torch.int32 and handle.src_info.shape == (local, rows)
    assert handle.layout_range.dtype == torch.int64 and handle.layout_range.shape == (local, num_ranks)
    assert handle.src_info.is_contiguous() and handle.layout_range.is_contiguous()
    # One block: every output is a view of the same storage.
    tensors = [data, count, handle.src_info, handle.layout_range] + ([scales] if fp8 else [])
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1


def _block_bytes(num_ranks: int) -> int:
    """Bytes of a BF16 dispatch's output block as the runtime carves it (each part 256-byte aligned): recv_x
    [L, rows, H] bf16, recv_count [L] int32, src_info and row_of [L, rows] int32, layout_range [L, R] int64."""
    local, rows = E // num_ranks, num_ranks * MAX_T
    parts = (local * rows * H * 2, local * 4, local * rows * 4, local * rows * 4, local * num_ranks * 8)
    return sum((n + 255) // 256 * 256 for n in parts)


class _OnlyInt:
    """An integer through __int__ only (no __index__): pybind11's convert pass takes it as int() does."""

    def __int__(self) -> int:
        return MAX_T


def _contract_worker(rank: int, num_ranks: int) -> None:
    dev = device()
    buf = make_buffer(low_latency=True, max_tokens=MAX_T, hidden=H, num_experts=E, backend="kernels",
                      explicitly_destroy=True)
    assert buf._kernels_ll is not None, buf._kernels_ll_why
    x, idx, w = _inputs(rank, MAX_T - rank)
    t = x.shape[0]
    for fp8, round_scale, ue8m0 in ((False, False, False), (True, False, False), (True, True, True)):
        with case(f"outputs of a dispatch (fp8={fp8}, ue8m0={ue8m0}) and its combine"):
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=fp8,
                                                                   round_scale=round_scale, use_ue8m0=ue8m0)
            _check_dispatch_outputs(buf, recv_x, count, handle, num_ranks, fp8, ue8m0)
            y = torch.randn(E // num_ranks, num_ranks * MAX_T, H, device=dev).to(torch.bfloat16)
            out, _, _ = buf.low_latency_combine(y, idx, w, handle)
            assert out.dtype == torch.bfloat16 and out.shape == (t, H) and out.stride() == (H, 1)
            assert out.device == dev
            assert out.untyped_storage().data_ptr() != handle.src_info.untyped_storage().data_ptr()
    with case("the runtime's calls name a wrongly typed argument"):
        run = buf._kernels_ll.low_latency_dispatch
        with pytest.raises(TypeError, match="num_experts must be an integer, got float"):
            run(x, idx, MAX_T, float(E), None, None, False, False, False, False, False)
        with pytest.raises(TypeError, match="topk_idx must be a torch.Tensor"):
            run(x, idx.tolist(), MAX_T, E, None, None, False, False, False, False, False)
        with pytest.raises(TypeError, match="takes 11 positional arguments, 2 given"):
            run(x, idx)
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)
        with pytest.raises(TypeError, match="handle must be a LowLatencyHandle"):
            buf._kernels_ll.low_latency_combine(y, idx, w, handle._replace(backend_state=None), False, False, False,
                                                None, None)
        buf.low_latency_combine(y, idx, w, handle)  # the runtime is still usable
    with case("flags by pybind11's rule: True, False, None (false), numpy.bool_; a str or a list is refused"):
        run = buf._kernels_ll.low_latency_dispatch
        for use_fp8, round_scale in ((None, None), (True, False), (False, None), (np.bool_(True), np.bool_(True))):
            recv_x, count, handle, _, _ = run(x, idx, MAX_T, E, None, None, use_fp8, round_scale, False, None, False)
            _check_dispatch_outputs(buf, recv_x, count, handle, num_ranks, bool(use_fp8), False)
        with pytest.raises(TypeError, match="use_fp8 must be a bool .*got str"):
            run(x, idx, MAX_T, E, None, None, "False", False, False, False, False)
        with pytest.raises(TypeError, match="round_scale must be a bool .*got list"):
            run(x, idx, MAX_T, E, None, None, False, [], False, False, False)
        with pytest.raises(TypeError, match="return_recv_hook must be a bool .*got str"):
            run(x, idx, MAX_T, E, None, None, False, False, False, False, "")
    with case("integers by pybind11's int64 rule; a count outside int's range is refused, not truncated"):
        recv_x, count, handle, _, _ = run(x, idx, _OnlyInt(), E, None, None, False, False, False, False, False)
        _check_dispatch_outputs(buf, recv_x, count, handle, num_ranks, False, False)
        with pytest.raises(TypeError, match="num_max_dispatch_tokens_per_rank must be an integer in int64 range"):
            run(x, idx, 1 << 64, E, None, None, False, False, False, False, False)
        with pytest.raises(ValueError, match=f"num_max_dispatch_tokens_per_rank={(1 << 32) + MAX_T} is out of range"):
            run(x, idx, (1 << 32) + MAX_T, E, None, None, False, False, False, False, False)
        with pytest.raises(ValueError, match=f"num_experts={(1 << 32) + E} is out of range"):
            run(x, idx, MAX_T, (1 << 32) + E, None, None, False, False, False, False, False)
    with case("the block lives while any output does, and goes with the last"):
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)
        torch.cuda.synchronize()
        want = count.clone()
        held = torch.cuda.memory_allocated(dev)
        del recv_x, handle
        assert torch.cuda.memory_allocated(dev) == held, "memory was freed while recv_count still lives"
        assert_equal(count, want, "recv_count after the other views went")
        del count
        freed = held - torch.cuda.memory_allocated(dev)
        block = _block_bytes(num_ranks)
        # The caching allocator rounds a large block up (512 bytes by default); 1 MiB of slack for its settings.
        assert block <= freed <= block + (1 << 20), f"freed {freed} bytes with the last output, block {block}"
    with case("combine reads the routing from the dispatch's block, not through the handle's tensors"):
        y = torch.randn(E // num_ranks, num_ranks * MAX_T, H, device=dev).to(torch.bfloat16)
        handle = buf.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)[2]
        want = buf.low_latency_combine(y, idx, w, handle)[0].clone()
        handle = buf.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)[2]
        src_info = handle.src_info
        decoy = torch.zeros(src_info.untyped_storage().nbytes() // 4, dtype=torch.int32, device=dev)
        src_info.set_(decoy.untyped_storage(), 0, src_info.shape, src_info.stride())  # the user moves it
        got = buf.low_latency_combine(y, idx, w, handle)[0]
        torch.cuda.synchronize()
        assert_equal(got, want, "combine after the handle's src_info was moved to zeroed memory", bitwise=True)
    with case("a call from a thread whose c10 current device (deferred) is not CUDA's"):
        # A fresh thread's CUDA device is 0. Entering the Buffer's device and leaving it makes CUDA's current
        # device the Buffer's and, when device 0 has no primary context, c10 defers the switch back: c10 says 0
        # (where its caching allocator would allocate), CUDA says the Buffer's. Rank 0 (or a process with a
        # context on device 0) gets no such split: its call is checked all the same.
        split = dev.index != 0 and not torch._C._cuda_hasPrimaryContext(0)
        handle = buf.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)[2]
        want = buf.low_latency_combine(y, idx, w, handle)[0].clone()
        torch.cuda.synchronize()
        found: dict = {}

        def body() -> None:
            try:
                with torch.cuda.device(dev.index):
                    pass
                found["c10 device"] = torch.cuda.current_device()
                recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)
                got, _, _ = buf.low_latency_combine(y, idx, w, handle)
                found["devices"] = {recv_x.device, count.device, handle.src_info.device, got.device}
                torch.cuda.synchronize(dev)
                found["got"] = got
            except BaseException as e:  # noqa: BLE001 (re-raised on the test's thread)
                found["error"] = e

        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        if "error" in found:
            raise found["error"]
        if split:
            assert found["c10 device"] == 0, f"precondition: c10's current device in the thread is {found}"
        assert found["devices"] == {dev}, f"outputs on {found['devices']}, the Buffer's device is {dev}"
        assert_equal(found["got"], want, "combine made from the thread", bitwise=True)
    if torch.cuda.device_count() > 1:
        with case("a call made while another GPU is current"):
            _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)
            y = torch.randn(E // num_ranks, num_ranks * MAX_T, H, device=dev).to(torch.bfloat16)
            want = buf.low_latency_combine(y, idx, w, handle)[0].clone()
            other = (dev.index + 1) % torch.cuda.device_count()
            torch.cuda.synchronize()
            with torch.cuda.device(other):
                recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)
                got, _, _ = buf.low_latency_combine(y, idx, w, handle)
                assert torch.cuda.current_device() == other
            assert recv_x.device == dev and got.device == dev and count.device == dev
            torch.cuda.synchronize(dev)
            assert_equal(got, want, "combine made under another current GPU", bitwise=True)
    with case("a known call shape is not validated again; errors post the abort"):
        seen = {"_first_ll_dispatch": 0, "_first_ll_combine": 0, "_post_abort": 0}
        buf._ll_dispatch_runs.clear()  # the earlier cases made these call shapes known: the first call misses
        buf._ll_combine_runs.clear()
        for name in seen:
            real = getattr(buf, name)
            setattr(buf, name, lambda *a, _n=name, _r=real: (seen.__setitem__(_n, seen[_n] + 1), _r(*a))[1])
        try:
            for _ in range(3):
                handle = buf.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)[2]
                got = buf.low_latency_combine(y, idx, w, handle)[0]
            assert seen == {"_first_ll_dispatch": 1, "_first_ll_combine": 1, "_post_abort": 0}, seen
            assert handle == tuple(handle) and hash(handle) == hash(tuple(handle))  # built as tuple.__new__ builds
            torch.cuda.synchronize()
            dist.barrier()  # no kernel of any rank in flight: the abort the refused call posts stops nothing
            with pytest.raises(ValueError, match="x must be BFloat16"):
                buf.low_latency_dispatch(x.float(), idx, MAX_T, E, use_fp8=False)
            dist.barrier()  # every rank posted; its next launch clears its own
            assert seen["_post_abort"] == 1 and seen["_first_ll_dispatch"] == 1, seen
            torch.cuda.synchronize()
            assert_equal(buf.low_latency_combine(y, idx, w, buf.low_latency_dispatch(
                x, idx, MAX_T, E, use_fp8=False)[2])[0], got, "a pair after the refused call", bitwise=True)
        finally:
            for name in seen:
                del buf.__dict__[name]
    with case("an allocation that fails inside a call is torch.OutOfMemoryError"):
        # The last case: the failed dispatch took a buffer half (on every rank alike) and made nothing.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        limit = torch.cuda.memory_reserved(dev) + (64 << 20)  # far less than a dispatch's block
        torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(dev).total_memory, dev)
        try:
            with pytest.raises(torch.OutOfMemoryError):
                buf.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
    dist.barrier()
    buf.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.low_latency_dispatch(x, idx, MAX_T, E)


def _inventory_worker(rank: int, num_ranks: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    dev = device()
    buf = make_buffer(low_latency=True, max_tokens=MAX_T, hidden=H, num_experts=E, backend="kernels",
                      explicitly_destroy=True)
    x, idx, w = _inputs(rank, MAX_T)
    y = torch.randn(E // num_ranks, num_ranks * MAX_T, H, device=dev).to(torch.bfloat16)

    def pair():
        handle = buf.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=True)[2]
        buf.low_latency_combine(y, idx, w, handle)

    for _ in range(8):  # the first call of the shape cleans the layout (memsets, barriers): not steady state
        pair()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PAIRS):
            pair()
        torch.cuda.synchronize()
    dist.barrier()
    events = prof.events()
    names = [e.name for e in events]
    found = {
        "launches": sum(1 for n in names if n.startswith(("cudaLaunchKernel", "cuLaunchKernel"))),
        "dispatch kernels": sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                                and "dispatch" in e.name),
        "combine kernels": sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                               and "combine" in e.name),
        "forbidden": sorted({n for n in names if n.startswith(("cuda", "cu")) and any(f in n for f in FORBIDDEN)}),
    }
    with case(f"per-call inventory over {PAIRS} eager pairs: {found}"):
        assert found["launches"] == 2 * PAIRS
        assert found["dispatch kernels"] == PAIRS and found["combine kernels"] == PAIRS
        assert not found["forbidden"]
    buf.destroy()
    return found


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_low_latency_host_path_contract(world_size: int) -> None:
    """The outputs' dtypes, shapes, strides and device, one block per dispatch, the handle's type and state,
    and a call made while another GPU is current."""
    run_distributed(_contract_worker, world_size, backend="nccl")


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_low_latency_host_path_inventory(world_size: int) -> None:
    """Steady-state eager pairs: one launch per call, one dispatch and one combine kernel, no memset, event,
    stream wait, allocation or attribute call."""
    run_distributed(_inventory_worker, world_size, backend="nccl")
