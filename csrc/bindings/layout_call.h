// get_dispatch_layout as one native call, for both normal-mode bindings: checks topk_idx at the boundary,
// allocates the outputs, zeroes the counts and launches the layout kernel on the caller's current stream.
#pragma once

#include <torch/extension.h>
#include <pybind11/pybind11.h>

#include "bindings/cached_call.h"
#include "bindings/stream_join.h"
#include "kernels/common/layout.h"
#include "kernels/common/nvlink_buffer.h"
#include "runtime/ipc_buffer.h"

namespace moe_ep {

// topk_idx int64 [T, K] (a CUDA tensor of the current device, contiguous, 0 < K <= kMaxTopk), num_experts E
// (> 0, a multiple of num_ranks R), nvl_size: ranks per NVLink domain (R: one domain, no domain counts) ->
// (num_tokens_per_rank int32 [R], num_tokens_per_domain int32 [R / nvl_size] or None, num_tokens_per_expert
// int32 [E], is_token_in_rank bool [T, R]); None when topk_idx or E is not one the kernel takes: the Buffer's
// full path then validates and raises the user's error. The three count vectors are views of one zeroed
// allocation (one memset). The kernel counts ids outside [-1, E) (and repeated ids) into bad_expert_ids (a
// word of the Buffer's NVLink Control block, reported by the next notify; null: not counted) and otherwise
// skips them as it skips -1.
inline pybind11::object layout_call(const at::Tensor& topk_idx, int64_t num_experts, int num_ranks, int nvl_size,
                                    int* bad_expert_ids) {
  if (!topk_idx.defined() || !topk_idx.is_cuda() || topk_idx.scalar_type() != at::kLong || topk_idx.dim() != 2 ||
      !topk_idx.is_contiguous() || topk_idx.size(1) < 1 || topk_idx.size(1) > nvlink::kMaxTopk ||
      topk_idx.size(0) > INT32_MAX / 64 || num_experts <= 0 || num_experts % num_ranks != 0 ||
      num_experts > INT32_MAX || nvl_size <= 0 || num_ranks % nvl_size != 0 || num_ranks > kLayoutMaxRanks) {
    return pybind11::none();
  }
  const c10::DeviceIndex device = topk_idx.get_device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = current_stream(device).stream();
  const int64_t t = topk_idx.size(0), domains = nvl_size == num_ranks ? 0 : num_ranks / nvl_size;
  at::Tensor counts = empty_on(device, at::kInt, {num_ranks + domains + num_experts});
  MOE_CUDA_CHECK(cudaMemsetAsync(counts.data_ptr(), 0, counts.nbytes(), stream));
  at::Tensor per_rank = counts.narrow(0, 0, num_ranks);
  at::Tensor per_expert = counts.narrow(0, num_ranks + domains, num_experts);
  at::Tensor in_rank = empty_on(device, at::kBool, {t, num_ranks});
  c10::optional<at::Tensor> per_domain;
  if (domains > 0) per_domain = counts.narrow(0, num_ranks, domains);
  RoutingLayoutArgs a{data_of<const int64_t>(topk_idx), static_cast<int>(t), static_cast<int>(topk_idx.size(1)),
                      static_cast<int>(num_experts), num_ranks, nvl_size, data_of<int>(per_rank),
                      data_of<int>(per_domain), data_of<int>(per_expert), data_of<bool>(in_rank)};
  a.bad_expert_ids = bad_expert_ids;
  launch_dispatch_layout(a, stream);
  pybind11::object domain_result = per_domain.has_value() ? pybind11::cast(std::move(*per_domain)) : pybind11::none();
  return pybind11::make_tuple(std::move(per_rank), std::move(domain_result), std::move(per_expert),
                              std::move(in_rank));
}

// The binding both normal-mode modules export: layout_call with the bad-id word of `buffer`'s NVLink Control block
// (reported by the next notify; buffer null: not flagged). None once the buffer is destroyed or a kernel timed out,
// so that the Buffer's full path raises why.
inline pybind11::object layout_call_on(const at::Tensor& topk_idx, int64_t num_experts, int num_ranks, int nvl_size,
                                       const IpcBuffer* buffer) {
  if (buffer != nullptr && !usable(*buffer)) return pybind11::none();
  int* bad = buffer != nullptr ? &reinterpret_cast<nvlink::Control*>(buffer->local())->bad_expert_ids : nullptr;
  return layout_call(topk_idx, num_experts, num_ranks, nvl_size, bad);
}

}  // namespace moe_ep
