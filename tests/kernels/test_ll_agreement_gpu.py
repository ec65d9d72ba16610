"""Low-latency dispatch agreement on real GPUs (docs/low_latency.md, "Agreement").

One rank (the last) passes another hidden size, expert count, top-k or use_fp8 to low_latency_dispatch than the
others. The compiled kernels carry each call's signature in the dispatch count words (and, at one place whatever
the layout, in a signature word per source), so every rank's receive finds the difference, takes that source as
sending nothing and ends: the bad call returns well within the kernel timeout (MOE_DISPATCHER_TIMEOUT_S=30, so a
timeout cannot pass for a detection), and every rank's next call, its combine and its hooks raise
SignatureMismatch naming the field, this rank's values and the other rank's. Before this check the same calls
moved bytes the receivers misread, or waited for count words that never came.
A long run of agreeing calls (dispatch + combine pairs over both buffer halves, hooked and unhooked, per-rank and
per-expert order, NVLink and NVSHMEM puts, use_fp8 and round_scale changing per call alike on every rank, so a
late signature word of the previous call on a half differs from the current one) records nothing and stays
bit-exact.
A mismatch may be recorded against a source that agrees: a sender laid out differently stores its count words
over other sources' (the message then says so); the tests accept it.
The layout fields (hidden, num_max_dispatch_tokens_per_rank, num_experts) differ above on a Buffer's first call.
A later call whose layout differs from the previous call's runs the layout change's rounds first (host
all-gathers under MOE_DISPATCHER_TIMEOUT_S, docs/low_latency.md "Layout change"): ranks changing to different
layouts (at a call, or in clean_low_latency_buffer) raise SignatureMismatch on every rank, quickly, and the Buffer
stays usable (the old layout's pairs, then an agreed change, bit-exact); a rank changing alone raises a timeout
naming the round and the rank that never came, and posts its abort, on which that rank's waiting kernel gives up:
its next call raises "rank r raised: ..." with the message.
"""
from __future__ import annotations

import contextlib
import random
import time

import pytest
import torch
import torch.distributed as dist
from dist import GPU_WORLD_SIZES, assert_equal, case, device, make_buffer, run_distributed

from moe_dispatcher.reference.fp8 import dequantize, per_token_cast_to_fp8
from moe_dispatcher.reference.low_latency import weighted_sum_per_rank
from moe_dispatcher.signature import SignatureMismatch

pytestmark = pytest.mark.gpu
WORLD_SIZES = GPU_WORLD_SIZES
MAX_T, MAX_H, MAX_E = 128, 4096, 64
H, E, K = 2048, 32, 4
TIMEOUT_S = 30
ENV = {"MOE_DISPATCHER_TIMEOUT_S": str(TIMEOUT_S)}

# (the field that differs, what the last rank passes instead, a Buffer's first call?, NVLink to the peers)
DISAGREEMENTS = [
    ("hidden", {"h": 2 * H}, True, True),
    ("hidden", {"h": 2 * H}, True, False),
    ("num_experts", {"e": 2 * E}, True, True),
    ("use_fp8", {"fp8": True}, False, True),
    ("use_fp8", {"fp8": True}, False, False),
    ("top-k", {"k": 2 * K}, False, True),
]


def _kernel_buffer(nvlink: bool):
    buf = make_buffer(low_latency=True, max_tokens=MAX_T, hidden=MAX_H, num_experts=MAX_E, backend="kernels",
                      explicitly_destroy=True, allow_nvlink_for_low_latency_mode=nvlink)
    if buf._kernels_ll is None:
        raise AssertionError(f"the low-latency kernels are not available: {buf._kernels_ll_why}")
    return buf


def _keep_nvshmem(num_ranks: int):
    """A small Buffer alive through a worker's Buffers, so that NVSHMEM stays initialised between them (their
    destroy frees their heap, not NVSHMEM)."""
    return make_buffer(low_latency=True, max_tokens=8, hidden=128, num_experts=2 * num_ranks, backend="kernels",
                       explicitly_destroy=True)


def _inputs(dev, t: int, h: int, e: int, k: int, gen: torch.Generator):
    x = torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16)
    idx = torch.rand(t, e, device=dev, generator=gen).topk(k, dim=1).indices
    return x, idx, torch.rand(t, k, device=dev, generator=gen)


def _disagreement_worker(rank: int, num_ranks: int) -> None:
    dev = device()
    gen = torch.Generator(device=dev).manual_seed(rank)
    odd = num_ranks - 1
    keep = _keep_nvshmem(num_ranks)
    for field, change, first_call, nvlink in DISAGREEMENTS:
        label = f"{field} differs on rank {odd} ({'first call' if first_call else 'after agreeing calls'}, " \
                f"{'NVLink' if nvlink else 'NVSHMEM puts'})"
        kb = _kernel_buffer(nvlink)
        with case(label):
            mine = {"h": H, "e": E, "k": K, "fp8": False}
            if not first_call:  # agreeing pairs first, on both halves
                for _ in range(2):
                    x, idx, w = _inputs(dev, MAX_T, H, E, K, gen)
                    recv, _, handle, _, _ = kb.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)
                    kb.low_latency_combine(recv, idx, w, handle)
                torch.cuda.synchronize()
                assert kb._kernels_ll.signature_info() is None
                dist.barrier()
            if rank == odd:
                mine.update(change)
            x, idx, w = _inputs(dev, MAX_T, mine["h"], mine["e"], mine["k"], gen)
            start = time.monotonic()
            recv, _, handle, _, _ = kb.low_latency_dispatch(x, idx, MAX_T, mine["e"], use_fp8=mine["fp8"])
            torch.cuda.synchronize()  # the receive found the other rank's signature and ended
            elapsed = time.monotonic() - start
            assert elapsed < TIMEOUT_S / 3, f"the disagreeing dispatch took {elapsed:.1f} s (timeout {TIMEOUT_S} s)"
            info = kb._kernels_ll.signature_info()
            assert info is not None, "no mismatch recorded"
            with pytest.raises(SignatureMismatch) as err:
                kb.low_latency_dispatch(x, idx, MAX_T, mine["e"], use_fp8=mine["fp8"])
            msg = str(err.value)
            show = {"hidden": mine["h"], "num_experts": mine["e"], "top-k": mine["k"],
                    "use_fp8": "yes" if mine["fp8"] else "no"}
            assert f"{field}={show[field]}" in msg, msg  # this rank's value
            if "stored over" in msg:
                # a sender laid out differently wrote its count words at its own offsets, over those of any
                # source here (this rank's own included): the record names that source, which agrees
                assert 0 <= info[1] < num_ranks, (rank, info)
            else:
                others = [odd] if rank != odd else [r for r in range(num_ranks) if r != odd]
                assert info[1] in others, (rank, info)
                tag_only = info[2] >> 63 == 1  # only the count word's tag: a layout field shows as one of three
                layout_named = field in ("hidden", "num_experts") and "or num_experts differs" in msg
                assert f"{field} differs" in msg or (tag_only and layout_named), msg
                assert f"rank {rank} called with" in msg and f"rank {info[1]} with" in msg, msg
            rows = torch.zeros((recv[0] if mine["fp8"] else recv).shape, dtype=torch.bfloat16, device=dev)
            with pytest.raises(SignatureMismatch):  # its combine
                kb.low_latency_combine(rows, idx, w, handle)
            with pytest.raises(SignatureMismatch):  # a hooked call
                kb.low_latency_dispatch(x, idx, MAX_T, mine["e"], use_fp8=mine["fp8"], return_recv_hook=True)
            torch.ones(1, device=dev).sum().item()  # the CUDA context survived
        dist.barrier()
        kb.destroy()
    keep.destroy()


# The FP8 flags of agreeing call `it`, alike on every rank: consecutive dispatches differ (so on one buffer half,
# each call's signature differs from the one before it there: a late signature word of the earlier call must not
# pass for a mismatch).
FLAGS = [(False, False), (True, False), (True, True)]


def _rows_for_combine(recv, use_fp8: bool) -> torch.Tensor:
    """The dispatched rows as bf16 (the FP8 ones dequantised), [L, R * max tokens, H]."""
    if not use_fp8:
        return recv
    q, scales = recv
    return dequantize(q, scales).to(torch.bfloat16)


def _agreeing_worker(rank: int, num_ranks: int, iterations: int) -> None:
    dev = device()
    rng = random.Random(rank)
    gen = torch.Generator(device=dev).manual_seed(rank)
    keep = _keep_nvshmem(num_ranks)
    for nvlink, reduction in ((True, "per_rank"), (True, "per_expert"), (False, "per_rank")):
        kb = _kernel_buffer(nvlink)
        kb.low_latency_combine_reduction = reduction
        bad = torch.zeros((), dtype=torch.int64, device=dev)
        with case(f"{iterations} agreeing dispatch + combine pairs ({'NVLink' if nvlink else 'NVSHMEM puts'}, "
                  f"{reduction}), hooked and unhooked, use_fp8 / round_scale changing per call"):
            for it in range(iterations):
                x, idx, w = _inputs(dev, rng.randint(0, MAX_T), H, E, K, gen)
                use_fp8, round_scale = FLAGS[it % len(FLAGS)]
                hooked = it % 2 == 1
                recv, _, handle, _, hook = kb.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=use_fp8,
                                                                   round_scale=round_scale, return_recv_hook=hooked)
                if hooked:
                    hook()
                out, _, hook = kb.low_latency_combine(_rows_for_combine(recv, use_fp8), idx, w, handle,
                                                      return_recv_hook=hooked)
                if hooked:
                    hook()
                sent = dequantize(*per_token_cast_to_fp8(x, round_scale)).to(torch.bfloat16) if use_fp8 else x
                bad += (out.view(torch.int16) != _want(sent, idx, w, reduction, num_ranks).view(torch.int16)).sum()
            torch.cuda.synchronize()
            assert kb._kernels_ll.signature_info() is None, kb._kernels_ll.signature_info()
            assert int(bad) == 0, f"{int(bad)} combined elements differ over {iterations} pairs"
        with case("a pair after the run"):
            x, idx, w = _inputs(dev, MAX_T, H, E, K, gen)
            recv, _, handle, _, _ = kb.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)
            assert_equal(kb.low_latency_combine(recv, idx, w, handle)[0], _want(x, idx, w, reduction, num_ranks),
                         "after the run", bitwise=True)
        dist.barrier()
        kb.destroy()
    keep.destroy()


def _want(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, reduction: str, num_ranks: int) -> torch.Tensor:
    """combine(dispatch(x)) with identity experts: the reference's per-rank order, or bf16(sum over k ascending of
    w_k * x) in float32 (per-expert)."""
    if reduction == "per_rank":
        return weighted_sum_per_rank(x.float().unsqueeze(1).expand(-1, K, -1), idx, w, E // num_ranks, num_ranks)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(idx.shape[1]):
        acc = acc + torch.where(idx[:, k:k + 1] >= 0, w[:, k:k + 1] * x.float(), torch.zeros_like(acc))
    return acc.to(torch.bfloat16)


def _pair_bit_exact(kb, dev, h: int, gen: torch.Generator, num_ranks: int, what: str) -> None:
    """One dispatch + combine at (MAX_T, h, E), compared bit for bit with combine(dispatch(x))."""
    x, idx, w = _inputs(dev, MAX_T, h, E, K, gen)
    recv, _, handle, _, _ = kb.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)
    assert_equal(kb.low_latency_combine(recv, idx, w, handle)[0], _want(x, idx, w, "per_rank", num_ranks), what,
                 bitwise=True)


def _layout_change_worker(rank: int, num_ranks: int) -> None:
    dev = device()
    gen = torch.Generator(device=dev).manual_seed(rank)
    odd = num_ranks - 1
    keep = _keep_nvshmem(num_ranks)
    for nvlink in (True, False):
        kb = _kernel_buffer(nvlink)
        how = "NVLink" if nvlink else "NVSHMEM puts"
        with case(f"agreeing pairs at hidden {H}, {E} experts ({how})"):
            for _ in range(2):
                _pair_bit_exact(kb, dev, H, gen, num_ranks, "before the change")
        with case(f"rank {odd} changes hidden, the others num_experts ({how})"):
            h, e = (2 * H, E) if rank == odd else (H, 2 * E)
            x, idx, _ = _inputs(dev, MAX_T, h, e, K, gen)
            start = time.monotonic()
            with pytest.raises(SignatureMismatch) as err:
                kb.low_latency_dispatch(x, idx, MAX_T, e, use_fp8=False)
            elapsed = time.monotonic() - start
            msg = str(err.value)
            assert msg.startswith("low-latency layout change: the ranks' calls do not agree"), msg
            assert "hidden differs" in msg and f"{2 * H} on rank {odd}" in msg and "num_experts differs" in msg, msg
            assert elapsed < TIMEOUT_S / 3, f"the disagreement took {elapsed:.1f} s (timeout {TIMEOUT_S} s)"
            assert kb._kernels_ll.signature_info() is None and kb._kernels_ll.timeout_info() is None
        with case(f"the old layout still serves, then an agreed change ({how})"):
            _pair_bit_exact(kb, dev, H, gen, num_ranks, "the old layout after the disagreement")
            _pair_bit_exact(kb, dev, 2 * H, gen, num_ranks, "after an agreed change")
        with case(f"clean_low_latency_buffer with different hidden sizes ({how})"):
            with pytest.raises(SignatureMismatch, match="low-latency layout change: .*hidden differs"):
                kb.clean_low_latency_buffer(MAX_T, 2 * H if rank == odd else H, E)
            kb.clean_low_latency_buffer(MAX_T, 2 * H, E)
            _pair_bit_exact(kb, dev, 2 * H, gen, num_ranks, "after an agreed clean")
        dist.barrier()
        kb.destroy()
    keep.destroy()


# The lone rank's round starts this long before its peers' dispatch: its deadline passes while their kernel still
# has most of its own timeout left, so the kernel gives up on the abort the lone rank posts, not on that timeout.
LONE_HEAD_START_S = 2 * TIMEOUT_S / 3


def _lone_change_worker(rank: int, num_ranks: int) -> None:
    from moe_dispatcher.compiled.low_latency import LAYOUT_PHASE
    from moe_dispatcher.reference.comm import agree
    from moe_dispatcher.signature import Signature
    dev = device()
    gen = torch.Generator(device=dev).manual_seed(rank)
    odd = num_ranks - 1
    kb = _kernel_buffer(True)
    with case(f"agreeing pairs at hidden {H}"):
        for _ in range(2):
            _pair_bit_exact(kb, dev, H, gen, num_ranks, "before the change")
        torch.cuda.synchronize()
        dist.barrier()
    if rank == odd:
        with case(f"rank {odd} alone changes hidden to {2 * H}"):
            x, idx, _ = _inputs(dev, MAX_T, 2 * H, E, K, gen)
            start = time.monotonic()
            with pytest.raises(RuntimeError) as err:
                kb.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)
            elapsed = time.monotonic() - start
            msg = str(err.value)
            assert f"rank {odd} timed out" in msg and f"{LAYOUT_PHASE}: agreement" in msg, msg
            assert f"waiting for ranks {list(range(odd))}" in msg, msg
            assert elapsed < TIMEOUT_S + 10, f"the lone change took {elapsed:.1f} s (deadline {TIMEOUT_S} s)"
    else:
        with case(f"rank {rank} keeps hidden {H}: its kernel waits for rank {odd} until rank {odd}'s abort"):
            time.sleep(LONE_HEAD_START_S)
            x, idx, _ = _inputs(dev, MAX_T, H, E, K, gen)
            kb.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)
            torch.cuda.synchronize()  # the kernel gave up on rank odd's abort
            with pytest.raises(RuntimeError) as err:
                kb.low_latency_dispatch(x, idx, MAX_T, E, use_fp8=False)
            msg = str(err.value)
            assert f"rank {odd} raised: RuntimeError:" in msg and f"{LAYOUT_PHASE}: agreement" in msg, msg
            assert f"rank {rank} was waiting in low_latency_dispatch" in msg, msg
        with case(f"complete rank {odd}'s abandoned all-gather (the group is whole again for the teardown)"):
            with contextlib.suppress(SignatureMismatch):
                agree(kb._board, Signature(LAYOUT_PHASE, (MAX_T, 2 * H, E)), dev, phase="agreement")
    dist.barrier()


def _signature_worker(rank: int, num_ranks: int) -> None:
    from moe_dispatcher import _ext
    from moe_dispatcher.compiled.low_latency import dispatch_signature
    native = _ext.require("the low-latency kernels").low_latency.dispatch_signature
    for case_ in [(128, 1, 2, 1, False, False, False), (7168, 128, 256, 8, True, True, True),
                  (16384, 65534, 1024, 32, True, False, False), (H, MAX_T, E, K, False, True, False)]:
        assert native(*case_) == dispatch_signature(*case_), case_


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ll_disagreement_raises_on_every_rank(world_size: int) -> None:
    """Another hidden / num_experts (first call), use_fp8 / top-k (after agreeing calls), NVLink and puts: every
    rank's next call raises SignatureMismatch naming the field; the bad call ends long before the timeout."""
    run_distributed(_disagreement_worker, world_size, backend="nccl", env=ENV, timeout=170)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ll_agreeing_calls_record_nothing(world_size: int) -> None:
    """500 agreeing pairs per configuration, both halves, hooked and unhooked, use_fp8 / round_scale changing per
    call alike on every rank: no mismatch, bit-exact."""
    run_distributed(_agreeing_worker, world_size, 500, backend="nccl", env=ENV, timeout=170)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ll_layout_changes_that_differ_raise_on_every_rank(world_size: int) -> None:
    """Ranks changing to different layouts (a call, clean_low_latency_buffer): SignatureMismatch on every rank, no
    hang; the old layout and an agreed change then run bit-exact."""
    run_distributed(_layout_change_worker, world_size, backend="nccl", env=ENV, timeout=170)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ll_lone_layout_change_times_out_and_aborts_its_peers(world_size: int) -> None:
    """One rank changes the layout alone: it raises a timeout naming the round and the missing ranks; the others'
    kernels give up on its abort and their next call raises its message."""
    run_distributed(_lone_change_worker, world_size, backend="nccl", env=ENV, timeout=170)


def test_ll_signature_native_matches_python() -> None:
    """The runtime's packing (low_latency.h) and the Python decoder's mirror agree."""
    if not torch.cuda.is_available():
        pytest.skip("needs the CUDA extension")
    _signature_worker(0, 1)
