#include "runtime/peer_pool/region_allocator.h"

#include <stdexcept>

namespace moe_ep::peer_pool {

RegionAllocator::RegionAllocator(size_t size, size_t alignment)
    : alignment_(alignment), capacity_(alignment ? size / alignment * alignment : 0) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    throw std::invalid_argument("RegionAllocator: the alignment must be a power of two");
  }
  if (capacity_ > 0) insert_free(0, capacity_);
}

void RegionAllocator::insert_free(size_t offset, size_t bytes) {
  free_by_offset_.emplace(offset, bytes);
  free_by_size_.emplace(bytes, offset);
}

void RegionAllocator::erase_free(std::map<size_t, size_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_by_offset_.erase(it);
}

size_t RegionAllocator::allocate(size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes > capacity_) return kNoRoom;  // also keeps the rounding below from overflowing
  const size_t need = (bytes + alignment_ - 1) / alignment_ * alignment_;
  std::lock_guard<std::mutex> lock(mu_);
  const auto fit = free_by_size_.lower_bound({need, 0});
  if (fit == free_by_size_.end()) return kNoRoom;
  const size_t range_bytes = fit->first, offset = fit->second;
  erase_free(free_by_offset_.find(offset));
  if (range_bytes > need) insert_free(offset + need, range_bytes - need);
  live_.emplace(offset, need);
  in_use_ += need;
  if (in_use_ > peak_) peak_ = in_use_;
  return offset;
}

ReleaseResult RegionAllocator::release(size_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto block = live_.find(offset);
  if (block == live_.end()) {
    ++bad_releases_;
    return ReleaseResult::kNotAllocated;
  }
  size_t start = offset, bytes = block->second;
  live_.erase(block);
  in_use_ -= bytes;
  // Merge with the free range right after the block, then with the one right before it.
  auto next = free_by_offset_.lower_bound(offset);
  if (next != free_by_offset_.end() && next->first == offset + bytes) {
    bytes += next->second;
    const auto after = std::next(next);
    erase_free(next);
    next = after;
  }
  if (next != free_by_offset_.begin()) {
    const auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      start = prev->first;
      bytes += prev->second;
      erase_free(prev);
    }
  }
  insert_free(start, bytes);
  return ReleaseResult::kReleased;
}

size_t RegionAllocator::block_bytes(size_t offset) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto block = live_.find(offset);
  return block == live_.end() ? 0 : block->second;
}

RegionStats RegionAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  RegionStats s;
  s.capacity = capacity_;
  s.in_use = in_use_;
  s.peak_in_use = peak_;
  s.largest_free = free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
  s.num_blocks = live_.size();
  s.num_free_ranges = free_by_offset_.size();
  s.bad_releases = bad_releases_;
  return s;
}

}  // namespace moe_ep::peer_pool
