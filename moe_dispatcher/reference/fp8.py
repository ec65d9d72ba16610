"""The per-token, per-128-channel FP8 (e4m3) cast of low-latency dispatch: the bit-exact specification.

Every step is one IEEE float32 operation so a CUDA kernel that performs the same operations (no fast-math)
produces the same bytes.
"""
from __future__ import annotations

from typing import Tuple

import torch

FP8_MAX = 448.0
GROUP = 128
AMAX_FLOOR = 1e-4


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False,
                          use_ue8m0: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Cast x [T, H] (bf16/float) to (e4m3 [T, H], scales).

    scales: float32 [T, H/128] (the factor that multiplies the e4m3 values back), or with use_ue8m0 int32
    [T, H/512] holding the biased exponent bytes of the power-of-two scales, 4 per word, little-endian.
    """
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0 requires round_scale=True (UE8M0 scales are powers of two)")
    t, h = x.shape
    if h % GROUP:
        raise ValueError(f"hidden size {h} is not a multiple of {GROUP}")
    xf = x.float().view(t, h // GROUP, GROUP)
    amax = xf.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)  # [T, G]
    # Divisions are tensor by tensor: PyTorch turns `tensor / python_float` into a multiply by the reciprocal
    # on CUDA and `python_float / tensor` into reciprocal-then-multiply everywhere: two roundings, not IEEE.
    fp8_max = torch.full_like(amax, FP8_MAX)
    if round_scale:
        # scale = 2^ceil(log2(amax / 448)). frexp gives amax/448 = m * 2^e with m in [0.5, 1): the ceiling of
        # log2 is e, except for m == 0.5 exactly (a power of two), where it is e - 1.
        mant, exp = torch.frexp(amax / fp8_max)
        exp = exp - (mant == 0.5).to(exp.dtype)
        scale = torch.ldexp(torch.ones_like(amax), exp)
        inv = torch.ldexp(torch.ones_like(amax), -exp)
    else:
        scale = amax / fp8_max
        inv = fp8_max / amax
    q = (xf * inv.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(t, h)
    if not use_ue8m0:
        return q, scale
    if h % (4 * GROUP):
        raise ValueError(f"use_ue8m0 needs a hidden size that is a multiple of {4 * GROUP}, got {h}")
    biased = (exp + 127).to(torch.int32).view(t, h // (4 * GROUP), 4)
    packed = biased[..., 0] | (biased[..., 1] << 8) | (biased[..., 2] << 16) | (biased[..., 3] << 24)
    return q, packed.to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., G/4] of exponent bytes -> float32 [..., G] power-of-two scales."""
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=packed.device)
    biased = (packed.unsqueeze(-1) >> shifts) & 0xFF
    return torch.ldexp(torch.ones_like(biased, dtype=torch.float32), biased - 127).flatten(-2)


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 [..., H] and float32 [..., H/128] (or packed UE8M0 int32) scales -> float32 [..., H]."""
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    qf = q.float()
    return (qf.unflatten(-1, (-1, GROUP)) * scales.unsqueeze(-1)).flatten(-2)
