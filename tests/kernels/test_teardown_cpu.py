"""Teardown rules (issue 16, item 4) on gloo ranks, over fake compiled backends that record what the release asks
of them (runtime/release.py):

* destroy() is collective: no rank frees exported memory before every peer has stopped using it; a peer that never
  arrives is named after MOE_DISPATCHER_TIMEOUT_S, and the memory is abandoned, not freed;
* garbage collection never waits: a collected Buffer's IPC memory is freed once every peer has released its own,
  its NVSHMEM memory only at a collective point where every rank has collected it (the same frees, in the same
  order, on every rank), so ranks collecting at different moments neither deadlock nor free alone;
* NVSHMEM memory that a user's tensor still views stays allocated (on every rank alike);
* at exit, live Buffers are released.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist
from dist import case, run_distributed

TIMEOUT_S = 2.0
ENV = {"MOE_DISPATCHER_TIMEOUT_S": str(TIMEOUT_S)}


class FakeBackend:
    """The teardown side of a compiled backend: records (event, monotonic time)."""

    def __init__(self, symmetric: bool = False, views: bool = False) -> None:
        self.symmetric, self.views, self.broken = symmetric, views, False
        self.events: list = []

    def quiesce(self) -> None:
        self.events.append(("quiesce", time.monotonic()))

    def views_alive(self) -> bool:
        return self.views

    def free(self, symmetric: bool) -> None:
        self.events.append(("free" if symmetric or not self.symmetric else "free-ipc-only", time.monotonic()))

    def abandon(self) -> None:
        self.events.append(("abandon", time.monotonic()))

    def destroy(self) -> None:  # what Buffer.destroy called before the collective release
        self.events.append(("free", time.monotonic()))

    def kinds(self) -> list:
        return [e for e, _ in self.events]


def _buffer(backend: FakeBackend):
    """A reference Buffer whose compiled backend is `backend` (registered as a Buffer created with it is)."""
    from moe_dispatcher import Buffer
    from moe_dispatcher.runtime import release
    buf = Buffer(backend="reference")
    buf._kernels = backend
    release.register(buf, backend.symmetric)
    return buf


def _store():
    return dist.distributed_c10d._get_default_store()


def _world_destroy_waits(rank: int, world_size: int) -> dict:
    out = {}
    with case("destroy waits for the slowest peer"):
        b = FakeBackend()
        buf = _buffer(b)
        if rank == world_size - 1:
            time.sleep(1.0)
        t0 = time.monotonic()
        buf.destroy()
        out["destroy"] = (t0, b.events)
    with case("a peer that never destroys is named"):
        b = FakeBackend()
        buf = _buffer(b)
        if rank != 1:
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=r"ranks \[1\] did not destroy this Buffer") as err:
                buf.destroy()
            out["missing"] = (time.monotonic() - t0, b.kinds(), str(err.value))
            _store().set(f"test/missing/{rank}", "1")
        else:
            _store().wait([f"test/missing/{q}" for q in range(world_size) if q != 1])
            buf._destroyed = True  # never released: this rank plays a dead peer
    return out


def test_destroy_is_collective_and_bounded() -> None:
    out = run_distributed(_world_destroy_waits, 3, env=ENV)
    quiesced = max(dict(r["destroy"][1])["quiesce"] for r in out)  # the last rank to stop
    for rank, r in enumerate(out):
        kinds = [e for e, _ in r["destroy"][1]]
        assert kinds == ["quiesce", "free"], f"rank {rank}: {kinds}"
        assert dict(r["destroy"][1])["free"] >= quiesced, f"rank {rank} freed before the slowest rank stopped"
    for rank in (0, 2):
        took, kinds, msg = out[rank]["missing"]
        assert kinds == ["quiesce", "abandon"], f"rank {rank}: {kinds} ({msg})"
        assert TIMEOUT_S - 0.2 <= took <= TIMEOUT_S + 3.0, f"rank {rank} gave up after {took:.1f} s"


def _world_late_symmetric(rank: int, world_size: int) -> list:
    """Rank 0 destroys a Buffer holding NVSHMEM memory after rank 1's wait for it timed out: rank 0 sees every
    post, rank 1 does not."""
    s = FakeBackend(symmetric=True)
    buf = _buffer(s)
    if rank == 0:  # later than rank 1's two waits (the collective point, then the release posts)
        time.sleep(2 * TIMEOUT_S + 0.5)
        buf.destroy()
    else:
        with pytest.raises(RuntimeError, match=r"ranks \[0\] did not destroy this Buffer"):
            buf.destroy()
    return s.kinds()


def test_no_lone_collective_free_after_a_peer_gave_up() -> None:
    """nvshmem_free waits for every rank: a rank that saw every post must not free the NVSHMEM buffer when a peer
    gave up waiting (that peer will never join the free, so the free would hang). It frees what is local only."""
    kinds = run_distributed(_world_late_symmetric, 2, env=ENV)
    assert kinds[1] == ["quiesce", "abandon"], kinds[1]
    assert kinds[0] == ["quiesce", "free-ipc-only"], f"rank 0 entered a collective free alone: {kinds[0]}"


def _world_late_point(rank: int, world_size: int) -> list:
    """Both ranks collected a Buffer holding NVSHMEM memory; rank 1's wait at the next collective point ends before
    rank 0 arrives: rank 0 sees every post there, rank 1 does not."""
    import warnings

    from moe_dispatcher.runtime import release
    s = FakeBackend(symmetric=True)
    buf = _buffer(s)
    del buf
    gc.collect()
    if rank == 0:
        time.sleep(TIMEOUT_S / 2 + 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        release.collective_point(dist.group.WORLD, rank, world_size, TIMEOUT_S if rank == 0 else TIMEOUT_S / 2,
                                 "a point")
    return s.kinds()


def test_no_lone_collective_free_at_a_collective_point() -> None:
    """The same rule at a collective point (Buffer creation, destroy, exit): rank 0 saw every post, but rank 1 gave
    up waiting, so neither frees the parked NVSHMEM buffer (rank 0 alone in nvshmem_free would hang)."""
    kinds = run_distributed(_world_late_point, 2, env=ENV)
    assert kinds == [["quiesce"], ["quiesce"]], f"a rank freed at a point its peer gave up: {kinds}"


def _world_creation_failed_before_its_point(rank: int, world_size: int) -> tuple:
    """Both ranks collected a Buffer holding NVSHMEM memory; then a Buffer creation raises on rank 1 only, before its
    collective point (an argument only rank 1 has wrong, checked after the signature agreement); then a creation
    succeeds on both."""
    import warnings

    from moe_dispatcher import Buffer
    s = FakeBackend(symmetric=True)
    buf = _buffer(s)
    del buf
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.monotonic()
        try:
            failed = Buffer(backend="reference", low_latency_combine_reduction="bogus" if rank == 1 else None)
        except ValueError:
            assert rank == 1
        took = time.monotonic() - t0
        failed = None  # noqa: F841 - rank 0 made it alone: drop it
        Buffer(backend="reference")
    return s.kinds(), took


def test_a_creation_that_failed_on_one_rank_keeps_the_collective_points_paired() -> None:
    """The point of the failed creation is not waited for on rank 0 (rank 1 posted its abort), and the next
    creation's point is the same point on both ranks: the parked NVSHMEM buffer is freed there, on both."""
    out = run_distributed(_world_creation_failed_before_its_point, 2, env=ENV)
    assert [kinds for kinds, _ in out] == [["quiesce", "free"]] * 2, out
    assert out[0][1] < TIMEOUT_S, f"rank 0 waited {out[0][1]:.1f} s at the point rank 1 never reached"


def _world_gc(rank: int, world_size: int) -> dict:
    from moe_dispatcher.runtime import release
    store = _store()
    out = {}
    with case("garbage collection of an IPC buffer: freed once every peer released"):
        b = FakeBackend()
        buf = _buffer(b)
        if rank == 0:
            del buf
            gc.collect()
            out["ipc_parked"] = b.kinds()  # quiesced, not freed: rank 1 still uses its buffer
            store.set("test/gc0", "1")
        else:
            store.wait(["test/gc0"])
            del buf
            gc.collect()
            store.set("test/gc1", "1")
        store.wait(["test/gc1"])
        release.poll()
        out["ipc_freed"] = b.kinds()
    with case("garbage collection of an NVSHMEM buffer: freed at a collective point every rank reached parked"):
        s = FakeBackend(symmetric=True)
        buf = _buffer(s)
        if rank == 0:
            del buf
            gc.collect()
        from moe_dispatcher import Buffer
        Buffer(backend="reference")  # collective point: rank 1 has not collected it yet
        out["sym_after_first_point"] = s.kinds()
        buf = None
        gc.collect()
        Buffer(backend="reference")  # collective point: both parked
        out["sym_after_second_point"] = s.kinds()
    with case("a user's view of the NVSHMEM buffer keeps it on every rank"):
        v = FakeBackend(symmetric=True, views=rank == 1)
        buf = _buffer(v)
        buf.destroy()
        out["views"] = v.kinds()
    return out


def test_garbage_collection_releases_every_buffer_kind() -> None:
    out = run_distributed(_world_gc, 2, env=ENV)
    assert out[0]["ipc_parked"] == ["quiesce"], out[0]["ipc_parked"]
    for rank, r in enumerate(out):
        assert r["ipc_freed"] == ["quiesce", "free"], f"rank {rank}: {r['ipc_freed']}"
        assert r["sym_after_second_point"] == ["quiesce", "free"], f"rank {rank}: {r['sym_after_second_point']}"
        assert r["views"] == ["quiesce", "free-ipc-only"], f"rank {rank}: {r['views']}"
    assert out[0]["sym_after_first_point"] == ["quiesce"], out[0]["sym_after_first_point"]
    assert out[1]["sym_after_first_point"] == [], out[1]["sym_after_first_point"]


_EXIT_SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    from test_teardown_cpu import FakeBackend, _buffer
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + {store!r}, rank=rank, world_size=2)
    b = FakeBackend()
    b.free = lambda symmetric: open({out!r} + str(rank), "w").write("free")
    buf = _buffer(b)
    if rank == 1:
        time.sleep(0.5)
    raise ValueError("a clean Python error")
""")


def test_exit_after_an_error_releases_live_buffers(tmp_path) -> None:
    """Both ranks raise and exit with the Buffer alive: the exit handler releases it (and the exit is clean)."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "rank.py"
    script.write_text(_EXIT_SCRIPT.format(tests=here, store=str(tmp_path / "store"), out=str(tmp_path / "freed")))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(here, "..", "helpers"),
                                                       os.environ.get("PYTHONPATH", "")]), **ENV)
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], env=env, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=120)
        assert p.returncode == 1 and "ValueError: a clean Python error" in err, f"rank {r}: rc {p.returncode}\n{err}"
    for r in range(2):
        assert (tmp_path / f"freed{r}").exists(), f"rank {r} exited without releasing its live Buffer"


def test_soak_logic_on_cpu() -> None:
    """The GPU soak's own logic (case drawing, the five kinds of calls, the checks) on gloo ranks, where the
    reference serves every Buffer; a check every 4 calls."""
    from test_teardown_gpu import _world_soak
    res = run_distributed(_world_soak, 2, 40, 4)
    assert res[0]["checked"] == 10 and sum(res[0]["counts"].values()) == 40, res[0]


class _PostThenRaiseStore:
    """A store in which rank 0 posts its key and then raises (gone from then on) right after this rank's first read
    of that key: the order that once gave up on a rank whose post was there."""

    def __init__(self) -> None:
        self.keys: dict = {"round/p/1": b"1"}
        self.raised = False

    def check(self, keys: list) -> bool:
        present = all(k in self.keys for k in keys)
        if keys == ["round/p/0"] and not self.raised:
            self.keys["round/p/0"], self.raised = b"3", True
        return present

    def get(self, key: str) -> bytes:
        return self.keys[key]

    def gone(self, q: int) -> bool:
        return q == 0 and self.raised


def test_a_post_made_before_raising_counts() -> None:
    """wait_for_posts reads a rank that posted and then raised between two of its reads as posted, not gone."""
    from moe_dispatcher.runtime.release import wait_for_posts
    store = _PostThenRaiseStore()
    values, missing = wait_for_posts(store, ["round/p/0", "round/p/1"], 1.0, store.gone)
    if missing or values != {0: "3", 1: "1"}:
        raise AssertionError(f"values {values}, missing {missing}")


SLOW_TIMEOUT_S = 3.0


def _world_dead_symmetric_peer(rank: int, world_size: int) -> tuple:
    """Rank 1 never destroys a Buffer holding NVSHMEM memory (a dead peer); the others time the destroy() that names
    it."""
    b = FakeBackend(symmetric=True)
    buf = _buffer(b)
    if rank == 1:
        _store().wait([f"test/dead/{q}" for q in range(world_size) if q != 1])
        buf._destroyed = True  # never released: this rank plays a dead peer
        return 0.0, b.kinds()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] did not destroy this Buffer"):
        buf.destroy()
    took = time.monotonic() - t0
    _store().set(f"test/dead/{rank}", "1")
    return took, b.kinds()


def test_a_dead_peer_costs_two_timeouts_at_destroy_not_three() -> None:
    """destroy() of a Buffer with NVSHMEM memory waits once at its collective point and once for the release posts;
    having missed a post, it does not also wait for verdicts the dead peer would never post."""
    out = run_distributed(_world_dead_symmetric_peer, 3, env={"MOE_DISPATCHER_TIMEOUT_S": str(SLOW_TIMEOUT_S)})
    for rank in (0, 2):
        took, kinds = out[rank]
        assert kinds == ["quiesce", "abandon"], f"rank {rank}: {kinds}"
        assert 2 * SLOW_TIMEOUT_S - 0.2 <= took < 3 * SLOW_TIMEOUT_S - 0.5, f"rank {rank}: destroy() took {took:.1f} s"
