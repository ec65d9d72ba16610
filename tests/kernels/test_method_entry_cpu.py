"""csrc/bindings/method_entry.h against the Python methods it stands for, on CPU.

A throwaway extension (torch.utils.cpp_extension.load_inline) exposes method_entry::make as the real extension
does; two Buffers over the stub runtime (tests/helpers/stub_low_latency.py) make the same calls, one through its
native entries (installed by Buffer._install_ll_entries, as Buffer.__init__ installs the compiled backend's), the
other through the class's Python methods. Every call must give the same outcome both ways: the result (types,
shapes, values), the exception (type, message, its context), the stub's launches, and the Buffer's _first_ll_*
validations and _post_abort calls (spied on each instance), for argument forms the entry serves (positional,
keywords in any order, defaults, repeated keys) and forms it hands to the method (an unknown or repeated keyword,
a missing argument, counts and flags of other types, a non-tensor x, a tuple that is not a handle), errors in
validation, in the run, a BaseException (no _post_abort) and an error inside _post_abort. Also: a subclass that
overrides a method keeps it; destroy() removes the entries; the entries hold the Buffer weakly.
"""
from __future__ import annotations

import gc
import os
import shutil
import types
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist
from stub_low_latency import attach_stub_low_latency

from moe_dispatcher import Buffer
from moe_dispatcher.handle import LowLatencyHandle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAXT, H, E, K, T = 8, 256, 16, 4, 5

SOURCE = r"""
#include "bindings/method_entry.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("method_entry", &moe_ep::method_entry::make, py::arg("kind"), py::arg("method"), py::arg("buffer"),
        py::arg("runs"), py::arg("first"), py::arg("served"), py::arg("key"), py::arg("first_args"),
        py::arg("run_args"), py::arg("handle_type"));
}
"""


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    from torch.utils.cpp_extension import load_inline

    build = tmp_path_factory.mktemp("method_entry_ext")
    return load_inline("method_entry_test", cpp_sources=[SOURCE], extra_include_paths=[os.path.join(ROOT, "csrc")],
                       build_directory=str(build), extra_cflags=["-O0"], verbose=False)


def _spied(buf) -> dict:
    """Count buf's _first_ll_dispatch / _first_ll_combine / _post_abort calls (instance attributes, which both the
    entry and the method find first); a test may set `raise_in` to make one of them raise."""
    spy = {"_first_ll_dispatch": 0, "_first_ll_combine": 0, "_post_abort": 0, "raise_in": {}}
    for name in ("_first_ll_dispatch", "_first_ll_combine", "_post_abort"):
        real = getattr(buf, name)

        def wrapped(*args, _name=name, _real=real):
            spy[_name] += 1
            if _name in spy["raise_in"]:
                raise spy["raise_in"][_name]
            return _real(*args)

        setattr(buf, name, wrapped)
    return spy


def _make(ext, entries: bool):
    buf = Buffer(num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(MAXT, 1024, 1, E), low_latency_mode=True,
                 backend="reference", explicitly_destroy=True)
    backend = attach_stub_low_latency(buf)
    if entries:
        buf._install_ll_entries(ext.method_entry)
        assert type(buf.__dict__["low_latency_dispatch"]).__name__ == "builtin_function_or_method"
        assert type(buf.__dict__["low_latency_combine"]).__name__ == "builtin_function_or_method"
    spy = _spied(buf)
    return types.SimpleNamespace(buf=buf, rt=backend.runtime, spy=spy, entries=entries)


@pytest.fixture
def pair(ext, tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    made = []
    try:
        made = [_make(ext, True), _make(ext, False)]
        yield made
    finally:
        for w in made:
            w.buf.destroy()
        dist.destroy_process_group()


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g)
    y = torch.randn(E, MAXT, H, generator=g).bfloat16()
    return x, idx, w, y


def _summary(obj):
    """A comparable picture of a result (tensors by dtype, shape and values; handles without their state)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.dtype, tuple(obj.shape))
    if isinstance(obj, LowLatencyHandle):
        return ("handle", obj.num_max_dispatch_tokens_per_rank, obj.hidden, obj.num_experts, obj.backend,
                obj.num_tokens, _summary(obj.src_info))
    if isinstance(obj, tuple):
        return tuple(_summary(o) for o in obj)
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return type(obj).__name__


def _outcome(w, call):
    """(result or exception picture, launches since, spy counts) of call(buf, dispatch, combine)."""
    before = len(w.rt.launches)
    counts = {k: w.spy[k] for k in ("_first_ll_dispatch", "_first_ll_combine", "_post_abort")}
    buf = w.buf
    if w.entries:
        dispatch, combine = buf.low_latency_dispatch, buf.low_latency_combine
    else:
        dispatch = lambda *a, **k: Buffer.low_latency_dispatch(buf, *a, **k)
        combine = lambda *a, **k: Buffer.low_latency_combine(buf, *a, **k)
    try:
        got = ("ok", _summary(call(dispatch, combine)))
    except BaseException as e:  # noqa: BLE001 (the exception is the outcome)
        ctx = e.__context__
        got = ("raised", type(e).__name__, str(e).replace("Buffer.", ""),
               None if ctx is None else (type(ctx).__name__, str(ctx)))
    launches = [(k, p, half) for k, p, half, _ in w.rt.launches[before:]]
    spent = {k: w.spy[k] - counts[k] for k in counts}
    return got, launches, spent


def _same(pair, call, served: bool | None = None):
    a, b = (_outcome(w, call) for w in pair)
    assert a == b
    if served is not None:
        assert (a[0][0] == "ok") == served, a
    return a


def _handle(w):
    x, idx, _, _ = _inputs()
    return Buffer.low_latency_dispatch(w.buf, x, idx, MAXT, E, use_fp8=False)[2]


def test_dispatch_forms_agree(pair):
    x, idx, _, _ = _inputs()
    cum = torch.zeros(E, dtype=torch.int32)
    forms = [
        lambda d, c: d(x, idx, MAXT, E),
        lambda d, c: d(x, idx, MAXT, E),  # a remembered key: no validation either way
        lambda d, c: d(x, idx, MAXT, E, use_fp8=False),
        lambda d, c: d(x, idx, MAXT, E, None, None, False, False, False, False, False),
        lambda d, c: d(return_recv_hook=True, num_experts=E, x=x, topk_idx=idx, use_fp8=False,
                       num_max_dispatch_tokens_per_rank=MAXT),
        lambda d, c: d(x, idx, MAXT, E, cumulative_local_expert_recv_stats=cum, use_fp8=False, async_finish=True),
        lambda d, c: d(x, idx, MAXT, E, use_fp8=True, round_scale=True, use_ue8m0=True),  # H % 512: refused
        lambda d, c: d(x, idx, MAXT, E, use_ue8m0=True),  # refused by validation: _post_abort
        lambda d, c: d(x, idx, MAXT, E, async_finish=True, return_recv_hook=True),
        lambda d, c: d(x.float(), idx, MAXT, E),  # a remembered key whose run refuses x
        lambda d, c: d(x[:, :128], idx, MAXT, E),  # another hidden: the same key, a new plan
        # forms the entry hands to the method
        lambda d, c: d(x, idx, MAXT),
        lambda d, c: d(x, idx, MAXT, E, bogus=1),
        lambda d, c: d(x, idx, MAXT, E, x=x),
        lambda d, c: d(x, idx, MAXT, E, None, None, True, False, False, False, False, 0),
        lambda d, c: d(x, idx, float(MAXT), E),
        lambda d, c: d(x, idx, np.int64(MAXT), E),
        lambda d, c: d(x, idx, True, E),
        lambda d, c: d(x, idx, MAXT, E, use_fp8=0),
        lambda d, c: d(x, idx, MAXT, E, use_fp8=None),
        lambda d, c: d(x, idx, MAXT, E, use_fp8=np.bool_(True)),
        lambda d, c: d(x, idx, MAXT, E, use_fp8="no"),
        lambda d, c: d(x, idx, 2 ** 70, E),
        lambda d, c: d(x.tolist(), idx, MAXT, E),
        lambda d, c: d(torch.nn.Parameter(x, requires_grad=False), idx, MAXT, E),
    ]
    for i, form in enumerate(forms):
        got = _same(pair, form)
        if i < 6:
            assert got[0][0] == "ok", (i, got)
    # the entry served the remembered keys without validating them again
    assert pair[0].spy["_first_ll_dispatch"] == pair[1].spy["_first_ll_dispatch"]


def test_combine_forms_agree(pair):
    _, idx, w, y = _inputs()
    handles = [_handle(p) for p in pair]

    def each(make):
        outcomes = []
        for p, h in zip(pair, handles):
            outcomes.append(_outcome(p, lambda d, c, h=h: make(d, c, h)))
        assert outcomes[0] == outcomes[1]
        return outcomes[0]

    assert each(lambda d, c, h: c(y, idx, w, h))[0][0] == "ok"
    assert each(lambda d, c, h: c(y, idx, w, h))[2]["_first_ll_combine"] == 0  # remembered both ways
    assert each(lambda d, c, h: c(y, idx, w, h, zero_copy=False, out=None))[0][0] == "ok"
    assert each(lambda d, c, h: c(handle=h, topk_weights=w, topk_idx=idx, x=y, return_recv_hook=True))[0][0] == "ok"
    assert each(lambda d, c, h: c(y, idx, w, h._replace(num_tokens=T)))[0][0] == "ok"
    each(lambda d, c, h: c(y, idx, w, h, use_logfmt=True))
    each(lambda d, c, h: c(y, idx, w, h, async_finish=True, return_recv_hook=True))
    each(lambda d, c, h: c(y, idx[:2], w[:2], h))
    each(lambda d, c, h: c(y, idx, w, tuple(h)))
    each(lambda d, c, h: c(y, idx, w, None))
    each(lambda d, c, h: c(y, idx, w, h, use_logfmt=0))
    each(lambda d, c, h: c(y, idx, w, h, flag=1))
    each(lambda d, c, h: c(y, idx, w))


def test_errors_agree(pair):
    x, idx, _, _ = _inputs()
    for p in pair:
        p.spy["raise_in"] = {"_first_ll_dispatch": KeyboardInterrupt("stop")}
    got = _same(pair, lambda d, c: d(x, idx, MAXT, E), served=False)
    assert got[0][1] == "KeyboardInterrupt" and got[2]["_post_abort"] == 0  # not an Exception: no abort posted
    for p in pair:
        p.spy["raise_in"] = {"_first_ll_dispatch": ValueError("bad"), "_post_abort": RuntimeError("abort failed")}
    got = _same(pair, lambda d, c: d(x, idx, MAXT, E), served=False)
    assert got[0][1:] == ("RuntimeError", "abort failed", ("ValueError", "bad"))
    for p in pair:
        p.spy["raise_in"] = {}
    _same(pair, lambda d, c: d(x, idx, MAXT, E), served=True)


def test_forgets_when_the_runs_are_cleared(pair):
    x, idx, _, _ = _inputs()
    for _ in range(2):
        _same(pair, lambda d, c: d(x, idx, MAXT, E), served=True)
    for p in pair:
        p.buf._ll_dispatch_runs.clear()
    got = _same(pair, lambda d, c: d(x, idx, MAXT, E), served=True)
    assert got[2]["_first_ll_dispatch"] == 1


def test_destroy_removes_the_entries(pair):
    x, idx, _, _ = _inputs()
    w = pair[0]
    w.buf.low_latency_dispatch(x, idx, MAXT, E)
    w.buf.destroy()
    assert "low_latency_dispatch" not in w.buf.__dict__ and "low_latency_combine" not in w.buf.__dict__
    with pytest.raises(RuntimeError, match="destroyed"):
        w.buf.low_latency_dispatch(x, idx, MAXT, E)


def test_subclass_override_kept_and_buffer_held_weakly(ext, tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        class Mine(Buffer):
            def low_latency_dispatch(self, *args, **kwargs):
                return "mine"

        buf = Mine(num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(MAXT, 1024, 1, E), low_latency_mode=True,
                   backend="reference", explicitly_destroy=True)
        attach_stub_low_latency(buf)
        buf._install_ll_entries(ext.method_entry)
        assert "low_latency_dispatch" not in buf.__dict__ and "low_latency_combine" in buf.__dict__
        assert buf.low_latency_dispatch() == "mine"
        ref = weakref.ref(buf)
        del buf  # with its entry (a strong reference from it would be a cycle the collector cannot see)
        gc.collect()
        assert ref() is None
    finally:
        dist.destroy_process_group()
