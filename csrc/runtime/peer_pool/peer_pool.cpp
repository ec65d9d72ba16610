#include "runtime/peer_pool/peer_pool.h"

#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

namespace moe_ep::peer_pool {

namespace {

struct Region {
  uintptr_t base;
  size_t bytes;
  int device;
  RegionAllocator allocator;
  bool closed = false;
  bool retired = false;
  void* free_when_empty = nullptr;

  Region(uintptr_t b, size_t n, int d) : base(b), bytes(n), device(d), allocator(n) {}
};

std::mutex g_mu;
std::map<uintptr_t, std::unique_ptr<Region>> g_regions;  // by base
size_t g_foreign_frees = 0;
thread_local std::map<int, uintptr_t> t_active;  // device -> base of this thread's region

// The region holding `p` (callers hold g_mu), or nullptr.
Region* containing(uintptr_t p) {
  auto it = g_regions.upper_bound(p);
  if (it == g_regions.begin()) return nullptr;
  --it;
  return p < it->second->base + it->second->bytes ? it->second.get() : nullptr;
}

// cudaFree of a retired region's memory, on its device (no lock held; never throws: it runs inside torch's free).
void free_device_memory(void* ptr, int device) {
  int before = -1;
  const bool switched = cudaGetDevice(&before) == cudaSuccess && before != device &&
                        cudaSetDevice(device) == cudaSuccess;
  const cudaError_t err = cudaFree(ptr);
  if (err != cudaSuccess) {
    std::fprintf(stderr, "moe_dispatcher peer pool: cudaFree of a retired region failed: %s\n",
                 cudaGetErrorString(err));
  }
  if (switched) cudaSetDevice(before);
}

}  // namespace

void register_region(uintptr_t base, size_t bytes, int device) {
  if (base == 0 || bytes == 0 || base % RegionAllocator::kDefaultAlignment != 0) {
    throw std::runtime_error("peer pool: a region needs a non-null base aligned to " +
                             std::to_string(RegionAllocator::kDefaultAlignment) + " bytes and a non-zero size");
  }
  std::lock_guard<std::mutex> lock(g_mu);
  const auto next = g_regions.lower_bound(base);
  const bool overlaps_next = next != g_regions.end() && next->first < base + bytes;
  const bool overlaps_prev = next != g_regions.begin() && std::prev(next)->first + std::prev(next)->second->bytes > base;
  if (overlaps_next || overlaps_prev) throw std::runtime_error("peer pool: the region overlaps a registered one");
  g_regions.emplace(base, std::make_unique<Region>(base, bytes, device));
}

void close_region(uintptr_t base) {
  std::lock_guard<std::mutex> lock(g_mu);
  const auto it = g_regions.find(base);
  if (it != g_regions.end()) it->second->closed = true;
}

bool retire_region(uintptr_t base, void* free_when_empty) {
  std::lock_guard<std::mutex> lock(g_mu);
  const auto it = g_regions.find(base);
  if (it == g_regions.end()) return false;
  Region& r = *it->second;
  r.closed = true;
  if (r.allocator.stats().num_blocks == 0) {
    g_regions.erase(it);
    return false;
  }
  r.retired = true;
  r.free_when_empty = free_when_empty;
  return true;
}

uintptr_t set_active_region(int device, uintptr_t base) {
  const auto it = t_active.find(device);
  const uintptr_t before = it == t_active.end() ? 0 : it->second;
  if (base == 0) {
    t_active.erase(device);
  } else {
    t_active[device] = base;
  }
  return before;
}

std::optional<RegionInfo> region_info(uintptr_t base) {
  std::lock_guard<std::mutex> lock(g_mu);
  const auto it = g_regions.find(base);
  if (it == g_regions.end()) return std::nullopt;
  const Region& r = *it->second;
  return RegionInfo{r.base, r.bytes, r.device, r.closed, r.retired, r.allocator.stats()};
}

size_t num_regions() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_regions.size();
}

size_t foreign_frees() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_foreign_frees;
}

}  // namespace moe_ep::peer_pool

using namespace moe_ep::peer_pool;

extern "C" void* moe_peer_pool_alloc(ssize_t size, int device, cudaStream_t) {
  if (size < 0) return nullptr;
  const auto active = t_active.find(device);
  if (active == t_active.end()) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  const auto it = g_regions.find(active->second);
  if (it == g_regions.end() || it->second->closed || it->second->device != device) return nullptr;
  const size_t offset = it->second->allocator.allocate(static_cast<size_t>(size));
  if (offset == RegionAllocator::kNoRoom) return nullptr;
  return reinterpret_cast<void*>(it->second->base + offset);
}

namespace {

// Waits for `device` (no lock held; never throws; errors, e.g. no device in the CPU tests, are cleared).
void synchronize_device(int device) {
  int before = -1;
  const bool switched = cudaGetDevice(&before) == cudaSuccess && before != device &&
                        cudaSetDevice(device) == cudaSuccess;
  if (cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();
  if (switched) cudaSetDevice(before);
}

}  // namespace

extern "C" void moe_peer_pool_free(void* ptr, ssize_t, int block_device, cudaStream_t) {
  // torch returns a segment only once the streams recorded on its blocks are done, but the block's own stream may
  // still run kernels queued before the free: torch relies on cudaFree synchronising the device. So wait before
  // the range can go to another segment (rare: torch frees segments only on empty_cache, an out-of-memory retry or
  // the pool's end).
  synchronize_device(block_device);
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  void* to_free = nullptr;
  int device = -1;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    Region* r = containing(p);
    if (r == nullptr) {
      ++g_foreign_frees;
      std::fprintf(stderr, "moe_dispatcher peer pool: free of %p, which lies in no region (ignored)\n", ptr);
      return;
    }
    if (r->allocator.release(p - r->base) == ReleaseResult::kNotAllocated) {
      std::fprintf(stderr, "moe_dispatcher peer pool: free of %p, which is no live block (a double free?); "
                   "ignored\n", ptr);
      return;
    }
    if (!r->retired || r->allocator.stats().num_blocks != 0) return;
    to_free = r->free_when_empty;
    device = r->device;
    g_regions.erase(r->base);  // forgotten before its memory goes: a new region may reuse the address
  }
  if (to_free != nullptr) free_device_memory(to_free, device);
}
