// Dispatch layout kernel (layout.h). Each thread takes whole tokens: it collects the token's destination ranks
// in a 64-bit mask (a token counts once per rank however many of its experts live there), writes its row of
// is_token_in_rank and adds to block-local counters in shared memory; at the end each block adds its counters
// to the global ones. Integer atomics, so the counts are exact whatever the order.
#include <algorithm>

#include "kernels/common/layout.h"
#include "kernels/common/launch_check.cuh"
#include "kernels/common/nvlink_buffer.h"

namespace moe_ep {
namespace {

constexpr int kLayoutThreads = 256;
using nvlink::kBadIdOutOfRange;
using nvlink::kBadIdRepeated;
constexpr int kMaxSharedExperts = 4096;  // more experts: counted straight into global memory

__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(RoutingLayoutArgs a) {
  __shared__ int expert_count[kMaxSharedExperts];
  __shared__ int rank_count[kLayoutMaxRanks];
  __shared__ int domain_count[kLayoutMaxRanks];
  const bool shared_experts = a.num_experts <= kMaxSharedExperts;
  const int num_domains = a.num_tokens_per_domain != nullptr ? a.num_ranks / a.nvl_size : 0;
  for (int i = threadIdx.x; i < (shared_experts ? a.num_experts : 0); i += blockDim.x) expert_count[i] = 0;
  for (int i = threadIdx.x; i < kLayoutMaxRanks; i += blockDim.x) rank_count[i] = domain_count[i] = 0;
  __syncthreads();

  const int experts_per_rank = a.num_experts / a.num_ranks;
  const uint64_t domain_mask = a.nvl_size >= 64 ? ~0ull : (1ull << a.nvl_size) - 1;
  int bad = 0;  // kBadId* bits of this thread's tokens
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < a.num_tokens; t += gridDim.x * blockDim.x) {
    uint64_t ranks = 0;
    const int64_t* row = a.topk_idx + static_cast<int64_t>(t) * a.num_topk;
    for (int k = 0; k < a.num_topk; ++k) {
      const int64_t e = row[k];
      if (e < 0 || e >= a.num_experts) {
        if (e < -1 || e >= a.num_experts) bad |= kBadIdOutOfRange;
        continue;
      }
      for (int j = 0; j < k; ++j) {
        if (row[j] == e) bad |= kBadIdRepeated;  // K <= 16: a few compares per slot
      }
      ranks |= 1ull << (e / experts_per_rank);
      atomicAdd(shared_experts ? &expert_count[e] : &a.num_tokens_per_expert[e], 1);
    }
    for (int r = 0; r < a.num_ranks; ++r) {
      const bool hit = (ranks >> r) & 1ull;
      a.is_token_in_rank[static_cast<int64_t>(t) * a.num_ranks + r] = hit;
      if (hit) atomicAdd(&rank_count[r], 1);
    }
    for (int d = 0; d < num_domains; ++d) {
      if (ranks & (domain_mask << (d * a.nvl_size))) atomicAdd(&domain_count[d], 1);
    }
  }
  // Only threads that saw a bad id touch the word (read by the next notify on this stream: the kernel
  // boundary orders it).
  if (bad && a.bad_expert_ids != nullptr) atomicOr(a.bad_expert_ids, bad);
  __syncthreads();
  for (int i = threadIdx.x; i < (shared_experts ? a.num_experts : 0); i += blockDim.x) {
    if (expert_count[i]) atomicAdd(&a.num_tokens_per_expert[i], expert_count[i]);
  }
  if (threadIdx.x < a.num_ranks && rank_count[threadIdx.x]) {
    atomicAdd(&a.num_tokens_per_rank[threadIdx.x], rank_count[threadIdx.x]);
  }
  if (threadIdx.x < num_domains && domain_count[threadIdx.x]) {
    atomicAdd(&a.num_tokens_per_domain[threadIdx.x], domain_count[threadIdx.x]);
  }
}

}  // namespace

void launch_dispatch_layout(const RoutingLayoutArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return;
  const int blocks = std::min(132, (args.num_tokens + kLayoutThreads - 1) / kLayoutThreads);
  layout_kernel<<<blocks, kLayoutThreads, 0, stream>>>(args);
  check_launch("layout_kernel");
}

}  // namespace moe_ep
