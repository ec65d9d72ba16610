// How the intranode kernels move rows through the rings of channel.cuh (torch-free): every warp at its own
// pace, one publisher warp per block. (This replaced a lock-step protocol in which a warp group took `chunk`
// rows, copied them, met at a group barrier and waited for the leader's tail release before the next chunk.)
//
// The W warps that serve one ring take its rows round robin (warp w: rows w, w + W, ...), each at its
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
// unfinished row is done; the publisher publishes whenever at least `batch` <= slots / 2 rows are new (and
// all of them once the ring's warps have left), the receiver consumes published rows and releases them at
// once (batch 1), so the head always moves up to the smallest blocked row's slot.
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
};

// Every thread of the block, before a __syncthreads: warp w of every ring starts at row w.
__device__ __forceinline__ void board_init(StreamBoard& b) {
  for (int i = threadIdx.x; i < kMaxRanks * kBoardWarps; i += blockDim.x) {
    b.next[i / kBoardWarps][i % kBoardWarps] = i % kBoardWarps;
  }
  if (threadIdx.x < kMaxRanks) b.left[threadIdx.x] = 0;
}

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

// Every thread of a stream kernel's block (2c sends channel c, 2c + 1 receives it), at the start: the counter
// of `ring` as this side last published it (sender: the tail; receiver: the head), read before the barrier
// because the publisher rewrites the copies; then the board, and the barrier. 0 when ring >= num_ranks.
__device__ __forceinline__ uint64_t stream_block_start(const Control* ctl, StreamBoard& board, int c, int ring,
                                                       int num_ranks, bool sender) {
  uint64_t base = 0;
  if (ring < num_ranks) {
    base = *reinterpret_cast<const volatile uint64_t*>(sender ? &ctl->tail_copy[c][ring] : &ctl->head_copy[c][ring]);
  }
  board_init(board);
  __syncthreads();
  return base;
}

// Whole sender group of ring `ring` (the `threads` threads of named barrier 1 + ring): its first
// thread waits until peer `ring` has drained what an earlier call sent into this ring (channel.cuh,
// drain_previous: the slot layout may have changed since), then every thread of the group learns the outcome
// through `shared_ok`. No row of the group may be written before this returns true.
__device__ __forceinline__ bool sender_group_ready(const Control* ctl, int ring, bool first, int threads, int* shared_ok,
                                                   const Watchdog& dog) {
  if (first) {
    *shared_ok = drain_previous<kMaxChannels>(&ctl->fifo_head[0][0], &ctl->tail_copy[0][0], kMaxRanks, ring, dog,
                                              kPhaseDrain);
  }
  ptx::group_sync(1 + ring, threads);
  return *shared_ok != 0;
}

// Lane 0 of a sender warp: wait until ring row `row` (counter value) has a free slot, i.e. the receiver
// released row - slots (head: written by the receiver's publisher, st.release.sys after its warps' slot
// loads). `seen` caches the last head read (acquired, so older acquires still order this warp's later
// stores after the receiver's loads once the caller's __syncwarp extends them to every lane).
__device__ __forceinline__ bool wait_free_slot(const uint64_t* head, uint64_t& seen, uint64_t row, int slots,
                                               const Watchdog& dog, int phase, int peer) {
  return wait_cached(head, seen, [&](uint64_t h) { return row < h + static_cast<uint64_t>(slots); }, dog, phase, peer);
}

// Lane 0 of a receiver warp: wait until the tail passed ring row `row` (tail: written by the sender's
// publisher, st.release.sys after its warps' slot stores); `seen` caches the last tail read.
__device__ __forceinline__ bool wait_published(const uint64_t* tail, uint64_t& seen, uint64_t row,
                                               const Watchdog& dog, int phase, int peer) {
  return wait_cached(tail, seen, [&](uint64_t t) { return row < t; }, dog, phase, peer);
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
// when at least `batch` rows are new, or when all its `warps` copy warps have left. Returns, in lane p, the
// rows published: at the end the ring's row count (or, after a timeout, the rows finished before it).
__device__ __forceinline__ int publish_rings(const StreamBoard& b, int rings, int warps, int batch, uint64_t* word,
                                             uint64_t base, uint64_t* mirror, int lane) {
  int count = 0;
  while (true) {
    bool finished = true, moved = false;
    if (lane < rings) {
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
