// Native calls as CPython METH_FASTCALL functions: the arguments of a hot call converted by hand from the
// caller's argument array. pybind11's generic dispatcher (an argument vector per call, its overload loop, one
// caster per argument) costs ~0.2 us of host time per call of 9-11 arguments (2-core x86 dev host: a no-op
// method of the low-latency dispatch's signature, 324 ns through pybind11, 107 ns as a FASTCALL function);
// for a call whose own work is one allocation and one launch that is a sizeable share. Host only; the GIL is
// held throughout (as in any bound function).
//
// The argument rules are those of pybind11's casters (what the same function bound with pybind11 accepts):
// a tensor is a torch.Tensor (subclasses too); an optional tensor None or a tensor; an integer an int in int64
// range, or an object with __index__ or __int__ giving one (not a float; integer() below); a flag True, False,
// None (false), or an object whose type defines __bool__ (the nb_bool slot: numpy.bool_, int, float, ...), which
// gives its value; a str, list, tuple or dict is not a flag (their truth comes from __len__, which pybind11 does
// not consult), nor an object whose __bool__ raises or returns something else. A wrong one raises TypeError
// naming the argument. C++ exceptions become Python exceptions through pybind11's translators (a pybind11
// value_error a ValueError, a std::runtime_error a RuntimeError, a pending Python error itself), as for a
// pybind11 function.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#ifdef __GLIBCXX__
#include <cxxabi.h>
#endif

#include <optional>
#include <string>

// pybind11::detail::try_translate_exceptions (run() below) is pybind11's own path from a C++ exception to the
// Python error, with every registered translator (torch's among them: a caching-allocator OOM stays
// torch.OutOfMemoryError).
static_assert(PYBIND11_VERSION_HEX >= 0x020D0000, "bindings/fast_call.h needs pybind11 >= 2.13");

namespace moe_ep::fast_call {

[[noreturn]] inline void bad_type(const char* name, const char* want, PyObject* got) {
  throw pybind11::type_error(std::string(name) + " must be " + want + ", got " + Py_TYPE(got)->tp_name);
}

inline const at::Tensor& tensor(PyObject* o, const char* name) {
  if (!THPVariable_Check(o)) bad_type(name, "a torch.Tensor", o);
  return THPVariable_Unpack(o);
}

inline std::optional<at::Tensor> optional_tensor(PyObject* o, const char* name) {
  if (o == Py_None) return std::nullopt;
  return tensor(o, name);
}

// pybind11's int64_t caster (convert pass): a float is refused; otherwise the value through __index__
// (PyLong_AsLongLong), and if that fails, for an object with a number slot (__index__, __int__ or __float__),
// through int(o) (so an object with __int__ only is taken, truncated as int() truncates it); a value outside
// int64 is refused. Every failure is a TypeError naming the argument (pybind11: "incompatible arguments").
inline int64_t integer(PyObject* o, const char* name) {
  if (PyLong_CheckExact(o)) {
    const long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {  // out of range
      PyErr_Clear();
      bad_type(name, "an integer in int64 range", o);
    }
    return v;
  }
  if (PyFloat_Check(o)) bad_type(name, "an integer", o);
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    if (PyNumber_Check(o) == 0) bad_type(name, "an integer", o);
    const pybind11::object as_int = pybind11::reinterpret_steal<pybind11::object>(PyNumber_Long(o));
    if (!as_int) {
      PyErr_Clear();
      bad_type(name, "an integer", o);
    }
    v = PyLong_AsLongLong(as_int.ptr());
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      bad_type(name, "an integer in int64 range", o);
    }
  }
  return v;
}

inline bool flag(PyObject* o, const char* name) {
  if (o == Py_True) return true;
  if (o == Py_False) return false;
  if (o == Py_None) return false;
  // pybind11's bool caster (convert pass): the type's nb_bool slot only, not PyObject_IsTrue (which falls back to
  // __len__).
  const PyNumberMethods* number = Py_TYPE(o)->tp_as_number;
  if (number != nullptr && number->nb_bool != nullptr) {
    const int v = number->nb_bool(o);
    if (v == 0 || v == 1) return v == 1;
    PyErr_Clear();
  }
  bad_type(name, "a bool (True, False or None)", o);
}

// `nargs` must be `want` (FASTCALL functions take no keywords: Python refuses those itself).
inline void expect_args(Py_ssize_t nargs, Py_ssize_t want, const char* function) {
  if (nargs != want)
    throw pybind11::type_error(std::string(function) + "() takes " + std::to_string(want) + " positional arguments, " +
                               std::to_string(nargs) + " given");
}

// Runs body() (returning a pybind11 object) for a METH_FASTCALL function: its new reference, or null with the
// Python error set from whatever body threw, except glibc's forced unwind (pthread_cancel / pthread_exit), which
// is rethrown, as pybind11's dispatcher does.
template <class Body>
PyObject* run(Body&& body) {
  try {
    return body().release().ptr();
#ifdef __GLIBCXX__
  } catch (abi::__forced_unwind&) {
    throw;  // a thread being cancelled unwinds through here: it must not be caught and turned into a Python error
#endif
  } catch (...) {
    pybind11::detail::try_translate_exceptions();
    return nullptr;
  }
}

}  // namespace moe_ep::fast_call
