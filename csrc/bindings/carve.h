// Typed views carved from one block: a call that returns several outputs allocates one block and hands out
// views of it (one allocation instead of several), made without the operator dispatcher (the per-call cost of
// view / as_strided is the point). Host only.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/TensorOptions.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <cstddef>

namespace moe_ep {

// A view of `storage` from byte `offset` (a multiple of the dtype's size) with explicit sizes and strides
// (elements): a dense tensor of the storage's device, as at::empty makes them (its dispatch keys follow the
// device; autograd and inference mode as for any new tensor).
inline at::Tensor carve(const c10::Storage& storage, size_t offset, at::ScalarType dtype, c10::IntArrayRef sizes,
                        c10::IntArrayRef strides) {
  const size_t esize = c10::elementSize(dtype);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(c10::computeDispatchKey(dtype, c10::kStrided, storage.device())),
      c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_and_strides(sizes, strides, static_cast<int64_t>(offset / esize));
  return at::Tensor(std::move(impl));
}

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

// `num_bytes` uninitialised bytes from torch's CUDA caching allocator, as the storage of the views carve() makes:
// what at::empty does for a CUDA tensor (the same allocator, so a MemPool context or a pluggable allocator applies
// alike), without its device guard or a tensor of the whole block. The block is of the current device and
// belongs to its current stream: the caller made the device current (DeviceScope) first.
inline c10::Storage cuda_block(size_t num_bytes) {
  c10::Allocator* allocator = c10::cuda::CUDACachingAllocator::get();
  return c10::Storage(c10::Storage::use_byte_size_t(), static_cast<int64_t>(num_bytes), allocator,
                      /*resizable=*/true);
}

}  // namespace moe_ep
