"""A Buffer creation that fails on one rank raises CreationFailed on every rank, soon, naming that rank (gloo ranks).

The real Buffer and compiled.create_backends over the intranode stub of tests/helpers (its IpcBuffer records what
the creation does with it) and a fake NVSHMEM extension, so that the compiled creation path runs on CPU. Injected on
one rank: the NVLink buffer's allocation fails (cudaMalloc), the IPC open of the peers' handles fails, the
extension is missing (the compiled backend on some ranks only), rank 0 cannot make NVSHMEM's unique id, NVSHMEM's
init raises (on every rank: the NVLink buffers are abandoned), and an argument only one rank has wrong (raised before the Buffer's signature agreement). Checked on every rank:
CreationFailed naming the failing rank and its message, well before MOE_DISPATCHER_TIMEOUT_S; ranks that allocated
free it (after every rank closed its mappings, when they were opened); NVSHMEM is not entered after a peer failed.
Before the creation rounds, the peers of the failing rank waited in the handles' all_gather_object, the unique-id
broadcast or the signature all-gather (until the world's timeout or the Board's deadline).
The topology exchange (hostnames) is such a round too, on every rank whether it was given a topology or not, and so
is Topology.from_group called alone: a rank that never comes to it is named.
"""
from __future__ import annotations

import base64
import pickle
import time
import types

import torch.distributed as dist
from dist import case, run_distributed

TIMEOUT_S = 40.0  # MOE_DISPATCHER_TIMEOUT_S of the ranks: every failure below must be reported long before it
FAST_S = 10.0
ENV = {"MOE_DISPATCHER_TIMEOUT_S": str(TIMEOUT_S)}
NVL_BYTES = 1 << 30


def _compiled_on_cpu(rank: int, events: list, fail: dict) -> None:
    """Let Buffer(backend='kernels') build the compiled backends on CPU: the intranode stub (whose IpcBuffer records
    into `events` and raises what fail["alloc"] / fail["open"] say) and a fake NVSHMEM extension (fail["uid"])."""
    import torch
    from stub_extension import stub_intranode

    from moe_dispatcher import Buffer, _ext, compiled
    from moe_dispatcher.runtime import nvshmem
    stub = stub_intranode(0)

    class IpcBuffer(stub.IpcBuffer):
        def __init__(self, *args):
            if fail.get("alloc"):
                raise RuntimeError(fail["alloc"])
            super().__init__(*args)
            events.append("alloc")

        def ipc_handle(self):
            return f"handle of rank {rank}".encode()

        def open_peers(self, handles):
            if fail.get("open"):
                raise RuntimeError(fail["open"])
            events.append(("open", list(handles)))

        def close(self):
            events.append("close")
            super().close()

        def destroy(self):
            events.append("destroy")
            super().destroy()

        def abandon(self):
            events.append("abandon")
            super().abandon()

    def get_unique_id():
        events.append("get_unique_id")
        if fail.get("uid"):
            raise RuntimeError(fail["uid"])
        return bytes(range(128))

    def init_with_unique_id(uid, rank_, nranks):
        events.append(("nvshmem_init", uid == bytes(range(128))))
        raise RuntimeError("fake NVSHMEM: init reached (the test stops here)")

    stub.IpcBuffer = IpcBuffer
    fake_nvshmem = types.SimpleNamespace(nvshmem_init_status=lambda: 0, nvshmem_get_unique_id=get_unique_id,
                                         nvshmem_init_with_unique_id=init_with_unique_id)
    ext = types.SimpleNamespace(intranode=stub, low_latency=types.SimpleNamespace(MAX_RANKS=8), peer_pool=None,
                                __file__="stub", **vars(fake_nvshmem))

    def extension_with(buffer, submodule, what):
        if fail.get("no_extension"):
            return None, fail["no_extension"]
        return ext, ""

    compiled._extension_with = extension_with
    _ext.load = lambda: ext
    _ext.require = lambda what: ext
    nvshmem._pick_backend = lambda: "extension"
    torch.cuda.current_device = lambda: 0
    torch.cuda.set_device = lambda device: None
    torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(multi_processor_count=132)
    Buffer.get_comm_stream = lambda self: types.SimpleNamespace()  # the stub's CommStream keeps it, never uses it


def _attempt(make) -> tuple:
    """(error type name, message, seconds) of make(), or (None, "", seconds) when it returned."""
    t0 = time.monotonic()
    try:
        make()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def _world_failures(rank: int, world_size: int) -> dict:
    from moe_dispatcher import Buffer
    out = {}

    def run(label: str, fail_on_1: dict, **kwargs) -> None:
        events: list = []
        _compiled_on_cpu(rank, events, fail_on_1 if rank == 1 else {})
        with case(label):
            err = _attempt(lambda: out.setdefault(f"{label}: buffer", Buffer(**kwargs)))
        out[label] = (*err, events)
        buf = out.pop(f"{label}: buffer", None)
        if buf is not None:
            buf.destroy()

    run("success", {}, num_nvl_bytes=NVL_BYTES, backend="kernels")
    run("allocation", {"alloc": "CUDA error: out of memory (cudaMalloc of the NVLink buffer)"},
        num_nvl_bytes=NVL_BYTES, backend="kernels")
    run("open", {"open": "cudaIpcOpenMemHandle: invalid device context"}, num_nvl_bytes=NVL_BYTES, backend="kernels")
    run("no extension", {"no_extension": "the extension moe_dispatcher._C is not available (stub)"},
        num_nvl_bytes=NVL_BYTES, backend="auto")
    run("allocation before NVSHMEM", {"alloc": "CUDA error: out of memory (cudaMalloc of the NVLink buffer)"},
        num_nvl_bytes=NVL_BYTES, num_rdma_bytes=1 << 20, low_latency_mode=True, backend="kernels")
    # Rank 0 cannot make NVSHMEM's unique id (the fail dict is rank 1's: swap the roles).
    events: list = []
    _compiled_on_cpu(rank, events, {"uid": "nvshmem_get_unique_id: bootstrap plugin missing"} if rank == 0 else {})
    with case("unique id"):
        out["unique id"] = (*_attempt(lambda: Buffer(num_nvl_bytes=NVL_BYTES, num_rdma_bytes=1 << 20,
                                                     low_latency_mode=True, backend="kernels")), events)
    # Every rank reaches NVSHMEM's init, which raises (the fake's, on every rank): no creation round follows, and
    # the peers have opened each rank's NVLink buffer, so it is abandoned, never freed (nor left to collection).
    events = []
    _compiled_on_cpu(rank, events, {})
    with case("NVSHMEM init"):
        out["init"] = (*_attempt(lambda: Buffer(num_nvl_bytes=NVL_BYTES, num_rdma_bytes=1 << 20,
                                                low_latency_mode=True, backend="kernels")), events)
    # Last: the peers' signature all-gather stays pending in the group.
    events = []
    with case("argument on one rank"):
        out["argument"] = (*_attempt(lambda: Buffer(num_nvl_bytes=-1 if rank == 1 else NVL_BYTES,
                                                    backend="reference")), events)
    store = dist.distributed_c10d._get_default_store()  # rank 1 stays until rank 0 is done (its exit would close
    store.add("argument done", 1)                        # the connection rank 0's pending all-gather reads)
    while int(store.add("argument done", 0)) < world_size:
        time.sleep(0.05)
    return out


def test_creation_failure_on_one_rank_raises_on_every_rank():
    results = run_distributed(_world_failures, 2, env=ENV, timeout=150)
    for rank, out in enumerate(results):
        kind, message, seconds, events = out["success"]
        assert kind is None, f"rank {rank}: {message}"
        assert ("open", [b"handle of rank 0", b"handle of rank 1"]) in events, events  # one exchange, both handles

        for label, step, said in (("allocation", "allocation", "out of memory"),
                                  ("open", "connection", "cudaIpcOpenMemHandle"),
                                  ("no extension", "allocation", "not available"),
                                  ("allocation before NVSHMEM", "allocation", "out of memory")):
            kind, message, seconds, events = out[label]
            assert kind == "CreationFailed", f"rank {rank}, {label}: {kind}: {message}"
            assert f"({step})" in message and "rank 1" in message and said in message, message
            assert seconds < FAST_S, f"rank {rank}, {label}: {seconds:.1f} s"
            assert not any(e == "get_unique_id" or e[0] == "nvshmem_init" for e in events), (label, events)
        # Who freed what: nothing was mapped after a failed allocation; after a failed open every rank closed its
        # mappings before freeing; a rank without the extension allocated nothing.
        events = out["allocation"][3]
        assert events == ([] if rank == 1 else ["alloc", "close", "destroy"]), events
        events = out["open"][3]
        if rank == 0:
            assert events[:2] == ["alloc", ("open", [b"handle of rank 0", b"handle of rank 1"])], events
        assert events[-3:] == ["close", "close", "destroy"], events  # close_mappings, then destroy (closes again)
        assert out["no extension"][3] == ([] if rank == 1 else ["alloc", "close", "destroy"])

        kind, message, seconds, events = out["unique id"]
        assert kind == "CreationFailed", f"rank {rank}: {kind}: {message}"
        assert "(NVSHMEM unique id)" in message and "rank 0: RuntimeError: nvshmem_get_unique_id" in message, message
        assert seconds < FAST_S, seconds
        assert events[-3:] == ["close", "close", "destroy"], events  # the connected NVLink buffer is freed
        assert ("get_unique_id" in events) == (rank == 0) and not any(e[0] == "nvshmem_init" for e in events)

        kind, message, seconds, events = out["init"]
        assert kind == "RuntimeError" and "fake NVSHMEM: init reached" in message, f"{kind}: {message}"
        assert ("nvshmem_init", True) in events and events[-1] == "abandon" and "destroy" not in events, events

        kind, message, seconds, _ = out["argument"]
        if rank == 1:
            assert kind == "ValueError" and "num_nvl_bytes" in message, message
        else:
            assert kind == "CreationFailed" and "rank 1 raised: ValueError" in message, f"{kind}: {message}"
            assert seconds < FAST_S, seconds


def _world_missing(rank: int, world_size: int) -> tuple:
    from moe_dispatcher import Buffer
    if rank == 1:  # never creates the Buffer
        time.sleep(TIMEOUT_S / 4 + 3)
        return None
    return _attempt(lambda: Buffer(num_nvl_bytes=NVL_BYTES, backend="reference"))


def test_creation_names_a_rank_that_never_comes():
    kind, message, seconds = run_distributed(_world_missing, 2, env={"MOE_DISPATCHER_TIMEOUT_S": str(TIMEOUT_S / 4)},
                                             timeout=60)[0]
    assert kind == "CreationFailed" and "waiting for ranks [1]" in message, f"{kind}: {message}"
    assert seconds < TIMEOUT_S / 4 + 5, seconds


def _world_late(rank: int, world_size: int) -> tuple:
    """Rank 1 comes to the Buffer's signature all-gather after rank 0 timed out there; its all-gather completes
    against rank 0's pending one. Its next creation round (the topology exchange) must name rank 0's failure (its
    abort)."""
    from moe_dispatcher import Buffer

    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        out = _attempt(lambda: Buffer(backend="reference"))
    else:
        time.sleep(LATE_TIMEOUT_S + 2)
        out = _attempt(lambda: Buffer(backend="reference"))
    store.add("late done", 1)  # rank 0 stays until rank 1 is done (its pending all-gather reads rank 0)
    while int(store.add("late done", 0)) < world_size:
        time.sleep(0.05)
    return out


LATE_TIMEOUT_S = 3.0


def test_a_rank_that_timed_out_in_creation_posts_its_abort():
    results = run_distributed(_world_late, 2, env={"MOE_DISPATCHER_TIMEOUT_S": str(LATE_TIMEOUT_S)}, timeout=60)
    kind, message, _ = results[0]
    assert kind == "CreationFailed" and "waiting for ranks [1]" in message, f"{kind}: {message}"
    kind, message, seconds = results[1]
    assert kind == "CreationFailed" and "(topology exchange): rank 0: CreationFailed" in message, f"{kind}: {message}"
    assert seconds < LATE_TIMEOUT_S, seconds


def _world_given_topology(rank: int, world_size: int) -> tuple:
    """Rank 0 is given its topology, rank 1 finds its own (MOE_DISPATCHER_NVL_SIZE, the same domain size: the
    signature agrees). Both must be created."""
    from moe_dispatcher import Buffer
    from moe_dispatcher.topology import Topology
    store = dist.distributed_c10d._get_default_store()
    given = Topology(rank, world_size, world_size) if rank == 0 else None
    out = _attempt(lambda: Buffer(backend="reference", topology=given))
    store.add("created", 1)  # a rank stays until every rank is done (or FAST_S passed)
    deadline = time.monotonic() + FAST_S
    while int(store.add("created", 0)) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    return out


def test_creation_with_a_topology_given_on_some_ranks_only():
    """Before the topology exchange was a round of every rank, the rank given a topology skipped the hostname
    all-gather and went on, and its peer waited in that all-gather (no deadline)."""
    results = run_distributed(_world_given_topology, 2, env={**ENV, "MOE_DISPATCHER_NVL_SIZE": "2"}, timeout=60)
    for rank, (kind, message, seconds) in enumerate(results):
        assert kind is None, f"rank {rank}: {kind}: {message}"
        assert seconds < FAST_S, (rank, seconds)


STUCK_TIMEOUT_S = 4.0


def _world_stuck_before_exchange(rank: int, world_size: int) -> tuple:
    """Rank 1 passes the signature round and never reaches the topology exchange (stuck telling its hostname)."""
    import socket

    from moe_dispatcher import Buffer
    if rank == 1:
        def stuck() -> str:
            time.sleep(STUCK_TIMEOUT_S + 3)
            raise OSError("gethostname gave up")
        socket.gethostname = stuck
    return _attempt(lambda: Buffer(backend="reference"))


def test_the_topology_exchange_names_a_rank_that_never_comes():
    """Before, the exchange was an all_gather_object: rank 0 waited in it with no deadline."""
    kind, message, seconds = run_distributed(_world_stuck_before_exchange, 2,
                                             env={"MOE_DISPATCHER_TIMEOUT_S": str(STUCK_TIMEOUT_S)}, timeout=60)[0]
    assert kind == "CreationFailed" and "(topology exchange)" in message, f"{kind}: {message}"
    assert f"ranks [1] did not reach this step within {STUCK_TIMEOUT_S:g} s" in message, message
    assert seconds < STUCK_TIMEOUT_S + 3, seconds


def _world_missing_from_group(rank: int, world_size: int) -> tuple:
    """Rank 1 never calls Topology.from_group (as the Megatron integration calls it before it makes its Buffer)."""
    from moe_dispatcher.topology import Topology
    if rank == 1:
        time.sleep(STUCK_TIMEOUT_S + 3)
        return None
    return _attempt(lambda: Topology.from_group(dist.group.WORLD))


def test_topology_from_group_names_a_rank_that_never_comes():
    """Before, Topology.from_group was an all_gather_object: rank 0 waited in it with no deadline."""
    kind, message, seconds = run_distributed(_world_missing_from_group, 2,
                                             env={"MOE_DISPATCHER_TIMEOUT_S": str(STUCK_TIMEOUT_S)}, timeout=60)[0]
    assert kind == "CreationFailed" and "Topology.from_group failed on every rank (topology exchange)" in message, \
        f"{kind}: {message}"
    assert f"ranks [1] did not reach this step within {STUCK_TIMEOUT_S:g} s" in message, message
    assert seconds < STUCK_TIMEOUT_S + 3, seconds


class _DictStore:
    """An in-memory store with a get that fails on a missing key (a real store's get blocks until its timeout)."""

    def __init__(self) -> None:
        self.keys: dict = {}

    def set(self, key: str, value) -> None:
        self.keys[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key: str) -> bytes:
        return self.keys[key]

    def check(self, keys: list) -> bool:
        return all(k in self.keys for k in keys)

    def delete_key(self, key: str) -> bool:
        return self.keys.pop(key, None) is not None


def _board_on(store, rank: int, num_ranks: int = 2):
    from moe_dispatcher.reference.board import Board
    board = Board.__new__(Board)
    board.rank, board.num_ranks, board.timeout_s, board.store = rank, num_ranks, 0.3, store
    board.next_collective, board.abort_posted = 3, False
    return board


class _InterleavingStore(_DictStore):
    """A store in which peer 0 posts its verdict for the round and then its abort (it raised later in the same
    Buffer creation) right after this rank's first read of the post: the order that once made a post look like a
    failure."""

    def __init__(self, step: str) -> None:
        super().__init__()
        self.post_key = f"create/{step}/0"
        self.peer_acted = False

    def check(self, keys: list) -> bool:
        present = super().check(keys)
        if keys == [self.post_key] and not self.peer_acted:
            self.peer_acted = True
            self.set(self.post_key, base64.b64encode(pickle.dumps((None, "payload of 0"))).decode())
            self.set("abort/0", "1|ValueError: raised after the round")
        return present


def test_a_post_followed_by_an_abort_counts_as_the_post():
    """A peer that posts its verdict and then aborts (a later step of its creation raised) between two reads of
    this rank is read as having passed the round: the round returns every payload instead of naming the peer's
    later error as its failure in this step."""
    step = "topology exchange"
    board = _board_on(_InterleavingStore(step), 1)
    board.timeout_s = 5.0
    got = board.creation_round(step, None, "payload of 1")
    if got != ["payload of 0", "payload of 1"]:
        raise AssertionError(f"the round's payloads: {got}")


def test_a_cleared_abort_is_emptied_not_deleted():
    """A rank back after raising empties its abort key instead of deleting it: a peer that found the key and reads
    it next must not meet a missing key (a real store's get would block for its whole timeout). Every reader takes
    the empty key for no abort; the message stays readable as the rank's last."""
    from moe_dispatcher import CreationFailed
    store = _DictStore()
    mine, peer = _board_on(store, 0), _board_on(store, 1)
    mine.post_abort(ValueError("bad argument"))
    if peer._aborts(3) != {0: "ValueError: bad argument"}:
        raise AssertionError(f"the posted abort: {peer._aborts(3)}")
    mine.clear_abort()
    if store.keys.get("abort/0") != b"":
        raise AssertionError(f"the cleared abort key: {store.keys.get('abort/0')!r} (emptied, never deleted)")
    if peer._aborts(3) or peer.abort_message(0) is not None:
        raise AssertionError(f"an emptied abort read as one: {peer._aborts(3)}, {peer.abort_message(0)!r}")
    if peer.last_abort_message(0) != "ValueError: bad argument":
        raise AssertionError(f"the last abort's message: {peer.last_abort_message(0)!r}")
    try:  # a creation round: rank 0 neither posted nor aborts, so it is missing, not failed
        peer.creation_round("step", None, "payload of 1")
    except CreationFailed as exc:
        if list(exc.missing) != [0] or "rank 0:" in str(exc):
            raise AssertionError(f"an emptied abort in a creation round: {exc} (missing {exc.missing})") from exc
    else:
        raise AssertionError("the round returned without rank 0's post")
