"""Single-process oracle for docs/semantics.md, written from the contract alone.

Every function takes the inputs of ALL ranks (lists indexed by rank) and returns what each rank must see.
The code is deliberately plain (loops over ranks and tokens, no clever indexing) so that it is an
independent second reading of the contract, not a copy of `moe_dispatcher.reference`. Everything runs on
CPU; callers move device tensors here with `.cpu()`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Payload = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

FP8_MAX = 448.0
FP8_GROUP = 128
AMAX_FLOOR = 1e-4


def ceil_to(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# ----------------------------------------------------------------------------------------------- layout
@dataclass
class Layout:
    num_tokens_per_rank: torch.Tensor  # int32 [R]
    num_tokens_per_rdma_rank: torch.Tensor | None  # int32 [D] or None when D == 1
    num_tokens_per_expert: torch.Tensor  # int32 [E]
    is_token_in_rank: torch.Tensor  # bool [T, R]


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, nvl_size: int | None = None) -> Layout:
    """get_dispatch_layout of one rank's topk_idx [T, K] (no communication, so no other ranks needed)."""
    topk_idx = topk_idx.cpu()
    num_local = num_experts // num_ranks
    nvl_size = num_ranks if nvl_size is None else nvl_size
    num_domains = num_ranks // nvl_size
    t_count, k_count = topk_idx.shape
    in_rank = torch.zeros(t_count, num_ranks, dtype=torch.bool)
    per_expert = [0] * num_experts
    per_domain = [0] * num_domains
    for t in range(t_count):
        domains = set()
        for k in range(k_count):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            per_expert[e] += 1
            in_rank[t, e // num_local] = True
            domains.add(e // num_local // nvl_size)
        for d in domains:
            per_domain[d] += 1
    per_rank = [int(in_rank[:, r].sum()) for r in range(num_ranks)]
    return Layout(
        num_tokens_per_rank=torch.tensor(per_rank, dtype=torch.int32),
        num_tokens_per_rdma_rank=torch.tensor(per_domain, dtype=torch.int32) if num_domains > 1 else None,
        num_tokens_per_expert=torch.tensor(per_expert, dtype=torch.int32),
        is_token_in_rank=in_rank,
    )


# -------------------------------------------------------------------------------------- normal dispatch
@dataclass
class Received:
    """What one rank receives from a normal dispatch."""

    recv_x: Payload
    recv_topk_idx: torch.Tensor | None  # int64 [N, K]
    recv_topk_weights: torch.Tensor | None  # float32 [N, K]
    num_recv_tokens_per_expert_list: list[int]
    rank_prefix_matrix: torch.Tensor  # int32 [R, R] (the same on every rank)
    recv_src_idx: torch.Tensor  # int64 [N], source token of each row
    recv_src_rank: torch.Tensor  # int64 [N], source rank of each row

    @property
    def num_rows(self) -> int:
        return int(self.recv_src_idx.numel())


def _rows(payload: Payload, picks: list[tuple[int, int]], payloads: Sequence[Payload]) -> Payload:
    """Stack rows payloads[src][t] for (src, t) in picks, keeping the payload's dtype/shape (tuple too)."""
    if isinstance(payload, tuple):
        return tuple(_rows(p, picks, [pl[i] for pl in payloads]) for i, p in enumerate(payload))
    if not picks:
        return payload.new_empty((0,) + tuple(payload.shape[1:]))
    return torch.stack([payloads[s][t] for s, t in picks])


def dispatch(xs: Sequence[Payload], topk_idx: Sequence[torch.Tensor],
             topk_weights: Sequence[torch.Tensor] | None, num_experts: int,
             expert_alignment: int = 1) -> list[Received]:
    """Normal dispatch: xs[r] is rank r's x ([T_r, H] tensor or (fp8, scales) tuple)."""
    num_ranks = len(xs)
    num_local = num_experts // num_ranks
    xs = [tuple(p.cpu() for p in x) if isinstance(x, tuple) else x.cpu() for x in xs]
    topk_idx = [i.cpu() for i in topk_idx]
    topk_weights = None if topk_weights is None else [w.cpu() for w in topk_weights]
    layouts = [layout(topk_idx[r], num_experts, num_ranks) for r in range(num_ranks)]

    # counts[i][j]: rows rank j gets from rank i
    counts = [[int(layouts[i].num_tokens_per_rank[j]) for j in range(num_ranks)] for i in range(num_ranks)]
    prefix = torch.zeros(num_ranks, num_ranks, dtype=torch.int32)
    for j in range(num_ranks):
        acc = 0
        for i in range(num_ranks):
            acc += counts[i][j]
            prefix[i, j] = acc

    out = []
    for me in range(num_ranks):
        picks = []  # (src rank, src token), in receive order
        for src in range(num_ranks):
            for t in range(topk_idx[src].shape[0]):
                if layouts[src].is_token_in_rank[t, me]:
                    picks.append((src, t))
        k_count = topk_idx[0].shape[1]
        r_idx = torch.full((len(picks), k_count), -1, dtype=torch.int64)
        r_w = torch.zeros(len(picks), k_count, dtype=torch.float32)
        for n, (src, t) in enumerate(picks):
            for k in range(k_count):
                e = int(topk_idx[src][t, k])
                if me * num_local <= e < (me + 1) * num_local:
                    r_idx[n, k] = e - me * num_local
                    if topk_weights is not None:
                        r_w[n, k] = topk_weights[src][t, k]
        per_expert = []
        for local in range(num_local):
            total = sum(int(layouts[src].num_tokens_per_expert[me * num_local + local]) for src in range(num_ranks))
            per_expert.append(ceil_to(total, expert_alignment))
        out.append(Received(
            recv_x=_rows(xs[me], picks, xs),
            recv_topk_idx=r_idx,
            recv_topk_weights=r_w if topk_weights is not None else None,
            num_recv_tokens_per_expert_list=per_expert,
            rank_prefix_matrix=prefix.clone(),
            recv_src_idx=torch.tensor([t for _, t in picks], dtype=torch.int64),
            recv_src_rank=torch.tensor([s for s, _ in picks], dtype=torch.int64),
        ))
    return out


# --------------------------------------------------------------------------------------- normal combine
def combine(rows: Sequence[torch.Tensor], received: Sequence[Received], num_tokens: Sequence[int],
            topk_weights: Sequence[torch.Tensor] | None = None,
            bias: Sequence[Sequence[torch.Tensor]] | None = None,
            ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Normal combine. rows[r]: the [N_r, H] rows rank r returns (only the first received[r].num_rows are read);
    topk_weights[r]: [N_r, K] float32; bias[s]: 0, 1 or 2 tensors [T_s, H] of source rank s.
    Returns per source rank (combined_x, combined_topk_weights or None)."""
    num_ranks = len(rows)
    rows = [r.cpu() for r in rows]
    dtype = rows[0].dtype
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    hidden = rows[0].shape[1]
    result = []
    for s in range(num_ranks):
        acc = torch.zeros(num_tokens[s], hidden, dtype=acc_dtype)
        for b in (bias[s] if bias is not None else ()):
            acc = acc + b.cpu().to(acc_dtype)
        w_acc = None
        if topk_weights is not None:
            w_acc = torch.zeros(num_tokens[s], topk_weights[0].shape[1], dtype=torch.float32)
        for r in range(num_ranks):  # ascending source of the returned rows
            rec = received[r]
            for n in range(rec.num_rows):
                if int(rec.recv_src_rank[n]) != s:
                    continue
                t = int(rec.recv_src_idx[n])
                acc[t] = acc[t] + rows[r][n].to(acc_dtype)
                if w_acc is not None:
                    w_acc[t] = w_acc[t] + topk_weights[r][n].cpu().float()
        result.append((acc.to(dtype), w_acc))
    return result


# ------------------------------------------------------------------------------------------- FP8 cast
def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest e4m3 value (ties to even), saturating at +-448; float64 result."""
    a = v.double().abs()
    _, ex = torch.frexp(a)  # a = m * 2^ex, m in [0.5, 1): floor(log2 a) = ex - 1
    e = torch.clamp(ex.to(torch.int64) - 1, min=-6)  # below 2^-6 the step stays 2^-9 (subnormals)
    step = torch.pow(2.0, (e - 3).double())
    q = torch.round(a / step) * step  # a / step is exact (power of two); torch.round ties to even
    q = torch.clamp(q, max=FP8_MAX)
    return torch.where(torch.signbit(v), -q, q)


def encode_e4m3(q: torch.Tensor) -> torch.Tensor:
    """Bytes (uint8) of exactly representable e4m3 values q (float64): sign | exponent(4, bias 7) | mantissa(3)."""
    a = q.abs()
    sign = torch.signbit(q).to(torch.int64) << 7
    normal = a >= 2.0 ** -6
    _, ex = torch.frexp(torch.where(normal, a, torch.ones_like(a)))
    e = ex.to(torch.int64) - 1
    mant_normal = ((torch.where(normal, a, torch.ones_like(a)) / torch.pow(2.0, e.double()) - 1.0) * 8).to(torch.int64)
    field_normal = ((e + 7) << 3) | mant_normal
    field_sub = (a * 512).to(torch.int64)  # 0..7 (2^-6 itself is normal)
    bits = sign | torch.where(normal, field_normal, field_sub)
    return bits.to(torch.uint8)


def fp8_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """ceil(log2(amax / 448)) computed exactly: the smallest e with 2^e >= the float32 quotient."""
    quotient = amax.float() / torch.full_like(amax.float(), FP8_MAX)
    m, ex = torch.frexp(quotient)
    return torch.where(m == 0.5, ex - 1, ex).to(torch.int64)


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False):
    """The LL dispatch cast of x [T, H]: (e4m3 [T, H], scales float32 [T, H/128] or packed int32 [T, H/512])."""
    assert not use_ue8m0 or round_scale
    t_count, hidden = x.shape
    assert hidden % FP8_GROUP == 0
    groups = hidden // FP8_GROUP
    xf = x.cpu().float().reshape(t_count, groups, FP8_GROUP)
    amax = torch.clamp(xf.abs().amax(dim=-1), min=torch.tensor(AMAX_FLOOR, dtype=torch.float32))  # [T, G]
    if round_scale:
        exponent = fp8_scale_exponent(amax)
        scaled = xf * torch.pow(2.0, (-exponent).double()).float().unsqueeze(-1)  # exact
        scale = torch.pow(2.0, exponent.double()).float()
    else:
        # One IEEE division each, tensor by tensor (`python_float / tensor` is reciprocal-then-multiply).
        scaled = xf * (torch.full_like(amax, FP8_MAX) / amax).unsqueeze(-1)  # float32 ops, in the contract's order
        scale = amax / torch.full_like(amax, FP8_MAX)
    q = encode_e4m3(round_to_e4m3(scaled)).reshape(t_count, hidden).view(torch.float8_e4m3fn)
    if not use_ue8m0:
        return q, scale
    assert groups % 4 == 0
    biased = (exponent + 127).reshape(t_count, groups // 4, 4)
    words = biased[..., 0] | (biased[..., 1] << 8) | (biased[..., 2] << 16) | (biased[..., 3] << 24)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return q, words.to(torch.int32)


def unpack_ue8m0(words: torch.Tensor) -> torch.Tensor:
    """int32 [.., G/4] packed exponent bytes -> float32 scales [.., G]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    biased = torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], dim=-1).flatten(-2)
    return torch.pow(2.0, (biased - 127).double()).float()


def dequant_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [T, H] = q * scale of its 128-group (scales float32 [T, H/128], or packed int32 [T, H/512])."""
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    t_count, hidden = q.shape
    return (q.float().reshape(t_count, -1, FP8_GROUP) * scales.float().unsqueeze(-1)).reshape(t_count, hidden)


def e4m3_half_ulp(v: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 spacing at |v| (v in the scaled domain), as float64."""
    a = v.double().abs()
    _, ex = torch.frexp(a)
    e = torch.clamp(ex.to(torch.int64) - 1, min=-6)
    return torch.pow(2.0, (e - 4).double())


# --------------------------------------------------------------------------------- low-latency dispatch
@dataclass
class LowLatencyReceived:
    """What one rank receives from a low-latency dispatch, per local expert."""

    rows: list[list[tuple[int, int]]]  # rows[l]: (src rank, src token) ascending by source then token
    recv_count: torch.Tensor  # int32 [L]

    def from_source(self, local: int, src: int) -> list[int]:
        return [t for s, t in self.rows[local] if s == src]


def low_latency_dispatch(topk_idx: Sequence[torch.Tensor], num_experts: int) -> list[LowLatencyReceived]:
    """Routing of a low-latency dispatch (the payload of row (s, t) is x_s[t], or its FP8 cast)."""
    num_ranks = len(topk_idx)
    num_local = num_experts // num_ranks
    topk_idx = [i.cpu() for i in topk_idx]
    out = []
    for me in range(num_ranks):
        rows = [[] for _ in range(num_local)]
        for src in range(num_ranks):
            for t in range(topk_idx[src].shape[0]):
                for k in range(topk_idx[src].shape[1]):
                    e = int(topk_idx[src][t, k])
                    if me * num_local <= e < (me + 1) * num_local:
                        rows[e - me * num_local].append((src, t))
        out.append(LowLatencyReceived(rows, torch.tensor([len(r) for r in rows], dtype=torch.int32)))
    return out


def low_latency_combine(topk_idx: torch.Tensor, topk_weights: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
    """out[t] = bf16(sum over k ascending with idx >= 0 of w[t, k] * float(slot_rows[t, k])), float32 sums.

    slot_rows[t, k] (bf16 [T, K, H]): the row the expert of slot k returned for token t."""
    topk_idx, topk_weights, slot_rows = topk_idx.cpu(), topk_weights.cpu(), slot_rows.cpu()
    t_count, k_count = topk_idx.shape
    acc = torch.zeros(t_count, slot_rows.shape[-1], dtype=torch.float32)
    for t in range(t_count):
        for k in range(k_count):
            if int(topk_idx[t, k]) >= 0:
                acc[t] = acc[t] + topk_weights[t, k].float() * slot_rows[t, k].float()
    return acc.to(torch.bfloat16)


def low_latency_combine_per_rank(topk_idx: torch.Tensor, topk_weights: torch.Tensor, slot_rows: torch.Tensor,
                                 num_local: int) -> torch.Tensor:
    """The per-rank order: for each token, the ranks of its picks (rank = expert // num_local) in the order of
    their first pick; rank d contributes part_d = sum over its picks k ascending of w[t, k] * float(row) (float32),
    rounded to bf16 when it has two picks or more; out[t] = bf16(sum of the parts in that order, float32)."""
    topk_idx, topk_weights, slot_rows = topk_idx.cpu(), topk_weights.cpu(), slot_rows.cpu()
    t_count, k_count = topk_idx.shape
    out = torch.zeros(t_count, slot_rows.shape[-1], dtype=torch.bfloat16)
    for t in range(t_count):
        ranks: list[int] = []  # in the order of their first pick
        picks: dict[int, list[int]] = {}
        for k in range(k_count):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            d = e // num_local
            if d not in picks:
                ranks.append(d)
                picks[d] = []
            picks[d].append(k)
        acc = torch.zeros(slot_rows.shape[-1], dtype=torch.float32)
        for d in ranks:
            part = torch.zeros(slot_rows.shape[-1], dtype=torch.float32)
            for k in picks[d]:
                part = part + topk_weights[t, k].float() * slot_rows[t, k].float()
            if len(picks[d]) >= 2:
                part = part.to(torch.bfloat16).float()
            acc = acc + part
        out[t] = acc.to(torch.bfloat16)
    return out


# ------------------------------------------------------------------------------------------ test inputs
def generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded from integers: the same on every rank, independent of call order."""
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + int(p) + 12345) % (2 ** 62)
    return torch.Generator().manual_seed(seed)


def make_topk_idx(gen: torch.Generator, num_tokens: int, num_experts: int, k: int, num_ranks: int,
                  kind: str = "random", drop: float = 0.25) -> torch.Tensor:
    """int64 [T, K] routing, distinct experts per token, -1 for unused slots.

    kind: "random" (each slot unused with probability `drop`), "dense" (no -1), "skewed" (every token picks
    the last expert only), "avoid_last_rank" (no expert of the last rank: it receives nothing), "unused" (all -1).
    """
    idx = torch.full((num_tokens, k), -1, dtype=torch.int64)
    if num_tokens == 0 or kind == "unused":
        return idx
    if kind == "skewed":
        idx[:, 0] = num_experts - 1
        return idx
    pool = num_experts - num_experts // num_ranks if kind == "avoid_last_rank" else num_experts
    take = min(k, pool)
    scores = torch.rand(num_tokens, pool, generator=gen)
    idx[:, :take] = scores.topk(take, dim=1).indices
    if kind in ("random", "avoid_last_rank"):
        unused = torch.rand(num_tokens, k, generator=gen) < drop
        idx[unused] = -1
    return idx


def make_weights(gen: torch.Generator, topk_idx: torch.Tensor, grid: bool = False) -> torch.Tensor:
    """float32 [T, K] positive weights (multiples of 1/16 in (0, 1] with grid=True, so products stay exact)."""
    if grid:
        return torch.randint(1, 17, topk_idx.shape, generator=gen).float() / 16
    return torch.rand(topk_idx.shape, generator=gen) + 0.05


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def make_x(gen: torch.Generator, num_tokens: int, hidden: int, kind: str = "randn",
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[T, H] activations.

    kind: "randn"; "special" (randn with NaNs of several payloads, +-inf, -0.0 and subnormals: copies must
    keep every bit); "grid" (multiples of 1/16 in [-8, 8]: sums of a few of them, and their products with grid
    weights, are exact in float32 and in bf16 after scaling by small integers); "fp8" (rows spanning many
    magnitudes, with zero rows, tiny values and 128-blocks whose amax is exactly 448 * 2^k)."""
    if kind == "grid":
        return (torch.randint(-128, 129, (num_tokens, hidden), generator=gen).double() / 16).to(dtype)
    x = torch.randn(num_tokens, hidden, generator=gen, dtype=torch.float64)
    if kind == "special":
        x = x.to(dtype)
        bits = x.view(_SAME_SIZE_INT[x.element_size()])
        pick = torch.rand(num_tokens, hidden, generator=gen)
        for lo, value in ((0.00, float("inf")), (0.02, float("-inf")), (0.04, -0.0), (0.06, -1e-40), (0.08, 1e-310)):
            x[(pick >= lo) & (pick < lo + 0.02)] = value  # subnormals: 1e-40 in bf16/float32, 1e-310 in float64
        nan = (pick >= 0.10) & (pick < 0.14)
        exponent = {2: 0x7F80, 4: 0x7F800000, 8: 0x7FF0000000000000}[x.element_size()] if \
            dtype == torch.bfloat16 or x.element_size() > 2 else 0x7C00
        payload = torch.randint(1, 64, (int(nan.sum()),), generator=gen).to(bits.dtype)
        bits[nan] = payload | exponent  # quiet and signalling NaNs with different payloads
        bits[nan & (pick >= 0.12)] |= -1 << (8 * x.element_size() - 1)  # some negative
        return x
    if kind == "fp8" and num_tokens:
        magnitude = 10.0 ** (torch.rand(num_tokens, 1, generator=gen, dtype=torch.float64) * 8 - 5)
        x = x * magnitude
        x[0] = 0.0  # amax below the 1e-4 floor
        if num_tokens > 1:
            x[1, :128] *= 1e-7  # a tiny block: subnormal e4m3
        if num_tokens > 2:
            x[2, :] = x[2, :].clamp(-1, 1)
            x[2, 5] = 448.0 * 2 ** -3  # the amax of its block is exactly 448 * 2^-3: round_scale exponent -3
        if num_tokens > 3:
            x[3] = x[3].sign() * 1000.0  # one magnitude: every value hits 448 after scaling
    return x.to(dtype)
