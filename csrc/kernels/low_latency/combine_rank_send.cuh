// Combine, send phase of the per-rank combine (Common::per_rank_combine): this rank sums, for each token
// of each source, the weighted rows of the token's picks among its own experts, and sends that one
// partial row back, instead of one row per (token, expert). At top-8 of 256 experts on 4 ranks a token
// picks ~3.6 ranks, so ~2.2x fewer bytes cross NVLink (~4x on 2 ranks). The reduction order this
// implies is CombineArgs::rank_partials (docs/semantics.md, "Low-latency combine").
//
// 1. Routing. The weights live with the tokens' owner, so every rank first pushes its routing
//    (topk_idx as int32, topk_weights) to every peer: [me][t][k] of the routing area of their receive
//    region (low_latency.h, rank_routing_offset); block j (grid-strided) writes peer me + 1 + j's copy,
//    then one thread fences and raises the routing word [me] of that peer (value T + 1).
// 2. Own tokens. With two peers or more, while the routing flies, the blocks take this rank's own
//    tokens (their routing is topk_idx / topk_weights here) as units (me, t).
// 3. Peers' tokens. Every block waits for the R - 1 routing words (acquire; the counts give the units),
//    the last block past the wait (workspace kWsCombineRoutingDone) puts them back to 0, and the units
//    (s, t < T_s) of the sources left follow (me + 1, me + 2, ...: ranks start on different peers; with
//    one peer, this rank's own tokens first).
// Units go round-robin over the grid, kRankBatch at a time per block. Warp b gathers unit b of the
// batch: lane k reads slot k of the token's routing; the picks on this rank (k ascending) name local
// experts l, whose rows are row_of[l][s*maxT + t] (written by the dispatch); units without a pick here
// are dropped and the rest compacted. Then the block computes each unit's row 16 bytes at a time: one
// pick -> the row as it is (the receiver multiplies it by its weight, as the per-expert combine does);
// two or more -> bf16(sum over its picks, k ascending, of w_k * row_k), products and sums rounded to
// float32 (__fmul_rn / __fadd_rn, never fused), and stores it into slot [me][t] of rank s's partial rows.
// Flags: after a CTA barrier, thread b of the block fences (__threadfence_system: the block's stores,
// released at system scope) and raises flag [me][t] on rank s (st.release.sys, value t + 1). The
// receiver waits for the flags of the ranks its token picked; it knows them from its own topk_idx, so
// a rank that holds no pick of a token sends nothing for it.
// NVLink only (every rank stores into its peers' memory): the runtime picks the per-expert kernels otherwise.
#pragma once

#include <cuda_bf16.h>

#include "kernels/low_latency/common.cuh"

namespace moe_ep::low_latency {

constexpr int kRankBatch = 4;  // units a block computes together (one warp gathers each one's picks)
static_assert(kRankBatch <= kThreads / 32, "a warp per unit of a batch");

// One unit of a batch: where its row goes and what it sums.
struct RankUnit {
  unsigned long long dst;  // address of slot [me][t] of the source's partial rows (its NVLink mapping)
  int* flag;               // flag [me][t] on the source (its NVLink mapping)
  int token, n;            // source token, picks on this rank
  int row[kMaxTopk];       // flat row l * R*maxT + row_of[...] of each pick, k ascending
  float weight[kMaxTopk];  // its weight
};

// Rows of a unit whose loads a thread issues at once, per vector (the unit's first kRankGroup picks; the
// rare unit with more loads the rest group by group while finishing).
constexpr int kRankGroup = 4;

// Issue the loads of picks [q0, q0 + kRankGroup) of unit u at vector v (those < u.n).
__device__ __forceinline__ void rank_load_group(const uint8_t* rows, const RankUnit& u, int v, int q0,
                                                size_t row_bytes, int4 (&raw)[kRankGroup]) {
#pragma unroll
  for (int i = 0; i < kRankGroup; ++i)
    if (q0 + i < u.n) raw[i] = ld_nc(rows + static_cast<size_t>(u.row[q0 + i]) * row_bytes + 16 * v);
}

// The 16 bytes at vector v of unit u's partial row, from its first group's loads (`raw`, issued by the caller):
// the row itself (one pick), or the rounded, weighted sum of its picks' rows, added in pick order.
__device__ __forceinline__ int4 rank_finish_vector(const uint8_t* rows, const RankUnit& u, int v, size_t row_bytes,
                                                   int4 (&raw)[kRankGroup]) {
  if (u.n == 1) return raw[0];
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
  for (int q0 = 0; q0 < u.n; q0 += kRankGroup) {
    if (q0 > 0) rank_load_group(rows, u, v, q0, row_bytes, raw);
#pragma unroll
    for (int i = 0; i < kRankGroup; ++i) {
      if (q0 + i >= u.n) break;
      const float w = u.weight[q0 + i];
      const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&raw[i]);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, __bfloat162float(x[j])));
    }
  }
  return pack_bf16x8(acc);
}

__device__ __forceinline__ void combine_rank_send_phase(const Common& c, const CombineArgs& a,
                                                        const HalfLayout& lay) {
  __shared__ int s_peer_tokens[kMaxRanks];    // peer i (rank me + 1 + i): its token count
  __shared__ int s_first_unit[kMaxRanks + 1];  // exclusive prefix of the token counts of step 3's sources
  __shared__ RankUnit s_unit[kRankBatch];
  __shared__ int s_units;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int R = c.num_ranks, E = c.num_experts, L = E / R, K = a.num_topk, T = a.num_tokens;
  const int H = c.hidden, maxT = c.max_tokens, me = c.rank;
  const int RT = R * maxT;
  const size_t row_bytes = static_cast<size_t>(H) * 2;
  int* signals = half_signals(c, lay);
  int* routed = signals + signal_token_counts(E);  // [R]: routing of source s pushed (value T_s + 1)
  int* flags = signals + signal_pair_flags(E, R);  // [R][maxT]: partial row of (expert rank, token)
  uint8_t* recv = c.buffer + c.half_offset + lay.recv_off;  // partial rows [R][maxT][H] bf16
  int2* routing = reinterpret_cast<int2*>(recv + rank_routing_offset(maxT, H, R));  // [R][maxT][K]
  const uint8_t* rows = a.x != nullptr ? static_cast<const uint8_t*>(a.x)
                                       : c.buffer + c.half_offset + lay.send_off;  // [L][R*maxT][H]

  const int G = gridDim.x, V = H / 8;
  // 1. Routing: this rank's [T][K] into slot [me] of every peer's routing area (peer me + 1 + j for block j).
  for (int j = blockIdx.x; j < R - 1; j += gridDim.x) {
    const int d = (me + 1 + j) % R;
    int2* dst = reinterpret_cast<int2*>(peer_address(c, d, routing + static_cast<size_t>(me) * maxT * K));
    for (int i = tid; i < T * K; i += blockDim.x) {
      const int64_t e = a.topk_idx[i];
      const int2 entry = make_int2(e >= 0 ? static_cast<int>(e) : -1, __float_as_int(a.topk_weights[i]));
      asm volatile("st.global.v2.s32 [%0], {%1,%2};" ::"l"(dst + i), "r"(entry.x), "r"(entry.y) : "memory");
    }
    __syncthreads();  // the block's routing stores precede the fence below
    if (tid == 0) {
      __threadfence_system();  // release them at system scope
      st_release_sys(reinterpret_cast<int*>(peer_address(c, d, routed + me)), T + 1);
    }
  }
  if (tid == 0) s_units = 0;
  __syncthreads();  // s_units is 0 before any warp gathers

  // Warp `warp` gathers unit (s, t) of the batch: lane k holds slot k's {expert, weight bits}; the picks on
  // this rank (k ascending) are compacted into s_unit (units without one are dropped).
  auto gather_unit = [&](int s, int t, int2 entry) {
    const bool mine = entry.x >= 0 && entry.x / L == me;
    const unsigned picks = __ballot_sync(0xffffffffu, mine);
    int row = 0;
    if (mine) {
      const int l = entry.x - me * L;
      row = l * RT + __ldg(a.row_of + static_cast<size_t>(l) * RT + s * maxT + t);
    }
    int slot = 0;
    if (lane == 0 && picks != 0) slot = atomicAdd(&s_units, 1);
    slot = __shfl_sync(0xffffffffu, slot, 0);
    if (picks == 0) return;
    RankUnit& unit = s_unit[slot];
    if (mine) {
      const int q = __popc(picks & ((1u << lane) - 1));
      unit.row[q] = row;
      unit.weight[q] = __int_as_float(entry.y);
    }
    if (lane == 0) {
      uint8_t* slot_local = recv + (static_cast<size_t>(me) * maxT + t) * row_bytes;
      unit.dst = reinterpret_cast<unsigned long long>(peer_address(c, s, slot_local));
      unit.flag = reinterpret_cast<int*>(peer_address(c, s, flags + static_cast<size_t>(me) * maxT + t));
      unit.token = t;
      unit.n = __popc(picks);
    }
  };
  // The gathered units: their rows (two vectors per thread at a time: vector idx and idx + blockDim.x, both
  // first groups' loads in flight before either is used), then the fences and flags.
  auto send_batch = [&]() {
    __syncthreads();  // the gathering warps' writes to s_unit
    const int nu = s_units, items = nu * V;
    for (int idx = tid; idx < items; idx += 2 * blockDim.x) {
      const int idx2 = idx + blockDim.x;
      const int b = idx / V, v = idx - b * V;
      const int b2 = idx2 < items ? idx2 / V : b, v2 = idx2 < items ? idx2 - b2 * V : v;
      int4 raw[kRankGroup], raw2[kRankGroup];
      rank_load_group(rows, s_unit[b], v, 0, row_bytes, raw);
      if (idx2 < items) rank_load_group(rows, s_unit[b2], v2, 0, row_bytes, raw2);
      st_v4(reinterpret_cast<uint8_t*>(s_unit[b].dst) + 16 * v, rank_finish_vector(rows, s_unit[b], v, row_bytes, raw));
      if (idx2 < items)
        st_v4(reinterpret_cast<uint8_t*>(s_unit[b2].dst) + 16 * v2,
              rank_finish_vector(rows, s_unit[b2], v2, row_bytes, raw2));
    }
    __syncthreads();  // every store of the batch precedes the fences below
    trace_event(c, kTraceCSendsIssued);  // the last batch's stamp stays
    if (tid < nu) {
      __threadfence_system();  // release: the block's stores of the batch, at system scope
      st_release_sys(s_unit[tid].flag, s_unit[tid].token + 1);
    }
    if (tid == 0) s_units = 0;
    __syncthreads();  // the batch's shared state is rewritten by the next one
  };

  // Slot k of own token t's routing (topk_idx / topk_weights are here: no wait).
  auto own_entry = [&](int t) {
    int2 entry = make_int2(-1, 0);
    if (lane < K) {
      const int64_t e = a.topk_idx[static_cast<size_t>(t) * K + lane];
      entry = make_int2(e >= 0 ? static_cast<int>(e) : -1, __float_as_int(a.topk_weights[static_cast<size_t>(t) * K + lane]));
    }
    return entry;
  };

  // 2. With two peers or more, this rank's own tokens first, while the routing is in flight (4 x H200, E=256,
  //    graph: combine 32.7-33.3 us, against 35.9 for one pass over all sources with one vector per thread in
  //    flight; with one peer the routing wait is short and a separate batch of own tokens cost more: 2 x H200
  //    23.0 us own-first, 22.3-22.5 with the own tokens in the pass over all sources).
  const bool own_first = R > 2;
  if (own_first) {
    for (int u0 = blockIdx.x; u0 < T; u0 += G * kRankBatch) {
      if (warp < kRankBatch && u0 + warp * G < T) gather_unit(me, u0 + warp * G, own_entry(u0 + warp * G));
      send_batch();
    }
  }

  // 3. The peers' routing, then the tokens of the sources left: source j is rank me + first + j.
  for (int i = tid; i < R - 1; i += blockDim.x)
    s_peer_tokens[i] = wait_flag(c, routed + (me + 1 + i) % R, kWaitCombineRouting, (me + 1 + i) % R, 0, 1) - 1;
  __syncthreads();  // the waiting threads' acquires cover the block's reads of the routing
  trace_event(c, kTraceCRouted);
  const int first = own_first ? 1 : 0, sources = R - first;
  if (tid == 0) {
    s_first_unit[0] = 0;
    for (int j = 0; j < sources; ++j) {
      const int i = j + first - 1;  // peer index of source j (-1: this rank)
      s_first_unit[j + 1] = s_first_unit[j] + (i < 0 ? T : s_peer_tokens[i]);
    }
    int* done = c.workspace + kWsCombineRoutingDone;
    if (atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1) {  // every block has read the words
      for (int r = 0; r < R; ++r) routed[r] = 0;
      *done = 0;
    }
  }
  __syncthreads();
  const int total = s_first_unit[sources];
  for (int u0 = blockIdx.x; u0 < total; u0 += G * kRankBatch) {
    if (warp < kRankBatch && u0 + warp * G < total) {
      const int u = u0 + warp * G;
      int j = 0;
      while (u >= s_first_unit[j + 1]) ++j;
      const int src = (me + first + j) % R, t = u - s_first_unit[j];
      if (src == me) {
        gather_unit(me, t, own_entry(t));
      } else {
        int2 entry = make_int2(-1, 0);
        if (lane < K) entry = ld_cg_v2(routing + (static_cast<size_t>(src) * maxT + t) * K + lane);
        gather_unit(src, t, entry);
      }
    }
    send_batch();
  }
}

}  // namespace moe_ep::low_latency
