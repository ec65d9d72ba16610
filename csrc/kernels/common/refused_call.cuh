// A call that notify refused: its data kernels move nothing (torch-free; intranode and internode kernels).
//
// Who decides: notify (intranode/notify.cu, internode/notify.cu), after its barrier, from every source's
// signature words (and, internode, its flags words). Every rank reads the same words, so every rank refuses
// the same calls: those whose sources' signatures differ or report a problem (kFlagSignatureMismatch, which the
// host turns into SignatureMismatch on every rank), and, on its own rank only, a call whose notify gave up
// waiting (a timeout: the Buffer is unusable then, and this rank's tables were never derived).
//
// What a refused call's notify writes: the tables of a call in which no source sent anything (rank prefix
// matrix, recv_channel_offset, per-expert counts, the expert-major layout, internode fwd_offset: all 0; the
// mailbox's receive count 0, no num_worst_tokens overflow), except recv_channel_offset[0][0] = kRefusedCall
// (nvlink_buffer.h), which is 0 in every accepted call.
//
// What the data kernels do: every dispatch and combine kernel that reads the call's recv_channel_offset (the
// fresh dispatch, and the cached dispatches and combines along its handle, which keep the same tensor) tests
// that word at its start, before it touches a ring, a FIFO counter, a drain wait or the internode grid barrier;
// on kRefusedCall every block of the kernel returns after writing only its own outputs: num_worst_tokens
// padding (all rows, since the received count is 0) and zero combine rows. All ranks take the same decision,
// so no rank waits for a peer's rows, nothing is written through ring offsets computed from disagreeing
// sizes, and no head / tail / copy counter moves on any rank: the next call starts from the counters of the
// last accepted call, on every rank alike. The local passes after the dispatch (pair ranks, em_permute,
// em_unpermute) see a received count of 0 and an all-zero layout, i.e. no pairs: padding rows only.
//
// Memory ordering: notify writes the tables with plain global stores. A kernel that reads them runs after
// notify on the same stream (the fresh dispatch: the kernel boundary makes notify's stores visible) or on a
// stream joined after it (cached calls: the CommStream's events order every launch on a Buffer after the
// previous one, and an event wait makes the earlier kernels' stores visible too). Nothing writes the tables
// afterwards (a fresh call allocates its own), so a plain load suffices and needs no fence.
#pragma once

#include <cstdint>

#include "kernels/common/nvlink_buffer.h"

namespace moe_ep {

// Every thread of a dispatch / combine block, first: whether the call of this recv_channel_offset table
// ([R, C + 1], int32) was refused by its notify. One load of a word every block of the call reads alike.
__device__ __forceinline__ bool call_refused(const int* recv_channel_offset) {
  return *recv_channel_offset == nvlink::kRefusedCall;
}

// Every thread of one block: the combine outputs of tokens [begin, end) of a refused call, zero rows of
// row_bytes bytes (a multiple of 16) and zero top-k weights (out_topk_weights [T, num_topk], or null).
__device__ __forceinline__ void zero_refused_outputs(uint8_t* out, float* out_topk_weights, int begin, int end,
                                                     int row_bytes, int num_topk) {
  const int64_t vecs = static_cast<int64_t>(end - begin) * (row_bytes / 16);
  int4* rows = reinterpret_cast<int4*>(out + static_cast<int64_t>(begin) * row_bytes);
  for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) rows[i] = make_int4(0, 0, 0, 0);
  const int64_t weights = static_cast<int64_t>(end - begin) * num_topk;
  for (int64_t i = threadIdx.x; out_topk_weights != nullptr && i < weights; i += blockDim.x) {
    out_topk_weights[static_cast<int64_t>(begin) * num_topk + i] = 0.f;
  }
}

}  // namespace moe_ep
