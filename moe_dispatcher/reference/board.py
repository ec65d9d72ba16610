"""Deadlines for the reference backend's collectives, and an arrival board that says who is missing.

A rank that skips a call, or raises alone on bad input, would leave its peers blocked in the next collective
until the process-group timeout (30 minutes by default), after which the group is dead. Instead every
collective of the reference backend is started asynchronously and waited for under a deadline:

* `MOE_DISPATCHER_TIMEOUT_S` (seconds, default DEFAULT_TIMEOUT_S = 5 minutes: the reference backend is slow
  on big CPU cases, so its default is longer than the compiled backends' 10 s; keep it below the process
  group's timeout). A collective not complete by then raises RuntimeError("moe_dispatcher reference: rank R
  timed out after T s in PHASE waiting for ranks [..]"), naming the group ranks that never arrived.
* The board lives in the group's store under a prefix of its own (one prefix per Buffer: Buffers are made
  collectively, so the n-th Buffer of a group is the same Buffer on every rank). Collectives of a Buffer are
  numbered 0, 1, 2, ... in call order, the same on every rank. Keys, one per rank and overwritten, so the
  store does not grow with the number of calls:
    "arrived/<rank>" = n  : the rank has waited in collective n (posted only by a wait longer than QUIET_S:
                            a fast collective costs no store traffic at all);
    "abort/<rank>" = "n|message" : the rank raised in a Buffer call whose next collective would have been n;
                            emptied ("") when the rank is back (see below), never deleted: a reader checks
                            that a key exists and then gets it, and a get of a key deleted in between would
                            block for the store's whole timeout;
    "said/<rank>" = message : the message of the rank's latest abort, kept once the abort is emptied: a peer
                            whose compiled kernel honoured that abort words its error with it later
                            (compiled.timeout_message), possibly after the rank came back.
* Waiting for collective n: block up to QUIET_S on the work; then, every POLL_S, post "arrived/<me>" = n and
  read the peers' abort keys. An abort of peer q for collective n seen on two polls in a row raises
  RuntimeError("moe_dispatcher reference: rank q raised: ... (rank R was waiting in PHASE)"). At the deadline,
  the ranks whose "arrived" key is missing or older than n are the ones named.
* A rank empties its own abort key before its next collective, and at its next Buffer call that gets past the
  Buffer's checks (Buffer._post_abort says why that is safe). The abort is ambiguous by nature: a rank that
  raised alone may come back and make the same collective (a caller that catches the error and retries).
  Peers honour an abort only after seeing it twice, POLL_S apart, while they still wait: a rank that comes
  back within that time is waited for, not reported.

A timed-out or aborted collective stays pending in torch.distributed: the group must not be used afterwards.
Without a store (a group whose store torch does not expose), collectives still time out, naming no peers.
"""
from __future__ import annotations

import base64
import contextlib
import datetime
import pickle
import time
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

from ..env import env_float

TIMEOUT_ENV = "MOE_DISPATCHER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
QUIET_S = 0.5  # a collective that completes within this touches no store key
POLL_S = 0.25  # then: how often the board is posted to and read

# Boards made per group and kind, so the n-th Buffer of a group gets the same prefix on every rank. The groups are
# held weakly: a table that kept a process group alive after destroy_process_group() leaves its gloo threads to be
# torn down during interpreter exit, which aborts the process at random ("terminate called without an active
# exception", SIGABRT) after all its work is done.
_boards_per_group: "weakref.WeakKeyDictionary[dist.ProcessGroup, Dict[str, int]]" = weakref.WeakKeyDictionary()


def timeout_s() -> float:
    """MOE_DISPATCHER_TIMEOUT_S as seconds (a finite number > 0), else DEFAULT_TIMEOUT_S."""
    return env_float(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, greater_than=0)


class PeerError(RuntimeError):
    """A collective of the reference backend gave up, or a compiled kernel honoured a peer's abort: a peer timed
    out or raised (never re-posted as an abort)."""


class CreationFailed(RuntimeError):
    """Buffer creation failed on some rank(s): raised on every rank of the group after the same creation round (see
    Board.creation_round), naming each failing rank with its error, or the ranks that never reached the round
    (`missing`: their list)."""

    missing: Sequence[int] = ()


class CollectiveTimeout(PeerError):
    """Board.run's deadline passed: the ranks it names never arrived. A caller that knows where those ranks wait
    (in a compiled kernel, for this rank) may post its own abort for them (compiled/low_latency.py)."""


def posts_abort(exc: BaseException) -> bool:
    """Whether a Buffer call raising `exc` posts an abort for its peers: not for errors every rank raises after
    the same collective (PeerError, moe_dispatcher.signature's SignatureMismatch): no peer is left waiting."""
    return not isinstance(exc, PeerError) and not getattr(exc, "raised_on_every_rank", False)


def on_every_rank(exc: BaseException) -> BaseException:
    """Mark `exc` as raised by every rank alike after the same collective (posts_abort then posts nothing)."""
    exc.raised_on_every_rank = True
    return exc


def _group_store(group: dist.ProcessGroup):
    """The store of `group` (shared by its ranks), or None when this torch does not expose one."""
    c10d = dist.distributed_c10d
    with contextlib.suppress(Exception):  # private helpers: any failure means "no board"
        return c10d._get_process_group_store(group)
    if group is None or group == dist.group.WORLD:
        with contextlib.suppress(Exception):
            return c10d._get_default_store()
    return None


class Board:
    """The deadline and arrival board of one Buffer's reference collectives over `group` (rank `rank` of
    `num_ranks` in it). kind: "board" (a Buffer's), or the name of another collective operation that keeps boards
    of its own, numbered apart (Topology.from_group's "topology": a Buffer's number must not depend on it)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int, kind: str = "board") -> None:
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self.timeout_s = timeout_s()
        # Works are polled (is_completed), never waited for with a timeout: NCCL's Work.wait(timeout) aborts the
        # communicator when the timeout passes, and gloo's may block past its timeout.
        self._poll = True
        counts = _boards_per_group.setdefault(group if group is not None else dist.group.WORLD, {})
        ordinal = counts.get(kind, 0)
        counts[kind] = ordinal + 1
        # The Buffer's number among its group's Buffers, the same on every rank (the Board is made first, before
        # anything that may raise on some ranks only): runtime/release.py names its rounds with it.
        self.ordinal = ordinal
        store = _group_store(group)
        self.store = dist.PrefixStore(f"moe_dispatcher/{kind}/{ordinal}/", store) if store is not None else None
        self.next_collective = 0  # the number of the next collective this rank enters
        self.abort_posted = False  # this rank's "abort/<rank>" is on the board (the Buffer's calls test it)

    # ------------------------------------------------------------------ collectives
    def run(self, phase: str, start: Callable[[], "dist.Work"], timeout_s: Optional[float] = None) -> None:
        """Start one collective (`start` issues it with async_op=True and returns its Work) and wait for it
        under the deadline. phase: what it is, for messages ("dispatch: counts all-gather"); timeout_s: the
        deadline of this collective (default: the Board's, MOE_DISPATCHER_TIMEOUT_S or DEFAULT_TIMEOUT_S)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        n = self.next_collective
        self.next_collective += 1
        self.clear_abort()
        work = start()
        if _wait(work, min(QUIET_S, timeout_s), self._poll):
            return
        deadline = time.monotonic() + timeout_s - QUIET_S
        suspects: Dict[int, str] = {}  # abort messages seen on the previous poll
        while True:
            if self.store is not None:
                self.store.set(f"arrived/{self.rank}", str(n))
                aborts = self._aborts(n)
                for q, message in aborts.items():
                    if suspects.get(q) == message:
                        raise PeerError(f"moe_dispatcher reference: rank {q} raised: {message} (rank {self.rank} "
                                        f"was waiting in {phase}; the process group is unusable now)")
                suspects = aborts
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if _wait(work, min(POLL_S, left), self._poll):
                return
        missing = self._missing(n)
        who = f"waiting for ranks {missing}" if missing is not None else "(no store to tell which ranks are missing)"
        raise CollectiveTimeout(f"moe_dispatcher reference: rank {self.rank} timed out after {timeout_s:g} s in "
                                f"{phase} (collective {n} of this Buffer) {who}; set {TIMEOUT_ENV} to wait longer. "
                                f"The process group is unusable now (the collective stays pending)")

    # ------------------------------------------------------------------ errors of this rank
    def post_abort(self, exc: BaseException) -> None:
        """This rank raises `exc` in a Buffer call: let peers waiting in its next collective fail fast. Errors
        that every rank raises after the same collective post nothing (posts_abort)."""
        if self.store is None or not posts_abort(exc):
            return
        message = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(Exception):  # never hide the caller's error behind a store failure
            self.store.set(f"said/{self.rank}", message)  # first: a peer that sees the abort finds its message
            self.store.set(f"abort/{self.rank}", f"{self.next_collective}|{message}")
            self.abort_posted = True

    def clear_abort(self) -> None:
        """This rank is back after raising (its next collective, or its next call past the Buffer's checks,
        begins): peers must not read its abort any more (its message stays, for last_abort_message). The key is
        emptied, not deleted (see the module docstring)."""
        if self.abort_posted:
            self.abort_posted = False
            self.store.set(f"abort/{self.rank}", "")

    def abort_message(self, rank: int) -> Optional[str]:
        """The message of the abort rank `rank` has posted, or None (no store, no abort posted, or the rank came
        back and emptied it)."""
        return self._read(f"abort/{rank}", lambda value: value.partition("|")[2])

    def last_abort_message(self, rank: int) -> Optional[str]:
        """The message of the latest abort rank `rank` posted, even once it came back and emptied the abort, or None
        (no store, no abort ever posted). The compiled backends word a peer's device abort with it: their kernel saw
        the abort byte, and the rank may have come back since (its next launch clears both)."""
        return self._read(f"said/{rank}", lambda value: value)

    def _read(self, key: str, message: Callable[[str], str]) -> Optional[str]:
        if self.store is None:
            return None
        with contextlib.suppress(Exception):  # the error being built must not turn into a store error
            if self.store.check([key]):
                return message(self.store.get(key).decode()) or None
        return None

    # ------------------------------------------------------------------ Buffer creation
    def creation_round(self, step: str, error: Optional[BaseException], payload: object = None,
                       operation: str = "Buffer creation") -> List[object]:
        """One bounded agreement round of Buffer creation (or of another `operation`, the errors' words): every
        rank posts its verdict (`error`: what its local step raised, or None) with `payload` (a picklable object
        its peers need, e.g. an IPC handle) and waits for every peer's post. Returns every rank's payload (index:
        rank) when no rank failed; else raises CreationFailed on every rank alike, naming the failing ranks and their
        messages (on the failing rank, from its own `error`).

        Keys (under this Buffer's board prefix): "create/<step>/<rank>" = base64 of pickle((message or None,
        payload)). A peer's "abort/<rank>" without its post counts as its failure: a rank that raised in
        Buffer.__init__ before reaching this round (Buffer._post_abort) is not waited for. (Its post comes first:
        a peer past this round may already have raised in a later call.) A peer missing after
        MOE_DISPATCHER_TIMEOUT_S is named; this rank then posts its own abort, so that a peer arriving later fails
        at its next round or Buffer call instead of going on alone. Without a store the round is one
        all_gather_object over the group (unbounded, the verdicts still travel with the payloads)."""
        message = None if error is None else f"{type(error).__name__}: {error}"
        mine = (message, payload)
        failed: Dict[int, str] = {}
        missing: Sequence[int] = ()
        if self.store is None:
            posts: List[object] = [None] * self.num_ranks
            dist.all_gather_object(posts, mine, group=self.group)
        else:
            posts = [None] * self.num_ranks
            posts[self.rank] = mine
            self.store.set(f"create/{step}/{self.rank}", base64.b64encode(pickle.dumps(mine)).decode())
            deadline, nap = time.monotonic() + self.timeout_s, 0.002
            waiting = [q for q in range(self.num_ranks) if q != self.rank]
            while True:
                for q in list(waiting):
                    # A post for this step comes first: a peer past it may already have raised in a later call
                    # of the Buffer (its abort then is not about this step). The abort is read before the post:
                    # a peer sets its post before any later abort, so a post set before the abort is seen here;
                    # read the other way round, a peer could post and abort between the two reads.
                    abort = self.store.get(f"abort/{q}").decode() if self.store.check([f"abort/{q}"]) else ""
                    if self.store.check([f"create/{step}/{q}"]):
                        posts[q] = pickle.loads(base64.b64decode(self.store.get(f"create/{step}/{q}")))
                    elif abort:  # ("": an abort the rank emptied when it came back)
                        posts[q] = (abort.partition("|")[2], None)
                    else:
                        continue
                    waiting.remove(q)
                if not waiting or time.monotonic() >= deadline:
                    break
                time.sleep(min(nap, max(deadline - time.monotonic(), 0.0)))
                nap = min(2 * nap, POLL_S / 5)
            missing = waiting
        for q, post in enumerate(posts):
            if q not in missing and post[0] is not None:
                failed[q] = post[0]
        if not failed and not missing:
            return [post[1] for post in posts]
        what = "; ".join(f"rank {q}: {m}" for q, m in sorted(failed.items()))
        if missing:
            what += ("; " if what else "") + (f"ranks {missing} did not reach this step within {self.timeout_s:g} s "
                                              f"(set {TIMEOUT_ENV} to wait longer)")
        exc = CreationFailed(f"moe_dispatcher: {operation} failed on every rank ({step}): {what} (rank "
                             f"{self.rank})")
        exc.missing = missing
        if missing:  # a peer that comes later must not go on alone: it reads this rank's abort
            self.post_abort(exc)
        else:  # every rank read the same posts and raises the same error: nobody is left waiting
            on_every_rank(exc)
        if error is not None:
            raise exc from error
        raise exc

    # ------------------------------------------------------------------ reading the board
    def _aborts(self, n: int) -> Dict[int, str]:
        """Peer -> message of the aborts posted for collective n."""
        found = {}
        for q in range(self.num_ranks):
            key = f"abort/{q}"
            if q == self.rank or not self.store.check([key]):
                continue
            at, _, message = self.store.get(key).decode().partition("|")
            if at == str(n):
                found[q] = message
        return found

    def _missing(self, n: int) -> Optional[List[int]]:
        """The ranks that have not posted arrival at collective n (None without a store)."""
        if self.store is None:
            return None
        missing = []
        for q in range(self.num_ranks):
            key = f"arrived/{q}"
            if q != self.rank and (not self.store.check([key]) or int(self.store.get(key)) < n):
                missing.append(q)
        return missing


def _wait(work: "dist.Work", seconds: float, poll: bool) -> bool:
    """Wait up to `seconds` for `work`: True when it completed; a failed collective raises its own error.
    poll: check work.is_completed() (sleeping 20 us, doubling up to 2 ms) rather than wait(timeout)."""
    if poll:
        deadline, nap = time.monotonic() + seconds, 2e-5
        while not work.is_completed():
            if time.monotonic() >= deadline:
                return False
            time.sleep(nap)
            nap = min(2 * nap, 2e-3)
        work.wait()  # a failure raises here; a success orders the current stream after the collective
        return True
    try:
        work.wait(datetime.timedelta(seconds=seconds))
        return True
    except RuntimeError:
        if work.is_completed():  # it failed rather than timed out: raise that failure
            raise
        return False
