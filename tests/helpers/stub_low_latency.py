"""A stand-in for the native low-latency runtime (_C.low_latency.LowLatencyRuntime) on a machine without GPUs.

StubRuntime has the runtime's methods and the same host-side rules (csrc/low_latency_bindings.cpp): the
invariant checks against a per-shape plan (ValueError), one buffer half per call alternating, the hook rules
(one call each, stale once its half was taken again, no shape change while one is pending), the layout change
(the backend's layout_round function called before and after the clear, as the native clean_layout calls it), the
timeout record (a test sets `timeout`; every later call and hook raises, and keeps raising), the signature record
(a test sets `signature` as a receive that found a source's dispatch signature differing would record it; every
later call and hook raises SignatureMismatch, before a timeout, and keeps raising), destroy. It
launches nothing: it records (kind, phases, half, shape) in `launches` and the plans it made in `plans`, and
allocates outputs on the CPU. attach_stub_low_latency() gives a Buffer the real LowLatencyBackend class
over it, serving CPU tensors, so tests/kernels/test_low_latency_host_cpu.py exercises the Buffer's low-latency glue
(first-call validation, the cached fast path, delegation) and tools/ll_host_cpu.py times it.
"""
from __future__ import annotations

import types
from typing import Callable, List, Optional

import torch

from moe_dispatcher.backend import Capabilities
from moe_dispatcher.compiled import kernel_timeout_s, timeout_message
from moe_dispatcher.compiled.low_latency import (_NO_EVENT, TIMEOUT_ENV, LowLatencyBackend, layout_round,
                                                 signature_mismatch)
from moe_dispatcher.event import EventOverlap
from moe_dispatcher.handle import LowLatencyHandle
from moe_dispatcher.runtime import ll_layout

MAX_HIDDEN, MAX_EXPERTS, MAX_TOPK = 16384, 1024, 32
PHASE_SEND, PHASE_RECV = 1, 2


class DispatchState:
    """The runtime's backend_state of a handle."""

    def __init__(self, owner, src_info, row_of, layout_range, max_tokens, hidden, num_experts, num_tokens, half):
        self.owner, self.src_info, self.row_of, self.layout_range = owner, src_info, row_of, layout_range
        self.max_tokens, self.hidden, self.num_experts, self.num_tokens, self.half = (max_tokens, hidden, num_experts,
                                                                                      num_tokens, half)


class StubRuntime:
    def __init__(self, num_bytes: int, num_ranks: int, rank_partials: bool = True, nvlink_all: bool = True,
                 timeout_s: float = 10.0, buffer_token: int = 0, board=None, rank: int = 0,
                 layout_round: Optional[Callable[[int, int, int, bool], None]] = None):
        self.num_bytes, self.num_ranks, self._rank_partials, self.nvlink_all = (num_bytes, num_ranks, rank_partials,
                                                                                nvlink_all)
        self.timeout_s, self.buffer_token = timeout_s, buffer_token
        self.num_blocks = 132
        self.launches: List[tuple] = []
        self.plans: List[tuple] = []
        self.cleans: List[tuple] = []
        self.timeout: Optional[tuple] = None  # (status, phase, rank, peer), as the kernels would record it
        self.signature: Optional[tuple] = None  # (call, source, seen, mine), as the dispatch receive would record it
        self.rank = rank
        self.board = board  # the Buffer's Board: the message of a peer's abort
        # The backend's round of a layout change (compiled/low_latency.py, layout_round); None: no peers to meet
        self._layout_round = layout_round
        # The peer abort: whether this PE's abort bytes are posted on its peers, and every write in order
        # (1: post_abort, 0: cleared by the next launch, as the native runtime's common() does).
        self.abort_posted = False
        self.abort_writes: List[int] = []
        self._broken: Optional[str] = None
        self._alive = True
        self._plans: dict = {}
        self._layout: Optional[tuple] = None
        self._next_half, self._calls, self._half_owner, self._pending = 0, 0, [0, 0], []

    # ---------------------------------------------------------------- the runtime's methods
    def dispatch(self, x, topk_idx, max_tokens, num_experts, cum_stats, wait_stats, use_fp8, round_scale, use_ue8m0,
                 async_finish, return_recv_hook):
        self.check_usable()
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set")
        _check(x, "x", torch.bfloat16)
        _check(topk_idx, "topk_idx", torch.int64)
        if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
            raise ValueError("low-latency dispatch: x must be [T, H] and topk_idx [T, K]")
        t, h = x.shape
        if t > max_tokens:
            raise ValueError(f"low-latency dispatch: x has {t} tokens, more than num_max_dispatch_tokens_per_rank")
        plan = self._plan(max_tokens, h, num_experts, topk_idx.shape[1])
        local, rows = plan["local"], plan["rows"]
        if cum_stats is not None:
            _check(cum_stats, "cumulative_local_expert_recv_stats", torch.int32, (local,))
        if wait_stats is not None:
            _check(wait_stats, "dispatch_wait_recv_cost_stats", torch.int64, (self.num_ranks,))
        half = self._start_call()
        if use_fp8:
            groups = h // 512 if use_ue8m0 else h // 128
            sdtype = torch.int32 if use_ue8m0 else torch.float32
            recv_x = (torch.empty(local, rows, h, dtype=torch.float8_e4m3fn),
                      torch.empty(local, groups, rows, dtype=sdtype).transpose(1, 2))
        else:
            recv_x = torch.empty(local, rows, h, dtype=torch.bfloat16)
        info = torch.empty(2, local, rows, dtype=torch.int32)
        layout_range = torch.empty(local, self.num_ranks, dtype=torch.int64)
        state = DispatchState(self, info[0], info[1], layout_range, max_tokens, h, num_experts, t, half)
        handle = LowLatencyHandle(info[0], layout_range, max_tokens, h, num_experts, "low_latency", self.buffer_token,
                                  state, t)
        event, hook = self._launch("dispatch", half, plan, async_finish, return_recv_hook, [x, topk_idx, info])
        return recv_x, torch.empty(local, dtype=torch.int32), handle, event, hook

    def combine(self, x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook, out, wait_stats):
        self.check_usable()
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set")
        s = self._state_of(handle)
        _check(topk_idx, "topk_idx", torch.int64)
        _check(topk_weights, "topk_weights", torch.float32)
        if topk_idx.dim() != 2 or topk_idx.shape[0] != s.num_tokens:
            raise ValueError("low_latency_combine: topk_idx must be [T, K] with the T of the handle's dispatch")
        _check(topk_weights, "topk_weights", torch.float32, tuple(topk_idx.shape))
        plan = self._plan(s.max_tokens, s.hidden, s.num_experts, topk_idx.shape[1])
        _check(x, "x", torch.bfloat16, (plan["local"], plan["rows"], s.hidden))
        if out is not None:
            _check(out, "out", torch.bfloat16, (s.num_tokens, s.hidden))
        if wait_stats is not None:
            _check(wait_stats, "combine_wait_recv_cost_stats", torch.int64, (self.num_ranks,))
        half = self._start_call()
        result = out if out is not None else torch.empty(s.num_tokens, s.hidden, dtype=torch.bfloat16)
        event, hook = self._launch("combine", half, plan, async_finish, return_recv_hook, [x, topk_idx, result])
        return result, event, hook

    def next_combine_buffer(self, handle):
        self.check_usable()
        s = self._state_of(handle)
        plan = self._plan(s.max_tokens, s.hidden, s.num_experts, 1, clean_on_change=False)
        return torch.zeros(plan["local"], plan["rows"], s.hidden, dtype=torch.bfloat16)

    def clean(self, max_tokens, hidden, num_experts):
        self.check_usable()
        self._plan(max_tokens, hidden, num_experts, 1, clean_on_change=False)
        self._clean_layout((max_tokens, hidden, num_experts))

    def set_rank_partials(self, value: bool) -> None:
        self._rank_partials = bool(value)

    @property
    def rank_partials(self) -> bool:
        return self._rank_partials

    def timeout_info(self):
        return self.timeout

    def signature_info(self):
        return self.signature

    def check_usable(self) -> None:
        if self.signature is not None:
            raise signature_mismatch(self.signature, self.rank)
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if not self._alive:
            raise RuntimeError("the low-latency backend was destroyed")
        if self.timeout is not None:
            self._broken = timeout_message("low-latency", self.timeout, self.timeout_s, TIMEOUT_ENV, self.board)
            raise RuntimeError(self._broken)

    def destroy(self) -> None:
        self._alive = False

    def post_abort(self) -> None:
        if self._alive:
            self.abort_posted = True
            self.abort_writes.append(1)

    def _clear_abort_if_posted(self) -> None:
        if self.abort_posted:
            self.abort_posted = False
            self.abort_writes.append(0)

    def trace_last(self, kind: int):
        return None

    def kernels_for(self, max_tokens, hidden, num_experts):
        plan = self._plan(max_tokens, hidden, num_experts, 1, clean_on_change=False)
        return plan["dedup"], plan["per_rank_ok"] and self._rank_partials

    # ---------------------------------------------------------------- the rules
    def _plan(self, max_tokens, hidden, num_experts, num_topk, clean_on_change=True) -> dict:
        key = (max_tokens, hidden, num_experts, num_topk)
        plan = self._plans.get(key)
        if plan is None:
            if hidden % 128 or not 128 <= hidden <= MAX_HIDDEN:
                raise ValueError(f"the low-latency kernels take hidden sizes divisible by 128 up to {MAX_HIDDEN}")
            if num_experts % self.num_ranks or num_experts > MAX_EXPERTS:
                raise ValueError("the low-latency kernels take a multiple of the rank count")
            if not 1 <= num_topk <= MAX_TOPK:
                raise ValueError(f"the low-latency kernels take 1 to {MAX_TOPK} top-k slots")
            need = ll_layout.buffer_bytes(max_tokens, hidden, self.num_ranks, num_experts)
            if need > self.num_bytes:
                raise ValueError(f"num_rdma_bytes={self.num_bytes} is too small: get_low_latency_rdma_size_hint "
                                 f"gives {need}")
            local = num_experts // self.num_ranks
            plan = self._plans[key] = {"local": local, "rows": self.num_ranks * max_tokens,
                                       "dedup": self.nvlink_all and local >= 2,
                                       "per_rank_ok": self.nvlink_all and local >= 2}
            self.plans.append(key)
        layout = key[:3]
        if clean_on_change and self._layout != layout:
            if self._pending:
                raise RuntimeError("low-latency call with new (max tokens, hidden, experts) while a hook of a call "
                                   "with the previous shapes has not been called: call the hook first")
            if self._layout is not None:
                self._clean_layout(layout)
            self._layout = layout
        return plan

    def _clean_layout(self, layout: tuple) -> None:
        """The native clean_layout: a round, the clear (recorded in `cleans`), a round; then the new layout."""
        if self._layout_round is not None:
            self._layout_round(*layout, False)
        self.cleans.append(layout)
        if self._layout_round is not None:
            self._layout_round(*layout, True)
        self._layout = layout

    def _start_call(self) -> int:
        half = self._next_half
        self._next_half ^= 1
        self._calls += 1
        self._half_owner[half] = self._calls
        self._pending = [c for c in self._pending if c in self._half_owner]
        return half

    def _launch(self, kind, half, plan, async_finish, return_recv_hook, keep):
        self._clear_abort_if_posted()  # the native common() clears it before every launch
        shape = (kind, half, "dedup" if plan["dedup"] else "per_expert",
                 "per_rank" if plan["per_rank_ok"] and self._rank_partials else "per_expert")
        if return_recv_hook:
            self.launches.append((kind, PHASE_SEND, half, shape))
            call = self._calls
            self._pending.append(call)
            return _NO_EVENT, _Hook(self, kind, call, half, shape)
        self.launches.append((kind, PHASE_SEND | PHASE_RECV, half, shape))
        if async_finish:
            return EventOverlap(None, extra_tensors=keep), None
        return _NO_EVENT, None

    def _state_of(self, handle) -> DispatchState:
        state = handle.backend_state
        if not isinstance(state, DispatchState):
            raise TypeError("handle must be a LowLatencyHandle returned by this Buffer's low_latency_dispatch")
        if state.owner is not self:
            raise RuntimeError("handle was made by another Buffer")
        return state


class _Hook:
    def __init__(self, rt: StubRuntime, kind: str, call: int, half: int, shape: tuple):
        self.rt, self.kind, self.call, self.half, self.shape, self.done = rt, kind, call, half, shape, False

    def __call__(self) -> None:
        rt = self.rt
        rt.check_usable()
        if self.done:
            raise RuntimeError("this low-latency hook was already called")
        if rt._half_owner[self.half] != self.call:
            raise RuntimeError("stale low-latency hook: its buffer half was reused by a later call")
        rt.launches.append((self.kind, PHASE_RECV, self.half, self.shape))
        self.done = True
        rt._pending = [c for c in rt._pending if c != self.call]


def _check(t, name: str, dtype: torch.dtype, shape: Optional[tuple] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor")
    if t.dtype != dtype:
        raise ValueError(f"low-latency: {name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"low-latency: {name} must be contiguous")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"low-latency: {name} must have shape {list(shape)}, got {list(t.shape)}")


def attach_stub_low_latency(buf, runtime: Optional[StubRuntime] = None, make: Callable = StubRuntime):
    """Give `buf` (a Buffer(low_latency_mode=True) of a gloo group) the real LowLatencyBackend class over a stub
    runtime, serving CPU tensors (the Buffer then resolves CPU low-latency calls to it). Returns the backend."""
    b = object.__new__(LowLatencyBackend)
    b._mod = types.SimpleNamespace(MAX_RANKS=32, TRACE_MAX_BLOCKS=256)
    b.rank, b.num_ranks, b.num_bytes, b.timeout_s = buf.rank, buf.group_size, buf.num_rdma_bytes, kernel_timeout_s()
    b.capabilities = Capabilities(low_latency=True, devices=frozenset({"cpu", "cuda"}))
    b._trace, b._alive, b.nvlink_peers = None, True, buf.group_size
    # The layout change's rounds under the backend's timeout, as LowLatencyBackend makes them.
    rounds = layout_round(buf._board, torch.device("cpu"), b.timeout_s)
    b.runtime = runtime if runtime is not None else make(buf.num_rdma_bytes, buf.group_size,
                                                         buf.low_latency_combine_reduction == "per_rank",
                                                         timeout_s=b.timeout_s, buffer_token=buf._token,
                                                         board=buf._board, rank=buf.rank, layout_round=rounds)
    b.low_latency_dispatch = b.runtime.dispatch
    b.low_latency_combine = b.runtime.combine
    b._state = types.SimpleNamespace(release=lambda ptr, device: None)
    b._ptr, b.device = 0, torch.device("cpu")
    b._raw, b._raw_memory = None, lambda: None  # no buffer tensor: no view can be alive
    buf._kernels_ll, buf._kernels_ll_why = b, ""
    buf._resolved.clear()
    buf._ll_dispatch_runs.clear()
    buf._ll_combine_runs.clear()
    return b
