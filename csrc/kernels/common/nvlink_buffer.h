// The NVLink buffer of every rank (CUDA IPC, intranode::IpcBuffer) and its host-mapped mailbox: the layout
// shared by the intranode kernels (the whole domain is the group) and the internode kernels' NVLink hop (the
// buffer is opened over one domain; internode's own messages follow the Control words). Plain C++ (no device
// code, no torch): included by the kernels, the runtime and the bindings. docs/intranode.md describes it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/timeout_record.h"

namespace moe_ep::nvlink {

constexpr int kMaxRanks = 8;
constexpr int kMaxGroupRanks = 64;  // ranks of a group the internode kernels serve (internode/protocol.h)
constexpr int kMaxChannels = 32;        // num_sms <= 64
constexpr int kMaxLocalExperts = 1024;  // experts per rank
constexpr int kMaxTopk = 16;
constexpr int kMaxChunk = 32;           // num_max_nvl_chunked_send_tokens

// One source's notify message, in the receiver's buffer (int32 words).
constexpr int kNotifyFlags = 0;                               // bit 0: the source's num_tokens_per_rank mismatched
constexpr int kNotifyCounts = 1;                              // [R] rows the source sends to each rank
constexpr int kNotifyChannels = kNotifyCounts + kMaxRanks;    // [C] inclusive prefix over channels of rows to me
constexpr int kNotifyExperts = kNotifyChannels + kMaxChannels;  // [L] the source's count for each of my experts
constexpr int kNotifyStride = (kNotifyExperts + kMaxLocalExperts + 15) / 16 * 16;
// The source's call signature (moe_dispatcher/signature.py), in the message's spare words after the expert
// counts: a 32-bit hash of the words every rank must pass alike, and the source's problem word (a local
// problem of its inputs, 0 for none). Every rank reads every source's pair, so all reach the same verdict.
constexpr int kNotifySignatureHash = kNotifyExperts + kMaxLocalExperts;
constexpr int kNotifySignatureProblem = kNotifySignatureHash + 1;
static_assert(kNotifySignatureProblem < kNotifyStride, "the signature words fit the message's spare words");

// The words of one direct call protocol (intranode/direct_call.cuh, which describes the protocol): a direct
// dispatch (Blocks = DirectOutputBlocks) or a pull combine (PullInputBlocks), whose kernels write straight into,
// or read straight from, blocks of the peers' NVLink buffers. Two sets in Control; [d] below: the word rank d
// writes into my buffer (into every peer's), or that my block 0 keeps about d.
template <typename Blocks>
struct DirectCallWords {
  uint64_t ready[kMaxRanks];     // [d]: the number of d's latest call; written by d's block 0 at its kernel's start
                                 // (st.release.sys), read by my blocks (ld.acquire.sys) before they use d's blocks
  Blocks blocks[kMaxRanks];      // [d]: where d's blocks of that call lie in d's buffer, and
  uint64_t layout[kMaxRanks];    // [d]: that call's layout word: plain stores by d before its ready store, which
                                 // publishes them
  uint64_t arrivals[kMaxRanks];  // [d]: blocks of d past their use of my blocks in this call; added by d
                                 // (red.release.sys), read and reset by my block 0
  uint64_t calls;                // my calls so far; read by my blocks at start, written by my block 0 at the end,
                                 // after every block of mine has read it
  uint64_t missed;               // my latest call that was missed (some rank's blocks not peer-mapped, or layouts
                                 // differ); written by my block 0 before calls; read by the ring kernel queued next
  uint64_t missed_total;         // how many of my calls were missed (tests, the bench); written beside missed
};
// What a direct dispatch's rank publishes: its output blocks for the call (protocol.h, DirectPayload /
// DirectMeta; offsets in its buffer, -1: not peer-mapped) and their rows.
struct DirectOutputBlocks {
  int64_t out_offset;
  int64_t meta_offset;
  int64_t out_rows;
};
// What a pull combine's rank publishes: where its combine input x and its top-k weights lie in its buffer (-1:
// not peer-mapped).
struct PullInputBlocks {
  int64_t x_offset;
  int64_t w_offset;
};

// Control words at the start of every rank's NVLink buffer; the rings follow at kRingsOffset.
// Writers/readers and scopes (channel.cuh describes the FIFO words):
struct Control {
  uint64_t barrier_signal[kMaxRanks];  // [s]: epoch of rank s's latest barrier; written by s (st.release.sys), read here (ld.acquire.sys)
  uint64_t barrier_epoch;              // this rank's barrier count; notify's thread 0 only
  int32_t timeout_claim;               // first timed-out thread of this rank (atomicCAS, gpu scope)
  int32_t bad_expert_ids;              // kBadId* bits ORed in by this rank's layout kernels; this rank's next
                                       // notify reads and clears it (same stream: kernel boundaries order it)
  uint64_t fifo_tail[kMaxChannels][kMaxRanks];   // [c][s]: rows s published into my ring (c, s)
  uint64_t fifo_head[kMaxChannels][kMaxRanks];   // [c][d]: rows d consumed from its ring (c, me)
  uint64_t tail_copy[kMaxChannels][kMaxRanks];   // [c][d]: rows I published into d's ring (c, me)
  uint64_t head_copy[kMaxChannels][kMaxRanks];   // [c][s]: rows I consumed from my ring (c, s)
  int32_t notify[2][kMaxRanks][kNotifyStride];   // [epoch parity][source]: notify messages, plain stores
                                                 // published by the barrier's release
  // [s]: the ring signature of the cached call (dispatch along a handle, combine) whose rows source s is sending
  // into my rings: the 64-bit word moe_dispatcher/signature.py packs (ring_signature_word), which fixes the
  // slot layout. Written by s's sender warp of row 0 of each of its rings to me (a plain store over NVLink, the
  // same value from every channel of one call) before that row's slot stores, so the tail release that
  // publishes row 0 publishes it too; read by my receiver warps after their first tail acquire of the call
  // (common/ring_signature.cuh). One word per source, not per ring: it fits the Control block's spare bytes
  // (kRingsOffset, which moe_dispatcher/config.py repeats, is unchanged).
  uint64_t ring_signature[kMaxRanks];
  // Set (1) by this rank's receivers when they found a source's ring signature differing (with the mailbox
  // record); this rank's next notify reads and clears it (atomicExch; the CommStream's events order it after
  // the kernels that set it) and sends kProblemRingSignature as its problem word, so every rank refuses that
  // fresh dispatch and raises SignatureMismatch at its host wait.
  int32_t ring_mismatch_seen;
  // [p]: peer p raised in a Buffer call (1) or came back (0); written by p's host (runtime/peer_abort.h, a
  // 1-byte copy over NVLink), read by this rank's Watchdog (wait.cuh) when it looks, every ~10 ms of a wait.
  // Last, so that no word above moves (the FIFO words keep their offsets and cache lines). Intranode only: the
  // internode kernels use RdmaControl's, which every rank of the group writes.
  alignas(8) uint8_t peer_aborted[kMaxAbortRanks];
  // Direct dispatch (intranode/dispatch_direct.cu) and pull combine (intranode/combine_pull.cu), after every word
  // above so that none of them moves: one set of direct-call words each (DirectCallWords above).
  DirectCallWords<DirectOutputBlocks> direct;
  DirectCallWords<PullInputBlocks> pull;
};
constexpr size_t kRingsOffset = (sizeof(Control) + 4095) / 4096 * 4096;
static_assert(kRingsOffset == 77824, "Control outgrew its pages: moe_dispatcher/config.py's NVL_CONTROL_BYTES and "
                                     "every Buffer size hint would move");

// Host-mapped mailbox (cudaHostAlloc mapped): notify's results for the host's only synchronisation.
struct Mailbox {
  TimeoutRecord timeout;
  int32_t seq;        // written last (after a system fence) by notify: the host-chosen call number
  int32_t num_recv;   // rows this rank receives
  int32_t flags;      // bit 0: some rank's num_tokens_per_rank mismatched is_token_in_rank
  // Sticky, set by every rank alike when some rank received more rows than num_worst_tokens (its extra
  // rows were dropped); the host reports and clears it at its next synchronised dispatch.
  int32_t overflow_rank, overflow_rows, overflow_worst;
  int32_t num_forward;  // internode notify only: rows this rank forwards as the team's forwarder (else 0)
  // Sticky, set by every rank alike (intranode notify) when the sources' signatures differ or one reports a
  // problem: the seq of the first such call; the host reports and clears it at its next synchronised dispatch.
  int32_t signature_mismatch;
  int32_t expert_counts[kMaxLocalExperts];  // per local expert, rounded up to expert_alignment
  // Each source rank's problem word in call signature_mismatch: every rank of the group (internode notify
  // records the whole group's, up to kMaxGroupRanks; intranode the domain's).
  int32_t signature_problems[kMaxGroupRanks];
  // Sticky, set by this rank's receivers when a cached call's sender wrote another ring signature than this
  // rank's (Control::ring_signature; internode also RdmaControl::ring_signature): per source s (its rank in the
  // group: intranode a local rank, internode a group rank of either hop), the first such pair (the source's
  // word, this rank's word; 0: none), then ring_mismatch = 1 after a system fence. The host takes the pairs when
  // the next fresh dispatch reports the disagreement (kProblemRingSignature), to name the fields.
  int64_t ring_mismatch_sent[kMaxGroupRanks];
  int64_t ring_mismatch_expected[kMaxGroupRanks];
  int32_t ring_mismatch;
};
constexpr int32_t kFlagLayoutMismatch = 1;
constexpr int32_t kFlagSignatureMismatch = 2;  // this call's sources disagree (also recorded in signature_mismatch)
// recv_channel_offset[0][0] of a call that notify refused (its sources disagree, or its notify gave up): every
// other word of the call's tables is 0, as for a call that received nothing. An accepted call has 0 there (the
// first row of source 0's channel 0). The data kernels read it first and move nothing (common/refused_call.cuh).
constexpr int32_t kRefusedCall = -1;
// Bits of the layout kernel's bad-id word (common/layout.h), turned into problem words by notify.
constexpr int32_t kBadIdOutOfRange = 1;
constexpr int32_t kBadIdRepeated = 2;
// Problem words notify makes of them (the codes of moe_dispatcher/signature.py's PROBLEMS).
constexpr int32_t kProblemIdOutOfRange = 4;
constexpr int32_t kProblemIdRepeated = 5;
// The problem word notify sends when this rank's receivers found a disagreeing ring signature in a cached call
// since its last notify (Control::ring_mismatch_seen).
constexpr int32_t kProblemRingSignature = 6;

}  // namespace moe_ep::nvlink
