// Expert-major dispatch, local pass (docs/intranode.md): the rank-major dispatch kernel has put the received
// rows in (source rank, token) order; this kernel copies each of them to its expert-major rows, over the
// whole GPU.
//
// Fresh call: the position of received row n's slot k, routed to local expert l, is
//   start[l] + (rank of (n, k) among the received pairs for l in (row, slot) order)
// with start from notify's layout table and the rank from launch_pair_rank over the received top-k. The rows
// are in (source rank, token) order, so this is the contract's order (expert, source rank, token, slot), i.e.
// base[source][l] + the pair's rank among that source's pairs for l. Positions at or past em_rows (a
// num_worst_tokens overflow) are dropped. Cached call: positions from the fresh call's
// em_inverse.
//
// One warp per received row: lanes hold the row's K positions (compacted, so the store loop runs over its
// pairs only); every lane loads kPermuteUnroll 16-byte vectors of the row, then stores them to each position.
// Blocks past row_blocks zero the padding rows instead. Every output element has exactly one writer and
// nothing here reads what this kernel writes: plain loads and stores, no ordering needed; the outputs are read
// by later kernels on the stream.
#include "kernels/common/ptx.cuh"
#include "kernels/common/launch_check.cuh"
#include "kernels/intranode/protocol.h"

namespace moe_ep::intranode {
namespace {

constexpr int kPermuteThreads = kEmRowsPerBlock * 32;
constexpr int kPermuteUnroll = 8;  // 16-byte loads in flight per lane
constexpr int kPermuteBlocksPerSm = 4;  // 32 warps per SM (56 registers on sm_90a, no spills)

// Slot `lane`'s position for received row n (-1: none); a fresh call also records it.
__device__ __forceinline__ int pair_position(const EmPermuteArgs& a, int64_t n, int lane) {
  const int k = a.num_topk;
  if (lane >= k) return -1;
  const int64_t at = n * k + lane;
  if (!a.fresh) return a.em_inverse[at];
  const ExpertMajorLayout lay{a.num_ranks, a.num_local};
  const int64_t l = a.recv_topk_idx[at];
  int pos = -1;
  if (l >= 0 && l < a.num_local) {
    pos = a.layout[lay.start(static_cast<int>(l))] + a.pair_rank[at];
    if (pos >= a.em_rows) pos = -1;  // past num_worst_tokens: dropped, reported through rows_needed
  }
  a.em_inverse[at] = pos;
  if (pos >= 0) {
    a.em_pair_row[pos] = static_cast<int>(n);
    a.em_pair_slot[pos] = lane;
    if (a.em_weights != nullptr) a.em_weights[pos] = a.recv_topk_weights[at];
  }
  return pos;
}

__device__ void permute_row(const EmPermuteArgs& a, int64_t n, int lane) {
  const int pos = pair_position(a, n, lane);
  // Compact the valid positions: lane i holds the i-th one (slot order); count is warp-uniform.
  const unsigned valid = __ballot_sync(0xffffffffu, pos >= 0);
  const int count = __popc(valid);
  int cpos = -1;
  for (unsigned rest = valid, i = 0; rest != 0; rest &= rest - 1, ++i) {
    const int p = __shfl_sync(0xffffffffu, pos, __ffs(rest) - 1);
    if (lane == static_cast<int>(i)) cpos = p;
  }
  if (count == 0) return;
  const int vecs = a.hidden_bytes / 16;
  const int4* src = reinterpret_cast<const int4*>(a.x + n * a.hidden_bytes);
#pragma unroll 1
  for (int v0 = 0; v0 < vecs; v0 += 32 * kPermuteUnroll) {  // the same iterations on every lane
    int4 v[kPermuteUnroll];
#pragma unroll
    for (int u = 0; u < kPermuteUnroll; ++u) {
      const int i = v0 + u * 32 + lane;
      if (i < vecs) v[u] = ptx::ld_nc_v4(src + i);
    }
#pragma unroll 1
    for (int j = 0; j < count; ++j) {
      const int p = __shfl_sync(0xffffffffu, cpos, j);
      int4* dst = reinterpret_cast<int4*>(a.em_x + static_cast<int64_t>(p) * a.hidden_bytes);
#pragma unroll
      for (int u = 0; u < kPermuteUnroll; ++u) {
        const int i = v0 + u * 32 + lane;
        if (i < vecs) dst[i] = v[u];
      }
    }
  }
  if (a.scales != nullptr) {
    for (int j = 0; j < count; ++j) {
      const int p = __shfl_sync(0xffffffffu, cpos, j);
      for (int i = lane; i < a.num_scales; i += 32) {
        a.em_scales[static_cast<int64_t>(p) * a.num_scales + i] = a.scales[n * a.num_scales + i];
      }
    }
  }
}

// Padding rows: each expert's alignment rows [start[l] + count[l], start[l + 1]) (fewer than the alignment;
// item j of L x (alignment - 1) is row j % (alignment - 1) of expert j / (alignment - 1)), then the rows
// [start[L], em_rows). One warp per row.
__device__ void zero_padding(const EmPermuteArgs& a, int warp, int num_warps, int lane) {
  const ExpertMajorLayout lay{a.num_ranks, a.num_local};
  const int vecs = a.hidden_bytes / 16;
  auto zero_row = [&](int64_t m) {
    auto* x = reinterpret_cast<int4*>(a.em_x + m * a.hidden_bytes);
    for (int v = lane; v < vecs; v += 32) x[v] = make_int4(0, 0, 0, 0);
    for (int i = lane; a.em_scales != nullptr && i < a.num_scales; i += 32) a.em_scales[m * a.num_scales + i] = 0;
    if (lane == 0 && a.fresh) {
      if (a.em_weights != nullptr) a.em_weights[m] = 0.f;
      a.em_pair_row[m] = -1;
      a.em_pair_slot[m] = -1;
    }
  };
  const int gap = a.expert_alignment - 1;
  for (int64_t j = warp; j < static_cast<int64_t>(a.num_local) * gap; j += num_warps) {
    const int l = static_cast<int>(j / gap);
    const int64_t m = static_cast<int64_t>(a.layout[lay.start(l)]) + a.layout[lay.count(l)] + j % gap;
    if (m < a.layout[lay.start(l + 1)] && m < a.em_rows) zero_row(m);
  }
  for (int64_t m = static_cast<int64_t>(a.layout[lay.start(a.num_local)]) + warp; m < a.em_rows; m += num_warps) {
    zero_row(m);
  }
}

__global__ void __launch_bounds__(kPermuteThreads, kPermuteBlocksPerSm) em_permute_kernel(EmPermuteArgs a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (static_cast<int>(blockIdx.x) >= a.row_blocks) {
    const int pad_warps = (gridDim.x - a.row_blocks) * kEmRowsPerBlock;
    zero_padding(a, (blockIdx.x - a.row_blocks) * kEmRowsPerBlock + warp, pad_warps, lane);
    return;
  }
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kEmRowsPerBlock + warp;
  if (n >= a.num_rows) return;
  if (n >= *a.received) {  // no row arrived here (num_worst_tokens tables): no pairs, no source
    if (a.fresh && lane < a.num_topk) a.em_inverse[n * a.num_topk + lane] = -1;
    if (a.fresh && lane == 0) a.recv_src_idx[n] = -1;
    return;
  }
  permute_row(a, n, lane);
}

}  // namespace

void launch_em_permute(const EmPermuteArgs& args, int pad_blocks, cudaStream_t stream) {
  if (args.row_blocks + pad_blocks <= 0) return;
  em_permute_kernel<<<args.row_blocks + pad_blocks, kPermuteThreads, 0, stream>>>(args);
  check_launch("em_permute_kernel");
}

}  // namespace moe_ep::intranode
