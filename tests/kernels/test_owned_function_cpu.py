"""csrc/bindings/owned_function.h on CPU: a C++ object called as a METH_FASTCALL function that owns it (how the
cached normal-mode plans reach Python, csrc/bindings/cached_call.h plan_function).

A throwaway extension (torch.utils.cpp_extension.load_inline, built in the test's tmp dir) wraps a counting object
that records its calls and its destruction. Checked: the function is a builtin (no pybind11 instance, no bound
method), each call reaches the object that function owns with its positional arguments, the objects passed to keep
stay referenced until the function is freed, the object is destroyed before they are released and exactly once,
and two functions made from one definition own their objects apart.
"""
from __future__ import annotations

import gc
import os
import shutil
import sys
import types
import weakref

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SOURCE = r"""
#include "bindings/fast_call.h"
#include "bindings/owned_function.h"

namespace f = moe_ep::fast_call;

// Destruction log: each Counter appends (its id, whether the first kept object was still alive: a weak reference
// to it, taken when the function was made, still resolves; True when nothing was kept).
pybind11::list* destroyed_log = nullptr;

struct Counter {
  int64_t id;
  int64_t calls = 0;
  pybind11::object witness;  // weakref.ref of the first kept object, or None
  ~Counter() {
    const bool kept = witness.is_none() || !witness().is_none();
    destroyed_log->append(pybind11::make_tuple(id, kept));
  }
};

PyObject* call_counter(PyObject* self, PyObject* const* a, Py_ssize_t n) {
  return f::run([&] {
    f::expect_args(n, 2, "counter");
    Counter& c = moe_ep::owned_object<Counter>(self);
    c.calls += f::integer(a[0], "step");
    return pybind11::make_tuple(c.id, c.calls, pybind11::reinterpret_borrow<pybind11::object>(a[1]));
  });
}

PyMethodDef counter_def{"counter", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_counter)),
                        METH_FASTCALL, nullptr};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  destroyed_log = new pybind11::list();  // never freed: a static one would be released after the interpreter ends
  m.attr("destroyed") = *destroyed_log;
  m.def("make", [](int64_t id, std::vector<pybind11::object> keep) {
    auto c = std::make_unique<Counter>();
    c->id = id;
    c->witness = keep.empty() ? pybind11::none()
                              : pybind11::module_::import("weakref").attr("ref")(keep.front());
    pybind11::object fn = moe_ep::owned_function(counter_def, std::move(c), std::move(keep));
    return fn;
  });
}
"""


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    from torch.utils.cpp_extension import load_inline

    build = tmp_path_factory.mktemp("owned_function_ext")
    return load_inline("owned_function_test", cpp_sources=[SOURCE], extra_include_paths=[os.path.join(ROOT, "csrc")],
                       build_directory=str(build), extra_cflags=["-O0"], verbose=False)


class _Kept:
    pass


def test_a_call_reaches_the_owned_object(ext):
    fn = ext.make(7, [])
    assert isinstance(fn, types.BuiltinFunctionType)
    marker = object()
    assert fn(2, marker) == (7, 2, marker)
    assert fn(3, None) == (7, 5, None)  # the same object: its state carries over
    with pytest.raises(TypeError, match="takes 2 positional arguments, 1 given"):
        fn(1)
    with pytest.raises(TypeError, match="step must be an integer"):
        fn(1.5, None)


def test_kept_objects_live_until_the_function_is_freed_and_the_object_goes_first(ext):
    kept = _Kept()
    ref = weakref.ref(kept)
    fn = ext.make(11, [kept])
    del kept
    gc.collect()
    assert ref() is not None, "the function must keep what it was given"
    before = len(ext.destroyed)
    fn(1, None)
    del fn
    gc.collect()
    assert ref() is None, "freeing the function releases what it kept"
    assert list(ext.destroyed[before:]) == [(11, True)], "destroyed once, before its kept objects were released"


def test_two_functions_own_their_objects_apart(ext):
    a, b = ext.make(1, []), ext.make(2, [])
    assert a(1, None)[:2] == (1, 1) and b(5, None)[:2] == (2, 5) and a(1, None)[:2] == (1, 2)
    before = len(ext.destroyed)
    del a
    gc.collect()
    assert list(ext.destroyed[before:]) == [(1, True)] and b(0, None)[:2] == (2, 5)
    assert sys.getrefcount(b) >= 2
