// Plain C++ test of csrc/runtime/peer_pool/region_allocator.{h,cpp} (no GPU, no torch): built and run by
// tests/kernels/test_region_allocator_cpu.py. Each check prints what failed; the exit status is the number of
// failed checks.
#include "runtime/peer_pool/region_allocator.h"

#include "expect.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

using moe_ep::peer_pool::RegionAllocator;
using moe_ep::peer_pool::ReleaseResult;

namespace {

constexpr size_t kNo = RegionAllocator::kNoRoom;

// True when the allocator is back to one free range spanning the whole region.
bool fully_merged(const RegionAllocator& a) {
  const auto s = a.stats();
  return s.in_use == 0 && s.num_blocks == 0 && s.num_free_ranges == 1 && s.largest_free == s.capacity;
}

void alignment() {
  RegionAllocator a(10 * 512 + 100);  // the tail past the last whole unit is never handed out
  EXPECT(a.stats().capacity == 10 * 512);
  const size_t x = a.allocate(1), y = a.allocate(513), z = a.allocate(0);
  EXPECT(x == 0 && y == 512 && z == 3 * 512);
  EXPECT(a.block_bytes(x) == 512 && a.block_bytes(y) == 1024 && a.block_bytes(z) == 512);
  EXPECT(a.stats().in_use == 4 * 512);
  RegionAllocator big(1 << 24, 1 << 21);  // 2 MiB units (the caching allocator's segment granularity)
  for (size_t bytes : {size_t{1}, size_t{(1 << 21) + 1}, size_t{3 << 20}}) {
    const size_t off = big.allocate(bytes);
    EXPECT(off != kNo && off % (1 << 21) == 0 && big.block_bytes(off) % (1 << 21) == 0);
  }
  bool threw = false;
  try {
    RegionAllocator bad(4096, 384);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  EXPECT(threw);
  RegionAllocator tiny(100);  // smaller than one unit: nothing to hand out
  EXPECT(tiny.stats().capacity == 0 && tiny.allocate(1) == kNo);
}

void exhaustion() {
  RegionAllocator a(8 * 512);
  EXPECT(a.allocate(8 * 512 + 1) == kNo);
  EXPECT(a.allocate(SIZE_MAX) == kNo && a.allocate(SIZE_MAX - 100) == kNo);  // no overflow in the rounding
  std::vector<size_t> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(a.allocate(500));
  EXPECT(std::find(blocks.begin(), blocks.end(), kNo) == blocks.end());
  EXPECT(a.allocate(1) == kNo);  // full
  auto s = a.stats();
  EXPECT(s.in_use == s.capacity && s.largest_free == 0 && s.num_free_ranges == 0 && s.num_blocks == 8);
  EXPECT(a.release(blocks[5]) == ReleaseResult::kReleased);
  EXPECT(a.allocate(1024) == kNo);   // one unit free: a two-unit block does not fit
  EXPECT(a.allocate(512) == blocks[5]);  // the freed unit is reused
  for (size_t b : blocks) EXPECT(a.release(b) == ReleaseResult::kReleased);
  EXPECT(fully_merged(a));
  EXPECT(a.stats().peak_in_use == 8 * 512);
  EXPECT(a.allocate(8 * 512) == 0);  // the whole region again, as one block
}

void fragmentation_and_best_fit() {
  RegionAllocator a(16 * 512);
  // Units: A=[0,2) B=[2,5) C=[5,6) D=[6,10) E=[10,11) rest [11,16) free.
  const size_t A = a.allocate(2 * 512), B = a.allocate(3 * 512), C = a.allocate(512), D = a.allocate(4 * 512),
               E = a.allocate(512);
  EXPECT(A == 0 && B == 2 * 512 && C == 5 * 512 && D == 6 * 512 && E == 10 * 512);
  EXPECT(a.release(B) == ReleaseResult::kReleased && a.release(D) == ReleaseResult::kReleased);
  // Free: [2,5) 3 units, [6,10) 4 units, [11,16) 5 units = 12 units, but no range of 6.
  auto s = a.stats();
  EXPECT(s.in_use == 4 * 512 && s.num_free_ranges == 3 && s.largest_free == 5 * 512);
  EXPECT(a.allocate(6 * 512) == kNo);
  // Best fit: a 3-unit request takes the 3-unit hole, a 4-unit one the 4-unit hole, leaving the tail whole.
  const size_t three = a.allocate(3 * 512), four = a.allocate(4 * 512);
  EXPECT(three == B && four == D);
  EXPECT(a.stats().largest_free == 5 * 512);
  // Among equal fits, the lowest offset.
  EXPECT(a.release(A) == ReleaseResult::kReleased && a.release(E) == ReleaseResult::kReleased);
  EXPECT(a.allocate(512) == A);
  for (size_t b : {A, three, four}) EXPECT(a.release(b) == ReleaseResult::kReleased);
  EXPECT(a.release(C) == ReleaseResult::kReleased);
  EXPECT(fully_merged(a));
}

void coalescing_in_every_order() {
  // Free five adjacent blocks in every order: the free list must end as one range each time.
  std::vector<int> order = {0, 1, 2, 3, 4};
  int permutations = 0;
  do {
    RegionAllocator a(5 * 512);
    std::vector<size_t> b;
    for (int i = 0; i < 5; ++i) b.push_back(a.allocate(512));
    size_t freed = 0;
    for (int i : order) {
      EXPECT(a.release(b[i]) == ReleaseResult::kReleased);
      freed += 512;
      EXPECT(a.stats().in_use == 5 * 512 - freed);
    }
    EXPECT(fully_merged(a));
    ++permutations;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT(permutations == 120);
  // Merging on both sides at once: free 0 and 2, then 1 joins all three.
  RegionAllocator a(4 * 512);
  const size_t x = a.allocate(512), y = a.allocate(512), z = a.allocate(512), w = a.allocate(512);
  EXPECT(a.release(x) == ReleaseResult::kReleased && a.release(z) == ReleaseResult::kReleased);
  EXPECT(a.stats().num_free_ranges == 2);
  EXPECT(a.release(y) == ReleaseResult::kReleased);
  EXPECT(a.stats().num_free_ranges == 1 && a.stats().largest_free == 3 * 512);
  EXPECT(a.release(w) == ReleaseResult::kReleased && fully_merged(a));
}

void double_and_foreign_release() {
  RegionAllocator a(8 * 512);
  const size_t x = a.allocate(2 * 512), y = a.allocate(512);
  EXPECT(a.release(x) == ReleaseResult::kReleased);
  const auto before = a.stats();
  EXPECT(a.release(x) == ReleaseResult::kNotAllocated);        // double release
  EXPECT(a.release(y + 256) == ReleaseResult::kNotAllocated);  // inside a block, not its start
  EXPECT(a.release(100 * 512) == ReleaseResult::kNotAllocated);  // outside the region
  const auto after = a.stats();
  EXPECT(after.bad_releases == 3 && before.bad_releases == 0);
  EXPECT(after.in_use == before.in_use && after.num_free_ranges == before.num_free_ranges &&
         after.largest_free == before.largest_free && after.num_blocks == 1);
  EXPECT(a.block_bytes(y) == 512 && a.block_bytes(x) == 0);
  EXPECT(a.release(y) == ReleaseResult::kReleased && fully_merged(a));
}

void random_against_model() {
  // Random allocations and releases, checked after every step against a list of live blocks: no two overlap, all
  // lie in the region, in_use is their sum; at the end everything merges back.
  std::mt19937_64 rng(7);
  RegionAllocator a(1 << 20);
  std::vector<std::pair<size_t, size_t>> live;  // (offset, bytes asked)
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const size_t bytes = 1 + rng() % (40 * 512);
      const size_t off = a.allocate(bytes);
      if (off == kNo) {
        EXPECT(a.stats().largest_free < bytes);
        continue;
      }
      EXPECT(off % 512 == 0 && off + bytes <= (1 << 20));
      live.emplace_back(off, bytes);
    } else {
      const size_t i = rng() % live.size();
      EXPECT(a.release(live[i].first) == ReleaseResult::kReleased);
      live[i] = live.back();
      live.pop_back();
    }
    if (step % 97 == 0) {
      auto sorted = live;
      std::sort(sorted.begin(), sorted.end());
      size_t sum = 0;
      for (size_t i = 0; i < sorted.size(); ++i) {
        sum += a.block_bytes(sorted[i].first);
        if (i + 1 < sorted.size()) EXPECT(sorted[i].first + a.block_bytes(sorted[i].first) <= sorted[i + 1].first);
      }
      EXPECT(a.stats().in_use == sum && a.stats().num_blocks == live.size());
    }
  }
  for (const auto& [off, bytes] : live) EXPECT(a.release(off) == ReleaseResult::kReleased);
  EXPECT(fully_merged(a));
}

void threads() {
  // Four threads allocate and release at once; every 512-byte unit records its owner, so an overlap (two live
  // blocks sharing a unit) is caught. At the end the region merges back into one range.
  constexpr size_t kUnits = 4096;
  RegionAllocator a(kUnits * 512);
  std::vector<std::atomic<int>> owner(kUnits);
  for (auto& o : owner) o.store(-1);
  std::atomic<int> overlaps{0}, bad{0};
  auto work = [&](int id) {
    std::mt19937_64 rng(id);
    std::vector<std::pair<size_t, size_t>> mine;
    for (int step = 0; step < 20000; ++step) {
      if (mine.empty() || rng() % 2 == 0) {
        const size_t units = 1 + rng() % 16;
        const size_t off = a.allocate(units * 512);
        if (off == kNo) continue;
        for (size_t u = off / 512; u < off / 512 + units; ++u) {
          int expected = -1;
          if (!owner[u].compare_exchange_strong(expected, id)) ++overlaps;
        }
        mine.emplace_back(off, units);
      } else {
        const auto [off, units] = mine.back();
        mine.pop_back();
        for (size_t u = off / 512; u < off / 512 + units; ++u) owner[u].store(-1);
        if (a.release(off) != ReleaseResult::kReleased) ++bad;
      }
    }
    for (const auto& [off, units] : mine) {
      for (size_t u = off / 512; u < off / 512 + units; ++u) owner[u].store(-1);
      if (a.release(off) != ReleaseResult::kReleased) ++bad;
    }
  };
  std::vector<std::thread> pool;
  for (int id = 0; id < 4; ++id) pool.emplace_back(work, id);
  for (auto& t : pool) t.join();
  EXPECT(overlaps.load() == 0 && bad.load() == 0);
  EXPECT(fully_merged(a));
  EXPECT(a.stats().peak_in_use > 0 && a.stats().peak_in_use <= kUnits * 512);
}

}  // namespace

int main() {
  alignment();
  exhaustion();
  fragmentation_and_best_fit();
  coalescing_in_every_order();
  double_and_foreign_release();
  random_against_model();
  threads();
  return moe_test::finish("region_allocator_test");
}
