// Low-latency (NVSHMEM) dispatch and combine: the host-side interface of the kernels.
//
// Torch-free and NVSHMEM-header-free, so the pybind11 glue (csrc/low_latency_bindings.cpp) can
// include it. Tensors arrive as raw device pointers; every shape and dtype was checked in Python
// (moe_dispatcher/compiled/low_latency.py). docs/low_latency.md describes the protocol.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moe_dispatcher::low_latency {

// Limits checked in Python before any launch.
constexpr int kMaxTopk = 32;        // one lane of a warp per top-k slot
constexpr int kMaxRanks = 32;       // one lane of a warp per source rank
constexpr int kMaxExperts = 1024;   // per-expert counters in shared memory and the workspace
constexpr int kMaxHidden = 16384;   // one BF16 message must fit in shared memory
constexpr int kThreads = 512;       // threads per block of every low-latency kernel

// Which halves of the work a launch does: both (one kernel), or send now and receive in the hook.
constexpr int kPhaseSend = 1;
constexpr int kPhaseRecv = 2;

// Kernel variants (bits of Common::variant; MOE_DISPATCHER_LL_VARIANT and MOE_DISPATCHER_LL_DISPATCH,
// read when the backend is created). Every variant produces the same bytes; they differ in what crosses
// NVLink. All are NVLink only: the backend clears them when some peer has no NVLink mapping.
//   kVariantDispatchDedup (the default): the dispatch sends each token once per destination RANK (with
//   the list of that rank's local experts it chose) into a per-source staging area of the receive
//   region; the receiver expands it into the per-expert layout (dispatch_dedup_send.cuh / _recv.cuh).
//   Needs at least two local experts (with one, per-expert messages are already one per rank): the
//   backend clears it for such calls.
constexpr int kVariantDispatchDedup = 2;
//   kVariantCombinePerRank (the default with CombineArgs::rank_partials): the combine sums the rows of a
//   token's picks on this rank here (weighted, float32, k ascending) and sends that partial sum back once
//   per (token, rank) instead of every (token, expert) row (combine_rank_send.cuh / _recv.cuh). Needs at
//   least two local experts (with one there is nothing to sum: the backend clears it) and rank_partials
//   (it computes that reduction order; the per-expert combine computes it at the receiver otherwise).
constexpr int kVariantCombinePerRank = 4;
constexpr int kVariantMask = kVariantDispatchDedup | kVariantCombinePerRank;

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
//                         share these words (which keeps the hint under DeepEP V1's formula).
// The total (2 * half_bytes) equals Buffer.get_low_latency_rdma_size_hint.
// A dedup message slot: [16 bytes, unused: the flag lives in the signal words] [body as in `msg`]
// then, at message_used_bytes, the entries: int32 {n, pick 0, ..., pick n-1}, pick = l * maxT + slot.
struct HalfLayout {
  size_t send_off, recv_off, signal_off, half_bytes;
  size_t msg_bytes;        // one per-expert dispatch message slot: 16-byte header + max(2H, H + 4H/128)
  size_t dedup_slot_bytes; // one dedup message slot: msg_bytes + room for {n, min(kMaxTopk, L) picks}
  size_t signal_bytes;
};

__host__ __device__ inline HalfLayout half_layout(int max_tokens, int hidden, int num_ranks,
                                                  int num_experts) {
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

// The signal words of a half (see above), as int32 indices from signal_off.
__host__ __device__ inline size_t signal_dispatch_counts() { return 0; }
__host__ __device__ inline size_t signal_combine_flags(int num_experts) { return static_cast<size_t>(num_experts); }
__host__ __device__ inline size_t signal_token_counts(int num_experts) { return static_cast<size_t>(num_experts); }
__host__ __device__ inline size_t signal_pair_flags(int num_experts, int num_ranks) {
  return static_cast<size_t>(num_experts) + static_cast<size_t>(num_ranks);
}

// Per-rank combine: byte offset (from recv_off) of the routing the sources push, [R][maxT][K] of int2
// {expert (int32, -1 = unused slot), weight (float32 bits)}, after the partial rows [R][maxT][H] bf16.
// Both fit the receive region whenever L >= 2: it holds E*maxT*2H >= 2*R*maxT*2H bytes, and
// R*maxT*K*8 <= R*maxT*2H for H >= 128 >= 4K.
__host__ __device__ inline size_t rank_routing_offset(int max_tokens, int hidden, int num_ranks) {
  return static_cast<size_t>(num_ranks) * max_tokens * hidden * 2;
}

// Bytes of a dispatch message actually used (16-byte multiple): header + payload (+ scales).
__host__ __device__ inline size_t message_used_bytes(int hidden, bool fp8) {
  const size_t h = static_cast<size_t>(hidden);
  const size_t body = fp8 ? h + h / 128 * 4 : 2 * h;
  return (16 + body + 15) / 16 * 16;
}

// Workspace: int32 words in ordinary device memory of this GPU (not symmetric), zeroed once at
// creation; every counter is returned to 0 by the kernel that used it.
constexpr int kWsDispatchFinished = 0;                              // [E] messages written
constexpr int kWsCombineFinished = kWsDispatchFinished + kMaxExperts;  // [L*R] parts done
constexpr int kWsDispatchRecvDone = kWsCombineFinished + kMaxExperts;  // blocks done polling
constexpr int kWsCombineRecvDone = kWsDispatchRecvDone + 1;
constexpr int kWsCombineRoutingDone = kWsCombineRecvDone + 1;  // per-rank combine: blocks past the routing wait
constexpr int kWorkspaceInts = kWsCombineRoutingDone + 1;

// Opt-in phase trace (docs/low_latency.md, "Phase trace"). Common::trace null: off, and every trace
// point is one uniform branch on it. Otherwise it points at one record of kTraceWords uint64 words (the
// Python backend keeps one per (kernel, buffer half), so the two calls of a graph replay do not overwrite
// each other). Thread 0 of each block stamps %globaltimer (ns; one clock per host) into its block's row:
//   word [b * kTraceEvents + ev]    block b reached event ev (kTraceD* / kTraceC*), 0 = not reached;
//   word [b * kTraceEvents + kTraceSmid]  the SM block b ran on (a value, not a time).
// The send phase clears its block's row first, so a row never mixes two calls. Per-pair words:
//   dispatch  sent[e]  sender: count of global expert e published (signal_peer returned)
//             wait[p], seen[p]  receiver, p = l*R + s: lane s of unit (l, s, part 0) began polling the count
//                       of source s, and saw it (seen - wait ~ 0: it was already there when polled)
//   combine   sent[p]  sender, p = l*R + s: flag of expert me*L + l raised on rank s
//             wait[e], seen[e]  receiver, block 0 only: began polling flag e (expert e), and saw it
constexpr int kTraceMaxBlocks = 256;
constexpr int kTraceEvents = 16;
constexpr int kTraceSmid = kTraceEvents - 1;
// Dispatch events. Send: entry (launch with the send phase) -> counted (per-expert counting pass over
// topk_idx done, first token's row loads in flight) -> cast_done (first token's message built in shared
// memory: loads landed + FP8 cast) -> stores_issued (last token: every store to the peers issued, CTA
// barrier) -> signaled (send phase over: fences, workspace atomics and count signals of all its tokens).
// Receive: recv_entry -> first_arrival / last_arrival (first / last unit of the block: warp 0 has seen
// the counts it needs) -> copy_done (last unit unpacked) -> exit (launch with the receive phase).
constexpr int kTraceDEntry = 0, kTraceDCounted = 1, kTraceDCastDone = 2, kTraceDStoresIssued = 3,
              kTraceDSignaled = 4, kTraceDRecvEntry = 5, kTraceDFirstArrival = 6,
              kTraceDLastArrival = 7, kTraceDCopyDone = 8, kTraceDExit = 9, kTraceDCount = 10;
// Combine events: entry -> sends_issued (all rows of the block's units stored / put + quiet, CTA
// barrier) -> flags_up (fences, workspace atomics and flags done, CTA barrier) -> recv_entry ->
// wait_done (every flag seen, CTA barrier) -> reduce_done (CTA barrier after the block's reductions)
// -> exit. The per-rank variant (combine_rank_*.cuh) stamps routed (every source's routing seen) after
// entry; sends_issued / flags_up / wait_done are then those of the block's last batch / token.
constexpr int kTraceCEntry = 0, kTraceCSendsIssued = 1, kTraceCFlagsUp = 2, kTraceCRecvEntry = 3,
              kTraceCWaitDone = 4, kTraceCReduceDone = 5, kTraceCExit = 6, kTraceCRouted = 7,
              kTraceCCount = 8;
constexpr int kTracePairSent = kTraceMaxBlocks * kTraceEvents;
constexpr int kTracePairWait = kTracePairSent + kMaxExperts;
constexpr int kTracePairSeen = kTracePairWait + kMaxExperts;
constexpr int kTraceWords = kTracePairSeen + kMaxExperts;

// What every launch needs about the buffer and the group.
struct Common {
  uint8_t* buffer;             // this PE's address of the symmetric allocation
  const uint64_t* peer_bases;  // device [R]: nvshmem_ptr(buffer, pe), 0 = reach pe by nvshmem puts
  int* workspace;              // device [kWorkspaceInts]
  size_t half_offset;          // byte offset of the half this call uses (0 or half_bytes)
  int rank, num_ranks, num_experts, max_tokens, hidden;
  int num_blocks;              // grid size (<= SMs: the fused kernels need co-resident blocks)
  int variant;                 // kVariant* bits
  uint64_t timeout_ns;         // a wait longer than this traps with a message
  unsigned long long* trace;   // phase-trace record (kTraceWords) or null: off (see above)
};

struct DispatchArgs {
  const void* x;               // bf16 [T, H]
  const int64_t* topk_idx;     // [T, K], -1 = unused slot
  int num_tokens, num_topk;
  bool fp8, round_scale, ue8m0;
  void* recv_x;                // fp8 or bf16 [L, R*maxT, H]
  void* recv_scales;           // float32 [L, H/128, R*maxT] or int32 [L, H/512, R*maxT]; fp8 only
  int* src_info;               // [L, R*maxT]
  int* row_of;                 // [L, R*maxT] or null: [l][s*maxT + t] = the row of (source s, token t) at
                               // local expert l (written for received pairs only; the per-rank combine's map)
  int64_t* layout_range;       // [L, R]
  int* recv_count;             // [L]
  int* cumulative_recv_stats;  // [L] or null
  int64_t* wait_stats;         // [R] or null
};

struct CombineArgs {
  const void* x;               // bf16 [L, R*maxT, H]; null with zero_copy (rows in the send region)
  const int64_t* topk_idx;     // [T, K]
  const float* topk_weights;   // [T, K]
  const int* src_info;         // the dispatch handle's [L, R*maxT]
  const int* row_of;           // the dispatch handle's [L, R*maxT] (DispatchArgs::row_of); per-rank variant
  const int64_t* layout_range; // the dispatch handle's [L, R]
  void* out;                   // bf16 [T, H]
  int num_tokens, num_topk;
  // Reduction order (docs/semantics.md, "Low-latency combine"). false: out = bf16(sum over k ascending of
  // w_k * row_k). true (per-rank partials): the picks of a token on one rank are summed first (k ascending,
  // float32) and, when there are two or more, rounded to bf16 (what travels back); the terms of its ranks
  // are then added in the order of each rank's first pick. A single pick on a rank is w_k * row_k as before.
  bool rank_partials;
  int64_t* wait_stats;         // [R] or null
};

// Enqueue on `stream`; no host synchronisation; capturable in CUDA graphs.
void launch_dispatch(const Common& c, const DispatchArgs& a, int phases, cudaStream_t stream);
void launch_combine(const Common& c, const CombineArgs& a, int phases, cudaStream_t stream);

}  // namespace moe_dispatcher::low_latency
