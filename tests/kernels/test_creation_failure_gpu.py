"""A Buffer creation that fails on one rank, on real GPUs (2 ranks, NCCL): every rank raises CreationFailed naming it,
soon, and the group stays usable for the next Buffer (tests/kernels/test_creation_failure_cpu.py checks the steps on
CPU).

Injected on one rank: the intranode backend's NVLink buffer allocation (the native IpcBuffer's constructor raises),
a failure right after its real IPC open of the peers' buffers (every rank closes its mappings, then frees), the
low-latency backend's local step, and rank 0's NVSHMEM unique id (an intranode + low-latency Buffer: NVSHMEM is not
entered on any rank, the connected NVLink buffers are freed). After each, a valid Buffer of the same kind is made,
serves a dispatch (intranode) or is created with NVSHMEM up (low-latency), and is destroyed.
"""
from __future__ import annotations

import time

import pytest
import torch
from dist import case, make_buffer, run_distributed

pytestmark = pytest.mark.gpu
TIMEOUT_S = 30.0  # MOE_DISPATCHER_TIMEOUT_S: every failure must be reported long before it
FAST_S = 10.0
HIDDEN = 1024


def _fails(label: str, make, rank: int, who: int, said: str, step: str) -> None:
    """make() must raise CreationFailed naming rank `who` and `said` at `step`, within FAST_S."""
    from moe_dispatcher import CreationFailed
    t0 = time.monotonic()
    with case(label):
        try:
            make()
        except CreationFailed as exc:
            message = str(exc)
        else:
            raise AssertionError(f"rank {rank}, {label}: the Buffer was created")
        seconds = time.monotonic() - t0
        assert f"({step})" in message and f"rank {who}: " in message and said in message, message
        assert seconds < FAST_S, f"rank {rank}, {label}: {seconds:.1f} s"


def _intranode_dispatch_works(rank: int, world_size: int) -> None:
    buf = make_buffer(hidden_bytes=HIDDEN * 2)
    assert buf._kernels is not None, buf._kernels_why
    x = torch.randn(8, HIDDEN, dtype=torch.bfloat16, device="cuda")
    topk_idx = torch.arange(8, device="cuda").view(8, 1) % (2 * world_size)
    layout = buf.get_dispatch_layout(topk_idx, 2 * world_size)
    recv = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                        num_tokens_per_expert=layout[2], topk_idx=topk_idx,
                        topk_weights=torch.ones(8, 1, device="cuda"))
    torch.cuda.synchronize()
    assert recv[0].shape == (8, HIDDEN), recv[0].shape  # rank r gets the 4 tokens of each rank for its experts
    buf.destroy()


def _world(rank: int, world_size: int) -> None:
    from moe_dispatcher import _ext, compiled
    from moe_dispatcher.compiled import intranode
    from moe_dispatcher.runtime import nvshmem
    native = _ext.load()
    real_ipc_buffer, real_connect = native.intranode.IpcBuffer, intranode.IntranodeBackend.connect

    def failing_allocation(*args):
        raise RuntimeError("injected: cudaMalloc of the NVLink buffer: out of memory")

    if rank == 1:
        native.intranode.IpcBuffer = failing_allocation
    _fails("intranode: allocation", lambda: make_buffer(hidden_bytes=HIDDEN * 2), rank, 1, "out of memory",
           "allocation")
    native.intranode.IpcBuffer = real_ipc_buffer
    with case("intranode after a failed allocation"):
        _intranode_dispatch_works(rank, world_size)

    def failing_connect(self, payloads):
        real_connect(self, payloads)  # the peers' buffers are really mapped: closed again before anyone frees
        raise RuntimeError("injected: after cudaIpcOpenMemHandle")

    if rank == 1:
        intranode.IntranodeBackend.connect = failing_connect
    _fails("intranode: IPC open", lambda: make_buffer(hidden_bytes=HIDDEN * 2), rank, 1, "cudaIpcOpenMemHandle",
           "connection")
    intranode.IntranodeBackend.connect = real_connect
    with case("intranode after a failed open"):
        _intranode_dispatch_works(rank, world_size)

    # Before any NVSHMEM bootstrap of this process: rank 0 cannot make the unique id (the extension's init).
    real_pick, real_uid = nvshmem._pick_backend, native.nvshmem_get_unique_id
    nvshmem._pick_backend = lambda: "extension"
    if rank == 0:
        native.nvshmem_get_unique_id = lambda: (_ for _ in ()).throw(RuntimeError("injected: no unique id"))
    _fails("intranode + low-latency: NVSHMEM unique id",
           lambda: make_buffer(hidden_bytes=HIDDEN * 2, low_latency=True, max_tokens=64, hidden=HIDDEN,
                               num_experts=2 * world_size), rank, 0, "no unique id", "NVSHMEM unique id")
    nvshmem._pick_backend, native.nvshmem_get_unique_id = real_pick, real_uid
    assert nvshmem.current() is None, "NVSHMEM was brought up although the unique id never came"

    real_create_ll = compiled.create_low_latency

    def failing_low_latency(buffer):
        raise RuntimeError("injected: low-latency setup failed")

    if rank == 1:
        compiled.create_low_latency = failing_low_latency
    _fails("low-latency: local step", lambda: make_buffer(low_latency=True, max_tokens=64, hidden=HIDDEN,
                                                          num_experts=2 * world_size),
           rank, 1, "low-latency setup failed", "allocation")
    compiled.create_low_latency = real_create_ll
    assert nvshmem.current() is None, "NVSHMEM was entered although a peer failed before it"
    with case("low-latency after the failures"):
        buf = make_buffer(low_latency=True, max_tokens=64, hidden=HIDDEN, num_experts=2 * world_size)
        assert buf._kernels_ll is not None, buf._kernels_ll_why
        buf.destroy()


def test_creation_failure_on_one_rank_gpu():
    run_distributed(_world, 2, backend="nccl", env={"MOE_DISPATCHER_TIMEOUT_S": str(TIMEOUT_S)}, timeout=240)
