// Token-major combine (kVariantCombineTokens), for a handle whose dispatch was dedup: its receive left
// the route (low_latency.h, kRouteWords): for each message (source s, index i) it unpacked, the token
// and the rows of this rank's experts it went to. The bytes sent are the pair combine's (one bf16 row
// per (token, expert), into [me*L + l][token] of the source's receive region); what changes is the
// order and the readiness granularity, so that the reduction overlaps the transfer:
//
// Send: units are the route's messages, taken i-major (unit u = i * R + s; a block takes u = block,
// block + grid, ...), so that every rank sends the rows of its sources' earlier tokens first. After a
// unit's rows: a barrier of the sending warps, then one thread: __threadfence_system (release: the
// unit's stores, at system scope) and st.release.sys of flag [me][token] on rank s (value 1), and a
// second barrier (the next unit's stores start after the fence, so that it waits for this unit's only).
// Receive: tasks (token, 256 channels) are taken in token order from the workspace counter
// kWsCombineClaim (GPU-scope atomicAdd, one per task, the next one issued while reducing the current);
// lanes k < K wait for flag [rank of expert k][token] (relaxed spin with __nanosleep, then acquire;
// __syncwarp hands the acquires to the warp), and the warp reduces exactly as the pair combine
// (reduce_chunk: same products, same order, same bits).
// Launches: fused, warps [0, kSendWarps) send while the others reduce what has landed, and the senders
// join the reduction after their last unit; send only (hook): every warp sends; receive only: every
// warp reduces. Senders never wait on anything, so every flag comes and every wait ends.
// Presence: a receive here waits only for the ranks its tokens chose, but the reuse of a half two calls
// later is safe only if every receive hears from every rank (docs/low_latency.md, "Signals"). So each
// send phase first raises presence word [me] on every rank (st.release.sys, value 1), and the last
// block of the receive waits for all R of them before it ends.
// Resets: the last block to finish (workspace kWsCombineRecvDone) zeroes the presence words, the claim
// counter and the flags [0..R)[0..T) (every flag that can come was seen by then: each task waits for
// its token's).
// Needs the combine's topk_idx to be the dispatch's (as the API requires): a flag the receiver does not
// wait for would stay set. NVLink only (the backend clears the variant otherwise).
#pragma once

#include "kernels/low_latency/combine_recv.cuh"

namespace moe_dispatcher::low_latency {

constexpr int kSendWarps = 8;           // sending warps of a fused launch (of kThreads / 32)
constexpr int kUnitBatch = 4;           // route records a block reads at once
constexpr unsigned kPollSleepNs = 64;   // between polls of a reducing warp

__device__ __forceinline__ void sender_barrier(int threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}

// The sending warps (threads [0, send_threads) of the block).
__device__ __forceinline__ void combine_tokens_send(const Common& c, const CombineArgs& a,
                                                    const HalfLayout& lay, int send_threads) {
  __shared__ int s_count[kMaxRanks];                        // route messages per source rank
  __shared__ int s_unit[kUnitBatch][kRouteWords];           // the batch's route records
  __shared__ unsigned long long s_src[kUnitBatch][kMaxTopk];  // byte offset of each row in x / send region
  __shared__ unsigned long long s_dst[kUnitBatch][kMaxTopk];  // its slot on the peer (NVLink address)
  const int tid = threadIdx.x;
  const int R = c.num_ranks, E = c.num_experts, L = E / R, H = c.hidden, maxT = c.max_tokens, me = c.rank;
  const int RT = R * maxT;
  const size_t row_bytes = static_cast<size_t>(H) * 2;
  const int V = H / 8;  // 16-byte vectors of a row
  const uint8_t* rows = a.x != nullptr ? static_cast<const uint8_t*>(a.x)
                                       : c.buffer + c.half_offset + lay.send_off;  // zero-copy rows
  uint8_t* recv = c.buffer + c.half_offset + lay.recv_off;  // [E][maxT][H] bf16 on every PE
  int* flags = half_signals(c, lay) + signal_pair_flags(E, R);  // [R][maxT]

  if (blockIdx.x == 0 && tid < R) {  // presence (see the top of the file)
    int* presence = half_signals(c, lay) + signal_message_counts(E);
    st_release_sys(reinterpret_cast<int*>(peer_address(c, tid, presence + me)), 1);
  }
  if (tid < R) s_count[tid] = a.route_count[tid];
  sender_barrier(send_threads);
  int most = 0;
  for (int s = 0; s < R; ++s) most = s_count[s] > most ? s_count[s] : most;
  const int units = most * R;
  const int G = gridDim.x;
  for (int u0 = blockIdx.x; u0 < units; u0 += G * kUnitBatch) {
    for (int idx = tid; idx < kUnitBatch * kRouteWords; idx += send_threads) {
      const int b = idx / kRouteWords, w = idx - b * kRouteWords;
      const int u = u0 + b * G, i = u / R, s = u - i * R;
      if (u < units && i < s_count[s]) s_unit[b][w] = a.route[(static_cast<size_t>(s) * maxT + i) * kRouteWords + w];
    }
    sender_barrier(send_threads);
    for (int idx = tid; idx < kUnitBatch * kMaxTopk; idx += send_threads) {
      const int b = idx / kMaxTopk, q = idx - b * kMaxTopk;
      const int u = u0 + b * G, i = u / R, s = u - i * R;
      if (u < units && i < s_count[s] && q < s_unit[b][1]) {
        const int flat = s_unit[b][2 + q], l = flat / RT;
        const int token = s_unit[b][0];
        s_src[b][q] = static_cast<unsigned long long>(flat) * row_bytes;
        uint8_t* local = recv + (static_cast<size_t>(me * L + l) * maxT + token) * row_bytes;
        s_dst[b][q] = reinterpret_cast<unsigned long long>(peer_address(c, s, local));
      }
    }
    sender_barrier(send_threads);
    for (int b = 0; b < kUnitBatch; ++b) {
      const int u = u0 + b * G;
      if (u >= units) break;
      const int i = u / R, s = u - i * R;
      if (i >= s_count[s]) continue;
      const int n = s_unit[b][1];
      const int total = n * V;
      for (int base = 0; base < total; base += kCopyUnroll * send_threads) {
        int4 v[kCopyUnroll];
#pragma unroll
        for (int k = 0; k < kCopyUnroll; ++k) {
          const int idx = base + k * send_threads + tid;
          if (idx < total) {
            const int q = idx / V, j = idx - q * V;
            v[k] = ld_nc(rows + s_src[b][q] + 16 * j);
          }
        }
#pragma unroll
        for (int k = 0; k < kCopyUnroll; ++k) {
          const int idx = base + k * send_threads + tid;
          if (idx < total) {
            const int q = idx / V, j = idx - q * V;
            st_v4(reinterpret_cast<uint8_t*>(s_dst[b][q]) + 16 * j, v[k]);
          }
        }
      }
      sender_barrier(send_threads);  // the unit's stores precede the fence
      if (tid == 0) {
        trace_event(c, kTraceCSendsIssued);  // the last unit's stamp stays
        __threadfence_system();  // release: the unit's stores, at system scope
        int* flag = flags + static_cast<size_t>(me) * maxT + s_unit[b][0];
        st_release_sys(reinterpret_cast<int*>(peer_address(c, s, flag)), 1);
      }
      sender_barrier(send_threads);  // the next unit's stores (and the next batch's records) after it
    }
  }
  if (tid == 0) trace_event(c, kTraceCFlagsUp);
}

// One reducing warp: takes tasks until none is left (see the top of the file). s_wait: per-source wait
// times of this block (shared), or null.
__device__ __forceinline__ void combine_tokens_reduce(const Common& c, const CombineArgs& a,
                                                      const HalfLayout& lay, unsigned long long* s_wait) {
  const int lane = threadIdx.x % 32;
  const int R = c.num_ranks, E = c.num_experts, L = E / R, H = c.hidden, K = a.num_topk, maxT = c.max_tokens;
  const int chunks = (H + 255) / 256;
  const int tasks = a.num_tokens * chunks;
  int* claim = c.workspace + kWsCombineClaim;
  const int* flags = half_signals(c, lay) + signal_pair_flags(E, R);  // [R][maxT]
  const uint8_t* recv = c.buffer + c.half_offset + lay.recv_off;
  int taken = lane == 0 ? atomicAdd(claim, 1) : 0;
  int task = __shfl_sync(0xffffffffu, taken, 0);
  while (task < tasks) {
    taken = lane == 0 ? atomicAdd(claim, 1) : 0;  // the next task; its latency overlaps this one
    const int t = task / chunks, col = (task - t * chunks) * 256 + lane * 8;
    int64_t e = -1;
    float w = 0.0f;
    if (lane < K) {
      e = a.topk_idx[static_cast<size_t>(t) * K + lane];
      w = a.topk_weights[static_cast<size_t>(t) * K + lane];
    }
    if (e >= 0) {
      const int d = static_cast<int>(e / L);
      const uint64_t start = now_ns();
      wait_flag(c, flags + static_cast<size_t>(d) * maxT + t, "low_latency_combine (receive)", d, kPollSleepNs);
      if (s_wait != nullptr) atomicAdd(&s_wait[d], static_cast<unsigned long long>(now_ns() - start));
    }
    __syncwarp();  // every lane's acquire precedes every lane's reads of the rows
    reduce_chunk(c, a, recv, t, col, e, w);
    task = __shfl_sync(0xffffffffu, taken, 0);
  }
}

// The whole token-major combine of one launch (phases: kPhaseSend and/or kPhaseRecv).
__device__ __forceinline__ void combine_tokens(const Common& c, const CombineArgs& a, const HalfLayout& lay,
                                               int phases) {
  __shared__ unsigned long long s_wait[kMaxRanks];
  __shared__ int s_last;
  const int tid = threadIdx.x, warp = tid / 32;
  const bool send = (phases & kPhaseSend) != 0, recv = (phases & kPhaseRecv) != 0;
  const int send_warps = recv ? kSendWarps : static_cast<int>(blockDim.x) / 32;
  const bool stats = recv && a.wait_stats != nullptr;
  if (tid < kMaxRanks) s_wait[tid] = 0;
  __syncthreads();
  if (send && warp < send_warps) combine_tokens_send(c, a, lay, send_warps * 32);
  if (recv) {
    if (tid == 0) trace_event(c, kTraceCRecvEntry);
    combine_tokens_reduce(c, a, lay, stats ? s_wait : nullptr);
  }
  __syncthreads();
  if (!recv) return;
  trace_event(c, kTraceCReduceDone);
  if (stats && tid < c.num_ranks && s_wait[tid] != 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + tid), s_wait[tid]);
  if (tid == 0) s_last = atomicAdd(c.workspace + kWsCombineRecvDone, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (s_last) {  // every block is done: nothing reads the flags or takes a task any more
    if (tid < c.num_ranks) {
      int* presence = half_signals(c, lay) + signal_message_counts(c.num_experts);
      wait_signal(c, presence + tid, "low_latency_combine (receive)", tid);
      presence[tid] = 0;
    }
    int* flags = half_signals(c, lay) + signal_pair_flags(c.num_experts, c.num_ranks);
    const int T = a.num_tokens;
    for (int idx = tid; idx < c.num_ranks * T; idx += blockDim.x) {
      const int d = idx / T;
      flags[static_cast<size_t>(d) * c.max_tokens + (idx - d * T)] = 0;
    }
    if (tid == 0) {
      c.workspace[kWsCombineClaim] = 0;
      c.workspace[kWsCombineRecvDone] = 0;
    }
  }
}

}  // namespace moe_dispatcher::low_latency
