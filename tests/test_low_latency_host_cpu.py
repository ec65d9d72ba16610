"""The low-latency backend's host path on CPU, against a stub of the native module.

The stub's Launcher takes exactly the positional arguments of csrc/low_latency_bindings.cpp (Launcher.dispatch /
Launcher.combine) and records them, so a wrong count or order fails here instead of on a GPU. Checked: one launch
per plain call with the outputs' addresses, plans made once per (maxT, hidden, experts, top-k, half) and dropped
by set_variant and set_rank_partials, the dedup and per-rank bits cleared for one local expert, the per-rank bit
cleared for the per-expert reduction, the signal words cleaned when the shapes change, and hooks / async_finish
still going through the stream path.
"""
from __future__ import annotations

import types

import pytest
import torch

from moe_dispatcher.compiled import low_latency as ll
from moe_dispatcher.compiled.low_latency import LowLatencyBackend, LowLatencyState


class _Launcher:
    made: list = []

    def __init__(self, buffer, peer_bases, workspace, half_offset, rank, num_ranks, num_experts, max_tokens, hidden,
                 num_blocks, timeout_ns, variant, dispatch_trace, combine_trace):
        self.fields = dict(half_offset=half_offset, num_experts=num_experts, max_tokens=max_tokens, hidden=hidden,
                           variant=variant)
        self.calls = []
        _Launcher.made.append(self)

    def dispatch(self, x, topk_idx, num_tokens, num_topk, fp8, round_scale, ue8m0, recv_x, recv_scales, src_info,
                 row_of, layout_range, recv_count, cum_stats, wait_stats, phases, stream):
        assert all(isinstance(v, int) for v in (x, topk_idx, recv_x, recv_scales, src_info, row_of, layout_range,
                                                recv_count, cum_stats, wait_stats, phases, stream))
        self.calls.append(("dispatch", dict(locals())))

    def combine(self, x, topk_idx, topk_weights, src_info, row_of, layout_range, out, num_tokens, num_topk,
                rank_partials, wait_stats, phases, stream):
        assert all(isinstance(v, int) for v in (x, topk_idx, topk_weights, src_info, row_of, layout_range, out,
                                                wait_stats, phases, stream))
        assert isinstance(rank_partials, bool)
        self.calls.append(("combine", dict(locals())))


def _half_layout(max_tokens, hidden, num_ranks, num_experts):
    return {"half_bytes": 1 << 20, "send_off": 0, "recv_off": 1 << 19, "signal_off": (1 << 20) - 4096,
            "signal_bytes": 4096}


@pytest.fixture
def backend(monkeypatch):
    stream = types.SimpleNamespace(cuda_stream=7, wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    mod = types.SimpleNamespace(MAX_HIDDEN=16384, MAX_EXPERTS=1024, MAX_TOPK=32, PHASE_SEND=1, PHASE_RECV=2,
                                VARIANT_MASK=6, Launcher=_Launcher, half_layout=_half_layout)
    b = object.__new__(LowLatencyBackend)
    b._mod, b.rank, b.num_ranks, b.num_bytes = mod, 0, 4, 1 << 30
    b._buffer_token, b.timeout_s, b._num_blocks, b._ptr = 1, 10.0, 132, 4096
    b._peer_bases = b._workspace = torch.zeros(4, dtype=torch.int64)
    b.nvlink_peers, b._trace, b._trace_last, b._alive = 4, None, {}, True
    b._checked, b._layout_key, b._phase_both, b.rank_partials = set(), None, 3, True
    b.set_variant(ll.DEFAULT_VARIANT)
    cleaned = []
    b.clean_low_latency_buffer = lambda *shape: cleaned.append(shape)
    b.cleaned = cleaned
    _Launcher.made.clear()
    return b


def _dispatch(b, t=5, h=256, e=16, k=4, half=0, fp8=True, **kw):
    x = torch.zeros(t, h, dtype=torch.bfloat16)
    idx = torch.zeros(t, k, dtype=torch.int64)
    args = dict(cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, use_fp8=fp8,
                round_scale=False, use_ue8m0=False, async_finish=False, return_recv_hook=False, half=half,
                make_hook=lambda receive: receive)
    args.update(kw)
    return b.low_latency_dispatch(x, idx, 8, e, **args), x, idx


def test_plain_dispatch_one_launch_with_output_addresses(backend):
    (recv_x, recv_count, handle, event, hook), x, idx = _dispatch(backend)
    assert hook is None and event.event is None
    (launcher,) = _Launcher.made
    ((kind, a),) = launcher.calls
    data, scales = recv_x
    assert kind == "dispatch" and a["phases"] == 3 and a["stream"] == 7
    assert a["x"] == x.data_ptr() and a["topk_idx"] == idx.data_ptr() and (a["num_tokens"], a["num_topk"]) == (5, 4)
    assert a["recv_x"] == data.data_ptr() and a["recv_scales"] == scales.data_ptr()
    assert a["src_info"] == handle.src_info.data_ptr() and a["layout_range"] == handle.layout_range.data_ptr()
    assert a["recv_count"] == recv_count.data_ptr() and a["cum_stats"] == 0 and a["wait_stats"] == 0
    assert data.shape == (4, 32, 256) and data.dtype == torch.float8_e4m3fn
    assert scales.shape == (4, 32, 2) and scales.stride() == (64, 1, 32)
    state = handle.backend_state
    assert handle.num_tokens == 5 and isinstance(state, LowLatencyState) and state.half == 0
    assert state.row_of.shape == handle.src_info.shape == (4, 32) and a["row_of"] == state.row_of.data_ptr()
    assert launcher.fields == dict(half_offset=0, num_experts=16, max_tokens=8, hidden=256,
                                   variant=ll.VARIANT_DISPATCH_DEDUP | ll.VARIANT_COMBINE_PER_RANK)


def test_plans_cached_per_half_and_dropped_by_set_variant(backend):
    for half in (0, 1, 0, 1):
        _dispatch(backend, half=half)
    assert [m.fields["half_offset"] for m in _Launcher.made] == [0, 1 << 20]
    assert [len(m.calls) for m in _Launcher.made] == [2, 2]
    backend.set_variant(0)
    _dispatch(backend)
    assert len(_Launcher.made) == 3 and _Launcher.made[-1].fields["variant"] == 0
    with pytest.raises(ValueError, match="unknown low-latency kernel variant"):
        backend.set_variant(1)
    backend.set_variant(ll.DEFAULT_VARIANT)
    backend.set_rank_partials(False)  # the per-expert reduction: the per-rank combine kernel is not used
    _dispatch(backend)
    assert len(_Launcher.made) == 4 and _Launcher.made[-1].fields["variant"] == ll.VARIANT_DISPATCH_DEDUP


def test_one_local_expert_clears_dedup_and_shape_change_cleans(backend):
    _dispatch(backend, e=4)
    assert _Launcher.made[-1].fields["variant"] == 0
    assert backend.cleaned == []
    _dispatch(backend, e=16)
    assert backend.cleaned == [(8, 256, 16)]
    with pytest.raises(ValueError, match="hidden sizes up to"):
        _dispatch(backend, h=32768)


def test_combine_plain_and_hook(backend):
    (recv_x, _, handle, _, _), _, idx = _dispatch(backend, fp8=False)
    y = torch.zeros_like(recv_x)
    w = torch.ones(idx.shape, dtype=torch.float32)
    out, event, hook = backend.low_latency_combine(y, idx, w, handle, False, False, False, None, None, 1,
                                                   lambda receive: receive)
    ((_, d), (kind, a)) = _Launcher.made[0].calls + _Launcher.made[1].calls
    assert kind == "combine" and hook is None and out.shape == (5, 256) and a["phases"] == 3
    assert a["x"] == y.data_ptr() and a["out"] == out.data_ptr() and a["src_info"] == handle.src_info.data_ptr()
    assert a["row_of"] == handle.backend_state.row_of.data_ptr() and a["rank_partials"] is True
    assert (a["num_tokens"], a["num_topk"]) == (5, 4)
    out, _, hook = backend.low_latency_combine(y, idx, w, handle, True, False, True, out, None, 0,
                                               lambda receive: receive)
    sent = _Launcher.made[0].calls[-1][1]
    assert sent["phases"] == 1 and sent["x"] == 0 and sent["out"] == out.data_ptr()
    hook()
    assert _Launcher.made[0].calls[-1][1]["phases"] == 2
