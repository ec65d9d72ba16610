"""The FP8 (e4m3) cast of low-latency dispatch: the oracle's own cast, written from docs/semantics.md, agrees
byte for byte with moe_dispatcher.reference.fp8, and the cast-back error bound holds (single process)."""
from __future__ import annotations

import oracle
import pytest
import torch
from test_reference_low_latency import check_fp8_bound

MODES = [(False, False), (True, False), (True, True)]  # (round_scale, use_ue8m0)


def _all_e4m3_values() -> torch.Tensor:
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(v[torch.isfinite(v)])


def test_oracle_rounding_matches_torch() -> None:
    """The oracle's round-to-nearest-even e4m3 agrees with torch's cast inside the finite range (ties included)."""
    values = _all_e4m3_values()
    mids = ((values[1:].double() + values[:-1].double()) / 2).float()  # exact ties
    up, down = torch.tensor(1e9), torch.tensor(-1e9)
    v = torch.cat([values, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                   torch.randn(100_000, generator=oracle.generator(1)) * 100,
                   torch.rand(10_000, generator=oracle.generator(2)) * 2 ** -5, torch.tensor([0.0, -0.0])])
    v = v[v.abs() <= 448]
    mine = oracle.encode_e4m3(oracle.round_to_e4m3(v))
    theirs = v.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (mine != theirs).nonzero().flatten()
    assert bad.numel() == 0, f"oracle e4m3 differs from torch at {v[bad[:5]].tolist()}"


def test_oracle_rounding_saturates() -> None:
    v = torch.tensor([448.0, 449.0, 463.9, 464.0, 500.0, 1e30, -470.0])
    assert oracle.round_to_e4m3(v).tolist() == [448.0, 448.0, 448.0, 448.0, 448.0, 448.0, -448.0]


@pytest.mark.parametrize("hidden,round_scale,use_ue8m0",
                         [(h, *m) for h in (128, 512, 7168) for m in MODES if not (m[1] and h % 512)])
def test_cast_matches_reference_bytes(hidden: int, round_scale: bool, use_ue8m0: bool) -> None:
    """Oracle and reference casts agree byte for byte (data and scales), on inputs spanning many magnitudes."""
    from moe_dispatcher.reference.fp8 import per_token_cast_to_fp8
    for seed, kind in enumerate(["fp8", "randn", "grid"]):
        x = oracle.make_x(oracle.generator(10 + seed, hidden), 48, hidden, kind)
        q, s = oracle.per_token_cast_to_fp8(x, round_scale, use_ue8m0)
        rq, rs = per_token_cast_to_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
        assert rq.dtype == torch.float8_e4m3fn and rq.shape == q.shape
        assert torch.equal(rq.view(torch.uint8), q.view(torch.uint8)), f"FP8 bytes differ ({kind})"
        assert rs.dtype == s.dtype and rs.shape == s.shape, (rs.dtype, rs.shape, s.dtype, s.shape)
        assert torch.equal(rs, s), f"scales differ ({kind}): {(rs != s).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("round_scale,use_ue8m0", MODES)
def test_cast_error_bound(round_scale: bool, use_ue8m0: bool) -> None:
    """|dequant - x| <= half an e4m3 ulp of the scaled value times the scale, per element; DeepEP's similarity
    metric < 2^-7 per 128-block."""
    x = oracle.make_x(oracle.generator(20), 64, 1024, "fp8")
    q, s = oracle.per_token_cast_to_fp8(x, round_scale, use_ue8m0)
    check_fp8_bound(oracle.dequant_fp8(q, s), x, s, "oracle cast")


def test_error_bound_check_can_fail() -> None:
    """The bound is tight: truncating instead of rounding to nearest breaks it."""
    x = oracle.make_x(oracle.generator(21), 16, 256, "randn")
    _, s = oracle.per_token_cast_to_fp8(x)
    scaled = x.float().reshape(16, 2, 128) / s.unsqueeze(-1)
    step = 2 * oracle.e4m3_half_ulp(scaled)
    truncated = (torch.trunc(scaled.double() / step) * step).float()
    deq = (truncated * s.unsqueeze(-1)).reshape(16, 256)
    with pytest.raises(AssertionError, match="half an ulp"):
        check_fp8_bound(deq, x, s, "truncating cast")


def test_round_scale_exact_powers_of_two() -> None:
    """amax exactly 448 * 2^k gives the scale 2^k (not 2^(k+1)); others round the scale up."""
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    x[0, 7] = 448 * 2 ** -3
    x[1, 0] = -448 * 2 ** 5
    x[2, 3] = 448 * 2 ** -3 * 1.0078125  # the next bf16 above: rounds up to 2^-2
    _, s = oracle.per_token_cast_to_fp8(x, round_scale=True)
    assert s.flatten().tolist() == [2 ** -3, 2 ** 5, 2 ** -2]
    q, _ = oracle.per_token_cast_to_fp8(x, round_scale=True)
    assert q.float()[0, 7].item() == 448 and q.float()[1, 0].item() == -448
    from moe_dispatcher.reference.fp8 import per_token_cast_to_fp8
    assert torch.equal(per_token_cast_to_fp8(x, round_scale=True)[1], s)


def test_amax_floor() -> None:
    """An all-zero group uses amax = 1e-4: scale 1e-4 / 448 (or its power-of-two round-up), data all zero."""
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    q, s = oracle.per_token_cast_to_fp8(x)
    assert s.item() == (torch.tensor(1e-4, dtype=torch.float32) / 448).item()
    assert q.view(torch.uint8).eq(0).all()
    _, s = oracle.per_token_cast_to_fp8(x, round_scale=True)
    assert s.item() == 2.0 ** -22  # 1e-4 / 448 = 2.23e-7, in (2^-23, 2^-22]


def test_ue8m0_packing_byte_order() -> None:
    """Group 4j + i goes to byte i (little-endian) of word j, as exponent + 127."""
    x = torch.zeros(1, 1024, dtype=torch.bfloat16)
    exps = [-3, 0, 2, 5, 7, -10, 1, 4]
    for g, e in enumerate(exps):
        x[0, g * 128] = 448 * 2.0 ** e
    _, words = oracle.per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    for j in range(2):
        word = int(words[0, j]) & 0xFFFFFFFF
        assert [(word >> (8 * i)) & 0xFF for i in range(4)] == [e + 127 for e in exps[4 * j: 4 * j + 4]]
    assert oracle.unpack_ue8m0(words).flatten().tolist() == [2.0 ** e for e in exps]
    from moe_dispatcher.reference.fp8 import per_token_cast_to_fp8
    assert torch.equal(per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)[1], words)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("round_scale,use_ue8m0", MODES)
def test_reference_cast_on_cuda_matches_oracle(round_scale: bool, use_ue8m0: bool) -> None:
    """The reference cast of CUDA tensors (what the reference backend does under NCCL) gives the contract's
    bytes too: scale = amax / 448 is one correctly rounded float32 division on every device."""
    from moe_dispatcher.reference.fp8 import per_token_cast_to_fp8
    x = oracle.make_x(oracle.generator(30), 64, 1024, "fp8")
    q, s = oracle.per_token_cast_to_fp8(x, round_scale, use_ue8m0)
    rq, rs = per_token_cast_to_fp8(x.cuda(), round_scale=round_scale, use_ue8m0=use_ue8m0)
    assert torch.equal(rq.cpu().view(torch.uint8), q.view(torch.uint8)), "FP8 bytes differ on CUDA"
    bad = (rs.cpu() != s).nonzero()
    assert bad.numel() == 0, (f"scales differ on CUDA at {bad[:3].tolist()}: "
                              f"{[(rs.cpu()[tuple(i)].item(), s[tuple(i)].item()) for i in bad[:3].tolist()]}")
