"""Low-latency backend: dispatch and combine over NVSHMEM with the compiled kernels.

One LowLatencyBackend belongs to one Buffer(low_latency_mode=True). It brings NVSHMEM up over the Buffer's
group (moe_dispatcher.runtime.nvshmem), holds one symmetric allocation of num_rdma_bytes split into two
halves, and makes the native runtime (_C.low_latency.LowLatencyRuntime, csrc/low_latency_bindings.cpp) that
serves every call: low_latency_dispatch / low_latency_combine ARE the runtime's functions (METH_FASTCALL, bound to
it; positional arguments only), so a Buffer call is one Python call into C++ (checks of the tensors against the shape's plan, the buffer half, the output
allocation, the launch, the handle, the hook or the event). docs/low_latency.md describes the layout, the
protocol and which kernels a call runs (chosen per shape: no switch).

Streams (DeepEP V1's semantics): kernels run on the current stream; with async_finish on the Buffer's comm
stream (after it waits for the current one), and an EventOverlap carries the event; with return_recv_hook
the send kernel runs now on the current stream and hook() enqueues the receive kernel on the stream current
at that time. Nothing synchronises with the host, except when the (max_tokens, hidden, num_experts) of a call
differ from the previous call's (a layout change, like clean_low_latency_buffer): then the runtime calls
layout_round's function twice around the clear of the new layout's signal words (device synchronised, one small
all-gather on the Buffer's Board under the kernels' timeout each: every rank's new layout must agree, else
SignatureMismatch on every rank; a rank whose peers never come raises a timeout naming them and posts its abort),
which is refused inside a CUDA graph capture (warm up with the same shapes first).
A wait longer than MOE_DISPATCHER_TIMEOUT_S seconds (default 10) in a kernel records which rank waited for which
peer in which phase and ends the kernel (no trap: the CUDA context survives); the next call on that rank raises a
RuntimeError saying so, and the Buffer is unusable from then on. A rank that raises in a Buffer call writes its
abort byte (after the two halves of every peer's symmetric buffer; post_abort), and a peer's wait that sees it at
two looks ~1 s apart gives up the same way: that peer's next call raises "rank r raised: ..." (docs/low_latency.md).
Agreement (docs/low_latency.md, "Agreement"): every dispatch carries its signature (hidden, max tokens, experts,
top-k, FP8 flags) in the count words it sends; a receive that finds a source's differing records it, takes that
source's counts as 0 and ends, and every rank (each receives from every rank) raises SignatureMismatch at its next
call (signature_mismatch builds it), with no collective; the Buffer is unusable from then on.

Phase trace (diagnostics, docs/low_latency.md "Phase trace"): MOE_DISPATCHER_LL_TRACE=1 when the backend is
created makes it keep one device record per (kernel, buffer half) and pass it to every launch; the kernels then
stamp %globaltimer at their phase boundaries. `last_trace()` returns the last call's timeline,
`trace_record(kind, half)` the raw device record (tools/ll_trace.py copies those between calls).
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

from .. import _ext
from ..backend import Backend, Capabilities
from ..env import env_flag
from ..event import EventOverlap
from ..handle import LowLatencyHandle
from ..reference.board import Board, CollectiveTimeout
from ..reference.comm import agree, all_gather_rows
from ..runtime import nvshmem
from ..signature import FIELDS, Signature, SignatureMismatch
from . import TIMEOUT_ENV, buffer_view, kernel_timeout_s, posted_by_peer, timeout_message

# Phase trace (diagnostics): "1" when the backend is created turns the kernels' timestamps on.
TRACE_ENV = "MOE_DISPATCHER_LL_TRACE"
TRACE_KINDS = ("dispatch", "combine")  # first index of the trace records
# EventOverlap of the calls that finish in stream order (no event): one shared object, like a fresh one.
_NO_EVENT = EventOverlap()


class _DeviceMemory:
    """A raw device range for torch.as_tensor (through __cuda_array_interface__); owns nothing. Every tensor viewing
    the range holds this object until its storage is freed, so a weak reference to it tells whether a view lives."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class LowLatencyBackend(Backend):
    """Compiled low-latency backend of one Buffer (see the module docstring).

    low_latency_dispatch(x, topk_idx, max_tokens, num_experts, cum_stats, wait_stats, use_fp8, round_scale,
    use_ue8m0, async_finish, return_recv_hook) and low_latency_combine(x, topk_idx, topk_weights, handle,
    zero_copy, async_finish, return_recv_hook, out, wait_stats) are the native runtime's functions (Backend's
    signatures, positional arguments only; the instance attributes shadow the base class's methods).
    """

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
        self.timeout_s = kernel_timeout_s()
        trace = env_flag(TRACE_ENV)  # settings are read before any collective: a bad one fails on every rank alike
        self.device = torch.device("cuda", torch.cuda.current_device())
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        # Phase trace: int64 [kind, half, TRACE_WORDS] on the device, or None (off: the kernels get null).
        self._trace: torch.Tensor | None = None
        if trace:
            if sms > self._mod.TRACE_MAX_BLOCKS:
                raise ValueError(f"{TRACE_ENV}: the trace records at most {self._mod.TRACE_MAX_BLOCKS} blocks, the "
                                 f"grid has {sms}")
            self._trace = torch.zeros(len(TRACE_KINDS), 2, self._mod.TRACE_WORDS, dtype=torch.int64,
                                      device=self.device)
        self._sms, self._buffer = sms, buffer  # for start() (the Buffer is dropped there)

    # ------------------------------------------------------------------ creation (compiled.create_backends)
    def start(self) -> None:
        """Collective, after every rank's local step succeeded: bring NVSHMEM up (its unique id goes through a
        bounded creation round of the Buffer's board), allocate and zero the symmetric buffer, make the native
        runtime, wait for every PE."""
        buffer, sms = self._buffer, self._sms
        self._buffer = None
        self._state = nvshmem.bootstrap(buffer.group, self.device.index,
                                        single_host=buffer.topology.is_single_domain, board=buffer._board)
        # The symmetric allocation: num_rdma_bytes for the two halves, then (128-byte aligned) this PE's abort
        # bytes, which the peers write (kernels/common/wait.cuh, "Peer abort"), and the dispatch signature words
        # (low_latency.h): CONTROL_BYTES from the abort bytes on, at one place whatever the call's shapes.
        abort_offset = (self.num_bytes + 127) // 128 * 128
        total = abort_offset + self._mod.CONTROL_BYTES
        try:
            self._ptr = self._state.malloc(total)
        except Exception:
            self._state.finalize()
            raise
        memory = _DeviceMemory(self._ptr, total)
        self._raw_memory = weakref.ref(memory)  # alive while a view of the buffer is (views_alive)
        whole = torch.as_tensor(memory, device=self.device)
        whole.zero_()  # every signal word of every layout starts at 0, and every abort byte
        self._raw = whole[:self.num_bytes]
        peers = [self._state.peer_ptr(self._ptr, pe) if buffer.allow_nvlink_for_low_latency_mode else 0
                 for pe in range(self.num_ranks)]
        # This PE's abort byte in every peer's abort bytes, through NVSHMEM's mapping (whether or not the kernels
        # may store over NVLink; 0: not mapped, that peer falls back to its timeout).
        aborts = [self._state.peer_ptr(self._ptr + abort_offset, pe) if pe != self.rank else 0
                  for pe in range(self.num_ranks)]
        self.nvlink_peers = sum(1 for p in peers if p)
        timeout_s = self.timeout_s
        board = buffer._board  # the message of a peer's abort
        self.runtime = self._mod.LowLatencyRuntime(
            self._raw, self.num_bytes, peers, self.rank, self.num_ranks, self.device.index, sms,
            int(self.timeout_s * 1e9), buffer.get_comm_stream(),
            getattr(buffer, "low_latency_combine_reduction", "per_rank") == "per_rank", self._trace,
            LowLatencyHandle, EventOverlap, _NO_EVENT, layout_round(board, self.device, self.timeout_s),
            lambda info: timeout_message("low-latency", info, timeout_s, TIMEOUT_ENV, board), buffer._token,
            self._ptr + abort_offset, [p + self.rank if p else 0 for p in aborts], signature_mismatch)
        # The calls: one native call each (see the class docstring).
        self.low_latency_dispatch = self.runtime.dispatch
        self.low_latency_combine = self.runtime.combine
        self._alive = True
        # Nobody sends before every peer zeroed its buffer: the zeroing done here, then one all-gather under the
        # Board's deadline (a peer that failed before this point is named in a timeout, instead of leaving this
        # rank in a device barrier for ever).
        torch.cuda.synchronize(self.device)
        all_gather_rows(board, torch.zeros(1, dtype=torch.int64, device=self.device),
                        "low-latency backend creation: buffers zeroed")

    def set_rank_partials(self, rank_partials: bool) -> None:
        """The combine's reduction order of later calls (the Buffer's low_latency_combine_reduction setter calls
        this); every rank must switch between the same two calls."""
        self.runtime.set_rank_partials(bool(rank_partials))

    @property
    def rank_partials(self) -> bool:
        return self.runtime.rank_partials

    def kernels_for(self, max_tokens: int, hidden: int, num_experts: int) -> str:
        """Which kernels a call of these shapes runs: "dedup" or "per_expert" dispatch, then "+rank_combine"
        when the combine sends per-rank partial rows (tests and tools label their cases with it)."""
        dedup, per_rank = self.runtime.kernels_for(max_tokens, hidden, num_experts)
        return ("dedup" if dedup else "per_expert") + ("+rank_combine" if per_rank else "")

    def timeout_info(self):
        """None, or (status, phase, waiting rank, peer) of the first wait that gave up (compiled.STATUS_*)."""
        return self.runtime.timeout_info()

    def signature_info(self):
        """None, or (call, source, seen, mine) of the first dispatch receive that found a source's signature differing
        from its own (see signature_mismatch)."""
        return self.runtime.signature_info()

    def post_abort(self) -> None:
        """Backend.post_abort: this PE's abort byte on every peer; the runtime clears it at its next launch (not
        after this rank's kernels honoured a peer's abort, nor once destroyed)."""
        if self._alive and not posted_by_peer(self.runtime.timeout_info()):
            self.runtime.post_abort()

    # ------------------------------------------------------------------ phase trace
    @property
    def tracing(self) -> bool:
        return self._trace is not None

    @property
    def num_blocks(self) -> int:
        return self.runtime.num_blocks

    def trace_record(self, kind: str, half: int) -> torch.Tensor:
        """The raw device record (int64 [TRACE_WORDS]) the kernels of `kind` ("dispatch"/"combine") write when
        they use buffer half `half`; a CUDA graph replay rewrites the same record. Layout: low_latency.h."""
        if self._trace is None:
            raise RuntimeError(f"phase trace off: set {TRACE_ENV}=1 before the Buffer is created")
        return self._trace[TRACE_KINDS.index(kind), half]

    def trace_meta(self, num_experts: int) -> dict:
        """What parse_trace_record needs about this backend's records."""
        m = self._mod
        return {"num_blocks": self.num_blocks, "num_ranks": self.num_ranks, "num_experts": num_experts,
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
        for i, kind in enumerate(TRACE_KINDS):
            last = self.runtime.trace_last(i)
            if last is None:
                continue
            half, num_experts = last
            out[kind] = parse_trace_record(self.trace_record(kind, half).cpu(), kind, self.trace_meta(num_experts))
            out[kind]["half"] = half
        return out

    # ------------------------------------------------------------------ teardown (moe_dispatcher/runtime/release.py)
    symmetric = True  # the buffer is NVSHMEM memory: freed collectively

    @property
    def broken(self) -> bool:
        return self.runtime.timeout_info() is not None or self.runtime.signature_info() is not None

    def quiesce(self) -> None:
        """Local: refuse later calls and hooks, drop this backend's views of the buffer, wait for the device."""
        self._alive = False
        self.runtime.destroy()
        self._raw = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def views_alive(self) -> bool:
        """A tensor viewing the buffer (get_local_buffer_tensor, the zero-copy combine buffer) is still alive."""
        return self._raw_memory() is not None

    def free(self, symmetric: bool) -> None:
        """Every rank stopped. symmetric: every rank's views are gone: free the buffer (an NVSHMEM barrier first,
        then the collective free) and drop this backend's NVSHMEM reference; else the buffer stays allocated for
        the views, until the process exits."""
        if symmetric:
            self._state.release(self._ptr, self.device)

    def abandon(self) -> None:
        """A rank never confirmed: the buffer stays allocated (no collective call can be made)."""

    # ------------------------------------------------------------------ buffer views and cleaning
    def next_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """bf16 [L, R*maxT, H] view of the next call's send region: the rows a zero-copy combine sends."""
        return self.runtime.next_combine_buffer(handle)

    def clean_low_latency_buffer(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        """Zero the signal words of both halves for these shapes and reset the workspace (collective: the clear
        on the current stream between the two rounds of layout_round; every rank passes the same shapes, else
        SignatureMismatch on every rank)."""
        self.runtime.clean(max_tokens, hidden, num_experts)

    def local_buffer_tensor(self, dtype: torch.dtype, size, offset: int, use_rdma_buffer: bool) -> torch.Tensor:
        """A typed view of this rank's NVSHMEM buffer from byte `offset` (writing it needs a
        clean_low_latency_buffer before the next low-latency call)."""
        if not self._alive:
            raise RuntimeError("the low-latency backend was destroyed")
        return buffer_view(lambda: self._raw, self.num_bytes, dtype, size, offset, "NVSHMEM")


# ------------------------------------------------------------------ layout change
LAYOUT_PHASE = "low-latency layout change"


def layout_round(board: Board, device: torch.device, timeout_s: float) -> Callable[[int, int, int, bool], None]:
    """The runtime's round on a layout change (csrc/low_latency_bindings.cpp, clean_layout): f(max_tokens, hidden,
    num_experts, zeroed), called with zeroed=False before the runtime clears the new layout's signal words (and
    the workspace, and its signature words) on the current stream, and zeroed=True after. Each call waits for the
    device, then all-gathers every rank's new layout on board (reference/comm.py agree) under `timeout_s`, the
    backend's (the kernels' MOE_DISPATCHER_TIMEOUT_S, default 10 s, not the reference backend's 300 s: a peer
    that never comes is named as soon as a kernel waiting for it would give up):

    * round 1 (zeroed=False): when it completes, every rank's kernels of the old layout have finished, so no
      store of theirs into this rank's buffer is in flight any more (every store a kernel makes into a peer is
      one the peer's receive waited for, or comes before such a one: data before its flag; the exception, a
      late signature word, carries its call's generation and reads as absent, low_latency.h). It also checks
      that every rank changes to the same layout: if not, every rank raises the same SignatureMismatch (fields,
      each rank's values), nothing was cleared, and the runtime keeps its old layout (the Buffer stays usable:
      every rank completed the same collective).
    * round 2 (zeroed=True): when it completes, every rank's clear has been performed, so no rank's first kernel
      of the new layout stores into a peer's signal words before that peer zeroed them.
    A rank whose peers never come (they called without changing the layout: their kernels wait for this rank)
    raises a timeout naming the round and the missing ranks after `timeout_s`. That timeout is
    raised as a plain RuntimeError, not the Board's PeerError, so that the Buffer posts this rank's abort
    (Buffer._post_abort): the missing ranks' kernels give up on it and raise "rank r raised: ..." with this
    message, instead of their own timeout.
    Nothing here runs per call: only on a change of (max_tokens, hidden, num_experts) or clean_low_latency_buffer.
    The synchronisations make it illegal inside a CUDA graph capture (it raises there: warm up first)."""

    def round_(max_tokens: int, hidden: int, num_experts: int, zeroed: bool) -> None:
        if device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"low-latency call with new (num_max_dispatch_tokens_per_rank, hidden, num_experts) = "
                    f"({max_tokens}, {hidden}, {num_experts}) inside a CUDA graph capture: a layout change "
                    f"synchronises the ranks on the host; make one call of these shapes before capturing")
            torch.cuda.synchronize(device)
        signature = Signature(LAYOUT_PHASE, (max_tokens, hidden, num_experts))
        try:
            agree(board, signature, device, phase="signals zeroed" if zeroed else "agreement", timeout_s=timeout_s)
        except CollectiveTimeout as exc:
            raise RuntimeError(str(exc)) from None

    return round_


# ------------------------------------------------------------------ agreement
LL_DISPATCH_FIELDS = FIELDS["low-latency dispatch"]  # hidden, max tokens, experts, top-k, use_fp8, round_scale, ue8m0
_TAG_ONLY = 1 << 63  # SignatureRecord.seen holds only the source's count-word tag (low_latency.h, kSeenTagOnly)
_BAD_COUNT = 1 << 62  # SignatureRecord.seen: a count word with our tag and a count out of range (kSeenBadCount)
_LAYOUT_FIELDS = LL_DISPATCH_FIELDS[:3]


def dispatch_signature(hidden: int, max_tokens: int, num_experts: int, num_topk: int, use_fp8: bool,
                       round_scale: bool, use_ue8m0: bool) -> int:
    """The 64-bit signature a low-latency dispatch carries, as csrc/kernels/low_latency/low_latency.h's
    dispatch_signature packs it (the fields exactly, plus a 7-bit hash of the layout fields in the 16-bit tag
    that every count word carries)."""
    layout_hash = ((hidden // 128) * 2654435761 + num_experts * 40503 + max_tokens) % 127
    return (num_topk | int(bool(use_fp8)) << 6 | int(bool(round_scale)) << 7 | int(bool(use_ue8m0)) << 8 |
            layout_hash << 9 | (hidden // 128) << 16 | num_experts << 24 | max_tokens << 35)


def decode_dispatch_signature(word: int) -> dict:
    """{field: value} of a signature (LL_DISPATCH_FIELDS order; the call's generation in bits 52-61, as the
    kernels carry it, is ignored); of a tag-only one (the source's count word reached this rank before its
    signature word), only top-k and the FP8 flags."""
    fields = {"top-k": word & 0x3F, "use_fp8": bool(word >> 6 & 1), "round_scale": bool(word >> 7 & 1),
              "use_ue8m0": bool(word >> 8 & 1)}
    if not word & _TAG_ONLY:
        fields = {"hidden": (word >> 16 & 0xFF) * 128, "num_max_dispatch_tokens_per_rank": word >> 35 & 0x1FFFF,
                  "num_experts": word >> 24 & 0x7FF, **fields}
    return {f: fields[f] for f in LL_DISPATCH_FIELDS if f in fields}


def _show(fields: dict) -> str:
    return ", ".join(f"{k}={('yes' if v else 'no') if isinstance(v, bool) else v}" for k, v in fields.items())


def signature_mismatch(info, rank: int) -> SignatureMismatch:
    """The error of a Buffer whose dispatch found a source whose call does not agree with its own: info = (call,
    source, seen, mine) as the runtime's signature_info gives it. Every rank raises its own (no collective): each
    names its own fields and the source's, so the ranks' messages together show every rank's call."""
    call, source, seen, mine = info
    unusable = "this Buffer is unusable now: destroy it on every rank and create a new one"
    ours, theirs = decode_dispatch_signature(mine), decode_dispatch_signature(seen)
    if seen & _BAD_COUNT:  # a count word with this call's tag whose count is past num_max_dispatch_tokens_per_rank
        count = (seen & 0xFFFF) - 1
        return SignatureMismatch(
            f"low-latency dispatch: rank {source}'s count word in rank {rank}'s buffer carried the tag of rank "
            f"{rank}'s call ({_show(ours)}) but the count {count}, outside [0, "
            f"{ours['num_max_dispatch_tokens_per_rank']}]: a rank whose call differs in a way the tag does not "
            f"show, or a stray store, wrote it (found by rank {rank}'s low-latency call {call} of this Buffer); "
            f"{unusable}")
    if seen == mine:  # rank `source` agrees, but a count word of its here carried another tag: another rank's
        # call, laid out differently, stored over it
        return SignatureMismatch(
            f"low-latency dispatch: the ranks' calls do not agree: a rank whose call differs from rank {rank}'s "
            f"({_show(ours)}) stored over rank {source}'s count word in rank {rank}'s buffer (found by rank "
            f"{rank}'s low-latency call {call} of this Buffer); {unusable}")
    differ = [f for f in theirs if theirs[f] != ours[f]]
    if seen & _TAG_ONLY and (seen >> 9 & 0x7F) != (mine >> 9 & 0x7F):
        differ.append(" or ".join(_LAYOUT_FIELDS))
    what = "; ".join(f"{f} differs" for f in differ) or "the signatures differ"
    return SignatureMismatch(
        f"low-latency dispatch: the ranks' calls do not agree: {what}: rank {rank} called with {_show(ours)}; rank "
        f"{source} with {_show(theirs)} (found by rank {rank}'s low-latency call {call} of this Buffer, in its "
        f"receive from rank {source}); {unusable}")


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
