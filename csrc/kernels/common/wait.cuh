// The one spin-wait of the device communication library (torch-free): a thread polls a word that another
// GPU (or another block of this GPU) writes, until a condition holds, under a watchdog that turns a hang into
// a reported timeout. Every wait of the intranode, internode and low-latency kernels goes through wait_while /
// wait_cached / wait_at_least, or wait_while_relaxed where spinning warps share the SM with copying ones.
//
// Memory ordering. The word is loaded with ld.acquire.sys (ptx.cuh): system scope, because the writer may be
// another GPU over NVLink (peer-mapped CUDA IPC memory) or an NVSHMEM signal from a remote PE. Every waited
// word has one writer at a time, which publishes with a release: st.release.sys, a fence.sys (or a completed
// nvshmem_quiet) before an NVSHMEM signal SET, or a fence before an atomic (the internode grid barrier). Once the condition holds, loads the waiting thread issues
// after the wait see everything the writer did before that release (slot rows before a tail, consumer loads
// before a head). The acquire orders only the waiting thread: a caller that waits for its group shares the
// outcome and extends the ordering to the group with a barrier (__syncwarp, bar.sync, __syncthreads), which
// the slot accesses follow. Each call site names its word's writer.
//
// Timeout (Watchdog): the deadline is taken at kernel start (make_watchdog). The first thread of the rank
// whose wait passes it wins the rank's claim word (atomicCAS, gpu scope, in the rank's own buffer) and fills
// the host-mapped TimeoutRecord: phase, rank, peer, a system fence, then status, so the host reads
// consistent fields once it sees status != 0. Every timed-out wait returns false, and the caller leaves its
// loop without publishing anything it did not finish. The claim word is sticky (never reset): the internode
// kernels and the host check it, so later calls of a Buffer that timed out fail fast.
//
// Abort: a wait may also end early, unrecorded, when abort() returns true (AbortFlag: another warp of the
// block gave up and recorded its own wait).
//
// Loops that are not waits on one word call Watchdog::expired themselves: the internode dispatch forwarder's
// poll over every source ring (it takes whichever ring has rows), and the publisher warps' backstops.
#pragma once

#include <cstdint>

#include "kernels/common/ptx.cuh"
#include "kernels/common/timeout_record.h"

namespace moe_ep {

struct Watchdog {
  uint64_t deadline_ns;    // %globaltimer value after which a wait gives up
  int rank;
  int* claim;              // in this rank's own buffer: first timed-out thread wins (atomicCAS, gpu scope)
  TimeoutRecord* record;   // host-mapped

  // True once the deadline has passed; the first caller of the rank records (phase, rank, peer).
  __device__ bool expired(int phase, int peer) const {
    if (ptx::globaltimer_ns() < deadline_ns) return false;
    if (atomicCAS(claim, 0, 1) == 0) {
      record->phase = phase;
      record->rank = rank;
      record->peer = peer;
      __threadfence_system();
      *reinterpret_cast<volatile int32_t*>(&record->status) = kStatusTimeout;
      __threadfence_system();
    }
    return true;
  }
};

__device__ __forceinline__ Watchdog make_watchdog(uint64_t timeout_ns, int rank, int* claim, TimeoutRecord* record) {
  return Watchdog{ptx::globaltimer_ns() + timeout_ns, rank, claim, record};
}

struct NoAbort {
  __device__ bool operator()() const { return false; }
};

// A block-local stop flag (shared memory): set by a warp that gave up.
struct AbortFlag {
  const volatile int* flag;
  __device__ bool operator()() const { return *flag != 0; }
};

// One thread: load `word` (ld.acquire.sys; Word = uint64_t, uint32_t or int) while pending(value), i.e. until
// the condition the caller waits for holds; `seen` is the last value loaded. False on timeout (recorded as
// (phase, this rank, peer)) or abort. `pending` is the loop condition (what is still missing), so a call site
// reads as the loop it is.
template <typename Word, typename Pending, typename Abort = NoAbort>
__device__ __forceinline__ bool wait_while(const Word* word, Word& seen, Pending pending, const Watchdog& dog,
                                           int phase, int peer, Abort abort = {}) {
  while (pending(seen = ptx::ld_acquire_sys(word))) {
    if (abort() || dog.expired(phase, peer)) return false;
  }
  return true;
}

// The same with a cached value: `seen` holds a value this thread acquired earlier (or a lower bound of the
// word), and no load is issued while it already suffices (its acquire still orders what follows).
template <typename Word, typename Pending, typename Abort = NoAbort>
__device__ __forceinline__ bool wait_cached(const Word* word, Word& seen, Pending pending, const Watchdog& dog,
                                            int phase, int peer, Abort abort = {}) {
  return !pending(seen) || wait_while(word, seen, pending, dog, phase, peer, abort);
}

// wait_while for a word polled while other warps of the SM stream data: relaxed loads (an acquire per poll
// is a fence each time), `sleep_ns` of __nanosleep between polls (spinning warps leave the issue slots to the
// copying ones), then, once the condition holds, one acquire load, whose value is `seen`: the word's one
// writer only moves it on (a flag set from 0, a counter growing), so the condition still holds for it, and
// the acquire orders what follows as wait_while's does.
template <typename Pending, typename Abort = NoAbort>
__device__ __forceinline__ bool wait_while_relaxed(const int* word, int& seen, Pending pending, const Watchdog& dog,
                                                   int phase, int peer, unsigned sleep_ns, Abort abort = {}) {
  while (pending(ptx::ld_relaxed_sys(word))) {
    if (sleep_ns) __nanosleep(sleep_ns);
    if (abort() || dog.expired(phase, peer)) return false;
  }
  seen = ptx::ld_acquire_sys(word);
  return true;
}

// A monotonic counter or epoch reaching `target`.
template <typename Word, typename Abort = NoAbort>
__device__ __forceinline__ bool wait_at_least(const Word* word, Word target, const Watchdog& dog, int phase, int peer,
                                              Abort abort = {}) {
  Word seen;
  return wait_while(word, seen, [&](Word v) { return v < target; }, dog, phase, peer, abort);
}

}  // namespace moe_ep
