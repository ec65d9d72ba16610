// The outputs of a direct dispatch (the intranode direct kernel, internode's direct NVLink hop) as views of the
// blocks the peers write them into: the payload block (DirectPayload: recv_x [rows, H], recv_scales int32/float32
// [rows, S]) and, in a fresh call, the meta block (DirectMeta: recv_topk_idx int64 [rows, K], recv_topk_weights
// float32 [rows, K], recv_src_idx int32 [rows]); kernels/intranode/protocol.h lays both out. Host only.
#pragma once

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "bindings/carve.h"
#include "kernels/intranode/protocol.h"
#include "runtime/cuda_check.h"

namespace moe_ep {

// `block` (uint8, contiguous, at least `bytes` long) lies at byte `offset` of the NVLink buffer at `buffer`, or
// offset is -1 (the block is not in the peer pool: the call will be missed). `call` and `what` name it in errors.
inline void check_direct_block(const at::Tensor& block, int64_t offset, int64_t bytes, const uint8_t* buffer,
                               const char* call, const char* what) {
  MOE_CHECK(block.scalar_type() == at::kByte && block.is_contiguous() && block.numel() >= bytes,
            std::string(call) + ": " + what + " must be a contiguous uint8 tensor of its layout's bytes");
  MOE_CHECK(offset == -1 || (offset >= 0 && offset % 16 == 0 && static_cast<uint8_t*>(block.data_ptr()) == buffer + offset),
            std::string(call) + ": " + what + "'s offset is not where it lies in this rank's NVLink buffer");
}

struct DirectOutputs {
  at::Tensor x, scales, topk_idx, topk_weights, src_idx;  // undefined where the call has none

  // (recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx), None where the call has none.
  pybind11::tuple to_python() const {
    auto or_none = [](const at::Tensor& t) { return t.defined() ? pybind11::cast(t) : pybind11::none(); };
    return pybind11::make_tuple(x, or_none(scales), or_none(topk_idx), or_none(topk_weights), or_none(src_idx));
  }
};

// The views of a call of `o.rows` rows: recv_x of x_dtype [rows, H] (H = o.hidden_bytes / its size); scales of
// scale_dtype when the call has scales (o.num_scales > 0 with has_scales); top-k index and weights when it has
// top-k (m.num_topk > 0 with has_topk), and the source index in a fresh call (meta given).
inline DirectOutputs carve_direct_outputs(const at::Tensor& payload, const c10::optional<at::Tensor>& meta,
                                          const intranode::DirectPayload& o, const intranode::DirectMeta& m,
                                          at::ScalarType x_dtype, bool has_scales, at::ScalarType scale_dtype,
                                          bool has_topk) {
  const int64_t rows = o.rows, h = o.hidden_bytes / static_cast<int64_t>(c10::elementSize(x_dtype));
  const int64_t s = o.num_scales, k = m.num_topk;
  DirectOutputs out;
  out.x = carve(payload, o.x_offset(), x_dtype, {rows, h}, {h, 1});
  if (has_scales) out.scales = carve(payload, o.scales_offset(), scale_dtype, {rows, s}, {s, 1});
  if (meta.has_value()) {
    if (has_topk) {
      out.topk_idx = carve(*meta, m.idx_offset(), at::kLong, {rows, k}, {k, 1});
      out.topk_weights = carve(*meta, m.weights_offset(), at::kFloat, {rows, k}, {k, 1});
    }
    out.src_idx = carve(*meta, m.src_offset(), at::kInt, {rows}, {1});
  }
  return out;
}

// The output pointers of a launch's arguments (any struct with recv_x, recv_scales, recv_topk_idx,
// recv_topk_weights, recv_src_idx: the intranode and internode dispatch arguments) from `outs`; null where undefined.
template <typename Args>
inline void set_direct_outputs(Args& a, const DirectOutputs& outs) {
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
  a.recv_x = static_cast<decltype(a.recv_x)>(ptr(outs.x));
  a.recv_scales = static_cast<decltype(a.recv_scales)>(ptr(outs.scales));
  a.recv_topk_idx = static_cast<decltype(a.recv_topk_idx)>(ptr(outs.topk_idx));
  a.recv_topk_weights = static_cast<decltype(a.recv_topk_weights)>(ptr(outs.topk_weights));
  a.recv_src_idx = static_cast<decltype(a.recv_src_idx)>(ptr(outs.src_idx));
}

}  // namespace moe_ep
