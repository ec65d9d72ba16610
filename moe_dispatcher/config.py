"""Kernel launch configuration (DeepEP V1-compatible `Config`) and the tuned tables per rank count."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Optional

from .env import env_int
from .topology import NVL_SIZE_ENV
from .validation import MAX_TOPK, check_count

# Upper bounds the kernels are compiled for (and MAX_TOPK, from validation); the buffer-size hints assume them.
MAX_NVL_PEERS = 8
_ALIGN = 128


def _align(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


def align_slot(nbytes: int) -> int:
    """Size of a ring slot holding `nbytes`: every slot of the intranode and internode rings is a multiple of 128
    bytes, so each starts on a cache line (4 x H200, intranode stream dispatch: BF16 396.6 vs 376.1 GB/s at
    20 SMs, FP8 384.0 vs 335.2 at 24, against 16-byte slots; combine unchanged; docs/intranode.md)."""
    return _align(nbytes, 128)


@dataclass(frozen=True)
class Config:
    """How many SMs a normal-mode kernel uses and how tokens are chunked through the channel FIFOs.

    `num_sms` must be even: each channel is a pair of SMs (one sends, one receives). A sender moves at most
    `num_max_nvl_chunked_send_tokens` tokens per step into a per-peer ring of
    `num_max_nvl_chunked_recv_tokens` slots (likewise for the RDMA hop of internode mode).
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        for field in fields(self):  # every field is a count: an int, not a bool (TypeError names the field)
            check_count(f"Config.{field.name}", getattr(self, field.name), 1)
        if self.num_sms % 2:
            raise ValueError(f"Config.num_sms must be a positive even number, got {self.num_sms}")
        for send, recv, what in (
            (self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens, "nvl"),
            (self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens, "rdma"),
        ):
            if send > recv:
                raise ValueError(f"Config: num_max_{what}_chunked_send_tokens ({send}) must not exceed "
                                 f"num_max_{what}_chunked_recv_tokens ({recv})")

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    @staticmethod
    def slot_bytes(hidden_bytes: int) -> int:
        """Bytes of one token slot in a channel ring: payload, FP8 scales, top-k ids/weights, source index (at
        least any kernel's slot for rows of `hidden_bytes`, both rounded by align_slot)."""
        scale_bytes = (hidden_bytes + 127) // 128 * 4
        return align_slot(hidden_bytes + scale_bytes + MAX_TOPK * (8 + 4) + 16)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink (CUDA IPC) buffer per GPU that normal-mode dispatch/combine need.

        hidden_bytes: bytes of one token row (H * element size; pass H * 2 for FP8 to leave room for BF16
        combine). The control words and messages ahead of the rings (the internode layout's, a superset of the
        intranode kRingsOffset), then per source peer a block of `num_channels` rings of
        `num_max_nvl_chunked_recv_tokens` slots of slot_bytes, plus 128 bytes of rounding: at least what both
        backends require (compiled.intranode.required_nvl_bytes, the internode buffer_layout).
        """
        check_count("hidden_bytes", hidden_bytes, 1)
        check_count("num_ranks", num_ranks, 1)
        nvl_peers = min(num_ranks, MAX_NVL_PEERS)
        header = internode_nvl_header_bytes(num_ranks)
        block = self.num_channels * self.num_max_nvl_chunked_recv_tokens * self.slot_bytes(hidden_bytes)
        return header + nvl_peers * _align(block + 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, nvl_size: Optional[int] = None) -> int:
        """Bytes of NVSHMEM symmetric buffer per GPU for internode normal mode (0 when one domain suffices).

        nvl_size: GPUs per NVLink domain (default: MOE_DISPATCHER_NVL_SIZE when set, else min(num_ranks, 8)).
        Covers the extension's layout: the control words and count messages, then for every domain one
        receive block and one send-staging block of `num_channels` rings of
        `num_max_rdma_chunked_recv_tokens` slots (slots sized by slot_bytes, enough for dispatch and combine).
        """
        check_count("hidden_bytes", hidden_bytes, 1)
        check_count("num_ranks", num_ranks, 1)
        nvl = default_nvl_size(num_ranks) if nvl_size is None else check_count("nvl_size", nvl_size, 1)
        if nvl <= 0 or num_ranks % nvl:
            raise ValueError(f"nvl_size {nvl} must divide num_ranks {num_ranks}")
        num_domains = num_ranks // nvl
        if num_domains <= 1:
            return 0
        ring = _align(self.num_channels * self.num_max_rdma_chunked_recv_tokens * self.slot_bytes(hidden_bytes))
        return internode_rdma_header_bytes(num_ranks, nvl) + 2 * num_domains * ring


def default_nvl_size(num_ranks: int) -> int:
    """GPUs per NVLink domain when none is given: MOE_DISPATCHER_NVL_SIZE if set, else min(num_ranks, 8)."""
    return env_int(NVL_SIZE_ENV, min(num_ranks, MAX_NVL_PEERS), minimum=1)


# ------------------------------------------------------------------ internode buffer headers
# The internode buffers' layout is computed by the extension (buffer_layout in csrc/internode_bindings.cpp, the
# one formula the kernels read). The size hints above need only the bytes ahead of the rings, on machines
# without the extension too: that arithmetic is repeated here, and only here (tests/kernels/test_internode_gpu.py checks
# that the hints cover the extension's layout). Constants: the kernels' (csrc/kernels/internode/protocol.h).
INTERNODE_MAX_CHANNELS = 32
INTERNODE_MAX_LOCAL_EXPERTS = 1024
INTERNODE_MAX_DOMAINS = 64
RDMA_CONTROL_BYTES = _align(8 * (INTERNODE_MAX_DOMAINS + 4 * INTERNODE_MAX_CHANNELS * INTERNODE_MAX_DOMAINS), 4096)
NVL_CONTROL_BYTES = 77824  # intranode::kRingsOffset


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def internode_rdma_header_bytes(num_ranks: int, nvl_size: int) -> int:
    """Bytes of the NVSHMEM buffer ahead of its rings: control, then the team messages and their staging copy."""
    d = num_ranks // nvl_size
    msg_ints = _align16(1 + num_ranks + INTERNODE_MAX_CHANNELS +
                        nvl_size * (INTERNODE_MAX_CHANNELS + INTERNODE_MAX_LOCAL_EXPERTS))
    return RDMA_CONTROL_BYTES + 2 * _align(2 * d * msg_ints * 4, 4096)


def internode_nvl_header_bytes(num_ranks: int) -> int:
    """Bytes of the NVLink buffer ahead of its rings in internode mode (a superset of the intranode header):
    the intranode control words, then the domain messages."""
    msg_ints = _align16(1 + num_ranks + INTERNODE_MAX_CHANNELS + INTERNODE_MAX_LOCAL_EXPERTS)
    return _align(NVL_CONTROL_BYTES + 2 * num_ranks * msg_ints * 4, 4096)


# Tuned tables: (num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens) per rank count, from
# chunk sweeps of the intranode kernels' stream protocol (the default) on H200s (2026-11-21, 4096 tokens,
# H=7168, 8-24 SMs; bench/results/*-092* in 62f8696); 8 ranks untuned. The internode path takes the same tables:
# 64-slot combine rings help the intranode combine at 24 SMs (386 vs 354 GB/s, equal at 20;
# bench/results/nvl_knobs_h200x4_20261121-0950.txt in 62f8696) but slow internode's NVLink forwarding 1.4x (1424 vs 1011
# us, bench/results/bench_internode_h200x4_20261121-1012.md in 62f8696), so 4 ranks keep 256.
_DISPATCH_TABLE = {2: (8, 256), 4: (12, 256), 8: (6, 256)}
_COMBINE_TABLE = {2: (8, 256), 4: (16, 256), 8: (4, 256)}


# Internode RDMA hop: rows per send step and ring slots. Every warp of a sender group puts the rows it staged
# and completes them (quiet) before one tail signal per step, so larger steps amortise that fixed cost; 32 is
# the kernels' largest step (MAX_CHUNK).
_RDMA_CHUNK, _RDMA_SLOTS = 32, 256


def _tuned(table: dict, num_ranks: int, num_sms: int) -> Config:
    check_count("num_ranks", num_ranks, 1)
    key = min((k for k in table if k >= num_ranks), default=max(table))
    send, recv = table[key]
    return Config(num_sms, send, recv, _RDMA_CHUNK, _RDMA_SLOTS)


@functools.lru_cache(maxsize=64, typed=True)  # Config is frozen: one object per (ranks, SMs); typed: 4.0 is no hit for 4
def get_dispatch_config(num_ranks: int, num_sms: int = 20) -> Config:
    """Tuned normal-mode dispatch config for `num_ranks` GPUs."""
    return _tuned(_DISPATCH_TABLE, num_ranks, num_sms)


@functools.lru_cache(maxsize=64, typed=True)
def get_combine_config(num_ranks: int, num_sms: int = 20) -> Config:
    """Tuned normal-mode combine config for `num_ranks` GPUs."""
    return _tuned(_COMBINE_TABLE, num_ranks, num_sms)


# ------------------------------------------------------------------ the default SM count
# The num_sms a Buffer uses when neither a Config nor Buffer.set_num_sms gives one: the smallest count whose
# exchange reaches the ceiling (every SM past it is taken from the GEMMs running beside the exchange and buys no
# bandwidth). A fresh dispatch fixes the handle's channel count, which must be the same on every rank, so the
# Buffer asks with facts every rank shares: the group size, one NVLink domain or not, the row bytes, and
# REFERENCE_TOKENS (token counts may differ between ranks); a caller that knows a group-wide token count can pass
# default_num_sms(...) to Buffer.set_num_sms. The rule reads measured sweeps, one edit to update:
#   (num_ranks, one NVLink domain) -> {payload bytes per rank (tokens x hidden bytes):
#                                      {num_sms: microseconds of one cached BF16 dispatch + combine}}
# `python -m moe_dispatcher.bench --mode overlap` prints the entry of the shape it ran ("num_sms rule point").
# (4, True): 4 x H200, 2026-11-21, 4096 tokens x hidden 7168, dispatch BF16 + combine per SM count
# (bench/results/h200x4.md, "Normal mode, cached-handle calls").
NUM_SMS_SWEEPS = {
    (4, True): {4096 * 7168 * 2: {8: 2496, 16: 1305, 20: 1092, 22: 1053, 24: 1186}},
}
# The same for a Buffer with a peer pool (num_pool_bytes > 0, one NVLink domain): direct dispatch and pull combine
# reach the ceiling with fewer SMs. (4, True): 4 x H200, 2026-11-27, the normal bench with --num-pool-bytes 4 GiB,
# cached BF16 dispatch + combine (bench/results/h200x4.md, "Peer pool").
NUM_SMS_SWEEPS_DIRECT = {
    (4, True): {4096 * 7168 * 2: {4: 2456, 6: 1689, 8: 1319, 10: 1096, 12: 1078, 16: 1036, 24: 1016}},
}
NUM_SMS_CEILING = 0.95  # a count "reaches the ceiling" when its time is within 1/0.95 of the sweep's best
NUM_SMS_FALLBACK = 20  # (ranks, NVLink) without a sweep: DeepEP V1's default
REFERENCE_TOKENS = 4096  # tokens per rank assumed when the caller knows no group-wide count


class DefaultNumSms(int):
    """Buffer.num_sms until Buffer.set_num_sms (or an assignment) replaces it: reads as DeepEP V1's 20, and tells
    the Buffer to take the SM count of each fresh dispatch from default_num_sms instead."""

    def __repr__(self) -> str:
        return f"DefaultNumSms({int(self)})"


def is_default_num_sms(value: int) -> bool:
    """True when `value` (a Buffer.num_sms) is the untouched default rather than a count the user set."""
    return type(value) is DefaultNumSms


def smallest_at_ceiling(times_us: dict) -> int:
    """The smallest SM count of one sweep {num_sms: time} whose time is within 1/NUM_SMS_CEILING of the best."""
    best = min(times_us.values())
    return min(sms for sms, t in times_us.items() if t <= best / NUM_SMS_CEILING)


def default_num_sms(num_ranks: int, nvlink: bool = True, hidden_bytes: int = 7168 * 2,
                    num_tokens: Optional[int] = None, direct: bool = False) -> int:
    """The smallest SM count that reaches the exchange's ceiling for this group and size.

    num_ranks: ranks of the group; nvlink: True when they share one NVLink domain (False: the internode path);
    hidden_bytes: bytes of one dispatched row (H x element size); num_tokens: tokens per rank, the same on every
    rank (None: REFERENCE_TOKENS); direct: the Buffer has a peer pool (direct dispatch and pull combine, one NVLink
    domain: NUM_SMS_SWEEPS_DIRECT). Reads NUM_SMS_SWEEPS[(num_ranks, nvlink)] at the measured payload nearest to
    num_tokens x hidden_bytes (log scale) and returns the smallest num_sms whose round time is within
    1/NUM_SMS_CEILING of that sweep's best; NUM_SMS_FALLBACK where no sweep was measured. Every rank must get the
    same answer (the ranks' channel counts must agree), so pass only group-wide facts.
    """
    check_count("num_ranks", num_ranks, 1)
    check_count("hidden_bytes", hidden_bytes, 1)
    tokens = REFERENCE_TOKENS if num_tokens is None else check_count("num_tokens", num_tokens, 1)
    payload = hidden_bytes * tokens
    table = NUM_SMS_SWEEPS_DIRECT if direct and nvlink else NUM_SMS_SWEEPS
    sweeps = table.get((num_ranks, bool(nvlink)))
    if not sweeps:
        return NUM_SMS_FALLBACK
    nearest = min(sweeps, key=lambda size: abs(math.log(size / payload)))
    return smallest_at_ceiling(sweeps[nearest])


def default_num_sms_bound(num_ranks: int) -> int:
    """The largest count default_num_sms can answer for `num_ranks` (any size, NVLink or not): the num_sms of
    Buffer.get_dispatch_config / get_combine_config while Buffer.num_sms is the default, so a Buffer sized from
    them holds the rings of every default choice."""
    check_count("num_ranks", num_ranks, 1)
    picks = [smallest_at_ceiling(times) for table in (NUM_SMS_SWEEPS, NUM_SMS_SWEEPS_DIRECT)
             for (ranks, _), sweeps in table.items() if ranks == num_ranks for times in sweeps.values()]
    return max([NUM_SMS_FALLBACK] + picks)
