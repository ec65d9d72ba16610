"""Low-latency backend: dispatch and combine over NVSHMEM with the compiled kernels.

One LowLatencyBackend belongs to one Buffer(low_latency_mode=True). It brings NVSHMEM up over the Buffer's
group (moe_dispatcher.runtime.nvshmem), holds one symmetric allocation of num_rdma_bytes split into two
halves (the Buffer picks the half of each call), and launches the kernels of csrc/kernels/low_latency.
docs/low_latency.md describes the layout and the protocol. The combine's reduction order is the Buffer's
low_latency_combine_reduction (set_rank_partials): "per_rank" uses the per-rank combine kernels (variant bit 4),
which read the handle's row_of ([L, R*maxT] int32, written by the dispatch next to src_info).

Streams (DeepEP V1's semantics): kernels run on the current stream; with async_finish on the Buffer's comm
stream (after it waits for the current one), and an EventOverlap carries the event; with return_recv_hook
the send kernel runs now on the current stream and hook() enqueues the receive kernel on the stream current
at that time. Nothing here synchronises with the host, except when the (max_tokens, hidden, num_experts)
of a call differ from the previous call's: then the signal words of the new layout are cleared with NVSHMEM
barriers around (collective, like clean_low_latency_buffer), which must not happen inside a CUDA graph
capture (warm up with the same shapes first).
A wait longer than MOE_DISPATCHER_TIMEOUT_S seconds (default 10) in a kernel prints which rank waited for
which peer and traps (the CUDA context is lost; a peer that skipped a call is the usual cause).

Phase trace (diagnostics, docs/low_latency.md "Phase trace"): MOE_DISPATCHER_LL_TRACE=1 when the backend is
created makes it keep one device record per (kernel, buffer half) and pass it to every launch; the kernels then
stamp %globaltimer at their phase boundaries. `last_trace()` returns the last call's timeline,
`trace_record(kind, half)` the raw device record (tools/ll_trace.py copies those between calls).
"""
from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import _ext
from ..backend import Backend, Capabilities
from ..event import EventOverlap
from ..handle import LowLatencyHandle
from ..runtime import nvshmem
from . import buffer_view

TIMEOUT_ENV = "MOE_DISPATCHER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 10.0
# Kernel variants (bits, csrc/kernels/low_latency/low_latency.h), read when the backend is created; a variant
# changes what crosses NVLink, never the results, and all of them need NVLink to every peer (cleared otherwise).
#   2 = dedup dispatch: one message per (token, destination rank), expanded by the receiver (the default).
#   4 = per-rank combine: one partial row per (token, rank), summed by the experts' rank (the default). Used
#       only when the Buffer's combine reduction is "per_rank" (it computes that order); the per-expert
#       combine kernel computes either order.
# MOE_DISPATCHER_LL_DISPATCH=dedup|per_expert sets or clears bit 2, on top of MOE_DISPATCHER_LL_VARIANT.
VARIANT_ENV = "MOE_DISPATCHER_LL_VARIANT"
DISPATCH_ENV = "MOE_DISPATCHER_LL_DISPATCH"
VARIANT_DISPATCH_DEDUP = 2  # == low_latency.h
VARIANT_COMBINE_PER_RANK = 4  # == low_latency.h
DEFAULT_VARIANT = VARIANT_DISPATCH_DEDUP | VARIANT_COMBINE_PER_RANK
# Grid size override (tuning only): at most the SM count.
BLOCKS_ENV = "MOE_DISPATCHER_LL_BLOCKS"
# Phase trace (diagnostics): "1" when the backend is created turns the kernels' timestamps on.
TRACE_ENV = "MOE_DISPATCHER_LL_TRACE"
TRACE_KINDS = ("dispatch", "combine")  # first index of the trace records


def variant_from_env(env=os.environ) -> int:
    """Kernel variant bits from MOE_DISPATCHER_LL_VARIANT, then MOE_DISPATCHER_LL_DISPATCH."""
    value = env.get(VARIANT_ENV, "")
    variant = int(value) if value else DEFAULT_VARIANT
    value = env.get(DISPATCH_ENV, "")
    if value == "dedup":
        variant |= VARIANT_DISPATCH_DEDUP
    elif value == "per_expert":
        variant &= ~VARIANT_DISPATCH_DEDUP
    elif value:
        raise ValueError(f"{DISPATCH_ENV}={value!r}: expected 'dedup' or 'per_expert'")
    return variant


def variant_name(variant: int) -> str:
    """Readable name of variant bits: the dispatch's ('dedup' or 'per_expert'), then '+rank_combine' when the
    combine sends per-rank partial rows."""
    name = "dedup" if variant & VARIANT_DISPATCH_DEDUP else "per_expert"
    return name + ("+rank_combine" if variant & VARIANT_COMBINE_PER_RANK else "")


class LowLatencyState(NamedTuple):
    """backend_state of this backend's LowLatencyHandle: the buffer half of the dispatch, and row_of int32
    [L, R*maxT] ([l][s*maxT + t] = the row of source s's token t at local expert l, set for received pairs only:
    the per-rank combine's map from a source's routing to the rows)."""
    half: int
    row_of: torch.Tensor


class _Plan(NamedTuple):
    """What the calls of one (max tokens, hidden, experts, top-k, buffer half) share, checked once: the native
    launcher (its fixed fields checked when made) and the output shapes of a dispatch."""
    launcher: object
    local: int
    rows: int
    half: int


class _DeviceMemory:
    """A raw device range for torch.as_tensor (through __cuda_array_interface__); owns nothing."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class LowLatencyBackend(Backend):
    """Compiled low-latency backend of one Buffer (see the module docstring)."""

    name = "low_latency"
    capabilities = Capabilities(low_latency=True, devices=frozenset({"cuda"}))

    def __init__(self, buffer) -> None:
        mod = _ext.require("the low-latency kernels")
        self._mod = mod.low_latency
        self.rank, self.num_ranks = buffer.rank, buffer.group_size
        if self.num_ranks > self._mod.MAX_RANKS:
            raise ValueError(f"the low-latency kernels serve at most {self._mod.MAX_RANKS} ranks, the group has "
                             f"{self.num_ranks}")
        self.num_bytes = buffer.num_rdma_bytes
        self._buffer_token = buffer._token
        self._buffer_ref = weakref.ref(buffer)
        self.timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
        if self.timeout_s <= 0:
            raise ValueError(f"{TIMEOUT_ENV} must be positive, got {self.timeout_s}")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._state = nvshmem.bootstrap(buffer.group, self.device.index,
                                        single_host=buffer.topology.is_single_domain)
        try:
            self._ptr = self._state.malloc(self.num_bytes)
        except Exception:
            self._state.finalize()
            raise
        self._raw = torch.as_tensor(_DeviceMemory(self._ptr, self.num_bytes), device=self.device)
        self._raw.zero_()  # every signal word of every layout starts at 0
        peers = [self._state.peer_ptr(self._ptr, pe) if buffer.allow_nvlink_for_low_latency_mode else 0
                 for pe in range(self.num_ranks)]
        self.nvlink_peers = sum(1 for p in peers if p)
        self._peer_bases = torch.tensor(peers, dtype=torch.int64, device=self.device)
        self._workspace = torch.zeros(self._mod.WORKSPACE_INTS, dtype=torch.int32, device=self.device)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._num_blocks = sms
        if os.environ.get(BLOCKS_ENV):
            self._num_blocks = int(os.environ[BLOCKS_ENV])
            if not 1 <= self._num_blocks <= sms:
                raise ValueError(f"{BLOCKS_ENV} must be in [1, {sms}], got {self._num_blocks}")
        self._checked: set[tuple] = set()  # (maxT, hidden, experts, top-k) that passed check_shape
        # The combine's reduction order (Buffer.low_latency_combine_reduction): per-rank partials or not.
        self.rank_partials = getattr(buffer, "low_latency_combine_reduction", "per_rank") == "per_rank"
        self.variant = 0
        self.set_variant(variant_from_env())
        # Phase trace: int64 [kind, half, TRACE_WORDS] on the device, or None (off: the kernels get 0).
        self._trace: torch.Tensor | None = None
        self._trace_last: dict[str, tuple[int, int]] = {}  # kind -> (half, num_experts) of its last launch
        if os.environ.get(TRACE_ENV, "0") not in ("", "0"):
            if not hasattr(self._mod, "TRACE_WORDS"):
                raise RuntimeError(f"{TRACE_ENV} is set but the compiled extension has no phase trace (rebuild it)")
            if self._num_blocks > self._mod.TRACE_MAX_BLOCKS:
                raise ValueError(f"{TRACE_ENV}: the trace records at most {self._mod.TRACE_MAX_BLOCKS} blocks, the grid "
                                 f"has {self._num_blocks} (set {BLOCKS_ENV})")
            self._trace = torch.zeros(len(TRACE_KINDS), 2, self._mod.TRACE_WORDS, dtype=torch.int64,
                                      device=self.device)
        self._layout_key: tuple[int, int, int] | None = None
        self._phase_both = self._mod.PHASE_SEND | self._mod.PHASE_RECV
        self._own_comm_stream: torch.cuda.Stream | None = None
        self._alive = True
        self._state.barrier()  # nobody sends before every peer zeroed its buffer
        torch.cuda.current_stream().synchronize()

    def set_variant(self, variant: int) -> None:
        """Kernel variant bits of later calls (tuning, see VARIANT_ENV): every variant gives the same results and
        leaves the workspace as it found it, so switching between calls is safe when every rank switches between
        the same two calls (not inside a graph capture: captured launches keep the variant they were captured
        with)."""
        if variant & ~getattr(self._mod, "VARIANT_MASK", 0):
            raise ValueError(f"unknown low-latency kernel variant bits: {variant} (see {VARIANT_ENV})")
        if self.nvlink_peers < self.num_ranks:  # every variant stores to peers through NVLink
            variant = 0
        self.variant = variant
        self._plans: dict[tuple, _Plan] = {}  # (maxT, hidden, experts, top-k, half) -> plan of this variant

    def set_rank_partials(self, rank_partials: bool) -> None:
        """The combine's reduction order of later calls (the Buffer's low_latency_combine_reduction setter calls
        this); every rank must switch between the same two calls."""
        self.rank_partials = bool(rank_partials)
        self._plans = {}

    # ------------------------------------------------------------------ phase trace
    @property
    def tracing(self) -> bool:
        return self._trace is not None

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def trace_record(self, kind: str, half: int) -> torch.Tensor:
        """The raw device record (int64 [TRACE_WORDS]) the kernels of `kind` ("dispatch"/"combine") write when
        they use buffer half `half`; a CUDA graph replay rewrites the same record. Layout: low_latency.h."""
        if self._trace is None:
            raise RuntimeError(f"phase trace off: set {TRACE_ENV}=1 before the Buffer is created")
        return self._trace[TRACE_KINDS.index(kind), half]

    def trace_meta(self, num_experts: int) -> dict:
        """What parse_trace_record needs about this backend's records."""
        m = self._mod
        return {"num_blocks": self._num_blocks, "num_ranks": self.num_ranks, "num_experts": num_experts,
                "events_per_block": m.TRACE_EVENTS, "smid": m.TRACE_SMID, "pair_sent": m.TRACE_PAIR_SENT,
                "pair_wait": m.TRACE_PAIR_WAIT, "pair_seen": m.TRACE_PAIR_SEEN, "words": m.TRACE_WORDS,
                "events": {"dispatch": dict(m.TRACE_DISPATCH_EVENTS), "combine": dict(m.TRACE_COMBINE_EVENTS)}}

    def last_trace(self) -> dict:
        """{kind: parsed record} of the last launch of each kind (synchronises the device). The times are
        %globaltimer ns (0 = event not reached); see parse_trace_record."""
        if self._trace is None:
            raise RuntimeError(f"phase trace off: set {TRACE_ENV}=1 before the Buffer is created")
        torch.cuda.synchronize(self.device)
        out = {}
        for kind, (half, num_experts) in self._trace_last.items():
            out[kind] = parse_trace_record(self.trace_record(kind, half).cpu(), kind, self.trace_meta(num_experts))
            out[kind]["half"] = half
        return out

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Free the symmetric buffer and drop this backend's NVSHMEM reference (collective)."""
        if not self._alive:
            return
        self._alive = False
        self._raw = None
        self._state.release(self._ptr, self.device)

    def _check_alive(self) -> None:
        if not self._alive:
            raise RuntimeError("the low-latency backend was destroyed")

    # ------------------------------------------------------------------ layout and checks
    def check_shape(self, max_tokens: int, hidden: int, num_experts: int, num_topk: int | None = None) -> None:
        key = (max_tokens, hidden, num_experts, num_topk)
        if key in self._checked:
            return
        m = self._mod
        if hidden > m.MAX_HIDDEN:
            raise ValueError(f"the low-latency kernels take hidden sizes up to {m.MAX_HIDDEN}, got {hidden}")
        if num_experts > m.MAX_EXPERTS:
            raise ValueError(f"the low-latency kernels take at most {m.MAX_EXPERTS} experts, got {num_experts}")
        if num_topk is not None and not 1 <= num_topk <= m.MAX_TOPK:
            raise ValueError(f"the low-latency kernels take 1 to {m.MAX_TOPK} top-k slots, got {num_topk}")
        half = m.half_layout(max_tokens, hidden, self.num_ranks, num_experts)["half_bytes"]
        if 2 * half > self.num_bytes:
            raise ValueError(f"num_rdma_bytes={self.num_bytes} is too small for {max_tokens} tokens, hidden {hidden}, "
                             f"{num_experts} experts (needs {2 * half})")
        self._checked.add(key)

    def _plan(self, max_tokens: int, hidden: int, num_experts: int, num_topk: int, half: int) -> _Plan:
        """The plan of a call with these shapes (made and checked on first use). A call whose (maxT, hidden,
        experts) differ from the previous call's first clears the signal words of the new layout."""
        if self._layout_key != (max_tokens, hidden, num_experts):
            if self._layout_key is not None:
                self.clean_low_latency_buffer(max_tokens, hidden, num_experts)
            self._layout_key = (max_tokens, hidden, num_experts)
        key = (max_tokens, hidden, num_experts, num_topk, half)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._new_plan(*key)
        return plan

    def _new_plan(self, max_tokens: int, hidden: int, num_experts: int, num_topk: int, half: int) -> _Plan:
        self.check_shape(max_tokens, hidden, num_experts, num_topk)
        r = self.num_ranks
        local = num_experts // r
        variant = self.variant
        if local < 2:  # both need two local experts or more (with one, a message / row is already per rank)
            variant &= ~(VARIANT_DISPATCH_DEDUP | VARIANT_COMBINE_PER_RANK)
        if not self.rank_partials:  # the per-rank combine computes the per-rank order only
            variant &= ~VARIANT_COMBINE_PER_RANK
        layout = self._mod.half_layout(max_tokens, hidden, r, num_experts)
        traces = [self._trace[TRACE_KINDS.index(kind), half].data_ptr() if self._trace is not None else 0
                  for kind in TRACE_KINDS]
        launcher = self._mod.Launcher(self._ptr, self._peer_bases.data_ptr(), self._workspace.data_ptr(),
                                      half * layout["half_bytes"], self.rank, r, num_experts, max_tokens, hidden,
                                      self._num_blocks, int(self.timeout_s * 1e9), variant, *traces)
        return _Plan(launcher, local, r * max_tokens, half)

    def _comm_stream(self) -> torch.cuda.Stream:
        buffer = self._buffer_ref()
        if buffer is not None:
            return buffer.get_comm_stream()
        if self._own_comm_stream is None:
            self._own_comm_stream = torch.cuda.Stream(self.device)
        return self._own_comm_stream

    def _run(self, launch: Callable[[int, int], None], async_finish: bool, return_recv_hook: bool,
             make_hook: Callable, keep: list) -> tuple[EventOverlap, Callable | None]:
        """Enqueue send now and receive in the hook, or send+receive on the comm stream (async_finish), with
        DeepEP's stream semantics (the plain call launches on the current stream without coming here)."""
        send, recv = self._mod.PHASE_SEND, self._mod.PHASE_RECV
        if return_recv_hook:
            launch(send, torch.cuda.current_stream().cuda_stream)
            return EventOverlap(), make_hook(lambda: launch(recv, torch.cuda.current_stream().cuda_stream))
        compute, comm = torch.cuda.current_stream(), self._comm_stream()
        comm.wait_stream(compute)
        launch(send | recv, comm.cuda_stream)
        for t in keep:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(comm)
        event = torch.cuda.Event()
        event.record(comm)
        return EventOverlap(event, extra_tensors=keep), None

    # ------------------------------------------------------------------ dispatch
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int, num_experts: int,
                             cumulative_local_expert_recv_stats: torch.Tensor | None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None, use_fp8: bool, round_scale: bool,
                             use_ue8m0: bool, async_finish: bool, return_recv_hook: bool, half: int,
                             make_hook: Callable):
        """The Buffer checked the arguments (x bf16 [T, H] and topk_idx int64 [T, K], both contiguous, on this
        device); outputs are new tensors of every call."""
        self._check_alive()
        t, h = x.shape
        k = topk_idx.shape[1]
        plan = self._plan(max_tokens, h, num_experts, k, half)
        local, rows, dev = plan.local, plan.rows, x.device
        if use_fp8:
            data = torch.empty((local, rows, h), dtype=torch.float8_e4m3fn, device=dev)
            if use_ue8m0:
                scales = torch.empty((local, h // 512, rows), dtype=torch.int32, device=dev).transpose(1, 2)
            else:
                scales = torch.empty((local, h // 128, rows), dtype=torch.float32, device=dev).transpose(1, 2)
            recv_x, scales_ptr = (data, scales), scales.data_ptr()
        else:
            data = recv_x = torch.empty((local, rows, h), dtype=torch.bfloat16, device=dev)
            scales, scales_ptr = None, 0
        recv_count = torch.empty(local, dtype=torch.int32, device=dev)
        info = torch.empty((2, local, rows), dtype=torch.int32, device=dev)  # src_info, row_of: one allocation
        src_info, row_of = info[0], info[1]
        layout_range = torch.empty((local, self.num_ranks), dtype=torch.int64, device=dev)
        handle = LowLatencyHandle(src_info, layout_range, max_tokens, h, num_experts, self.name, self._buffer_token,
                                  LowLatencyState(plan.half, row_of), t)
        cum, wait = cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats
        if self._trace is not None:
            self._trace_last["dispatch"] = (half, num_experts)
        args = (x.data_ptr(), topk_idx.data_ptr(), t, k, use_fp8, round_scale, use_ue8m0, data.data_ptr(), scales_ptr,
                src_info.data_ptr(), row_of.data_ptr(), layout_range.data_ptr(), recv_count.data_ptr(),
                0 if cum is None else cum.data_ptr(), 0 if wait is None else wait.data_ptr())
        dispatch = plan.launcher.dispatch

        def launch(phases: int, stream: int) -> None:
            self._check_alive()
            dispatch(*args, phases, stream)

        if not (async_finish or return_recv_hook):  # the common call: one launch on the current stream
            launch(self._phase_both, torch.cuda.current_stream().cuda_stream)
            return recv_x, recv_count, handle, EventOverlap(), None
        keep = [v for v in (x, topk_idx, data, scales, recv_count, info, layout_range, cum, wait) if v is not None]
        event, hook = self._run(launch, async_finish, return_recv_hook, make_hook, keep)
        return recv_x, recv_count, handle, event, hook

    # ------------------------------------------------------------------ combine
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, zero_copy: bool, async_finish: bool, return_recv_hook: bool,
                            out: torch.Tensor | None, combine_wait_recv_cost_stats: torch.Tensor | None,
                            half: int, make_hook: Callable):
        """The Buffer checked the arguments (x bf16 [L, R*maxT, H], topk_idx int64 and topk_weights float32
        [T, K], out bf16 [T, H] or None: all contiguous, on this device)."""
        self._check_alive()
        max_tokens, h, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        t, k = topk_idx.shape
        plan = self._plan(max_tokens, h, num_experts, k, half)
        result = out if out is not None else torch.empty((t, h), dtype=torch.bfloat16, device=x.device)
        wait = combine_wait_recv_cost_stats
        if self._trace is not None:
            self._trace_last["combine"] = (half, num_experts)
        row_of = handle.backend_state.row_of
        args = (0 if zero_copy else x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(),
                handle.src_info.data_ptr(), row_of.data_ptr(), handle.layout_range.data_ptr(), result.data_ptr(), t,
                k, self.rank_partials, 0 if wait is None else wait.data_ptr())
        combine = plan.launcher.combine

        def launch(phases: int, stream: int) -> None:
            self._check_alive()
            combine(*args, phases, stream)

        if not (async_finish or return_recv_hook):
            launch(self._phase_both, torch.cuda.current_stream().cuda_stream)
            return result, EventOverlap(), None
        keep = [v for v in (x, topk_idx, topk_weights, handle.src_info, row_of, handle.layout_range, result, wait)
                if v is not None]
        event, hook = self._run(launch, async_finish, return_recv_hook, make_hook, keep)
        return result, event, hook

    # ------------------------------------------------------------------ buffer views and cleaning
    def next_combine_buffer(self, handle: LowLatencyHandle, half: int) -> torch.Tensor:
        """bf16 [L, R*maxT, H] view of `half`'s send region: the rows a zero-copy combine sends."""
        self._check_alive()
        max_tokens, h, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        layout = self._mod.half_layout(max_tokens, h, self.num_ranks, num_experts)
        local, rows = num_experts // self.num_ranks, self.num_ranks * max_tokens
        begin = half * layout["half_bytes"] + layout["send_off"]
        return self._raw[begin: begin + local * rows * h * 2].view(torch.bfloat16).view(local, rows, h)

    def clean_low_latency_buffer(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        """Zero the signal words of both halves for these shapes and reset the workspace (collective: NVSHMEM
        barriers before and after, on the current stream)."""
        self._check_alive()
        self.check_shape(max_tokens, hidden, num_experts)
        layout = self._mod.half_layout(max_tokens, hidden, self.num_ranks, num_experts)
        stream = torch.cuda.current_stream()
        self._state.barrier(stream)  # every peer is done with the buffer (and its earlier use)
        for half in (0, 1):
            begin = half * layout["half_bytes"] + layout["signal_off"]
            self._raw[begin: begin + layout["signal_bytes"]].zero_()
        self._workspace.zero_()
        self._state.barrier(stream)  # nobody sends before every peer's signals are zero
        self._layout_key = (max_tokens, hidden, num_experts)

    def local_buffer_tensor(self, dtype: torch.dtype, size, offset: int, use_rdma_buffer: bool) -> torch.Tensor:
        """A typed view of this rank's NVSHMEM buffer from byte `offset` (writing it needs a
        clean_low_latency_buffer before the next low-latency call)."""
        self._check_alive()
        return buffer_view(lambda: self._raw, self.num_bytes, dtype, size, offset, "NVSHMEM")


def parse_trace_record(words: torch.Tensor, kind: str, meta: dict) -> dict:
    """One trace record (CPU int64 [words]) as {"events": {name: int64 [blocks]}, "smid": int64 [blocks],
    "sent", "wait", "seen": int64 [E]}. Times are %globaltimer ns, 0 = not reached / not written.
    Pair words (low_latency.h): dispatch sent[e] (sender, global expert e), wait/seen[l*R + s] (receiver,
    local expert l, source s); combine sent[l*R + s] (sender: flag of its expert l to rank s), wait/seen[e]
    (receiver's block 0, global expert e)."""
    b, ev, e = meta["num_blocks"], meta["events_per_block"], meta["num_experts"]
    rows = words[: meta["pair_sent"]].view(-1, ev)[:b]
    return {"events": {name: rows[:, i].clone() for name, i in meta["events"][kind].items()},
            "smid": rows[:, meta["smid"]].clone(),
            "sent": words[meta["pair_sent"]: meta["pair_sent"] + e].clone(),
            "wait": words[meta["pair_wait"]: meta["pair_wait"] + e].clone(),
            "seen": words[meta["pair_seen"]: meta["pair_seen"] + e].clone()}
