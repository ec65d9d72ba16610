"""Launch real ranks for a test: `run_distributed(fn, world_size, *args)`.

Each rank is a fresh process (spawn start method) that joins a process group through a FileStore in a
temporary directory (no port to race for), runs `fn(rank, world_size, *args)` and reports back. Any rank's
exception is re-raised in the test with that rank's traceback attached; a hard timeout kills stuck ranks and
names them, with the last `case(...)` each one entered. Spawning costs seconds on a small machine, so test
functions batch many cases into one world (loop inside `fn`) and label them with `case(...)`.

Assertion rewriting does not reach the ranks: give `assert` statements messages, or use the helpers here.
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import pickle
import queue as queue_mod
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT = float(os.environ.get("MOE_TEST_TIMEOUT", "300"))
PROFILE = bool(os.environ.get("MOE_TEST_PROFILE"))  # print the slowest cases of each world (rank 0's view)
GRACE_SECONDS = 3.0  # after a rank fails, how long the others get to report before they are killed

# Children never use NVLink multicast (NVLS): on shared GPU hosts it can take the GPUs out of service.
CHILD_ENV = {
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "OMP_NUM_THREADS": "1",
}

# Backends every distributed test is parametrised over: gloo always, NCCL on enough GPUs (marked `gpu`).
BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)]
# (world_size, NVLink domain size): one domain of 2 and of 4 ranks, and 4 ranks emulating 2 domains of 2
# (MOE_DISPATCHER_NVL_SIZE), which sends normal mode through the internode path.
WORLDS = [pytest.param(2, None, id="2"), pytest.param(4, None, id="4"), pytest.param(4, 2, id="4-nvl2")]
NVL_ENV = "MOE_DISPATCHER_NVL_SIZE"
# World sizes of the GPU-only (kernel) tests; sizes above the visible GPU count are skipped by the `gpu`
# marker, so an 8-GPU machine runs the EP8 cases with the same command.
GPU_WORLD_SIZES = [2, 4, 8]


def nvl_env(nvl_size: int | None) -> dict[str, str]:
    return {NVL_ENV: str(nvl_size)} if nvl_size else {}


_env_lock = threading.Lock()
_queue: Any = None  # the parent's queue, set in each rank
_rank: int = -1
_progress_file: str | None = None


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback as the cause of the re-raised exception."""

    def __str__(self) -> str:
        return self.args[0]


class DistributedTestFailure(AssertionError):
    """A rank failed in a way that cannot be re-raised as its own exception, or ranks hung or died."""


# ---------------------------------------------------------------------------------------- inside a rank
def device() -> torch.device:
    """The device of this rank's tensors: cuda:rank under NCCL, else CPU."""
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def case(label: str):
    """Label a sub-case: reported to the parent (a hang names it) and noted on any exception raised inside."""
    if _queue is not None:
        _queue.put(("progress", _rank, label))  # asynchronous: timing only
    if _progress_file is not None:  # synchronous: survives a rank that dies or hangs right after
        with open(_progress_file, "w") as f:
            f.write(label)
    try:
        yield
    except BaseException as exc:  # pytest's outcomes (a failing pytest.raises) are BaseExceptions
        if hasattr(exc, "add_note"):
            exc.add_note(f"[rank {_rank}] in case: {label}")
        raise


def _worker(fn: Callable, rank: int, world_size: int, backend: str, store_path: str, timeout_s: float,
            args: tuple, q: Any) -> None:
    global _queue, _rank, _progress_file
    _queue, _rank, _progress_file = q, rank, f"{store_path}.progress.{rank}"
    import faulthandler
    faulthandler.enable(all_threads=True)  # a rank killed by a signal still prints where it was (stderr)
    import torch.distributed as dist
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        result = fn(rank, world_size, *args)
        try:
            payload = pickle.dumps(result)
        except Exception as exc:
            raise TypeError(f"rank {rank}: the return value of {fn.__name__} cannot be pickled: {exc}") from exc
        q.put(("ok", rank, payload))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        tb = "".join(traceback.format_exception(exc))
        try:
            blob = pickle.dumps(exc)
            pickle.loads(blob)
        except Exception:  # noqa: BLE001 - e.g. pytest's Failed: re-raised as text
            blob = None
        q.put(("err", rank, blob, tb, "".join(traceback.format_exception_only(exc)).strip()))
    finally:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
    # Skip the interpreter's slow teardown (torch, CUDA): flush what the parent must see, then leave.
    q.close()
    q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------------- the parent
def run_distributed(fn: Callable, world_size: int, *args: Any, backend: str = "gloo",
                    env: dict[str, str] | None = None, timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` spawned ranks; return the ranks' results in rank order.

    fn must be importable (a module-level function) and its arguments and result picklable (move CUDA
    tensors to CPU before returning them). backend: "gloo" (CPU) or "nccl" (rank r on cuda:r, every GPU
    visible). env: extra environment variables for the ranks. timeout: seconds for the whole world.
    """
    __tracebackhide__ = True  # pytest shows the rank's traceback (the cause), not this function
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="moe_dist_")
    store_path = os.path.join(tmpdir, "store")
    child_env = dict(CHILD_ENV)
    child_env.update(env or {})
    pg_timeout = max(timeout - 15.0, 10.0)  # collectives time out (with a traceback) before the hard kill
    procs = []
    with _env_lock:  # spawn copies os.environ at start(): set the children's env around it
        saved = {k: os.environ.get(k) for k in child_env}
        os.environ.update(child_env)
        try:
            for rank in range(world_size):
                p = ctx.Process(target=_worker, name=f"rank{rank}",
                                args=(fn, rank, world_size, backend, store_path, pg_timeout, args, q), daemon=True)
                p.start()
                procs.append(p)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    results: dict[int, Any] = {}
    errors: dict[int, tuple] = {}  # rank -> (exception or None, traceback, summary), in arrival order
    progress: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    first_error_at: float | None = None
    timeline: list[tuple] = [(time.monotonic(), "(spawn and init)")]
    try:
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            if first_error_at is not None and now > first_error_at + GRACE_SECONDS:
                break
            if now > deadline:
                break
            try:
                msg = q.get(timeout=0.2)
            except queue_mod.Empty:
                # a rank that died without reporting (segfault, os._exit) never will
                for rank, p in enumerate(procs):
                    if rank in results or rank in errors or p.is_alive():
                        continue
                    with contextlib.suppress(queue_mod.Empty):  # its last message may still be in flight
                        msg = q.get(timeout=1.0)
                        break
                    errors[rank] = (None, "", f"exited with code {p.exitcode} without reporting")
                    first_error_at = first_error_at or time.monotonic()
                else:
                    continue
            kind, rank = msg[0], msg[1]
            if kind == "progress":
                progress[rank] = msg[2]
                if rank == 0 and PROFILE:
                    timeline.append((time.monotonic(), msg[2]))
            elif kind == "ok":
                results[rank] = pickle.loads(msg[2])
            else:
                errors[rank] = (pickle.loads(msg[2]) if msg[2] is not None else None, msg[3], msg[4])
                first_error_at = first_error_at or time.monotonic()
    finally:
        for rank in range(world_size):
            with contextlib.suppress(OSError), open(f"{store_path}.progress.{rank}") as f:
                progress[rank] = f.read()
        for p in procs:
            p.join(timeout=2.0 if not errors and len(results) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        q.close()
        shutil.rmtree(tmpdir, ignore_errors=True)

    if PROFILE:
        timeline.append((time.monotonic(), "(end)"))
        spans = sorted(((b[0] - a[0], a[1]) for a, b in itertools.pairwise(timeline)), reverse=True)
        print(f"\n{fn.__name__} x{world_size}: " + "; ".join(f"{d:.2f}s {label}" for d, label in spans[:8]),
              file=sys.stderr)
    missing = [r for r in range(world_size) if r not in results and r not in errors]
    hang_note = ""
    if missing:
        last = ", ".join(f"rank {r}: {progress.get(r, '(no case entered)')}" for r in missing)
        hang_note = (f"ranks {missing} did not finish "
                     f"{'after another rank failed' if errors else f'within {timeout:.0f} s'}; last cases: {last}")
    if errors:
        rank = next(iter(errors))  # the first failure to arrive: later ones are usually its consequences
        exc, tb, summary = errors[rank]
        if not tb:  # a rank that died: name its last case
            summary += f" (last case: {progress.get(rank, '(none entered)')})"
        others = [r for r in errors if r != rank]
        header = f"rank {rank} of {world_size} ({backend}) failed"
        if others:
            header += f"; ranks {others} failed too"
        if hang_note:
            header += f"; {hang_note}"
        remote = RemoteTraceback(f"{header}\n\n{tb}")
        if exc is None:
            raise DistributedTestFailure(f"{header}: {summary}\n{tb}")
        if hasattr(exc, "add_note"):
            exc.add_note(header)
        raise exc from remote
    if missing:
        raise DistributedTestFailure(hang_note)
    return [results[r] for r in range(world_size)]


# --------------------------------------------------------------------------------------- check helpers
def _describe_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str:
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, e = a.view(torch.uint8), e.view(torch.uint8)
    if a.is_floating_point() or a.dtype == torch.bfloat16:
        diff = ~((a == e) | (torch.isnan(a) & torch.isnan(e)))
    else:
        diff = a != e
    where = diff.nonzero()
    first = tuple(where[0].tolist()) if where.numel() else None
    text = f"{int(diff.sum())} of {a.numel()} elements differ"
    if first is not None:
        text += f"; first at {first}: got {a[first].item()} expected {e[first].item()}"
    return text


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_equal(actual: Any, expected: Any, what: str, *, bitwise: bool = False) -> None:
    """Exact equality of tensors (NaN equals NaN; FP8 compared as bytes), tuples, lists and scalars.

    bitwise=True compares floating tensors bit for bit (NaN payloads, -0.0): for copies of data."""
    if isinstance(expected, (tuple, list)) and not isinstance(expected, torch.Size):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            raise AssertionError(f"{what}: expected a sequence of {len(expected)}, got {_short(actual)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_equal(a, e, f"{what}[{i}]", bitwise=bitwise)
        return
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{what}: expected a tensor, got {_short(actual)}")  # noqa: TRY004
        if actual.dtype != expected.dtype or tuple(actual.shape) != tuple(expected.shape):
            raise AssertionError(f"{what}: got {actual.dtype}{list(actual.shape)}, "
                                 f"expected {expected.dtype}{list(expected.shape)}")
        a, e = actual.detach().cpu(), expected.detach().cpu()
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or (bitwise and a.is_floating_point()):
            as_int = _SAME_SIZE_INT[a.element_size()]
            a, e = a.contiguous().view(as_int), e.contiguous().view(as_int)
        same = (a == e)
        if a.is_floating_point():
            same |= torch.isnan(a) & torch.isnan(e)
        if not bool(same.all()):
            raise AssertionError(f"{what}: {_describe_mismatch(a, e)}{' (bit patterns)' if bitwise else ''}")
        return
    if actual != expected:
        raise AssertionError(f"{what}: got {_short(actual)}, expected {_short(expected)}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, *, rtol: float, atol: float) -> None:
    if not isinstance(actual, torch.Tensor) or tuple(actual.shape) != tuple(expected.shape) \
            or actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: got {_short(actual)}, expected {expected.dtype}{list(expected.shape)}")
    try:
        torch.testing.assert_close(actual.detach().cpu(), expected.detach().cpu(), rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}") from None


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor {v.dtype}{list(v.shape)}"
    text = repr(v)
    return text if len(text) < 200 else text[:200] + "..."


# ------------------------------------------------------------------------------ moe_dispatcher helpers
def make_buffer(*, hidden_bytes: int = 0, low_latency: bool = False, max_tokens: int = 0, hidden: int = 0,
                num_experts: int = 0, group: Any = None, **kwargs: Any):
    """A Buffer for this rank's world, sized like DeepEP's tests size theirs.

    Normal mode: NVLink/RDMA bytes from the tuned configs for rows of `hidden_bytes` (RDMA bytes for the NVLink
    domains of `topology=` when given, else of MOE_DISPATCHER_NVL_SIZE / the default). Low-latency mode:
    num_rdma_bytes from get_low_latency_rdma_size_hint(max_tokens, hidden, R, num_experts)."""
    import torch.distributed as dist

    from moe_dispatcher import Buffer
    num_ranks = dist.get_world_size(group)
    topology = kwargs.get("topology")  # a given topology's NVLink domains size the RDMA buffer
    nvl_size = topology.nvl_size if topology is not None else None
    nvl = rdma = 0
    if hidden_bytes:
        for cfg in (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)):
            nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
            rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, nvl_size))
    if low_latency:
        rdma = max(rdma, Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, num_ranks, num_experts))
    return Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=low_latency, **kwargs)


def make_low_latency_buffer(cases: list[dict], num_ranks: int):
    """A low-latency Buffer sized for every case of `cases` (dicts with "maxT" tokens, "H" hidden, "L" local
    experts)."""
    return make_buffer(low_latency=True, max_tokens=max(c["maxT"] for c in cases),
                       hidden=max(c["H"] for c in cases), num_experts=num_ranks * max(c["L"] for c in cases))


def per_rank(values: list[int], num_ranks: int) -> list[int]:
    """values cycled to one entry per rank (cases are written for 4 ranks and reused for 2)."""
    return [values[r % len(values)] for r in range(num_ranks)]


def fill_pool(pool, streams) -> list:
    """Allocate a PeerPool until nothing fits, on each of `streams` (torch.cuda.Stream; the caller's and the
    Buffer's comm stream): the tensors, to be dropped to give the room back. Torch's caching allocator ties a freed
    block to the stream it was allocated on and keeps a live pool's freed segments (it cannot hand them back to the
    region), so a block a dispatch freed on the comm stream can serve the next dispatch there although allocations
    on another stream find the pool full: filling it from one stream only does not fill it. On each stream the
    region's largest free range first as one block, then 64, 16, 4, 1 MiB blocks until each fails."""
    hog = []
    for stream in streams:
        with torch.cuda.stream(stream):
            if pool.stats()["largest_free"] >= (2 << 20):
                hog.append(pool.allocate((pool.stats()["largest_free"] >> 21 << 21,), torch.uint8))
            for mib in (64, 16, 4, 1):
                while True:
                    try:
                        hog.append(pool.allocate((mib << 20,), torch.uint8))
                    except torch.OutOfMemoryError:
                        break
    return hog
