"""Peer pool: torch tensors in memory that every GPU of the Buffer's NVLink domain has mapped.

A Buffer made with num_pool_bytes=N > 0 (compiled intranode or internode backend; internode: the GPUs of the rank's
NVLink domain, indexed by local rank) has an N-byte region past its NVLink buffer, in
the same cudaMalloc allocation: exported with it through CUDA IPC, so every peer maps it when it maps the buffer and
nothing new is exchanged. PeerPool hands out torch tensors from that region through torch's caching allocator (a
torch.cuda.MemPool over a CUDAPluggableAllocator whose functions are moe_dispatcher._C's moe_peer_pool_alloc /
moe_peer_pool_free, over csrc/runtime/peer_pool/). A kernel of any rank can then read or write a live tensor of
another rank at peer_bases[rank] + offset_of(tensor): zero-copy outputs of dispatch and inputs of combine.

    pool = buffer.peer_pool
    recv_x = pool.allocate((rows, hidden), torch.bfloat16)   # or: with pool.allocating(): torch.empty(...)
    offset = pool.offset_of(recv_x)                          # the same region offset names it on every peer

Sizes: torch takes whole segments from the region (its caching allocator rounds a request of at most 1 MiB to a 2 MiB
segment shared with other small ones, 1-10 MiB to a 20 MiB segment, larger ones to a multiple of 2 MiB) and keeps
freed blocks cached for reuse by later allocations from the pool, as it does for its own memory. A request that does
not fit raises PeerPoolExhausted (a torch.OutOfMemoryError) naming what is in use.

Lifetime (docs/intranode.md, "Peer pool"): Buffer.destroy() (and garbage collection of the Buffer) DEFERS while pool
tensors are alive; it never refuses. It closes the pool on every rank alike: later allocations raise, peer_bases
raise (this rank's mappings of the peers' regions are gone), and the tensors stay valid local memory; the allocation
holding the region is freed once every peer has closed its mapping (the release protocol) AND torch has returned
every segment of the pool: after the last pool tensor is freed, at the next torch.cuda.empty_cache() (or when torch
frees cached memory on an OOM).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence

import torch

# torch keeps a raw pointer to the allocator in each pool that uses it, for as long as the pool holds any segment
# (past the MemPool object itself): one allocator per process, never released.
_allocator = None


def _pluggable_allocator(extension_file: str, native):
    global _allocator
    if _allocator is None:
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(extension_file, native.ALLOC_SYMBOL, native.FREE_SYMBOL)
    return _allocator


class PeerPoolExhausted(torch.OutOfMemoryError):
    """An allocation from a PeerPool does not fit in its region (raise Buffer(num_pool_bytes=...))."""


class PeerPool:
    """The peer pool of one rank of a Buffer (see the module docstring); made by the intranode or internode backend.

    Attributes:
        device:     the rank's CUDA device.
        rank, num_ranks: the rank in the NVLink domain and the domain's size.
        base:       device address of this rank's region (int).
        num_bytes:  the region's size (Buffer(num_pool_bytes=...)).
    """

    def __init__(self, ipc, native, extension_file: str, device: torch.device, rank: int, num_ranks: int) -> None:
        """ipc: the backend's IpcBuffer (num_pool_bytes > 0, peers opened); native: moe_dispatcher._C.peer_pool;
        extension_file: the path of moe_dispatcher._C (torch loads the allocator functions from it)."""
        self._native = native
        self.device = device
        self.rank, self.num_ranks = rank, num_ranks
        self.num_bytes = ipc.pool_bytes
        peers = ipc.peer_ptrs()
        self.base = peers[rank] + ipc.pool_offset
        self._peer_bases: Optional[List[int]] = [p + ipc.pool_offset for p in peers]
        self._peer_bases_tensor: Optional[torch.Tensor] = None
        native.register_region(self.base, self.num_bytes, device.index)
        allocator = _pluggable_allocator(extension_file, native)
        with torch.cuda.device(device):
            self._mem_pool: Optional[torch.cuda.MemPool] = torch.cuda.MemPool(allocator.allocator())

    # ------------------------------------------------------------------ allocation
    @property
    def closed(self) -> bool:
        """True once the Buffer was destroyed (or collected): no allocation, no peer addresses."""
        return self._mem_pool is None

    def _check_open(self, what: str) -> None:
        if self._mem_pool is None:
            raise RuntimeError(f"PeerPool.{what}: the pool of rank {self.rank} is closed (its Buffer was destroyed); "
                               f"its tensors stay valid, but nothing new comes from it")

    @contextlib.contextmanager
    def allocating(self) -> Iterator["PeerPool"]:
        """Within it, this thread's CUDA allocations on the pool's device come from the region (torch's
        use_mem_pool; other threads and devices are unaffected). Contexts of two PeerPools of one device do not
        nest (RuntimeError); an allocation that does not fit raises torch.OutOfMemoryError."""
        self._check_open("allocating")
        index = self.device.index
        previous = self._native.set_active_region(index, self.base)
        if previous not in (0, self.base):
            self._native.set_active_region(index, previous)
            raise RuntimeError("PeerPool.allocating(): another PeerPool's context is active on this device and "
                               "thread; pool contexts of one device do not nest")
        try:
            with torch.cuda.use_mem_pool(self._mem_pool, self.device):
                yield self
        finally:
            self._native.set_active_region(index, previous)

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape` and `dtype` on the pool's device, in the region. Raises
        PeerPoolExhausted when it does not fit, RuntimeError once the pool is closed."""
        try:
            with torch.cuda.device(self.device), self.allocating():
                return torch.empty(tuple(shape), dtype=dtype, device=self.device)
        except torch.OutOfMemoryError as exc:
            # Raised below, outside this block: an error raised in it would carry `exc` as its context, and exc's
            # traceback holds torch.cuda.use_mem_pool's frame, hence the MemPool: while the caller kept the error,
            # torch could never hand this pool's segments back (close() and empty_cache() would not free the region).
            known = str(exc) if isinstance(exc, PeerPoolExhausted) else None
        if known is not None:
            raise PeerPoolExhausted(known)
        nbytes = torch.Size(tuple(shape)).numel() * torch.empty((), dtype=dtype).element_size()
        s = self.stats()
        raise PeerPoolExhausted(
            f"PeerPool of rank {self.rank}: no room for {tuple(shape)} {dtype} ({nbytes} bytes): "
            f"{s['in_use']} of {s['capacity']} bytes are held by torch's segments of this pool, the largest free "
            f"range is {s['largest_free']} bytes (torch rounds requests up to whole segments: 2 MiB for at most "
            f"1 MiB, 20 MiB for 1-10 MiB); raise Buffer(num_pool_bytes=...) or free pool tensors")

    @property
    def mem_pool_id(self) -> tuple:
        """The id of the torch.cuda.MemPool the region's blocks come through (for native callers that allocate
        from it as use_mem_pool does: csrc/intranode_bindings.cpp, cached direct dispatch). RuntimeError once
        closed."""
        self._check_open("mem_pool_id")
        return self._mem_pool.id

    # ------------------------------------------------------------------ addresses
    def contains(self, tensor: torch.Tensor) -> bool:
        """True when all of `tensor`'s storage lies in this rank's region."""
        if tensor.device != self.device or tensor.device.type != "cuda":
            return False
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        return self.base <= start and start + storage.nbytes() <= self.base + self.num_bytes

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Byte offset of `tensor`'s first element (data_ptr(), storage offset included) in the region: the same
        tensor sits at peer_bases[rank] + offset in every peer's mapping. Raises ValueError when the tensor's
        storage is not in this pool."""
        if not self.contains(tensor):
            raise ValueError(f"PeerPool.offset_of: the tensor ({tuple(tensor.shape)} {tensor.dtype} on "
                             f"{tensor.device}) is not in the peer pool of rank {self.rank} (allocate it with "
                             f"PeerPool.allocate or inside PeerPool.allocating())")
        return tensor.data_ptr() - self.base

    @property
    def peer_bases(self) -> List[int]:
        """Device address of every rank's region in this process (index: rank in the domain; this rank's is
        `base`), for kernels: rank r's tensor at offset o is at peer_bases[r] + o. Valid until the Buffer is
        destroyed (RuntimeError after)."""
        self._check_open("peer_bases")
        return list(self._peer_bases)

    def peer_bases_tensor(self) -> torch.Tensor:
        """peer_bases as an int64 [num_ranks] tensor on the pool's device (made once)."""
        self._check_open("peer_bases_tensor")
        if self._peer_bases_tensor is None:
            self._peer_bases_tensor = torch.tensor(self._peer_bases, dtype=torch.int64, device=self.device)
        return self._peer_bases_tensor

    def peer_view(self, rank: int, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor over rank `rank`'s region at byte `offset` (this process's mapping; for rank == self.rank the
        region itself): torch kernels on it read and write the peer's memory over NVLink. For tests and
        diagnostics: it must not be used after the Buffer is destroyed (the mapping is closed then)."""
        self._check_open("peer_view")
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"PeerPool.peer_view: rank {rank} is not in 0..{self.num_ranks - 1}")
        item = torch.empty((), dtype=dtype).element_size()
        nbytes = torch.Size(tuple(shape)).numel() * item
        if offset < 0 or offset % item or offset + nbytes > self.num_bytes:
            raise ValueError(f"PeerPool.peer_view: {nbytes} bytes at offset {offset} do not fit the region of "
                             f"{self.num_bytes} bytes aligned to {item}")
        raw = self._native.device_bytes(self._peer_bases[rank] + offset, nbytes, self.device.index)
        return raw.view(dtype).view(tuple(shape))

    # ------------------------------------------------------------------ state
    def stats(self) -> dict:
        """The region's allocator: {capacity, in_use (bytes of torch's segments, live or cached), peak_in_use,
        largest_free, num_blocks, num_free_ranges, bad_releases, closed, retired, ...}; a forgotten region (closed,
        every segment returned) reports zeros and closed=True."""
        info = self._native.region_info(self.base)
        if info is None:
            return {"capacity": self.num_bytes, "in_use": 0, "peak_in_use": 0, "largest_free": 0, "num_blocks": 0,
                    "num_free_ranges": 0, "bad_releases": 0, "closed": True, "retired": True}
        return dict(info)

    def close(self) -> None:
        """The Buffer stops (destroy or collection, before its mappings close): no new allocations, no peer
        addresses. Dropping the MemPool makes torch return its cached free segments now; the segments of live
        tensors come back after those are freed, at torch's next empty_cache. Idempotent."""
        if self._mem_pool is None:
            return
        self._native.close_region(self.base)
        self._peer_bases = self._peer_bases_tensor = None
        self._mem_pool = None
