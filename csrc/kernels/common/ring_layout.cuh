// Where rows sit in the rings (torch-free), for every ring of the normal-mode kernels: the intranode
// NVLink rings, the internode NVLink hop and the internode RDMA rings. The host computes the sizes
// (moe_dispatcher/compiled/*.py: slot bytes, block bytes) with the same arithmetic.
//
// Buffer: the rings start at some offset of the receiver's buffer (intranode: kRingsOffset after the
// Control words), one block per sending peer, `peer_block_bytes` apart (at least C x slots x slot_bytes,
// rounded up by the host); inside a peer's block, one ring per channel, each `num_slots` slots of
// `slot_bytes` bytes:
//   ring (channel c, from peer p) = rings + p * peer_block_bytes + c * num_slots * slot_bytes
//   slot of ring row i            = ring + (i % num_slots) * slot_bytes
// Row numbers are the rings' monotonic counters (channel.cuh), never reset, so the slot of a row is its
// counter value modulo the ring size.
//
// Dispatch slot (DispatchSlot), 4-byte fields after the payload, no padding between them:
//   [payload hidden_bytes][scales S x int32][top-k expert K x int32][top-k weight K x f32][source token int32]
//   [tag int32: internode only; the RDMA hop's local-rank mask, the NVLink hop's source domain]
//   bytes = hidden_bytes + 4 S + 8 K + 4 (+ 4 internode), rounded up to 128 by the host (align_slot: every
//   slot starts on a cache line).
// Combine slot: [row hidden x dtype bytes][top-k weight K x f32], bytes = row_bytes + 4 K rounded up to 128.
// hidden_bytes is a multiple of 16, so the payload is copied in 16-byte vectors (copy.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe_ep {

// Ring (channel c, from peer p) of a buffer whose rings start at `rings`.
__device__ __forceinline__ uint8_t* ring_at(uint8_t* rings, size_t peer_block_bytes, int peer, int c, int num_slots,
                                            int slot_bytes) {
  return rings + peer * peer_block_bytes + static_cast<size_t>(c) * num_slots * slot_bytes;
}

// Slot of ring row `row` (a counter value).
template <typename Byte>  // uint8_t or const uint8_t
__device__ __forceinline__ Byte* ring_slot(Byte* ring, uint64_t row, int num_slots, int slot_bytes) {
  return ring + static_cast<size_t>(row % num_slots) * slot_bytes;
}

// The fields of a dispatch slot (see the file comment).
struct DispatchSlot {
  int hidden_bytes, num_scales, num_topk;
  __device__ int32_t* scales(uint8_t* s) const { return reinterpret_cast<int32_t*>(s + hidden_bytes); }
  __device__ int32_t* idx(uint8_t* s) const { return scales(s) + num_scales; }
  __device__ float* weights(uint8_t* s) const { return reinterpret_cast<float*>(idx(s) + num_topk); }
  __device__ int32_t* source(uint8_t* s) const { return reinterpret_cast<int32_t*>(weights(s) + num_topk); }
  __device__ int32_t* tag(uint8_t* s) const { return source(s) + 1; }
};

// Tokens [begin, end) of channel c when T tokens are split over C channels: ceil(T / C) consecutive tokens
// per channel (the last ones may hold fewer, or none). notify counts rows per channel with the same split.
__device__ __forceinline__ void channel_range(int num_tokens, int num_channels, int c, int& begin, int& end) {
  const int per = (num_tokens + num_channels - 1) / num_channels;
  begin = min(c * per, num_tokens);
  end = min(begin + per, num_tokens);
}

}  // namespace moe_ep
