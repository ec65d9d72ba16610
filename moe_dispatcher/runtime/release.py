"""Releasing what a Buffer's compiled backends share with their peers: destroy(), garbage collection and exit.

A compiled backend exports memory: the intranode/internode NVLink buffer (cudaMalloc'd, mapped by the domain's
peers through CUDA IPC) and the NVSHMEM symmetric buffer (low-latency, internode). Two rules follow:
- exported memory is freed only once every peer has stopped using it: freeing an IPC allocation that a peer still
  maps is undefined, and nvshmem_free is collective (it waits for every PE);
- nothing waits forever: a peer that died never confirms, so every wait ends after a timeout, and then the memory
  is abandoned (left allocated until the process exits, which is safe) instead of freed.

A backend takes part through five methods: quiesce() (local: wait for this GPU's work, close this rank's mappings of
the peers' memory, refuse later calls), symmetric (True when it holds NVSHMEM memory), views_alive() (a tensor
handed to the user still views its NVSHMEM memory), free(symmetric) (every peer confirmed: free the IPC buffer, and
the NVSHMEM one when `symmetric`, else leave it allocated) and abandon() (a peer never confirmed), plus `broken` (a
kernel recorded a timeout: a peer is known to be gone or out of step).

Confirmations go through the group's store, under the Buffer's board prefix (reference/board.py: the n-th Buffer
of a group has the same prefix on every rank): "release/<rank>" = "free", or "views" when this rank's user still
holds a view of the NVSHMEM buffer. Three ways to release:

* Buffer.destroy() (collective): quiesce, post, wait for every peer's post (MOE_DISPATCHER_TIMEOUT_S; the compiled
  kernels' shorter timeout when a backend is broken). All posted: free (the NVSHMEM buffer only when nobody posted
  "views", and every rank then posts "verdict/<rank>" = "go": a rank that saw a post missing posts "stop", and
  the others leave the NVSHMEM buffer allocated rather than enter a collective free without it; a rank that
  posts "go" and dies before the free can still hang the others' free). A peer missing: abandon and raise
  naming it.
* Garbage collection (ranks collect at different moments, so it never waits): quiesce, post, and park the backends
  in this module's pending list. A parked IPC-only Buffer is freed by the first poll (at every Buffer creation,
  destroy and collection, and at exit) that finds every peer's post. A parked Buffer with NVSHMEM memory is freed
  only at a collective point (next section), because nvshmem_free blocks until every rank calls it.
* Exit (atexit): every live Buffer is parked as if collected; the IPC ones are waited for (the timeout), then a last
  collective point frees the NVSHMEM ones; whatever a peer never confirmed is abandoned. The handler is registered
  again after each NVSHMEM bootstrap, so it runs before exit handlers of libraries imported by the bootstrap.

Collective points: every Buffer creation and every destroy() of a group is one, named by the Buffer's board ordinal
("create-<o>", "destroy-<o>"; the exit handler's is "exit"): the same on every rank, even after a creation that
raised on some ranks before their point (a rank that posted its abort on the creating Buffer's board is not
waited for there). Once a Buffer of a group holds NVSHMEM memory, each point posts "round/<point>/<rank>" = the
parked Buffers (board ordinals) this rank can free, waits for every rank's post and frees the ones every rank
listed, in ordinal order: the same nvshmem_free calls in the same order on every rank. A rank missing at a point
frees nothing there (its parked Buffers wait for the next point), and neither does any other: each rank posts
"round/<point>/verdict/<rank>" = "go" (it saw every post) or "stop", and frees only on every rank's "go" (the
verdict round of destroy()).
"""
from __future__ import annotations

import atexit
import contextlib
import threading
import time
import warnings
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from ..reference.board import _group_store

_POLL_S = (0.002, 0.05)  # first and longest sleep between two reads of the store
_lock = threading.RLock()
_parked: List["Release"] = []  # collected (or exiting) Buffers whose memory waits for their peers' posts
_live: "weakref.WeakSet" = weakref.WeakSet()  # Buffers holding compiled backends, not yet released
_exit_registered = False
# Groups whose Buffers have held NVSHMEM memory (rounds are posted on them) -> (rank, ranks, timeout_s, the group's
# store or None), recorded while the group exists: exit may come after destroy_process_group(). Held strongly: the
# exit handler's last collective point must come on every rank alike, whatever this rank's Buffers went through.
_symmetric_groups: Dict[object, tuple] = {}


class PeerMissing(RuntimeError):
    """A peer never confirmed it stopped using this rank's exported memory within the timeout."""


def wait_for_posts(store, keys: Sequence[str], timeout_s: float,
                   gone: Optional[Callable[[int], bool]] = None) -> Tuple[Dict[int, str], List[int]]:
    """Read keys[q] for every q until all exist or `timeout_s` passes: -> ({q: value}, [q missing]). A store that
    fails (its host died) counts as every unread key missing. gone(q): True when rank q will never post (it raised):
    it is not waited for. A post made before raising counts: gone(q) is asked before the key is read, so a rank
    that posts and then raises between the two reads is read as posted (read the other way round, it would be
    given up although its post is there)."""
    values: Dict[int, str] = {}
    given_up: set = set()
    deadline, sleep = time.monotonic() + timeout_s, _POLL_S[0]
    while True:
        try:
            for q, key in enumerate(keys):
                if q in values or q in given_up:
                    continue
                was_gone = gone is not None and gone(q)
                if store.check([key]):
                    values[q] = store.get(key).decode()
                elif was_gone:
                    given_up.add(q)
        except Exception:  # noqa: BLE001 - a dead store: nobody else can confirm
            break
        if len(values) + len(given_up) == len(keys) or time.monotonic() >= deadline:
            break
        time.sleep(min(sleep, max(deadline - time.monotonic(), 0.0)))
        sleep = min(sleep * 2, _POLL_S[1])
    return values, [q for q in range(len(keys)) if q not in values]


class Release:
    """The release of one Buffer's compiled backends (see the module docstring). store: the Buffer's board store
    (None when torch exposes none: then destroy() waits in a process-group barrier, unbounded, and leaves the
    NVSHMEM buffer allocated, and collection abandons); ordinal: the Buffer's number among its group's Buffers (its
    Board's: the same Buffer on every rank, whatever a failed creation on some ranks skipped)."""

    def __init__(self, store, group, rank: int, num_ranks: int, timeout_s: float, broken_timeout_s: float,
                 ordinal: int) -> None:
        self.store, self.group, self.rank, self.num_ranks = store, group, rank, num_ranks
        self.ordinal = ordinal
        self.timeout_s, self.broken_timeout_s = timeout_s, broken_timeout_s
        self.backends: list = []
        self.symmetric = False
        self.done = False

    def _take(self, backends: Sequence) -> None:
        self.backends = [b for b in backends if b is not None]
        self.symmetric = any(b.symmetric for b in self.backends)

    def _keys(self) -> List[str]:
        return [f"release/{q}" for q in range(self.num_ranks)]

    def _timeout(self) -> float:
        return self.broken_timeout_s if any(b.broken for b in self.backends) else self.timeout_s

    def _views(self) -> bool:
        return any(b.symmetric and b.views_alive() for b in self.backends)

    def _quiesce_and_post(self) -> None:
        errors = []
        for b in self.backends:
            try:
                b.quiesce()
            except Exception as exc:  # noqa: BLE001 - the others still stop; the first error is raised below
                errors.append(exc)
        if self.store is not None:
            self.store.set(f"release/{self.rank}", "views" if self._views() else "free")
        if errors:
            raise errors[0]

    def _free(self, symmetric: bool) -> None:
        backends, self.backends, self.done = self.backends, [], True
        for b in backends:
            b.free(symmetric)

    def _abandon(self) -> None:
        backends, self.backends, self.done = self.backends, [], True
        for b in backends:
            b.abandon()

    # ------------------------------------------------------------------ the three ways
    def collective(self, backends: Sequence) -> None:
        """Buffer.destroy() of `backends`: see the module docstring. Raises PeerMissing (after abandoning) when a
        peer never posted."""
        self._take(backends)
        if not self.backends:
            self.done = True
            return
        try:
            self._quiesce_and_post()
        except Exception:
            self._abandon()
            raise
        if self.store is None:  # no way to agree on the views: the NVSHMEM buffer stays (never a lone free)
            dist.barrier(group=self.group)
            self._free(symmetric=False)
            return
        timeout = self._timeout()
        values, missing = wait_for_posts(self.store, self._keys(), timeout)
        if self.symmetric:
            # nvshmem_free waits for every rank: free it only where every rank saw every post. Each rank posts
            # what it saw ("go" / "stop") and frees the NVSHMEM buffer only on all "go", so a rank whose wait
            # timed out (its timeout may be shorter: a broken backend) keeps the others from a free it will not
            # join. (The ranks post this right after the wait above, so the second wait is short.) A rank that
            # missed posts frees nothing collectively whatever the verdicts say: it posts "stop" and does not wait
            # for verdicts, which the missing ranks would never post (a second full timeout).
            self.store.set(f"verdict/{self.rank}", "stop" if missing else "go")
            all_go = False
            if not missing:
                verdicts, late = wait_for_posts(self.store, [f"verdict/{q}" for q in range(self.num_ranks)], timeout)
                all_go = not late and all(v == "go" for v in verdicts.values())
        if missing:
            self._abandon()
            raise PeerMissing(f"moe_dispatcher: Buffer.destroy() on rank {self.rank}: ranks {missing} did not "
                              f"destroy this Buffer within {timeout:g} s (dead, or not calling destroy()); its "
                              f"memory stays allocated until this process exits (MOE_DISPATCHER_TIMEOUT_S sets the "
                              f"wait)")
        self._free(symmetric=all(v == "free" for v in values.values()) and (not self.symmetric or all_go))

    def park(self, backends: Sequence) -> None:
        """Garbage collection or exit of `backends`: quiesce and post without waiting; the pending list frees them
        later."""
        self._take(backends)
        if not self.backends:
            self.done = True
            return
        try:
            self._quiesce_and_post()
        except Exception:  # noqa: BLE001 - collection must not raise; a backend that fails to stop is left alone
            self._abandon()
            return
        if self.store is None:
            self._abandon()
            return
        with _lock:
            _parked.append(self)
        poll()

    def _confirmed(self) -> bool:
        """Every peer posted (non-blocking)."""
        return not wait_for_posts(self.store, self._keys(), 0.0)[1]


def register(buffer, symmetric: bool) -> None:
    """A Buffer with compiled backends was created (`symmetric`: one holds NVSHMEM memory): it is released at exit
    unless released before."""
    rel = buffer._release
    with _lock:
        _live.add(buffer)
        if symmetric:
            _symmetric_groups.setdefault(rel.group, (rel.rank, rel.num_ranks, rel.timeout_s, _group_store(rel.group)))
    global _exit_registered
    if symmetric or not _exit_registered:  # again after an NVSHMEM bootstrap: before the exit handlers it registered
        atexit.unregister(_at_exit)
        atexit.register(_at_exit)
        _exit_registered = True


def forget(buffer) -> None:
    with _lock:
        _live.discard(buffer)


def poll() -> None:
    """Free the parked IPC-only Buffers whose peers all posted (non-blocking, never collective)."""
    with _lock:
        for r in [r for r in _parked if not r.symmetric]:
            if r._confirmed():
                _parked.remove(r)
                with contextlib.suppress(Exception):
                    r._free(symmetric=False)


def collective_point(group, rank: int, num_ranks: int, timeout_s: float, point: str, board=None) -> None:
    """A point every rank of `group` reaches (Buffer creation, destroy(), exit): frees the parked Buffers with
    NVSHMEM memory that every rank parked (see the module docstring). point: its name, the same on every rank
    ("create-<board ordinal>", "destroy-<board ordinal>", "exit"; a name, not a count, so that a rank whose Buffer
    creation raised before its point does not shift the later ones). board: the creating Buffer's Board (creation
    only: fresh, so any abort on it is about this creation): a rank that posted its abort there and not its round
    post is not waited for."""
    poll()
    with _lock:
        if group not in _symmetric_groups:
            return
        store = _symmetric_groups[group][3]
        if store is None:
            return
        store = dist.PrefixStore("moe_dispatcher/release/", store)
        mine = sorted(r.ordinal for r in _parked if r.symmetric and r.group is group and not r._views())
        store.set(f"round/{point}/{rank}", ",".join(map(str, mine)))
        gone = None if board is None else (lambda q: q != rank and board.abort_message(q) is not None)
        values, missing = wait_for_posts(store, [f"round/{point}/{q}" for q in range(num_ranks)], timeout_s, gone)
        # The verdict round (as Release.collective's): nvshmem_free waits for every rank, so a rank frees only
        # when every rank saw every post; a rank whose wait ended early (a peer came late) posts "stop".
        store.set(f"round/{point}/verdict/{rank}", "stop" if missing else "go")
        if not missing:
            keys = [f"round/{point}/verdict/{q}" for q in range(num_ranks)]
            verdicts, late = wait_for_posts(store, keys, timeout_s)
            missing = late + [q for q, v in verdicts.items() if v != "go"]
        if missing:
            warnings.warn(f"moe_dispatcher: rank {rank}: ranks {sorted(missing)} did not reach (or saw a rank missing "
                          f"at) collective point '{point}' of their group within {timeout_s:g} s; parked NVSHMEM "
                          f"buffers stay allocated", stacklevel=3)
            return
        agreed = set(mine)
        for v in values.values():
            agreed &= {int(o) for o in v.split(",") if o}
        for r in sorted((r for r in _parked if r.symmetric and r.group is group and r.ordinal in agreed),
                        key=lambda r: r.ordinal):
            _parked.remove(r)
            r._free(symmetric=True)
    poll()  # every rank has passed the previous point: its posts of Buffers collected before are in


def _at_exit() -> None:
    """Park every live Buffer, wait for the IPC ones' peers, free the NVSHMEM ones at a last collective point;
    abandon what a peer never confirmed. Never raises (the interpreter is going down)."""
    with contextlib.suppress(Exception):
        for buffer in list(_live):
            buffer._release_at_exit()
        with _lock:
            ipc = [r for r in _parked if not r.symmetric]
        deadline = time.monotonic() + max((r._timeout() for r in ipc), default=0.0)
        while any(not r.symmetric for r in _parked) and time.monotonic() < deadline:
            poll()
            time.sleep(_POLL_S[1])
        for group, (rank, num_ranks, timeout_s, _) in list(_symmetric_groups.items()):
            parked = [r for r in _parked if r.group is group]
            collective_point(group, rank, num_ranks, max((r._timeout() for r in parked), default=timeout_s), "exit")
    with _lock:
        left, _parked[:] = list(_parked), []
    for r in left:
        with contextlib.suppress(Exception):
            r._abandon()
