"""Timing and cross-rank statistics.

GPU: each timed call is bracketed by a pair of CUDA events on the current stream (our calls make the current
stream wait for the comm stream before they return, so the events cover the whole exchange), after a
warm-up, a device synchronize and a group barrier so every rank starts together. CPU (gloo): time.perf_counter
around each call (gloo collectives are synchronous). Each rank keeps its own per-call times; `gather`
brings a summary of every rank to every rank, so tables can show min/mean/max over ranks (rank 0 alone may
mislead when ranks wait for each other differently).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(device: torch.device, group=None) -> None:
    sync(device)
    dist.barrier(group=group)
    sync(device)


# The host may run at most this many calls ahead of the device while timing: the outputs the calls allocate
# are then recycled by the caching allocator from the warm-up's blocks (no cudaMalloc inside the timed loop
# when the warm-up has at least RUN_AHEAD + 1 calls), and the device still has work queued while the host
# waits, so no idle gap is timed.
RUN_AHEAD = 8


def time_calls(fn: Callable[[int], Any], iters: int, warmup: int, device: torch.device, group=None) -> List[float]:
    """Seconds of each of `iters` calls fn(i) after `warmup` calls (i counts on from the warm-up ones)."""
    for i in range(warmup):
        fn(i)
    barrier(device, group)
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            if i >= RUN_AHEAD:
                ends[i - RUN_AHEAD].synchronize()
            starts[i].record()
            fn(warmup + i)
            ends[i].record()
        sync(device)
        return [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)]
    out = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(warmup + i)
        out.append(time.perf_counter() - t0)
    return out


def time_graph_replays(graph, iters: int, warmup: int, device: torch.device, group=None) -> List[float]:
    """Seconds of each replay of a captured CUDA graph (collective: every rank replays its own)."""
    return time_calls(lambda i: graph.replay(), iters, warmup, device, group)


def host_overhead(fn: Callable[[int], Any], iters: int, warmup: int, device: torch.device, group=None) -> List[float]:
    """CPU seconds of each call fn(i), measured with perf_counter around the Python call only: the device is
    synchronised before each call (outside the measured span), so the call never waits for earlier work and
    the span is the host cost of validating, allocating and launching."""
    for i in range(warmup):
        fn(i)
    barrier(device, group)
    out = []
    for i in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn(warmup + i)
        out.append(time.perf_counter() - t0)
    sync(device)
    return out


def summary(times_s: Sequence[float]) -> Dict[str, float]:
    """Per-rank summary of per-call times, in microseconds."""
    us = [t * 1e6 for t in times_s]
    return {"mean": statistics.fmean(us), "median": statistics.median(us), "min": min(us), "max": max(us),
            "n": len(us)}


def gather(obj: Any, group=None) -> List[Any]:
    """obj of every rank, in rank order, on every rank."""
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def across(values: Sequence[float]) -> Dict[str, float]:
    """min / mean / max over ranks."""
    vals = [float(v) for v in values]
    return {"min": min(vals), "mean": statistics.fmean(vals), "max": max(vals)}


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / 1e9 / seconds if seconds > 0 else float("nan")


def rotation(bytes_per_copy: int, device: torch.device, cap: int = 32) -> int:
    """How many copies of an input to rotate through so the L2 cache cannot serve them from the previous call:
    enough copies to cover 3x the L2 (at least 2, at most `cap`)."""
    if device.type != "cuda" or bytes_per_copy <= 0:
        return 2
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20)
    return int(min(cap, max(2, math.ceil(3 * l2 / bytes_per_copy))))


def try_capture(body: Callable[[], Any], device: torch.device, group=None) -> tuple:
    """Capture body() in a CUDA graph on every rank. Returns (graph or None, reason). The graph is used only
    if every rank captured it (replays are collective), so the verdict is agreed over the group."""
    graph: Optional[torch.cuda.CUDAGraph] = None
    reason = ""
    if device.type != "cuda":
        reason = "no CUDA device"
    else:
        try:
            sync(device)
            g = torch.cuda.CUDAGraph()
            # thread_local: other threads' CUDA calls (NCCL's watchdog) must not invalidate the capture
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                body()
            sync(device)
            graph = g
        except Exception as exc:  # noqa: BLE001 - any failure means "not capturable"; reported, not raised
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            try:
                sync(device)
            except Exception:  # noqa: BLE001
                pass
    verdicts = gather(reason, group)
    bad = [(r, v) for r, v in enumerate(verdicts) if v]
    if bad:
        return None, "; ".join(f"rank {r}: {v}" for r, v in bad[:2])
    return graph, ""
