// The peer pool's regions: device ranges that every peer maps (a tail of an IpcBuffer's allocation), each with a
// RegionAllocator, and the two C entry points through which torch's caching allocator takes blocks from them
// (torch.cuda.memory.CUDAPluggableAllocator over this extension's file; moe_dispatcher/compiled/peer_pool.py).
//
// Which region an allocation comes from: torch calls moe_peer_pool_alloc(size, device, stream) with no pool id, so
// each thread names its region per device (set_active_region; PeerPool.allocating() sets it around torch's
// use_mem_pool, which routes only the current thread's allocations too). A free finds its region by address.
//
// Lifetime of a region (docs/intranode.md, "Peer pool"): registered -> closed (the owner stops: no new blocks,
// live ones stay valid) -> retired (the memory's owner is destroyed). A retired region with live blocks (torch
// still holds segments: live tensors, or cached blocks not yet returned by torch.cuda.empty_cache()) keeps the
// memory allocated and is forgotten at its last free, which then frees the memory if the owner handed it over.
// Torch-free; the registry's lock is never held while calling into torch or CUDA.
#pragma once

#include <cuda_runtime.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "runtime/peer_pool/region_allocator.h"

namespace moe_ep::peer_pool {

struct RegionInfo {
  uintptr_t base = 0;
  size_t bytes = 0;
  int device = -1;
  bool closed = false;   // no new blocks
  bool retired = false;  // the owner is gone; forgotten at the last free
  RegionStats stats;
};

// Adds [base, base + bytes) of `device` (base a multiple of RegionAllocator::kDefaultAlignment). Throws
// std::runtime_error when it overlaps a registered region.
void register_region(uintptr_t base, size_t bytes, int device);
// No new blocks from the region at `base` (its allocations fail); live blocks stay. Unknown base: no-op.
void close_region(uintptr_t base);
// The owner of the memory at `base` goes away: closes the region. No live block: forgets it and returns false
// (the owner frees the memory itself). Live blocks: returns true and keeps the region until its last block is
// freed, then forgets it and cudaFree's `free_when_empty` (nullptr: the memory stays allocated until the process
// exits, the way of an abandoned IpcBuffer). Unknown base: false.
bool retire_region(uintptr_t base, void* free_when_empty);
// This thread's pool allocations on `device` come from the region at `base` (0: from none, they fail). Returns
// the region named before.
uintptr_t set_active_region(int device, uintptr_t base);
std::optional<RegionInfo> region_info(uintptr_t base);
size_t num_regions();
// Frees of an address in no region (counted and reported on stderr, never acted on).
size_t foreign_frees();

}  // namespace moe_ep::peer_pool

// The allocator functions torch.cuda.memory.CUDAPluggableAllocator takes (its alloc / free signatures): a block
// of the calling thread's active region of `device`, nullptr when there is none or it is full or closed (torch
// then raises torch.OutOfMemoryError: an allocation routed to a pool is not retried after a cache flush); free
// returns a block (a double or foreign free is reported on stderr and ignored). free first synchronises `device`,
// as cudaFree does, on which torch relies before a segment's memory can go elsewhere (torch orders reuse against
// the streams recorded on a block, not against the block's own stream); alloc does not synchronise.
extern "C" {
__attribute__((visibility("default"))) void* moe_peer_pool_alloc(ssize_t size, int device, cudaStream_t stream);
__attribute__((visibility("default"))) void moe_peer_pool_free(void* ptr, ssize_t size, int device,
                                                              cudaStream_t stream);
}
