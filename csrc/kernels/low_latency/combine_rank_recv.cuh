// Combine, receive phase of the per-rank combine (Common::per_rank_combine; the sender's side is in
// combine_rank_send.cuh): out[t] from the partial rows the ranks of token t's picks sent back.
//
// A block takes a token at a time (t = blockIdx.x, grid-strided). Warp 0 reads the token's top-k row:
// its ranks in the order of their first pick (lane k is a rank's lead when no earlier slot has the
// same rank), with the number of picks on each. The leads wait for flag [rank][t] (relaxed spin, then
// acquire), reset it (this block is its only reader; its next writer comes two calls later) and list
// the ranks in shared memory; a CTA barrier hands the acquires to the block. Then, 16 bytes at a time:
//   acc = 0; for each rank in that order: acc = acc + term,
//   term = w_k * row (one pick k on that rank: the row as the expert returned it) or the bf16 partial
//   sum the rank computed (two or more picks), all in float32 (__fmul_rn / __fadd_rn), then bf16.
// With one pick per rank this is the per-expert combine's sum, in the same order, bit for bit.
#pragma once

#include <cuda_bf16.h>

#include "kernels/low_latency/common.cuh"

namespace moe_ep::low_latency {

__device__ __forceinline__ void combine_rank_recv_phase(const Common& c, const CombineArgs& a,
                                                        const HalfLayout& lay) {
  __shared__ int s_rank[kMaxTopk];       // the token's ranks, in the order of their first pick
  __shared__ float s_scale[kMaxTopk];    // weight of the rank's single pick, or 0: a partial sum
  __shared__ int s_single[kMaxTopk];     // 1: one pick on that rank (multiply), 0: partial (add)
  __shared__ int s_ranks;
  __shared__ unsigned long long s_wait[kMaxRanks];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int R = c.num_ranks, E = c.num_experts, L = E / R, K = a.num_topk, H = c.hidden;
  const int maxT = c.max_tokens, V = H / 8;
  const size_t row_bytes = static_cast<size_t>(H) * 2;
  int* flags = half_signals(c, lay) + signal_pair_flags(E, R);  // [R][maxT]
  const uint8_t* recv = c.buffer + c.half_offset + lay.recv_off;  // partial rows [R][maxT][H] bf16
  if (tid < kMaxRanks) s_wait[tid] = 0;
  __syncthreads();

  for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    if (warp == 0) {
      int64_t e = -1;
      float w = 0.0f;
      if (lane < K) {
        e = a.topk_idx[static_cast<size_t>(t) * K + lane];
        w = a.topk_weights[static_cast<size_t>(t) * K + lane];
      }
      const int d = e >= 0 ? static_cast<int>(e / L) : -1;
      int lead = lane, same = 0;  // the first lane with this lane's rank; lanes with it
      for (int k = K - 1; k >= 0; --k) {  // K <= 32, the same for every lane
        const int dk = __shfl_sync(0xffffffffu, d, k);
        if (d >= 0 && dk == d) {
          lead = k;
          ++same;
        }
      }
      const unsigned leads = __ballot_sync(0xffffffffu, d >= 0 && lead == lane);
      if (d >= 0 && lead == lane) {
        const int j = __popc(leads & ((1u << lane) - 1));
        int* flag = flags + static_cast<size_t>(d) * maxT + t;
        const uint64_t start = now_ns();
        wait_flag(c, flag, kWaitCombineData, d, 0, 1);
        if (a.wait_stats != nullptr) atomicAdd(&s_wait[d], static_cast<unsigned long long>(now_ns() - start));
        *flag = 0;
        s_rank[j] = d;
        s_single[j] = same == 1;
        s_scale[j] = w;
      }
      if (lane == 0) s_ranks = __popc(leads);
    }
    __syncthreads();  // warp 0's acquires cover the block's reads of the partial rows
    trace_event(c, kTraceCWaitDone);  // the last token's stamp stays
    const int n = s_ranks;
    for (int v = tid; v < V; v += blockDim.x) {
      float acc[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
      for (int q0 = 0; q0 < n; q0 += 8) {
        int4 raw[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (q0 + i < n)
            raw[i] = ld_cg(recv + (static_cast<size_t>(s_rank[q0 + i]) * maxT + t) * row_bytes + 16 * v);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (q0 + i >= n) break;
          const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&raw[i]);
          if (s_single[q0 + i]) {
            const float w = s_scale[q0 + i];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, __bfloat162float(x[j])));
          } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __bfloat162float(x[j]));
          }
        }
      }
      st_v4(static_cast<uint8_t*>(a.out) + (static_cast<size_t>(t) * H) * 2 + 16 * v, pack_bf16x8(acc));
    }
    __syncthreads();  // the token's shared state is rewritten by the next one
  }
  if (a.wait_stats != nullptr && tid < R && s_wait[tid] != 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + tid), s_wait[tid]);
}

}  // namespace moe_ep::low_latency
