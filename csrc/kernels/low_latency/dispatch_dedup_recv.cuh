// Dispatch, receive phase of the dedup dispatch (Common::dedup_dispatch; the sender's side and the slot
// format are in dispatch_dedup_send.cuh): expand each source's per-rank messages into the per-expert
// layout, the same bytes as the per-expert kernels write.
//
// 1. Placement. Every block waits for all the counts [l][s] and token counts [s] (published by the
//    sources early, so usually long there) and computes begin[l][s] = rows of sources before s for
//    expert l (sources ascending, then tokens: the reference's order). The block owning l (l % grid)
//    writes layout_range[l][*], recv_count[l] and the stats.
// 2. Messages. Units are the tokens (s, t < T_s) of all sources (source-major), handed out round-robin
//    over the grid, kDedupBatch at a time per block: warp 0 waits for each unit's flag (acquire), which
//    says either that (s, t) sends nothing here (kNoMessage) or that its message is in slot [s][t]
//    (token t + 1); the messages are compacted, a CTA barrier hands the acquires to the block, then the
//    picks are read, src_info (and row_of, the per-rank combine's map) written, and each 16-byte vector of a body is loaded once and stored into
//    every row its picks name (kCopyUnroll loads in flight per thread); FP8 scales (one word per
//    thread, loaded with the picks) go to the token-minor layout (UE8M0: packed 4 per int32).
// Agreement: the counts and token counts are read with wait_count (their signature tag compared with this
// call's, common.cuh "Dispatch agreement"): a source that does not agree counts 0 everywhere, so no flag of
// its is polled and none of its messages is read.
// Resets: a flag is read by one block only, which zeroes it right after reading it; the counts and
// token counts are read by every block, and the last block to finish (workspace kWsDispatchRecvDone)
// zeroes them, and the sources' signature words of this half. No source writes them again before this kernel ends: its next use of this half comes
// two calls later, after it has received this PE's signals of the call in between.
#pragma once

#include "kernels/low_latency/common.cuh"
#include "kernels/low_latency/fp8_cast.cuh"

namespace moe_ep::low_latency {

constexpr int kDedupBatch = 4;  // messages a block unpacks together (their loads in flight at once)
static_assert(kDedupBatch * (kMaxHidden / 128) <= kThreads, "one FP8 scale word of a batch per thread");

__device__ __forceinline__ void dispatch_dedup_recv_phase(const Common& c, const DispatchArgs& a,
                                                          const HalfLayout& lay) {
  __shared__ int s_begin[kMaxExperts];        // [l*R + s]: the count of (l, s), then its first row
  __shared__ int s_first_unit[kMaxRanks + 1];  // exclusive prefix of the sources' token counts
  __shared__ unsigned long long s_slot[kDedupBatch];  // byte offset of the message's slot in the half
  __shared__ int s_src[kDedupBatch], s_token[kDedupBatch], s_messages;
  __shared__ int s_pick[kDedupBatch][1 + kMaxTopk];  // {n, picks} as sent
  __shared__ int s_row[kDedupBatch][kMaxTopk];       // flat row (l * R*maxT + row) of each pick
  __shared__ unsigned long long s_wait[kMaxRanks];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int R = c.num_ranks, E = c.num_experts, L = E / R, H = c.hidden, maxT = c.max_tokens;
  const int RT = R * maxT;
  int* signals = half_signals(c, lay);
  int* counts = signals + signal_dispatch_counts();      // [L][R]
  int* token_counts = signals + signal_token_counts(E);  // [R]
  int* flags = signals + signal_pair_flags(E, R);        // [R][maxT]
  const uint8_t* half = c.buffer + c.half_offset;
  const size_t used = message_used_bytes(H, a.fp8);
  const int pick_words = 1 + (L < kMaxTopk ? L : kMaxTopk);  // {n, at most min(K, L) picks}

  // 1. Placement.
  if (tid < kMaxRanks) s_wait[tid] = 0;
  for (int p = tid; p < E; p += blockDim.x) {
    const uint64_t start = now_ns();
    s_begin[p] = wait_count(c, a, counts + p, kWaitDispatchCounts, p % R);
    if (blockIdx.x == 0) {
      trace_pair(c, kTracePairWait, p, start);
      trace_pair_now(c, kTracePairSeen, p);
    }
  }
  for (int s = tid; s < R; s += blockDim.x)
    s_first_unit[s + 1] = wait_count(c, a, token_counts + s, kWaitDispatchCounts, s);
  __syncthreads();
  for (int l = tid; l < L; l += blockDim.x) {
    const bool owner = l % gridDim.x == blockIdx.x;
    int run = 0;
    for (int s = 0; s < R; ++s) {
      const int n = s_begin[l * R + s];
      s_begin[l * R + s] = run;
      if (owner) a.layout_range[l * R + s] = (static_cast<int64_t>(run) << 32) | static_cast<int64_t>(n);
      run += n;
    }
    if (owner) {
      a.recv_count[l] = run;
      if (a.cumulative_recv_stats != nullptr) atomicAdd(a.cumulative_recv_stats + l, run);
    }
  }
  if (tid == 0) {
    s_first_unit[0] = 0;
    for (int s = 0; s < R; ++s) s_first_unit[s + 1] += s_first_unit[s];
  }
  __syncthreads();

  // 2. Messages.
  const int total = s_first_unit[R];
  const int G = gridDim.x;
  const int data_vecs = a.fp8 ? H / 16 : H / 8;  // 16-byte vectors of one row of recv_x
  const size_t row_bytes = a.fp8 ? static_cast<size_t>(H) : static_cast<size_t>(H) * 2;
  uint8_t* out = static_cast<uint8_t*>(a.recv_x);
  for (int u0 = blockIdx.x; u0 < total; u0 += G * kDedupBatch) {
    const int remaining = (total - u0 + G - 1) / G;
    const int units = remaining < kDedupBatch ? remaining : kDedupBatch;
    if (warp == 0) {
      int s = 0, token = -1;
      if (lane < units) {
        const int u = u0 + lane * G;
        while (u >= s_first_unit[s + 1]) ++s;
        int* flag = flags + static_cast<size_t>(s) * maxT + (u - s_first_unit[s]);
        const uint64_t start = now_ns();
        token = wait_flag(c, flag, kWaitDispatchData, s, 0, 0) - 1;  // < 0: kNoMessage (or timed out)
        if (a.wait_stats != nullptr) atomicAdd(&s_wait[s], static_cast<unsigned long long>(now_ns() - start));
        *flag = 0;  // read by this block only; its next writer comes two calls later
      }
      const unsigned real = __ballot_sync(0xffffffffu, token >= 0);
      if (token >= 0) {
        const int b = __popc(real & ((1u << lane) - 1));  // compacted: the batch's messages first
        s_src[b] = s;
        s_token[b] = token;
        s_slot[b] = lay.recv_off + (static_cast<size_t>(s) * maxT + token) * lay.dedup_slot_bytes;
      }
      if (lane == 0) s_messages = __popc(real);
    }
    __syncthreads();  // warp 0's acquires cover the block's reads of the messages below
    if (u0 == static_cast<int>(blockIdx.x)) trace_event(c, kTraceDFirstArrival);
    trace_event(c, kTraceDLastArrival);  // the last batch's stamp stays
    const int nb = s_messages;

    // The picks, and the first round of body loads in flight with them (body offsets do not depend on
    // the picks); each body vector is loaded once and stored to every row its message's picks name.
    const int vecs = nb * data_vecs;
    int4 v[kCopyUnroll];
    auto load_round = [&](int base) {
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int idx = base + u * blockDim.x + tid;
        if (idx < vecs) {
          const int b = idx / data_vecs, j = idx - b * data_vecs;
          v[u] = ld_cg(half + s_slot[b] + 16 + 16 * j);
        }
      }
    };
    auto store_round = [&](int base) {
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int idx = base + u * blockDim.x + tid;
        if (idx < vecs) {
          const int b = idx / data_vecs, j = idx - b * data_vecs;
          const int n = s_pick[b][0];
          for (int q = 0; q < n; ++q) st_v4(out + static_cast<size_t>(s_row[b][q]) * row_bytes + 16 * j, v[u]);
        }
      }
    };
    for (int idx = tid; idx < nb * pick_words; idx += blockDim.x) {
      const int b = idx / pick_words, w = idx - b * pick_words;
      s_pick[b][w] = ld_cg_s32(half + s_slot[b] + used + 4 * w);
    }
    load_round(0);
    // FP8: one scale word of the batch per thread, loaded with the picks (token-minor stores below).
    const int per_msg = a.ue8m0 ? H / 512 : H / 128;  // int32 words (UE8M0: 4 exponents) or floats per row
    const int scale_b = a.fp8 && tid < nb * per_msg ? tid / per_msg : -1;
    const int scale_g = scale_b >= 0 ? tid - scale_b * per_msg : 0;
    int scale_value = 0;
    if (scale_b >= 0) {
      const float* sc = reinterpret_cast<const float*>(half + s_slot[scale_b] + 16 + H);
      if (a.ue8m0) {
        uint32_t word = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) word |= ue8m0_byte(ld_cg_f32(sc + 4 * scale_g + k)) << (8 * k);
        scale_value = static_cast<int>(word);
      } else {
        scale_value = __float_as_int(ld_cg_f32(sc + scale_g));
      }
    }
    __syncthreads();
    for (int idx = tid; idx < nb * kMaxTopk; idx += blockDim.x) {
      const int b = idx / kMaxTopk, q = idx - b * kMaxTopk;
      const int n = s_pick[b][0];
      if (q < n) {
        const int p = s_pick[b][1 + q];
        const int l = p / maxT, slot = p - l * maxT;
        const int row = s_begin[l * R + s_src[b]] + slot, flat = l * RT + row;
        s_row[b][q] = flat;
        a.src_info[flat] = s_token[b];
        if (a.row_of != nullptr) a.row_of[l * RT + s_src[b] * maxT + s_token[b]] = row;
      }
    }
    __syncthreads();
    store_round(0);
    for (int base = kCopyUnroll * blockDim.x; base < vecs; base += kCopyUnroll * blockDim.x) {
      load_round(base);
      store_round(base);
    }
    if (scale_b >= 0) {
      // Scales, token-minor: element (l, row, g) lives at [l][g][row].
      int* scales_out = static_cast<int*>(a.recv_scales);
      const int n = s_pick[scale_b][0];
      for (int q = 0; q < n; ++q) {
        const int flat = s_row[scale_b][q], l = flat / RT, row = flat - l * RT;
        scales_out[(static_cast<size_t>(l) * per_msg + scale_g) * RT + row] = scale_value;
      }
    }
    __syncthreads();  // the batch's shared state is rewritten by the next one
    trace_event(c, kTraceDCopyDone);  // the last batch's stamp stays
  }

  if (a.wait_stats != nullptr && tid < R && s_wait[tid] != 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + tid), s_wait[tid]);
  // Every block has finished polling when the counter reaches gridDim.x: the last one resets.
  if (tid == 0) {
    check_signatures(c, a);  // common.cuh: each source's full word, once per call, before the reset below
    int* done = c.workspace + kWsDispatchRecvDone;
    if (atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1) {
      for (int i = 0; i < E; ++i) counts[i] = 0;
      for (int s = 0; s < R; ++s) {
        token_counts[s] = 0;
        *signature_word(c, a, s) = 0;
      }
      *done = 0;
    }
  }
}

}  // namespace moe_ep::low_latency
