// Low-latency (NVSHMEM) dispatch and combine: the host-side interface of the kernels.
//
// Torch-free and NVSHMEM-header-free, so the native runtime (csrc/low_latency_bindings.cpp) can
// include it. Tensors arrive as raw device pointers; the runtime checked every device, dtype,
// contiguity and size against the call's plan first. The buffer layout is in layout.h.
// docs/low_latency.md describes the protocol.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/timeout_record.h"
#include "kernels/low_latency/layout.h"

namespace moe_ep::low_latency {

constexpr int kThreads = 512;       // threads per block of every low-latency kernel

// Which halves of the work a launch does: both (one kernel), or send now and receive in the hook.
constexpr int kPhaseSend = 1;
constexpr int kPhaseRecv = 2;

// The kernels each call runs, chosen by the runtime per shape (no switch): with NVLink to every peer
// and two local experts or more, the dedup dispatch (one message per (token, destination rank) with
// the list of that rank's local experts it chose, expanded by the receiver: dispatch_dedup_*.cuh) and,
// for the per-rank reduction order, the per-rank combine (a token's picks on one rank summed there,
// one partial row back per (token, rank): combine_rank_*.cuh). Otherwise (a peer reached through
// NVSHMEM puts, one local expert, or the per-expert order) the per-expert kernels (dispatch_send.cuh,
// dispatch_recv.cuh, combine_send.cuh, combine_recv.cuh), which serve every case.

// What a timed-out wait records as its phase (TimeoutRecord::phase); wait_phase_name names them.
constexpr int kWaitDispatchCounts = 1;  // dispatch receive: a source's per-expert / token counts
constexpr int kWaitDispatchData = 2;    // dedup dispatch receive: a source's per-token flag
constexpr int kWaitCombineRouting = 3;  // per-rank combine send: a source's routing
constexpr int kWaitCombineData = 4;     // combine receive: an expert's (or expert rank's) flag
inline const char* wait_phase_name(int phase) {
  switch (phase) {
    case kWaitDispatchCounts: return "low_latency_dispatch (receive counts)";
    case kWaitDispatchData: return "low_latency_dispatch (receive)";
    case kWaitCombineRouting: return "low_latency_combine (routing)";
    case kWaitCombineData: return "low_latency_combine (receive)";
    default: return "low-latency (unknown phase)";
  }
}

// Workspace: int32 words in ordinary device memory of this GPU (not symmetric), zeroed once at
// creation; every counter is returned to 0 by the kernel that used it.
constexpr int kWsDispatchFinished = 0;                              // [E] messages written
constexpr int kWsCombineFinished = kWsDispatchFinished + kMaxExperts;  // [L*R] parts done
constexpr int kWsDispatchRecvDone = kWsCombineFinished + kMaxExperts;  // blocks done polling
constexpr int kWsCombineRecvDone = kWsDispatchRecvDone + 1;
constexpr int kWsCombineRoutingDone = kWsCombineRecvDone + 1;  // per-rank combine: blocks past the routing wait
// Set (atomicCAS 0 -> 1) by the first wait that times out, and never reset: later waits of any
// kernel of this backend give up at once (the Buffer is unusable after a timeout anyway).
constexpr int kWsTimeoutClaim = kWsCombineRoutingDone + 1;
// Set (atomicCAS 0 -> 1) by the first receive that finds a source's dispatch signature differing from this
// call's; its winner fills the SignatureRecord. Never reset by the kernels (the Buffer is unusable after it).
constexpr int kWsSignatureClaim = kWsTimeoutClaim + 1;
constexpr int kWorkspaceInts = kWsSignatureClaim + 1;

// ---- Dispatch agreement (docs/low_latency.md, "Agreement").
// The signature of a dispatch: the fields every rank must pass alike, packed exactly (no hash) into 64 bits,
// so that a receiver that records a source's word can name that source's values:
//   [0, 6) top-k (1..32)   6 use_fp8   7 round_scale   8 use_ue8m0   [9, 16) a 7-bit hash of (hidden,
//   num_max_dispatch_tokens_per_rank, num_experts)   [16, 24) hidden / 128 (1..128)   [24, 35) num_experts
//   (..1024)   [35, 52) num_max_dispatch_tokens_per_rank (..kMaxTokensPerRank).
// Never 0 (hidden >= 128). The runtime computes it once per (plan, FP8 flags) on the host.
// The word a call publishes and compares (DispatchArgs::signature) adds its generation in bits
// [kGenerationShift, 62): the call's index on its buffer half, ((call number - 1) >> 1) mod 2^kGenerationBits
// (the runtime numbers every dispatch and combine call from 1, and the halves alternate per call, so this is
// how many calls used this half before; ranks that call in lockstep, as they must, agree on it). A receiver
// takes a signature word of another generation as not yet arrived: a word of the call before on this half can
// still land after that call's reset (it is published with no ordering), and must not pass for this call's.
// Its low 16 bits, the tag, travel in every dispatch count word: (tag << 16) | (count + 1) (kCountBits). The
// tag holds top-k and the FP8 flags exactly, so a difference in those (which leaves the buffer layout alike and
// the count words where the receiver reads them) is always seen; a difference in the layout fields moves the
// sender's count words elsewhere, and the receiver learns it from the sender's full word in the signature
// words (below), which sit at one place whatever the layout.
constexpr int kCountBits = 16;
constexpr int kMaxTokensPerRank = (1 << kCountBits) - 2;  // count + 1 must fit kCountBits
constexpr unsigned kCountMask = (1u << kCountBits) - 1;
constexpr int kGenerationShift = 52;
constexpr int kGenerationBits = 10;  // bits 62 and 63 mark a SignatureRecord's `seen` (below)
inline uint64_t with_generation(uint64_t signature, uint64_t call) {
  return signature | (((call - 1) >> 1) & ((1ull << kGenerationBits) - 1)) << kGenerationShift;
}
inline uint64_t dispatch_signature(int hidden, int max_tokens, int num_experts, int num_topk, bool fp8,
                                   bool round_scale, bool ue8m0) {
  const uint64_t layout_hash = (static_cast<uint64_t>(hidden / 128) * 2654435761u +
                                static_cast<uint64_t>(num_experts) * 40503u + static_cast<uint64_t>(max_tokens)) %
                               127u;
  return static_cast<uint64_t>(num_topk) | (fp8 ? 1ull << 6 : 0) | (round_scale ? 1ull << 7 : 0) |
         (ue8m0 ? 1ull << 8 : 0) | layout_hash << 9 | static_cast<uint64_t>(hidden / 128) << 16 |
         static_cast<uint64_t>(num_experts) << 24 | static_cast<uint64_t>(max_tokens) << 35;
}

// The signature words: uint64 [2 halves][kMaxRanks] in this PE's symmetric allocation, after the abort bytes
// (kSignatureWordsOffset bytes after them; the allocation holds kControlBytes from the abort bytes on), so at
// the same place whatever (maxT, hidden, experts) a rank uses. Word [h][s]: the signature of source s's
// dispatch on half h, written by s's send phase at entry (block 0, one thread per destination), read by this
// PE's receive phase where a count word is late (the spin's slow path) or carried a foreign tag, and once per
// call after the count waits (common.cuh, check_signatures: the tag's 7-bit layout hash can collide), and
// put back to 0 with the count words by the last receiving block: the count words' lifetime exactly.
constexpr size_t kSignatureWordsOffset = 128;
constexpr size_t kControlBytes = kSignatureWordsOffset + 2 * kMaxRanks * sizeof(uint64_t);

// Host-mapped: the first receive that saw a foreign signature (status 0 -> 1 last, after a system fence,
// as TimeoutRecord). `seen` is the source's full signature word, or its count word's tag with kSeenTagOnly set
// when that word was not visible yet. `call` is the runtime's number of the launch that recorded it (a CUDA
// graph replay repeats the number of the call it captured).
struct SignatureRecord {
  int32_t status;
  int32_t source;
  uint64_t seen;
  uint64_t mine;
  uint64_t call;
};
constexpr uint64_t kSeenTagOnly = 1ull << 63;
// `seen` is the count word itself (low 32 bits): its tag was this call's but its count lay outside
// [0, max_tokens] (a stray store, or a layout whose tag collides with ours wrote there).
constexpr uint64_t kSeenBadCount = 1ull << 62;

// Opt-in phase trace (docs/low_latency.md, "Phase trace"). Common::trace null: off, and every trace
// point is one uniform branch on it. Otherwise it points at one record of kTraceWords uint64 words (the
// runtime keeps one per (kernel, buffer half), so the two calls of a graph replay do not overwrite
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
// -> exit. The per-rank combine (combine_rank_*.cuh) stamps routed (every source's routing seen) after
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
  bool dedup_dispatch;         // the dedup dispatch kernels (needs NVLink to every peer and L >= 2)
  bool per_rank_combine;       // the per-rank combine kernels (NVLink to every peer, L >= 2, rank_partials)
  uint64_t timeout_ns;         // a wait longer than this records itself in `timeout` and gives up
  TimeoutRecord* timeout;      // host-mapped: the first timed-out wait's (phase, rank, peer)
  const uint8_t* peer_aborts;  // this PE's abort bytes [kMaxAbortRanks] (timeout_record.h), after the two halves
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
  // Dispatch agreement (above; here, not in Common: a larger Common costs the combine kernel a spill):
  uint64_t signature;          // this call's dispatch_signature, with_generation
  uint64_t* signature_words;   // this PE's signature words [2][kMaxRanks] (the call's half: c.half_offset != 0)
  SignatureRecord* mismatch;   // host-mapped
  uint64_t call;               // the runtime's number of this call
};

struct CombineArgs {
  const void* x;               // bf16 [L, R*maxT, H]; null with zero_copy (rows in the send region)
  const int64_t* topk_idx;     // [T, K]
  const float* topk_weights;   // [T, K]
  const int* src_info;         // the dispatch handle's [L, R*maxT]
  const int* row_of;           // the dispatch handle's [L, R*maxT] (DispatchArgs::row_of); per-rank combine
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

}  // namespace moe_ep::low_latency
