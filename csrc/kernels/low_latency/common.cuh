// Device helpers shared by the low-latency kernels: peer addressing, signal words, timed waits.
//
// Signal words are int32 in the symmetric buffer. Each one has exactly one writer per call (a
// thread of the sending PE) and is read by the receiving PE's blocks; the last reading block puts
// it back to 0 in the same kernel (docs/low_latency.md, "Signals"). Ordering is system scope on
// both sides because writer and reader are different GPUs.
#pragma once

#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "kernels/common/channel.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/low_latency/low_latency.h"

namespace moe_ep::low_latency {

// Row copies (dispatch receive, combine send) spread the 16-byte vectors of their rows over all
// threads of the block, and each thread issues this many loads before the matching stores: the
// loads' latencies (L2 or HBM, ~0.5-1 us) overlap instead of adding up.
constexpr int kCopyUnroll = 8;

// Memory-order helpers of kernels/common/ptx.cuh (system scope: writer and reader are different GPUs):
// ld_acquire_sys / st_release_sys on signal words, ld_relaxed_sys for spins that end in an acquire,
// st_relaxed_sys for values that publish no data (the dedup dispatch's early counts).
using ptx::ld_acquire_sys;
using ptx::ld_relaxed_sys;
using ptx::st_relaxed_sys;
using ptx::st_release_sys;

__device__ __forceinline__ uint64_t now_ns() { return ptx::globaltimer_ns(); }

// 16-byte loads. Inputs that do not change during the kernel: non-coherent path. Data a peer wrote
// into our buffer (published by a signal we acquired): L2 only (.cg), never L1.
__device__ __forceinline__ int4 ld_nc(const void* p) { return ptx::ld_nc_v4(static_cast<const int4*>(p)); }
__device__ __forceinline__ int4 ld_cg(const void* p) { return ptx::ld_cg_v4(static_cast<const int4*>(p)); }
__device__ __forceinline__ int ld_cg_s32(const void* p) { return ptx::ld_cg(static_cast<const int*>(p)); }
__device__ __forceinline__ float ld_cg_f32(const void* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int2 ld_cg_v2(const int2* p) {
  int2 v;
  asm volatile("ld.global.cg.v2.s32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
}
// 8 float32 values rounded to bf16 (round to nearest even), packed into one 16-byte vector.
__device__ __forceinline__ int4 pack_bf16x8(const float (&v)[8]) {
  int4 packed;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int j = 0; j < 4; ++j) p[j] = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
  return packed;
}
// Stores to a peer over NVLink (or local outputs): plain weak stores, published by a later
// release on a signal.
__device__ __forceinline__ void st_v4(void* p, int4 v) {
  asm volatile("st.global.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// This PE's address `local` (inside the symmetric buffer) as seen from `pe` through NVLink, or
// null when `pe` is reached with nvshmem puts instead.
__device__ __forceinline__ uint8_t* peer_address(const Common& c, int pe, const void* local) {
  const uint64_t base = c.peer_bases[pe];
  if (base == 0) return nullptr;
  return reinterpret_cast<uint8_t*>(base) +
         (reinterpret_cast<const uint8_t*>(local) - c.buffer);
}

// Publish `value` into the signal word `local_word` (a symmetric address) of PE `pe`.
// Precondition (the callers' job): every data store or put this signal covers was made visible
// at system scope first (stores + __threadfence_system, puts + nvshmem_quiet), and the calling
// thread has observed that (an atomic on a workspace counter followed by __threadfence_system).
// Writer: this thread. Reader: blocks of `pe`'s receive phase, with ld_acquire_sys.
__device__ __forceinline__ void signal_peer(const Common& c, int* local_word, int value, int pe) {
  if (uint8_t* remote = peer_address(c, pe, local_word)) {
    st_release_sys(reinterpret_cast<int*>(remote), value);
  } else {
    nvshmem_int_atomic_set(local_word, value, pe);
  }
}

// Timed waits. A wait that sees its word still 0 after c.timeout_ns, or a peer's abort byte set for
// kAbortHoldNs, records (status, phase, this rank, peer) in the host-mapped TimeoutRecord through the common
// Watchdog (kernels/common/wait.cuh: the first thread of this GPU to give up wins the claim word, fills the
// record, fences, then sets its status)
// and returns `on_timeout` instead of trapping: the caller picks a value that makes the rest of the
// kernel do no work for that peer (a count of 0, "no message"), so the kernel ends, the CUDA context
// survives, and the runtime raises on this rank's next call. Once the claim word is set every later
// wait (of this kernel or a later one) gives up within 64 polls (a spin reads the claim every 64th
// poll only), so one missing peer costs one timeout.
__device__ __forceinline__ Watchdog wait_watchdog(const Common& c) {
  return make_watchdog(c.timeout_ns, c.rank, c.workspace + kWsTimeoutClaim, c.timeout, c.peer_aborts);
}
__device__ __forceinline__ bool timed_out_before(const Common& c) {
  return *reinterpret_cast<const volatile int*>(c.workspace + kWsTimeoutClaim) != 0;
}

// The abort of the low-latency waits: every 64th poll, whether a thread of this GPU already timed out (then
// this wait gives up too, unrecorded, and one missing peer costs one timeout).
struct EarlierTimeout {
  const Common* c;
  mutable unsigned polls = 0;
  __device__ bool operator()() const { return (++polls & 63) == 0 && timed_out_before(*c); }
};

// Wait until the signal word is non-zero (wait_while, kernels/common/wait.cuh); returns it (acquire: the
// peer's stores it publishes are visible to this thread), or on_timeout (see above).
__device__ __forceinline__ int wait_signal(const Common& c, const int* word, int phase, int peer,
                                           int on_timeout) {
  int v = ld_acquire_sys(word);
  if (v != 0) return v;
  const Watchdog dog = wait_watchdog(c);
  const bool arrived = wait_while(word, v, [](int seen) { return seen == 0; }, dog, phase, peer, EarlierTimeout{&c});
  return arrived ? v : on_timeout;
}

// wait_signal for words polled while other warps of the SM stream data (the dedup dispatch's message flags,
// the token-major combine's flags): wait_while_relaxed, `sleep_ns` of __nanosleep between polls, then one
// acquire load of the (still non-zero) word. On timeout: on_timeout.
__device__ __forceinline__ int wait_flag(const Common& c, const int* word, int phase, int peer,
                                         unsigned sleep_ns, int on_timeout) {
  if (ld_relaxed_sys(word) != 0) return ld_acquire_sys(word);
  const Watchdog dog = wait_watchdog(c);
  int v = 0;
  const bool arrived = wait_while_relaxed(word, v, [](int seen) { return seen == 0; }, dog, phase, peer, sleep_ns,
                                          EarlierTimeout{&c});
  return arrived ? v : on_timeout;
}

// ---- Dispatch agreement (low_latency.h, "Dispatch agreement"; docs/low_latency.md, "Agreement").
//
// Protocol. Every dispatch count word carries the sender's tag: (tag << kCountBits) | (count + 1), still
// non-zero, so the waits' "!= 0" is unchanged and the tag arrives with the count in the same word, under the
// same release / acquire (or relaxed, for the dedup dispatch's early counts) as before. The receiver compares
// the tag with its own once per count word it reads (count_of); no per-token work. A source whose layout
// fields differ writes its count words at its own layout's offsets, so this PE's words stay 0: its wait then
// reaches the spin's slow path, where every 64th poll also reads the source's signature word (same place in
// every layout) and gives up on a non-zero foreign one (SignatureOrTimeout). Either way record_mismatch
// records the first one and the count is taken as 0: a source that does not agree contributes no rows (nothing
// of its is read, so nothing is written out of bounds), the kernel ends, and the host raises at its next call.
// Once per call and source, after the count waits, the full word is compared too (check_signatures), which the
// tag's 7-bit layout hash alone could miss.
// A count that matches but lies outside [0, max_tokens] (a stray store that happened to carry our tag, or a
// layout whose 7-bit hash collides with ours) counts 0 too (one unsigned compare per word), so no count can
// index past a region, and is recorded (kSeenBadCount) like a mismatch: the next call raises.
//
// Memory ordering of the signature words: the sender's word publishes no data (relaxed system-scope store, or
// an NVSHMEM atomic set on the put path) and is not ordered before the same call's count words (those come from
// other threads and blocks, or with relaxed stores and no fence), so the receiver may see a count word first
// (count_of then records the tag only), and where a wait gave up (so check_signatures below did not wait for
// every source's word before the reset) the word may land after this call's last receiving block reset it.
// Such a late word is of an earlier call on this half when a later call reads it (over NVLink the previous
// one: every store of a kernel is performed by the time the kernel completes, and the sender's next call on
// this half comes after that), so of another generation unless 1024 calls used this half in between. So the
// word carries its call's generation (low_latency.h, with_generation), and a word of another generation is
// taken as not yet arrived (0): a late word cannot be mistaken for this call's. The reset (by the same last
// receiving block as the count words) keeps a word's lifetime the count words' but is not needed for this.

// This PE's signature word for source `source` on the call's half.
__device__ __forceinline__ uint64_t* signature_word(const Common& c, const DispatchArgs& a, int source) {
  return a.signature_words + (c.half_offset != 0 ? kMaxRanks : 0) + source;
}

// A count word as the sender publishes it.
__device__ __forceinline__ int pack_count(const DispatchArgs& a, int count) {
  return static_cast<int>((static_cast<uint32_t>(a.signature) << kCountBits) | static_cast<uint32_t>(count + 1));
}

// Send phase, at entry: block 0's threads r < R write this call's signature into word [half][me] of PE r.
__device__ __forceinline__ void publish_signature(const Common& c, const DispatchArgs& a) {
  const int r = threadIdx.x;
  if (blockIdx.x != 0 || r >= c.num_ranks) return;
  uint64_t* local = signature_word(c, a, c.rank);
  if (uint8_t* remote = peer_address(c, r, local)) {
    *reinterpret_cast<volatile uint64_t*>(remote) = a.signature;  // relaxed: no data to publish (see above)
  } else {
    nvshmem_uint64_atomic_set(local, a.signature, r);
  }
}

// A signature word as this call reads it: 0 when absent or of another generation (a late word of the call
// before on this half; see above).
__device__ __forceinline__ uint64_t signature_seen(const Common& c, const DispatchArgs& a, int source) {
  const uint64_t w = *reinterpret_cast<const volatile uint64_t*>(signature_word(c, a, source));
  return (w >> kGenerationShift) == (a.signature >> kGenerationShift) ? w : 0;
}

// The first foreign signature of this GPU fills the host-mapped record (fields, a system fence, then status, as
// the Watchdog does); every finder then sets the timeout claim, so that every later wait of this and later
// kernels gives up within 64 polls (EarlierTimeout) instead of waiting for a peer whose call does not match.
__device__ __forceinline__ void record_mismatch(const Common& c, const DispatchArgs& a, int source, uint64_t seen) {
  if (atomicCAS(c.workspace + kWsSignatureClaim, 0, 1) == 0) {
    a.mismatch->source = source;
    a.mismatch->seen = seen;
    a.mismatch->mine = a.signature;
    a.mismatch->call = a.call;
    __threadfence_system();
    *reinterpret_cast<volatile int32_t*>(&a.mismatch->status) = 1;
    __threadfence_system();
  }
  atomicExch(c.workspace + kWsTimeoutClaim, 1);
}

// The count a count word carries: its tag compared with ours (one compare); a foreign tag records the mismatch
// (with the source's full signature word when visible: of this generation and non-zero) and counts 0; a
// matching tag over a count outside [0, max_tokens] records the word (kSeenBadCount) and counts 0.
__device__ __forceinline__ int count_of(const Common& c, const DispatchArgs& a, int word, int source) {
  const uint32_t w = static_cast<uint32_t>(word);
  if ((w >> kCountBits) != (static_cast<uint32_t>(a.signature) & kCountMask)) {
    const uint64_t full = signature_seen(c, a, source);
    record_mismatch(c, a, source, full != 0 ? full : (kSeenTagOnly | (w >> kCountBits)));
    return 0;
  }
  const uint32_t n = (w & kCountMask) - 1u;  // count + 1 == 0 wraps past max_tokens
  if (n > static_cast<uint32_t>(c.max_tokens)) {
    record_mismatch(c, a, source, kSeenBadCount | w);
    return 0;
  }
  return static_cast<int>(n);
}

// The abort of the count waits: EarlierTimeout's, plus (same 64th polls) the source's signature word: of this
// generation, non-zero and not ours means its count words went elsewhere (another layout) or carry another tag;
// record and give up.
struct SignatureOrTimeout {
  const Common* c;
  const DispatchArgs* a;
  int source;
  mutable unsigned polls = 0;
  __device__ bool operator()() const {
    if ((++polls & 63) != 0) return false;
    if (timed_out_before(*c)) return true;
    const uint64_t seen = signature_seen(*c, *a, source);
    if (seen == 0 || seen == a->signature) return false;
    record_mismatch(*c, *a, source, seen);
    return true;
  }
};

// The full signature check, once per call and source: the tag compares 7 hashed bits of the layout fields only,
// so two layouts whose count words coincide could pass it. Thread 0 of block b checks the sources b, b + grid,
// ..., after its count waits and before the block's arrival on kWsDispatchRecvDone: it waits for the source's
// word of this generation (published at the source's entry into this very call, so it comes) and records it if
// it differs. Its load is an acquire, performed before that arrival, so before the last block's reset. Skipped
// once a wait gave up (a mismatch or timeout is recorded already); its wait gives up as the count waits do.
__device__ __forceinline__ void check_signatures(const Common& c, const DispatchArgs& a) {
  if (timed_out_before(c)) return;
  const uint64_t generation = a.signature >> kGenerationShift;
  const Watchdog dog = wait_watchdog(c);
  for (int s = blockIdx.x; s < c.num_ranks; s += gridDim.x) {
    uint64_t seen = 0;
    const bool arrived = wait_while(
        static_cast<const uint64_t*>(signature_word(c, a, s)), seen,
        [generation](uint64_t v) { return v == 0 || (v >> kGenerationShift) != generation; }, dog,
        kWaitDispatchCounts, s, EarlierTimeout{&c});
    if (!arrived) return;
    if (seen != a.signature) {
      record_mismatch(c, a, s, seen);
      return;
    }
  }
}

// Wait for a dispatch count word of `source` (wait_signal with SignatureOrTimeout) and return its count
// (count_of). A wait that gives up (timeout, an earlier give-up, a foreign signature) counts 0.
__device__ __forceinline__ int wait_count(const Common& c, const DispatchArgs& a, const int* word, int phase,
                                          int source) {
  int v = ld_acquire_sys(word);
  if (v == 0) {
    const Watchdog dog = wait_watchdog(c);
    const bool arrived = wait_while(word, v, [](int seen) { return seen == 0; }, dog, phase, source,
                                    SignatureOrTimeout{&c, &a, source});
    if (!arrived) return 0;
  }
  return count_of(c, a, v, source);
}

// The int32 signal words of this call's half (low_latency.h, HalfLayout).
__device__ __forceinline__ int* half_signals(const Common& c, const HalfLayout& lay) {
  return reinterpret_cast<int*>(c.buffer + c.half_offset + lay.signal_off);
}

// ---- Phase trace (low_latency.h, kTrace*): writes only to the trace record, never to data or
// signal words, so the memory-ordering protocol is the same with tracing on or off. c.trace is a
// kernel argument, uniform over the grid: the branches below never diverge.

// Thread 0 of the block stamps event `ev` of its row.
__device__ __forceinline__ void trace_event(const Common& c, int ev) {
  if (c.trace != nullptr && threadIdx.x == 0) c.trace[blockIdx.x * kTraceEvents + ev] = now_ns();
}
// The same after a CTA barrier (the event covers every thread of the block). The barrier is only
// taken when tracing (uniform condition: all threads or none).
__device__ __forceinline__ void trace_block_event(const Common& c, int ev) {
  if (c.trace != nullptr) {
    __syncthreads();
    trace_event(c, ev);
  }
}
// Start of a launch that runs the send phase: clear the block's row (no stale event of an earlier
// call survives), note the SM, stamp the entry event.
__device__ __forceinline__ void trace_begin(const Common& c, int entry_event) {
  if (c.trace != nullptr && threadIdx.x == 0) {
    const uint64_t t = now_ns();
    unsigned long long* row = c.trace + blockIdx.x * kTraceEvents;
    for (int i = 0; i < kTraceEvents; ++i) row[i] = 0;
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    row[kTraceSmid] = smid;
    row[entry_event] = t;
  }
}
// One per-pair word (kTracePairSent / Wait / Seen + index): a time the caller already read, or now
// (the clock is read inside the branch: nothing when tracing is off).
__device__ __forceinline__ void trace_pair(const Common& c, int base, int index, uint64_t t) {
  if (c.trace != nullptr) c.trace[base + index] = t;
}
__device__ __forceinline__ void trace_pair_now(const Common& c, int base, int index) {
  if (c.trace != nullptr) c.trace[base + index] = now_ns();
}

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

}  // namespace moe_ep::low_latency
