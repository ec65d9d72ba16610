// The per-call protocol of the kernels that use the peers' NVLink buffers in place (the direct call): the direct
// dispatch (dispatch_direct.cu) writes its rows straight into the receivers' output blocks, the pull combine
// (combine_pull.cu) reads its tokens' rows straight from the holders' input blocks; the internode dispatch
// (internode/dispatch.cu) runs it over its NVLink domain (Common of the domain: rank = local index). Each runs it on its own set of
// words (Control::direct, Control::pull: common/nvlink_buffer.h, DirectCallWords) with its own published blocks
// (Blocks: DirectOutputBlocks, PullInputBlocks) and timeout phases, which its DirectCallSite names. The kernel's
// own work (its use of the peers' blocks) lies between begin_direct_call and end_direct_call, which every thread
// of every block calls.
//
// Protocol, per call n (n = my words.calls + 1; every rank makes the same calls of a kind in the same order, so
// n is the same on every rank):
//  0. Start (begin): a rank whose Buffer already failed (the watchdog's sticky claim word set by an earlier call's
//     timeout or an honoured abort) returns from every block at once, publishing nothing (below).
//  1. Ready (begin): my block 0 stores my blocks of call n and the call's layout word into every peer's
//     words.blocks[me] / words.layout[me] (plain stores), then n into its words.ready[me] (st.release.sys: it
//     publishes the stores before it). My kernel of call n starts after everything my stream queued before it, so
//     my blocks are free (a block the peers write: whatever used its memory before is done, as the pool's caching
//     allocator hands a block back to its stream only in stream order) or complete (a block the peers read).
//  2. Verdict (begin): threads 0..R-1 of every block acquire every rank's words.ready (>= n, the watchdog's wait
//     under the site's ready phase) and read its blocks and layout word (after the acquire in program order);
//     the block barrier hands them to the block (DirectCallState, shared memory). Every rank's blocks peer-mapped
//     (the kernel's `accepts`) and every layout word equal to mine: in_pool, the kernel uses the peers' blocks.
//     Else the call is missed: nobody touches a peer's blocks, and the ring kernel queued next on every rank moves
//     the call (its ring signature check reports a layout that differs). The same words reach every block of
//     every rank, so the verdict is the same everywhere. A wait that timed out (recorded) leaves ready = 0: the
//     kernel returns at once and the call fails (no arrival anywhere: the peers time out too).
//  3. Arrival (end): every thread of the block fences at system scope (__threadfence_system: its stores before any
//     later store of it, its loads done, at system scope), the block barrier collects the threads, then thread d
//     adds 1 to d's words.arrivals[me] (red.release.sys, cumulative over the barrier), also in a missed call: the
//     arrival says the block is past its use of d's blocks and its reads of call n's words.
//  4. Completion (end): my block 0 (thread s) waits with ld.acquire.sys until words.arrivals[s] reaches gridDim.x
//     (every rank launches the same grid), under the site's arrive phase, which orders every rank's use of MY
//     blocks (their rows written into them, their reads of them) before the end of my kernel, hence before any
//     later work of my stream. Then it resets words.arrivals[s] to 0: no block of s adds to it again before s sees
//     my words.ready of call n + 1, which my next kernel stores only after this one ended. Last, thread 0 marks a
//     missed call (words.missed = n, words.missed_total + 1) and stores n into words.calls: every block of mine
//     read words.calls before arriving at me (step 3), and block 0 saw all of my arrivals, so no block of this
//     call reads the new value. The words of call n are not overwritten before every rank read them: a rank reads
//     them before it arrives, and my next kernel starts after this one saw every arrival. A timeout (recorded)
//     leaves the counters as they are: the call fails.
// A call that notify refused (common/refused_call.cuh) runs none of this: every block returns before
// begin_direct_call, touching no word, so the next call starts from the same counters on every rank.
#pragma once

#include <cstdint>

#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/intranode/protocol.h"

namespace moe_ep::intranode {

// Which protocol a kernel runs: its set of words and the phases its timeouts name (one value per kernel, passed to
// both begin_direct_call and end_direct_call).
template <typename Blocks>
struct DirectCallSite {
  DirectCallWords<Blocks> Control::*words;  // &Control::direct or &Control::pull
  int ready_phase;                          // step 2's wait for a rank's ready word
  int arrive_phase;                         // step 4's wait for a rank's arrivals
  int first_rank = 0;                       // a timeout names peer d as rank first_rank + d (the internode kernels
                                            // run the protocol over one NVLink domain: its first group rank)
};

// What begin_direct_call hands to its block: a __shared__ variable of the kernel's, read after begin returns.
template <typename Blocks>
struct DirectCallState {
  uint64_t n;                // this call's number
  int ready;                 // 0: a wait for a ready word timed out (recorded): return at once
  int in_pool;               // the verdict: 1 the kernel uses the peers' blocks, 0 the call is missed
  int all_arrived;           // block 0, step 4: 0 when a wait for arrivals timed out
  Blocks blocks[kMaxRanks];  // [d]: rank d's published blocks of call n
};

// The site's set of words in rank d's buffer.
template <typename Blocks>
__device__ __forceinline__ DirectCallWords<Blocks>& direct_call_words(const Common& c, int d,
                                                                      const DirectCallSite<Blocks>& site) {
  return reinterpret_cast<Control*>(c.peers[d])->*site.words;
}

// Steps 1 and 2, by every thread of the block: publish my blocks `mine` and my `layout` word (block 0), then
// every rank's blocks and the verdict into `call`; `accepts(blocks)`: rank d's blocks are peer-mapped. Returns
// call.ready (false: a timeout, the kernel returns).
template <typename Blocks, typename Accepts>
__device__ __forceinline__ bool begin_direct_call(DirectCallState<Blocks>& call, const Common& c,
                                                  const DirectCallSite<Blocks>& site, const Blocks& mine,
                                                  uint64_t layout, const Watchdog& dog, Accepts accepts) {
  static_assert(sizeof(Blocks) % sizeof(int64_t) == 0 && alignof(Blocks) == alignof(int64_t),
                "a Blocks struct is int64 words");
  constexpr int kBlockWords = sizeof(Blocks) / sizeof(int64_t);
  const int num_ranks = c.num_ranks, me = c.rank;
  DirectCallWords<Blocks>& own = direct_call_words(c, me, site);
  if (threadIdx.x == 0) {
    call.n = *reinterpret_cast<volatile uint64_t*>(&own.calls) + 1;
    call.ready = call.in_pool = call.all_arrived = 1;
    // 0. A rank whose earlier call timed out or honoured an abort (its sticky claim word) publishes nothing: that
    // call left words.calls as it was, so this one would publish new blocks under the same number n, where a peer
    // still late with the failed call could find them and write into memory handed out since. Every block
    // returns; the host raises at its next check, and the peers time out or see the abort.
    if (*reinterpret_cast<const volatile int32_t*>(dog.claim) != 0) call.ready = 0;
  }
  __syncthreads();
  if (!call.ready) return false;
  const uint64_t n = call.n;
  if (blockIdx.x == 0 && threadIdx.x < num_ranks) {  // 1. my blocks of call n, then ready for call n
    DirectCallWords<Blocks>& peer = direct_call_words(c, threadIdx.x, site);
    peer.blocks[me] = mine;
    peer.layout[me] = layout;
    ptx::st_release_sys(&peer.ready[me], n);
  }
  if (threadIdx.x < num_ranks) {  // 2. every rank's words of call n, and the verdict
    const int d = threadIdx.x;
    if (wait_at_least(&own.ready[d], n, dog, site.ready_phase, site.first_rank + d)) {
      Blocks theirs;
#pragma unroll
      for (int i = 0; i < kBlockWords; ++i) {
        reinterpret_cast<int64_t*>(&theirs)[i] = reinterpret_cast<const volatile int64_t*>(&own.blocks[d])[i];
      }
      const uint64_t their_layout = *reinterpret_cast<const volatile uint64_t*>(&own.layout[d]);
      call.blocks[d] = theirs;
      if (!accepts(theirs) || their_layout != layout) call.in_pool = 0;
    } else {
      call.ready = 0;
    }
  }
  __syncthreads();
  return call.ready;
}

// Steps 3 and 4, by every thread of the block, after its last use of the peers' blocks: arrive at every rank, then
// (block 0) wait for every rank's arrivals and close the call.
template <typename Blocks>
__device__ __forceinline__ void end_direct_call(DirectCallState<Blocks>& call, const Common& c,
                                                const DirectCallSite<Blocks>& site, const Watchdog& dog) {
  const int num_ranks = c.num_ranks;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < num_ranks) {  // 3. arrival: release at system scope, cumulative over the barrier
    uint64_t* arrivals = &direct_call_words(c, threadIdx.x, site).arrivals[c.rank];
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(arrivals), "l"(1ull) : "memory");
  }
  if (blockIdx.x != 0) return;  // one block completes the call

  // 4. Completion (block 0): every rank's blocks arrived here.
  DirectCallWords<Blocks>& own = direct_call_words(c, c.rank, site);
  if (threadIdx.x < num_ranks) {
    const int s = threadIdx.x;
    if (wait_at_least(&own.arrivals[s], static_cast<uint64_t>(gridDim.x), dog, site.arrive_phase,
                      site.first_rank + s)) {
      own.arrivals[s] = 0;
    } else {
      call.all_arrived = 0;  // a timeout (recorded): the counters are left as they are, the call fails
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && call.all_arrived) {
    const uint64_t n = call.n;
    if (!call.in_pool) {
      *reinterpret_cast<volatile uint64_t*>(&own.missed) = n;
      own.missed_total += 1;
    }
    *reinterpret_cast<volatile uint64_t*>(&own.calls) = n;
  }
}

}  // namespace moe_ep::intranode
