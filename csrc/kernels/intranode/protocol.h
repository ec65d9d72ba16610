// Intranode (NVLink, CUDA IPC) protocol: the kernel arguments and limits, on the NVLink buffer and mailbox of
// common/nvlink_buffer.h. Plain C++ (no device code, no torch): included by the kernels,
// the runtime and the bindings. docs/intranode.md describes the protocol.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/nvlink_buffer.h"

namespace moe_ep::intranode {

// The NVLink buffer's layout and the mailbox are shared with the internode kernels (common/nvlink_buffer.h).
using nvlink::Control;
using nvlink::DirectCallWords;
using nvlink::DirectOutputBlocks;
using nvlink::kBadIdOutOfRange;
using nvlink::kBadIdRepeated;
using nvlink::kFlagLayoutMismatch;
using nvlink::kFlagSignatureMismatch;
using nvlink::kMaxChannels;
using nvlink::kMaxChunk;
using nvlink::kMaxLocalExperts;
using nvlink::kMaxRanks;
using nvlink::kMaxTopk;
using nvlink::kNotifyChannels;
using nvlink::kNotifyCounts;
using nvlink::kNotifyExperts;
using nvlink::kNotifyFlags;
using nvlink::kNotifySignatureHash;
using nvlink::kNotifySignatureProblem;
using nvlink::kProblemIdOutOfRange;
using nvlink::kProblemIdRepeated;
using nvlink::kProblemRingSignature;
using nvlink::kRefusedCall;
using nvlink::kNotifyStride;
using nvlink::kRingsOffset;
using nvlink::Mailbox;
using nvlink::PullInputBlocks;

constexpr int kWarps = 24;              // copy warps of a dispatch block (the publisher warp comes on top)

// Phases named in timeout errors.
enum Phase : int32_t {
  kPhaseNotify = 1,        // notify barrier: waiting for a peer to arrive
  kPhaseDispatchSend = 2,  // dispatch sender: waiting for free slots in a peer's ring
  kPhaseDispatchRecv = 3,  // dispatch receiver: waiting for rows from a peer
  kPhaseCombineSend = 4,
  kPhaseCombineRecv = 5,
  kPhaseDrain = 6,         // sender: waiting for a peer to drain what an earlier call sent
  kPhaseDirectReady = 7,   // direct dispatch sender: waiting for a peer's kernel to start (its outputs ready)
  kPhaseDirectArrive = 8,  // direct dispatch receiver: waiting for a peer's blocks to finish writing rows here
  kPhasePullReady = 9,     // pull combine: waiting for a peer's kernel to start (its input ready)
  kPhasePullArrive = 10,   // pull combine: waiting for a peer's blocks to finish reading my input
};

struct Common {
  uint8_t* peers[kMaxRanks];  // every rank's NVLink buffer as mapped in this process (own = local)
  int rank;
  int num_ranks;
  Mailbox* mailbox;           // device pointer of the mapped mailbox
  uint64_t timeout_ns;
  size_t src_block_bytes;     // ring bytes per source rank in each buffer (after kRingsOffset)
};

struct NotifyArgs {
  Common c;
  const bool* is_token_in_rank;      // [T, R]
  const int* num_tokens_per_rank;    // [R] (checked against is_token_in_rank)
  const int* num_tokens_per_expert;  // [E]
  int num_tokens, num_experts, num_channels, expert_alignment, num_worst_tokens, seq;
  int* rank_prefix_matrix;           // out [R, R]
  int* recv_channel_offset;          // out [R, C + 1]: first row of channel c from source s; [s][C] = end
  int* em_layout;                    // out, expert-major dispatch only (else null): see ExpertMajorLayout
  int* send_row_offset;              // out [R, C] or null: the row of destination d's output where my channel
                                     // c's rows to d start (direct dispatch); all 0 in a refused call
  int signature_hash;                // hash of this call's signature words (moe_dispatcher/signature.py)
  int problem;                       // this rank's problem word (0: none); notify adds the layout kernel's
  int* bad_expert_ids;               // Control::bad_expert_ids of this rank (read and cleared), or null
};

// Expert-major layout table, int32, computed by notify from every source's per-expert counts (L local
// experts, R ranks). Expert l's rows are [start[l], start[l + 1]): first its count[l] pairs, then zero
// padding rows up to a multiple of expert_alignment. base[s][l] is where source s's pairs for l begin:
// start[l] + sum over s' < s of source s' count for l. start[L] is the number of rows needed.
struct ExpertMajorLayout {
  int num_ranks, num_local;
  __host__ __device__ static int words(int r, int l) { return r * l + (l + 1) + 2 * l; }
  __host__ __device__ int base(int s, int l) const { return s * num_local + l; }
  __host__ __device__ int start(int l) const { return num_ranks * num_local + l; }
  __host__ __device__ int count(int l) const { return num_ranks * num_local + num_local + 1 + l; }
  __host__ __device__ int padded(int l) const { return num_ranks * num_local + 2 * num_local + 1 + l; }
};

// For each (row t, slot k) of an int64 [T, K] expert table routed to expert e, its rank among the table's
// pairs routed to e, in (t, k) order; -1 for unused slots (e outside [0, E)). The user: the expert-major
// dispatch's receiver, over the rank-major received top-k (E = local experts, row_limit = the received count
// on the device: rows at or past it are neither counted nor written). workspace: int32 [blocks, E].
struct PairRankArgs {
  const int64_t* topk_idx;  // [T, K]
  int num_tokens, num_topk, num_experts;
  int* pair_rank;           // out [T, K]
  int* workspace;           // [pair_rank_blocks(T), E]
  const int* row_limit;     // device int or null (all T rows)
};
constexpr int kPairRankTokens = 64;  // rows per block of the pair-rank kernels
inline int pair_rank_blocks(int num_tokens) { return (num_tokens + kPairRankTokens - 1) / kPairRankTokens; }

struct DispatchArgs {
  Common c;
  const uint8_t* x;          // [T, hidden_bytes]
  const int32_t* scales;     // [T, S] 4-byte scales or null
  const int64_t* topk_idx;   // [T, K] or null (cached dispatch)
  const float* topk_weights;  // [T, K] or null
  const bool* is_token_in_rank;
  const int* recv_channel_offset;  // [R, C + 1]
  uint8_t* recv_x;           // [rows, hidden_bytes]
  int32_t* recv_scales;      // [rows, S]
  int64_t* recv_topk_idx;    // [rows, K]
  float* recv_topk_weights;  // [rows, K]
  int* recv_src_idx;         // [rows] or null (cached dispatch)
  int num_tokens, hidden_bytes, num_scales, num_topk, experts_per_rank;
  int num_rows;              // rows of the outputs (num_worst_tokens, or the received count)
  int pad_rows;              // 1: fill rows past the received count (num_worst_tokens): zeros, -1
  int num_channels;
  int chunk;                 // the sender publishes its tail every `chunk` rows at least (at most half a ring)
  int num_slots, slot_bytes;
  uint64_t ring_signature;   // cached dispatch: this call's ring signature (common/ring_signature.cuh); 0: fresh
};

// Direct dispatch (dispatch_direct.cu): every block a sender, rows written straight to their final row in the
// destination's OUTPUT tensors, which the destination allocated in memory every peer has mapped (its NVLink
// buffer: the peer pool after the rings, moe_dispatcher/compiled/peer_pool.py): no staging, no copy out.
// A rank's outputs of one call are two blocks of that memory, each array starting at a 16-byte multiple: the
// payload (DirectPayload: x [rows, hidden_bytes], then scales [rows, S] int32) and, in a fresh call, the meta
// block (DirectMeta: top-k idx [rows, K] int64, weights [rows, K] float32, source index [rows] int32), apart so
// that the handle, which keeps the source index, does not keep the payload's memory. The host carves its output
// tensors from the blocks with these offsets (intranode_bindings.cpp, direct_dispatch).
struct DirectPayload {
  int64_t rows, hidden_bytes, num_scales;
  __host__ __device__ static int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }
  __host__ __device__ int64_t x_offset() const { return 0; }
  __host__ __device__ int64_t scales_offset() const { return up16(rows * hidden_bytes); }
  __host__ __device__ int64_t bytes() const { return scales_offset() + up16(rows * num_scales * 4); }
};
struct DirectMeta {
  int64_t rows, num_topk;
  __host__ __device__ static int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }
  __host__ __device__ int64_t idx_offset() const { return 0; }
  __host__ __device__ int64_t weights_offset() const { return up16(rows * num_topk * 8); }
  __host__ __device__ int64_t src_offset() const { return weights_offset() + up16(rows * num_topk * 4); }
  __host__ __device__ int64_t bytes() const { return src_offset() + up16(rows * 4); }
};

struct DirectDispatchArgs {
  Common c;
  const uint8_t* x;                // [T, hidden_bytes]
  const int32_t* scales;           // [T, S] 4-byte scales or null
  const int64_t* topk_idx;         // [T, K] or null
  const float* topk_weights;       // [T, K] or null
  const bool* is_token_in_rank;    // [T, R]
  const int* recv_channel_offset;  // [R, C + 1]: [0][0] the refused-call word, [R-1][C] my received count
  const int* send_row_offset;      // [R, C]: notify's, or kept in the handle for cached dispatch
  // Published per call (Control::direct_*): where MY output blocks lie in my NVLink buffer (16-aligned), -1 when
  // not peer-mapped (then every rank's call is missed: the ring kernel moves it); my rows (received count, or
  // num_worst_tokens); and the call's layout word (0 in a fresh call, which notify checked; a cached call's ring
  // signature): a rank whose word differs makes every rank's call missed, and the ring kernel's signature check
  // reports it, so no rank writes rows of another layout into a peer's block.
  int64_t out_offset, meta_offset, out_rows;
  uint64_t layout;
  int* row_of_token;               // [T, R] or null (cached): out, the row of my token t in d's outputs (filled with
                                   // -1 by the host; -1 stays where t is not sent to d or its row was dropped)
  int num_tokens, hidden_bytes, num_scales, num_topk, experts_per_rank;
  int write_meta;                  // 1: top-k and source index too (fresh dispatch); 0: payload and scales only
  int pad_rows;                    // 1: fill my rows past the received count (num_worst_tokens) as the ring does
  int num_channels;
};
void launch_direct_dispatch(const DirectDispatchArgs& args, cudaStream_t stream);
// The ring kernel of a dispatch queued after its direct kernel: it moves the call only if the direct one missed it.
void launch_ring_fallback(const DispatchArgs& args, cudaStream_t stream);


enum CombineDtype : int { kBf16 = 0, kFp16 = 1, kFp32 = 2 };

struct CombineArgs {
  Common c;
  const uint8_t* x;                // [rows, hidden] received rows
  const float* topk_weights;       // [rows, K] or null
  const uint8_t* bias0;            // [T, hidden] or null
  const uint8_t* bias1;
  const bool* is_token_in_rank;    // [T, R]
  const int* recv_channel_offset;  // [R, C + 1]
  uint8_t* out;                    // [T, hidden]
  float* out_topk_weights;         // [T, K] or null
  int dtype, num_tokens, hidden, num_topk;
  int num_x_rows;                  // rows of x (num_worst_tokens may truncate what a channel lists)
  int num_channels;
  int chunk;                       // the sender publishes its tail every `chunk` rows at least (at most half a ring)
  int num_slots, slot_bytes;
  uint64_t ring_signature;         // this call's ring signature (common/ring_signature.cuh), nonzero
};

// Pull combine (combine_pull.cu): each rank reduces its own tokens by reading their rows straight from the
// holders' combine inputs, which every holder has in its peer pool (offsets published per call), instead of the
// holders pushing rows through rings. base: the ring combine's arguments (bias, outputs, routing, dtype; its
// ring fields unused); x and topk_weights of base are this rank's inputs, at x_offset / w_offset in its NVLink
// buffer.
struct CombinePullArgs {
  CombineArgs base;
  const int* row_of_token;  // [T, R]: my token t's row in rank d's received rows (the direct dispatch's), or -1
  int64_t x_offset;         // my x in my NVLink buffer, or -1: not peer-mapped (every rank's call is then missed)
  int64_t w_offset;         // my topk_weights in my NVLink buffer (when base.topk_weights is set)
};
void launch_combine_pull(const CombinePullArgs& args, cudaStream_t stream);
// The ring combine queued after a pull combine: it moves the call only if the pull one missed it.
void launch_ring_reduce_fallback(const CombineArgs& args, cudaStream_t stream);

// Launchers (csrc/kernels/intranode/*.cu). They check the launch and throw std::runtime_error.
void launch_notify(const NotifyArgs& args, cudaStream_t stream);
void launch_dispatch(const DispatchArgs& args, cudaStream_t stream);
void launch_combine(const CombineArgs& args, cudaStream_t stream);
void launch_pair_rank(const PairRankArgs& args, cudaStream_t stream);

// Expert-major dispatch, local pass after the rank-major dispatch kernel (em_permute.cu): received row
// n (n < min(num_rows, *received)) goes to each of its expert-major positions. Fresh (fresh = 1): the
// position of slot k is layout.start[recv_topk_idx[n][k]] + pair_rank[n][k] (dropped at or past em_rows),
// written to em_inverse with em_pair_row / em_pair_slot / em_weights; em_inverse and recv_src_idx are -1 for
// the rows past the received count (the rank-major dispatch ran without padding rows). Cached (fresh = 0):
// positions from em_inverse. Blocks from row_blocks on zero the
// padding rows (each expert's alignment rows, then [layout.start[L], em_rows)): payload, scales, and in
// fresh mode weight 0, pair row / slot -1.
struct EmPermuteArgs {
  const uint8_t* x;                 // [num_rows, hidden_bytes] rank-major received rows
  const int32_t* scales;            // [num_rows, S] or null
  const int64_t* recv_topk_idx;     // fresh: [num_rows, K] local expert of each slot, -1 where none
  const float* recv_topk_weights;   // fresh: [num_rows, K], read when em_weights is given
  const int* pair_rank;             // fresh: [num_rows, K] (launch_pair_rank over recv_topk_idx)
  const int* layout;                // ExpertMajorLayout table of the fresh call (notify)
  const int* received;              // device int: rows received (recv_channel_offset[R - 1][C])
  int fresh, num_rows, hidden_bytes, num_scales, num_topk, num_ranks, num_local, expert_alignment, em_rows;
  int row_blocks;                   // ceil(num_rows / rows per block)
  uint8_t* em_x;                    // [em_rows, hidden_bytes]
  int32_t* em_scales;               // [em_rows, S] or null
  float* em_weights;                // fresh: [em_rows] or null
  int* em_pair_row;                 // fresh: [em_rows]
  int* em_pair_slot;                // fresh: [em_rows]
  int* em_inverse;                  // [num_rows, K]: fresh out, cached in
  int* recv_src_idx;                // fresh: [num_rows], set to -1 past the received count
};
constexpr int kEmRowsPerBlock = 8;  // em_permute / em_unpermute: one warp per received row
void launch_em_permute(const EmPermuteArgs& args, int pad_blocks, cudaStream_t stream);

// Expert-major combine, local pass before the rank-major combine kernel (em_unpermute.cu): for received
// row r < min(num_rows, *received), out[r] = sum over slots k ascending with p = inverse[r][k] >= 0 of x[p]
// (times weights[p], the product rounded to float32), accumulated in float32 from 0 with no FMA contraction,
// rounded to the dtype: the same numbers, in the same order, as unpermute() in moe_dispatcher/expert_major.py. out_topk_weights[r][k] = topk_weights[p], 0 where no pair.
struct EmUnpermuteArgs {
  const uint8_t* x;                 // [M, hidden] expert-major rows
  const int* inverse;               // [num_rows, K]
  const float* weights;             // [M] or null
  const float* topk_weights;        // [M] or null (then out_topk_weights is null too)
  const int* received;              // device int: rows received
  uint8_t* out;                     // [num_rows, hidden]
  float* out_topk_weights;          // [num_rows, K] or null
  int dtype, hidden, num_rows, num_topk;
};
void launch_em_unpermute(const EmUnpermuteArgs& args, cudaStream_t stream);

}  // namespace moe_ep::intranode
