// How the intranode kernels drive the rings of channel.cuh (torch-free): every copy warp at its own pace, one
// publisher warp per block (progress_board.cuh).
//
// The W warps that serve one ring take its rows round robin (warp w: rows w, w + W, ...), each at its
// own pace. A sender warp waits (lane 0, wait.cuh: ld.acquire.sys of the head, cached) only for the slot of
// its own next row; a receiver warp waits only until the tail passes its own next row. After a row the warp
// raises its entry of the block's RingBoard. The publisher warp owns the system-scope counters: lane p
// publishes ring p's count of finished rows (publish_in_order) to the ring's remote counter with
// st.release.sys (sender block: the tail in the receiver's buffer; receiver block: the head in the sender's
// buffer). Ordering: a warp's slot stores (or loads) -> __syncwarp -> its st.release.cta -> the publisher's
// ld.acquire.cta -> the publisher's st.release.sys; causality order is transitive, so a peer that acquires
// the counter sees the rows (tail) or may overwrite the slots (head). Only the publisher pays the
// system-scope fence, and no copy warp waits for it.
//
// Progress: a sender warp blocked on ring row i needs head > i - slots. Every row below the smallest
// unfinished row is done; the publisher publishes whenever at least `batch` <= slots / 2 rows are new (and
// all of them once the ring's warps have left), the receiver consumes published rows and releases them at
// once (batch 1), so the head always moves up to the smallest blocked row's slot.
#pragma once

#include <cstdint>

#include "kernels/common/channel.cuh"
#include "kernels/common/progress_board.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/intranode/protocol.h"

namespace moe_ep::intranode {

constexpr int kBoardWarps = kWarps;  // copy warps of one ring at most

// Shared by the copy warps and the publisher of one block: stream = ring (the combine receiver: stream 0,
// its channel's tokens).
using RingBoard = ProgressBoard<kMaxRanks, kBoardWarps>;

// Every thread of a dispatch / combine block (2c sends channel c, 2c + 1 receives it), at the start: the counter
// of `ring` as this side last published it (sender: the tail; receiver: the head), read before the barrier
// because the publisher rewrites the copies; then the board, and the barrier. 0 when ring >= num_ranks.
__device__ __forceinline__ uint64_t ring_block_start(const Control* ctl, RingBoard& board, int c, int ring,
                                                     int num_ranks, bool sender) {
  uint64_t base = 0;
  if (ring < num_ranks) {
    base = *reinterpret_cast<const volatile uint64_t*>(sender ? &ctl->tail_copy[c][ring] : &ctl->head_copy[c][ring]);
  }
  board.init();
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
  return wait_cached(head, seen, [&](uint64_t h) { return row >= h + static_cast<uint64_t>(slots); }, dog, phase, peer);
}

// Lane 0 of a receiver warp: wait until the tail passed ring row `row` (tail: written by the sender's
// publisher, st.release.sys after its warps' slot stores); `seen` caches the last tail read.
__device__ __forceinline__ bool wait_published(const uint64_t* tail, uint64_t& seen, uint64_t row,
                                               const Watchdog& dog, int phase, int peer) {
  return wait_cached(tail, seen, [&](uint64_t t) { return row >= t; }, dog, phase, peer);
}

// Whole warp: lane 0's wait outcome in every lane, then a warp barrier that orders lane 0's acquire
// before every lane's accesses to the slot.
__device__ __forceinline__ bool warp_outcome(bool ok_in_lane0) {
  const int ok = __shfl_sync(0xffffffffu, ok_in_lane0 ? 1 : 0, 0);
  __syncwarp();
  return ok != 0;
}

}  // namespace moe_ep::intranode
