"""The compiled (CUDA) backends. `create(buffer)` returns the object that serves a Buffer's CUDA calls, or
None with the reason it cannot (no extension, CPU group, kernels not built for this case).

A backend is a moe_dispatcher.backend.Backend (its capabilities say what it serves): get_dispatch_layout, dispatch,
cached_dispatch, combine (the signatures of reference.ReferenceNormal), low_latency_dispatch,
low_latency_combine, next_combine_buffer, clean_low_latency_buffer, local_buffer_tensor, destroy.

Collective: every rank of the Buffer's group calls create_backends() at the same point. A failure on one rank (an
allocation, an IPC open, a bad local setting) raises CreationFailed on every rank (see create_backends).
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import _ext
from ..env import env_float
from ..reference.board import CreationFailed, on_every_rank

# A compiled kernel that waits longer than this for a peer records what it waited for and stops (the
# backends' timeout_message says which rank); one setting for every compiled backend.
TIMEOUT_ENV = "MOE_DISPATCHER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 10.0


class NvlinkMappings:
    """Creation-failure cleanup of a normal-mode backend (intranode, internode) that holds an IpcBuffer `_ipc`
    (its NVLink buffer, mapped by its peers once connected) and a PeerPool `peer_pool` or None. Listed before
    Backend among the bases, so that these override Backend's defaults."""

    def close_mappings(self) -> None:
        """Creation failed after connect(): close the pool and this rank's mappings of the peers' buffers."""
        if self.peer_pool is not None:
            self.peer_pool.close()
        self._ipc.close()

    def discard(self) -> None:
        """Creation failed before start() and no peer maps this rank's NVLink buffer (any more): free it now."""
        self.close_mappings()
        self._ipc.destroy()


def kernel_timeout_s() -> float:
    """Seconds from $MOE_DISPATCHER_TIMEOUT_S: a finite number > 0, default 10 (read when a backend is built)."""
    return env_float(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, greater_than=0)


# Where a cached call's plan launches (LaunchMode in csrc/bindings/stream_join.h): on the current stream as it is
# (the full path: the Buffer made the comm stream current after ordering it), on the comm stream after the
# caller's stream (async_finish: the call returns an event), or on the caller's stream itself (a synchronous
# call: no event to record or wait for). Every launch that uses a Buffer is ordered after the previous one by
# the backend's CommStream, whichever stream each went to.
LAUNCH_CURRENT, LAUNCH_ASYNC, LAUNCH_SYNC = 0, 1, 2


class HandleState:
    """backend_state of a DispatchHandle from a backend whose cached calls run from native plans (intranode,
    internode).

    routing:        the backend's tables of the handle (intranode: (num_channels, recv_channel_offset, direct), direct
                    None or, for a direct dispatch's handle, (send_row_offset, row_of_token); internode:
                    (num_channels, recv_channel_offset, fwd_offset, fwd_mask, fwd_capacity, fwd_row_offset,
                    fwd_rows), fwd_rows None without a peer pool).
    dispatch_plans: [the native plan of the latest cached dispatch of plain rows, that of FP8 rows with scales],
                    None before the first such call; combine_plans likewise, [without, with top-k weights]. A plan
                    is a function that owns its native CachedCall (csrc/bindings/cached_call.h, plan_function):
                    plan(handle, x, aux, config, num_sms, mode) -> (output, aux output or None, event or None), or
                    None when the call is not the one it was made for. One slot per kind, so
                    that a model alternating the kinds on a handle (combine, then combine with weights in the
                    backward) keeps both. A plan holds the handle's routing tensors but not the handle (the
                    handle owns it), so dropping the handle frees everything at once.
    """

    __slots__ = ("routing", "dispatch_plans", "combine_plans")

    def __init__(self, routing: tuple) -> None:
        self.routing = routing
        self.dispatch_plans: list = [None, None]
        self.combine_plans: list = [None, None]


def run_cached(backend, plans: list, kind: int, make: Callable, handle, x: torch.Tensor, aux: Optional[torch.Tensor],
               config) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The full path of a cached call (dispatch along a handle, or combine) of a backend with native plans, on the
    current stream: the handle's plan of this kind (plans[kind], a slot of its HandleState) when it takes these
    arguments, else a new one (make(x, aux, handle, config): the backend's checks, then the plan, kept for the
    Buffer's fast path); a plan that will not launch (buffer destroyed, timeout recorded) raises through
    backend.refused(). -> (output, aux output or None)."""
    num_sms = backend._buffer_cls.num_sms
    plan = plans[kind]
    result = plan(handle, x, aux, config, num_sms, LAUNCH_CURRENT) if plan is not None else None
    if result is None:
        plan = plans[kind] = make(x, aux, handle, config)
        result = plan(handle, x, aux, config, num_sms, LAUNCH_CURRENT)
        if result is None:
            backend.refused()
    return result[0], result[1]


def wait_counts(backend, seq: int, flag_layout_mismatch: int) -> int:
    """A normal-mode backend's host wait for its notify call `seq` (fresh dispatch without num_worst_tokens) on
    its IpcBuffer mailbox: the rows this rank receives, after the errors notify reported (a timeout, a layout
    that does not match the counts, an earlier num_worst_tokens overflow)."""
    num_recv, flags = backend._ipc.wait_notify(seq, backend.timeout_s + 30.0)
    if num_recv < 0:
        backend._check()
        raise RuntimeError(f"moe_dispatcher {backend.name}: rank {backend.rank}: notify gave up")
    # Both errors below are every rank's alike (notify reported them to all): they post no abort (board.py).
    if flags & flag_layout_mismatch:
        raise on_every_rank(ValueError("dispatch: num_tokens_per_rank does not match is_token_in_rank on some rank "
                                       "(pass the layout that get_dispatch_layout returned for these topk_idx)"))
    overflow = backend._ipc.take_worst_overflow()
    if overflow is not None:
        raise on_every_rank(ValueError(
            f"dispatch: in an earlier dispatch with num_worst_tokens={overflow[2]}, rank {overflow[0]} received "
            f"{overflow[1]} rows; the rows past num_worst_tokens were dropped (the compiled backend reports this at "
            f"the next synchronised dispatch, on every rank; raise num_worst_tokens)"))
    return num_recv


def raise_refused_calls(backend) -> None:
    """check_refused_calls of a normal-mode backend with a notify mailbox (intranode, internode): every rank of the
    group calls it at the same point, after the same calls. Waits (spinning on the host-mapped mailbox, as a
    synchronised dispatch does; no device sync) for the notify of the latest fresh dispatch this backend launched,
    then reports what that dispatch's host wait would have: a recorded timeout or peer abort (RuntimeError /
    PeerError, backend._check), and a refused call (SignatureMismatch on every rank alike, through
    backend._raise_disagreement, the synchronised dispatch's own report: one all-gather of the kept signatures,
    made only when a refusal is pending, which every rank's mailbox records alike once its notify of that call
    completed). Calls with num_worst_tokens never wait for notify, so without this their refusals wait for the
    next synchronised dispatch. A fresh dispatch replayed from a CUDA graph after the latest eager one publishes
    the captured call's number instead: synchronise the replay's stream and make one eager call first."""
    backend._check()
    seq = backend._notified
    if seq:
        num_recv, _ = backend._ipc.wait_notify(seq, backend.timeout_s + 30.0)
        if num_recv < 0:
            backend._check()
            raise RuntimeError(f"moe_dispatcher {backend.name}: rank {backend.rank}: notify gave up")
    backend._raise_disagreement()


def recv_tensors(rows: int, x: torch.Tensor, x_scales: Optional[torch.Tensor], num_scales: int,
                 num_topk: Optional[int]) -> List[Optional[torch.Tensor]]:
    """The outputs of a fresh dispatch receiving `rows` rows: [recv_x, recv_scales or None, recv_topk_idx and
    recv_topk_weights (None when num_topk is None: no topk_idx), recv_src_idx]."""
    dev = x.device
    recv_x = torch.empty(rows, x.shape[1], dtype=x.dtype, device=dev)
    recv_scales = (torch.empty(rows, num_scales, dtype=x_scales.dtype, device=dev)
                   if x_scales is not None else None)
    recv_idx = recv_w = None
    if num_topk is not None:
        recv_idx = torch.empty(rows, num_topk, dtype=torch.int64, device=dev)
        recv_w = torch.empty(rows, num_topk, dtype=torch.float32, device=dev)
    recv_src = torch.empty(rows, dtype=torch.int32, device=dev)
    return [recv_x, recv_scales, recv_idx, recv_w, recv_src]


def combine_tensors(num_tokens: int, x: torch.Tensor, topk_weights: Optional[torch.Tensor], bias: Sequence[torch.Tensor]
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The outputs and biases of a combine with a bias (the launcher's full path): -> (out [T, H] x.dtype,
    out_topk_weights float32 [T, K] or None (no topk_weights), bias0, bias1 (contiguous, or None))."""
    out = torch.empty(num_tokens, x.shape[1], dtype=x.dtype, device=x.device)
    out_w = (torch.empty(num_tokens, topk_weights.shape[1], dtype=torch.float32, device=x.device)
             if topk_weights is not None else None)
    biases = [b.contiguous() for b in bias] + [None, None]
    return out, out_w, biases[0], biases[1]


def buffer_view(raw: Callable[[], torch.Tensor], total: int, dtype: torch.dtype, size: Optional[Sequence[int]],
                offset: int, kind: str) -> torch.Tensor:
    """get_local_buffer_tensor's view: `size` (None: the rest of the buffer) elements of `dtype` from byte
    `offset` of the `total`-byte `kind` ("NVLink", "RDMA", ...) buffer, checked to fit before raw() (the buffer's
    bytes, uint8) is asked for."""
    elem = torch.empty((), dtype=dtype).element_size()
    count = (total - offset) // elem if size is None else int(torch.Size(size).numel())
    if offset < 0 or offset % elem or offset + count * elem > total:
        raise ValueError(f"get_local_buffer_tensor: {count} x {dtype} at offset {offset} does not fit the "
                         f"{total}-byte {kind} buffer")
    view = raw()[offset: offset + count * elem].view(dtype)
    return view.view(*size) if size is not None else view


# TimeoutRecord::status (csrc/kernels/common/timeout_record.h): why a kernel's wait gave up.
STATUS_TIMEOUT = 1
STATUS_PEER_ABORTED = 2  # a peer raised in a Buffer call and posted its abort byte (kernels/common/wait.cuh)


def timeout_message(kernels: str, info, timeout_s: float, env: str, board=None) -> str:
    """The error of a Buffer whose kernels recorded a wait that gave up: info = (status, phase, waiting rank, peer).
    STATUS_PEER_ABORTED: `peer` raised in a Buffer call; its message comes from `board` (the Buffer's
    reference/board.py Board: last_abort_message) when it has one. Otherwise a timeout."""
    status, phase, rank, peer = info
    unusable = "this Buffer is unusable now: destroy it on every rank and create a new one"
    if status == STATUS_PEER_ABORTED:
        said = board.last_abort_message(peer) if board is not None else None
        cause = f"rank {peer} raised: {said}" if said else f"rank {peer} raised (no message)"
        return f"moe_dispatcher {kernels}: {cause} (rank {rank} was waiting in {phase}); {unusable}"
    return (f"moe_dispatcher {kernels}: rank {rank} timed out after {timeout_s:g} s in {phase} waiting for rank "
            f"{peer} (a peer skipped a call, or calls differ between ranks); {unusable} ({env} sets the timeout)")


def posted_by_peer(info) -> bool:
    """Whether a recorded failure (timeout_info's tuple or None) is a peer's abort: this rank then posts none of
    its own (the reference board's rule for PeerError: every waiting rank sees the raising rank's abort itself)."""
    return info is not None and info[0] == STATUS_PEER_ABORTED


def _extension_with(buffer, submodule: str, what: str) -> Tuple[Optional[object], str]:
    """(the `_C` module, "") when `buffer` is on GPUs and `_C` has `submodule`; else (None, why not)."""
    if not torch.cuda.is_available():
        return None, "CUDA is not available in this process"
    if "nccl" not in str(dist.get_backend(buffer.group)).lower():
        return None, "the Buffer's process group has no NCCL backend (GPU tensors need a GPU group)"
    mod = _ext.load()
    if mod is None:
        return None, f"the extension moe_dispatcher._C is not available ({_ext.why_unavailable()})"
    if not hasattr(mod, submodule):
        return None, f"the extension moe_dispatcher._C was built without the {what} kernels"
    return mod, ""


def create_backends(buffer) -> Tuple[Tuple[Optional[object], str], Tuple[Optional[object], str]]:
    """The compiled backends of `buffer` (a Buffer whose backend is not "reference"): ((normal-mode backend or None,
    why not), (low-latency backend or None, why not)).

    Collective, on every rank of the Buffer's group, in steps such that a failure on any rank ends in CreationFailed
    on every rank, within MOE_DISPATCHER_TIMEOUT_S, naming the failing ranks and their errors (no peer is left in a
    collective it would wait in forever):
    1. local: each backend's constructor (the NVLink buffer's cudaMalloc, checks); any error is caught;
    2. round "allocation" (Board.creation_round, on the store under a deadline): every rank's verdict, with what
       the peers need (IPC handle, hostname) and which backends it made; a failure, or backends made on some ranks
       only, raises on every rank, and each rank frees what it allocated (no peer has mapped it);
    3. local: connect() (open the peers' IPC handles, the peer pool); round "connection": every rank's verdict;
       a failure raises on every rank, after each rank closed its mappings and a round "release" confirmed that
       every rank did (then each frees its buffer; a rank missing there: the buffer stays allocated until exit);
    4. start(): NVSHMEM (internode and low-latency backends), entered only when every rank got this far. Its
       unique id travels in one more creation round (runtime/nvshmem.py), so a rank 0 that cannot make it fails
       every rank; NVSHMEM's own collectives (init, malloc, barrier) are out of reach of the rounds.
    The rounds replace the IPC handles' all_gather_object and NVSHMEM's unique-id broadcast: creation makes no
    process-group collective of its own."""
    board = buffer._board
    normal = ll = None
    why, ll_why = "", "the Buffer was not built with low_latency_mode=True"
    error, payload = None, None
    try:
        normal, why = create(buffer)
        if buffer.low_latency_mode:
            ll, ll_why = create_low_latency(buffer)
        payload = (normal is not None, why, ll is not None, ll_why,
                   normal.creation_payload() if normal is not None else None)
    except Exception as exc:  # noqa: BLE001 - every rank learns it in the round below
        error = exc
    made = [b for b in (normal, ll) if b is not None]
    connected = False
    try:
        posts = board.creation_round("allocation", error, payload)
        _same_backends(posts, buffer.rank)
        if normal is not None:  # on every rank alike (_same_backends)
            error = None
            try:
                normal.connect([p[4] for p in posts])
            except Exception as exc:  # noqa: BLE001 - every rank learns it in the round below
                error = exc
            connected = True
            board.creation_round("connection", error)
        for b in made:
            b.start()
    except CreationFailed as failure:
        with contextlib.suppress(Exception):  # the error to raise is CreationFailed, whatever the cleanup meets
            _release_after_failure(board, made, None if connected and failure.missing else connected)
        raise
    except Exception:
        # Anything else (start(): NVSHMEM's init or malloc, the low-latency "buffers zeroed" all-gather timing out
        # or honouring a peer's abort) may come after the peers opened this rank's NVLink buffer, and without a
        # round telling whether they closed it: abandon (never free) every backend made, then raise. Left to
        # garbage collection, the IpcBuffer would free memory the peers still map.
        for b in made:
            with contextlib.suppress(Exception):
                b.abandon()
        raise
    return (normal, why), (ll, ll_why)


def _same_backends(posts: Sequence[tuple], rank: int) -> None:
    """Raise CreationFailed (every rank alike: every rank reads the same posts) unless every rank made the same
    compiled backends (posts: (normal made, why not, low-latency made, why not, payload) per rank)."""
    for made, why, mode in ((0, 1, "normal-mode"), (2, 3, "low-latency")):
        without = [q for q, p in enumerate(posts) if not p[made]]
        if without and len(without) < len(posts):
            reasons = "; ".join(f"rank {q}: {posts[q][why]}" for q in without)
            raise on_every_rank(CreationFailed(
                f"moe_dispatcher: Buffer creation failed on every rank (allocation): the compiled {mode} backend "
                f"serves some ranks but not ranks {without} ({reasons}) (rank {rank})"))


def _release_after_failure(board, backends: Sequence, connected: Optional[bool]) -> None:
    """Creation failed on some rank: free what this rank's backends allocated. Before connect() (connected False)
    no peer maps it; after, every rank closes its mappings first and a last round confirms that every rank did (a
    rank missing there, or at the round that failed (connected None), may still map this rank's buffer: it stays
    allocated until the process exits, as release.py does)."""
    if connected is None:
        for b in backends:
            b.abandon()
        return
    if connected:
        for b in backends:
            b.close_mappings()
        try:
            board.creation_round("release", None)
        except CreationFailed:
            for b in backends:
                b.abandon()
            return
    for b in backends:
        b.discard()


def create(buffer) -> Tuple[Optional[object], str]:
    """The normal-mode backend for `buffer` (intranode for one NVLink domain, internode for several), or None
    and the reason. Local: the backend's constructor allocates; create_backends connects and starts it."""
    mod, why = _extension_with(buffer, "intranode", "intranode")
    if mod is None:
        return None, why
    topo = buffer.topology
    if not topo.is_single_domain:
        return _create_internode(buffer, mod)
    if not 2 <= topo.num_ranks <= mod.intranode.MAX_RANKS:
        return None, (f"the compiled kernels serve one NVLink domain of 2 to {mod.intranode.MAX_RANKS} GPUs; this "
                      f"group has {topo.num_ranks} ranks")
    if buffer.num_nvl_bytes == 0:
        return None, "the Buffer has no NVLink buffer (num_nvl_bytes=0)"
    from .intranode import IntranodeBackend
    return IntranodeBackend(buffer), ""


def internode_decision(topology, num_nvl_bytes: int, num_rdma_bytes: int, has_internode: bool,
                       max_ranks: int = 64) -> str:
    """Why the internode backend cannot serve a multi-domain Buffer ("" when it can). Torch-free, so the
    CPU tests check it; a too-small (non-zero) num_rdma_bytes is a ValueError raised by the backend."""
    if not has_internode:
        return "the extension moe_dispatcher._C was built without the internode kernels"
    if topology.num_ranks > max_ranks:
        return f"the internode kernels serve at most {max_ranks} ranks; this group has {topology.num_ranks}"
    if num_rdma_bytes == 0:
        return (f"the group spans {topology.num_domains} NVLink domains of {topology.nvl_size} and the Buffer has no "
                f"NVSHMEM buffer (num_rdma_bytes=0; size it with Config.get_rdma_buffer_size_hint)")
    if num_nvl_bytes == 0:
        return "the Buffer has no NVLink buffer (num_nvl_bytes=0)"
    return ""


def _create_internode(buffer, mod) -> Tuple[Optional[object], str]:
    why = internode_decision(buffer.topology, buffer.num_nvl_bytes, buffer.num_rdma_bytes,
                             hasattr(mod, "internode"),
                             getattr(getattr(mod, "internode", None), "MAX_RANKS", 64))
    if why:
        return None, why
    from .internode import InternodeBackend
    return InternodeBackend(buffer), ""


def create_low_latency(buffer) -> Tuple[Optional[object], str]:
    """The low-latency (NVSHMEM) backend for a Buffer(low_latency_mode=True), or None and the reason. Local like
    create(): its start() (create_backends) bootstraps NVSHMEM and allocates, collectively."""
    mod, why = _extension_with(buffer, "low_latency", "low-latency")
    if mod is None:
        return None, why
    if buffer.num_rdma_bytes == 0:
        return None, "the Buffer has no NVSHMEM buffer (num_rdma_bytes=0)"
    from .low_latency import LowLatencyBackend
    return LowLatencyBackend(buffer), ""
