// The "stream" protocol of the intranode rings (MOE_DISPATCHER_NVL_VARIANT=stream; torch-free). Same rings,
// slots and counters as the chunked protocol of channel.cuh, so calls of either protocol may follow each
// other on one Buffer (a dispatch of one and a combine of the other included).
//
// Chunked (channel.cuh): a group of warps takes `chunk` rows, every warp copies its share, a group barrier,
// then the leader's st.release.sys of the tail; the next chunk starts after that release. Every chunk ends
// with the group idle: waiting for its slowest warp, for the system-scope fence (a round trip over NVLink),
// and for the scan of the next chunk's tokens.
//
// Stream: the W warps that serve one ring take its rows round robin (warp w: rows w, w + W, ...), each at its
// own pace. A sender warp waits (lane 0, ld.acquire.sys of the head, cached) only for the slot of its own next
// row; a receiver warp waits only until the tail passes its own next row. After a row the warp stores the
// index of its next row in a shared board (__syncwarp, then st.release.cta). One more warp per block, the
// publisher, owns the system-scope counters: lane p takes the smallest board entry of ring p -- every row
// below it is done, since a warp raises its entry only after its row -- and stores base + that count to the
// ring's remote counter with st.release.sys (sender block: the tail in the receiver's buffer; receiver block:
// the head in the sender's buffer). Ordering: a warp's slot stores (or loads) -> __syncwarp -> its
// st.release.cta -> the publisher's ld.acquire.cta -> the publisher's st.release.sys; causality order is
// transitive, so a peer that acquires the counter sees the rows (tail) or may overwrite the slots (head).
// Only the publisher pays the system-scope fence, and no copy warp waits for it.
//
// Progress: a sender warp blocked on ring row i needs head > i - slots. Every row below the smallest
// unfinished row is done; the sender's publisher publishes whenever at least `batch` <= slots / 2 rows are
// new (and all of them once the ring's warps have left), so the tail is past i - slots / 2; the receiver
// consumes published rows and releases them once at least release_batch <= slots / 2 of them are new (1 by
// default), so the head is past i - slots: the slot of the smallest blocked row always gets freed.
//
// Knobs (StreamTuning in protocol.h, suffixes of MOE_DISPATCHER_NVL_VARIANT): how many copy warps serve each
// ring and which (RingWarps), the receivers' release batch, the block roles (halves), and shared_poll: a
// waiting copy warp polls no system-scope word itself; the block's extra warp (publisher, or the combine
// receiver's release warp) acquires each ring's incoming counter (sender: head; receiver: tail) on every
// round and releases it to a shared-memory copy (StreamBoard::incoming) that the copy warps acquire at CTA
// scope. Ordering: the peer's release -> the extra warp's ld.acquire.sys -> its st.release.cta -> the copy
// warp's ld.acquire.cta -> __syncwarp -> every lane's slot accesses (causality order is transitive). One
// poller per block instead of up to 24 per block hammering the same few control lines in L2.
#pragma once

#include <climits>
#include <cstdint>

#include "kernels/common/channel.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/intranode/protocol.h"

namespace moe_dispatcher::intranode {

constexpr int kBoardWarps = kWarps;  // copy warps of one ring at most

// Shared by the copy warps and the publisher of one block.
struct StreamBoard {
  int next[kMaxRanks][kBoardWarps];  // [ring][warp]: the warp's next row; its rows below it are done
  int left[kMaxRanks];               // warps of the ring that left their loop (their `next` is final)
  uint64_t incoming[kMaxRanks];      // shared_poll: the latest value of each ring's incoming counter (sender
                                     // block: its head; receiver block: its tail), acquired by the extra warp
};

// Every thread of the block, before a __syncthreads: warp w of every ring starts at row w.
__device__ __forceinline__ void board_init(StreamBoard& b) {
  for (int i = threadIdx.x; i < kMaxRanks * kBoardWarps; i += blockDim.x) {
    b.next[i / kBoardWarps][i % kBoardWarps] = i % kBoardWarps;
  }
  if (threadIdx.x < kMaxRanks) {
    b.left[threadIdx.x] = 0;
    b.incoming[threadIdx.x] = 0;
  }
}

// Which ring copy warp `warp` (of `total`) serves among `rings`, as its warp `gw` of `warps`. Even (default):
// per = total / rings warps each (at most tune.ring_warps when set), ring = warp / per, the rest idle (ring >=
// rings). Spread: warp w serves ring w % rings, so every warp works and the first total % rings rings get one
// warp more. warps_of(r) is the same count for ring r (the publisher's lanes).
struct RingWarps {
  int total, rings;
  StreamTuning tune;
  __device__ int even() const {
    const int per = total / rings;
    return tune.ring_warps > 0 ? min(per, tune.ring_warps) : per;
  }
  __device__ int ring_of(int warp) const { return tune.spread ? warp % rings : warp / even(); }
  __device__ int gw_of(int warp) const { return tune.spread ? warp / rings : warp % even(); }
  __device__ int warps_of(int r) const { return tune.spread ? (total - r + rings - 1) / rings : even(); }
};

// Whole copy warp, after the loads/stores of a row: the warp's next row is `next`.
__device__ __forceinline__ void board_advance(StreamBoard& b, int ring, int warp, int next, int lane) {
  __syncwarp();
  if (lane == 0) ptx::st_release_cta(&b.next[ring][warp], next);
}

// Whole copy warp, leaving: `next` >= 0 is its final entry (the first of its rows past the ring's last row,
// so the smallest final entry of the ring is its row count); -1 (a timeout) keeps the entry, so nothing
// the warp did not finish is ever published.
__device__ __forceinline__ void board_leave(StreamBoard& b, int ring, int warp, int next, int lane) {
  __syncwarp();
  if (lane == 0) {
    if (next >= 0) ptx::st_release_cta(&b.next[ring][warp], next);
    ptx::red_add_release_cta(&b.left[ring], 1);
  }
}

// A ring's incoming counter as a waiting lane reads it: ld.acquire.sys of the word itself, or (shared_poll)
// ld.acquire.cta of the block's copy, which the extra warp acquired at system scope before its release, so
// the chain orders the peer's accesses before this lane's just the same.
__device__ __forceinline__ uint64_t read_incoming(const uint64_t* word, const uint64_t* copy) {
  return copy != nullptr ? ptx::ld_acquire_cta(copy) : ptx::ld_acquire_sys(word);
}

// Lane 0 of a sender warp: wait until ring row `row` (counter value) has a free slot, i.e. the receiver
// released row - slots. `seen` caches the last head read (acquired, so older acquires still order this
// warp's later stores after the receiver's loads once the caller's __syncwarp extends them to every lane).
// copy: the block's copy of the head (shared_poll) or null.
__device__ __forceinline__ bool wait_free_slot(const uint64_t* head, const uint64_t* copy, uint64_t& seen,
                                               uint64_t row, int slots, const Watchdog& dog, int phase, int peer) {
  while (row >= seen + static_cast<uint64_t>(slots)) {
    seen = read_incoming(head, copy);
    if (row < seen + static_cast<uint64_t>(slots)) break;
    if (dog.expired(phase, peer)) return false;
  }
  return true;
}

// Lane 0 of a receiver warp: wait until the tail passed ring row `row`; `seen` caches the last tail read.
__device__ __forceinline__ bool wait_published(const uint64_t* tail, const uint64_t* copy, uint64_t& seen,
                                               uint64_t row, const Watchdog& dog, int phase, int peer) {
  while (row >= seen) {
    seen = read_incoming(tail, copy);
    if (row < seen) break;
    if (dog.expired(phase, peer)) return false;
  }
  return true;
}

// The extra warp's part of shared_poll, lane p < rings: acquire ring p's incoming counter `word` and, when it
// moved past `last`, release it to the block's copy. Returns whether it moved.
__device__ __forceinline__ bool poll_incoming(const uint64_t* word, uint64_t* copy, uint64_t& last) {
  const uint64_t v = ptx::ld_acquire_sys(word);
  if (v == last) return false;
  last = v;
  ptx::st_release_cta(copy, v);
  return true;
}

// Whole warp: lane 0's wait outcome in every lane, then a warp barrier that orders lane 0's acquire
// before every lane's accesses to the slot.
__device__ __forceinline__ bool warp_outcome(bool ok_in_lane0) {
  const int ok = __shfl_sync(0xffffffffu, ok_in_lane0 ? 1 : 0, 0);
  __syncwarp();
  return ok != 0;
}

// The publisher warp. Lane p < rings owns ring p: `word` is its remote counter, `base` the counter's value
// at kernel start, `mirror` (or null) a local word that gets every published value. Ring p is published
// when at least `batch` rows are new, or when all its `warps` copy warps have left (`warps`: lane p's ring's).
// `incoming` (shared_poll, else null): ring p's incoming counter, polled into b.incoming[p] on every round.
// Returns, in lane p, the rows published: at the end the ring's row count (or, after a timeout, the rows
// finished before it).
__device__ __forceinline__ int publish_rings(StreamBoard& b, int rings, int warps, int batch, uint64_t* word,
                                             uint64_t base, uint64_t* mirror, const uint64_t* incoming, int lane) {
  int count = 0;
  uint64_t polled = 0;
  while (true) {
    bool finished = true, moved = false;
    if (lane < rings) {
      if (incoming != nullptr) moved = poll_incoming(incoming, &b.incoming[lane], polled);
      // `left` first: when every warp has left, the entries read after it are final.
      const bool all_left = ptx::ld_acquire_cta(&b.left[lane]) == warps;
      int k = INT_MAX;
      for (int w = 0; w < warps; ++w) k = min(k, ptx::ld_acquire_cta(&b.next[lane][w]));
      if (k > count && (all_left || k - count >= batch)) {
        ptx::st_release_sys(word, base + static_cast<uint64_t>(k));
        if (mirror != nullptr) *reinterpret_cast<volatile uint64_t*>(mirror) = base + static_cast<uint64_t>(k);
        count = k;
        moved = true;
      }
      finished = all_left;
    }
    if (__all_sync(0xffffffffu, finished)) break;
    if (!__any_sync(0xffffffffu, moved)) __nanosleep(64);
  }
  return count;
}

}  // namespace moe_dispatcher::intranode
