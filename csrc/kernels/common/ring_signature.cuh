// Agreement of cached calls (torch-free; the intranode dispatch and combine kernels, and both hops of the
// internode ones: below the intranode protocol; internode carries one word per hop, written and compared by the
// roles docs/internode.md "Cached calls: ring signatures" lists, through the same helpers).
//
// A cached call (dispatch along a handle, combine) runs no notify, so nothing compares the ranks' arguments
// before rows move; yet the slot layout of a ring comes from the sender's arguments (row bytes, scales, top-k
// weights, slots) and the receiver reads the slots with its own. Each launch therefore carries its ring
// signature (Args::ring_signature: the word moe_dispatcher/signature.py packs with ring_signature_word; nonzero
// for cached calls, 0 for a fresh dispatch, whose notify compared the full signatures), and:
//   sender:   the warp that writes row 0 of a ring in this call first stores the word into
//             Control::ring_signature[me] of the receiver (publish_ring_signature; every channel's sender of
//             the call stores the same word), then the row. Its
//             __syncwarp + st.release.cta on the board, the publisher's ld.acquire.cta and st.release.sys of
//             the tail publish the word with row 0 (rings.cuh): a receiver that acquired a tail past row 0
//             of the call sees this call's word.
//   receiver: every receiver warp (combine: every lane d, for ring d), after its first tail acquire of the call
//             on a ring (tail > its row >= row 0 of the call), loads the word once and compares it with its own
//             (ring_disagrees). On a difference it records the pair in the mailbox (record_ring_mismatch) and
//             reads no slot of that ring in this call: dispatch writes zero rows instead, combine leaves the
//             source out of its sums. It still waits for every row and releases it, so both sides finish the
//             call and the counters stay in step: the next call starts from agreeing counters.
//   report:   Control::ring_mismatch_seen makes this rank's next notify send kProblemRingSignature, so every
//             rank refuses that fresh dispatch and raises SignatureMismatch alike at its host wait (or, for a
//             call that does not wait, at the next synchronised dispatch); the host names the fields from the
//             mailbox pairs of every rank (one all-gather). No rank raises alone, so no peer waits for it.
// Why the word read is this call's: every sender block stores it only after drain_previous, which waits until
// the receiver's head passed the final tail (tail_copy; the previous call's kernels on this rank have ended, as
// drain_previous assumes anyway) of every channel's ring to that receiver. So (a) each store of an earlier call
// happens before it (that store preceded its ring's tail release, the receiver acquired that tail before it
// released the head the drain acquires), and, the stores being morally strong (volatile: relaxed, system scope),
// precedes it in coherence order; (b) each read of an earlier call happens before it (the receiver's warps read
// the word before they finish a row, and every head release follows the finish of the rows it releases), so it
// cannot see it. A receiver that acquired a tail past row 0 of its call therefore reads a store of this call
// (coherence-after every earlier one), and every store of one call carries the same value, whichever channel
// made it and when. A ring that carries no row in a call neither writes nor reads the word: its receiver
// reads no slot, so nothing can be misread there (and no disagreement is found on it).
#pragma once

#include <cstdint>

#include "kernels/common/nvlink_buffer.h"

namespace moe_ep {

// The warp of row 0 of a ring (one lane): the call's word into the receiver's Control (remote, plain store),
// before the row's slot stores and the board advance that orders both before the tail release.
__device__ __forceinline__ void publish_ring_signature(nvlink::Control* receiver, int me, uint64_t word) {
  *reinterpret_cast<volatile uint64_t*>(&receiver->ring_signature[me]) = word;
}

// The record of a disagreement found on a ring from `source` (a rank of the group: the mailbox keeps
// kMaxGroupRanks pairs, so internode receivers record either hop's source by its group rank): in the mailbox, the
// first pair per source stays (every warp of one call writes the same pair), then the flag, after a system fence
// (the host reads the pairs after a notify wait, which follows this kernel); in this rank's Control, the word its
// next notify reads.
__device__ __forceinline__ void record_ring_mismatch(nvlink::Control* ctl, nvlink::Mailbox* box, int source,
                                                     uint64_t sent, uint64_t expected) {
  volatile nvlink::Mailbox* v = box;
  if (v->ring_mismatch_sent[source] == 0) {
    v->ring_mismatch_expected[source] = static_cast<int64_t>(expected);
    v->ring_mismatch_sent[source] = static_cast<int64_t>(sent);
  }
  __threadfence_system();
  v->ring_mismatch = 1;
  *reinterpret_cast<volatile int32_t*>(&ctl->ring_mismatch_seen) = 1;
}

// A receiver thread, after its first tail acquire of the call on a ring whose sender stored its word at `word`
// (its own ld.acquire.sys, or another lane's followed by a __syncwarp): whether that word differs from `mine`;
// records a difference under `source` when `record` (one thread per warp suffices: all read the same word).
__device__ __forceinline__ bool ring_word_disagrees(const uint64_t* word, nvlink::Control* ctl, nvlink::Mailbox* box,
                                                    int source, uint64_t mine, bool record) {
  const uint64_t sent = *reinterpret_cast<const volatile uint64_t*>(word);
  if (sent == mine) return false;
  if (record) record_ring_mismatch(ctl, box, source, sent, mine);
  return true;
}

// The same for a ring of the NVLink domain from local rank `source` (its word in this rank's Control).
__device__ __forceinline__ bool ring_disagrees(nvlink::Control* ctl, nvlink::Mailbox* box, int source,
                                               uint64_t mine, bool record) {
  return ring_word_disagrees(&ctl->ring_signature[source], ctl, box, source, mine, record);
}

}  // namespace moe_ep
