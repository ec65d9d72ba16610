"""Where a training step's time goes, from torch.profiler: router, dispatch, permute, experts, combine, rest.

``StepProfile(model)`` marks, in every MoE layer of the model, the work of each part, forward and backward,
as a profiler range named ``moe.<part>``:

  router    the router module (gating GEMM, top-k, aux losses)
  dispatch  token_dispatcher.token_dispatch (the exchange on the way in; ours includes its expert-major
            permutation, which it does inside the exchange)
  permute   dispatch_preprocess, dispatch_postprocess, combine_preprocess, combine_postprocess (the
            dispatchers' own permutations and layout work outside the exchange)
  experts   the experts module
  combine   token_combine (the exchange on the way back)

Forward ranges bracket the call. Backward ranges are opened by an identity autograd node on the call's
outputs (its backward runs when all their gradients are ready: the call's backward begins) and closed by
one on its inputs (its backward runs when their gradients are done), on the autograd thread that runs
both. Only calls whose inputs and outputs take part in autograd get a backward range.

``with profile.steps(): ...`` profiles the steps run inside; ``breakdown()`` then charges every GPU kernel
(CPU: every op's own CPU time) to the innermost ``moe.*`` range its launch sits in, and everything else
to "rest" (attention, dense layers, loss, gradient reduction, optimizer). Kernel times on concurrent
streams add up, so the parts can sum to more than the step's wall time. ``gpu_busy()`` says how much of the
wall time the GPU ran anything; ``exposed_dispatcher()`` how much of the MoE layers' GPU time the dispatcher's
kernels run with no other kernel beside them; ``host_breakdown()`` the host's wall time inside each part.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict

import torch

PARTS = ("router", "dispatch", "permute", "experts", "combine", "rest")
DISPATCHER_PARTS = ("dispatch", "permute", "combine")  # the token dispatcher's own work
_DISPATCHER_PARTS = {"dispatch_preprocess": "permute", "token_dispatch": "dispatch", "dispatch_postprocess": "permute",
                     "combine_preprocess": "permute", "token_combine": "combine", "combine_postprocess": "permute"}


class _Range:
    """A profiler range opened in one place and closed in another (same thread)."""

    def __init__(self, name: str) -> None:
        self.name, self.handle = name, None

    def open(self) -> None:
        self.handle = torch.ops.profiler._record_function_enter_new(self.name, None)

    def close(self) -> None:
        if self.handle is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(self.handle)
            self.handle = None


class _Mark(torch.autograd.Function):
    """Identity on tensors; its backward opens (is_open) or closes the shared range."""

    @staticmethod
    def forward(ctx, span: _Range, is_open: bool, *tensors: torch.Tensor):
        ctx.span, ctx.is_open = span, is_open
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.span.open() if ctx.is_open else ctx.span.close()
        return (None, None, *grads)


def _mark(span: _Range, is_open: bool, values):
    """Pass `values` (a tensor, or a tuple/list holding tensors) through a _Mark; others unchanged."""
    single = isinstance(values, torch.Tensor)
    items = [values] if single else list(values)
    where = [i for i, v in enumerate(items) if isinstance(v, torch.Tensor) and v.requires_grad]
    if not where:
        return values
    marked = _Mark.apply(span, is_open, *[items[i] for i in where])
    for i, t in zip(where, marked):
        items[i] = t
    return items[0] if single else type(values)(items)


def _differentiable(values) -> bool:
    items = [values] if isinstance(values, torch.Tensor) else values if isinstance(values, (tuple, list)) else []
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in items)


def _wrap(fn, part: str):
    """fn(*args) inside a forward range moe.<part>; its backward inside moe.<part>.backward."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if not torch.autograd.profiler._is_profiler_enabled:
            return fn(*args, **kwargs)
        span = _Range(f"moe.{part}.backward")
        grad_in = torch.is_grad_enabled() and _differentiable(args)
        if grad_in:
            args = _mark(span, False, args)
        with torch.profiler.record_function(f"moe.{part}"):
            out = fn(*args, **kwargs)
        if grad_in and _differentiable(out):
            out = _mark(span, True, out)
        return out

    return wrapped


class StepProfile:
    """Profiler ranges on every MoE layer of `model` (module docstring) and the step breakdown."""

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        for layer in self.layers:
            for module, part in ((layer.router, "router"), (layer.experts, "experts")):
                module.forward = _wrap(module.forward, part)
            dispatcher = layer.token_dispatcher
            for method, part in _DISPATCHER_PARTS.items():
                setattr(dispatcher, method, _wrap(getattr(dispatcher, method), part))
        self.profiler: torch.profiler.profile | None = None
        self.num_steps, self.wall_s = 0, 0.0

    @contextlib.contextmanager
    def steps(self, num_steps: int):
        """Profile what runs inside as `num_steps` training steps."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.num_steps = num_steps
        with torch.profiler.profile(activities=activities) as prof:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            yield
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.wall_s = time.perf_counter() - start
        self.profiler = prof

    def _charged(self):
        """(part, kernel or op name, microseconds) for every GPU kernel (CPU: op) of the profiled steps."""
        on_gpu = torch.cuda.is_available()
        for event in self.profiler.events():
            if on_gpu:
                for kernel in event.kernels:
                    if kernel.duration:
                        yield _part_of(event), kernel.name, kernel.duration
            elif event.device_type == torch.autograd.DeviceType.CPU and event.self_cpu_time_total:
                yield _part_of(event), event.name, event.self_cpu_time_total

    def breakdown(self) -> dict[str, float]:
        """Milliseconds per step charged to each of PARTS (module docstring)."""
        if self.profiler is None or not self.num_steps:
            return {}
        totals: dict[str, float] = defaultdict(float)
        for part, _, us in self._charged():
            totals[part] += us
        return {part: totals.get(part, 0.0) / 1e3 / self.num_steps for part in PARTS}

    def gpu_busy(self) -> dict[str, float]:
        """How much of the profiled steps' wall time the GPU ran anything (on this rank): wall_ms and busy_ms per
        step (the union of every kernel's and copy's interval, all streams) and busy_fraction. A step whose GPU
        idles much of the time is bound by the host (launches, host syncs), where faster kernels do not show.
        {} on CPU. The profiler's own host overhead makes the fraction a lower bound."""
        if self.profiler is None or not self.num_steps or not torch.cuda.is_available() or not self.wall_s:
            return {}
        spans = [(e.time_range.start, e.time_range.end) for e in self.profiler.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
                 and not getattr(e, "is_user_annotation", False)]  # a range's GPU-side span is not work
        if not spans:  # no device events recorded: no figure rather than a false 0%
            return {}
        busy = covered(spans)
        wall_ms = 1e3 * self.wall_s / self.num_steps
        busy_ms = busy / 1e3 / self.num_steps
        return {"wall_ms": round(wall_ms, 2), "busy_ms": round(busy_ms, 2),
                "busy_fraction": round(busy_ms / wall_ms, 3) if wall_ms else 0.0}

    def host_breakdown(self) -> dict[str, float]:
        """Milliseconds per step the host spends inside each MoE part's ranges (their CPU wall time, forward and
        backward, nested ranges counted once, host syncs included: a part that waits for the GPU on the host shows
        it here), for router, dispatch, permute, experts and combine; {} when nothing was profiled. With the GPU
        idle part of the step (gpu_busy), it says which part keeps the host from running ahead."""
        if self.profiler is None or not self.num_steps:
            return {}
        cpu = torch.autograd.DeviceType.CPU
        spans: dict[str, list] = defaultdict(list)
        for e in self.profiler.events():
            if e.device_type == cpu and e.name.startswith("moe.") and e.time_range.end > e.time_range.start:
                part = e.name[4:].split(".")[0]
                if part in PARTS and part != "rest":
                    spans[part].append((e.time_range.start, e.time_range.end))
        return {part: round(covered(spans[part]) / 1e3 / self.num_steps, 3) for part in PARTS if part != "rest"}

    def _device_spans(self):
        """(part, start_us, end_us) of every device event (kernel, copy, memset) of the profiled steps; its part is
        that of the CPU op that launched it, found as torch links kernels to ops: the raw profiler event of a
        kernel carries the correlation id of its launching frontend op (linked_correlation_id), and that op's
        FunctionEvent carries the same id and the kernels linked to it. CUDA runtime events (cudaLaunchKernel)
        are CPU events too, with ids from another counter that can collide with an op's, but torch links no
        kernel to them, so only ops with kernels are candidates. The raw events are read because FunctionEvent
        has no linked_correlation_id before torch 2.13. Part None: no launching op recorded (a launch outside
        any op). GPU-side user-annotation spans (first to last kernel of a range) are not device work and are
        left out."""
        cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
        ops = {e.id: e for e in self.profiler.events()
               if e.device_type == cpu and not getattr(e, "is_async", False) and e.kernels}
        for k in self.profiler.profiler.kineto_results.events():
            if k.device_type() == cuda and k.end_ns() > k.start_ns() and not k.is_user_annotation():
                op = ops.get(k.linked_correlation_id())
                yield (_part_of(op) if op is not None else None), k.start_ns() / 1e3, k.end_ns() / 1e3

    def exposed_dispatcher(self) -> dict[str, float]:
        """How much of the MoE layers' GPU time the dispatcher leaves exposed (on this rank), per step:
        dispatcher_ms (the union of the intervals of the dispatcher's kernels: DISPATCHER_PARTS, forward and
        backward), exposed_ms (the part of it in which no other kernel runs: nothing hides it), moe_layer_ms (the
        union over every MoE part: router, dispatcher, experts), exposed_fraction = exposed / moe_layer, and
        unlinked_ms (the union of device events no launching op was recorded for: counted in neither set, so
        a large value makes the figures uncertain). {} on CPU or when no device event was recorded."""
        if self.profiler is None or not self.num_steps or not torch.cuda.is_available():
            return {}
        return exposed_share(list(self._device_spans()), self.num_steps)

    def top_kernels(self, top: int = 8) -> dict[str, list[tuple[str, float, float, float]]]:
        """Per part, its `top` costliest kernels (CPU: ops), costliest first, as (name cut to 100 characters, ms
        per step, launches per step, the longest launch's ms). A kernel whose longest launch is many times its
        mean (ms per step / launches per step) spends most of its time in a few launches: for a kernel that waits
        for its peers, the ranks' skew at those calls rather than its own work."""
        if self.profiler is None or not self.num_steps:
            return {}
        totals: dict[tuple[str, str], float] = defaultdict(float)
        counts: dict[tuple[str, str], int] = defaultdict(int)
        longest: dict[tuple[str, str], float] = defaultdict(float)
        for part, name, us in self._charged():
            key = part, name[:100]
            totals[key] += us
            counts[key] += 1
            longest[key] = max(longest[key], us)
        out: dict[str, list[tuple[str, float, float, float]]] = {part: [] for part in PARTS}
        for (part, name), us in sorted(totals.items(), key=lambda item: -item[1]):
            if len(out[part]) < top:
                key = part, name
                out[part].append((name, round(us / 1e3 / self.num_steps, 3), round(counts[key] / self.num_steps, 2),
                                  round(longest[key] / 1e3, 3)))
        return out


def _part_of(event) -> str:
    """The part of the innermost moe.* range around a profiler event (itself included), else "rest"."""
    while event is not None:
        name = event.name
        if name.startswith("moe."):
            part = name[4:].split(".")[0]
            if part in PARTS:
                return part
        event = event.cpu_parent
    return "rest"


def exposed_share(spans, num_steps: int) -> dict[str, float]:
    """StepProfile.exposed_dispatcher from (part or None, start, end) intervals in microseconds over num_steps
    steps."""
    mine = [(lo, hi) for part, lo, hi in spans if part in DISPATCHER_PARTS]
    others = [(lo, hi) for part, lo, hi in spans if part is not None and part not in DISPATCHER_PARTS]
    layer = [(lo, hi) for part, lo, hi in spans if part is not None and part != "rest"]
    unlinked = [(lo, hi) for part, lo, hi in spans if part is None]
    if not spans or not layer:
        return {}
    dispatcher = covered(mine)
    # the dispatcher's time under no other kernel: its union minus its overlap with the others' union
    exposed = covered(mine + others) - covered(others)
    per_step = lambda us: round(us / 1e3 / num_steps, 3)  # noqa: E731
    return {"dispatcher_ms": per_step(dispatcher), "exposed_ms": per_step(exposed),
            "moe_layer_ms": per_step(covered(layer)), "exposed_fraction": round(exposed / covered(layer), 3),
            "unlinked_ms": per_step(covered(unlinked))}


def covered(spans) -> float:
    """The length of the union of (start, end) intervals (any order, overlapping or not)."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total
