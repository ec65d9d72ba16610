// Expert-major combine, local pass (docs/intranode.md): each received row's partial sum over its expert-major
// rows, written as a rank-major row that the rank-major combine kernel then sends. Over the whole GPU, one
// warp per received row.
//
// Arithmetic (protocol.h, EmUnpermuteArgs): float32, from 0, pairs in slot order, each term x (or x * weight
// rounded to float32) added with __fadd_rn / __fmul_rn so no FMA contraction changes a rounding.
//
// Speed: the traffic is every expert row read once and every received row written once (HBM bound). The
// row's pairs are compacted first (lane i: the i-th pair in slot order), then each lane issues 8 independent
// 16-byte loads before it adds anything: kGroup pairs x kUnroll vectors, chosen from the row's pair count
// (1 x 8, 2 x 4, 4 x 2, 8 x 1), so a row with one pair keeps as many loads in flight as one with eight. When
// the group holds all the row's pairs (every row with at most 8), each vector's sum is finished right after
// the loads and no accumulator lives across loads; rows with more than 8 pairs carry one vector's sums from
// group to group. Every output has one writer; x is read-only here: plain loads and stores.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/common/ptx.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/intranode/em_pairs.cuh"
#include "kernels/common/launch_check.cuh"
#include "kernels/intranode/protocol.h"

namespace moe_ep::intranode {
namespace {

constexpr int kUnpermuteThreads = kEmRowsPerBlock * 32;
constexpr int kLoadsInFlight = 8;  // 16-byte loads per lane before the first addition
// 4 blocks (32 warps) per SM: 64 registers, enough for the 8 loads in flight without spilling (sm_90a).
constexpr int kUnpermuteBlocksPerSm = 4;

// acc += term(x) for every element, in this order (the caller walks the pairs in slot order).
template <typename T>
__device__ __forceinline__ void add_term(float (&acc)[Vec<T>::kElems], const Vec<T>& x, bool weighted, float w) {
#pragma unroll
  for (int e = 0; e < Vec<T>::kElems; ++e) {
    const float v = to_float(x.elems[e]);
    acc[e] = __fadd_rn(acc[e], weighted ? __fmul_rn(v, w) : v);
  }
}

template <typename T>
__device__ __forceinline__ int4 round_vec(const float (&acc)[Vec<T>::kElems]) {
  Vec<T> out;
#pragma unroll
  for (int e = 0; e < Vec<T>::kElems; ++e) out.elems[e] = from_float<T>(acc[e]);
  return out.raw;
}

// A row whose n pairs (0 <= n <= kGroup) fit one group: lane i < n holds pair i's position cpos and weight cw.
template <typename T, int kGroup, int kUnroll>
__device__ __forceinline__ void reduce_one_group(const EmUnpermuteArgs& a, int n, int cpos, float cw, int4* out,
                                                 int vecs, int row_bytes, int lane) {
  const bool weighted = a.weights != nullptr;
  const int4* src[kGroup];
  float w[kGroup];
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    const int p = __shfl_sync(0xffffffffu, cpos, i);
    w[i] = __shfl_sync(0xffffffffu, cw, i);
    src[i] = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(i < n ? p : 0) * row_bytes);
  }
#pragma unroll 1
  for (int v0 = 0; v0 < vecs; v0 += 32 * kUnroll) {
    Vec<T> x[kGroup][kUnroll];
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * 32 + lane;
        if (i < n && v < vecs) x[i][u].raw = ptx::ld_nc_v4(src[i] + v);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * 32 + lane;
      if (v >= vecs) break;
      float acc[Vec<T>::kElems];
#pragma unroll
      for (int e = 0; e < Vec<T>::kElems; ++e) acc[e] = 0.f;
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        if (i < n) add_term<T>(acc, x[i][u], weighted, w[i]);
      }
      out[v] = round_vec<T>(acc);
    }
  }
}

// A row with more than kGroup pairs (at most 32: K <= kMaxTopk): groups of kGroup, one vector per lane at a
// time, its sums carried from group to group.
template <typename T, int kGroup>
__device__ __forceinline__ void reduce_many_groups(const EmUnpermuteArgs& a, int n, int cpos, float cw, int4* out,
                                                   int vecs, int row_bytes, int lane) {
  const bool weighted = a.weights != nullptr;
#pragma unroll 1
  for (int v0 = 0; v0 < vecs; v0 += 32) {
    const int v = v0 + lane;
    float acc[Vec<T>::kElems];
#pragma unroll
    for (int e = 0; e < Vec<T>::kElems; ++e) acc[e] = 0.f;
#pragma unroll 1
    for (int g = 0; g < n; g += kGroup) {
      Vec<T> x[kGroup];
      float w[kGroup];
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        const int p = __shfl_sync(0xffffffffu, cpos, (g + i) & 31);
        w[i] = __shfl_sync(0xffffffffu, cw, (g + i) & 31);
        if (g + i < n && v < vecs) {
          x[i].raw = ptx::ld_nc_v4(reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(p) * row_bytes) + v);
        }
      }
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        if (g + i < n) add_term<T>(acc, x[i], weighted, w[i]);
      }
    }
    if (v < vecs) out[v] = round_vec<T>(acc);
  }
}

template <typename T>
__global__ void __launch_bounds__(kUnpermuteThreads, kUnpermuteBlocksPerSm) em_unpermute_kernel(EmUnpermuteArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kEmRowsPerBlock + (threadIdx.x >> 5);
  // Rows past the received count (the tail of a num_worst_tokens table) are never sent by combine.
  if (r >= a.num_rows || r >= *a.received) return;
  const int k = a.num_topk;
  const EmRowPairs pairs = em_row_pairs(a.inverse, a.weights, r, k, lane);
  const int n = pairs.n, cpos = pairs.cpos, pos = pairs.pos;
  const float cw = pairs.cw;
  const int row_bytes = a.hidden * static_cast<int>(sizeof(T));
  const int vecs = row_bytes / 16;
  int4* out = reinterpret_cast<int4*>(a.out + r * row_bytes);
  if (n <= 1) {  // n == 0 (every pair dropped): zeros
    reduce_one_group<T, 1, kLoadsInFlight>(a, n, cpos, cw, out, vecs, row_bytes, lane);
  } else if (n == 2) {
    reduce_one_group<T, 2, kLoadsInFlight / 2>(a, n, cpos, cw, out, vecs, row_bytes, lane);
  } else if (n <= 4) {
    reduce_one_group<T, 4, kLoadsInFlight / 4>(a, n, cpos, cw, out, vecs, row_bytes, lane);
  } else if (n <= 8) {
    reduce_one_group<T, 8, 1>(a, n, cpos, cw, out, vecs, row_bytes, lane);
  } else {
    reduce_many_groups<T, kLoadsInFlight>(a, n, cpos, cw, out, vecs, row_bytes, lane);
  }
  if (a.out_topk_weights != nullptr && lane < k) {
    a.out_topk_weights[r * k + lane] = pos >= 0 ? a.topk_weights[pos] : 0.f;
  }
}

}  // namespace

void launch_em_unpermute(const EmUnpermuteArgs& args, cudaStream_t stream) {
  if (args.num_rows <= 0) return;
  const dim3 grid((args.num_rows + kEmRowsPerBlock - 1) / kEmRowsPerBlock);
  switch (args.dtype) {
    case kBf16: em_unpermute_kernel<__nv_bfloat16><<<grid, kUnpermuteThreads, 0, stream>>>(args); break;
    case kFp16: em_unpermute_kernel<__half><<<grid, kUnpermuteThreads, 0, stream>>>(args); break;
    default: em_unpermute_kernel<float><<<grid, kUnpermuteThreads, 0, stream>>>(args); break;
  }
  check_launch("em_unpermute_kernel");
}

}  // namespace moe_ep::intranode
