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
// Timeout (Watchdog): the deadline is taken at kernel start (make_watchdog; rounded up to kLookQuantumNs, at most
// kMaxTimeoutNs). The first thread of the rank whose wait passes it (or honours a peer's abort, below) wins the
// rank's claim word (atomicCAS, gpu scope, in the rank's own buffer) and fills the host-mapped TimeoutRecord:
// phase, rank, peer, a system fence, then status, so the host reads consistent fields once it sees status != 0.
// Every timed-out wait returns false, and the caller leaves its loop without publishing anything it did not
// finish. The claim word is sticky (never reset): the internode kernels and the host check it, so later calls
// of a Buffer that timed out (or honoured an abort) fail fast.
//
// Peer abort (docs/intranode.md, "Errors on one rank: the peer abort"). A rank whose Buffer call raises writes
// 1 into its byte of every peer's abort bytes (timeout_record.h), and 0 again at its next launch. Writer: that
// rank's host, a 1-byte copy-engine copy to the peer's mapped memory (runtime/peer_abort.h); a rank never writes
// its own byte. Reader: a waiting thread here, with volatile 8-byte loads (relaxed, coherent at L2, where NVLink
// writes land). The byte publishes no data, so no fence goes with either side; seeing it late only delays the
// give-up. The Watchdog honours a peer's abort as it does its deadline: the first thread of the rank to give up
// records (kStatusPeerAborted, phase, this rank, the aborted peer) through the same claim word, and every wait
// that gives up returns false. The rule, as the reference board's (an abort seen on two polls in a row): a
// waiting thread honours an abort it saw set at two looks at least kAbortHoldNs (about 1 s) apart. A rank that
// raised, caught the error and came back within that time has cleared its byte by the second look and is
// waited for, not reported. Any peer's abort counts, not only the waited-for one's (a wait for a rank that
// itself waits for the raising one ends too).
//
// Cost on the hot waits. A spin reads %globaltimer and compares it with one 64-bit word, next_look_ns, as it
// compared the deadline before the peer abort existed (one clock read, one 64-bit compare, the word in two
// registers); ptxas adds a BSSY/BSYNC pair per poll (where the look rejoins) and the Watchdog holds one pointer
// more (the abort bytes). next_look_ns is the time of the thread's next look (the slow path, look): a multiple
// of kLookQuantumNs (~17 ms), never past the deadline, whose low bits (less than one quantum, so they delay the
// look by less than that) hold the rest of the state: the deadline, as quanta after the next look, and whether
// the last look saw an abort. A look checks the deadline, loads the abort bytes (8 words) and moves
// next_look_ns on: to the next quantum boundary (at most ~17 ms on), or kAbortHoldNs further when it saw an
// abort, never past the deadline. A wait that ends within one quantum of its watchdog's start never looks. The
// slow path is inlined and leaves the spin (wait_while's shape). No call: a call site makes ptxas keep the live
// values in registers the callee saves, and an earlier version with the abort scan out of line spilled in the
// intranode and internode dispatch/combine kernels, inside their copy loops, which lost 3-6% bandwidth.
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

constexpr uint64_t kLookQuantumNs = 1ull << 24;   // ~16.8 ms: looks fall on multiples of it
constexpr uint64_t kLookStateMask = kLookQuantumNs - 1;
constexpr uint64_t kMaxTimeoutNs = ((1ull << 23) - 1) << 24;  // ~39 hours: what the 23 bits of quanta hold
constexpr uint64_t kAbortHoldNs = 1ull << 30;     // ~1.07 s: an abort seen at two looks this far apart is honoured

// The lowest peer whose abort byte is set, or -1 (none, or no abort bytes: null). A rank never writes its own
// byte, and the bytes of ranks past the group stay 0, so the scan reads all kMaxAbortRanks bytes.
__device__ __forceinline__ int first_aborted_peer(const volatile uint64_t* peer_aborts) {
  if (peer_aborts == nullptr) return -1;
#pragma unroll 1
  for (int w = 0; w < kMaxAbortRanks / 8; ++w) {
    const uint64_t bytes = peer_aborts[w];
    if (bytes != 0) return w * 8 + (__ffsll(static_cast<long long>(bytes)) - 1) / 8;
  }
  return -1;
}

struct Watchdog {
  // The %globaltimer value from which a wait looks (takes the slow path): a multiple of kLookQuantumNs, plus in
  // its low bits [23:1] the deadline as quanta after that multiple, [0] whether the last look saw an abort byte
  // set. Per thread: every thread holds its own Watchdog, and only its own looks move this on.
  mutable uint64_t next_look_ns;
  int rank;
  int* claim;              // in this rank's own buffer: first thread to give up wins (atomicCAS, gpu scope)
  TimeoutRecord* record;   // host-mapped
  const volatile uint64_t* peer_aborts;  // this rank's abort bytes [kMaxAbortRanks / 8 words], or null: none

  // The %globaltimer value from which a wait gives up.
  __device__ __forceinline__ uint64_t deadline_ns() const {
    return (next_look_ns & ~kLookStateMask) + (((next_look_ns & kLookStateMask) >> 1) << 24);
  }

  // True once the deadline has passed or a peer's abort was seen at two looks kAbortHoldNs apart; the first
  // caller of the rank records it. One clock read and one 64-bit compare unless a look is due.
  __device__ __forceinline__ bool expired(int phase, int peer) const {
    const uint64_t now = ptx::globaltimer_ns();
    if (now < next_look_ns) return false;
    return look(now, phase, peer);
  }

  __device__ __forceinline__ bool look(uint64_t now, int phase, int peer) const {
    const uint64_t deadline = deadline_ns();
    if (now >= deadline) return give_up(kStatusTimeout, phase, peer);
    const int aborted = first_aborted_peer(peer_aborts);
    if (aborted >= 0 && (next_look_ns & 1)) return give_up(kStatusPeerAborted, phase, aborted);
    // Both multiples of the quantum, next after now and never past the deadline.
    uint64_t next = (now + (aborted >= 0 ? kAbortHoldNs : 0) + kLookQuantumNs) & ~kLookStateMask;
    if (next > deadline) next = deadline;
    next_look_ns = next | (((deadline - next) >> 24) << 1) | (aborted >= 0 ? 1 : 0);
    return false;
  }

  // The first thread of the rank to give up fills the record (phase, rank, peer, a system fence, then status).
  __device__ __forceinline__ bool give_up(int32_t status, int phase, int peer) const {
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

// peer_aborts: this rank's abort bytes (kMaxAbortRanks, 8-byte aligned; timeout_record.h) or null.
__device__ __forceinline__ Watchdog make_watchdog(uint64_t timeout_ns, int rank, int* claim, TimeoutRecord* record,
                                                  const uint8_t* peer_aborts) {
  const uint64_t now = ptx::globaltimer_ns();
  const uint64_t deadline =
      (now + (timeout_ns < kMaxTimeoutNs ? timeout_ns : kMaxTimeoutNs) + kLookStateMask) & ~kLookStateMask;
  // The first look one to two quanta on (a wait that ends sooner never looks), or at the deadline.
  uint64_t first = (now + 2 * kLookQuantumNs) & ~kLookStateMask;
  if (first > deadline) first = deadline;
  return Watchdog{first | (((deadline - first) >> 24) << 1), rank, claim, record,
                  reinterpret_cast<const volatile uint64_t*>(peer_aborts)};
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
  // The inner loop is the spin (load, condition, abort, one clock compare); a due look leaves it. Shaped so, the
  // look stays out of the spin's body, and ptxas keeps the surrounding copy loops as they were without it.
  for (;;) {
    uint64_t now;
    do {
      if (!pending(seen = ptx::ld_acquire_sys(word))) return true;
      if (abort()) return false;
      now = ptx::globaltimer_ns();
    } while (now < dog.next_look_ns);
    if (dog.look(now, phase, peer)) return false;
  }
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
  for (;;) {  // shaped as wait_while's
    uint64_t now;
    do {
      if (!pending(ptx::ld_relaxed_sys(word))) {
        seen = ptx::ld_acquire_sys(word);
        return true;
      }
      if (sleep_ns) __nanosleep(sleep_ns);
      if (abort()) return false;
      now = ptx::globaltimer_ns();
    } while (now < dog.next_look_ns);
    if (dog.look(now, phase, peer)) return false;
  }
}

// A monotonic counter or epoch reaching `target`.
template <typename Word, typename Abort = NoAbort>
__device__ __forceinline__ bool wait_at_least(const Word* word, Word target, const Watchdog& dog, int phase, int peer,
                                              Abort abort = {}) {
  Word seen;
  return wait_while(word, seen, [&](Word v) { return v < target; }, dog, phase, peer, abort);
}

}  // namespace moe_ep
