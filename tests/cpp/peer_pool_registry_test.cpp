// Plain C++ test of the peer pool's region registry and its C entry points (csrc/runtime/peer_pool/peer_pool.cpp)
// without a GPU: regions are fake device addresses that nothing dereferences; the only CUDA calls are the free's
// device synchronisation, which fails harmlessly without a GPU (a retired region is handed no memory to free). Built and run by tests/kernels/test_region_allocator_cpu.py; the
// exit status is the number of failed checks.
#include "runtime/peer_pool/peer_pool.h"

#include "expect.h"

#include <cstdio>
#include <stdexcept>
#include <thread>

using namespace moe_ep::peer_pool;

namespace {

constexpr uintptr_t kA = 0x7f0000000000, kB = 0x7f0010000000;  // two fake regions of 1 MiB on devices 0 and 1
constexpr size_t kMiB = 1 << 20;

uintptr_t alloc(ssize_t size, int device) {
  return reinterpret_cast<uintptr_t>(moe_peer_pool_alloc(size, device, nullptr));
}
void release(uintptr_t p, int device) { moe_peer_pool_free(reinterpret_cast<void*>(p), 0, device, nullptr); }

bool throws(void (*f)()) {
  try {
    f();
  } catch (const std::runtime_error&) {
    return true;
  }
  return false;
}

void registration() {
  register_region(kA, kMiB, 0);
  register_region(kB, kMiB, 1);
  EXPECT(num_regions() == 2);
  EXPECT(throws([] { register_region(kA + kMiB / 2, kMiB, 0); }));  // overlaps A's end
  EXPECT(throws([] { register_region(kA - kMiB / 2, kMiB, 0); }));  // overlaps A's start
  EXPECT(throws([] { register_region(kA + 3 * kMiB, kMiB, 0); }) == false);  // disjoint: fine
  close_region(kA + 3 * kMiB);
  EXPECT(retire_region(kA + 3 * kMiB, nullptr) == false);  // empty: forgotten at once
  EXPECT(throws([] { register_region(kA + 3 * kMiB + 100, kMiB, 0); }));  // misaligned base
  EXPECT(num_regions() == 2 && !region_info(kA + 3 * kMiB).has_value());
}

void active_region_routes_allocations() {
  EXPECT(alloc(512, 0) == 0);  // no active region on this thread: nothing
  EXPECT(set_active_region(0, kA) == 0);
  EXPECT(set_active_region(1, kB) == 0);
  const uintptr_t a = alloc(1000, 0), b = alloc(1000, 1);
  EXPECT(a == kA && b == kB);
  EXPECT(alloc(1000, 2) == 0);  // a device with no region
  EXPECT(region_info(kA)->stats.in_use == 1024 && region_info(kB)->stats.num_blocks == 1);
  // Another thread has no active region: its allocations fail, and its frees still find the region by address.
  uintptr_t other = 1;
  std::thread([&] {
    other = alloc(512, 0);
    release(a, 0);
  }).join();
  EXPECT(other == 0 && region_info(kA)->stats.in_use == 0);
  EXPECT(alloc(2 * kMiB, 0) == 0);  // bigger than the region
  release(b, 1);
  EXPECT(set_active_region(1, 0) == kB);
}

void bad_frees_are_counted_not_acted_on() {
  const uintptr_t a = alloc(512, 0);
  release(a, 0);
  release(a, 0);  // double free
  EXPECT(region_info(kA)->stats.bad_releases == 1 && region_info(kA)->stats.in_use == 0);
  const size_t before = foreign_frees();
  release(0x1000, 0);  // in no region
  EXPECT(foreign_frees() == before + 1);
}

void close_and_retire() {
  const uintptr_t a = alloc(4096, 0), b = alloc(4096, 0);
  close_region(kA);
  EXPECT(alloc(512, 0) == 0);  // closed: no new blocks
  EXPECT(region_info(kA)->closed && !region_info(kA)->retired);
  release(a, 0);  // live blocks are still returned
  EXPECT(retire_region(kA, nullptr) == true);  // b is live: the region waits for it
  EXPECT(region_info(kA)->retired && num_regions() == 2);
  release(b, 0);  // the last block: forgotten
  EXPECT(!region_info(kA).has_value() && num_regions() == 1);
  EXPECT(retire_region(kA, nullptr) == false);  // unknown now
  register_region(kA, kMiB, 0);  // the same address again (a new IpcBuffer where the old one was)
  EXPECT(alloc(512, 0) == kA);
  release(kA, 0);
  EXPECT(retire_region(kA, nullptr) == false && retire_region(kB, nullptr) == false && num_regions() == 0);
  EXPECT(set_active_region(0, 0) == kA);
}

}  // namespace

int main() {
  registration();
  active_region_routes_allocations();
  bad_frees_are_counted_not_acted_on();
  close_and_retire();
  return moe_test::finish("peer_pool_registry_test");
}
