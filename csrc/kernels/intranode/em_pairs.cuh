// The pairs of one received row in the expert-major layout, as the un-permuting pass (em_unpermute.cu) reads
// them: compacted in slot order, the order of the sum.
#pragma once

#include <cstdint>

namespace moe_ep::intranode {

// Whole warp, row r of the inverse table [rows, k] (k <= 32; -1: the pair was dropped). Lane j < k: pos = the
// expert-major row of slot j or -1. The valid pairs are compacted in slot order: lane i < n holds the i-th one's
// row (cpos) and weight (cw: weights[cpos], or 1 when weights is null). n is warp-uniform.
struct EmRowPairs {
  int pos;    // this lane's slot: its expert-major row, or -1
  int n;      // valid pairs of the row
  int cpos;   // lane i < n: the i-th valid pair's expert-major row
  float cw;   // and its weight
};

__device__ __forceinline__ EmRowPairs em_row_pairs(const int* inverse, const float* weights, int64_t r, int k,
                                                   int lane) {
  EmRowPairs p{-1, 0, 0, 1.f};
  float w = 1.f;
  if (lane < k) {
    p.pos = inverse[r * k + lane];
    if (p.pos >= 0 && weights != nullptr) w = weights[p.pos];
  }
  const unsigned valid = __ballot_sync(0xffffffffu, p.pos >= 0);
  p.n = __popc(valid);
  for (unsigned rest = valid, i = 0; rest != 0; rest &= rest - 1, ++i) {
    const int j = __ffs(rest) - 1;
    const int row = __shfl_sync(0xffffffffu, p.pos, j);
    const float wj = __shfl_sync(0xffffffffu, w, j);
    if (lane == static_cast<int>(i)) {
      p.cpos = row;
      p.cw = wj;
    }
  }
  return p;
}

}  // namespace moe_ep::intranode
