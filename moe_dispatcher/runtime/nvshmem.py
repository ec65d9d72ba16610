"""NVSHMEM bootstrap over an existing torch.distributed group.

``bootstrap(group, device_index)`` brings NVSHMEM up on every rank of ``group`` (NVSHMEM PE id ==
group rank) and makes sure the device state of ``moe_dispatcher._C`` is initialised, which its
NVSHMEM kernels need. The way is chosen automatically (no switch):

* ``nvshmem4py`` when it is importable: nvshmem4py does the host-side init from a unique id made
  by rank 0 (it reaches the others in a creation round of the Buffer's board, or a broadcast over
  ``group``), then ``_C.nvshmem_attach()`` registers the extension's device state.
* ``extension`` otherwise: the extension's own unique-id init (no nvshmem4py needed).

If NVSHMEM is already up in this process (someone else initialised it), bootstrap only attaches.
Per process the state is created once and reference counted: every ``bootstrap`` returns the same
object and must be matched by one ``finalize()``; the last one tears NVSHMEM down. Like NVSHMEM
itself, bootstrap/malloc/free/barrier/finalize are collective: same order on every rank.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import _ext
from ..reference.board import CreationFailed

UNIQUE_ID_BYTES = 128

_lock = threading.Lock()
_state: NvshmemState | None = None


@dataclass
class NvshmemState:
    """NVSHMEM as set up by :func:`bootstrap`; shared by every caller in the process."""

    rank: int  # NVSHMEM PE id == rank in the bootstrap group
    nranks: int
    device_index: int
    backend: str  # "nvshmem4py", "extension" or "attached" (NVSHMEM was already up)
    _refcount: int = field(default=1, repr=False)
    _nvshmem4py: Any = field(default=None, repr=False)  # nvshmem.core when we initialised it

    @property
    def _C(self):  # the extension module
        return _ext.require("NVSHMEM")

    def malloc(self, nbytes: int) -> int:
        """Collective symmetric allocation of ``nbytes``; returns the device pointer as int."""
        return self._C.nvshmem_malloc(nbytes)

    def free(self, ptr: int) -> None:
        """Collective free of a pointer from :meth:`malloc`."""
        self._C.nvshmem_free(ptr)

    def peer_ptr(self, ptr: int, pe: int) -> int:
        """Address of symmetric ``ptr`` on PE ``pe`` for direct loads/stores (0: not P2P-reachable)."""
        return self._C.nvshmem_ptr(ptr, pe)

    def barrier(self, stream: torch.cuda.Stream | None = None) -> None:
        """Collective barrier enqueued on ``stream`` (default: the current stream)."""
        if stream is None:
            stream = torch.cuda.current_stream(self.device_index)
        self._C.nvshmem_barrier_all(stream.cuda_stream)

    def finalize(self) -> None:
        """Drop one reference; the last one finalizes NVSHMEM for this process (collective)."""
        finalize()

    def release(self, ptr: int, device: torch.device) -> None:
        """A backend's collective end: wait for `device`'s work, a barrier (no PE still reads or writes `ptr`,
        every one's work is done), then free `ptr` and drop this reference."""
        torch.cuda.synchronize(device)
        self.barrier()
        torch.cuda.synchronize(device)
        self.free(ptr)
        self.finalize()


def _set_env_defaults(single_host: bool) -> None:
    """NVSHMEM environment for our machines; values the user already set are kept."""
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")  # multicast can take shared GPUs down
    os.environ.setdefault("NVSHMEM_MAX_TEAMS", "8")  # saves ~130 MB per GPU
    if single_host:
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")  # P2P only, no NIC probing


def _import_nvshmem4py() -> tuple[Any, Any]:
    """(nvshmem.core, cuda.core.Device); raises ImportError with the reason when unusable."""
    try:
        core = importlib.import_module("nvshmem.core")
        try:
            from cuda.core import Device
        except ImportError:
            from cuda.core.experimental import Device  # cuda-core < 0.4
    except Exception as exc:  # not installed, or its CUDA Python deps are missing
        raise ImportError(f"nvshmem4py is not usable: {type(exc).__name__}: {exc}") from exc
    return core, Device


def _pick_backend() -> str:
    """nvshmem4py when it is importable (with its CUDA Python dependencies), else the extension's own init."""
    try:
        _import_nvshmem4py()
    except ImportError:
        return "extension"
    return "nvshmem4py"


def _broadcast_unique_id(uid: bytes | None, group: dist.ProcessGroup) -> bytes:
    """Group rank 0's 128-byte unique id, on every rank of ``group``."""
    backend = str(dist.get_backend(group)).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else "cpu"
    buf = torch.zeros(UNIQUE_ID_BYTES, dtype=torch.uint8, device=device)
    if uid is not None:
        buf.copy_(torch.frombuffer(bytearray(uid), dtype=torch.uint8))
    # Broadcast takes a global rank as source; group rank 0 is not global rank 0 in general.
    dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
    return bytes(buf.cpu().numpy().tobytes())


def _share_unique_id(make: Callable[[], bytes | None], group: dist.ProcessGroup, board: Any) -> bytes:
    """Group rank 0's unique id (what ``make()`` returns there; other ranks' ``make()`` prepares and returns None)
    on every rank. With a ``board`` (a Buffer's reference.board.Board) it travels in one bounded creation round
    that carries every rank's error of ``make()`` too: a rank that failed (rank 0 without an id) raises
    CreationFailed on every rank, none waits forever. Without one: a broadcast over ``group`` (a rank whose
    ``make()`` raised leaves the others waiting in it)."""
    if board is None:
        uid = make()
        _check_unique_id(uid)
        return _broadcast_unique_id(uid, group)
    uid, error = None, None
    try:
        uid = make()
        _check_unique_id(uid)
    except Exception as exc:  # noqa: BLE001 - every rank learns it in the round
        error = exc
    return board.creation_round("NVSHMEM unique id", error, uid)[0]


def _check_unique_id(uid: bytes | None) -> None:
    if uid is not None and len(uid) != UNIQUE_ID_BYTES:
        raise RuntimeError(f"NVSHMEM unique id has {len(uid)} bytes, expected 128")


def _init_nvshmem4py(group: dist.ProcessGroup, device_index: int, board: Any) -> Any:
    rank, nranks = dist.get_rank(group), dist.get_world_size(group)
    made: list = []

    def make() -> bytes | None:
        core, Device = _import_nvshmem4py()
        device = Device(device_index)
        device.set_current()
        made.extend((core, device, core.get_unique_id(empty=(rank != 0))))
        return made[2]._data.tobytes() if rank == 0 else None

    data = _share_unique_id(make, group, board)
    core, device, uid = made
    if rank != 0:  # write the received bytes into the empty id's struct
        ctypes.memmove(uid._data.ctypes.data, data, UNIQUE_ID_BYTES)
    core.init(device=device, uid=uid, rank=rank, nranks=nranks, initializer_method="uid")
    return core


def _init_extension(C: Any, group: dist.ProcessGroup, board: Any) -> None:
    rank, nranks = dist.get_rank(group), dist.get_world_size(group)
    data = _share_unique_id(lambda: C.nvshmem_get_unique_id() if rank == 0 else None, group, board)
    C.nvshmem_init_with_unique_id(data, rank, nranks)


def bootstrap(
    group: dist.ProcessGroup | None = None,
    device_index: int | None = None,
    *,
    single_host: bool = False,
    board: Any = None,
) -> NvshmemState:
    """Initialise NVSHMEM over ``group`` (default: WORLD) on CUDA device ``device_index``.

    Args:
        group: the torch.distributed group whose ranks become the NVSHMEM PEs (PE id = group rank).
        device_index: CUDA device of this rank (default: the current device). All GPUs stay
            visible; this only selects the current device.
        single_host: all ranks share one host: sets NVSHMEM_REMOTE_TRANSPORT=none if unset.
        board: the creating Buffer's reference.board.Board: rank 0's unique id reaches the peers in a bounded
            creation round of it rather than a broadcast (see _share_unique_id); a failure to make it raises
            reference.board.CreationFailed on every rank.

    Returns the process-wide :class:`NvshmemState` (the same object on repeated calls, each of which
    needs its own :func:`finalize`). Raises RuntimeError with NVSHMEM's reason when init fails.
    """
    global _state
    group = group if group is not None else dist.group.WORLD
    rank, nranks = dist.get_rank(group), dist.get_world_size(group)
    with _lock:
        if _state is not None:
            if (_state.rank, _state.nranks) != (rank, nranks):
                raise RuntimeError(
                    f"NVSHMEM is already bootstrapped as PE {_state.rank} of {_state.nranks}; "
                    f"cannot bootstrap again as rank {rank} of {nranks} (one NVSHMEM world per "
                    "process)"
                )
            _state._refcount += 1
            return _state

        C = _ext.require("NVSHMEM bootstrap")
        if device_index is None:
            device_index = torch.cuda.current_device()
        torch.cuda.set_device(device_index)
        _set_env_defaults(single_host)

        core = None
        if C.nvshmem_init_status() >= 2:  # NVSHMEM_STATUS_IS_INITIALIZED: someone else owns it
            backend = "attached"
        else:
            backend = _pick_backend()
        try:
            if backend == "nvshmem4py":
                core = _init_nvshmem4py(group, device_index, board)
            elif backend == "extension":
                _init_extension(C, group, board)
            if backend != "extension":
                C.nvshmem_attach()  # fill this .so's device state (NVSHMEM itself is up)
        except CreationFailed:  # every rank raises it alike, naming the failing rank
            raise
        except Exception as exc:
            raise RuntimeError(
                f"NVSHMEM bootstrap ({backend}) failed on rank {rank} of {nranks}, device "
                f"{device_index}: {exc}"
            ) from exc

        pe, npes = C.nvshmem_my_pe(), C.nvshmem_n_pes()
        if (pe, npes) != (rank, nranks):
            raise RuntimeError(
                f"NVSHMEM came up as PE {pe} of {npes} but this is rank {rank} of {nranks} in the "
                "bootstrap group (NVSHMEM was initialised elsewhere with another group?)"
            )
        _state = NvshmemState(rank, nranks, device_index, backend, _nvshmem4py=core)
        return _state


def finalize() -> None:
    """Drop one :func:`bootstrap` reference; the last one finalizes (collective)."""
    global _state
    with _lock:
        if _state is None:
            raise RuntimeError("NVSHMEM finalize without a matching bootstrap")
        _state._refcount -= 1
        if _state._refcount > 0:
            return
        state, _state = _state, None
        C = _ext.require("NVSHMEM finalize")
        # Ours first: NVSHMEM counts inits; ours unregisters our device state, and nvshmem4py's
        # (if it initialised NVSHMEM) is the last one, which tears NVSHMEM down.
        C.nvshmem_finalize()
        if state._nvshmem4py is not None:
            state._nvshmem4py.finalize()


def current() -> NvshmemState | None:
    """The bootstrapped state of this process, or None."""
    return _state
