// Combine, receive phase: wait for the flags of all E experts, then
// out[t] = bf16(sum over k ascending of w[t,k] * row(t, expert k)), each product rounded to
// float32 and added in float32 (__fmul_rn/__fadd_rn: never fused), as the reference does; a -1
// slot adds 0. With CombineArgs::rank_partials, the per-rank order instead (reduce_chunk_rank_partials).
//
// Flags: written once per call by the expert's PE (signal_peer), read by every block here with
// ld_acquire_sys (then a CTA barrier hands the acquire to the block's other threads). The last
// block to finish polling (workspace kWsCombineRecvDone, GPU scope) writes them back to 0.
#pragma once

#include <cuda_bf16.h>

#include "kernels/low_latency/common.cuh"

namespace moe_ep::low_latency {

// out[t, col .. col+8) of this lane (the warp covers 256 channels of token t): lane k < K holds slot k
// (expert my_e, weight my_w) of the token; the rows are recv [e][t] (bf16 [E][maxT][H]). The caller
// made them visible to the whole warp (acquire + barrier).
__device__ __forceinline__ void reduce_chunk(const Common& c, const CombineArgs& a, const uint8_t* recv, int t,
                                             int col, int64_t my_e, float my_w) {
  const int H = c.hidden, K = a.num_topk;
  const size_t row_bytes = static_cast<size_t>(H) * 2;
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
  // Slots in groups of 8: the group's loads are all issued before the first is used, then the
  // products are added in slot order (the order, hence the bits, of the one-at-a-time loop).
  for (int k0 = 0; k0 < K; k0 += 8) {
    int4 raw[8];
    float w[8];
    bool has[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int k = k0 + u;  // < 32: K <= kMaxTopk
      const int64_t e = __shfl_sync(0xffffffffu, my_e, k);
      w[u] = __shfl_sync(0xffffffffu, my_w, k);
      has[u] = k < K && e >= 0;
      raw[u] = make_int4(0, 0, 0, 0);
      if (has[u] && col < H)
        raw[u] = ld_cg(recv + (static_cast<size_t>(e) * c.max_tokens + t) * row_bytes +
                       static_cast<size_t>(col) * 2);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      if (k0 + u >= K) break;
      const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw[u]);
      if (has[u]) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w[u], __bfloat162float(v[j])));
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], 0.0f);
      }
    }
  }
  if (col < H) st_v4(static_cast<uint8_t*>(a.out) + (static_cast<size_t>(t) * H + col) * 2, pack_bf16x8(acc));
}

// reduce_chunk with CombineArgs::rank_partials: the token's ranks in the order of their first pick; a rank
// with one pick adds w_k * row_k, a rank with several adds bf16(its picks' weighted sum, k ascending) as
// float, all in float32. The bits of the per-rank combine (combine_rank_*.cuh), computed here from the
// per-expert rows (the kernels a Buffer picks for peers without NVLink, with the per-rank order).
__device__ __forceinline__ void reduce_chunk_rank_partials(const Common& c, const CombineArgs& a, const uint8_t* recv,
                                                           int t, int col, int64_t my_e, float my_w) {
  const int H = c.hidden, K = a.num_topk, lane = threadIdx.x % 32;
  const int L = c.num_experts / c.num_ranks;
  const size_t row_bytes = static_cast<size_t>(H) * 2;
  const int d = lane < K && my_e >= 0 ? static_cast<int>(my_e / L) : -1;
  int lead = lane;  // the first lane with this lane's rank
  for (int k = K - 1; k >= 0; --k) {
    const int dk = __shfl_sync(0xffffffffu, d, k);
    if (d >= 0 && dk == d) lead = k;
  }
  unsigned leads = __ballot_sync(0xffffffffu, d >= 0 && lead == lane);
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
  while (leads != 0) {  // ranks in the order of their first pick (uniform over the warp)
    const int k_lead = __ffs(leads) - 1;
    leads &= leads - 1;
    const int dr = __shfl_sync(0xffffffffu, d, k_lead);
    unsigned picks = __ballot_sync(0xffffffffu, d == dr);
    const bool single = __popc(picks) == 1;
    float part[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) part[j] = 0.0f;
    while (picks != 0) {  // the rank's picks, k ascending, 8 loads in flight
      int ks[8];
      int4 raw[8];
      int m = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        ks[i] = -1;
        if (picks != 0) {
          ks[i] = __ffs(picks) - 1;
          picks &= picks - 1;
          m = i + 1;
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        raw[i] = make_int4(0, 0, 0, 0);
        const int64_t e = __shfl_sync(0xffffffffu, my_e, ks[i] < 0 ? 0 : ks[i]);
        if (i < m && col < H)
          raw[i] = ld_cg(recv + (static_cast<size_t>(e) * c.max_tokens + t) * row_bytes + static_cast<size_t>(col) * 2);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float w = __shfl_sync(0xffffffffu, my_w, ks[i] < 0 ? 0 : ks[i]);
        if (i >= m) continue;
        const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw[i]);
#pragma unroll
        for (int j = 0; j < 8; ++j) part[j] = __fadd_rn(part[j], __fmul_rn(w, __bfloat162float(v[j])));
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
      acc[j] = __fadd_rn(acc[j], single ? part[j] : __bfloat162float(__float2bfloat16_rn(part[j])));
  }
  if (col < H) st_v4(static_cast<uint8_t*>(a.out) + (static_cast<size_t>(t) * H + col) * 2, pack_bf16x8(acc));
}

__device__ __forceinline__ void combine_recv_phase(const Common& c, const CombineArgs& a,
                                                   const HalfLayout& lay) {
  __shared__ unsigned long long s_wait[kMaxRanks];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = blockDim.x / 32;
  const int R = c.num_ranks, E = c.num_experts, L = E / R, H = c.hidden, K = a.num_topk;
  int* flags = reinterpret_cast<int*>(c.buffer + c.half_offset + lay.signal_off) + E;
  const uint8_t* recv = c.buffer + c.half_offset + lay.recv_off;  // [E][maxT][H] bf16

  const int chunks = (H + 255) / 256;  // a warp reduces 256 channels of one token at a time
  const int tasks = a.num_tokens * chunks;
  const int stride = gridDim.x * warps;
  // Lane k < K holds slot k (expert, weight) of the warp's task. Inputs of this call, not peer
  // data: the first task's are loaded before the wait, each next task's while reducing this one.
  int64_t next_e = -1;
  float next_w = 0.0f;
  auto load_slots = [&](int task) {
    next_e = -1;
    next_w = 0.0f;
    if (task < tasks && lane < K) {
      const size_t t = static_cast<size_t>(task / chunks);
      next_e = a.topk_idx[t * K + lane];
      next_w = a.topk_weights[t * K + lane];
    }
  };
  load_slots(blockIdx.x * warps + warp);

  const bool stats = blockIdx.x == 0 && a.wait_stats != nullptr;
  if (tid < R) s_wait[tid] = 0;
  __syncthreads();
  const uint64_t start = now_ns();
  for (int e = tid; e < E; e += blockDim.x) {
    wait_signal(c, flags + e, kWaitCombineData, e / L, 1);
    if (stats) atomicMax(&s_wait[e / L], static_cast<unsigned long long>(now_ns() - start));
    if (blockIdx.x == 0) {
      trace_pair(c, kTracePairWait, e, start);
      trace_pair_now(c, kTracePairSeen, e);
    }
  }
  __syncthreads();
  trace_event(c, kTraceCWaitDone);
  if (stats && tid < R)
    atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + tid), s_wait[tid]);
  if (tid == 0) {
    int* done = c.workspace + kWsCombineRecvDone;
    if (atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1) {
      for (int e = 0; e < E; ++e) flags[e] = 0;
      *done = 0;
    }
  }

  for (int task = blockIdx.x * warps + warp; task < tasks; task += stride) {
    const int t = task / chunks, col = (task - t * chunks) * 256 + lane * 8;
    const int64_t my_e = next_e;
    const float my_w = next_w;
    load_slots(task + stride);
    if (a.rank_partials) {
      reduce_chunk_rank_partials(c, a, recv, t, col, my_e, my_w);
    } else {
      reduce_chunk(c, a, recv, t, col, my_e, my_w);
    }
  }
}

}  // namespace moe_ep::low_latency
