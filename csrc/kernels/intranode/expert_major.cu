// Pair ranks of an expert table: for each (row t, slot k) routed to expert e, its rank among the table's
// pairs for e, in (t, k) order (protocol.h, PairRankArgs). The expert-major dispatch runs it on the receiver
// side, over the rank-major received top-k (local experts, rows in (source rank, token) order), so
// start[e] + rank is the pair's expert-major row (em_permute.cu). No sorting (docs/intranode.md, "Expert-major dispatch").
//
// Three small local kernels, no communication; integer counts only, so the result is exact:
//   count: per block of kPairRankTokens rows, pairs per expert           -> workspace[b][e]
//   scan:  per expert, exclusive prefix over blocks                       -> workspace[b][e] (in place)
//   rank:  one warp per block walks its pairs in order; pairs of one expert within a 32-pair step
//          are ranked with match_any, and the warp's running count per expert lives in shared memory.
// Rows at or past *row_limit (when given) are not counted and their ranks are not written.
#include <algorithm>

#include "kernels/common/launch_check.cuh"
#include "kernels/intranode/protocol.h"

namespace moe_ep::intranode {
namespace {

constexpr int kCountThreads = 256;
constexpr int kScanWarps = 32;  // scan: one block of 32 warps per 32 experts

__device__ __forceinline__ int expert_of(const PairRankArgs& a, int64_t i) {
  const int64_t e = a.topk_idx[i];
  return (e >= 0 && e < a.num_experts) ? static_cast<int>(e) : -1;
}

__device__ __forceinline__ int ranked_rows(const PairRankArgs& a) {
  return a.row_limit != nullptr ? max(0, min(a.num_tokens, *a.row_limit)) : a.num_tokens;
}

// Pairs [first, last) of block b (in (t, k) order).
__device__ __forceinline__ void block_pairs(const PairRankArgs& a, int b, int64_t& first, int64_t& last) {
  const int64_t rows = ranked_rows(a);
  first = min(static_cast<int64_t>(b) * kPairRankTokens, rows) * a.num_topk;
  last = min(static_cast<int64_t>(b + 1) * kPairRankTokens, rows) * a.num_topk;
}

__global__ void __launch_bounds__(kCountThreads) pair_count_kernel(PairRankArgs a) {
  extern __shared__ int count[];  // [E]
  for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  int64_t first, last;
  block_pairs(a, blockIdx.x, first, last);
  for (int64_t i = first + threadIdx.x; i < last; i += blockDim.x) {
    const int e = expert_of(a, i);
    if (e >= 0) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  int* out = a.workspace + static_cast<int64_t>(blockIdx.x) * a.num_experts;
  for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x) out[e] = count[e];
}

// Block of 32 warps for experts [32 x blockIdx.x, +32): lane = expert, warp w owns a contiguous segment of the
// blocks. Pass 1 sums each segment, the segments' exclusive prefix comes from shared memory, pass 2 rewrites the
// segment with its running prefix. Loads are issued 8 at a time (a plain loop would wait on every one:
// each rewrite depends on the load before it).
__global__ void __launch_bounds__(kScanWarps * 32) pair_scan_kernel(PairRankArgs a, int blocks) {
  constexpr int kBatch = 8;
  __shared__ int segment_sum[kScanWarps][33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = blockIdx.x * 32 + lane;
  const bool valid = e < a.num_experts;
  const int per = (blocks + kScanWarps - 1) / kScanWarps;
  const int b0 = min(warp * per, blocks), b1 = min(b0 + per, blocks);
  int* column = a.workspace + e;
  const int64_t stride = a.num_experts;
  int sum = 0;
  for (int b = b0; valid && b < b1; b += kBatch) {
    int v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) v[j] = b + j < b1 ? column[(b + j) * stride] : 0;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) sum += v[j];
  }
  segment_sum[warp][lane] = sum;
  __syncthreads();
  int running = 0;
  for (int w = 0; w < warp; ++w) running += segment_sum[w][lane];
  for (int b = b0; valid && b < b1; b += kBatch) {
    int v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) v[j] = b + j < b1 ? column[(b + j) * stride] : 0;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (b + j < b1) column[(b + j) * stride] = running;
      running += v[j];
    }
  }
}

__global__ void __launch_bounds__(32) pair_rank_kernel(PairRankArgs a) {
  extern __shared__ int running[];  // [E]: pairs of expert e before the current step
  const int lane = threadIdx.x;
  const int* base = a.workspace + static_cast<int64_t>(blockIdx.x) * a.num_experts;
  for (int e = lane; e < a.num_experts; e += 32) running[e] = base[e];
  __syncwarp();
  int64_t first, last;
  block_pairs(a, blockIdx.x, first, last);
  // The next step's expert is loaded one step ahead, so the loads do not wait behind the shared-memory work.
  int next = first + lane < last ? expert_of(a, first + lane) : -1;
  for (int64_t step = first; step < last; step += 32) {
    const int64_t i = step + lane;
    const int e = next;
    next = i + 32 < last ? expert_of(a, i + 32) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, e);  // lanes holding the same expert
    const int before = __popc(same & ((1u << lane) - 1u));    // of them, the ones earlier in (t, k) order
    int rank = -1;
    if (e >= 0) rank = running[e] + before;
    __syncwarp();  // every lane read running[e] before the group's first lane advances it
    if (e >= 0 && before == 0) running[e] += __popc(same);
    __syncwarp();
    if (i < last) a.pair_rank[i] = rank;
  }
}

}  // namespace

void launch_pair_rank(const PairRankArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0 || args.num_topk == 0) return;
  const int blocks = pair_rank_blocks(args.num_tokens);
  const size_t shared = static_cast<size_t>(args.num_experts) * sizeof(int);
  pair_count_kernel<<<blocks, kCountThreads, shared, stream>>>(args);
  check_launch("pair_count_kernel");
  pair_scan_kernel<<<(args.num_experts + 31) / 32, kScanWarps * 32, 0, stream>>>(args, blocks);
  check_launch("pair_scan_kernel");
  pair_rank_kernel<<<blocks, 32, shared, stream>>>(args);
  check_launch("pair_rank_kernel");
}

}  // namespace moe_ep::intranode
