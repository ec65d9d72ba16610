// Memory-order helpers for cross-GPU protocols (torch-free).
//
// Scopes: ".sys" for words another GPU writes or reads over NVLink (peer-mapped CUDA IPC memory),
// ".gpu" for words only this GPU's blocks share. Every flag in the protocols names which one it uses.
// Data payloads use weak (plain) accesses; they are published/consumed through a release/acquire pair
// on the flag that guards them.
#pragma once

#include <cstdint>

namespace moe_ep::ptx {

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

// A 32-bit word of this GPU written by another block (the internode grid barrier's generation).
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
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

// GPU scope, 32-bit words that only this GPU's blocks share (a block's progress read by a sibling block: the
// internode pull combine's second source receiver block). The release / acquire pair publishes, like the
// system-scope one, everything the releasing thread did before (and, through a barrier, what the threads that
// joined it did), to a thread of any block of this GPU; cumulative, so the acquiring thread may pass it on at
// system scope. The relaxed load is for polls that end in one acquire (no L1 line is returned).
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int ld_relaxed_gpu(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int ld_volatile(const int* p) {
  int v;
  asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// ---------------------------------------------------------------- words shared by the warps of one block
// CTA-scope release/acquire on shared (or any) memory: a warp publishes its progress to a sibling warp of
// the same block; cheap (no system-wide drain), and cumulative like the system-scope pair above, so a
// sibling that acquires the value and then releases at system scope also publishes what this warp did
// before its release.
__device__ __forceinline__ void st_release_cta(int* p, int v) {
  asm volatile("st.release.cta.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire_cta(const int* p) {
  int v;
  asm volatile("ld.acquire.cta.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_add_release_cta(int* p, int v) {
  asm volatile("red.release.cta.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

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

}  // namespace moe_ep::ptx
