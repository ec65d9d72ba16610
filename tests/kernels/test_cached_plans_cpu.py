"""The fast path of repeated cached calls (Buffer.dispatch / Buffer.combine calling a handle's native plan), on CPU.

The real Buffer and IntranodeBackend run over the stub extension of tests/helpers/stub_extension.py, whose plans follow
the native ones (the same "not mine" rules) and record every launch with its launch mode: a call took the fast
path when its plan launched as a synchronous call (LAUNCH_SYNC) or as async_finish (LAUNCH_ASYNC)
instead of LAUNCH_CURRENT (the full path launches inside Buffer._stream_scope).
Checked: repeated calls skip the checks only when the handle, the tensors' metadata and the config are those a
plan was made for; anything else (a bad argument above all) takes the full path and raises as before, with
nothing launched; a recorded timeout or a destroyed buffer still stops every call. And the fresh and expert-major
calls hand the native launchers tensors (None for what is absent), whatever their sizes.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from stub_extension import StubEvent, single_rank_stub

from moe_dispatcher import Buffer, Config
from moe_dispatcher.compiled import LAUNCH_ASYNC, LAUNCH_CURRENT, LAUNCH_SYNC, HandleState
from moe_dispatcher.compiled.intranode import combine_slot_bytes, dispatch_slot_bytes
from moe_dispatcher.signature import SignatureMismatch, raise_disagreement, ring_disagreement, ring_signature_word

T, H, E, K = 16, 256, 8, 2
ROWS = 24  # rows notify "received" (the stub's answer)


@pytest.fixture
def world(monkeypatch, tmp_path):
    with single_rank_stub(str(tmp_path / "store"), ROWS, monkeypatch.setattr, T, H, E, K) as (buf, backend, g, x, idx):
        handle = backend.dispatch(x, None, idx, None, torch.full((1,), T, dtype=torch.int32),
                                  torch.ones(T, 1, dtype=torch.bool), torch.zeros(E, dtype=torch.int32), 1, 0)[5]
        yield types.SimpleNamespace(buf=buf, backend=backend, ext=backend._mod, handle=handle, x=x, idx=idx,
                                    y=torch.randn(ROWS, H, generator=g).bfloat16(),
                                    w=torch.rand(ROWS, K, generator=g))


def _modes(w, kind: str) -> list:
    return [args[-1] for k, args in w.ext.launches if k == kind]


def test_repeated_cached_calls_take_the_fast_path(world):
    w = world
    buf, h = w.buf, w.handle
    for _ in range(3):
        recv, idx, weights, counts, new_handle, event = buf.dispatch(w.x, handle=h)
        assert recv.shape == (ROWS, H) and recv.dtype == torch.bfloat16
        assert (idx, weights, counts, new_handle, event.event) == (None, None, None, None, None)
        out, out_w, event = buf.combine(w.y, h)
        assert out.shape == (T, H) and out.dtype == torch.bfloat16 and out_w is None and event.event is None
        out, out_w, _ = buf.combine(w.y, h, topk_weights=w.w)
        assert out_w.shape == (T, K) and out_w.dtype == torch.float32
    # The first call of each kind checks and makes a plan; the later ones launch it.
    assert _modes(w, "CachedDispatch") == [LAUNCH_CURRENT, LAUNCH_SYNC, LAUNCH_SYNC]
    assert _modes(w, "CachedCombine") == [LAUNCH_CURRENT, LAUNCH_CURRENT] + [LAUNCH_SYNC] * 4  # one plan per kind
    # Plans hold the geometry the checks passed (the handle's channels, the config's chunk and ring).
    channels, offsets, direct = h.backend_state.routing
    assert direct is None  # no peer pool: the ring kernels
    _, chunk, slots = w.backend._config(None, combine=False)
    assert w.ext.plans[0] == ("CachedDispatch", (w.backend._timeout_ns, offsets, torch.bfloat16, (T, H), None, channels,
                                                 chunk, slots, dispatch_slot_bytes(H * 2, 0, 0), None, Buffer.num_sms,
                                                 ring_signature_word("cached dispatch", H, torch.bfloat16, None, 0, 0,
                                                                     slots)))
    _, chunk, slots = w.backend._config(None, combine=True)
    assert w.ext.plans[1][1][4:9] == (None, channels, chunk, slots, combine_slot_bytes(H * 2, 0))
    assert w.ext.plans[2][1][4:9] == ((ROWS, K), channels, chunk, slots, combine_slot_bytes(H * 2, K))
    # A launch gets the caller's tensors and the outputs it allocated.
    recv = buf.dispatch(w.x, handle=h)[0]
    x, aux, out, aux_out, mode = w.ext.launches[-1][1]
    assert x is w.x and aux is None and out is recv and aux_out is None and mode == LAUNCH_SYNC


def test_async_finish_on_the_fast_path_returns_the_native_event(world):
    w = world
    for _ in range(2):
        recv, *_, event = w.buf.dispatch(w.x, handle=w.handle, async_finish=True)
    assert isinstance(event.event, StubEvent) and _modes(w, "CachedDispatch") == [LAUNCH_CURRENT, LAUNCH_ASYNC]
    assert event.extra_tensors[0] is w.x and event.extra_tensors[1] is recv
    event.current_stream_wait()
    for _ in range(2):
        out, out_w, event = w.buf.combine(w.y, w.handle, topk_weights=w.w, async_finish=True)
    assert _modes(w, "CachedCombine")[-1] == LAUNCH_ASYNC
    assert [t is u for t, u in zip(event.extra_tensors, (w.y, w.w, out, out_w))] == [True] * 4


def test_fp8_dispatch_takes_the_fast_path_with_contiguous_scales(world):
    w = world
    x8 = w.x.float().to(torch.float8_e4m3fn)
    scales = torch.rand(T, H // 128)
    for _ in range(2):
        (recv, recv_scales), *_ = w.buf.dispatch((x8, scales), handle=w.handle)
        assert recv.dtype == torch.float8_e4m3fn and recv_scales.shape == (ROWS, H // 128)
    column_major = torch.rand(H // 128, T).t()  # accepted, copied by the full path
    w.buf.dispatch((x8, column_major), handle=w.handle)
    assert _modes(w, "CachedDispatch") == [LAUNCH_CURRENT, LAUNCH_SYNC, LAUNCH_CURRENT]
    assert len(w.ext.plans) == 1


def _noncontiguous(rows: int, cols: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.zeros(cols, rows, dtype=dtype).t()


BAD_DISPATCH = [
    (dict(x=torch.zeros(T, H, dtype=torch.int32)), TypeError, "x must have dtype"),
    (dict(x=torch.zeros(T + 1, H, dtype=torch.bfloat16)), ValueError, "x must have shape"),
    (dict(x=torch.zeros(T, H, 1, dtype=torch.bfloat16)), ValueError, "x must be 2-D"),
    (dict(x=_noncontiguous(T, H)), ValueError, "contiguous"),
    (dict(x=torch.zeros(T, 4, dtype=torch.bfloat16)), ValueError, "multiple of 16"),
    (dict(x=[torch.zeros(T, H, dtype=torch.bfloat16)]), TypeError, "tuple must be"),
    (dict(x=(torch.zeros(T, H, dtype=torch.bfloat16), torch.rand(T, 2))), TypeError, "FP8 data"),
    (dict(x=(torch.zeros(T, H).to(torch.float8_e4m3fn), torch.rand(T + 1, 2))), ValueError, "FP8 scales"),
    (dict(topk_idx=torch.zeros(T, K, dtype=torch.int64)), ValueError, "takes no topk_idx"),
    (dict(topk_weights=torch.zeros(T, K)), ValueError, "takes no topk_idx"),
    (dict(expert_alignment=0), ValueError, "expert_alignment"),
    (dict(expert_alignment=1.0), TypeError, "expert_alignment"),  # a wrong type: TypeError (validation.py)
    (dict(num_worst_tokens=-1), ValueError, "num_worst_tokens"),
    (dict(config="fast"), TypeError, "config must be"),
    (dict(handle=(1, 2)), TypeError, "handle must be a DispatchHandle"),
]


@pytest.mark.parametrize("bad,error,match", BAD_DISPATCH, ids=[m for _, _, m in BAD_DISPATCH])
def test_bad_dispatch_raises_with_a_plan_in_place(world, bad, error, match):
    w = world
    for _ in range(2):  # a plan, used once
        w.buf.dispatch(w.x, handle=w.handle)
    launched = len(w.ext.launches)
    kwargs = dict(x=w.x, handle=w.handle)
    kwargs.update(bad)
    with pytest.raises(error, match=match):
        w.buf.dispatch(**kwargs)
    assert len(w.ext.launches) == launched, "nothing may launch for a bad call"


BAD_COMBINE = [
    (dict(x=torch.zeros(ROWS + 1, H, dtype=torch.bfloat16)), ValueError, "x must have shape"),
    (dict(x=torch.zeros(ROWS, H, dtype=torch.int32)), TypeError, "x must have dtype"),
    (dict(x=_noncontiguous(ROWS, H)), ValueError, "contiguous"),
    (dict(x=torch.zeros(ROWS, 4, dtype=torch.bfloat16)), ValueError, "multiple of 16"),
    (dict(topk_weights=torch.zeros(ROWS, K, dtype=torch.float16)), TypeError, "topk_weights must have dtype"),
    (dict(topk_weights=torch.zeros(ROWS - 1, K)), ValueError, "topk_weights must have shape"),
    (dict(topk_weights=_noncontiguous(ROWS, K, torch.float32)), ValueError, "contiguous"),
    (dict(topk_weights=torch.zeros(ROWS, 17)), ValueError, "at most 16 top-k"),
    (dict(bias=torch.zeros(T + 1, H, dtype=torch.bfloat16)), ValueError, "bias"),
    (dict(bias=torch.zeros(T, H)), TypeError, "bias"),
    (dict(config=1), TypeError, "config must be"),
    (dict(handle=None), TypeError, "handle must be a DispatchHandle"),
]


@pytest.mark.parametrize("bad,error,match", BAD_COMBINE, ids=[m for _, _, m in BAD_COMBINE])
def test_bad_combine_raises_with_a_plan_in_place(world, bad, error, match):
    w = world
    for weights in (None, w.w, None, w.w):
        w.buf.combine(w.y, w.handle, topk_weights=weights)
    launched = len(w.ext.launches)
    kwargs = dict(x=w.y, handle=w.handle)
    kwargs.update(bad)
    with pytest.raises(error, match=match):
        w.buf.combine(**kwargs)
    assert len(w.ext.launches) == launched, "nothing may launch for a bad call"


def test_a_call_unlike_the_plan_checks_and_replans(world):
    w = world
    buf, h = w.buf, w.handle
    buf.dispatch(w.x, handle=h)
    wide = torch.zeros(T, 2 * H, dtype=torch.bfloat16)
    assert buf.dispatch(wide, handle=h)[0].shape == (ROWS, 2 * H)  # another row size: a new plan
    assert buf.dispatch(w.x.half(), handle=h)[0].dtype == torch.float16  # another dtype: a new plan
    buf.dispatch(w.x, handle=h)  # and back
    assert [args[3] for kind, args in w.ext.plans] == [(T, H), (T, 2 * H), (T, H), (T, H)]
    assert _modes(w, "CachedDispatch") == [LAUNCH_CURRENT] * 4

    channels = h.backend_state.routing[0]  # the handle's: a config sets the chunk and ring sizes of a cached call
    cfg = Config(8, 4, 64)
    buf.dispatch(w.x, handle=h, config=cfg)  # another config: a new plan with its geometry
    assert w.ext.plans[-1][1][5:8] == (channels, 4, 64)
    buf.dispatch(w.x, handle=h, config=Config(8, 4, 64))  # an equal config: the same plan, on the fast path
    assert len(w.ext.plans) == 5 and _modes(w, "CachedDispatch")[-1] == LAUNCH_SYNC

    buf.dispatch(w.x, handle=h)  # config None again: a new plan
    sms, n = Buffer.num_sms, len(w.ext.plans)
    try:
        Buffer.set_num_sms(sms + 2)  # the default config changes with it: checked again
        buf.dispatch(w.x, handle=h)
        assert len(w.ext.plans) == n + 1 and _modes(w, "CachedDispatch")[-2:] == [LAUNCH_CURRENT, LAUNCH_CURRENT]
        assert w.ext.plans[-1][1][-2] == sms + 2
    finally:
        Buffer.set_num_sms(sms)

    # A handle whose routing fields were replaced shares the state but not the plan.
    other = h._replace(is_token_in_rank=h.is_token_in_rank.clone())
    n = len(w.ext.plans)
    buf.dispatch(w.x, handle=other)
    assert len(w.ext.plans) == n + 1 and _modes(w, "CachedDispatch")[-1] == LAUNCH_CURRENT
    buf.dispatch(w.x, handle=h)
    assert len(w.ext.plans) == n + 2 and _modes(w, "CachedDispatch")[-1] == LAUNCH_CURRENT
    buf.dispatch(w.x, handle=h)
    assert _modes(w, "CachedDispatch")[-1] == LAUNCH_SYNC


def test_handle_of_another_buffer_is_refused(world):
    w = world
    w.buf.dispatch(w.x, handle=w.handle)
    other = Buffer(num_nvl_bytes=1 << 30, backend="reference", explicitly_destroy=True)
    with pytest.raises(RuntimeError, match="another Buffer"):
        other.dispatch(w.x, handle=w.handle)
    with pytest.raises(RuntimeError, match="another Buffer"):
        other.combine(w.y, w.handle)


def test_timeout_and_destroy_stop_the_fast_path(world):
    w = world
    for _ in range(2):
        w.buf.dispatch(w.x, handle=w.handle)
        w.buf.combine(w.y, w.handle)
    w.buf.get_dispatch_layout(w.idx, E)
    w.backend._ipc.timeout = (1, "combine (receiver waiting for rows)", 0, 0)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="rank 0 timed out .* in combine"):
            w.buf.dispatch(w.x, handle=w.handle)
        with pytest.raises(RuntimeError, match="rank 0 timed out"):
            w.buf.combine(w.y, w.handle)
        # The native layout call refuses too (on GPUs the full path then raises; here CPU tensors resolve to the
        # reference backend, which serves the layout).
        layouts = sum(kind == "layout" for kind, _ in w.ext.launches)
        w.buf.get_dispatch_layout(w.idx, E)
        assert sum(kind == "layout" for kind, _ in w.ext.launches) == layouts
    w.backend._ipc.timeout = None
    w.backend._broken = None
    w.buf.dispatch(w.x, handle=w.handle)
    w.backend._ipc.destroy()  # the backend's buffer gone under the plan
    with pytest.raises(RuntimeError, match="intranode backend was destroyed"):
        w.buf.dispatch(w.x, handle=w.handle)
    w.buf.destroy()
    with pytest.raises(RuntimeError, match="Buffer was destroyed"):
        w.buf.dispatch(w.x, handle=w.handle)
    with pytest.raises(RuntimeError, match="Buffer was destroyed"):
        w.buf.combine(w.y, w.handle)


def test_fresh_and_expert_major_calls_pass_tensors(world):
    """The launchers take tensors, None for what a call lacks; empty tensors (no expert rows here: the stub's
    counts are 0) are passed as they are."""
    w = world
    launches = w.ext.launches
    notify = [args for kind, args in launches if kind == "notify"][-1]
    dispatch = [args for kind, args in launches if kind == "dispatch"][-1]
    assert all(isinstance(t, torch.Tensor) for t in notify[2:5]) and notify[11] is None  # no expert-major layout
    assert dispatch[2] is not None and dispatch[3] is None and dispatch[5] is None  # x, no scales, no weights
    assert dispatch[10].shape == (ROWS, K) and dispatch[11].shape == (ROWS, K)  # received top-k ids and weights
    px, ps, pw, tpe, counts, em = w.backend.expert_major_dispatch(w.x, None, w.idx, torch.rand(T, K), E, 1, 0)
    assert px.shape == (0, H) and ps is None and pw.shape == (0,) and counts == [0] * E
    kinds = [kind for kind, _ in launches]
    assert kinds[-5:] == ["layout", "notify", "dispatch", "pair_rank", "em_permute"]
    permute = launches[-1][1]
    assert permute[7] is px and permute[12].shape == (ROWS, K)  # em_x, the inverse table
    assert isinstance(launches[-4][1][11], torch.Tensor)  # notify's layout table
    out, out_w = w.backend.expert_major_combine(px, em, None, pw, ())
    assert out.shape == (T, H) and out_w.shape == (T, K)
    assert [kind for kind, _ in launches][-2:] == ["em_unpermute", "CachedCombine"]
    out, _ = w.backend.combine(w.y, w.handle, None, (torch.zeros(T, H, dtype=torch.bfloat16),))  # a bias: no plan
    assert launches[-1][0] == "combine" and launches[-1][1][4] is not None and launches[-1][1][5] is None  # bias0


def test_fixed_size_dispatch_gives_the_exchanged_counts_on_the_device(world):
    """dispatch(num_worst_tokens=W) of the intranode backend returns notify's padded per-expert counts on the device
    (the expert-major composition's rows needed, docs/semantics.md), read from the expert-major table notify fills;
    without W they are the host's python ints. Fails when W gives no counts (the composition then counted the rows
    it kept: no silent loss needs the exchanged counts)."""
    w = world
    local = E  # one rank
    out = w.backend.dispatch(w.x, None, w.idx, None, torch.full((1,), T, dtype=torch.int32),
                             torch.ones(T, 1, dtype=torch.bool), torch.zeros(E, dtype=torch.int32), 4, 8)
    counts = out[4]
    notify = [args for kind, args in w.ext.launches if kind == "notify"][-1]
    em_layout = notify[11]  # (the signature hash and problem word follow, by keyword)
    assert em_layout is not None and em_layout.numel() == w.ext.em_layout_words(1, local)
    assert isinstance(counts, torch.Tensor) and counts.dtype == torch.int32 and counts.numel() == local
    padded = 1 * local + 2 * local + 1  # ExpertMajorLayout::padded(0)
    assert counts.data_ptr() == em_layout[padded:].data_ptr()
    assert w.backend.dispatch(w.x, None, w.idx, None, torch.full((1,), T, dtype=torch.int32),
                              torch.ones(T, 1, dtype=torch.bool), torch.zeros(E, dtype=torch.int32), 4, 0)[4] == [0] * E


def test_plans_carry_the_ring_signature_of_their_slot_layout(world):
    """Every cached plan (and the bias combine's launch) gets the ring signature word of its call: the fields that
    fix its ring's slot layout (issue 16 item 2); calls that lay slots out differently get different words."""
    w = world
    buf, h = w.buf, w.handle
    _, _, slots = w.backend._config(None, combine=False)
    _, _, cslots = w.backend._config(None, combine=True)
    scales = torch.ones(T, H // 128, dtype=torch.float32)
    buf.dispatch(w.x, handle=h)
    buf.dispatch(w.x[:, :128].contiguous(), handle=h)
    buf.dispatch(w.x.float(), handle=h)
    buf.dispatch((w.x.to(torch.float8_e4m3fn), scales), handle=h)
    buf.combine(w.y, h)
    buf.combine(w.y, h, topk_weights=w.w)
    words = [args[-1] for _, args in w.ext.plans]
    want = [ring_signature_word("cached dispatch", H, torch.bfloat16, None, 0, 0, slots),
            ring_signature_word("cached dispatch", 128, torch.bfloat16, None, 0, 0, slots),
            ring_signature_word("cached dispatch", H, torch.float32, None, 0, 0, slots),
            ring_signature_word("cached dispatch", H, torch.float8_e4m3fn, torch.float32, H // 128, 0, slots),
            ring_signature_word("combine", H, torch.bfloat16, None, 0, 0, cslots),
            ring_signature_word("combine", H, torch.bfloat16, None, 0, K, cslots)]
    assert words == want and len(set(words)) == len(words) and all(0 < v < 1 << 63 for v in words)
    bias = torch.zeros(T, H, dtype=torch.bfloat16)
    buf.combine(w.y, h, bias=bias)
    assert [args[-1] for kind, args in w.ext.launches if kind == "combine"] == [want[4]]


def test_a_recorded_ring_mismatch_is_raised_by_the_next_dispatch_naming_the_fields(world, monkeypatch):
    """A cached call's receivers recorded a source's differing ring signature (the mailbox pairs) and the next
    fresh dispatch's notify reported problem 6 on this rank (Control::ring_mismatch_seen): cached calls meanwhile
    keep the fast path (no rank raises alone, so no peer waits for it); the fresh dispatch raises SignatureMismatch
    at its host wait naming the problem's rank and, from the gathered pairs, the field with both values and both
    ranks; the pairs are taken, and no abort is posted."""
    w = world
    buf, h, b = w.buf, w.handle, w.backend
    _, _, slots = b._config(None, combine=False)
    mine = ring_signature_word("cached dispatch", H, torch.bfloat16, None, 0, 0, slots)
    theirs = ring_signature_word("cached dispatch", 2 * H, torch.bfloat16, None, 0, 0, slots)
    cmine = ring_signature_word("combine", H, torch.bfloat16, None, 0, 0, slots)
    ctheirs = ring_signature_word("combine", H, torch.float32, None, 0, K, slots)
    b._ipc.ring_mismatch = [(1, theirs, mine), (2, ctheirs, cmine)]
    buf.dispatch(w.x, handle=h)
    buf.dispatch(w.x, handle=h)
    assert _modes(w, "CachedDispatch")[-1] == LAUNCH_SYNC
    b._ipc.signature_mismatch = (b._seq + 1, [6])  # what the notify of the next fresh dispatch records
    b.device = torch.device("cpu")  # the gloo world gathers the signatures and pairs on the CPU
    # (gloo's all-gather takes no stacked output as NCCL's does: one rank's gather is a copy)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, inp, group=None: out.copy_(inp.view(out.shape)))
    with pytest.raises(SignatureMismatch) as err:
        b.dispatch(w.x, None, w.idx, None, torch.full((1,), T, dtype=torch.int32), torch.ones(T, 1, dtype=torch.bool),
                   torch.zeros(E, dtype=torch.int32), 1, 0)
    text = str(err.value)
    assert "on rank 0, a cached dispatch or combine along a handle received rows laid out by another" in text, text
    assert f"cached dispatch: the ranks' calls do not agree: hidden differs: {H} on rank 0; {2 * H} on rank 1" in text
    assert "x dtype differs: bfloat16 on rank 0; float32 on rank 2" in text, text
    assert f"topk_weights columns differs: 0 on rank 0; {K} on rank 2" in text, text
    assert b._ipc.ring_mismatch is None and not b._ipc.abort_posted


def test_only_a_rank_whose_word_reported_the_ring_problem_takes_its_records(monkeypatch):
    """The records are taken (cleared) when they are reported; a rank whose own problem word was another problem
    (its notify left Control::ring_mismatch_seen set, so its next notify reports problem 6) must keep them for that
    report, else it would come without the fields. Two ranks, seen from rank 0 (the gathers copy its rows)."""
    mine = ring_signature_word("cached dispatch", H, torch.bfloat16, None, 0, 0, 64)
    theirs = ring_signature_word("cached dispatch", 2 * H, torch.bfloat16, None, 0, 0, 64)
    calls = []

    def records():
        calls.append(1)
        return [(1, theirs, mine)]

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, inp, group=None: out.copy_(inp.expand_as(out)))
    with pytest.raises(SignatureMismatch) as err:  # rank 0 sent problem 4 (bad ids), rank 1 problem 6
        raise_disagreement(None, torch.device("cpu"), {}, 7, [4, 6], records)
    assert calls == [] and "hidden differs" not in str(err.value), str(err.value)
    with pytest.raises(SignatureMismatch) as err:  # its next notify: problem 6 on rank 0
        raise_disagreement(None, torch.device("cpu"), {}, 8, [6, 0], records)
    assert calls == [1] and f"hidden differs: {H} on rank 0; {2 * H} on rank 1" in str(err.value), str(err.value)


def test_ring_signatures_tell_dtypes_outside_the_table_apart_by_size():
    """x of two dtypes outside signature.DTYPES with other element sizes (uint8 and int16 rows of one hidden) lay
    out their slots differently: their ring signatures differ (their codes no longer clamp to one value), and the
    error names each by its size; dtypes of one size lay rows out alike."""
    word = lambda dtype: ring_signature_word("cached dispatch", H, dtype, None, 0, 0, 64)
    assert word(torch.uint8) != word(torch.int16) and word(torch.int16) != word(torch.bfloat16)
    assert word(torch.uint8) == word(torch.float8_e5m2) != word(torch.float8_e4m3fn)
    text = ring_disagreement(0, [(1, word(torch.int16), word(torch.uint8))])
    assert "x dtype differs: a 1-byte dtype on rank 0; a 2-byte dtype on rank 1" in text, text


def test_combine_along_a_direct_dispatch_handle_takes_the_fast_path(world):
    """Along the handle of a direct dispatch (a Buffer with a peer pool: routing holds (send_row_offset,
    row_of_token)) the combine's plan is the native pull plan (cached_pull_combine, given the dispatch's row_of_token
    and the combine's geometry and ring signature), which serves the fast path's synchronous and async_finish calls
    like the ring plans (the Python plan it replaces served the full path only)."""
    w = world
    h = w.handle
    channels, offsets, _ = h.backend_state.routing
    row_of_token = torch.full((T, 1), -1, dtype=torch.int32)
    direct = h._replace(backend_state=HandleState((channels, offsets, (torch.zeros(1, channels, dtype=torch.int32),
                                                                       row_of_token))))
    for _ in range(3):
        out, out_w, _ = w.buf.combine(w.y, direct, topk_weights=w.w)
        assert out.shape == (T, H) and out_w.shape == (T, K)
    w.buf.combine(w.y, direct, topk_weights=w.w, async_finish=True)
    assert _modes(w, "CachedPullCombine") == [LAUNCH_CURRENT, LAUNCH_SYNC, LAUNCH_SYNC, LAUNCH_ASYNC]
    kind, args = w.ext.plans[-1]
    _, chunk, slots = w.backend._config(None, combine=True)
    assert kind == "CachedPullCombine" and args[1] is offsets and args[2] is row_of_token
    assert args[6:10] == (channels, chunk, slots, combine_slot_bytes(H * 2, K))
    assert args[-1] == ring_signature_word("combine", H, torch.bfloat16, None, 0, K, slots)
    # With a bias (no plan) the full path's combine launcher gets the map and finds the pool offsets itself.
    w.buf.combine(w.y, direct, bias=torch.zeros(T, H, dtype=torch.bfloat16))
    assert w.ext.launches[-1][0] == "combine" and w.ext.launches[-1][1][-1] is row_of_token


def test_dispatch_along_a_direct_dispatch_handle_takes_the_fast_path(world):
    """Along the handle of a direct dispatch the cached dispatch's plan is native too (cached_direct_dispatch: the
    handle's send_row_offset, the pool's MemPool id, and the backend's list of its latest direct blocks, which the
    plan updates in place), serving the fast path's synchronous and async_finish calls (the Python plan it replaces
    served the full path only)."""
    w = world
    h = w.handle
    channels, offsets, _ = h.backend_state.routing
    send_rows = torch.zeros(1, channels, dtype=torch.int32)
    direct = h._replace(backend_state=HandleState((channels, offsets, (send_rows, torch.full((T, 1), -1,
                                                                                             dtype=torch.int32)))))
    blocks = w.backend._direct_blocks
    w.backend.peer_pool = types.SimpleNamespace(mem_pool_id=(3, 4))
    try:
        for _ in range(3):
            recv = w.buf.dispatch(w.x, handle=direct)[0]
            assert recv.shape == (ROWS, H)
        w.buf.dispatch(w.x, handle=direct, async_finish=True)
    finally:
        w.backend.peer_pool = None  # the stub has no pool to close at teardown
    assert _modes(w, "CachedDirectDispatch") == [LAUNCH_CURRENT, LAUNCH_SYNC, LAUNCH_SYNC, LAUNCH_ASYNC]
    kind, args = w.ext.plans[-1]
    _, chunk, slots = w.backend._config(None, combine=False)
    assert kind == "CachedDirectDispatch" and args[1] is offsets and args[2] is send_rows
    assert args[6:10] == (channels, chunk, slots, dispatch_slot_bytes(H * 2, 0, 0))
    assert args[-3] == ring_signature_word("cached dispatch", H, torch.bfloat16, None, 0, 0, slots)
    assert args[-2] == (3, 4) and args[-1] is blocks and w.backend._direct_blocks is blocks
