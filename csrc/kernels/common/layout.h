// Dispatch layout (torch-free): from topk_idx [T, K], the tokens per rank, per expert and (internode) per
// NVLink domain, and which ranks each token goes to. Local, no communication. The intranode and internode
// backends both launch it (intranode: one domain, no domain counts).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe_ep {

constexpr int kLayoutMaxRanks = 64;  // ranks of one layout (a bit each in a 64-bit mask per token)

struct RoutingLayoutArgs {
  const int64_t* topk_idx;     // [T, K]; -1 (or any id outside [0, E)) = unused slot
  int num_tokens, num_topk, num_experts, num_ranks;
  int nvl_size;                // ranks per NVLink domain (num_ranks % nvl_size == 0)
  int* num_tokens_per_rank;    // [R], zeroed by the caller
  int* num_tokens_per_domain;  // [R / nvl_size], zeroed by the caller; null: not counted
  int* num_tokens_per_expert;  // [E], zeroed by the caller
  bool* is_token_in_rank;      // [T, R]
  // Device word or null (the NVLink buffer's Control::bad_expert_ids): the kernel ORs in
  // nvlink::kBadIdOutOfRange for an id outside [-1, E) (such a slot is not counted) and nvlink::kBadIdRepeated
  // for a token naming one expert twice (counted twice); the next notify reports it on every rank.
  int* bad_expert_ids;
};

void launch_dispatch_layout(const RoutingLayoutArgs& args, cudaStream_t stream);

}  // namespace moe_ep
