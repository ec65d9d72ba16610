"""csrc/bindings/fast_call.h's argument rules against pybind11's own casters, on CPU.

A throwaway extension (torch.utils.cpp_extension.load_inline, built in the test's tmp dir) binds the same
conversions twice: through pybind11 (a bool and an int64_t parameter: what the low-latency calls accepted before
they became METH_FASTCALL functions) and through fast_call::flag / fast_call::integer inside fast_call::run. Every
value must give the same result both ways (the value, or a TypeError), and the fast call's TypeError names the
argument. Also: a C++ exception leaves fast_call::run as the Python exception pybind11 would give (torch's
OutOfMemoryError, ValueError), and a thread's forced unwind (pthread_exit) passes through it (in a child process:
a swallowed one aborts).
"""
from __future__ import annotations

import decimal
import fractions
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SOURCE = r"""
#include <pthread.h>

#include "bindings/fast_call.h"

namespace f = moe_ep::fast_call;

PyObject* fc_flag(PyObject*, PyObject* const* a, Py_ssize_t n) {
  return f::run([&] {
    f::expect_args(n, 1, "fc_flag");
    return pybind11::bool_(f::flag(a[0], "use_fp8"));
  });
}
PyObject* fc_integer(PyObject*, PyObject* const* a, Py_ssize_t n) {
  return f::run([&] {
    f::expect_args(n, 1, "fc_integer");
    return pybind11::int_(f::integer(a[0], "num_experts"));
  });
}
PyObject* fc_oom(PyObject*, PyObject* const*, Py_ssize_t) {
  return f::run([&]() -> pybind11::object { TORCH_CHECK_WITH(OutOfMemoryError, false, "test OOM"); });
}
PyObject* fc_value_error(PyObject*, PyObject* const*, Py_ssize_t) {
  return f::run([&]() -> pybind11::object { throw pybind11::value_error("test value error"); });
}

// A native thread that ends with pthread_exit inside fast_call::run: glibc unwinds it with abi::__forced_unwind,
// which run must let through (a catch that swallows it makes glibc abort the process). No Python API is used on
// that thread (it never holds the GIL).
void* exit_inside_run(void*) {
  f::run([]() -> pybind11::object { pthread_exit(nullptr); });
  return nullptr;
}
PyObject* fc_thread_exit(PyObject*, PyObject* const*, Py_ssize_t) {
  pthread_t thread;
  if (pthread_create(&thread, nullptr, exit_inside_run, nullptr) != 0) return PyErr_Format(PyExc_OSError, "no thread");
  Py_BEGIN_ALLOW_THREADS pthread_join(thread, nullptr);
  Py_END_ALLOW_THREADS Py_RETURN_TRUE;
}

PyMethodDef defs[] = {
    {"fc_thread_exit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fc_thread_exit)), METH_FASTCALL,
     nullptr},
    {"fc_flag", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fc_flag)), METH_FASTCALL, nullptr},
    {"fc_integer", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fc_integer)), METH_FASTCALL, nullptr},
    {"fc_oom", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fc_oom)), METH_FASTCALL, nullptr},
    {"fc_value_error", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fc_value_error)), METH_FASTCALL,
     nullptr}};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pb_flag", [](bool v) { return v; });
  m.def("pb_integer", [](int64_t v) { return v; });
  for (PyMethodDef& d : defs)
    m.attr(d.ml_name) = pybind11::reinterpret_steal<pybind11::object>(PyCFunction_New(&d, nullptr));
}
"""


class _Index:
    def __index__(self) -> int:
        return 7


class _IntOnly:
    def __int__(self) -> int:
        return 9


class _FloatOnly:
    def __float__(self) -> float:
        return 2.5


class _IndexRaises:
    def __index__(self) -> int:
        raise RuntimeError("no index")


class _Len:
    def __len__(self) -> int:
        return 1


class _BoolFalse:
    def __bool__(self) -> bool:
        return False


class _BoolRaises:
    def __bool__(self) -> bool:
        raise RuntimeError("no truth")


INTEGERS = [0, -3, 2**63 - 1, -2**63, 2**63, -2**63 - 1, 2**70, True, np.int64(5), np.int32(-4), _Index(), _IntOnly(),
            _FloatOnly(), _IndexRaises(), 2.0, np.float64(2.0), np.float32(2.5), decimal.Decimal("3.7"),
            fractions.Fraction(7, 2), "5", None, [1], 3 + 0j]
FLAGS = [True, False, None, 0, 1, 2, 0.0, 0.5, np.bool_(True), np.bool_(False), np.int64(0), "False", "", [], [0], (),
         {}, _Len(), _BoolFalse(), _BoolRaises(), object(), torch.tensor(True)]


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    from torch.utils.cpp_extension import load_inline

    build = tmp_path_factory.mktemp("fast_call_ext")
    return load_inline("fast_call_rules_test", cpp_sources=[SOURCE], extra_include_paths=[os.path.join(ROOT, "csrc")],
                       build_directory=str(build), extra_cflags=["-O0"], verbose=False)


def _outcome(fn, value):
    try:
        out = fn(value)
    except Exception as e:  # noqa: BLE001 (the exception's type is the outcome)
        return type(e).__name__
    return (type(out).__name__, out)


@pytest.mark.parametrize("value", INTEGERS, ids=lambda v: f"{type(v).__name__}:{str(v)[:24]}")
def test_integer_is_pybind11s_int64_rule(ext, value):
    want = _outcome(ext.pb_integer, value)
    assert want == "TypeError" or want == ("int", int(value))  # pybind11 itself: a value or incompatible arguments
    assert _outcome(ext.fc_integer, value) == want


@pytest.mark.parametrize("value", FLAGS, ids=lambda v: f"{type(v).__name__}:{str(v)[:24]}")
def test_flag_is_pybind11s_bool_rule(ext, value):
    want = _outcome(ext.pb_flag, value)
    assert _outcome(ext.fc_flag, value) == want


def test_wrong_arguments_are_named(ext):
    with pytest.raises(TypeError, match="use_fp8 must be a bool .*got str"):
        ext.fc_flag("False")
    with pytest.raises(TypeError, match="num_experts must be an integer in int64 range, got int"):
        ext.fc_integer(2**64)
    with pytest.raises(TypeError, match="num_experts must be an integer, got float"):
        ext.fc_integer(1.0)
    with pytest.raises(TypeError, match=r"fc_flag\(\) takes 1 positional arguments, 2 given"):
        ext.fc_flag(True, True)


def test_exceptions_leave_as_pybind11_translates_them(ext):
    with pytest.raises(torch.OutOfMemoryError, match="test OOM"):
        ext.fc_oom()
    with pytest.raises(ValueError, match="test value error"):
        ext.fc_value_error()


def test_forced_unwind_passes_through(ext):
    code = ("import importlib.util, sys, torch\n"
            "spec = importlib.util.spec_from_file_location('fast_call_rules_test', sys.argv[1])\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "print('joined', m.fc_thread_exit())\n")
    done = subprocess.run([sys.executable, "-c", code, ext.__file__], check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "joined True" in done.stdout, done.stdout + done.stderr
