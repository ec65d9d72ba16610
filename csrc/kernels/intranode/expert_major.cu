// Expert-major dispatch, sender side: the rank of each (token, slot) pair among this rank's pairs for
// the same expert, in (token, slot) order. The receiver of expert e's rank adds it to the base notify
// computed for (this source, e), which places the pair at its final expert-major row with no sorting on
// the receiving side (docs/intranode.md, "Expert-major dispatch").
//
// Three small local kernels, no communication; integer counts only, so the result is exact:
//   count: per block of kPairRankTokens tokens, pairs per expert  -> workspace[b][e]
//   scan:  per expert, exclusive prefix over blocks               -> workspace[b][e] (in place)
//   rank:  one warp per block walks its pairs in order; pairs of one expert within a 32-pair step
//          are ranked with match_any, and the warp's running count per expert lives in shared memory.
#include <algorithm>

#include "kernels/intranode/launch_check.cuh"
#include "kernels/intranode/protocol.h"

namespace moe_dispatcher::intranode {
namespace {

constexpr int kCountThreads = 256;

__device__ __forceinline__ int expert_of(const PairRankArgs& a, int64_t i) {
  const int64_t e = a.topk_idx[i];
  return (e >= 0 && e < a.num_experts) ? static_cast<int>(e) : -1;
}

__global__ void __launch_bounds__(kCountThreads) pair_count_kernel(PairRankArgs a) {
  extern __shared__ int count[];  // [E]
  for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kPairRankTokens * a.num_topk;
  const int64_t last = min(static_cast<int64_t>(blockIdx.x + 1) * kPairRankTokens,
                           static_cast<int64_t>(a.num_tokens)) * a.num_topk;
  for (int64_t i = first + threadIdx.x; i < last; i += blockDim.x) {
    const int e = expert_of(a, i);
    if (e >= 0) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  int* out = a.workspace + static_cast<int64_t>(blockIdx.x) * a.num_experts;
  for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x) out[e] = count[e];
}

__global__ void __launch_bounds__(kCountThreads) pair_scan_kernel(PairRankArgs a, int blocks) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= a.num_experts) return;
  int running = 0;
  for (int b = 0; b < blocks; ++b) {
    int* w = a.workspace + static_cast<int64_t>(b) * a.num_experts + e;
    const int v = *w;
    *w = running;
    running += v;
  }
}

__global__ void __launch_bounds__(32) pair_rank_kernel(PairRankArgs a) {
  extern __shared__ int running[];  // [E]: pairs of expert e before the current step
  const int lane = threadIdx.x;
  const int* base = a.workspace + static_cast<int64_t>(blockIdx.x) * a.num_experts;
  for (int e = lane; e < a.num_experts; e += 32) running[e] = base[e];
  __syncwarp();
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kPairRankTokens * a.num_topk;
  const int64_t last = min(static_cast<int64_t>(blockIdx.x + 1) * kPairRankTokens,
                           static_cast<int64_t>(a.num_tokens)) * a.num_topk;
  for (int64_t step = first; step < last; step += 32) {
    const int64_t i = step + lane;
    const int e = i < last ? expert_of(a, i) : -1;
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
  pair_scan_kernel<<<(args.num_experts + kCountThreads - 1) / kCountThreads, kCountThreads, 0, stream>>>(args, blocks);
  check_launch("pair_scan_kernel");
  pair_rank_kernel<<<blocks, 32, shared, stream>>>(args);
  check_launch("pair_rank_kernel");
}

}  // namespace moe_dispatcher::intranode
