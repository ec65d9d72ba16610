// Dispatch, send phase: each token becomes one message (header + BF16 row, or FP8 row + scales,
// cast here), written into the receive slot of every expert it selected on the expert's PE.
//
// Slots: the message of the i-th token (ascending) of this rank that chose expert e goes to slot i
// of the receiver's region [e % L][me][*]; the block counts the earlier selections of e itself,
// so the layout is deterministic and equal to the reference's (sources ascending, then tokens).
//
// Counts (the dispatch signal [l][me] on the expert's PE, value pack_count(count): the call's signature tag
// over count + 1, common.cuh "Dispatch agreement"): sent by whichever
// thread finishes the last message of that expert. Per message: the block's stores to the peer
// (or the warp's puts + nvshmem_quiet), CTA barrier, then the slot owner does
// __threadfence_system + atomicAdd on workspace finished[e] (GPU scope). The thread whose add
// completes the count does __threadfence_system (acquiring every earlier writer's fenced stores
// through the atomic's modification order), resets the counter and publishes the count with
// signal_peer. Experts this rank sends nothing to get count 0 at once. Block 0 first writes the call's
// signature into this rank's signature word of every PE (publish_signature: no data, no ordering).
#pragma once

#include "kernels/low_latency/common.cuh"
#include "kernels/low_latency/fp8_cast.cuh"

namespace moe_ep::low_latency {

// Shared memory of the send phase: per-expert counts of this rank, the destinations of the token
// in flight, and the message itself (16-byte aligned, up to 16 + 2H bytes).
struct DispatchSendShared {
  int count[kMaxExperts];
  int dst_expert[kMaxTopk];
  int slot[kMaxTopk];
  long long dst_offset[kMaxTopk];  // byte offset of the slot inside the buffer (both halves)
};

// Up to kRowVectors 16-byte vectors of a bf16 row per thread (kMaxHidden / 8 / kThreads).
constexpr int kRowVectors = (kMaxHidden / 8 + kThreads - 1) / kThreads;

// Issue the loads of token t's bf16 row into registers (vector tid + j * blockDim.x in raw[j]), so
// that their latency overlaps the counting that precedes the cast.
__device__ __forceinline__ void load_row(const __nv_bfloat16* x, int t, int H, int4 (&raw)[kRowVectors]) {
  const int4* row = reinterpret_cast<const int4*>(x + static_cast<size_t>(t) * H);
  const int vectors = H / 8;
#pragma unroll
  for (int j = 0; j < kRowVectors; ++j) {
    const int i = j * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
    raw[j] = i < vectors ? ld_nc(row + i) : make_int4(0, 0, 0, 0);
  }
}

// The body of a message (at msg + 16) from the bf16 row in `raw` (load_row): the row itself, or its
// FP8 cast (e4m3 bytes, then one float32 scale per 128 channels). Every thread of the block calls it.
__device__ __forceinline__ void write_message_body(const DispatchArgs& a, const int4 (&raw)[kRowVectors],
                                                   uint8_t* msg, int H) {
  const int tid = threadIdx.x, lane = tid % 32;
  const int vectors = H / 8;  // 16-byte vectors of the bf16 row
  if (a.fp8) {
    float* scales = reinterpret_cast<float*>(msg + 16 + H);
    // H/8 is a multiple of 16 and blockDim of 32: half-warps are uniformly in or out of range.
#pragma unroll
    for (int j = 0; j < kRowVectors; ++j) {
      const int i = j * blockDim.x + tid;
      if (j * static_cast<int>(blockDim.x) >= vectors) break;  // uniform over the block
      const Fp8Group g = cast_group_fp8(raw[j], a.round_scale);
      if (i < vectors) {
        reinterpret_cast<uint2*>(msg + 16)[i] = g.q;
        if (lane % 16 == 0) scales[i / 16] = g.scale;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kRowVectors; ++j) {
      const int i = j * blockDim.x + tid;
      if (i < vectors) reinterpret_cast<int4*>(msg + 16)[i] = raw[j];
    }
  }
}

// Threads tid < K: the experts of token t (-1: unused slot; all -1 when t >= T, no token) into
// expert[], and their slots (counted next) to 0.
__device__ __forceinline__ void read_token_experts(const int64_t* topk_idx, int t, int T, int K, int* expert,
                                                   int* slot) {
  const int tid = threadIdx.x;
  if (tid < K) {
    expert[tid] = t < T ? static_cast<int>(topk_idx[static_cast<size_t>(t) * K + tid]) : -1;
    slot[tid] = 0;
  }
}

// One earlier selection of expert e (a token before the one in flight chose it): count it in slot[k]
// of the first k whose expert[k] is e (the first, as the reference's order needs).
__device__ __forceinline__ void count_slot(const int* expert, int* slot, int e, int K) {
  for (int k = 0; k < K; ++k) {
    if (expert[k] == e) {
      atomicAdd(&slot[k], 1);
      break;
    }
  }
}

__device__ __forceinline__ void dispatch_send_phase(const Common& c, const DispatchArgs& a,
                                                    const HalfLayout& lay, uint8_t* smem_raw) {
  auto& sh = *reinterpret_cast<DispatchSendShared*>(smem_raw);
  uint8_t* msg = smem_raw + (sizeof(DispatchSendShared) + 15) / 16 * 16;
  const int tid = threadIdx.x, warp = tid / 32;
  const int R = c.num_ranks, E = c.num_experts, L = E / R, K = a.num_topk, T = a.num_tokens;
  const int H = c.hidden;
  const size_t half = c.half_offset;
  int* finished = c.workspace + kWsDispatchFinished;
  int* signals = reinterpret_cast<int*>(c.buffer + half + lay.signal_off);  // [L][R]
  const size_t used = message_used_bytes(H, a.fp8);
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(a.x);

  // The block's first token: its row loads and its destinations go out before the counting pass,
  // which also counts the slots of that token (one pass over topk_idx instead of two).
  publish_signature(c, a);
  int4 raw[kRowVectors];
  const int first = blockIdx.x;
  if (first < T) load_row(x, first, H, raw);
  for (int e = tid; e < E; e += blockDim.x) sh.count[e] = 0;
  read_token_experts(a.topk_idx, first, T, K, sh.dst_expert, sh.slot);
  __syncthreads();
  // Every block counts this rank's selections per expert (T*K entries, shared-memory atomics).
  const int first_limit = first < T ? first * K : 0;
  for (int i = tid; i < T * K; i += blockDim.x) {
    const int64_t e = a.topk_idx[i];
    if (e >= 0) {
      atomicAdd(&sh.count[e], 1);
      if (i < first_limit) count_slot(sh.dst_expert, sh.slot, static_cast<int>(e), K);
    }
  }
  __syncthreads();
  trace_event(c, kTraceDCounted);

  // Experts that get nothing from this rank: count 0 now (no data to order before it).
  for (int e = blockIdx.x * blockDim.x + tid; e < E; e += gridDim.x * blockDim.x) {
    if (sh.count[e] == 0) {
      signal_peer(c, signals + (e % L) * R + c.rank, pack_count(a, 0), e / L);
      trace_pair_now(c, kTracePairSent, e);
    }
  }

  for (int t = first; t < T; t += gridDim.x) {
    if (t != first) {
      // Later tokens of this block (T > grid): row loads first, then the slot pass of this token.
      load_row(x, t, H, raw);
      read_token_experts(a.topk_idx, t, T, K, sh.dst_expert, sh.slot);
      __syncthreads();
      for (int i = tid; i < t * K; i += blockDim.x) {
        const int e = static_cast<int>(a.topk_idx[i]);
        if (e >= 0) count_slot(sh.dst_expert, sh.slot, e, K);
      }
      __syncthreads();
    }
    if (tid < K) {
      const int e = sh.dst_expert[tid];
      if (e >= 0) {
        const size_t index = (static_cast<size_t>(e % L) * R + c.rank) * c.max_tokens + sh.slot[tid];
        sh.dst_offset[tid] = static_cast<long long>(half + lay.recv_off + index * lay.msg_bytes);
      }
    }
    // The message in shared memory: header (source token), then the payload.
    if (tid == 0) reinterpret_cast<int4*>(msg)[0] = make_int4(t, 0, 0, 0);
    write_message_body(a, raw, msg, H);
    __syncthreads();
    if (t == first) trace_event(c, kTraceDCastDone);

    // NVLink destinations: the whole block streams the message to every slot.
    const int n16 = static_cast<int>(used / 16);
    bool any_put = false;
    for (int k = 0; k < K; ++k) {
      const int e = sh.dst_expert[k];
      if (e >= 0 && c.peer_bases[e / L] == 0) any_put = true;
    }
    for (int idx = tid; idx < K * n16; idx += blockDim.x) {
      const int k = idx / n16, j = idx - k * n16;
      const int e = sh.dst_expert[k];
      if (e < 0) continue;
      uint8_t* remote = peer_address(c, e / L, c.buffer + sh.dst_offset[k]);
      if (remote != nullptr) st_v4(remote + 16 * j, reinterpret_cast<const int4*>(msg)[j]);
    }
    // Put path (no NVLink mapping): stage the message in the symmetric send region, one warp per
    // destination puts it and waits for its completion (nvshmem_quiet) before the count below.
    if (any_put) {
      uint8_t* staged = c.buffer + half + lay.send_off + static_cast<size_t>(t) * lay.msg_bytes;
      for (int j = tid; j < n16; j += blockDim.x)
        reinterpret_cast<int4*>(staged)[j] = reinterpret_cast<const int4*>(msg)[j];
      __syncthreads();
      if (warp < K) {
        const int e = sh.dst_expert[warp];
        if (e >= 0 && c.peer_bases[e / L] == 0) {
          nvshmemx_putmem_nbi_warp(c.buffer + sh.dst_offset[warp], staged, used, e / L);
          nvshmem_quiet();
        }
      }
    }
    __syncthreads();  // every store/put of this message precedes the fences below
    trace_event(c, kTraceDStoresIssued);  // the last token's stamp stays

    if (tid < K) {
      const int e = sh.dst_expert[tid];
      if (e >= 0) {
        __threadfence_system();  // release: the block's message stores, at system scope
        const int done = atomicAdd(finished + e, 1) + 1;
        if (done == sh.count[e]) {
          __threadfence_system();  // acquire: every other writer's fenced message of expert e
          finished[e] = 0;
          signal_peer(c, signals + (e % L) * R + c.rank, pack_count(a, done), e / L);
          trace_pair_now(c, kTracePairSent, e);
        }
      }
    }
    __syncthreads();  // shared message and destinations are rewritten by the next token
  }
  trace_event(c, kTraceDSignaled);  // after the last token's barrier: all of its fences and signals
}

}  // namespace moe_ep::low_latency
