// A sub-allocator over one contiguous range of memory, by byte offset: best fit over a free list whose neighbouring
// free ranges are merged at every release. Torch-free and CUDA-free (it never touches the memory), so that
// tests/cpp/region_allocator_test.cpp checks it on any machine; runtime/peer_pool/peer_pool.h puts it over a
// peer-mapped device region and hands its blocks to torch's caching allocator.
// Thread-safe: every method takes the allocator's mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>

namespace moe_ep::peer_pool {

struct RegionStats {
  size_t capacity = 0;       // bytes that can be handed out (the region rounded down to the alignment)
  size_t in_use = 0;         // bytes of live blocks (each rounded up to the alignment)
  size_t peak_in_use = 0;    // most bytes in use at once since creation
  size_t largest_free = 0;   // the largest block an allocate() can return now
  size_t num_blocks = 0;     // live blocks
  size_t num_free_ranges = 0;  // free ranges (1 when nothing is allocated: the free list is fully merged)
  size_t bad_releases = 0;   // release() of an offset that is not a live block (double or foreign frees)
};

enum class ReleaseResult { kReleased, kNotAllocated };

class RegionAllocator {
 public:
  static constexpr size_t kDefaultAlignment = 512;
  static constexpr size_t kNoRoom = SIZE_MAX;

  // A region of `size` bytes; every block starts at a multiple of `alignment` (a power of two) and spans a
  // multiple of it. Throws std::invalid_argument on a bad alignment.
  explicit RegionAllocator(size_t size, size_t alignment = kDefaultAlignment);
  RegionAllocator(const RegionAllocator&) = delete;
  RegionAllocator& operator=(const RegionAllocator&) = delete;

  // Offset of a new block of at least `bytes` (0 counts as 1), or kNoRoom when no free range holds it. Best fit:
  // the smallest free range that holds it, the lowest-offset one among equals; the block is cut from its front.
  size_t allocate(size_t bytes);
  // Returns the block at `offset` and merges it with free neighbours. kNotAllocated (and nothing changes, but
  // bad_releases counts it) when `offset` is not the start of a live block: a double release or a foreign one.
  ReleaseResult release(size_t offset);
  // Bytes of the live block at `offset` (after rounding), 0 when there is none.
  size_t block_bytes(size_t offset) const;
  RegionStats stats() const;
  size_t alignment() const { return alignment_; }

 private:
  void insert_free(size_t offset, size_t bytes);  // callers hold mu_
  void erase_free(std::map<size_t, size_t>::iterator it);

  mutable std::mutex mu_;
  const size_t alignment_;
  const size_t capacity_;
  std::map<size_t, size_t> free_by_offset_;        // offset -> bytes: neighbours for merging
  std::set<std::pair<size_t, size_t>> free_by_size_;  // (bytes, offset): best fit by lower_bound
  std::unordered_map<size_t, size_t> live_;        // offset -> bytes of each live block
  size_t in_use_ = 0, peak_ = 0, bad_releases_ = 0;
};

}  // namespace moe_ep::peer_pool
