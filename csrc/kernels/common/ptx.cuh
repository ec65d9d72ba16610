// Memory-order helpers for cross-GPU protocols (torch-free).
//
// Scopes: ".sys" for words another GPU writes or reads over NVLink (peer-mapped CUDA IPC memory),
// ".gpu" for words only this GPU's blocks share. Every flag in the protocols names which one it uses.
// Data payloads use weak (plain) accesses; they are published/consumed through a release/acquire pair
// on the flag that guards them.
#pragma once

#include <cstdint>

namespace moe_dispatcher::ptx {

// ---------------------------------------------------------------- flags (64-bit, monotonic counters)
// Acquire load at system scope: loads after it observe everything the releasing writer did before
// its release store, even when that writer is another GPU.
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Release store at system scope: every load and store this thread did before (and, through a CTA
// barrier that precedes it, those of the threads that joined the barrier) is visible to a peer that
// acquires this word and sees the value.
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// The same for 32-bit signal words (values, not counters: the low-latency kernels' counts and flags).
__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(int* p, int v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Relaxed at system scope: never served from a stale L1 line, orders nothing (spins that end in an
// acquire load; values that publish no data).
__device__ __forceinline__ int ld_relaxed_sys(const int* p) {
  int v;
  asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_sys(int* p, int v) {
  asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int ld_volatile(const int* p) {
  int v;
  asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// ---------------------------------------------------------------- bulk data (16-byte vectors)
// Read-only input tensors: non-coherent path, no L1 allocation (they are streamed once).
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Ring slots written by another GPU: cache at L2 only (.cg), so a line cached in L1 during an
// earlier lap of the ring can never be returned. Ordered after the acquire of the tail that
// published the slot.
__device__ __forceinline__ int4 ld_cg_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ int ld_cg(const int* p) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Output tensors written once: streaming store (evict-first).
__device__ __forceinline__ void st_cs_v4(int4* p, int4 v) {
  asm volatile("st.global.cs.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// ---------------------------------------------------------------- bulk copies (sm_90 copy engine)
// One thread moves a whole 16-byte-aligned range (size a multiple of 16): global -> shared completes
// on an mbarrier (expect_tx bytes, then wait for the phase), shared -> global is tracked in the
// thread's bulk groups (commit, then wait_group.read before the shared buffer is reused, and
// wait_group 0 before the writes may be published: after it they are performed, and
// fence.proxy.async.global orders them before the thread's later generic accesses, e.g. a
// __threadfence_system and a release of a flag). The global side may be a peer's NVLink mapping.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Initialise an mbarrier expecting one arrival per phase, visible to the copy engine afterwards.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Start `bytes` of global `src` -> shared `dst`; the phase of `bar` completes when they landed.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}
// Wait for the phase of `bar` with parity `parity` (0 for its first phase, then alternating).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// Start `bytes` of shared `src` -> global `dst` as one bulk group of this thread.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(shared_address(src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// This thread's bulk stores have read their shared sources (the buffers may be rewritten).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// This thread's bulk stores are complete, and ordered before its later generic accesses.
__device__ __forceinline__ void bulk_wait_written() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// ---------------------------------------------------------------- time and barriers
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Named barrier for a group of `threads` threads (a multiple of 32) inside a CTA; id 0 is
// __syncthreads, so groups use 1..15. Orders the group's memory accesses at CTA scope.
__device__ __forceinline__ void group_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace moe_dispatcher::ptx
