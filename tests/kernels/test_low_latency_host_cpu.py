"""The Buffer's low-latency host glue on CPU, over a stub of the native runtime (tests/helpers/stub_low_latency.py).

Checked: a call is validated in Python on the first call of its key only (later calls go straight to the
runtime, which still checks the tensors' invariants); a bad argument raises before anything launches; halves
alternate per call; the hook rules (send now, receive in the hook, once, not when stale, no shape change while
pending); the per-expert reduction order reaches the runtime; a recorded timeout makes every later call and
hook raise with rank, phase and peer; a recorded signature mismatch (a source's dispatch did not agree) makes
every later call and hook raise SignatureMismatch naming the fields that differ with both ranks' values, before
a timeout it caused, and posts no abort; a destroyed Buffer refuses calls.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from stub_low_latency import PHASE_RECV, PHASE_SEND, attach_stub_low_latency

from moe_dispatcher import Buffer
from moe_dispatcher import buffer as buffer_module
from moe_dispatcher.compiled.low_latency import decode_dispatch_signature, dispatch_signature
from moe_dispatcher.signature import SignatureMismatch

MAXT, H, E, K, T = 8, 256, 16, 4, 5
BOTH = PHASE_SEND | PHASE_RECV


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        buf = Buffer(num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(MAXT, 1024, 1, E), low_latency_mode=True,
                     backend="reference", explicitly_destroy=True)
        backend = attach_stub_low_latency(buf)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, H, generator=g).bfloat16()
        idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
        w = torch.rand(T, K, generator=g)
        yield types.SimpleNamespace(buf=buf, rt=backend.runtime, x=x, idx=idx, w=w)
        buf.destroy()
    finally:
        dist.destroy_process_group()


def _pair(w, **kw):
    recv_x, count, handle, event, hook = w.buf.low_latency_dispatch(w.x, w.idx, MAXT, E, use_fp8=False, **kw)
    y = torch.zeros(E, MAXT, H, dtype=torch.bfloat16)
    return recv_x, handle, y


def test_plain_calls_one_launch_each_alternating_halves(world):
    w = world
    for _ in range(2):
        recv_x, handle, y = _pair(w)
        out, event, hook = w.buf.low_latency_combine(y, w.idx, w.w, handle)
        assert hook is None and event.event is None and out.shape == (T, H) and recv_x.shape == (E, MAXT, H)
        assert handle.backend == "low_latency" and handle.num_tokens == T and handle.backend_state.half in (0, 1)
    assert [(k, p, half) for k, p, half, _ in w.rt.launches] == [
        ("dispatch", BOTH, 0), ("combine", BOTH, 1), ("dispatch", BOTH, 0), ("combine", BOTH, 1)]
    # the default kernels: dedup dispatch and per-rank combine (NVLink, 16 local experts)
    assert {s[2:] for *_, s in w.rt.launches} == {("dedup", "per_rank")}
    assert w.rt.plans == [(MAXT, H, E, K)]  # one plan for the shape, made on first use


def test_validation_runs_on_the_first_call_of_a_key_only(world, monkeypatch):
    w = world
    calls = []
    real = buffer_module.check_topk_idx
    monkeypatch.setattr(buffer_module, "check_topk_idx", lambda *a, **k: (calls.append(1), real(*a, **k)))
    for _ in range(3):
        _, handle, y = _pair(w)
        w.buf.low_latency_combine(y, w.idx, w.w, handle)
    assert len(calls) == 2  # one dispatch key, one combine key
    _pair(w, async_finish=True)  # a new key: validated once more
    assert len(calls) == 3
    # The runtime still checks every call's invariants on a cached key. (An error forgets the cached keys: the
    # next call takes the full path, which clears the abort the error posted; so each key is cached again first.)
    with pytest.raises(ValueError, match="x must be"):
        w.buf.low_latency_dispatch(w.x.float(), w.idx, MAXT, E, use_fp8=False)
    assert not w.buf._ll_dispatch_runs and not w.buf._ll_combine_runs
    n = len(calls)
    _pair(w)
    with pytest.raises(ValueError, match="tokens, more than"):
        w.buf.low_latency_dispatch(torch.zeros(MAXT + 1, H, dtype=torch.bfloat16),
                                   torch.zeros(MAXT + 1, K, dtype=torch.int64), MAXT, E, use_fp8=False)
    _, handle, y = _pair(w)
    w.buf.low_latency_combine(y, w.idx, w.w, handle)
    _, handle, y = _pair(w)
    assert len(calls) == n + 3  # the dispatch key cached twice, the combine key once: the bad calls ran no check
    with pytest.raises(ValueError, match="topk_weights"):
        w.buf.low_latency_combine(y, w.idx, w.w.double(), handle)


def test_bad_arguments_raise_before_launching(world):
    w = world
    n = len(w.rt.launches)
    with pytest.raises(ValueError, match="divisible by 128"):
        w.buf.low_latency_dispatch(torch.zeros(T, 100, dtype=torch.bfloat16), w.idx, MAXT, E)
    with pytest.raises(ValueError):
        w.buf.low_latency_dispatch(w.x, w.idx, MAXT, E, async_finish=True, return_recv_hook=True)
    with pytest.raises(ValueError, match="more than"):
        w.buf.low_latency_dispatch(w.x, w.idx, T - 1, E)
    with pytest.raises(ValueError, match="use_ue8m0"):
        w.buf.low_latency_dispatch(w.x, w.idx, MAXT, E, use_ue8m0=True)
    with pytest.raises(TypeError):
        w.buf.low_latency_combine(torch.zeros(E, MAXT, H, dtype=torch.bfloat16), w.idx, w.w, object())
    with pytest.raises(NotImplementedError):
        _, handle, y = _pair(w)
        w.buf.low_latency_combine(y, w.idx, w.w, handle, use_logfmt=True)
    assert len(w.rt.launches) == n + 1  # only the valid dispatch above


def test_hook_rules(world):
    w = world
    recv_x, count, handle, event, hook = w.buf.low_latency_dispatch(w.x, w.idx, MAXT, E, use_fp8=False,
                                                                    return_recv_hook=True)
    assert w.rt.launches[-1][:2] == ("dispatch", PHASE_SEND)
    hook()
    assert w.rt.launches[-1][:2] == ("dispatch", PHASE_RECV)
    with pytest.raises(RuntimeError, match="already called"):
        hook()
    stale = w.buf.low_latency_dispatch(w.x, w.idx, MAXT, E, use_fp8=False, return_recv_hook=True)[4]
    # a pending hook blocks a change of shapes (the layout would be cleaned under it)
    with pytest.raises(RuntimeError, match="call the hook first"):
        w.buf.low_latency_dispatch(torch.zeros(T, 512, dtype=torch.bfloat16), w.idx, MAXT, E, use_fp8=False)
    for _ in range(2):
        w.buf.low_latency_dispatch(w.x, w.idx, MAXT, E, use_fp8=False)
    with pytest.raises(RuntimeError, match="stale"):
        stale()
    w.buf.low_latency_dispatch(torch.zeros(T, 512, dtype=torch.bfloat16), w.idx, MAXT, E, use_fp8=False)
    assert w.rt.cleans == [(MAXT, 512, E)]  # the new layout's signal words were cleaned first


def test_per_expert_order_and_no_nvlink_pick_the_per_expert_kernels(world):
    w = world
    w.buf.low_latency_combine_reduction = "per_expert"
    _, handle, y = _pair(w)
    w.buf.low_latency_combine(y, w.idx, w.w, handle)
    assert w.rt.launches[-1][3][2:] == ("dedup", "per_expert")
    w.rt.nvlink_all = False
    w.rt._plans.clear()
    assert w.rt.kernels_for(MAXT, H, E) == (False, False)


def test_timeout_makes_every_later_call_raise(world):
    w = world
    hook = w.buf.low_latency_dispatch(w.x, w.idx, MAXT, E, use_fp8=False, return_recv_hook=True)[4]
    w.rt.timeout = (1, "low_latency_dispatch (receive counts)", 0, 3)
    for call in (hook, lambda: _pair(w), hook):
        with pytest.raises(RuntimeError, match=r"rank 0 timed out .* in low_latency_dispatch \(receive counts\) "
                                               r"waiting for rank 3"):
            call()


def _sig(hidden=H, max_tokens=MAXT, num_experts=E, num_topk=K, use_fp8=False, round_scale=False, use_ue8m0=False):
    return dispatch_signature(hidden, max_tokens, num_experts, num_topk, use_fp8, round_scale, use_ue8m0)


def test_signature_packs_every_field_exactly():
    cases = [(128, 1, 2, 1, False, False, False), (7168, 128, 256, 8, True, True, True),
             (16384, 65534, 1024, 32, True, False, False), (4096, 4096, 64, 6, False, True, False)]
    for case in cases:
        word = dispatch_signature(*case)
        assert word != 0 and word < 1 << 52
        assert tuple(decode_dispatch_signature(word).values()) == case
    # the 16-bit tag a count word carries holds top-k and the FP8 flags exactly: any two of them differ there
    tags = {_sig(num_topk=k, use_fp8=f, round_scale=r, use_ue8m0=u) & 0xFFFF
            for k in range(1, 33) for f in (0, 1) for r in (0, 1) for u in (0, 1)}
    assert len(tags) == 32 * 8


def test_signature_mismatch_makes_every_later_call_raise(world):
    w = world
    _, handle, y = _pair(w)
    hook = w.buf.low_latency_dispatch(w.x, w.idx, MAXT, E, use_fp8=False, return_recv_hook=True)[4]
    n = len(w.rt.launches)
    # rank 0's receive found rank 1's dispatch (call 2) with another hidden size; a timeout it caused came after
    w.rt.signature = (2, 1, _sig(hidden=512), _sig())
    w.rt.timeout = (1, "low_latency_combine (receive)", 0, 1)
    calls = (hook, lambda: _pair(w), lambda: w.buf.low_latency_combine(y, w.idx, w.w, handle), hook)
    for call in calls:
        with pytest.raises(SignatureMismatch) as err:
            call()
        text = str(err.value)
        assert isinstance(err.value, ValueError)
        assert "low-latency dispatch: the ranks' calls do not agree: hidden differs" in text
        assert f"rank 0 called with hidden={H}, num_max_dispatch_tokens_per_rank={MAXT}, num_experts={E}, " \
               f"top-k={K}, use_fp8=no, round_scale=no, use_ue8m0=no" in text
        assert f"rank 1 with hidden=512, num_max_dispatch_tokens_per_rank={MAXT}" in text
        assert "low-latency call 2" in text and "timed out" not in text
    assert len(w.rt.launches) == n  # nothing launched
    assert w.rt.abort_writes == []  # raised on every rank alike: no abort posted to the peers
    assert w.buf._kernels_ll.broken


def test_signature_mismatch_from_a_count_word_names_what_the_tag_holds(world):
    w = world
    # the source's signature word was not visible yet: only its count word's tag (top-k, FP8 flags, layout hash)
    w.rt.signature = (4, 1, (1 << 63) | (_sig(num_topk=2, use_fp8=True) & 0xFFFF), _sig())
    with pytest.raises(SignatureMismatch, match=r"top-k differs; use_fp8 differs: rank 0 called with .*; rank 1 "
                                                r"with top-k=2, use_fp8=yes, round_scale=no, use_ue8m0=no \("):
        _pair(w)
    w.rt.signature = (4, 1, (1 << 63) | (_sig(max_tokens=MAXT * 2) & 0xFFFF), _sig())
    with pytest.raises(SignatureMismatch, match="hidden or num_max_dispatch_tokens_per_rank or num_experts differs"):
        _pair(w)


def test_count_out_of_range_makes_every_later_call_raise(world):
    w = world
    # rank 0's receive found rank 1's count word with this call's tag but count MAXT + 3 (kSeenBadCount)
    word = (_sig() & 0xFFFF) << 16 | (MAXT + 4)
    w.rt.signature = (6, 1, (1 << 62) | word, (2 << 52) | _sig())  # `mine` with its generation, as the kernels'
    for call in (lambda: _pair(w), lambda: _pair(w)):
        with pytest.raises(SignatureMismatch, match=rf"rank 1's count word in rank 0's buffer carried the tag of "
                                                    rf"rank 0's call \(hidden={H}, .*\) but the count {MAXT + 3}, "
                                                    rf"outside \[0, {MAXT}\]"):
            call()


def test_destroyed_buffer_refuses_calls(world):
    w = world
    _pair(w)
    w.buf.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        _pair(w)


def test_stub_and_buffer_call_the_native_signatures():
    """The stub's methods, the Backend protocol and the native runtime (its docstrings in
    csrc/low_latency_bindings.cpp) take the same arguments in the same order, which is what Buffer passes."""
    import inspect
    import os
    import re

    from stub_low_latency import StubRuntime

    from moe_dispatcher.backend import Backend
    src = open(os.path.join(os.path.dirname(__file__), "..", "..", "csrc", "low_latency_bindings.cpp")).read()
    src = re.sub(r'"\s*"', "", src)  # C++ string literals continued on the next line
    for name, proto in (("dispatch", Backend.low_latency_dispatch), ("combine", Backend.low_latency_combine)):
        native = re.search(rf'"{name}\(([^)]*)\)', src).group(1).split(", ")
        stub = list(inspect.signature(getattr(StubRuntime, name)).parameters)[1:]
        proto_args = list(inspect.signature(proto).parameters)[1:]
        assert len(native) == len(stub) == len(proto_args), (name, native, stub, proto_args)
        assert native == stub, (name, native, stub)


def test_ll_host_cpu_tool_runs():
    import os
    import subprocess
    import sys
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "ll_host_cpu.py")
    out = subprocess.run([sys.executable, tool, "--calls", "2000", "--hidden", "1024", "--tokens", "16",
                          "--experts", "16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "buffer.low_latency_dispatch" in out.stdout and "us" in out.stdout
