// The low-latency buffer layout: the ONE definition of where each region of the NVSHMEM buffer lies.
//
// Plain C++ (no CUDA, no torch) so that three users share it: the kernels (device code), the native
// runtime (csrc/low_latency_bindings.cpp) and the CPU-only module moe_dispatcher._layout
// (csrc/layout/ll_layout_module.cpp), through which Buffer.get_low_latency_rdma_size_hint reads it on
// machines without the CUDA extension.
#pragma once

#include <cstddef>

#if defined(__CUDACC__)
#define MOE_LL_HD __host__ __device__
#else
#define MOE_LL_HD
#endif

namespace moe_ep::low_latency {

// Limits the runtime checks before any launch.
constexpr int kMaxTopk = 32;        // one lane of a warp per top-k slot
constexpr int kMaxRanks = 32;       // one lane of a warp per source rank
constexpr int kMaxExperts = 1024;   // per-expert counters in shared memory and the workspace
constexpr int kMaxHidden = 16384;   // one BF16 message must fit in shared memory

// Byte layout of ONE half of the symmetric buffer for a given (max_tokens, hidden, ranks, experts).
// The halves sit at 0 and half_bytes. Inside a half:
//   [send_off, +send_bytes)   send region: the zero-copy combine rows [L][R*maxT][H] bf16, or the
//                             staging copy of dispatch messages [maxT][msg] for the put path
//   [recv_off, +recv_bytes)   receive region, one of (a half serves one call at a time):
//                               per-expert dispatch messages [L][R][maxT][msg],
//                               dedup dispatch messages [R][maxT][dedup_slot] (fits when L >= 2),
//                               combine rows [E][maxT][H] bf16,
//                               per-rank combine: partial rows [R][maxT][H] bf16, then at
//                                 rank_routing_offset the sources' routing [R][maxT][K] int2 {expert, weight}
//   [signal_off, +signal_bytes)  int32 words:
//       [0, E)            dispatch counts [L][R] (value count + 1), every dispatch
//       [E, E + F)        the flags of the call, F = max(E, R + R*maxT) when L >= 2, else E:
//                           combine: flags [E] (value 1);
//                           dedup dispatch: token counts per source rank [R] (value T + 1), then
//                             flags [source][token] (value token + 1, or -1: no message) from E + R;
//                           per-rank combine: the same words: routing pushed [R] (value T + 1), then
//                             flags [expert rank][token] (value token + 1) from E + R.
//                         A half serves one call at a time and every call leaves them at 0, so the calls
//                         share these words (which keeps the size under DeepEP V1's formula).
// The buffer needs 2 * half_bytes (Buffer.get_low_latency_rdma_size_hint returns exactly that).
// A dedup message slot: [16 bytes, unused: the flag lives in the signal words] [body as in `msg`]
// then, at message_used_bytes, the entries: int32 {n, pick 0, ..., pick n-1}, pick = l * maxT + slot.
struct HalfLayout {
  size_t send_off, recv_off, signal_off, half_bytes;
  size_t msg_bytes;        // one per-expert dispatch message slot: 16-byte header + max(2H, H + 4H/128)
  size_t dedup_slot_bytes; // one dedup message slot: msg_bytes + room for {n, min(kMaxTopk, L) picks}
  size_t signal_bytes;
};

MOE_LL_HD inline HalfLayout half_layout(int max_tokens, int hidden, int num_ranks, int num_experts) {
  HalfLayout l{};
  const size_t t = static_cast<size_t>(max_tokens), h = static_cast<size_t>(hidden);
  const size_t r = static_cast<size_t>(num_ranks), e = static_cast<size_t>(num_experts);
  const size_t local = e / r;
  const size_t fp8 = h + h / 128 * 4;
  l.msg_bytes = 16 + (2 * h > fp8 ? 2 * h : fp8);
  const size_t picks = local < static_cast<size_t>(kMaxTopk) ? local : static_cast<size_t>(kMaxTopk);
  l.dedup_slot_bytes = l.msg_bytes + (4 * (1 + picks) + 15) / 16 * 16;
  const size_t combine_msg = 2 * h;
  const size_t send = t * l.msg_bytes > e * t * combine_msg ? t * l.msg_bytes : e * t * combine_msg;
  // The dedup staging [R][maxT][dedup_slot] fits here whenever L >= 2 (then L * msg >= dedup_slot).
  const size_t recv = e * t * (l.msg_bytes > combine_msg ? l.msg_bytes : combine_msg);
  const size_t flags = local >= 2 && r + r * t > e ? r + r * t : e;
  l.signal_bytes = 4 * (e + flags);
  l.send_off = 0;
  l.recv_off = send;
  l.signal_off = send + recv;
  l.half_bytes = (send + recv + l.signal_bytes + 127) / 128 * 128;
  return l;
}

// Bytes of NVSHMEM buffer per GPU low-latency mode needs for these shapes: both halves.
inline size_t buffer_bytes(int max_tokens, int hidden, int num_ranks, int num_experts) {
  return 2 * half_layout(max_tokens, hidden, num_ranks, num_experts).half_bytes;
}

// The signal words of a half (see above), as int32 indices from signal_off.
MOE_LL_HD inline size_t signal_dispatch_counts() { return 0; }
MOE_LL_HD inline size_t signal_combine_flags(int num_experts) { return static_cast<size_t>(num_experts); }
MOE_LL_HD inline size_t signal_token_counts(int num_experts) { return static_cast<size_t>(num_experts); }
MOE_LL_HD inline size_t signal_pair_flags(int num_experts, int num_ranks) {
  return static_cast<size_t>(num_experts) + static_cast<size_t>(num_ranks);
}

// Per-rank combine: byte offset (from recv_off) of the routing the sources push, [R][maxT][K] of int2
// {expert (int32, -1 = unused slot), weight (float32 bits)}, after the partial rows [R][maxT][H] bf16.
// Both fit the receive region whenever L >= 2: it holds E*maxT*2H >= 2*R*maxT*2H bytes, and
// R*maxT*K*8 <= R*maxT*2H for H >= 128 >= 4K.
MOE_LL_HD inline size_t rank_routing_offset(int max_tokens, int hidden, int num_ranks) {
  return static_cast<size_t>(num_ranks) * max_tokens * hidden * 2;
}

// Bytes of a dispatch message actually used (16-byte multiple): header + payload (+ scales).
MOE_LL_HD inline size_t message_used_bytes(int hidden, bool fp8) {
  const size_t h = static_cast<size_t>(hidden);
  const size_t body = fp8 ? h + h / 128 * 4 : 2 * h;
  return (16 + body + 15) / 16 * 16;
}

}  // namespace moe_ep::low_latency
