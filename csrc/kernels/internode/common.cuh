// Device helpers of the internode kernels: buffer addressing and the RDMA ring (torch-free).
//
// RDMA ring (channel c, from the team member of domain x, to me): slots in MY symmetric buffer at
// rdma_recv_offset + x * rdma_domain_bytes + c * slots * slot_bytes (ring_layout.cuh); tail word RdmaControl::tail[c][x]
// in my buffer (written by x), head word RdmaControl::head[c][my domain] in x's buffer (written by me).
// Counters are monotonic u64 and never reset, as for the NVLink FIFOs (channel.cuh).
//
// Across domains only public NVSHMEM calls are used:
//   data:   by one of two paths, chosen per destination PE (rdma_peer_base), never per row:
//           mapped (nvshmem_ptr of the destination PE is not null: P2P over NVLink, the emulated
//             domains of one host, or a multi-node NVLink fabric): plain stores through the mapped
//             pointer, then a per-lane fence.acq_rel.sys (rdma_mapped_stores_done): the dispatch sender
//             writes its rows straight into the destination slots, and so does the pull combine's forwarder
//             with its partials; the FIFO combine stages its partials and the warp that staged them copies
//             them into the same slot index of the destination ring (rdma_put_rows), kUnroll 16-byte loads
//             in flight per lane;
//           not mapped (a NIC between the domains): rows are staged in the symmetric staging slots, and
//             that warp puts them into the same slot index of the destination ring
//             (nvshmemx_putmem_nbi_warp), completed by nvshmem_quiet (rdma_put_rows);
//           after a group barrier one thread publishes the tail with
//           nvshmemx_signal_op(tail, value, NVSHMEM_SIGNAL_SET, pe) behind a system fence.
//   credit: nvshmemx_signal_op(head, value, NVSHMEM_SIGNAL_SET, pe), issued after a CTA barrier that
//           follows every load of the consumed slots.
//   polling: the waiting side reads its own word with ld.acquire.sys (never a peer's memory).
// A ring between a rank and itself (its own domain) skips NVSHMEM: the sender writes its own
// receive slots directly and publishes the tail with st.release.sys; the credit likewise.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "kernels/common/channel.cuh"
#include "kernels/common/copy.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/common/ring_layout.cuh"
#include "kernels/common/ring_signature.cuh"
#include "kernels/internode/protocol.h"

namespace moe_ep::internode {

__device__ __forceinline__ RdmaControl* rdma_ctl(const Common& c) { return reinterpret_cast<RdmaControl*>(c.rdma); }
__device__ __forceinline__ nvlink::Control* nvl_ctl(const Common& c, int local) {
  return reinterpret_cast<nvlink::Control*>(c.nvl[local]);
}
__device__ __forceinline__ int team_pe(const Common& c, int domain) { return domain * c.nvl_size + c.local; }

// Ring (c, from domain x) in this rank's symmetric buffer (receive side), or the same ring's
// staging area for sends to domain x (send side; slot i stages the row put into slot i of x's ring).
__device__ __forceinline__ uint8_t* rdma_recv_ring(const Common& c, int x, int ch, int slots, int slot_bytes) {
  return ring_at(c.rdma + c.layout.rdma_recv_offset, c.layout.rdma_domain_bytes, x, ch, slots, slot_bytes);
}
__device__ __forceinline__ uint8_t* rdma_send_ring(const Common& c, int x, int ch, int slots, int slot_bytes) {
  return ring_at(c.rdma + c.layout.rdma_send_offset, c.layout.rdma_domain_bytes, x, ch, slots, slot_bytes);
}
// The slot array that this rank writes for rows going to domain x: its own receive ring when x is
// its domain (no NVSHMEM), else its staging ring for x.
__device__ __forceinline__ uint8_t* rdma_write_ring(const Common& c, int x, int ch, int slots, int slot_bytes) {
  return x == c.domain ? rdma_recv_ring(c, c.domain, ch, slots, slot_bytes) : rdma_send_ring(c, x, ch, slots, slot_bytes);
}

// NVL ring (channel ch, from local rank src) inside the NVLink buffer `base` of its receiver.
__device__ __forceinline__ uint8_t* nvl_ring(const Common& c, uint8_t* base, int src, int ch, int slots, int slot_bytes) {
  return ring_at(base + c.layout.nvl_rings_offset, c.layout.nvl_src_block_bytes, src, ch, slots, slot_bytes);
}

// The team member of domain x's symmetric RDMA buffer as this GPU maps it (nvshmem_ptr of my own base: every
// symmetric offset is the same there), or null when it is not mapped (a NIC between the domains: rows go by
// NVSHMEM puts) and for my own domain (rows are written in place). One lookup per block (or warp) and
// destination domain, passed to every rdma_put_rows of that domain.
__device__ __forceinline__ uint8_t* rdma_peer_base(const Common& c, int x) {
  return x == c.domain ? nullptr : static_cast<uint8_t*>(nvshmem_ptr(c.rdma, team_pe(c, x)));
}

// Ring (ch, my domain) of the team member of domain x, as this GPU maps it (peer = rdma_peer_base(c, x), not null).
__device__ __forceinline__ uint8_t* rdma_mapped_ring(const Common& c, uint8_t* peer, int ch, int slots,
                                                     int slot_bytes) {
  return peer + (rdma_recv_ring(c, c.domain, ch, slots, slot_bytes) - c.rdma);
}

// One warp, after its lanes stored rows into x's ring through the mapped pointer (rdma_put_rows' mapped path, or the
// dispatch sender's rows written there directly): every lane's fence.acq_rel.sys, then the warp barrier. Each
// lane's stores into x's slots precede its system fence, which precedes the barrier, and through it (and the group
// barrier, or the board's CTA release / acquire) the publishing thread's fence.sys + signal SET of the tail
// (rdma_signal_tail): a release pattern at system scope, cumulative over every lane's stores, so x's ld.acquire.sys
// of the tail sees the rows. The per-lane fence also makes each lane's remote stores performed at system scope
// before the warp reports them done, the role nvshmem_quiet has for a put.
__device__ __forceinline__ void rdma_mapped_stores_done() {
  ptx::fence_sys();
  __syncwarp();
}

// One warp: the mapped path's copy of rdma_put_rows (n 16-byte vectors, kUnroll loads in flight per lane), out of
// line: inlined into the combine's worker warps, its kUnroll x 4 data registers beside their live state spilled.
// Internal linkage (static), so that ptxas compiles it under each calling kernel's register limit.
template <int kUnroll>
static __device__ __noinline__ void mapped_copy(int4* to, const int4* from, int n, int lane) {
  warp_copy<true, kUnroll>(to, from, n, lane);
}

// One warp: move rows [first, first + n) of my staging ring for domain x into the same slots of x's ring
// (c, my domain), split where the ring wraps, so that they are visible at x before the tail that follows.
// Every warp of a group moves the rows it staged itself, right after staging them, so all warps move data
// over the link at once (the pull combine, unmapped x: block 3c's warps move the forwarder block's chunks); the tail is
// published afterwards by rdma_signal_tail. peer: rdma_peer_base(c, x) (the dispatch sender passes null: where x
// is mapped it wrote its rows into x's slots itself and calls rdma_mapped_stores_done instead).
//   mapped (peer != null): the warp copies the run with plain 16-byte loads (ld.cg: the staging slots were
//     written by this warp or, pull combine, by another block of this GPU) and stores through the mapped
//     pointer, kUnroll loads in flight per lane (NVSHMEM's warp put over P2P keeps one, which made the
//     combine's puts the bottleneck), then rdma_mapped_stores_done (every lane fence.acq_rel.sys, warp
//     barrier: the ordering argument is there). It replaces the quiet: nothing of this path is an NVSHMEM
//     operation.
//   not mapped (peer == null): nvshmemx_putmem_nbi_warp, completed (delivered at x) by one lane's
//     nvshmem_quiet, whatever the transport; after it and the barrier that follows, any thread may publish.
// Both paths: every store into x's ring follows the credit acquire that covers the slots (the caller's), and
// every load of a staging slot precedes the tail, hence the credit that lets the next call rewrite it.
// Precondition: this warp staged the rows (plain stores), or acquired a word released after their staging
// (the pull combine's RdmaControl::staged); the __syncwarp below then orders those stores, or that acquire,
// before the copy's loads. And n <= slots, slot_bytes a multiple of 16 (checked by the bindings:
// check_geometry). Nothing to do for my own domain (rows are written in place).
template <int kUnroll>
__device__ __forceinline__ void rdma_put_rows(const Common& c, uint8_t* peer, int x, int ch, uint64_t first, int n,
                                              int slots, int slot_bytes, int lane) {
  if (x == c.domain || n <= 0) return;
  __syncwarp();  // the lanes' staging stores (or the acquire that published them) before the warp-wide copy reads them
  uint8_t* src = rdma_send_ring(c, x, ch, slots, slot_bytes);
  uint8_t* dst = rdma_recv_ring(c, c.domain, ch, slots, slot_bytes);  // same offsets in x's buffer
  const int begin = static_cast<int>(first % slots);
  const int n1 = min(n, slots - begin), n2 = n - n1;
  if (peer != nullptr) {
    int4* to = reinterpret_cast<int4*>(rdma_mapped_ring(c, peer, ch, slots, slot_bytes));
    const int4* from = reinterpret_cast<const int4*>(src);
    const int vecs_per_slot = slot_bytes / 16;
    mapped_copy<kUnroll>(to + begin * vecs_per_slot, from + begin * vecs_per_slot, n1 * vecs_per_slot, lane);
    if (n2 > 0) mapped_copy<kUnroll>(to, from, n2 * vecs_per_slot, lane);
    rdma_mapped_stores_done();  // this lane's stores into x's ring before the warp barrier (and so before the tail)
    return;
  }
  const int pe = team_pe(c, x);
  nvshmemx_putmem_nbi_warp(dst + static_cast<size_t>(begin) * slot_bytes, src + static_cast<size_t>(begin) * slot_bytes,
                           static_cast<size_t>(n1) * slot_bytes, pe);
  if (n2 > 0) nvshmemx_putmem_nbi_warp(dst, src, static_cast<size_t>(n2) * slot_bytes, pe);
  __syncwarp();
  // Completion (delivery at x) of this warp's puts, whatever the transport: after it and the group
  // barrier that follows, the tail may be published by any thread of the group.
  if (lane == 0) nvshmem_quiet();
  __syncwarp();
}

// One thread: publish the tail of ring (ch, my domain) at domain x: x's tail[ch][my domain] = tail.
// Precondition: a group barrier after every warp's rdma_put_rows (remote) or slot stores (my domain).
// Remote: a signal SET after the puts were completed (quiet), so x sees the rows once it sees the
// tail. My domain: st.release.sys, which with the barrier publishes every thread's slot stores.
__device__ __forceinline__ void rdma_signal_tail(const Common& c, int x, int ch, uint64_t tail) {
  uint64_t* word = &rdma_ctl(c)->tail[ch][c.domain];  // symmetric address of x's word
  if (x == c.domain) {
    ptx::st_release_sys(word, tail);
  } else {
    // Over P2P a SET signal is a plain (relaxed) store: this fence makes it a release, cumulative over
    // every warp's stores ordered before it by the group barrier (other transports: the quiets).
    __threadfence_system();
    nvshmemx_signal_op(word, tail, NVSHMEM_SIGNAL_SET, team_pe(c, x));
  }
}

// One thread: return the credit of ring (ch, from x): x's head[ch][my domain] = head. Precondition:
// a CTA barrier after every load of the consumed slots.
__device__ __forceinline__ void rdma_credit(const Common& c, int x, int ch, uint64_t head) {
  uint64_t* word = &rdma_ctl(c)->head[ch][c.domain];
  if (x == c.domain) {
    ptx::st_release_sys(word, head);
  } else {
    __threadfence_system();  // the slot loads (ordered by the barrier) before the relaxed SET over P2P
    nvshmemx_signal_op(word, head, NVSHMEM_SIGNAL_SET, team_pe(c, x));
  }
}

// One thread, after the drain of earlier calls (drain_previous_calls) and before its block's first tail signal to
// domain x: this call's RDMA ring signature (common/ring_signature.cuh) into x's RdmaControl::ring_signature[my
// domain]. Remote: a put completed here (nvshmem_quiet), so the tail signal that follows it (same thread, or
// another after a barrier; rdma_signal_tail's fence) publishes it with the rows. My domain: a plain store,
// published by the st.release.sys of the tail in the same way.
__device__ __forceinline__ void rdma_publish_signature(const Common& c, int x, uint64_t word) {
  uint64_t* dst = &rdma_ctl(c)->ring_signature[c.domain];  // symmetric address of x's word
  if (x == c.domain) {
    *reinterpret_cast<volatile uint64_t*>(dst) = word;
  } else {
    nvshmem_uint64_p(dst, word, team_pe(c, x));
    nvshmem_quiet();
  }
}

// Every block of a dispatch / combine kernel, first thing: the previous calls' drain, then a grid
// barrier. Returns false (in every thread) when some wait of this rank timed out (now or in an
// earlier call: the claim word is sticky), and the kernel must exit.
//
// Why: the rings' geometry (channel count, slot size) may differ from the previous call's, so before
// this rank writes any ring it produces into (RDMA rings to every domain x, NVLink FIFOs to every
// local rank j, any channel) the consumer must have consumed everything earlier calls put there:
// head >= tail_copy for all of them. The tail_copy words must be read BEFORE any block of this call
// advances them: waiting for rows of the current call would wait for consumers that may themselves
// wait (through another rank's blocks) for this block, a cycle across ranks that deadlocks (a
// combine receiver needs every domain's partial of a batch or chunk, a combine forwarder every local rank's
// rows). Hence every block checks a share of the (channel, peer) pairs and no block sends before
// the grid barrier, i.e. before all checks are done. All blocks are co-resident (required anyway).
__device__ __forceinline__ void grid_sync(RdmaControl* ctl, const Watchdog& dog, int rank) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t g = *reinterpret_cast<volatile uint32_t*>(&ctl->grid_gen);  // read before arriving: it
                                                                                // cannot change until every block arrived
    __threadfence();
    if (atomicAdd(&ctl->grid_arrived, 1u) == gridDim.x - 1) {
      atomicExch(&ctl->grid_arrived, 0u);  // before the bump: nobody arrives again before it
      __threadfence();
      atomicAdd(&ctl->grid_gen, 1u);
    } else {
      // grid_gen: written by the last block to arrive (fence, then the atomic bump); a timeout is recorded
      // and the sticky claim word makes every block leave after the barrier.
      uint32_t now;
      wait_while(&ctl->grid_gen, now, [&](uint32_t v) { return v == g; }, dog, kPhaseRdmaDrain, rank);
    }
    __threadfence();
  }
  __syncthreads();
}

__device__ __forceinline__ bool drain_previous_calls(const Common& c, const Watchdog& dog) {
  RdmaControl* ctl = rdma_ctl(c);
  nvlink::Control* nctl = nvl_ctl(c, c.local);
  const int D = c.num_domains, nvl = c.nvl_size;
  const int rdma_pairs = kMaxChannels * D, total = rdma_pairs + kMaxChannels * nvl;
  bool ok = true;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; ok && i < total; i += gridDim.x * blockDim.x) {
    if (i < rdma_pairs) {
      const int ch = i / D, x = i % D;
      const uint64_t sent = *reinterpret_cast<const volatile uint64_t*>(&ctl->tail_copy[ch][x]);
      ok = wait_at_least(&ctl->head[ch][x], sent, dog, kPhaseRdmaDrain, team_pe(c, x));
    } else {
      const int k = i - rdma_pairs, ch = k / nvl, j = k % nvl;
      const uint64_t sent = *reinterpret_cast<const volatile uint64_t*>(&nctl->tail_copy[ch][j]);
      ok = wait_at_least(&nctl->fifo_head[ch][j], sent, dog, kPhaseNvlDrain, c.domain * nvl + j);
    }
  }
  grid_sync(ctl, dog, c.rank);
  return *reinterpret_cast<const volatile int32_t*>(&nctl->timeout_claim) == 0;
}

}  // namespace moe_ep::internode
