"""The eager low-latency host path on real GPUs: what one call leaves behind and what it asks of the CUDA runtime.

Checked per rank, on the compiled kernels (docs/low_latency.md, "Host path"):
* the outputs keep DeepEP V1's contract: dtypes, shapes and strides of recv_x (BF16, or FP8 with float32 / UE8M0
  int32 scales, token-minor), recv_count, the handle's src_info and layout_range, and the combine's output, all
  on the Buffer's device; the dispatch's outputs are views of one block (one storage) that stays valid while any
  of them lives; the handle is a LowLatencyHandle whose backend_state is the runtime's capsule;
* a call made while another GPU is current runs on the Buffer's device and gives the same bits;
* the runtime's calls (METH_FASTCALL functions) name a wrongly typed argument in their TypeError;
* the per-call inventory in steady state (torch.profiler's CUDA runtime events over N eager pairs): N launches per
  call kind, exactly one kernel whose name holds "dispatch" per dispatch and one holding "combine" per combine,
  and no memset, event, stream-wait, allocation or function-attribute call.
"""
from __future__ import annotations

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
    with case("the block outlives every view but one"):
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)
        torch.cuda.synchronize()
        want = count.clone()
        del recv_x, handle
        torch.cuda.empty_cache()
        noise = torch.full((1 << 20,), -7, dtype=torch.int32, device=dev)  # would reuse a freed block
        torch.cuda.synchronize()
        assert_equal(count, want, "recv_count after the other views went")
        del noise
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
    dist.barrier()
    buf.destroy()


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
