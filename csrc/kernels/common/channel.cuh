// The channel FIFO: one ring of fixed-size slots carrying rows from a sender on one GPU to a receiver on
// another (or the same) GPU (torch-free). Its words live in the NVLink buffers' Control block
// (intranode/protocol.h); its slots are laid out by ring_layout.cuh. Two ways of driving it:
//   per warp (progress_board.cuh): the intranode dispatch and combine kernels; every copy warp waits for its
//     own row and one publisher warp per block moves the counters;
//   per group (ChannelSender / ChannelReceiver below): the internode kernels' NVLink hop; the group leader
//     waits for a batch of rows, the group copies them, a group barrier, then the leader moves the counter.
//
// Words of one ring (channel c, src -> dst); all are monotonic 64-bit counters that are never reset:
//   slots        in dst's buffer. Written by src with weak stores, read by dst (ld.cg) once published.
//   tail         in dst's buffer. Count of rows src has published. Written by src with st.release.sys,
//                after a barrier (group barrier, or the board's CTA release/acquire chain) that covers
//                every slot store of those rows; read by dst (wait.cuh: ld.acquire.sys, then a warp or
//                group barrier before the slot loads).
//   head         in src's buffer. Count of rows dst has consumed. Written by dst with st.release.sys,
//                after a barrier that follows every load of the consumed slots, so src may overwrite
//                them; read by src (ld.acquire.sys) to find free slots.
//   tail_copy    in src's buffer: src's own count (stored relaxed at each publication), read by the drain
//                check of src's sibling sender blocks and by src's next kernel.
//   head_copy    in dst's buffer: dst's own count, read at kernel start, written at kernel end.
// Slot of row number i: (i % num_slots). Because counters persist across calls, nothing has to be
// cleaned between calls; a sender only has to wait until dst drained what earlier calls sent before
// the slot layout (slot size, channel count) may change: see drain_previous().
//
// Threading of the group API: reserve / wait are called by one thread (the group leader), which then
// shares the outcome with its group through shared memory and a group barrier; advance() is called by
// every thread of the group with the same n (the leader also stores the flag).
#pragma once

#include <cstdint>

#include "kernels/common/ptx.cuh"
#include "kernels/common/ring_layout.cuh"
#include "kernels/common/wait.cuh"

namespace moe_ep {

struct ChannelSender {
  uint8_t* slots;            // dst's ring (peer-mapped)
  uint64_t* remote_tail;     // dst's tail word for this ring
  const uint64_t* head;      // head word in this GPU's buffer
  uint64_t* tail_copy;       // this GPU's copy of the tail
  int num_slots;
  int slot_bytes;
  uint64_t tail;             // register copy, identical in every thread of the group

  // Leader only: wait until n more rows fit (ring capacity minus rows dst has not consumed yet). The head is
  // written by dst (st.release.sys after its loads of the slots), so the rows written after this may reuse them.
  __device__ bool reserve(int n, const Watchdog& dog, int phase, int peer) const {
    uint64_t consumed;
    return wait_while(head, consumed, [&](uint64_t h) { return tail + n - h > static_cast<uint64_t>(num_slots); },
                      dog, phase, peer);
  }
  __device__ uint8_t* slot(int i) const {
    return ring_slot(slots, tail + i, num_slots, slot_bytes);
  }
  // Every thread of the group, after a group barrier that follows all slot stores of these rows.
  __device__ void advance(int n, bool leader) {
    tail += n;
    if (leader) {
      ptx::st_release_sys(remote_tail, tail);  // publishes the group's slot stores (barrier + release)
      *reinterpret_cast<volatile uint64_t*>(tail_copy) = tail;
    }
  }
};

struct ChannelReceiver {
  const uint8_t* slots;      // this GPU's ring
  const uint64_t* tail;      // tail word in this GPU's buffer
  uint64_t* remote_head;     // src's head word for this ring (peer-mapped)
  uint64_t* head_copy;       // this GPU's copy of the head
  int num_slots;
  int slot_bytes;
  uint64_t head;             // register copy, identical in every thread of the group

  // Leader only: wait until the tail reaches at least `until`; returns the tail seen (0 on timeout). The tail
  // is written by src (st.release.sys after a group barrier over its slot stores): the rows below it are in.
  __device__ uint64_t wait(uint64_t until, const Watchdog& dog, int phase, int peer) const {
    uint64_t published;
    return wait_while(tail, published, [&](uint64_t t) { return t < until; }, dog, phase, peer) ? published : 0;
  }
  __device__ const uint8_t* slot(uint64_t index) const {
    return ring_slot(slots, index, num_slots, slot_bytes);
  }
  // Every thread of the group, after a group barrier that follows all loads of these rows.
  __device__ void release(int n, bool leader) {
    if (n == 0) return;
    head += n;
    if (leader) ptx::st_release_sys(remote_head, head);  // src may now overwrite the consumed slots
  }
  __device__ void finish(bool leader) const {
    if (leader) *head_copy = head;  // read by the next kernel on this stream (kernel boundary orders it)
  }
};

// Leader only, before a sender writes its first row to `dst` in a call: every ring (any channel)
// from this GPU to dst must be drained of what earlier calls sent, because this call may lay the
// rings out differently (slot size, channel count). For each channel the current tail copy is read
// (a sibling block of this call may already have advanced it, which it did only after passing this
// same check, so waiting for its newer value only waits for rows that are being consumed anyway)
// and the head must reach it. heads/tail_copies are [channel][rank] arrays with `stride` ranks.
template <int kMaxChannels>
__device__ bool drain_previous(const uint64_t* heads, const uint64_t* tail_copies, int stride, int dst,
                               const Watchdog& dog, int phase) {
  for (int c = 0; c < kMaxChannels; ++c) {
    const uint64_t sent = *reinterpret_cast<const volatile uint64_t*>(tail_copies + c * stride + dst);
    if (!wait_at_least(heads + c * stride + dst, sent, dog, phase, dst)) return false;  // head: written by dst
  }
  return true;
}

}  // namespace moe_ep
