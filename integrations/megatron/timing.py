"""Time spent in the dispatcher's communication, forward and backward (off unless enabled).

Forward calls are timed around the Buffer call. Backward calls run inside autograd, so the dispatcher
brackets each communication op with two identity autograd nodes: the one on the op's outputs runs its
backward first (all output grads ready: the op's backward starts), the one on its inputs runs last (the
op's backward is done). On CUDA the marks are events on the current stream, read at `summary()`.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


def _mark(device: torch.device):
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed(start, end) -> float:
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3


class CommTimer:
    """Accumulates seconds per name: "dispatch", "combine", "dispatch.backward", "combine.backward"."""

    def __init__(self) -> None:
        self.enabled = False
        self._spans: list[tuple[str, object, object]] = []
        self._open: dict[str, object] = {}

    def enable(self, on: bool = True) -> None:
        self.enabled = on

    @contextmanager
    def forward(self, name: str, device: torch.device):
        if not self.enabled:
            yield
            return
        start = _mark(device)
        yield
        self._spans.append((name, start, _mark(device)))

    def backward_end(self, name: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Wrap the op's inputs: their backward node runs when the op's backward has finished."""
        if not self.enabled or not any(t.requires_grad for t in tensors):
            return tensors
        return _BackwardMark.apply(self, name + ".backward", False, *tensors)

    def backward_start(self, name: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Wrap the op's outputs: their backward node runs when the op's backward is about to start."""
        if not self.enabled or not any(t.requires_grad for t in tensors):
            return tensors
        return _BackwardMark.apply(self, name + ".backward", True, *tensors)

    def _backward_mark(self, name: str, is_start: bool, device: torch.device) -> None:
        mark = _mark(device)
        if is_start:
            self._open[name] = mark
        elif name in self._open:
            self._spans.append((name, self._open.pop(name), mark))

    def summary(self, reset: bool = True) -> dict[str, float]:
        """Seconds per name since the last reset (synchronises CUDA)."""
        if any(not isinstance(s, float) for _, s, _ in self._spans) and torch.cuda.is_available():
            torch.cuda.synchronize()
        totals: dict[str, float] = defaultdict(float)
        for name, start, end in self._spans:
            totals[name] += _elapsed(start, end)
        if reset:
            self._spans.clear()
        return dict(totals)


class _BackwardMark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, timer: CommTimer, name: str, is_start: bool, *tensors: torch.Tensor):
        ctx.timer, ctx.name, ctx.is_start, ctx.device = timer, name, is_start, tensors[0].device
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.timer._backward_mark(ctx.name, ctx.is_start, ctx.device)
        return (None, None, None, *grads)


comm_timer = CommTimer()
