"""Start one process per rank and give each a process group, then run the benchmark body in it.

Two ways in:
- under torchrun (RANK / WORLD_SIZE / LOCAL_RANK in the environment): this process is one rank; the group
  comes from env:// and the GPU is LOCAL_RANK;
- otherwise: spawn `num_ranks` processes with torch.multiprocessing (start method "spawn"); they meet
  through a FileStore in a temporary directory (no port to race for). Rank r uses cuda:r.

Every rank keeps all GPUs visible (torch.cuda.set_device, never CUDA_VISIBLE_DEVICES: peer access and
NVSHMEM's P2P discovery need them) and runs with NVLink multicast / NVLS switched off.
"""
from __future__ import annotations

import datetime
import os
import shutil
import sys
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist

# Set in every rank before any NCCL / NVSHMEM initialisation (multicast can take the shared host's GPUs out
# of service on the lent machines).
RANK_ENV = {
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def default_num_ranks() -> int:
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.device_count()
    return 2


def _init(rank: int, world_size: int, local_rank: int, use_cuda: bool, init_method: str, timeout_s: float) -> None:
    os.environ.update(RANK_ENV)
    kwargs: dict = {}
    if use_cuda:
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        torch.set_num_threads(1)
        backend = "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def _spawned(local_rank: int, world_size: int, use_cuda: bool, store_path: str, timeout_s: float,
             body: Callable[[Any], None], opts: Any) -> None:
    _init(local_rank, world_size, local_rank, use_cuda, f"file://{store_path}", timeout_s)
    try:
        body(opts)
    finally:
        sys.stdout.flush()
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(body: Callable[[Any], None], opts: Any, num_ranks: int, use_cuda: bool, timeout_s: float) -> None:
    """Run body(opts) on every rank of a fresh group of `num_ranks` (or on this torchrun rank)."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if num_ranks != world:
            raise SystemExit(f"--num-ranks {num_ranks} differs from torchrun's WORLD_SIZE={world}")
        local_rank = int(os.environ["LOCAL_RANK"])
        _init(int(os.environ["RANK"]), world, local_rank, use_cuda, "env://", timeout_s)
        try:
            body(opts)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return
    if use_cuda and torch.cuda.device_count() < num_ranks:
        raise SystemExit(f"--num-ranks {num_ranks} needs {num_ranks} GPUs, {torch.cuda.device_count()} visible")
    import torch.multiprocessing as mp
    os.environ.update(RANK_ENV)  # spawned children inherit the parent's environment at start
    if not use_cuda:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmpdir = tempfile.mkdtemp(prefix="moe_bench_")
    try:
        mp.spawn(_spawned, args=(num_ranks, use_cuda, os.path.join(tmpdir, "store"), timeout_s, body, opts),
                 nprocs=num_ranks, join=True)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
