// Device helpers of the internode kernels: buffer addressing and the RDMA ring (torch-free).
//
// RDMA ring (channel c, from the team member of domain x, to me): slots in MY symmetric buffer at
// rdma_recv_offset + x * rdma_domain_bytes + c * slots * slot_bytes; tail word RdmaControl::tail[c][x]
// in my buffer (written by x), head word RdmaControl::head[c][my domain] in x's buffer (written by me).
// Counters are monotonic u64 and never reset, as for the NVLink FIFOs (channel.cuh).
//
// Across domains only public NVSHMEM calls are used:
//   data:   nvshmemx_putmem_nbi_warp from the sender's symmetric staging slots (same slot index as
//           the destination), then nvshmem_fence and nvshmemx_putmem_signal_nbi_warp for the last
//           segment, which sets the tail: NVSHMEM delivers the signal after the data of that put,
//           and the fence orders the earlier segment before it.
//   credit: nvshmemx_signal_op(head, value, NVSHMEM_SIGNAL_SET, pe), issued after a CTA barrier that
//           follows every load of the consumed slots.
//   polling: the waiting side reads its own word with ld.acquire.sys (never a peer's memory).
// A ring between a rank and itself (its own domain) skips NVSHMEM: the sender writes its own
// receive slots directly and publishes the tail with st.release.sys; the credit likewise.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "kernels/common/channel.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/internode/protocol.h"

namespace moe_dispatcher::internode {

__device__ __forceinline__ RdmaControl* rdma_ctl(const Common& c) { return reinterpret_cast<RdmaControl*>(c.rdma); }
__device__ __forceinline__ intranode::Control* nvl_ctl(const Common& c, int local) {
  return reinterpret_cast<intranode::Control*>(c.nvl[local]);
}
__device__ __forceinline__ int team_pe(const Common& c, int domain) { return domain * c.nvl_size + c.local; }

// Ring (c, from domain x) in this rank's symmetric buffer (receive side), or the same ring's
// staging area for sends to domain x (send side; slot i stages the row put into slot i of x's ring).
__device__ __forceinline__ uint8_t* rdma_recv_ring(const Common& c, int x, int ch, int slots, int slot_bytes) {
  return c.rdma + c.layout.rdma_recv_offset + x * c.layout.rdma_domain_bytes +
         static_cast<size_t>(ch) * slots * slot_bytes;
}
__device__ __forceinline__ uint8_t* rdma_send_ring(const Common& c, int x, int ch, int slots, int slot_bytes) {
  return c.rdma + c.layout.rdma_send_offset + x * c.layout.rdma_domain_bytes +
         static_cast<size_t>(ch) * slots * slot_bytes;
}
// The slot array that this rank writes for rows going to domain x: its own receive ring when x is
// its domain (no NVSHMEM), else its staging ring for x.
__device__ __forceinline__ uint8_t* rdma_write_ring(const Common& c, int x, int ch, int slots, int slot_bytes) {
  return x == c.domain ? rdma_recv_ring(c, c.domain, ch, slots, slot_bytes) : rdma_send_ring(c, x, ch, slots, slot_bytes);
}

// NVL ring (channel ch, from local rank src) inside the NVLink buffer `base` of its receiver.
__device__ __forceinline__ uint8_t* nvl_ring(const Common& c, uint8_t* base, int src, int ch, int slots, int slot_bytes) {
  return base + c.layout.nvl_rings_offset + src * c.layout.nvl_src_block_bytes + static_cast<size_t>(ch) * slots * slot_bytes;
}

// One warp: publish rows [first, first + n) of ring (ch, my domain) at domain x (n <= slots).
// Precondition: the rows are in this rank's write ring (rdma_write_ring) and every thread that
// wrote them passed a CTA barrier with this warp. Sets x's tail[ch][my domain] to first + n.
__device__ __forceinline__ void rdma_publish(const Common& c, int x, int ch, uint64_t first, int n, int slots,
                                             int slot_bytes, int lane) {
  RdmaControl* ctl = rdma_ctl(c);
  uint64_t* tail_word = &ctl->tail[ch][c.domain];  // symmetric address of x's word
  const uint64_t new_tail = first + n;
  if (x == c.domain) {
    if (lane == 0) ptx::st_release_sys(tail_word, new_tail);
    __syncwarp();
    return;
  }
  const int pe = team_pe(c, x);
  uint8_t* src = rdma_send_ring(c, x, ch, slots, slot_bytes);
  uint8_t* dst = rdma_recv_ring(c, c.domain, ch, slots, slot_bytes);  // same offsets in x's buffer
  const int begin = static_cast<int>(first % slots);
  const int n1 = min(n, slots - begin), n2 = n - n1;
  if (lane == 0) __threadfence_system();  // the CTA's staging stores, before the NIC/peer reads them
  __syncwarp();
  if (n2 > 0) {
    nvshmemx_putmem_nbi_warp(dst + static_cast<size_t>(begin) * slot_bytes, src + static_cast<size_t>(begin) * slot_bytes,
                             static_cast<size_t>(n1) * slot_bytes, pe);
    nvshmem_fence();
    nvshmemx_putmem_signal_nbi_warp(dst, src, static_cast<size_t>(n2) * slot_bytes, tail_word, new_tail,
                                    NVSHMEM_SIGNAL_SET, pe);
  } else {
    nvshmemx_putmem_signal_nbi_warp(dst + static_cast<size_t>(begin) * slot_bytes, src + static_cast<size_t>(begin) * slot_bytes,
                                    static_cast<size_t>(n1) * slot_bytes, tail_word, new_tail, NVSHMEM_SIGNAL_SET, pe);
  }
}

// One thread: return the credit of ring (ch, from x): x's head[ch][my domain] = head. Precondition:
// a CTA barrier after every load of the consumed slots.
__device__ __forceinline__ void rdma_credit(const Common& c, int x, int ch, uint64_t head) {
  uint64_t* word = &rdma_ctl(c)->head[ch][c.domain];
  if (x == c.domain) {
    ptx::st_release_sys(word, head);
  } else {
    nvshmemx_signal_op(word, head, NVSHMEM_SIGNAL_SET, team_pe(c, x));
  }
}

// One thread: wait until `word` (local) reaches `until`; false on timeout (recorded).
__device__ __forceinline__ bool wait_at_least(const uint64_t* word, uint64_t until, const Watchdog& dog, int phase,
                                              int peer) {
  while (ptx::ld_acquire_sys(word) < until) {
    if (dog.expired(phase, peer)) return false;
  }
  return true;
}

// One thread, before the first row this call sends to domain x over RDMA: every ring (any channel)
// to x must have been drained of what earlier calls sent (the layout may change between calls).
__device__ __forceinline__ bool rdma_drain_previous(const Common& c, int x, const Watchdog& dog) {
  RdmaControl* ctl = rdma_ctl(c);
  for (int ch = 0; ch < kMaxChannels; ++ch) {
    const uint64_t sent = *reinterpret_cast<const volatile uint64_t*>(&ctl->tail_copy[ch][x]);
    if (!wait_at_least(&ctl->head[ch][x], sent, dog, kPhaseRdmaDrain, team_pe(c, x))) return false;
  }
  return true;
}

// Tokens [begin, end) of channel ch when T tokens are split over C channels (as intranode).
__device__ __forceinline__ void channel_range(int num_tokens, int num_channels, int ch, int& begin, int& end) {
  const int per = (num_tokens + num_channels - 1) / num_channels;
  begin = min(ch * per, num_tokens);
  end = min(begin + per, num_tokens);
}

}  // namespace moe_dispatcher::internode
