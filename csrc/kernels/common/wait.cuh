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
// whose wait passes it (or honours a peer's abort, below) wins the rank's claim word (atomicCAS, gpu scope,
// in the rank's own buffer) and fills the host-mapped TimeoutRecord: phase, rank, peer, a system fence, then
// status, so the host reads consistent fields once it sees status != 0. Every timed-out wait returns false,
// and the caller leaves its loop without publishing anything it did not finish. The claim word is sticky
// (never reset): the internode kernels and the host check it, so later calls of a Buffer that timed out (or
// honoured an abort) fail fast.
//
// Peer abort (docs/intranode.md, "Errors on one rank: the peer abort"). A rank whose Buffer call raises writes
// 1 into its byte of every peer's abort bytes (timeout_record.h), and 0 again at its next launch. Writer: that
// rank's host, a 1-byte copy-engine copy to the peer's mapped memory (runtime/peer_abort.h). Reader: every
// waiting thread here, with volatile 8-byte loads (relaxed, coherent at L2, where NVLink writes land). The byte
// publishes no data, so no fence goes with either side; seeing it late only delays the give-up.
// The Watchdog honours a peer's abort as it does its deadline: the first thread of the rank to give up records
// (kStatusPeerAborted, phase, this rank, the aborted peer) through the same claim word, and every wait that
// gives up returns false. The rule, as the reference board's: an abort counts only once this thread has seen it
// set at every look for kAbortHoldNs (a rank that raised, caught the error and came back within that time has
// cleared its byte and is waited for, not reported); any peer's abort counts, not only the waited-for one's (a
// wait for a rank that itself waits for the raising one ends too).
// Cost on the hot waits: nothing measurable. A spin already read %globaltimer and compared it with the deadline;
// it now compares it with next_look_ns instead (at most the deadline). Only when that passes, every
// kAbortLookNs, does the thread take the slow path (look) that checks the deadline and loads the abort bytes
// (num_ranks / 8 words). A wait that ends within kAbortLookNs of its watchdog's start never reads them. The
// look state (next_look_ns, abort_seen_ns) is per thread: every thread holds its own Watchdog, in registers
// (look is inlined: a call would put the Watchdog on the stack, and ptxas then spills in the low-latency
// kernels; inlined, they use 1 register more than before and spill nothing).
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

// How long a peer's abort must be seen before a wait honours it, and how often a waiting thread looks.
constexpr uint64_t kAbortHoldNs = 1000000000ull;  // 1 s
constexpr uint64_t kAbortLookNs = 100000ull;      // 100 us

struct Watchdog {
  uint64_t deadline_ns;    // %globaltimer value after which a wait gives up
  int rank;
  int* claim;              // in this rank's own buffer: first thread to give up wins (atomicCAS, gpu scope)
  TimeoutRecord* record;   // host-mapped
  const volatile uint64_t* peer_aborts;  // this rank's abort bytes [num_ranks rounded up to 8], or null: none
  int num_ranks;
  // Per thread (each thread holds its own Watchdog): when to read the clock's slow path next, and since when
  // this thread has seen some peer's abort byte set on every look (0: not set at the last look).
  mutable uint64_t next_look_ns;
  mutable uint64_t abort_seen_ns;

  // True once the deadline has passed or a peer's abort has been seen for kAbortHoldNs; the first caller of
  // the rank records it. One clock read and one compare unless a look is due.
  __device__ __forceinline__ bool expired(int phase, int peer) const {
    const uint64_t now = ptx::globaltimer_ns();
    if (now < next_look_ns) return false;
    return look(now, phase, peer);
  }

  __device__ __forceinline__ bool look(uint64_t now, int phase, int peer) const {
    if (now >= deadline_ns) return give_up(kStatusTimeout, phase, peer);
    const int aborted = aborted_peer();
    if (aborted < 0) {
      abort_seen_ns = 0;
    } else if (abort_seen_ns == 0) {
      abort_seen_ns = now;
    } else if (now - abort_seen_ns >= kAbortHoldNs) {
      return give_up(kStatusPeerAborted, phase, aborted);
    }
    next_look_ns = now + kAbortLookNs < deadline_ns ? now + kAbortLookNs : deadline_ns;
    return false;
  }

  // The lowest peer whose abort byte is set, or -1.
  __device__ int aborted_peer() const {
    if (peer_aborts == nullptr) return -1;
    for (int w = 0; w < (num_ranks + 7) / 8; ++w) {
      uint64_t bytes = peer_aborts[w];
      if (w == rank / 8) bytes &= ~(0xffull << (8 * (rank % 8)));  // never our own byte (peers do not write it)
      if (bytes != 0) return w * 8 + (__ffsll(static_cast<long long>(bytes)) - 1) / 8;
    }
    return -1;
  }

  // The first thread of the rank to give up fills the record (phase, rank, peer, a system fence, then status).
  __device__ bool give_up(int32_t status, int phase, int peer) const {
    if (atomicCAS(claim, 0, 1) == 0) {
      record->phase = phase;
      record->rank = rank;
      record->peer = peer;
      __threadfence_system();
      *reinterpret_cast<volatile int32_t*>(&record->status) = status;
      __threadfence_system();
    }
    return true;
  }
};

// peer_aborts: this rank's abort bytes (kMaxAbortRanks, 8-byte aligned) or null; num_ranks: the ranks that may
// write them (the group's).
__device__ __forceinline__ Watchdog make_watchdog(uint64_t timeout_ns, int rank, int* claim, TimeoutRecord* record,
                                                  const uint8_t* peer_aborts, int num_ranks) {
  const uint64_t now = ptx::globaltimer_ns(), deadline = now + timeout_ns;
  const uint64_t first_look = peer_aborts != nullptr && now + kAbortLookNs < deadline ? now + kAbortLookNs : deadline;
  return Watchdog{deadline, rank, claim, record, reinterpret_cast<const volatile uint64_t*>(peer_aborts), num_ranks,
                  first_look, 0};
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
