"""Buffer: the DeepEP V1-compatible entry point for expert-parallel dispatch and combine.

A Buffer belongs to one process group (the expert-parallel group). Each call validates its inputs, picks the
backend that serves them (the compiled kernels for CUDA tensors when they are built and cover the case; the
reference backend in plain torch.distributed otherwise, or when asked), and applies the stream semantics of
`previous_event` / `async_finish` / `allocate_on_comm_stream`. docs/semantics.md defines what each call
computes; the signatures are DeepEP V1's (docs/semantics.md lists the surface).
"""
from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _ext
from . import config as _config
from .compiled import LAUNCH_ASYNC, LAUNCH_SYNC, HandleState, buffer_view
from .compiled import kernel_timeout_s as _kernel_timeout_s
from .backend import Backend, Capabilities
from .config import Config
from .env import env_choice, env_flag, env_int
from .event import EventOverlap
from .expert_major import ExpertMajorHandle
from .handle import DispatchHandle, LowLatencyHandle
from .reference import ReferenceLowLatency, ReferenceNormal
from .reference.normal import layout_problem
from .reference.board import Board, CollectiveTimeout, CreationFailed, PeerError, on_every_rank, posts_abort
from .reference.comm import agree, all_gather_rows
from .runtime import ll_layout, release
from .signature import Signature, dispatch_signature
from .topology import NVL_SIZE_ENV, Topology
from .topology import exchange as topology_exchange
from .validation import (check_combine_weights, check_count, check_flag_exclusive, check_num_experts, check_row_bytes,
                         check_tensor, check_topk_idx, check_topk_weights, normalise_bias, split_x)

BACKEND_ENV = "MOE_DISPATCHER_BACKEND"
BACKENDS = ("auto", "reference", "kernels")
# The low-latency combine's reduction order (docs/semantics.md, "Low-latency combine"), when the Buffer's
# low_latency_combine_reduction argument is not given: "per_rank" (the default) or "per_expert".
LL_COMBINE_ENV = "MOE_DISPATCHER_LL_COMBINE"
LL_COMBINE_REDUCTIONS = ("per_rank", "per_expert")
# Debug switch: a fresh dispatch served by the compiled kernels checks its layout against topk_idx in full and
# agrees on its whole signature in one all-gather (moe_dispatcher.signature); the reference backend always does.
CHECK_LAYOUT_ENV = "MOE_DISPATCHER_CHECK_LAYOUT"
COMM_REFUSED = ("Buffer(comm=...): an mpi4py communicator is not supported by moe_dispatcher; pass a "
                "torch.distributed process group as `group`")
# The EventOverlap of a synchronous fast-path call (nothing to wait for): one shared, eventless instance, since
# making one per call is a measurable share of a cached call's host time.
_NO_EVENT = EventOverlap()

_tokens = itertools.count(1)

Tensor = torch.Tensor
XType = Union[Tensor, Tuple[Tensor, Tensor]]


class Buffer:
    """Communication buffer of one expert-parallel group.

    Args (DeepEP V1's, all accepted by keyword):
        group: the ProcessGroup tokens are exchanged over (default: the world).
        num_nvl_bytes: NVLink (CUDA IPC) buffer per GPU for normal mode; see Config.get_nvl_buffer_size_hint.
        num_rdma_bytes: NVSHMEM symmetric buffer per GPU for low-latency and internode normal mode.
        low_latency_mode: enable low_latency_dispatch / low_latency_combine.
        num_qps_per_rank: InfiniBand queue pairs per peer (no effect on NVLink-only machines).
        allow_nvlink_for_low_latency_mode: let low-latency kernels store to peers over NVLink when NVSHMEM
            maps them; False sends everything through NVSHMEM puts.
        allow_mnnvl, use_fabric, enable_shrink: multi-node NVLink fabric and elastic shrinking: not supported.
        comm: an mpi4py communicator in place of `group`: not supported (ignored when `group` is given, as in
            DeepEP V1).
        explicitly_destroy: accepted for compatibility: destroy() and garbage collection both release the
            buffer safely (see destroy).
    Ours:
        backend: "auto" (default, or env MOE_DISPATCHER_BACKEND), "reference" or "kernels" (error if the
            compiled kernels cannot serve a CUDA call instead of falling back).
        topology: a Topology to use instead of finding NVLink domains from the group.
        low_latency_combine_reduction: the order low_latency_combine sums in (default: env
            MOE_DISPATCHER_LL_COMBINE, else "per_rank"). "per_rank": the rows of a token's experts on one rank
            are summed there (weighted, float32) and that partial sum travels back as bf16 when it has two
            terms or more, then the ranks' terms are added; ~2.2x fewer bytes at top-8 of 256 experts on 4
            ranks (the order DeepEP's normal-mode combine uses across ranks). "per_expert": every row travels
            back and is summed in top-k order (DeepEP V1's low-latency combine). Settable between calls, on
            every rank alike.
        num_pool_bytes: bytes of peer pool per GPU (default 0: none): torch tensors that every GPU of the NVLink
            domain has mapped, from `peer_pool` (moe_dispatcher/compiled/peer_pool.py; compiled intranode and
            internode backends). The same on every rank.
    """

    # DeepEP V1's class attribute: reads as 20. Until set_num_sms (or an assignment) replaces it, each fresh
    # dispatch without a Config takes its SM count from config.default_num_sms (group size, NVLink, row bytes).
    num_sms: int = _config.DefaultNumSms(20)

    def __init__(self, group: Optional[dist.ProcessGroup] = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm: Optional[object] = None, *,
                 backend: Optional[str] = None, topology: Optional[Topology] = None,
                 low_latency_combine_reduction: Optional[str] = None, num_pool_bytes: int = 0) -> None:
        comm_only = group is None and comm is not None
        if not dist.is_initialized():
            if comm_only:
                raise NotImplementedError(COMM_REFUSED)
            raise RuntimeError("Buffer needs torch.distributed to be initialised (init_process_group) first")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        # The reference backend's deadline and arrival board (MOE_DISPATCHER_TIMEOUT_S; reference/board.py), made
        # first, on every rank: an error raised below on some ranks only posts its abort there, and the peers
        # waiting in a creation collective (the signature's all-gather, a creation round of the compiled
        # backends) raise CreationFailed naming the rank instead of waiting (docs/semantics.md, "Errors at
        # Buffer creation").
        self._board = Board(self.group, self.rank, self.group_size)
        try:
            self._create(num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                         allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric, explicitly_destroy, enable_shrink,
                         comm_only, backend, topology, low_latency_combine_reduction, num_pool_bytes)
        except CollectiveTimeout as exc:
            # A peer never came: it may still come, complete its collective against this rank's pending one and
            # go on alone. So this rank posts its abort (as Board.creation_round does for a missing peer), and
            # that peer fails at its next collective instead.
            failure = CreationFailed(f"moe_dispatcher: Buffer creation failed: {exc}")
            self._board.post_abort(failure)
            raise failure from exc
        except PeerError as exc:  # a peer raised (its abort): the creation failed on every rank
            raise on_every_rank(CreationFailed(f"moe_dispatcher: Buffer creation failed: {exc}")) from exc
        except BaseException as exc:
            self._board.post_abort(exc)  # (not for errors every rank raises alike: board.posts_abort)
            raise

    def _create(self, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool, num_qps_per_rank: int,
                allow_nvlink_for_low_latency_mode: bool, allow_mnnvl: bool, use_fabric: bool, explicitly_destroy: bool,
                enable_shrink: bool, comm_only: bool, backend: Optional[str], topology: Optional[Topology],
                low_latency_combine_reduction: Optional[str], num_pool_bytes: int) -> None:
        """__init__ past the board (the arguments are __init__'s)."""
        for flag, name in ((allow_mnnvl, "allow_mnnvl"), (use_fabric, "use_fabric"), (enable_shrink, "enable_shrink")):
            if flag:
                raise NotImplementedError(f"Buffer({name}=True) is not supported by moe_dispatcher")
        if comm_only:  # here, past the board: peers of a rank that passed it alone fail fast (its abort)
            raise NotImplementedError(COMM_REFUSED)
        for value, name in ((num_nvl_bytes, "num_nvl_bytes"), (num_rdma_bytes, "num_rdma_bytes"),
                            (num_qps_per_rank, "num_qps_per_rank"), (num_pool_bytes, "num_pool_bytes")):
            check_count(name, value)
        backend = backend or env_choice(BACKEND_ENV, BACKENDS, "auto")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self._check_layout = env_flag(CHECK_LAYOUT_ENV)  # read before any collective: a bad value fails alike
        # Every rank must make the same Buffer: sizes that differ would let a kernel write past a peer's
        # allocation, and a domain size set on some ranks only would split the hostname exchange below.
        nvl_size = topology.nvl_size if topology is not None else env_int(NVL_SIZE_ENV, 0, minimum=1)
        self._agree(Signature("Buffer creation", (
            num_nvl_bytes, num_rdma_bytes, bool(low_latency_mode), nvl_size, backend, num_qps_per_rank,
            bool(allow_nvlink_for_low_latency_mode), bool(explicitly_destroy), num_pool_bytes,
            bool(self._check_layout))))  # the layout check adds a gather to every fresh dispatch: on every rank or none
        # The topology exchange: one bounded creation round on the Board (a rank that never comes is named, on every
        # rank that came, after MOE_DISPATCHER_TIMEOUT_S), made by every rank, given a topology or not: a rank given
        # one and a rank finding its own from MOE_DISPATCHER_NVL_SIZE pass the same signature above, and the
        # second must not wait for the first.
        if topology is None:
            self.topology = Topology.from_group(self.group, board=self._board)
        else:
            topology_exchange(self.group, self._board)
            self.topology = topology
        if (self.topology.rank, self.topology.num_ranks) != (self.rank, self.group_size):
            raise ValueError(f"topology describes rank {self.topology.rank} of {self.topology.num_ranks}, but this "
                             f"process is rank {self.rank} of {self.group_size} in the group")
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.num_pool_bytes = num_pool_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.backend = backend
        self._kernels_ll = None
        self.low_latency_combine_reduction = (low_latency_combine_reduction
                                              or env_choice(LL_COMBINE_ENV, LL_COMBINE_REDUCTIONS, "per_rank"))
        self._token = next(_tokens)
        self._destroyed = False
        self._comm_stream: Optional[torch.cuda.Stream] = None
        self._events: Optional[Tuple[torch.cuda.Event, torch.cuda.Event]] = None
        self._local_buffers: dict = {}
        nvl = self.topology.nvl_size
        self._reference_normal = ReferenceNormal(self.group, self.rank, self.group_size, nvl, self._token,
                                                 self._board, type(self))
        self._reference_ll = ReferenceLowLatency(self.group, self.rank, self.group_size, self._token,
                                                 self._stream_scope, self._ll_combine_reduction == "per_rank",
                                                 self._board)
        self._kernels = self._kernels_ll = None
        self._kernels_why = self._kernels_ll_why = "Buffer(backend='reference') was asked for"
        # A collective point: NVSHMEM buffers of collected Buffers that every rank parked are freed here (before
        # this Buffer allocates its own).
        release.collective_point(self.group, self.rank, self.group_size, self._board.timeout_s,
                                 f"create-{self._board.ordinal}", self._board)
        # The release of the compiled backends' memory (destroy(), garbage collection, exit): runtime/release.py.
        self._release = release.Release(self._board.store, self.group, self.rank, self.group_size,
                                        self._board.timeout_s, _kernel_timeout_s(), self._board.ordinal)
        if backend != "reference":
            from . import compiled  # collective: a failure on any rank raises CreationFailed on every rank
            (self._kernels, self._kernels_why), (self._kernels_ll, self._kernels_ll_why) = \
                compiled.create_backends(self)
        # Low-latency fast path (see low_latency_dispatch): call key -> the compiled backend's method.
        self._ll_dispatch_runs: dict = {}
        self._ll_combine_runs: dict = {}
        self._resolved: dict = {}  # (mode, device type, call facts) -> Backend: _resolve's decisions
        self._pending_row_checks: List[Tuple[Tensor, int]] = []
        if self._kernels is not None or self._kernels_ll is not None:
            release.register(self, any(k is not None and k.symmetric for k in (self._kernels, self._kernels_ll)))

    def _agree(self, signature: Signature) -> None:
        """Collective: raise SignatureMismatch on every rank unless every rank passed an equal `signature` (one
        small all-gather under the Board's deadline, the reference backend's agreement row)."""
        device = torch.device("cpu")
        if torch.cuda.is_available() and "nccl" in str(dist.get_backend(self.group)).lower():
            device = torch.device("cuda", torch.cuda.current_device())
        agree(self._board, signature, device)

    @property
    def low_latency_combine_reduction(self) -> str:
        """"per_rank" or "per_expert": the order low_latency_combine sums in (see the class docstring)."""
        return self._ll_combine_reduction

    @low_latency_combine_reduction.setter
    def low_latency_combine_reduction(self, value: str) -> None:
        if value not in LL_COMBINE_REDUCTIONS:
            raise ValueError(f"low_latency_combine_reduction must be one of {LL_COMBINE_REDUCTIONS}, got {value!r} "
                             f"(or set {LL_COMBINE_ENV})")
        self._ll_combine_reduction = value
        for backend in (getattr(self, "_reference_ll", None), getattr(self, "_kernels_ll", None)):
            if backend is not None:
                backend.set_rank_partials(value == "per_rank")

    # ------------------------------------------------------------------ static helpers (DeepEP V1)
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True when the extension was built with Hopper (sm_90) kernels."""
        mod = _ext.load()
        return bool(mod is not None and getattr(mod, "is_sm90_compiled", lambda: False)())

    @classmethod
    def set_num_sms(cls, new_num_sms: int) -> None:
        """SMs the normal-mode kernels use when a call passes no Config (even: one channel per pair). Setting it
        replaces the default choice (config.default_num_sms) for every later call; setting back the value read
        from Buffer.num_sms before restores whatever it was."""
        check_count("num_sms", new_num_sms, 1)
        if new_num_sms % 2:
            raise ValueError(f"num_sms must be a positive even int, got {new_num_sms!r}")
        cls.num_sms = new_num_sms

    @classmethod
    def _config_num_sms(cls, num_ranks: int) -> int:
        """num_sms of get_dispatch_config / get_combine_config: the one set, else the largest default choice."""
        num_sms = cls.num_sms
        return _config.default_num_sms_bound(num_ranks) if _config.is_default_num_sms(num_sms) else num_sms

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> Config:
        """Tuned dispatch Config at Buffer.num_sms SMs (while that is the default: at the largest count the default
        rule can choose for `num_ranks`, so that buffers sized from it fit every default choice)."""
        return _config.get_dispatch_config(num_ranks, cls._config_num_sms(num_ranks))

    @classmethod
    def get_combine_config(cls, num_ranks: int) -> Config:
        """Tuned combine Config, num_sms as get_dispatch_config's."""
        return _config.get_combine_config(num_ranks, cls._config_num_sms(num_ranks))

    def _fresh_config(self, config: Optional[Config], data: Tensor) -> Optional[Config]:
        """The Config of a fresh dispatch of rows like `data` (its channel count becomes the handle's): the one
        given; else, while Buffer.num_sms is the default, the tuned chunks at config.default_num_sms for this
        group and row size (facts every rank shares, so every rank picks the same count); else None (the
        backend's default at Buffer.num_sms)."""
        if config is not None or not _config.is_default_num_sms(type(self).num_sms):
            return config
        row_bytes = data.shape[1] * data.element_size() if data.dim() == 2 else 0
        if row_bytes <= 0:
            return None
        sms = _config.default_num_sms(self.group_size, self.topology.is_single_domain, row_bytes,
                                      direct=self.num_pool_bytes > 0)
        return _config.get_dispatch_config(self.group_size, sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of NVSHMEM buffer per GPU that low-latency mode needs: two halves, each holding a send
        region, a receive region and the signal words, as csrc/kernels/low_latency/layout.h lays them out
        (read through moe_dispatcher._layout, on any machine). Never above DeepEP V1's formula
        (tests/kernels/test_low_latency_layout.py)."""
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
                            ("num_ranks", num_ranks), ("num_experts", num_experts)):
            check_count(name, value, 1)
        return ll_layout.buffer_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    # ------------------------------------------------------------------ lifetime and streams
    def destroy(self) -> None:
        """Release the buffer's memory and peer mappings; later calls raise. Collective: call it on every rank (it
        is a no-op on a Buffer already destroyed).

        Each rank waits for its GPU's work and stops using its peers' memory, then waits (up to
        MOE_DISPATCHER_TIMEOUT_S; the compiled kernels' timeout once a kernel timed out) until every peer has done
        the same; only then is the memory that peers mapped freed. A peer that never arrives (dead, or not calling
        destroy()) leaves this rank's memory allocated until the process exits, and destroy() raises naming it.
        Tensors from get_local_buffer_tensor and get_next_low_latency_combine_buffer stay valid: they keep their
        memory (the NVSHMEM buffer, while such a tensor lives on any rank, stays allocated until the process
        exits). Garbage collection releases a Buffer too, without waiting for anyone (runtime/release.py)."""
        if self._destroyed:
            return
        backends = self._drop_backends()
        release.collective_point(self.group, self.rank, self.group_size, self._board.timeout_s,
                                 f"destroy-{self._board.ordinal}")
        self._release.collective(backends)

    def _drop_backends(self) -> list:
        """Mark the Buffer destroyed and take its compiled backends out of it (every reference it holds)."""
        self._destroyed = True
        release.forget(self)
        backends = [k for k in (self._kernels, self._kernels_ll) if k is not None]
        self._kernels = self._kernels_ll = None
        for name in ("_local_buffers", "_ll_dispatch_runs", "_ll_combine_runs", "_resolved"):
            getattr(self, name, {}).clear()  # (all of them exist unless __init__ raised)
        return backends

    def __del__(self) -> None:
        # Garbage collection comes at a different moment on each rank, so it never waits for peers: the backends
        # stop and are parked until every peer has posted its own release (runtime/release.py).
        if getattr(self, "_destroyed", True) or not hasattr(self, "_release"):
            return
        with contextlib.suppress(Exception):
            self._release.park(self._drop_backends())

    def _release_at_exit(self) -> None:
        """The interpreter exits with this Buffer alive: park it as garbage collection would."""
        if not self._destroyed:
            self._release.park(self._drop_backends())

    def _post_abort(self, exc: BaseException) -> None:
        """This rank raises `exc` in a Buffer call: let the peers waiting for it fail fast ("rank r raised: ...")
        instead of waiting out their timeout. The reference collectives read the Board (reference/board.py); the
        compiled kernels' waits read this rank's abort byte, which each compiled backend writes on every peer
        (Backend.post_abort) and clears at its next launch. Errors every rank raises alike post nothing
        (board.posts_abort). Never raises: the caller's error is what propagates.

        When the Board's abort goes: this rank's next collective clears it (Board.run), and so does its next call
        that gets past the Buffer's checks: a normal-mode call's native plan that launched (the fast paths of
        dispatch, combine, get_dispatch_layout), any normal-mode full path as it enters _stream_scope (cached or
        fresh, intranode or internode, expert-major), a low-latency call's full path (_first_ll_dispatch /
        _first_ll_combine). The compiled calls never enter the Board, so without that the abort would stay there
        until this rank's next Board collective, possibly many calls later, and a peer waiting in one (a
        low-latency layout change's round, a pending-rows check, an uncached call's agreement) would take it for
        news and raise "rank r raised" about a call every rank has long got past.
        Why clearing at the next call is safe for a peer still waiting in the FAILED call:
        - in a compiled kernel: the kernel reads this rank's abort byte, which the backend clears at the same
          launch (native plans' usable(), the backends' _check); the message it is worded with later stays on the
          Board (Board.last_abort_message).
        - in a Board collective n of that call: it honours the abort after seeing it twice POLL_S apart, and may
          miss it if this rank came back sooner. Then this rank's next communicating call either enters that
          collective n itself (what the Board always allowed a rank that comes back: board.py), or launches kernels
          that wait for the peer's next call, which cannot come while the peer waits in collective n: they time
          out (MOE_DISPATCHER_TIMEOUT_S, the kernels'), this rank's next call raises that timeout and posts its
          abort again (for the same n: no Board collective came between), and the peer raises it. A rank that
          never calls again is named by the peer's own timeout. So the peer still raises, bounded by the kernels'
          timeout instead of at once."""
        self._board.post_abort(exc)
        if not posts_abort(exc):
            return
        # The compiled low-latency calls never enter the Board (one native call on the fast path) and their
        # runtime's checks come after the fast path's lookup: forget the fast paths, so that this rank's next
        # low-latency call takes the full one, which clears the abort posted here.
        self._ll_dispatch_runs.clear()
        self._ll_combine_runs.clear()
        with contextlib.suppress(Exception):
            if torch.cuda.is_current_stream_capturing():  # no CUDA work outside a capture in progress: the peers
                return                                     # (capturing too, launching nothing) wait for no one
        for kernels in (self._kernels, self._kernels_ll):
            if kernels is not None:
                with contextlib.suppress(Exception):
                    kernels.post_abort()

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed")

    @property
    def peer_pool(self):
        """The PeerPool of this rank (moe_dispatcher/compiled/peer_pool.py): torch tensors in memory every GPU of the
        NVLink domain has mapped. Needs Buffer(num_pool_bytes=N > 0) served by the compiled intranode or internode
        backend (internode: the pool's ranks are the local ranks of this rank's domain); RuntimeError otherwise, or
        once the Buffer is destroyed (its tensors stay valid: destroy() defers the free of the pool's memory until
        the last of them is gone)."""
        self._check_alive()
        pool = getattr(self._kernels, "peer_pool", None)
        if pool is not None:
            return pool
        if self.num_pool_bytes == 0:
            why = "the Buffer has no peer pool (num_pool_bytes=0)"
        elif self._kernels is None:
            why = f"the compiled kernels do not serve this Buffer: {self._kernels_why}"
        else:
            why = (f"only the intranode and internode backends have a peer pool; this Buffer's is "
                   f"{self._kernels.name}")
        raise RuntimeError(f"Buffer.peer_pool: {why}")

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The CUDA stream communication kernels run on: of the highest priority, as DeepEP V1's, so that beside
        kernels of other streams (GEMMs) the block scheduler starts the exchange's blocks first; they wait on
        their peers' blocks, which then are not left queued behind GEMM blocks."""
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
        return self._comm_stream

    @staticmethod
    def capture() -> EventOverlap:
        """An EventOverlap for the work queued so far on the current stream (nothing on a CPU machine)."""
        if not torch.cuda.is_available():
            return EventOverlap()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[Sequence[int]] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Tensor:
        """A typed view of this rank's NVLink (or NVSHMEM) buffer, from byte `offset`."""
        self._check_alive()
        kernels = self._kernels_ll if use_rdma_buffer else self._kernels
        if kernels is not None:
            return kernels.local_buffer_tensor(dtype, size, offset, use_rdma_buffer)
        total = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes

        def raw() -> Tensor:
            if use_rdma_buffer not in self._local_buffers:
                cuda = torch.cuda.is_available()
                dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
                self._local_buffers[use_rdma_buffer] = torch.zeros(total, dtype=torch.uint8, device=dev)
            return self._local_buffers[use_rdma_buffer]
        return buffer_view(raw, total, dtype, size, offset, "RDMA" if use_rdma_buffer else "NVLink")

    def _stream_scope(self, device: torch.device, previous_event: Optional[EventOverlap], async_finish: bool,
                      allocate_on_comm_stream: bool, run: Callable[[], tuple],
                      keep: Sequence) -> Tuple[tuple, EventOverlap]:
        """Run `run` with DeepEP's stream semantics and return (its results, EventOverlap).

        A synchronous call without previous_event runs on the caller's current stream: what the caller queues
        next comes after it by stream order, with no event, no stream switch and no record_stream (the compiled
        backend's launch order makes its kernels follow the Buffer's latest launch, csrc/bindings/stream_join.h).
        Otherwise the work goes on the comm stream, which first waits for `previous_event` (or the current
        stream); async_finish returns an event the caller waits on, else the current stream waits now.
        Memory safety across the two streams (the caching allocator reuses a block as soon as its owner
        stream's queued work allows):
        - outputs are allocated while the comm stream is current, so they are recorded on the current
          (compute) stream, which uses them next, unless allocate_on_comm_stream asks for comm ownership;
        - inputs (`keep`) are recorded on the comm stream only with async_finish: without it the compute
          stream waits for the comm stream before anything it queues later (a free included) can run.
        """
        if allocate_on_comm_stream and previous_event is None and device.type == "cuda":
            raise ValueError("allocate_on_comm_stream=True needs previous_event (the comm stream must wait for "
                             "the work that produced the inputs)")
        if self._board.abort_posted:  # the call got past the Buffer's checks: this rank is back (see _post_abort)
            self._board.clear_abort()
        if device.type != "cuda":
            return run(), EventOverlap()
        order = self._kernels.launch_order if self._kernels is not None else None
        if previous_event is None and not async_finish:
            if order is not None:
                order.enter_current()
            return run(), EventOverlap()
        compute = torch.cuda.current_stream(device.index if device.index is not None else None)
        comm = self._comm_stream if self._comm_stream is not None else self.get_comm_stream()
        joined = previous_event is None or previous_event.event is None
        if not joined:
            comm.wait_event(previous_event.event)
        else:
            self._sync_event(0).record(compute)
            comm.wait_event(self._sync_event(0))
        if order is not None:  # the kernels' launches on the comm stream follow the latest one (stream_join.h)
            order.enter_full_path(joined, compute.cuda_stream)
        torch.cuda.set_stream(comm)
        try:
            results = run()
        finally:
            torch.cuda.set_stream(compute)
        tensors = [t for t in _flatten(results) if isinstance(t, Tensor)]
        if not allocate_on_comm_stream:
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(compute)
        if async_finish:
            for t in keep:
                if isinstance(t, Tensor) and t.is_cuda:
                    t.record_stream(comm)
            event = torch.cuda.Event()
            event.record(comm)
            return results, EventOverlap(event, extra_tensors=list(keep) + tensors)
        done = self._sync_event(1)
        done.record(comm)
        compute.wait_event(done)
        if order is not None:
            order.caller_joined(compute.cuda_stream)
        return results, EventOverlap()

    def _sync_event(self, i: int) -> torch.cuda.Event:
        """Reusable events of synchronous calls (0: compute -> comm, 1: comm -> compute). Re-recording an
        event is safe: a wait captures the event's state at the moment it is enqueued."""
        events = self._events
        if events is None:
            events = self._events = (torch.cuda.Event(), torch.cuda.Event())
        return events[i]

    # ------------------------------------------------------------------ backend choice
    def _resolve(self, mode: str, device: torch.device, local_experts: Optional[int] = None,
                 combine_dtype: Optional[torch.dtype] = None) -> Backend:
        """The backend that serves a call: the one place that decides between the compiled kernels and the
        reference backend. mode: "normal" or "low_latency"; device: where the call's tensors live;
        local_experts (fresh normal dispatch) and combine_dtype (combine input) are the call facts that
        the compiled backends' Capabilities may not cover. A CUDA call the kernels cannot serve raises with
        Buffer(backend='kernels') and falls back to the reference otherwise, warning once per process and
        reason."""
        key = (mode, device.type, local_experts, combine_dtype)
        backend = self._resolved.get(key)
        if backend is not None:
            return backend
        kernels, why = (self._kernels, self._kernels_why) if mode == "normal" else (self._kernels_ll,
                                                                                       self._kernels_ll_why)
        reference = self._reference_normal if mode == "normal" else self._reference_ll
        backend = reference
        if kernels is not None:
            why = _refusal(kernels.capabilities, mode, device, local_experts, combine_dtype)
            if not why:
                backend = kernels
        if backend is reference and device.type == "cuda":
            if self.backend == "kernels":
                raise RuntimeError(f"Buffer(backend='kernels'): the compiled kernels cannot serve this call: {why}")
            if self.backend == "auto" and why not in _warned_fallbacks:
                _warned_fallbacks.add(why)
                warnings.warn(f"moe_dispatcher: using the reference backend (torch.distributed) for CUDA tensors: "
                              f"{why}", stacklevel=3)
        self._resolved[key] = backend
        return backend

    def _backend_of(self, handle, kinds: tuple) -> Backend:
        """The backend that made `handle` (checked to be one of `kinds` and of this Buffer)."""
        if not isinstance(handle, kinds):
            raise TypeError(f"handle must be a {' or '.join(k.__name__ for k in kinds)} returned by this Buffer, "
                            f"got {type(handle).__name__}")
        if handle.buffer_token != self._token:
            raise RuntimeError("handle was made by another Buffer; pass the handle this Buffer's dispatch returned")
        normal = isinstance(handle, DispatchHandle)
        if handle.backend == "reference":
            return self._reference_normal if normal else self._reference_ll
        kernels = self._kernels if normal else self._kernels_ll
        if kernels is None:
            raise RuntimeError("handle was made by the compiled kernels, which this Buffer no longer holds")
        return kernels

    def _combine_backend(self, handle: DispatchHandle, dtype: torch.dtype) -> Backend:
        """The backend that reduces combine input of `dtype` along `handle`: its maker, or the reference
        when the maker does not reduce that dtype (every handle carries the fields the reference reads)."""
        backend = self._backend_of(handle, (DispatchHandle,))
        if dtype in backend.capabilities.combine_dtypes:
            return backend
        return self._resolve("normal", handle.is_token_in_rank.device, combine_dtype=dtype)

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Per-rank / per-domain / per-expert token counts and the token-to-rank map of a routing.

        topk_idx: int64 [T, K], -1 for unused slots.
        Returns (num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [D] or None for one domain,
        num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R], EventOverlap).
        """
        # Fast path: a synchronous layout on the compiled backend is one native call on the caller's stream; it
        # answers None for arguments it does not take, and the full path below validates them. It joins no launch
        # order: its only write to Buffer memory is the atomic bad-id word, which notify reads and clears
        # atomically (a bad id found beside an unfinished dispatch is reported by the next notify).
        if previous_event is None and not async_finish and not allocate_on_comm_stream and type(topk_idx) is Tensor:
            kernels = self._kernels
            if kernels is not None and kernels.layout_call is not None and type(num_experts) is int:
                out = kernels.layout_call(topk_idx, num_experts, *kernels.layout_args)
                if out is not None:
                    if self._board.abort_posted:  # this rank is back (see _post_abort)
                        self._board.clear_abort()
                    return (*out, _NO_EVENT)
        try:
            self._check_alive()
            check_num_experts(num_experts, self.group_size)
            backend = self._resolve("normal", topk_idx.device)
            check_topk_idx(topk_idx, num_experts,
                           values=topk_idx.device.type == "cpu" or backend is self._reference_normal, distinct=True)
            results, event = self._stream_scope(topk_idx.device, previous_event, async_finish, allocate_on_comm_stream,
                                                lambda: backend.get_dispatch_layout(topk_idx, num_experts), [topk_idx])
            return (*results, event)
        except Exception as exc:  # a peer waiting for this call fails fast (_post_abort)
            self._post_abort(exc)
            raise

    def _check_routing(self, data: Tensor, backend, topk_idx: Optional[Tensor], topk_weights: Optional[Tensor],
                       num_experts: int) -> None:
        """topk_idx / topk_weights of a fresh dispatch (ids checked by value where a sync is free)."""
        if topk_idx is None:
            if topk_weights is not None:
                raise ValueError("topk_weights given without topk_idx")
            return
        check_num_experts(num_experts, self.group_size)
        values = data.device.type == "cpu" or backend is self._reference_normal
        check_topk_idx(topk_idx, num_experts, num_tokens=data.shape[0], device=data.device, values=values,
                       distinct=True)
        if topk_weights is not None:
            check_topk_weights(topk_weights, topk_idx)

    @staticmethod
    def _check_dispatch_options(expert_alignment: int, num_worst_tokens: int, config: Optional[Config]) -> None:
        check_count("expert_alignment", expert_alignment, 1)
        check_count("num_worst_tokens", num_worst_tokens, 0)
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a moe_dispatcher.Config, got {type(config).__name__}")

    def dispatch(self, x: XType, handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[Tensor] = None, num_tokens_per_rdma_rank: Optional[Tensor] = None,
                 is_token_in_rank: Optional[Tensor] = None, num_tokens_per_expert: Optional[Tensor] = None,
                 topk_idx: Optional[Tensor] = None, topk_weights: Optional[Tensor] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token to every rank that holds one of its experts.

        x: [T, H] (bf16/fp16/fp32/fp64), or (fp8 e4m3 [T, H], scales float32/int32 [T, S]); both copied bit-exactly.
        Fresh dispatch: pass the layout from get_dispatch_layout and topk_idx int64 [T, K] / topk_weights
        float32 [T, K] (the layout is computed here if omitted). Cached dispatch: pass `handle` only.
        Returns (recv_x [N, H] (or tuple), recv_topk_idx int64 [N, K] rebased to local experts (-1 elsewhere),
        recv_topk_weights float32 [N, K] (0 where -1), num_recv_tokens_per_expert_list (python ints, rounded
        up to expert_alignment; empty with num_worst_tokens), handle, EventOverlap). Rows are ordered by
        source rank, then source token. Cached mode returns (recv_x, None, None, None, None, EventOverlap).
        """
        # Fast path (docs/intranode.md, "Host path"): a cached dispatch with the stream defaults whose handle holds
        # a native plan (made by the first such call, after every check) is one native call; the plan answers
        # None for arguments unlike those it was made for, and the full path below checks them.
        if (handle is not None and previous_event is None and not allocate_on_comm_stream and topk_idx is None
                and topk_weights is None and type(handle) is DispatchHandle and handle.buffer_token == self._token
                and type(handle.backend_state) is HandleState and type(expert_alignment) is int
                and expert_alignment == 1 and type(num_worst_tokens) is int and num_worst_tokens == 0):
            mode = LAUNCH_ASYNC if async_finish else LAUNCH_SYNC
            if type(x) is Tensor:
                plan = handle.backend_state.dispatch_plans[0]
                try:
                    out = plan(handle, x, None, config, self.num_sms, mode) if plan is not None else None
                except Exception as exc:  # a peer waiting for this call (a direct one) fails fast (_post_abort)
                    self._post_abort(exc)
                    raise
                if out is not None:
                    if self._board.abort_posted:  # this rank is back (see _post_abort)
                        self._board.clear_abort()
                    return out[0], None, None, None, None, (EventOverlap(out[2], (x, out[0])) if async_finish
                                                            else _NO_EVENT)
            elif type(x) is tuple and len(x) == 2 and type(x[0]) is Tensor and type(x[1]) is Tensor:
                plan = handle.backend_state.dispatch_plans[1]
                try:
                    out = plan(handle, x[0], x[1], config, self.num_sms, mode) if plan is not None else None
                except Exception as exc:
                    self._post_abort(exc)
                    raise
                if out is not None:
                    if self._board.abort_posted:  # this rank is back (see _post_abort)
                        self._board.clear_abort()
                    return (out[0], out[1]), None, None, None, None, (EventOverlap(out[2], (*x, out[0], out[1]))
                                                                       if async_finish else _NO_EVENT)
        try:
            self._check_alive()
            data, scales = split_x(x)
            dev = data.device
            self._check_dispatch_options(expert_alignment, num_worst_tokens, config)
            if handle is not None:
                if topk_idx is not None or topk_weights is not None:
                    raise ValueError("cached dispatch (handle given) takes no topk_idx/topk_weights: the routing is "
                                     "the handle's")
                backend = self._backend_of(handle, (DispatchHandle,))
                check_tensor("x", data, shape=(handle.num_tokens, None), device=handle.is_token_in_rank.device)
                (recv_x, recv_scales), event = self._stream_scope(
                    dev, previous_event, async_finish, allocate_on_comm_stream,
                    lambda: backend.cached_dispatch(data, scales, handle, config), [data, scales])
                return (recv_x if scales is None else (recv_x, recv_scales)), None, None, None, None, event

            if num_tokens_per_expert is None and topk_idx is None:
                raise ValueError("dispatch needs either handle (cached mode) or the routing: topk_idx and/or the "
                                 "layout (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)")
            if topk_idx is not None and num_tokens_per_expert is None:
                raise ValueError("dispatch with topk_idx but no num_tokens_per_expert: pass the layout from "
                                 "get_dispatch_layout (it also tells how many experts there are)")
            num_experts = num_tokens_per_expert.numel() if num_tokens_per_expert is not None else 0
            backend = self._resolve("normal", dev, local_experts=num_experts // self.group_size)
            config = self._fresh_config(config, data)
            self._check_routing(data, backend, topk_idx, topk_weights, num_experts)
            if not num_worst_tokens:
                self._check_pending_rows()
            r = self.group_size
            for name, t, dtype, shape in (("num_tokens_per_rank", num_tokens_per_rank, torch.int32, (r,)),
                                          ("is_token_in_rank", is_token_in_rank, torch.bool, (data.shape[0], r)),
                                          ("num_tokens_per_expert", num_tokens_per_expert, torch.int32, (None,))):
                if t is None:
                    raise ValueError(f"dispatch: {name} is required (from get_dispatch_layout)")
                check_tensor(name, t, dtypes=(dtype,), shape=shape, device=dev)
            check_num_experts(num_tokens_per_expert.numel(), r)
            if num_tokens_per_rdma_rank is not None:
                check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, dtypes=(torch.int32,),
                             shape=(self.topology.num_domains,), device=dev)
            if self._check_layout and backend is not self._reference_normal:
                self._agree_layout(data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                   num_tokens_per_expert, config)
            inputs = [data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                      num_tokens_per_expert]
            results, event = self._stream_scope(
                dev, previous_event, async_finish, allocate_on_comm_stream,
                lambda: backend.dispatch(data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                         num_tokens_per_expert, expert_alignment, num_worst_tokens, config), inputs)
            recv_x, recv_scales, recv_idx, recv_w, counts, new_handle = results
            if num_worst_tokens:  # the backend's device counts stay internal (Backend.dispatch)
                counts = []
            return (recv_x if scales is None else (recv_x, recv_scales)), recv_idx, recv_w, counts, new_handle, event
        except Exception as exc:  # a peer waiting for this call fails fast (_post_abort)
            self._post_abort(exc)
            raise

    def combine(self, x: Tensor, handle: DispatchHandle, topk_weights: Optional[Tensor] = None, bias=None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Return each received row to its source and sum the rows of every token (no top-k weighting).

        x: [N, H] in the order dispatch returned (N = rows of that recv_x). topk_weights: float32 [N, K], summed
        the same way. bias: None, a tensor or a pair of tensors [T, H] (x's dtype) added to the sum.
        Returns (combined_x [T, H] x.dtype, combined_topk_weights float32 [T, K] or None, EventOverlap).
        """
        # Fast path: as dispatch's (a combine with a bias takes the full path).
        if (bias is None and previous_event is None and not allocate_on_comm_stream and type(handle) is DispatchHandle
                and handle.buffer_token == self._token and type(handle.backend_state) is HandleState
                and type(x) is Tensor and (topk_weights is None or type(topk_weights) is Tensor)):
            plan = handle.backend_state.combine_plans[topk_weights is not None]
            if plan is not None:
                mode = LAUNCH_ASYNC if async_finish else LAUNCH_SYNC
                try:
                    out = plan(handle, x, topk_weights, config, self.num_sms, mode)
                except Exception as exc:  # a peer waiting for this call (a pull) fails fast (_post_abort)
                    self._post_abort(exc)
                    raise
                if out is not None:
                    if self._board.abort_posted:  # this rank is back (see _post_abort)
                        self._board.clear_abort()
                    if not async_finish:
                        return out[0], out[1], _NO_EVENT
                    kept = (x, out[0]) if topk_weights is None else (x, topk_weights, out[0], out[1])
                    return out[0], out[1], EventOverlap(out[2], kept)
        try:
            self._check_alive()
            self._backend_of(handle, (DispatchHandle,))
            rows = handle.recv_src_idx.shape[0]
            check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
                         shape=(rows, None), device=handle.is_token_in_rank.device)
            backend = self._combine_backend(handle, x.dtype)
            if config is not None and not isinstance(config, Config):
                raise TypeError(f"config must be a moe_dispatcher.Config, got {type(config).__name__}")
            check_combine_weights(topk_weights, rows, x.device)
            if backend is not self._reference_normal:
                check_row_bytes("x", x)
            biases = normalise_bias(bias, handle.num_tokens, x.shape[1], x.dtype, x.device)
            results, event = self._stream_scope(x.device, previous_event, async_finish, allocate_on_comm_stream,
                                                lambda: backend.combine(x, handle, topk_weights, biases, config),
                                                [x, topk_weights, *biases])
            return (*results, event)
        except Exception as exc:  # a peer waiting for this call fails fast (_post_abort)
            self._post_abort(exc)
            raise

    def _agree_layout(self, data: Tensor, scales: Optional[Tensor], topk_idx: Optional[Tensor],
                      topk_weights: Optional[Tensor], num_tokens_per_rank: Tensor, is_token_in_rank: Tensor,
                      num_tokens_per_expert: Tensor, config: Optional[Config]) -> None:
        """MOE_DISPATCHER_CHECK_LAYOUT: the reference backend's checks before a compiled fresh dispatch (host
        syncs and one all-gather): the layout against topk_idx in full, the whole signature across ranks."""
        problem = layout_problem(topk_idx, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                 self.group_size, self.topology.nvl_size)
        self._agree(dispatch_signature("dispatch", data, scales, topk_idx, topk_weights, num_tokens_per_expert.numel(),
                                       config or self.get_dispatch_config(self.group_size), problem))

    def _note_pending_rows(self, need: Tensor, limit: int) -> None:
        """Remember (on the device, no sync) how far a num_worst_tokens call exceeded its limit. Folded into
        one running maximum, so a caller that only ever uses num_worst_tokens keeps one tensor, not a list."""
        excess = need.to(torch.int64) - limit
        if self._pending_row_checks:
            excess = torch.maximum(excess, self._pending_row_checks[0][0] - self._pending_row_checks[0][1])
        self._pending_row_checks = [(excess, 0)]

    def check_refused_calls(self) -> None:
        """Raise now what the next synchronised dispatch (a fresh one without num_worst_tokens) would raise for the
        earlier dispatches with num_worst_tokens: SignatureMismatch on every rank alike, naming the fields, values
        and ranks, when the compiled kernels refused one of them because its ranks disagreed (signature, bad expert
        ids, a cached call's ring signature; that call moved nothing and returned padding rows, docs/semantics.md),
        and a timeout or a peer's abort the kernels recorded. Every rank of the group calls it at the same point,
        after the same calls (at a training step's end, say: the Megatron integration's step-end check does).

        Cost: a wait for the notify of this Buffer's latest fresh dispatch (spinning on host-mapped memory; done in
        practice by then), no device sync; a collective only when there is a refusal to report (the synchronised
        dispatch's all-gather of the signatures). The reference backend raises such calls at the call itself:
        nothing to do."""
        try:
            self._check_alive()
            if self._kernels is not None:
                self._kernels.check_refused_calls()
        except Exception as exc:  # a timeout on this rank: its peers fail fast (SignatureMismatch posts nothing)
            self._post_abort(exc)
            raise

    def _forget_dropped_rows(self) -> None:
        """Forget every overflow of earlier num_worst_tokens calls, so that the next synchronised dispatch does not
        raise it: for a caller that checked those calls' rows_needed itself (the Megatron integration's run_step,
        integrations/megatron/guard.py: a bound overflow has raised there already, a capacity factor's drops
        are chosen). Every rank calls it at the same point, after those calls' dispatches finished."""
        self._pending_row_checks = []
        if self._kernels is not None:
            self._kernels.forget_overflow()

    def _check_pending_rows(self) -> None:
        """Collective: raise on every rank if any earlier expert_major_dispatch(num_worst_tokens=W) on any rank
        needed more than W rows (the rows past W were dropped). Every rank made the same calls, so every rank
        holds the same number of pending checks and takes part in the same all-gather."""
        if not self._pending_row_checks:
            return
        checks, self._pending_row_checks = self._pending_row_checks, []
        excess = torch.stack([need - limit for need, limit in checks]).max().reshape(1)
        worst = all_gather_rows(self._board, excess, "pending-rows check all-gather").view(-1)
        if int(worst.max()) > 0:
            rank = int(worst.argmax())
            # One overflow, one report: the composition's bounded exchange (compiled backends) recorded it in
            # the backend too (its notify finished: the excess just read came from its counts).
            if self._kernels is not None:
                self._kernels.forget_overflow()
            raise on_every_rank(ValueError(  # every rank raises it after the same all-gather: no abort (board.py)
                f"expert_major_dispatch: on rank {rank}, {int(worst.max())} more expert rows arrived than "
                f"num_worst_tokens allowed; they were dropped (raise num_worst_tokens)"))

    # ------------------------------------------------------------------ expert-major (fused permutation)
    def expert_major_dispatch(self, x: XType, handle: Optional[ExpertMajorHandle] = None,
                              topk_idx: Optional[Tensor] = None, topk_weights: Optional[Tensor] = None,
                              num_experts: Optional[int] = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                              config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                              async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Dispatch straight into expert-major layout: one row per (received token, local expert) pair, the rows
        of each local expert contiguous (what grouped expert GEMMs read; docs/semantics.md).

        x: as for dispatch; topk_idx int64 [T, K]; topk_weights float32 [T, K] or None; num_experts E.
        expert_alignment pads each expert's rows to a multiple (FP8 GEMMs want 16 or 32); num_worst_tokens > 0
        fixes the row count M (no host sync with the compiled kernels): rows past M are dropped, handle.rows_needed
        (from the exchanged counts) says how many were needed, and every rank raises at the next synchronised
        dispatch (docs/semantics.md).
        Returns (permuted_x [M, H] (or the FP8 tuple), permuted_weights float32 [M] or None,
        tokens_per_expert_list (python ints; empty with num_worst_tokens), tokens_per_expert int32 [L] (device),
        handle, EventOverlap). Cached mode (`handle` only): (permuted_x, None, None, None, None, EventOverlap).
        """
        try:
            self._check_alive()
            data, scales = split_x(x)
            dev = data.device
            self._check_dispatch_options(expert_alignment, num_worst_tokens, config)
            if handle is not None:
                if not isinstance(handle, ExpertMajorHandle):
                    raise TypeError(f"handle must be an ExpertMajorHandle, got {type(handle).__name__}")
                if topk_idx is not None or topk_weights is not None:
                    raise ValueError("cached dispatch (handle given) takes no topk_idx/topk_weights: the routing is "
                                     "the handle's")
                backend = self._backend_of(handle.dispatch, (DispatchHandle,))
                check_tensor("x", data, shape=(handle.dispatch.num_tokens, None), device=handle.pair_row.device)

                (px, ps), event = self._stream_scope(
                    dev, previous_event, async_finish, allocate_on_comm_stream,
                    lambda: backend.expert_major_cached_dispatch(data, scales, handle, config), [data, scales])
                return (px if scales is None else (px, ps)), None, None, None, None, event
            if topk_idx is None or num_experts is None:
                raise ValueError("expert_major_dispatch needs topk_idx and num_experts (or a handle for cached mode)")
            backend = self._resolve("normal", dev, local_experts=num_experts // self.group_size
                                    if isinstance(num_experts, int) else None)
            self._check_routing(data, backend, topk_idx, topk_weights, num_experts)
            if not num_worst_tokens:
                self._check_pending_rows()
            config = self._fresh_config(config, data)

            def run():
                px, ps, pw, tpe, counts, h = backend.expert_major_dispatch(
                    data, scales, topk_idx, topk_weights, num_experts, expert_alignment, num_worst_tokens, config)
                if num_worst_tokens:  # reported later, alike on every backend (docs/semantics.md)
                    self._note_pending_rows(h.rows_needed, num_worst_tokens)
                return px, ps, pw, tpe, counts, h

            (px, ps, pw, tpe, counts, new_handle), event = self._stream_scope(
                dev, previous_event, async_finish, allocate_on_comm_stream, run, [data, scales, topk_idx, topk_weights])
            return (px if scales is None else (px, ps)), pw, counts, tpe, new_handle, event
        except Exception as exc:  # a peer waiting for this call fails fast (_post_abort)
            self._post_abort(exc)
            raise

    def expert_major_combine(self, x: Tensor, handle: ExpertMajorHandle, weights: Optional[Tensor] = None,
                             topk_weights: Optional[Tensor] = None, bias=None, config: Optional[Config] = None,
                             previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                             allocate_on_comm_stream: bool = False):
        """Reduce expert-major rows back to their tokens (the inverse layout of expert_major_dispatch).

        x: [M, H] expert-major rows; weights: float32 [M] multiplied into the rows first (None: plain sum);
        topk_weights: float32 [M] per-pair values returned to their top-k slot; bias as for combine.
        Returns (combined_x [T, H] x.dtype, combined_topk_weights float32 [T, K] or None, EventOverlap).
        """
        try:
            self._check_alive()
            if not isinstance(handle, ExpertMajorHandle):
                raise TypeError(f"handle must be an ExpertMajorHandle, got {type(handle).__name__}")
            self._backend_of(handle.dispatch, (DispatchHandle,))
            m = handle.pair_row.numel()
            check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64), shape=(m, None),
                         device=handle.pair_row.device)
            backend = self._combine_backend(handle.dispatch, x.dtype)
            if config is not None and not isinstance(config, Config):
                raise TypeError(f"config must be a moe_dispatcher.Config, got {type(config).__name__}")
            for name, t in (("weights", weights), ("topk_weights", topk_weights)):
                if t is not None:
                    check_tensor(name, t, dtypes=(torch.float32,), shape=(m,), device=x.device)
            biases = normalise_bias(bias, handle.dispatch.num_tokens, x.shape[1], x.dtype, x.device)

            results, event = self._stream_scope(
                x.device, previous_event, async_finish, allocate_on_comm_stream,
                lambda: backend.expert_major_combine(x, handle, weights, topk_weights, biases, config),
                [x, weights, topk_weights, *biases])
            return (*results, event)
        except Exception as exc:  # a peer waiting for this call fails fast (_post_abort)
            self._post_abort(exc)
            raise

    # ------------------------------------------------------------------ low-latency mode
    # The public calls are a fast path: the key of the call's Python-checked facts (shapes the checks read,
    # flags) is looked up in a dict; on a hit the backend's method (for the compiled backend, the native
    # runtime's: csrc/low_latency_bindings.cpp, which checks the tensors' invariants itself) is called once.
    # On a miss, _first_ll_dispatch / _first_ll_combine validate the arguments (moe_dispatcher.validation),
    # resolve the backend and, for the compiled one, remember the method under the key. The reference
    # backend is never remembered: its calls are validated every time (its checks read values too).
    def low_latency_dispatch(self, x: Tensor, topk_idx: Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Send each (token, expert) selection to the expert, packed per local expert.

        x: bf16 [T, H], T <= num_max_dispatch_tokens_per_rank, H % 128 == 0; topk_idx int64 [T, K].
        Returns (recv_x bf16 [L, R*maxT, H] or (fp8 [L, R*maxT, H], scales), recv_count int32 [L], handle,
        EventOverlap, hook or None). Only the first recv_count[l] rows of expert l are valid.
        """
        try:
            run = self._ll_dispatch_runs.get((num_max_dispatch_tokens_per_rank, num_experts, x.is_cuda, use_fp8,
                                              round_scale, use_ue8m0, async_finish, return_recv_hook))
            if run is None:
                run = self._first_ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                              cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                              use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
            return run(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                       dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        except Exception as exc:  # a peer waiting for this call fails fast (_post_abort)
            self._post_abort(exc)
            raise

    def low_latency_combine(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, handle: LowLatencyHandle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[Tensor] = None):
        """Return expert outputs to their tokens and reduce them weighted by topk_weights.

        x: bf16 [L, R*maxT, H] (ignored with zero_copy: the rows come from
        get_next_low_latency_combine_buffer); topk_idx int64 [T, K] and topk_weights float32 [T, K] as given
        to dispatch. Returns (combined_x bf16 [T, H] (into `out` when given), EventOverlap, hook or None).
        """
        try:
            try:
                run = self._ll_combine_runs.get((handle.backend, use_logfmt, async_finish, return_recv_hook))
            except AttributeError:  # not a handle: the full path says so
                run = None
            if run is None:
                run = self._first_ll_combine(x, topk_idx, topk_weights, handle, use_logfmt, async_finish,
                                             return_recv_hook, out, combine_wait_recv_cost_stats)
            return run(x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook, out,
                       combine_wait_recv_cost_stats)
        except Exception as exc:  # a peer waiting for this call fails fast (_post_abort)
            self._post_abort(exc)
            raise

    def _check_low_latency(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        if not self.low_latency_mode:
            raise RuntimeError("low-latency calls need Buffer(low_latency_mode=True, num_rdma_bytes=...)")
        check_count("num_max_dispatch_tokens_per_rank", max_tokens, 1)
        check_count("hidden", hidden, 1)
        check_num_experts(num_experts, self.group_size)
        need = self.get_low_latency_rdma_size_hint(max_tokens, hidden, self.group_size, num_experts)
        if self.num_rdma_bytes < need:
            raise ValueError(f"num_rdma_bytes={self.num_rdma_bytes} is too small for {max_tokens} tokens per rank, "
                             f"hidden {hidden}, {num_experts} experts: get_low_latency_rdma_size_hint gives {need}")

    def _first_ll_dispatch(self, x, topk_idx, max_tokens, num_experts, cum_stats, wait_stats, use_fp8, round_scale,
                           use_ue8m0, async_finish, return_recv_hook) -> Callable:
        """Validate a dispatch whose key was not seen (see above); -> the backend method that serves it."""
        self._board.clear_abort()  # this rank is back after raising (_post_abort)
        self._check_alive()
        check_flag_exclusive(async_finish, return_recv_hook)
        check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=2)
        t, h = x.shape
        if h % 128:
            raise ValueError(f"low-latency dispatch needs a hidden size divisible by 128, got {h}")
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise ValueError("use_ue8m0 needs use_fp8=True and round_scale=True (UE8M0 scales are powers of two)")
        if use_ue8m0 and h % 512:
            raise ValueError(f"use_ue8m0 packs 4 scales per int32: hidden must be divisible by 512, got {h}")
        self._check_low_latency(max_tokens, h, num_experts)
        if t > max_tokens:
            raise ValueError(f"x has {t} tokens, more than num_max_dispatch_tokens_per_rank={max_tokens}")
        dev = x.device
        backend = self._resolve("low_latency", dev)
        reference = backend is self._reference_ll
        check_topk_idx(topk_idx, num_experts, num_tokens=t, device=dev, values=reference, distinct=True)
        if cum_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", cum_stats, dtypes=(torch.int32,),
                         shape=(num_experts // self.group_size,), device=dev)
        if wait_stats is not None:
            check_tensor("dispatch_wait_recv_cost_stats", wait_stats, dtypes=(torch.int64,),
                         shape=(self.group_size,), device=dev)
        if not reference:
            self._ll_dispatch_runs[(max_tokens, num_experts, x.is_cuda, use_fp8, round_scale, use_ue8m0,
                                    async_finish, return_recv_hook)] = backend.low_latency_dispatch
        return backend.low_latency_dispatch

    def _first_ll_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, async_finish, return_recv_hook, out,
                          wait_stats) -> Callable:
        """Validate a combine whose key was not seen (see above); -> the backend method that serves it."""
        self._board.clear_abort()  # this rank is back after raising (_post_abort)
        self._check_alive()
        if use_logfmt:
            raise NotImplementedError("low_latency_combine(use_logfmt=True) is not supported yet")
        check_flag_exclusive(async_finish, return_recv_hook)
        backend = self._backend_of(handle, (LowLatencyHandle,))
        max_tokens, h, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        self._check_low_latency(max_tokens, h, num_experts)
        local, rows = num_experts // self.group_size, self.group_size * max_tokens
        dev = handle.src_info.device
        reference = backend is self._reference_ll
        check_tensor("x", x, dtypes=(torch.bfloat16,), shape=(local, rows, h), device=dev)
        check_topk_idx(topk_idx, num_experts, device=dev, values=reference)
        if topk_idx.shape[0] > max_tokens:
            raise ValueError(f"topk_idx has {topk_idx.shape[0]} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{max_tokens}")
        check_topk_weights(topk_weights, topk_idx)
        t = topk_idx.shape[0]
        if handle.num_tokens is not None and t != handle.num_tokens:
            raise ValueError(f"low_latency_combine: topk_idx has {t} tokens but the dispatch of this handle had "
                             f"{handle.num_tokens}; pass the topk_idx that dispatch was given")
        if out is not None:
            check_tensor("out", out, dtypes=(torch.bfloat16,), shape=(t, h), device=dev)
        if wait_stats is not None:
            check_tensor("combine_wait_recv_cost_stats", wait_stats, dtypes=(torch.int64,), shape=(self.group_size,),
                         device=dev)
        if not reference:
            self._ll_combine_runs[(handle.backend, use_logfmt, async_finish, return_recv_hook)] = \
                backend.low_latency_combine
        return backend.low_latency_combine

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> Tensor:
        """The bf16 [L, R*maxT, H] send region the next low-latency call (a combine) will use: write expert
        outputs here and call low_latency_combine(..., zero_copy=True) to skip the copy."""
        self._check_alive()
        return self._backend_of(handle, (LowLatencyHandle,)).next_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency signal words (needed after using the NVSHMEM buffer for something else).
        Collective: every rank passes the same shapes (else SignatureMismatch on every rank)."""
        self._check_alive()
        self._check_low_latency(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if self._kernels_ll is not None:
            try:
                self._kernels_ll.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)
            except Exception as exc:  # a peer waiting for this rank (its kernel, or the clean's round) fails fast
                self._post_abort(exc)
                raise


# Reasons the reference backend served CUDA calls, warned about once per process.
_warned_fallbacks: set = set()


def _refusal(caps: Capabilities, mode: str, device: torch.device, local_experts: Optional[int],
             combine_dtype: Optional[torch.dtype]) -> str:
    """Why a backend with these capabilities cannot serve the call ("" when it can)."""
    if not (caps.normal if mode == "normal" else caps.low_latency):
        return f"the compiled backend has no {mode.replace('_', '-')} mode"
    if device.type not in caps.devices:
        return f"the compiled kernels take no {device.type} tensors"
    if local_experts is not None and caps.max_local_experts is not None and local_experts > caps.max_local_experts:
        return (f"the compiled kernels serve at most {caps.max_local_experts} experts per rank, this call has "
                f"{local_experts}")
    if combine_dtype is not None and combine_dtype not in caps.combine_dtypes:
        return f"the compiled kernels do not reduce {combine_dtype}"
    return ""


def _flatten(obj) -> list:
    if isinstance(obj, (tuple, list)):
        return [y for item in obj for y in _flatten(item)]
    return [obj]
