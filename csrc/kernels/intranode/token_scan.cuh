// TokenScan: a sender warp's walk over its channel's tokens bound for one destination (intranode dispatch
// kernels: the ring sender of dispatch.cu and the direct sender of dispatch_direct.cu).
#pragma once

#include <cstdint>

namespace moe_ep::intranode {

// A sender warp's walk over its channel's tokens bound for one destination, 32 at a time (every lane
// holds the same state): the window [base, base + 32), its hits `mask`, and `before`, the hits of the
// earlier windows. The next window's flags are loaded one window ahead (next_hit, lane i: token
// base + 32 + i), so crossing a window rarely waits for memory.
struct TokenScan {
  const bool* in_rank;
  int num_ranks, dst, end;
  int base, before;
  unsigned mask;
  bool next_hit;

  __device__ bool hit(int t) const { return t < end && in_rank[static_cast<int64_t>(t) * num_ranks + dst]; }
  __device__ void start(int begin, int lane) {
    base = begin;
    before = 0;
    mask = __ballot_sync(0xffffffffu, hit(begin + lane));
    next_hit = hit(begin + 32 + lane);
  }
  // The token of the channel's k-th row for dst (k never decreases between calls), or -1 past the last.
  __device__ int find(int k, int lane) {
    while (k >= before + __popc(mask)) {
      if (base + 32 >= end) return -1;
      before += __popc(mask);
      base += 32;
      mask = __ballot_sync(0xffffffffu, next_hit);
      next_hit = hit(base + 32 + lane);
    }
    const int j = k - before;
    const bool mine = ((mask >> lane) & 1u) && __popc(mask & ((1u << lane) - 1u)) == j;
    return base + __ffs(__ballot_sync(0xffffffffu, mine)) - 1;
  }
};

}  // namespace moe_ep::intranode
