// Warp-wide row copies with several 16-byte loads in flight per lane (torch-free). Used by every kernel that
// moves whole rows: the intranode and internode ring senders and receivers.
#pragma once

#include "kernels/common/ptx.cuh"

namespace moe_ep {

// dst[0..n) = src[0..n) in 16-byte vectors, kUnroll loads in flight per lane. kFromRing: src is a ring
// written by another GPU (ld.cg, after the acquire of the counter that published it); otherwise src is a
// read-only input (ld.nc). Stores are plain (they may go to a peer over NVLink; the caller publishes them).
template <bool kFromRing, int kUnroll>
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int n, int lane) {
  for (int base = lane; base < n; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * 32;
      if (i < n) v[u] = kFromRing ? ptx::ld_cg_v4(src + i) : ptx::ld_nc_v4(src + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * 32;
      if (i < n) dst[i] = v[u];
    }
  }
}

}  // namespace moe_ep
