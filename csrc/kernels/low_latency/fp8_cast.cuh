// Per-token FP8 (e4m3) cast by groups of 128 channels, bit-identical to
// moe_dispatcher/reference/fp8.py: every step is one IEEE float32 operation with round-to-nearest
// (__fdiv_rn / __fmul_rn: never contracted or approximated), and the e4m3 conversion is the
// hardware's round-to-nearest-even with saturation to +-448 (what clamp + cast does in torch).
//
// Work split: a thread holds 8 consecutive channels (one 16-byte bf16 load), so the 16 threads of
// a half-warp hold one group; the group's amax is a 4-step xor-shuffle reduction inside it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace moe_ep::low_latency {

constexpr float kFp8Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;

struct Fp8Group {
  uint2 q;      // the 8 e4m3 bytes of this thread's channels
  float scale;  // the group's scale (the same in all 16 threads)
};

// `raw`: 8 bf16 channels. All 32 lanes of the warp must call this together (shuffles); a
// half-warp whose channels lie past the hidden size passes zeros and ignores the result.
__device__ __forceinline__ Fp8Group cast_group_fp8(int4 raw, bool round_scale) {
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
  float v[8];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] = __bfloat162float(h[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  amax = fmaxf(amax, kAmaxFloor);

  float scale, inv;
  if (round_scale) {
    // 2^ceil(log2(amax / 448)): t = 1.m * 2^(E-127); ceil(log2 t) = E - 127 + (m != 0).
    const float t = __fdiv_rn(amax, kFp8Max);
    const uint32_t bits = __float_as_uint(t);
    const int exponent = static_cast<int>((bits >> 23) & 0xFFu) - 127 + ((bits & 0x7FFFFFu) != 0);
    scale = __uint_as_float(static_cast<uint32_t>(exponent + 127) << 23);
    inv = __uint_as_float(static_cast<uint32_t>(127 - exponent) << 23);
  } else {
    // docs/semantics.md: one correctly rounded division each (the reference divides tensor by tensor).
    scale = __fdiv_rn(amax, kFp8Max);
    inv = __fdiv_rn(kFp8Max, amax);
  }

  Fp8Group g;
  uint32_t word[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const float2 lo = make_float2(__fmul_rn(v[4 * w + 0], inv), __fmul_rn(v[4 * w + 1], inv));
    const float2 hi = make_float2(__fmul_rn(v[4 * w + 2], inv), __fmul_rn(v[4 * w + 3], inv));
    const uint32_t a = __nv_cvt_float2_to_fp8x2(lo, __NV_SATFINITE, __NV_E4M3);
    const uint32_t b = __nv_cvt_float2_to_fp8x2(hi, __NV_SATFINITE, __NV_E4M3);
    word[w] = (a & 0xFFFFu) | (b << 16);
  }
  g.q = make_uint2(word[0], word[1]);
  g.scale = scale;
  return g;
}

// Biased exponent byte of a power-of-two float32 scale (UE8M0).
__device__ __forceinline__ uint32_t ue8m0_byte(float scale) {
  return (__float_as_uint(scale) >> 23) & 0xFFu;
}

}  // namespace moe_ep::low_latency
