// Typed views carved from one byte tensor: a call that returns several outputs allocates one block and hands out
// views of it (one allocation instead of several), made without the operator dispatcher (the per-call cost of
// view / as_strided is the point). Host only.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>

namespace moe_ep {

// A view of `base`'s storage from byte `offset` (a multiple of the dtype's size) with explicit sizes and strides
// (elements).
inline at::Tensor carve(const at::Tensor& base, size_t offset, at::ScalarType dtype, c10::IntArrayRef sizes,
                        c10::IntArrayRef strides) {
  const size_t esize = c10::elementSize(dtype);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(),
                                                   c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_and_strides(sizes, strides, static_cast<int64_t>((base.storage_offset() * base.element_size() +
                                                                    offset) / esize));
  return at::Tensor(std::move(impl));
}

}  // namespace moe_ep
