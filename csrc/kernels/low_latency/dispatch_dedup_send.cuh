// Dispatch, send phase of the dedup dispatch (Common::dedup_dispatch): each token becomes ONE message
// per destination RANK, carrying the list of that rank's local experts it chose, instead of one
// message per chosen expert (top-8 of 256 experts on 4 ranks hits ~3.6 ranks: ~2.2x fewer bytes
// over NVLink). The receiver expands the messages into the per-expert layout
// (dispatch_dedup_recv.cuh); the outputs are the per-expert kernels', byte for byte.
//
// Token t of this rank (`me`) goes to d's staging slot [me][t] of the receive region (HalfLayout:
// [R][maxT] slots of dedup_slot_bytes) on every rank d it has a pick on. A slot holds the body at
// offset 16 as in the per-expert messages (BF16 row, or FP8 row + float32 scales; the 16-byte header
// is not sent), then at message_used_bytes the picks {n, p_0, ..., p_{n-1}} with p = l * maxT + slot:
// local expert l of d, and slot = the number of this rank's earlier tokens that chose that expert, so
// that row begin[l][me] + slot of expert l is where the per-expert kernels (and the reference) puts it.
//
// Order of a block's work for its token: the row's loads go out, the block counts the earlier tokens'
// selections (the picks' slots: a shared lookup per selection; in the blocks that publish counts,
// every token's) while they are in flight, casts, then streams the body and the picks to every
// destination in one go, so that the flag's fence waits for one drain.
//
// Signals (words of the receiver's half, low_latency.h):
//   signature word [half][me] (common.cuh "Dispatch agreement"): this call's signature, block 0 at entry.
//   token count [me] (value pack_count(T): the signature's tag over T + 1), at the message-count word:
//     published by block 0 at entry; the receiver polls flags [me][0, T).
//   counts [l][me] (value pack_count(count)): this rank's tokens for each expert, published by the blocks that
//     count every token (the first min(grid, ceil(E / blockDim)) blocks), right after their count.
//   Both with relaxed stores: they order no data (the receiver needs them to place rows and to know
//   which flags to poll), so it can lay out its rows while the data is in flight.
//   flag [me][t], one per token and rank: kNoMessage (relaxed, no data) when t has no pick on that
//     rank, else t + 1 after the block's stores of the message, a CTA barrier, then the thread of that
//     destination's __threadfence_system (release: the block's stores, at system scope) and
//     st.release.sys. No workspace counters: every message has its own flag, so the receiver unpacks
//     messages as they land.
// NVLink only (the runtime picks the per-expert kernels when some peer has no mapping).
#pragma once

#include "kernels/low_latency/dispatch_send.cuh"

namespace moe_ep::low_latency {

// Flag value of a token with no pick on the receiving rank (a message is flagged token + 1 >= 1).
constexpr int kNoMessage = -1;

// Shared memory of the dedup send phase (the message itself follows, 16-byte aligned).
struct DedupSendShared {
  int count[kMaxExperts];    // this rank's selections per expert (blocks that publish counts only)
  int8_t k_of[kMaxExperts];  // the token in flight: the top-k index of expert e (its first), -1 if none
  int expert[kMaxTopk];      // the token in flight: its experts (-1: unused slot)
  int slot[kMaxTopk];        // this rank's earlier tokens that chose expert[k]
  int pick_k[kMaxTopk];      // its picks grouped by destination: the top-k index k of each
  int dest_rank[kMaxTopk];   // its distinct destination ranks, in the order of their first pick
  int dest_n[kMaxTopk];      // picks on dest_rank[j]
  int dest_first[kMaxTopk];  // first pick of destination j in `pick_k`
  unsigned long long dest_slot[kMaxTopk];  // address of its message slot on dest_rank[j] (NVLink)
  unsigned dest_mask;        // bit d: the token has a pick on rank d
  int num_dests;
};

// Counting over topk_idx, an entry per thread (coalesced loads, kLoads in flight per thread). For the
// token in flight, `upto` (its experts in k_of): slot[k] += the tokens before it that chose expert k
// (one shared lookup per entry). With kTotals, also count[e] += every selection of e by all T tokens.
template <bool kTotals>
__device__ __forceinline__ void count_tokens(DedupSendShared& sh, const int64_t* topk_idx, int T, int upto,
                                             int K) {
  constexpr int kLoads = 4;
  const int n = (kTotals ? T : upto) * K, earlier = upto * K;
  for (int base = threadIdx.x; base < n; base += kLoads * blockDim.x) {
    int64_t e64[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int i = base + u * blockDim.x;
      e64[u] = i < n ? topk_idx[i] : -1;
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      if (e64[u] < 0) continue;
      const int e = static_cast<int>(e64[u]);
      if (kTotals) atomicAdd(&sh.count[e], 1);
      if (base + u * static_cast<int>(blockDim.x) < earlier) {
        const int k = sh.k_of[e];
        if (k >= 0) atomicAdd(&sh.slot[k], 1);
      }
    }
  }
}

// Thread 0: point k_of at the token in flight's experts (value k, the first k of a repeated expert), or
// back to -1 (value < 0).
__device__ __forceinline__ void mark_token_experts(DedupSendShared& sh, int K, bool mark) {
  for (int k = K - 1; k >= 0; --k)
    if (sh.expert[k] >= 0) sh.k_of[sh.expert[k]] = static_cast<int8_t>(mark ? k : -1);
}

// One warp, from the token's experts alone: its destinations (distinct ranks of its picks, in the
// order of their first pick), its picks grouped by destination (k ascending inside a group), and the
// address of its message slot [me][t] on each destination.
__device__ __forceinline__ void plan_destinations(const Common& c, DedupSendShared& sh, const HalfLayout& lay,
                                                  int t, int K, int L) {
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
  unsigned mask = d >= 0 ? 1u << d : 0u;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mask |= __shfl_xor_sync(0xffffffffu, mask, off);
  if (d >= 0) {
    sh.pick_k[first + before_me] = lane;
    if (lead == lane) {
      sh.dest_rank[j] = d;
      sh.dest_n[j] = same;
      sh.dest_first[j] = first;
      uint8_t* local = c.buffer + c.half_offset + lay.recv_off +
                       (static_cast<size_t>(c.rank) * c.max_tokens + t) * lay.dedup_slot_bytes;
      sh.dest_slot[j] = reinterpret_cast<unsigned long long>(peer_address(c, d, local));
    }
  }
  if (lane == 0) {
    sh.num_dests = __popc(leads);
    sh.dest_mask = mask;
  }
}

__device__ __forceinline__ void dispatch_dedup_send_phase(const Common& c, const DispatchArgs& a,
                                                          const HalfLayout& lay, uint8_t* smem_raw) {
  auto& sh = *reinterpret_cast<DedupSendShared*>(smem_raw);
  uint8_t* msg = smem_raw + (sizeof(DedupSendShared) + 15) / 16 * 16;
  const int tid = threadIdx.x, warp = tid / 32;
  const int R = c.num_ranks, E = c.num_experts, L = E / R, K = a.num_topk, T = a.num_tokens;
  const int H = c.hidden, me = c.rank;
  int* signals = half_signals(c, lay);
  int* counts = signals + signal_dispatch_counts();       // [L][R]
  int* token_counts = signals + signal_token_counts(E);  // [R]
  int* flags = signals + signal_pair_flags(E, R);         // [R][maxT]
  const size_t used = message_used_bytes(H, a.fp8);
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(a.x);
  // The blocks that publish counts [e][me] (e = blockIdx.x * blockDim.x + tid, grid-strided) count
  // every token's selections; the others only the earlier tokens of their own.
  const bool totals = static_cast<int>(blockIdx.x * blockDim.x) < E;

  publish_signature(c, a);
  if (blockIdx.x == 0 && tid < R)
    st_relaxed_sys(reinterpret_cast<int*>(peer_address(c, tid, token_counts + me)), pack_count(a, T));
  for (int e = tid; e < E; e += blockDim.x) {
    if (totals) sh.count[e] = 0;
    sh.k_of[e] = -1;
  }

  int4 raw[kRowVectors];
  for (int t = blockIdx.x; t < T || (t == static_cast<int>(blockIdx.x) && totals); t += gridDim.x) {
    // (A block without a token of its own still counts, when it publishes counts.)
    const bool has_token = t < T;
    if (has_token) load_row(x, t, H, raw);  // in flight during the counting
    read_token_experts(a.topk_idx, t, T, K, sh.expert, sh.slot);
    __syncthreads();
    if (tid == 0) mark_token_experts(sh, K, true);
    __syncthreads();
    if (totals && t == static_cast<int>(blockIdx.x)) {
      count_tokens<true>(sh, a.topk_idx, T, has_token ? t : 0, K);
    } else {
      count_tokens<false>(sh, a.topk_idx, T, t, K);
    }
    __syncthreads();
    if (tid == 0) mark_token_experts(sh, K, false);  // read again only after two more barriers
    if (t == static_cast<int>(blockIdx.x)) {
      trace_event(c, kTraceDCounted);
      if (totals) {
        // Counts of every expert (zeros too): relaxed stores (they publish no data; see the top).
        for (int e = blockIdx.x * blockDim.x + tid; e < E; e += gridDim.x * blockDim.x) {
          st_relaxed_sys(reinterpret_cast<int*>(peer_address(c, e / L, counts + (e % L) * R + me)),
                         pack_count(a, sh.count[e]));
          trace_pair_now(c, kTracePairSent, e);
        }
      }
    }
    if (!has_token) break;

    // The last warp plans: it has the fewest row vectors to cast (write_message_body) when the row
    // does not fill the block evenly.
    if (warp == static_cast<int>(blockDim.x) / 32 - 1) plan_destinations(c, sh, lay, t, K, L);
    write_message_body(a, raw, msg, H);
    __syncthreads();
    if (t == static_cast<int>(blockIdx.x)) trace_event(c, kTraceDCastDone);
    if (tid < R && ((sh.dest_mask >> tid) & 1u) == 0) {
      int* flag = flags + static_cast<size_t>(me) * c.max_tokens + t;
      st_relaxed_sys(reinterpret_cast<int*>(peer_address(c, tid, flag)), kNoMessage);
    }
    // The whole block streams the body (vectors 1 .. used/16 - 1) to each destination, then the picks.
    const int body_vecs = static_cast<int>(used / 16) - 1;
    for (int idx = tid; idx < sh.num_dests * body_vecs; idx += blockDim.x) {
      const int j = idx / body_vecs, v = idx - j * body_vecs;
      st_v4(reinterpret_cast<uint8_t*>(sh.dest_slot[j]) + 16 * (1 + v), reinterpret_cast<const int4*>(msg)[1 + v]);
    }

    // The picks {n, p...} at `used` of each destination's slot (vector q holds words 4q .. 4q+3; sent
    // while 4q <= n), p = l * maxT + slot of pick k.
    const int pick_vecs = (1 + K + 3) / 4;
    for (int idx = tid; idx < sh.num_dests * pick_vecs; idx += blockDim.x) {
      const int j = idx / pick_vecs, q = idx - j * pick_vecs, n = sh.dest_n[j];
      if (4 * q > n) continue;
      int w[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int word = 4 * q + u;
        int value = 0;
        if (word == 0) {
          value = n;
        } else if (word <= n) {
          const int k = sh.pick_k[sh.dest_first[j] + word - 1];
          value = (sh.expert[k] % L) * c.max_tokens + sh.slot[k];
        }
        w[u] = value;
      }
      st_v4(reinterpret_cast<uint8_t*>(sh.dest_slot[j]) + used + 16 * q, make_int4(w[0], w[1], w[2], w[3]));
    }
    __syncthreads();  // every store of this token's messages precedes the fences below
    trace_event(c, kTraceDStoresIssued);  // the last token's stamp stays

    if (tid < sh.num_dests) {
      const int d = sh.dest_rank[tid];
      __threadfence_system();  // release: the block's stores of the message, at system scope
      int* flag = flags + static_cast<size_t>(me) * c.max_tokens + t;
      st_release_sys(reinterpret_cast<int*>(peer_address(c, d, flag)), t + 1);
    }
    __syncthreads();  // the shared message and plan are rewritten by the next token
  }
  trace_event(c, kTraceDSignaled);  // after the last token's barrier: all of its fences and flags
}

}  // namespace moe_ep::low_latency
