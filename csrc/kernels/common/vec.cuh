// 16-byte vectors of bf16 / fp16 / fp32 elements and their float32 conversions, for the kernels that sum rows
// (combine, the expert-major un-permute). Conversions round to nearest even (_rn), so every kernel that
// reduces in float32 gives the bits the reference backend gives.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace moe_ep {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float(float v) { return v; }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ float from_float(float v) { return v; }

// One 16-byte load or store seen as its elements.
template <typename T>
union Vec {
  static constexpr int kElems = 16 / sizeof(T);
  int4 raw;
  T elems[kElems];
};

}  // namespace moe_ep
