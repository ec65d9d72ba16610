"""Low-latency backend: dispatch and combine over NVSHMEM with the compiled kernels.

One LowLatencyBackend belongs to one Buffer(low_latency_mode=True). It brings NVSHMEM up over the Buffer's
group (moe_dispatcher.runtime.nvshmem), holds one symmetric allocation of num_rdma_bytes split into two
halves (the Buffer picks the half of each call), and launches the kernels of csrc/kernels/low_latency.
docs/low_latency.md describes the layout and the protocol.

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
from ..event import EventOverlap
from ..handle import LowLatencyHandle
from ..runtime import nvshmem

TIMEOUT_ENV = "MOE_DISPATCHER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 10.0
# Kernel variants (bits, csrc/kernels/low_latency/low_latency.h), read when the backend is created; every
# variant gives the same bytes, and all of them need NVLink to every peer (cleared otherwise).
#   1 = combine send spreads rows over the whole grid;
#   2 = dedup dispatch: one message per (token, destination rank), expanded by the receiver;
#   4 = token-major combine along the route a dedup dispatch leaves in its handle (pair combine otherwise).
# MOE_DISPATCHER_LL_DISPATCH=dedup|per_expert and MOE_DISPATCHER_LL_COMBINE=tokens|pairs set or clear bits 2
# and 4 on top of MOE_DISPATCHER_LL_VARIANT. Default: dedup dispatch + pair combine (the fastest on 4 x H200,
# 2026-11-21: 32.9 / 50.9 us against 40.3 / 50.8 for per_expert + pairs and 32.8 / 58.9 for dedup + tokens).
VARIANT_ENV = "MOE_DISPATCHER_LL_VARIANT"
DISPATCH_ENV = "MOE_DISPATCHER_LL_DISPATCH"
COMBINE_ENV = "MOE_DISPATCHER_LL_COMBINE"
VARIANT_COMBINE_ROWS, VARIANT_DISPATCH_DEDUP, VARIANT_COMBINE_TOKENS = 1, 2, 4  # == low_latency.h
DEFAULT_VARIANT = VARIANT_DISPATCH_DEDUP
VARIANT_NAMED = {DISPATCH_ENV: (VARIANT_DISPATCH_DEDUP, "dedup", "per_expert"),
                 COMBINE_ENV: (VARIANT_COMBINE_TOKENS, "tokens", "pairs")}
# Grid size override (tuning only): at most the SM count.
BLOCKS_ENV = "MOE_DISPATCHER_LL_BLOCKS"
# Phase trace (diagnostics): "1" when the backend is created turns the kernels' timestamps on.
TRACE_ENV = "MOE_DISPATCHER_LL_TRACE"
TRACE_KINDS = ("dispatch", "combine")  # first index of the trace records


def variant_from_env(env=os.environ) -> int:
    """Kernel variant bits from MOE_DISPATCHER_LL_VARIANT, then MOE_DISPATCHER_LL_DISPATCH / _COMBINE."""
    value = env.get(VARIANT_ENV, "")
    variant = int(value) if value else DEFAULT_VARIANT
    for name, (bit, on, off) in VARIANT_NAMED.items():
        value = env.get(name, "")
        if value == on:
            variant |= bit
        elif value == off:
            variant &= ~bit
        elif value:
            raise ValueError(f"{name}={value!r}: expected {on!r} or {off!r}")
    return variant


def variant_name(variant: int) -> str:
    """Readable name of variant bits, e.g. 'dedup+tokens', 'per_expert+pairs+rows'."""
    parts = ["dedup" if variant & VARIANT_DISPATCH_DEDUP else "per_expert",
             "tokens" if variant & VARIANT_COMBINE_TOKENS else "pairs"]
    if variant & VARIANT_COMBINE_ROWS:
        parts.append("rows")
    return "+".join(parts)


class LowLatencyState(NamedTuple):
    """backend_state of this backend's LowLatencyHandle: the buffer half of the dispatch, and the route its
    receive left (dedup dispatch: int32 route_count [R] and route [R, maxT, ROUTE_WORDS]; None otherwise)."""
    half: int
    route_count: torch.Tensor | None = None
    route: torch.Tensor | None = None


class _DeviceMemory:
    """A raw device range for torch.as_tensor (through __cuda_array_interface__); owns nothing."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class LowLatencyBackend:
    """Compiled low-latency backend of one Buffer (see the module docstring)."""

    name = "low_latency"

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
        self._own_comm_stream: torch.cuda.Stream | None = None
        self._alive = True
        self._state.barrier()  # nobody sends before every peer zeroed its buffer
        torch.cuda.current_stream().synchronize()

    def set_variant(self, variant: int) -> None:
        """Kernel variant bits of later calls (tuning, see VARIANT_ENV): every variant gives the same results and
        leaves the workspace as it found it, so switching between calls is safe when every rank switches between
        the same two calls (not inside a graph capture: captured launches keep the variant they were captured
        with). A handle keeps working across a switch: its combine runs token-major only if its dispatch was
        dedup (it then carries the route) and the variant asks for it."""
        if variant & ~getattr(self._mod, "VARIANT_MASK", 0):
            raise ValueError(f"unknown low-latency kernel variant bits: {variant} (see {VARIANT_ENV})")
        if self.nvlink_peers < self.num_ranks:  # every variant stores to peers through NVLink
            variant &= ~(VARIANT_COMBINE_ROWS | VARIANT_DISPATCH_DEDUP | VARIANT_COMBINE_TOKENS)
        self.variant = variant

    # ------------------------------------------------------------------ phase trace
    @property
    def tracing(self) -> bool:
        return self._trace is not None

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def _trace_arg(self, kind: str, half: int, num_experts: int) -> dict:
        """The `trace` keyword of a launch: the record of (kind, half), or nothing when tracing is off (so an
        extension built before the trace existed still works)."""
        if self._trace is None:
            return {}
        self._trace_last[kind] = (half, num_experts)
        return {"trace": self._trace[TRACE_KINDS.index(kind), half].data_ptr()}

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

    # ------------------------------------------------------------------ what this backend serves
    def serves_normal(self, topology) -> bool:
        return False

    def serves_low_latency(self) -> bool:
        return True

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Free the symmetric buffer and drop this backend's NVSHMEM reference (collective)."""
        if not self._alive:
            return
        self._alive = False
        torch.cuda.synchronize(self.device)
        self._state.barrier()
        torch.cuda.synchronize(self.device)
        self._raw = None
        self._state.free(self._ptr)
        self._state.finalize()

    def _check_alive(self) -> None:
        if not self._alive:
            raise RuntimeError("the low-latency backend was destroyed")

    # ------------------------------------------------------------------ layout and checks
    def check_shape(self, max_tokens: int, hidden: int, num_experts: int, num_topk: int | None = None) -> None:
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

    def _layout(self, max_tokens: int, hidden: int, num_experts: int) -> dict:
        """The half layout of these shapes; clears the signal words when the shapes changed since the last call."""
        key = (max_tokens, hidden, num_experts)
        if self._layout_key is not None and self._layout_key != key:
            self.clean_low_latency_buffer(max_tokens, hidden, num_experts)
        self._layout_key = key
        return self._mod.half_layout(max_tokens, hidden, self.num_ranks, num_experts)

    def _common(self, layout: dict, half: int, max_tokens: int, hidden: int, num_experts: int) -> dict:
        return {"buffer": self._ptr, "peer_bases": self._peer_bases.data_ptr(),
                "workspace": self._workspace.data_ptr(), "half_offset": half * layout["half_bytes"],
                "rank": self.rank, "num_ranks": self.num_ranks, "num_experts": num_experts,
                "max_tokens": max_tokens, "hidden": hidden, "num_blocks": self._num_blocks,
                "timeout_ns": int(self.timeout_s * 1e9), "variant": self.variant}

    def _comm_stream(self) -> torch.cuda.Stream:
        buffer = self._buffer_ref()
        if buffer is not None:
            return buffer.get_comm_stream()
        if self._own_comm_stream is None:
            self._own_comm_stream = torch.cuda.Stream(self.device)
        return self._own_comm_stream

    def _run(self, launch: Callable[[int, int], None], async_finish: bool, return_recv_hook: bool,
             make_hook: Callable, keep: list) -> tuple[EventOverlap, Callable | None]:
        """Enqueue send+receive (or send now, receive in the hook) with DeepEP's stream semantics."""
        send, recv = self._mod.PHASE_SEND, self._mod.PHASE_RECV
        if return_recv_hook:
            launch(send, torch.cuda.current_stream().cuda_stream)
            return EventOverlap(), make_hook(lambda: launch(recv, torch.cuda.current_stream().cuda_stream))
        if not async_finish:
            launch(send | recv, torch.cuda.current_stream().cuda_stream)
            return EventOverlap(), None
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
        self._check_alive()
        t, h = x.shape
        k = topk_idx.shape[1]
        self.check_shape(max_tokens, h, num_experts, k)
        layout = self._layout(max_tokens, h, num_experts)
        x = x.contiguous()
        topk_idx = topk_idx.to(torch.int64).contiguous()
        r = self.num_ranks
        local, rows = num_experts // r, r * max_tokens
        dev = x.device
        scales = None
        if use_fp8:
            groups = h // 512 if use_ue8m0 else h // 128
            data = torch.empty(local, rows, h, dtype=torch.float8_e4m3fn, device=dev)
            scales = torch.empty(local, groups, rows, dtype=torch.int32 if use_ue8m0 else torch.float32,
                                 device=dev).transpose(1, 2)
            recv_x = (data, scales)
        else:
            data = recv_x = torch.empty(local, rows, h, dtype=torch.bfloat16, device=dev)
        recv_count = torch.empty(local, dtype=torch.int32, device=dev)
        src_info = torch.empty(local, rows, dtype=torch.int32, device=dev)
        layout_range = torch.empty(local, r, dtype=torch.int64, device=dev)
        common = self._common(layout, half, max_tokens, h, num_experts)
        # Dedup needs two local experts or more (with one, per-expert messages are already one per rank); its
        # receive leaves the route the token-major combine sends along (kept in the handle).
        route_count = route = None
        if common["variant"] & VARIANT_DISPATCH_DEDUP and local < 2:
            common["variant"] &= ~VARIANT_DISPATCH_DEDUP
        if common["variant"] & VARIANT_DISPATCH_DEDUP:
            route_count = torch.empty(r, dtype=torch.int32, device=dev)
            route = torch.empty(r, max_tokens, self._mod.ROUTE_WORDS, dtype=torch.int32, device=dev)
        handle = LowLatencyHandle(src_info, layout_range, max_tokens, h, num_experts, self.name, self._buffer_token,
                                  LowLatencyState(half, route_count, route))
        routes = {} if route is None else {"route_count": route_count.data_ptr(), "route": route.data_ptr()}
        cum, wait = cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats
        trace = self._trace_arg("dispatch", half, num_experts)

        def launch(phases: int, stream: int) -> None:
            self._check_alive()
            self._mod.dispatch(**common, x=x.data_ptr(), topk_idx=topk_idx.data_ptr(), num_tokens=t, num_topk=k,
                               fp8=use_fp8, round_scale=round_scale, ue8m0=use_ue8m0, recv_x=data.data_ptr(),
                               recv_scales=scales.data_ptr() if scales is not None else 0,
                               src_info=src_info.data_ptr(), layout_range=layout_range.data_ptr(),
                               recv_count=recv_count.data_ptr(), cum_stats=cum.data_ptr() if cum is not None else 0,
                               wait_stats=wait.data_ptr() if wait is not None else 0, phases=phases, stream=stream,
                               **trace, **routes)

        keep = [x, topk_idx, data, scales, recv_count, src_info, layout_range, cum, wait, route_count, route]
        event, hook = self._run(launch, async_finish, return_recv_hook, make_hook, [v for v in keep if v is not None])
        return recv_x, recv_count, handle, event, hook

    # ------------------------------------------------------------------ combine
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, zero_copy: bool, async_finish: bool, return_recv_hook: bool,
                            out: torch.Tensor | None, combine_wait_recv_cost_stats: torch.Tensor | None,
                            half: int, make_hook: Callable):
        self._check_alive()
        max_tokens, h, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        t, k = topk_idx.shape
        self.check_shape(max_tokens, h, num_experts, k)
        layout = self._layout(max_tokens, h, num_experts)
        x = x.contiguous()
        topk_idx = topk_idx.to(torch.int64).contiguous()
        topk_weights = topk_weights.contiguous()
        result = out if out is not None else torch.empty(t, h, dtype=torch.bfloat16, device=x.device)
        target = result if result.is_contiguous() else torch.empty_like(result, memory_format=torch.contiguous_format)
        common = self._common(layout, half, max_tokens, h, num_experts)
        state = handle.backend_state
        routes = {}
        if common["variant"] & VARIANT_COMBINE_TOKENS and isinstance(state, LowLatencyState) and state.route is not None:
            routes = {"route_count": state.route_count.data_ptr(), "route": state.route.data_ptr()}
        else:
            common["variant"] &= ~VARIANT_COMBINE_TOKENS
        wait = combine_wait_recv_cost_stats
        send_phase = self._mod.PHASE_SEND
        trace = self._trace_arg("combine", half, num_experts)

        def launch(phases: int, stream: int) -> None:
            self._check_alive()
            self._mod.combine(**common, x=0 if zero_copy else x.data_ptr(), topk_idx=topk_idx.data_ptr(),
                              topk_weights=topk_weights.data_ptr(), src_info=handle.src_info.data_ptr(),
                              layout_range=handle.layout_range.data_ptr(), out=target.data_ptr(), num_tokens=t,
                              num_topk=k, wait_stats=wait.data_ptr() if wait is not None else 0, phases=phases,
                              stream=stream, **trace, **routes)
            if target is not result and phases != send_phase:
                with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                    result.copy_(target)

        keep = [x, topk_idx, topk_weights, handle.src_info, handle.layout_range, result, target, wait]
        if routes:
            keep += [state.route_count, state.route]
        event, hook = self._run(launch, async_finish, return_recv_hook, make_hook, [v for v in keep if v is not None])
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
        elem = torch.empty((), dtype=dtype).element_size()
        count = (self.num_bytes - offset) // elem if size is None else int(torch.Size(size).numel())
        if offset < 0 or offset % elem or offset + count * elem > self.num_bytes:
            raise ValueError(f"get_local_buffer_tensor: {count} x {dtype} at offset {offset} does not fit the "
                             f"{self.num_bytes}-byte NVSHMEM buffer")
        view = self._raw[offset: offset + count * elem].view(dtype)
        return view.view(*size) if size is not None else view


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
