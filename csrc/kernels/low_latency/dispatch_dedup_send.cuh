// Dispatch, send phase of the dedup variant (kVariantDispatchDedup): each token becomes ONE message
// per destination RANK, carrying the list of that rank's local experts it chose, instead of one
// message per chosen expert (top-8 of 256 experts on 4 ranks hits ~3.6 ranks: ~2.2x fewer bytes
// over NVLink). The receiver expands the messages into the per-expert layout
// (dispatch_dedup_recv.cuh); the outputs are the per-expert variant's, byte for byte.
//
// Message i from this rank (`me`) to rank d sits in d's staging slot [me][i] of the receive region
// (HalfLayout: [R][maxT] slots of dedup_slot_bytes), i = the number of this rank's earlier tokens
// with a pick on d. A slot holds the body at offset 16 as in the per-expert messages (BF16 row, or
// FP8 row + float32 scales; the 16-byte header is not sent), then at message_used_bytes the picks
// {n, p_0, ..., p_{n-1}} with p = l * maxT + slot: local expert l of d, and slot = the number of this
// rank's earlier tokens that chose that expert, so that row begin[l][me] + slot of expert l is where
// the per-expert variant (and the reference) puts it.
//
// Signals (words of the receiver's half, low_latency.h):
//   counts [l][me] (value count + 1): this rank's tokens for each expert, and message counts [me]
//     (value count + 1): its messages to that rank. Published right after the counting pass with
//     relaxed stores: they order no data (the receiver needs them to place rows and to know which
//     messages to wait for), so the receiver can lay out its rows while the data is in flight.
//   flag [me][i] (value token + 1), one per message: the block's stores of the message, CTA barrier,
//     then the thread of that destination: __threadfence_system (release: the block's stores, at
//     system scope) and st.release.sys of the flag. No workspace counters: every message has its own
//     flag, so the receiver unpacks messages as they land.
// NVLink only (the backend clears the variant when some peer has no mapping).
#pragma once

#include "kernels/low_latency/dispatch_send.cuh"

namespace moe_dispatcher::low_latency {

// Shared memory of the dedup send phase (the message itself follows, 16-byte aligned).
struct DedupSendShared {
  int count[kMaxExperts];    // this rank's selections per expert (every block counts them all)
  int messages[kMaxRanks];   // this rank's tokens with a pick on each rank: its messages to that rank
  int stage[kMaxRanks];      // per rank: this rank's tokens before the one in flight with a pick on it
  int expert[kMaxTopk];      // the token in flight: its experts (-1: unused slot)
  int slot[kMaxTopk];        // this rank's earlier tokens that chose expert[k]
  int pick[kMaxTopk];        // l * maxT + slot of its picks, grouped by destination
  int dest_rank[kMaxTopk];   // its distinct destination ranks, in the order of their first pick
  int dest_n[kMaxTopk];      // picks on dest_rank[j]
  int dest_first[kMaxTopk];  // first pick of destination j in `pick`
  unsigned long long dest_slot[kMaxTopk];  // address of its message slot on dest_rank[j] (NVLink)
  int num_dests;
};

// Whether topk_idx entry i (expert e >= 0) is its token's first pick on rank e / L (earlier picks of
// the token on the same rank share one message).
__device__ __forceinline__ bool first_pick_on_rank(const int64_t* topk_idx, int i, int e, int K, int L) {
  const int d = e / L;
  for (int j = i - i % K; j < i; ++j) {
    const int64_t f = topk_idx[j];
    if (f >= 0 && static_cast<int>(f) / L == d) return false;
  }
  return true;
}

// topk_idx entry i (expert e >= 0) of a token before the one in flight: one more earlier selection of
// e (the slot of the in-flight token's pick of e), and one more earlier message to rank e / L when it
// is its token's first pick there.
__device__ __forceinline__ void count_earlier(DedupSendShared& sh, const int64_t* topk_idx, int i, int e,
                                              int K, int L) {
  count_slot(sh.expert, sh.slot, e, K);
  if (first_pick_on_rank(topk_idx, i, e, K, L)) atomicAdd(&sh.stage[e / L], 1);
}

// Warp 0, after the counting pass: the destinations of the token in flight (distinct ranks of its
// picks, in the order of their first pick), its picks grouped by destination (k ascending inside a
// group), and the address of its message slot on each destination.
__device__ __forceinline__ void plan_destinations(const Common& c, DedupSendShared& sh, const HalfLayout& lay,
                                                  int K, int L) {
  const int lane = threadIdx.x % 32;
  const int e = lane < K ? sh.expert[lane] : -1;
  const int d = e >= 0 ? e / L : -1;
  // lead: the first lane with this lane's destination; before_me: earlier lanes with it; same: all of them.
  int lead = lane, before_me = 0, same = 0;
  for (int k = 0; k < K; ++k) {  // K <= 32, the same for every lane
    const int dk = __shfl_sync(0xffffffffu, d, k);
    if (d >= 0 && dk == d) {
      if (k < lane) {
        if (before_me == 0) lead = k;
        ++before_me;
      }
      ++same;
    }
  }
  const unsigned leads = __ballot_sync(0xffffffffu, d >= 0 && lead == lane);
  const int j = __popc(leads & ((1u << lead) - 1));  // destination index (leads before this group's)
  // Picks of the destinations before this one: valid lanes whose lead comes before this lane's lead.
  int first = 0;
  for (int k = 0; k < K; ++k) {
    const int dk = __shfl_sync(0xffffffffu, d, k), lk = __shfl_sync(0xffffffffu, lead, k);
    if (dk >= 0 && lk < lead) ++first;
  }
  if (d >= 0) {
    sh.pick[first + before_me] = (e % L) * c.max_tokens + sh.slot[lane];
    if (lead == lane) {
      sh.dest_rank[j] = d;
      sh.dest_n[j] = same;
      sh.dest_first[j] = first;
      uint8_t* local = c.buffer + c.half_offset + lay.recv_off +
                       (static_cast<size_t>(c.rank) * c.max_tokens + sh.stage[d]) * lay.dedup_slot_bytes;
      sh.dest_slot[j] = reinterpret_cast<unsigned long long>(peer_address(c, d, local));
    }
  }
  if (lane == 0) sh.num_dests = __popc(leads);
}

__device__ __forceinline__ void dispatch_dedup_send_phase(const Common& c, const DispatchArgs& a,
                                                          const HalfLayout& lay, uint8_t* smem_raw) {
  auto& sh = *reinterpret_cast<DedupSendShared*>(smem_raw);
  uint8_t* msg = smem_raw + (sizeof(DedupSendShared) + 15) / 16 * 16;
  const int tid = threadIdx.x, warp = tid / 32;
  const int R = c.num_ranks, E = c.num_experts, L = E / R, K = a.num_topk, T = a.num_tokens;
  const int H = c.hidden, me = c.rank;
  int* signals = half_signals(c, lay);
  int* counts = signals + signal_dispatch_counts();    // [L][R]
  int* msg_counts = signals + signal_message_counts(E);  // [R]
  int* flags = signals + signal_pair_flags(E, R);      // [R][maxT]
  const size_t used = message_used_bytes(H, a.fp8);
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(a.x);

  // The block's first token: its row loads go out before the counting pass, which also counts that
  // token's slots and message indices (one pass over topk_idx instead of two).
  int4 raw[kRowVectors];
  const int first = blockIdx.x;
  if (first < T) load_row(x, first, H, raw);
  for (int e = tid; e < E; e += blockDim.x) sh.count[e] = 0;
  if (tid < R) {
    sh.messages[tid] = 0;
    sh.stage[tid] = 0;
  }
  read_token_experts(a.topk_idx, first, T, K, sh.expert, sh.slot);
  __syncthreads();
  const int first_limit = first < T ? first * K : 0;
  for (int i = tid; i < T * K; i += blockDim.x) {
    const int64_t e64 = a.topk_idx[i];
    if (e64 < 0) continue;
    const int e = static_cast<int>(e64);
    atomicAdd(&sh.count[e], 1);
    if (first_pick_on_rank(a.topk_idx, i, e, K, L)) {
      atomicAdd(&sh.messages[e / L], 1);
      if (i < first_limit) atomicAdd(&sh.stage[e / L], 1);
    }
    if (i < first_limit) count_slot(sh.expert, sh.slot, e, K);
  }
  __syncthreads();
  trace_event(c, kTraceDCounted);

  // Counts of every expert (zeros too) and message counts, spread over the grid: relaxed stores
  // (they publish no data; see the top of the file).
  for (int i = blockIdx.x * blockDim.x + tid; i < E + R; i += gridDim.x * blockDim.x) {
    if (i < E) {
      int* word = counts + (i % L) * R + me;
      st_relaxed_sys(reinterpret_cast<int*>(peer_address(c, i / L, word)), sh.count[i] + 1);
      trace_pair_now(c, kTracePairSent, i);
    } else {
      const int d = i - E;
      st_relaxed_sys(reinterpret_cast<int*>(peer_address(c, d, msg_counts + me)), sh.messages[d] + 1);
    }
  }

  for (int t = first; t < T; t += gridDim.x) {
    if (t != first) {
      // Later tokens of this block (T > grid): row loads first, then the slot / message-index pass.
      load_row(x, t, H, raw);
      read_token_experts(a.topk_idx, t, T, K, sh.expert, sh.slot);
      if (tid < R) sh.stage[tid] = 0;
      __syncthreads();
      for (int i = tid; i < t * K; i += blockDim.x) {
        const int64_t e64 = a.topk_idx[i];
        if (e64 >= 0) count_earlier(sh, a.topk_idx, i, static_cast<int>(e64), K, L);
      }
      __syncthreads();
    }
    if (warp == 0) plan_destinations(c, sh, lay, K, L);
    write_message_body(a, raw, msg, H);
    __syncthreads();
    if (t == first) trace_event(c, kTraceDCastDone);

    // The whole block streams the message to each destination: body vectors 1 .. used/16 - 1, then
    // the picks {n, p...} at `used` (vector q holds words 4q .. 4q+3; sent while 4q <= n).
    const int nd = sh.num_dests;
    const int body_vecs = static_cast<int>(used / 16) - 1;
    const int per_dest = body_vecs + (1 + K + 3) / 4;
    for (int idx = tid; idx < nd * per_dest; idx += blockDim.x) {
      const int j = idx / per_dest, v = idx - j * per_dest;
      uint8_t* slot = reinterpret_cast<uint8_t*>(sh.dest_slot[j]);
      if (v < body_vecs) {
        st_v4(slot + 16 * (1 + v), reinterpret_cast<const int4*>(msg)[1 + v]);
        continue;
      }
      const int q = v - body_vecs, n = sh.dest_n[j];
      if (4 * q > n) continue;
      int w[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int word = 4 * q + u;
        w[u] = word == 0 ? n : (word <= n ? sh.pick[sh.dest_first[j] + word - 1] : 0);
      }
      st_v4(slot + used + 16 * q, make_int4(w[0], w[1], w[2], w[3]));
    }
    __syncthreads();  // every store of this token's messages precedes the fences below
    trace_event(c, kTraceDStoresIssued);  // the last token's stamp stays

    if (tid < nd) {
      const int d = sh.dest_rank[tid];
      __threadfence_system();  // release: the block's stores of the message, at system scope
      int* flag = flags + static_cast<size_t>(me) * c.max_tokens + sh.stage[d];
      st_release_sys(reinterpret_cast<int*>(peer_address(c, d, flag)), t + 1);
    }
    __syncthreads();  // the shared message and plan are rewritten by the next token
  }
  trace_event(c, kTraceDSignaled);  // after the last token's barrier: all of its fences and flags
}

}  // namespace moe_dispatcher::low_latency
