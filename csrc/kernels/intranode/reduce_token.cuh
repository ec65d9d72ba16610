// One token's combine reduction, shared by the ring combine (combine.cu: rows in ring slots) and the pull
// combine (combine_pull.cu: rows in the holders' peer-mapped inputs).
#pragma once

#include <cstdint>

#include "kernels/common/ptx.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/intranode/protocol.h"

namespace moe_ep::intranode {

// acc += the biases' vector v of row `token` (bias0, then bias1; either may be absent): the start of every combine
// reduction's float32 order.
template <typename T>
__device__ __forceinline__ void add_biases(float* acc, const CombineArgs& a, int64_t token, int row_bytes, int v) {
  const uint8_t* biases[2] = {a.bias0, a.bias1};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (biases[i] == nullptr) continue;
    Vec<T> b;
    b.raw = ptx::ld_nc_v4(reinterpret_cast<const int4*>(biases[i] + token * row_bytes) + v);
#pragma unroll
    for (int e = 0; e < Vec<T>::kElems; ++e) acc[e] += to_float(b.elems[e]);
  }
}

// Whole warp: output row `token` = cast(bias0 + bias1 + rows of ranks ascending), accumulated in float32 in
// that order (the reference's order), and the top-k weights summed likewise. src[d]: the token's row from rank d
// (row_bytes bytes), or null; weights[d]: its top-k weights (float32 [K]; read only with out_topk_weights), null
// with src[d]. kRanks: the rank count rounded up to 2, 4 or 8, so the per-rank arrays stay in registers; each
// lane keeps 8 row loads in flight (8 / kRanks vectors of each rank's row). Loads are ld.global.cg (L2 only):
// the rows were written by other kernels or GPUs.
template <typename T, int kRanks>
__device__ __forceinline__ void reduce_token(const CombineArgs& a, int64_t token, const uint8_t* const* src,
                                             const uint8_t* const* weights, int row_bytes, int lane) {
  constexpr int kUnroll = 8 / kRanks;
  const int vecs = row_bytes / 16;
  for (int v0 = lane; v0 < vecs; v0 += 32 * kUnroll) {
    Vec<T> rows[kUnroll][kRanks];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * 32;
#pragma unroll
      for (int d = 0; d < kRanks; ++d) {
        if (v < vecs && src[d] != nullptr) rows[u][d].raw = ptx::ld_cg_v4(reinterpret_cast<const int4*>(src[d]) + v);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * 32;
      if (v >= vecs) break;
      float acc[Vec<T>::kElems];
#pragma unroll
      for (int e = 0; e < Vec<T>::kElems; ++e) acc[e] = 0.f;
      add_biases<T>(acc, a, token, row_bytes, v);
#pragma unroll
      for (int d = 0; d < kRanks; ++d) {
        if (src[d] != nullptr) {
#pragma unroll
          for (int e = 0; e < Vec<T>::kElems; ++e) acc[e] += to_float(rows[u][d].elems[e]);
        }
      }
      Vec<T> out;
#pragma unroll
      for (int e = 0; e < Vec<T>::kElems; ++e) out.elems[e] = from_float<T>(acc[e]);
      reinterpret_cast<int4*>(a.out + token * row_bytes)[v] = out.raw;
    }
  }
  if (a.out_topk_weights != nullptr && lane < a.num_topk) {
    float wsum = 0.f;
#pragma unroll
    for (int d = 0; d < kRanks; ++d) {
      if (src[d] != nullptr) wsum += __int_as_float(ptx::ld_cg(reinterpret_cast<const int*>(weights[d]) + lane));
    }
    a.out_topk_weights[token * a.num_topk + lane] = wsum;
  }
}

}  // namespace moe_ep::intranode
