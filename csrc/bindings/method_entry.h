// Buffer.low_latency_dispatch / low_latency_combine without their Python frame: native functions that the
// Buffer installs as its instance's attributes of those names (shadowing the class's methods for that instance),
// each doing in C what the Python method does (moe_dispatcher/buffer.py), which reads:
//
//     try:
//         run = self.<runs>.get(key)            # key: a few of the arguments (counts, flags, x.is_cuda, ...)
//         if run is None:
//             run = self.<first>(...)           # validates; remembers `run` under the key unless the reference
//         return run(...)                       #   backend serves the call
//     except Exception as exc:
//         self._post_abort(exc)
//         raise
//
// An entry binds the arguments as Python binds them to the method (positional, then keywords by name, then the
// method's own defaults, read from the function) and keeps its own keys. A call whose key arguments are of the
// exact types the key is made of (bool flags, int counts, a torch.Tensor x without __torch_function__, the
// LowLatencyHandle type) is served here: a remembered key calls its run; a new one calls <first> then run, as the
// method's miss does, and is remembered when <first> returned `served` (the compiled backend's function: the one
// run the method remembers). Every other call (arguments the method would refuse, a key argument of another
// type) is the Python method's call itself. So a call gives what the method gives: the same run with the same
// arguments, <first> on the same calls, _post_abort on the same errors. Only the traceback lacks the method's
// frame. The keys are forgotten when <runs> is empty (the Buffer clears it when destroyed or given another
// backend). What saves the time (~0.3 us a call): no frame, no bound method, no key tuple or dict look-up.
//
// An entry references the Buffer weakly (the Buffer's __dict__ holds the entry: a strong reference would be a
// cycle the garbage collector cannot see through the capsule). Host only; the GIL is held throughout.
#pragma once

#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/PythonTorchFunctionTLS.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moe_ep::method_entry {

constexpr int kMaxParams = 16;

// The part of a call its Python key is made of. Dispatch: counts = (max tokens, experts), bits = x.is_cuda and
// the five flags. Combine: text = handle.backend, bits = the three flags.
struct Key {
  int64_t count0 = 0, count1 = 0;
  unsigned bits = 0;
  PyObject* text = nullptr;  // borrowed while looking up; a stored key owns it

  bool operator==(const Key& o) const {
    if (count0 != o.count0 || count1 != o.count1 || bits != o.bits) return false;
    if (text == o.text) return true;
    return text != nullptr && o.text != nullptr && PyUnicode_Compare(text, o.text) == 0;
  }
};

enum class Kind { kDispatch, kCombine };

struct Entry {
  Kind kind;
  PyObject* method = nullptr;      // the class's Python function (the full path)
  PyObject* buffer = nullptr;      // weak reference to the Buffer
  PyObject* runs = nullptr;        // the Buffer's dict of remembered runs: empty = forget the keys here
  PyObject* first = nullptr;       // name of the validating method (interned)
  PyObject* post_abort = nullptr;  // "_post_abort" (interned)
  PyObject* served = nullptr;      // the run a new key is remembered for
  PyTypeObject* handle_type = nullptr;  // combine: LowLatencyHandle
  Py_ssize_t handle_fields = 0, backend_field = 0;
  std::vector<PyObject*> params;    // the method's parameter names after self (owned)
  std::vector<PyObject*> defaults;  // their defaults (owned; null: required)
  std::vector<int> first_args, run_args;  // parameter indices passed to <first> and to run, in order
  std::vector<int> key_args;              // parameter indices the key reads, in the key's order
  std::vector<std::pair<Key, PyObject*>> known;  // key -> run (both owned)

  ~Entry() {
    forget();
    for (PyObject* o : params) Py_XDECREF(o);
    for (PyObject* o : defaults) Py_XDECREF(o);
    for (PyObject* o : {method, buffer, runs, first, post_abort, served}) Py_XDECREF(o);
    Py_XDECREF(reinterpret_cast<PyObject*>(handle_type));
  }
  void forget() {
    for (auto& [k, run] : known) {
      Py_XDECREF(k.text);
      Py_DECREF(run);
    }
    known.clear();
  }
};

constexpr const char* kEntryName = "moe_dispatcher.method_entry.Entry";
inline void free_entry(PyObject* capsule) { delete static_cast<Entry*>(PyCapsule_GetPointer(capsule, kEntryName)); }

// A flag of the key: exactly True or False (the key's objects are then the method's key objects one to one).
inline bool exact_flag(PyObject* o, unsigned bit, unsigned* bits) {
  if (o == Py_True) {
    *bits |= 1u << bit;
    return true;
  }
  return o == Py_False;
}

// A count of the key: an int (not a subclass, not bool) within int64.
inline bool exact_count(PyObject* o, int64_t* out) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  *out = v;
  return true;
}

// The key of bound arguments `a`, or false when one of its arguments is not of the exact type it is made of.
inline bool key_of(const Entry& e, PyObject* const* a, Key* key) {
  const std::vector<int>& k = e.key_args;
  if (e.kind == Kind::kDispatch) {  // x, max tokens, experts, use_fp8, round_scale, use_ue8m0, async, hook
    PyObject* x = a[k[0]];
    // x.is_cuda as the method reads it: a plain tensor (or Parameter, which has no __torch_function__ of its
    // own) while no torch function mode is active (x.is_cuda would ask the mode).
    if (!THPVariable_CheckExact(x) || at::impl::torch_function_mode_enabled()) return false;
    key->bits = THPVariable_Unpack(x).is_cuda() ? 1u : 0u;
    if (!exact_count(a[k[1]], &key->count0) || !exact_count(a[k[2]], &key->count1)) return false;
    for (int i = 3; i < 8; ++i)
      if (!exact_flag(a[k[i]], static_cast<unsigned>(i - 2), &key->bits)) return false;
    return true;
  }
  // Combine: handle, use_logfmt, async, hook; handle.backend read by position from a LowLatencyHandle.
  PyObject* handle = a[k[0]];
  if (Py_TYPE(handle) != e.handle_type || PyTuple_GET_SIZE(handle) != e.handle_fields) return false;
  PyObject* backend = PyTuple_GET_ITEM(handle, e.backend_field);
  if (!PyUnicode_CheckExact(backend)) return false;
  key->text = backend;
  for (int i = 1; i < 4; ++i)
    if (!exact_flag(a[k[i]], static_cast<unsigned>(i - 1), &key->bits)) return false;
  return true;
}

// Binds (args, kwnames) to the method's parameters as Python would; false where Python would raise instead.
inline bool bind(const Entry& e, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, PyObject** slots) {
  const auto n = static_cast<Py_ssize_t>(e.params.size());
  if (nargs > n) return false;
  for (Py_ssize_t i = 0; i < n; ++i) slots[i] = i < nargs ? args[i] : nullptr;
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t j = 0; j < nkw; ++j) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, j);
    Py_ssize_t i = 0;
    while (i < n && e.params[i] != name) ++i;  // interned names: usually the same object
    if (i == n) {
      i = 0;
      while (i < n && PyUnicode_Compare(e.params[i], name) != 0) ++i;
      if (PyErr_Occurred()) PyErr_Clear();
    }
    if (i == n || slots[i] != nullptr) return false;
    slots[i] = args[nargs + j];
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (slots[i] != nullptr) continue;
    if (e.defaults[i] == nullptr) return false;
    slots[i] = e.defaults[i];
  }
  return true;
}

// callable(prefix..., a[indices]...) without keywords; prefix: the Buffer for a method called by name.
inline PyObject* call_with(PyObject* callable, PyObject* self, PyObject* const* a, const std::vector<int>& indices) {
  PyObject* argv[kMaxParams + 2];
  Py_ssize_t n = 1;  // argv[0] is free: PY_VECTORCALL_ARGUMENTS_OFFSET lets the callee use it
  if (self != nullptr) argv[n++] = self;
  for (int i : indices) argv[n++] = a[i];
  if (self != nullptr)  // a method by name: callable is its name
    return PyObject_VectorcallMethod(callable, argv + 1, static_cast<size_t>(n - 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                     nullptr);
  return PyObject_Vectorcall(callable, argv + 1, static_cast<size_t>(n - 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                             nullptr);
}

// The error now set as its exception object (normalized, its traceback attached), cleared; and back.
inline PyObject* take_error() {
#if PY_VERSION_HEX >= 0x030C0000
  return PyErr_GetRaisedException();
#else
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr) PyException_SetTraceback(value, tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  return value;
#endif
}
inline void restore_error(PyObject* exc) {  // steals exc
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(exc);
#else
  PyErr_Restore(Py_NewRef(reinterpret_cast<PyObject*>(Py_TYPE(exc))), exc, PyException_GetTraceback(exc));
#endif
}

// The method's `except Exception as exc: self._post_abort(exc); raise` for the error now set (result null).
inline void after_error(const Entry& e, PyObject* buffer) {
  if (!PyErr_ExceptionMatches(PyExc_Exception)) return;
  PyObject* exc = take_error();
  PyObject* argv[2] = {buffer, exc};
  PyObject* r = PyObject_VectorcallMethod(e.post_abort, argv, 2, nullptr);
  if (r == nullptr) {  // raised inside the except block: that error propagates, with the call's as its context
    PyObject* raised = take_error();
    if (raised != exc) {
      PyException_SetContext(raised, exc);  // steals exc
    } else {
      Py_DECREF(exc);  // the same exception raised again: no context to itself, as Python does
    }
    restore_error(raised);
    return;
  }
  Py_DECREF(r);
  restore_error(exc);
}

// The method's own call: Buffer.<method>(buffer, *args, **kwargs).
inline PyObject* call_method(const Entry& e, PyObject* buffer, PyObject* const* args, Py_ssize_t nargs,
                             PyObject* kwnames) {
  const Py_ssize_t total = nargs + (kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames));
  if (total <= kMaxParams) {
    PyObject* argv[kMaxParams + 2];
    argv[0] = nullptr;  // free: PY_VECTORCALL_ARGUMENTS_OFFSET
    argv[1] = buffer;
    for (Py_ssize_t i = 0; i < total; ++i) argv[i + 2] = args[i];
    return PyObject_Vectorcall(e.method, argv + 1, static_cast<size_t>(nargs + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                               kwnames);
  }
  PyObject* tuple = PyTuple_New(nargs + 1);  // more arguments than any call the method takes: it raises
  if (tuple == nullptr) return nullptr;
  Py_INCREF(buffer);
  PyTuple_SET_ITEM(tuple, 0, buffer);
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    Py_INCREF(args[i]);
    PyTuple_SET_ITEM(tuple, i + 1, args[i]);
  }
  PyObject* kwargs = nullptr;
  if (kwnames != nullptr) {
    kwargs = PyDict_New();
    for (Py_ssize_t j = 0; kwargs != nullptr && j < PyTuple_GET_SIZE(kwnames); ++j)
      if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, j), args[nargs + j]) != 0) Py_CLEAR(kwargs);
    if (kwargs == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
  }
  PyObject* r = PyObject_Call(e.method, tuple, kwargs);
  Py_DECREF(tuple);
  Py_XDECREF(kwargs);
  return r;
}

// The entry's METH_FASTCALL | METH_KEYWORDS function: args[0, nargs) positional, then the keywords' values in
// kwnames' order.
inline PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  Entry& e = *static_cast<Entry*>(PyCapsule_GetPointer(self, kEntryName));
  PyObject* a[kMaxParams];
  Key key;
  PyObject* buffer = PyWeakref_GetObject(e.buffer);  // borrowed; Py_None once the Buffer is gone
  if (buffer == Py_None) {
    PyErr_SetString(PyExc_RuntimeError, "this Buffer was garbage-collected");
    return nullptr;
  }
  Py_INCREF(buffer);  // held for the call, as a bound method holds its self
  PyObject* result = nullptr;
  if (!bind(e, args, nargs, kwnames, a) || !key_of(e, a, &key)) {
    result = call_method(e, buffer, args, nargs, kwnames);
    Py_DECREF(buffer);
    return result;
  }
  if (PyDict_GET_SIZE(e.runs) == 0) e.forget();
  PyObject* run = nullptr;
  for (auto& [k, r] : e.known)
    if (k == key) {
      run = r;
      break;
    }
  if (run != nullptr) {
    Py_INCREF(run);
  } else {
    run = call_with(e.first, buffer, a, e.first_args);
    if (run != nullptr && run == e.served) {
      Py_XINCREF(key.text);
      Py_INCREF(run);
      e.known.emplace_back(key, run);
    }
  }
  if (run != nullptr) {
    result = call_with(run, nullptr, a, e.run_args);
    Py_DECREF(run);
  }
  if (result == nullptr) after_error(e, buffer);
  Py_DECREF(buffer);
  return result;
}

inline PyMethodDef kEntryDef{"method_entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call)),
                             METH_FASTCALL | METH_KEYWORDS,
                             "A Buffer method's fast path in C (csrc/bindings/method_entry.h)."};

// The indices of `names` among the method's parameters (ValueError for a name it does not have).
inline std::vector<int> indices_of(const Entry& e, PyObject* names) {
  std::vector<int> out;
  PyObject* seq = PySequence_Fast(names, "parameter names must be a sequence");
  if (seq == nullptr) throw pybind11::error_already_set();
  for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(seq); ++j) {
    PyObject* name = PySequence_Fast_GET_ITEM(seq, j);
    size_t i = 0;
    while (i < e.params.size() && PyUnicode_Compare(e.params[i], name) != 0) ++i;
    if (i == e.params.size()) {
      Py_DECREF(seq);
      throw pybind11::value_error("method_entry: the method has no parameter " + pybind11::repr(name).cast<std::string>());
    }
    out.push_back(static_cast<int>(i));
  }
  Py_DECREF(seq);
  return out;
}

// The entry of `method` (the class's Python function) for `buffer`: kind "dispatch" or "combine"; runs: the
// Buffer's dict of remembered runs; first: the name of its validating method; served: the run it remembers;
// key, first_args, run_args: parameter names (the key's in the order key_of reads them); handle_type: the
// LowLatencyHandle type (combine).
inline pybind11::object make(const std::string& kind, pybind11::object method, pybind11::object buffer,
                             pybind11::dict runs, const std::string& first, pybind11::object served,
                             pybind11::object key, pybind11::object first_args, pybind11::object run_args,
                             pybind11::object handle_type) {
  namespace py = pybind11;
  auto e = std::make_unique<Entry>();
  if (kind != "dispatch" && kind != "combine") throw py::value_error("method_entry: kind must be dispatch or combine");
  e->kind = kind == "dispatch" ? Kind::kDispatch : Kind::kCombine;
  if (!PyFunction_Check(method.ptr())) throw py::type_error("method_entry: method must be a Python function");
  const py::object code = method.attr("__code__");
  const int argcount = code.attr("co_argcount").cast<int>();
  const py::tuple varnames = code.attr("co_varnames");
  if (code.attr("co_kwonlyargcount").cast<int>() != 0 || (code.attr("co_flags").cast<int>() & (CO_VARARGS | CO_VARKEYWORDS)))
    throw py::value_error("method_entry: the method must take positional-or-keyword parameters only");
  if (argcount - 1 > kMaxParams) throw py::value_error("method_entry: too many parameters");
  const py::object defaults_obj = method.attr("__defaults__");
  const py::tuple defaults = defaults_obj.is_none() ? py::tuple() : py::tuple(defaults_obj);
  const int first_default = argcount - static_cast<int>(defaults.size());
  for (int i = 1; i < argcount; ++i) {
    PyObject* name = varnames[i].ptr();
    Py_INCREF(name);
    PyUnicode_InternInPlace(&name);
    e->params.push_back(name);
    PyObject* d = i >= first_default ? defaults[i - first_default].ptr() : nullptr;
    Py_XINCREF(d);
    e->defaults.push_back(d);
  }
  e->key_args = indices_of(*e, key.ptr());
  e->first_args = indices_of(*e, first_args.ptr());
  e->run_args = indices_of(*e, run_args.ptr());
  if (e->key_args.size() != (e->kind == Kind::kDispatch ? 8u : 4u))
    throw py::value_error("method_entry: the key reads 8 parameters (dispatch) or 4 (combine)");
  if (e->kind == Kind::kCombine) {
    if (!PyType_Check(handle_type.ptr()) ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(handle_type.ptr()), &PyTuple_Type))
      throw py::type_error("method_entry: handle_type must be a tuple type");
    const py::tuple fields = handle_type.attr("_fields");
    e->handle_fields = static_cast<Py_ssize_t>(fields.size());
    e->backend_field = -1;
    for (Py_ssize_t i = 0; i < e->handle_fields; ++i)
      if (fields[i].cast<std::string>() == "backend") e->backend_field = i;
    if (e->backend_field < 0) throw py::value_error("method_entry: the handle type has no backend field");
    e->handle_type = reinterpret_cast<PyTypeObject*>(handle_type.inc_ref().ptr());
  }
  e->method = method.inc_ref().ptr();
  e->buffer = PyWeakref_NewRef(buffer.ptr(), nullptr);
  if (e->buffer == nullptr) throw py::error_already_set();
  e->runs = runs.inc_ref().ptr();
  e->first = PyUnicode_InternFromString(first.c_str());
  e->post_abort = PyUnicode_InternFromString("_post_abort");
  e->served = served.inc_ref().ptr();
  py::object capsule = py::reinterpret_steal<py::object>(PyCapsule_New(e.get(), kEntryName, free_entry));
  if (!capsule) throw py::error_already_set();
  e.release();  // the capsule owns it now
  py::object fn = py::reinterpret_steal<py::object>(PyCFunction_New(&kEntryDef, capsule.ptr()));
  if (!fn) throw py::error_already_set();
  return fn;
}

}  // namespace moe_ep::method_entry
