// Warp-wide row copies with several 16-byte loads in flight per lane (torch-free).
#pragma once

#include "kernels/common/ptx.cuh"
#include "kernels/intranode/protocol.h"

namespace moe_dispatcher::intranode {

// dst[0..n) = src[0..n) in 16-byte vectors, kUnroll loads in flight per lane. kFromRing: src is a ring
// written by another GPU (ld.cg); otherwise src is a read-only input (ld.nc). Stores are plain (they may
// go to a peer over NVLink).
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

// Ring of (channel c, source src) inside the buffer `base` of its receiver.
__device__ __forceinline__ uint8_t* ring_slots(uint8_t* base, size_t src_block_bytes, int src, int c, int num_slots,
                                               int slot_bytes) {
  return base + kRingsOffset + src * src_block_bytes + static_cast<size_t>(c) * num_slots * slot_bytes;
}

// Tokens [begin, end) of channel c when T tokens are split over C channels.
__device__ __forceinline__ void channel_range(int num_tokens, int num_channels, int c, int& begin, int& end) {
  const int per = (num_tokens + num_channels - 1) / num_channels;
  begin = min(c * per, num_tokens);
  end = min(begin + per, num_tokens);
}

}  // namespace moe_dispatcher::intranode
