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
// Timeout (Watchdog): the deadline is taken at kernel start (make_watchdog; at most kMaxTimeoutTicks, ~18
// minutes). The first thread of the rank whose wait passes it (or honours a peer's abort, below) wins the
// rank's claim word (atomicCAS, gpu scope, in the rank's own buffer) and fills the host-mapped TimeoutRecord:
// phase, rank, peer, a system fence, then status, so the host reads consistent fields once it sees status != 0.
// Every timed-out wait returns false, and the caller leaves its loop without publishing anything it did not
// finish. The claim word is sticky (never reset): the internode kernels and the host check it, so later calls
// of a Buffer that timed out (or honoured an abort) fail fast.
//
// Peer abort (docs/intranode.md, "Errors on one rank: the peer abort"). A rank whose Buffer call raises writes
// 1 into its byte of every peer's abort bytes (timeout_record.h), and 0 again at its next launch. Writer: that
// rank's host, a 1-byte copy-engine copy to the peer's mapped memory (runtime/peer_abort.h). Reader: every
// waiting thread here, with volatile 8-byte loads (relaxed, coherent at L2, where NVLink writes land). The byte
// publishes no data, so no fence goes with either side; seeing it late only delays the give-up.
// The Watchdog honours a peer's abort as it does its deadline: the first thread of the rank to give up records
// (kStatusPeerAborted, phase, this rank, the aborted peer) through the same claim word, and every wait that
// gives up returns false. The rule, as the reference board's (an abort seen on two polls in a row): a waiting
// thread honours an abort it saw set at two looks kAbortHoldTicks (about 1 s) apart. A rank that raised, caught
// the error and came back within that time has cleared its byte by the second look and is waited for, not
// reported. Any peer's abort counts, not only the waited-for one's (a wait for a rank that itself waits for the
// raising one ends too).
// Cost on the hot waits: nothing measurable. A spin already read %globaltimer and compared it with the deadline;
// it now compares it (32-bit ticks) with next_look instead, never later than the deadline. Only when that
// passes, about every millisecond, does the thread take the slow path (look) that checks the deadline and loads
// the abort bytes (num_ranks / 8 words). A wait that ends within a millisecond of its watchdog's start never
// reads them. The per-thread state (deadline, next_look) fits the two registers the 64-bit deadline took; look
// is inlined, which keeps the Watchdog in registers (a call would put it on the stack, and ptxas then spills).
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

// The watchdog's clock: %globaltimer in ticks of 1024 ns, 32 bits (it wraps every ~73 minutes; times are
// compared through their signed difference, valid within +-36 minutes, hence kMaxTimeoutTicks). Two 32-bit
// times per thread (the deadline and the next look) take the registers one 64-bit deadline took.
__device__ __forceinline__ uint32_t watchdog_ticks() { return static_cast<uint32_t>(ptx::globaltimer_ns() >> 10); }
__device__ __forceinline__ bool reached(uint32_t now, uint32_t when) { return static_cast<int32_t>(now - when) >= 0; }
constexpr uint32_t kMaxTimeoutTicks = 1u << 30;  // ~18 minutes: longer timeouts act as this in the kernels
constexpr uint32_t kAbortLookTicks = 1024;       // ~1 ms between looks at the abort bytes
constexpr uint32_t kAbortHoldTicks = 1u << 20;   // ~1.07 s: an abort seen twice this far apart is honoured

// The lowest peer (other than `rank`) whose abort byte is set, or -1 (none, or no abort bytes). Not inlined: the
// slow path's loop stays out of the waits' register budget.
__device__ __noinline__ inline int first_aborted_peer(const volatile uint64_t* peer_aborts, int num_ranks, int rank) {
  if (peer_aborts == nullptr) return -1;
  for (int w = 0; w < (num_ranks + 7) / 8; ++w) {
    uint64_t bytes = peer_aborts[w];
    if (w == rank / 8) bytes &= ~(0xffull << (8 * (rank % 8)));  // never our own byte (peers do not write it)
    if (bytes != 0) return w * 8 + (__ffsll(static_cast<long long>(bytes)) - 1) / 8;
  }
  return -1;
}

struct Watchdog {
  uint32_t deadline;       // watchdog_ticks() after which a wait gives up
  // When the next look is due (watchdog_ticks(), never past the deadline), and in bit 0 whether the last look
  // saw some peer's abort byte set (then the next look is kAbortHoldTicks later). Per thread: every thread
  // holds its own Watchdog.
  mutable uint32_t next_look;
  int rank;
  int* claim;              // in this rank's own buffer: first thread to give up wins (atomicCAS, gpu scope)
  TimeoutRecord* record;   // host-mapped
  const volatile uint64_t* peer_aborts;  // this rank's abort bytes [num_ranks rounded up to 8], or null: none
  int num_ranks;

  // True once the deadline has passed or a peer's abort was seen at two looks kAbortHoldTicks apart; the first
  // caller of the rank records it. One clock read and one compare unless a look is due.
  __device__ __forceinline__ bool expired(int phase, int peer) const {
    const uint32_t now = watchdog_ticks();
    if (!reached(now, next_look)) return false;
    return look(now, phase, peer);
  }

  __device__ __forceinline__ bool look(uint32_t now, int phase, int peer) const {
    if (reached(now, deadline)) return give_up(kStatusTimeout, phase, peer);
    const int aborted = aborted_peer();
    if (aborted >= 0 && (next_look & 1u)) return give_up(kStatusPeerAborted, phase, aborted);
    uint32_t next = now + (aborted >= 0 ? kAbortHoldTicks : kAbortLookTicks);
    if (reached(next, deadline)) next = deadline;
    next_look = (next & ~1u) | (aborted >= 0 ? 1u : 0u);
    return false;
  }

  __device__ __forceinline__ int aborted_peer() const { return first_aborted_peer(peer_aborts, num_ranks, rank); }

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

// peer_aborts: this rank's abort bytes (kMaxAbortRanks, 8-byte aligned) or null; num_ranks: the ranks that may
// write them (the group's).
__device__ __forceinline__ Watchdog make_watchdog(uint64_t timeout_ns, int rank, int* claim, TimeoutRecord* record,
                                                  const uint8_t* peer_aborts, int num_ranks) {
  const uint32_t now = watchdog_ticks();
  const uint64_t ticks = (timeout_ns + 1023) >> 10;
  const uint32_t deadline = now + static_cast<uint32_t>(ticks < kMaxTimeoutTicks ? ticks : kMaxTimeoutTicks);
  uint32_t first = now + kAbortLookTicks;
  if (peer_aborts == nullptr || reached(first, deadline)) first = deadline;
  return Watchdog{deadline, first & ~1u, rank, claim, record, reinterpret_cast<const volatile uint64_t*>(peer_aborts),
                  num_ranks};
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
