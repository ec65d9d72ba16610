// moe_dispatcher._layout: the low-latency buffer layout (csrc/kernels/low_latency/layout.h) for Python.
//
// A CUDA-free, torch-free CPython extension that setup.py builds on every install with a C++ compiler
// (the CUDA extension stays optional), so Buffer.get_low_latency_rdma_size_hint and the layout tests read
// the one C++ definition on CPU machines too. Plain Python C API: no build dependency beyond Python.h.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels/low_latency/layout.h"

namespace {

using namespace moe_ep::low_latency;

// Four non-negative ints (max_tokens, hidden, num_ranks, num_experts), checked like the runtime does
// before it lays a buffer out; false with a Python ValueError/TypeError set otherwise.
bool shape_args(PyObject* const* args, Py_ssize_t n, int out[4]) {
  if (n != 4) {
    PyErr_SetString(PyExc_TypeError, "expected (max_tokens, hidden, num_ranks, num_experts)");
    return false;
  }
  for (int i = 0; i < 4; ++i) {
    const long v = PyLong_AsLong(args[i]);
    if (v == -1 && PyErr_Occurred()) return false;
    if (v < 1 || v > (1L << 30)) {
      PyErr_SetString(PyExc_ValueError, "max_tokens, hidden, num_ranks and num_experts must be positive ints");
      return false;
    }
    out[i] = static_cast<int>(v);
  }
  if (out[3] % out[2] != 0) {
    PyErr_SetString(PyExc_ValueError, "num_experts must be a multiple of num_ranks");
    return false;
  }
  return true;
}

PyObject* py_half_layout(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int s[4];
  if (!shape_args(args, n, s)) return nullptr;
  const HalfLayout l = half_layout(s[0], s[1], s[2], s[3]);
  return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:n}", "half_bytes", static_cast<Py_ssize_t>(l.half_bytes),
                       "send_off", static_cast<Py_ssize_t>(l.send_off), "recv_off",
                       static_cast<Py_ssize_t>(l.recv_off), "signal_off", static_cast<Py_ssize_t>(l.signal_off),
                       "msg_bytes", static_cast<Py_ssize_t>(l.msg_bytes), "dedup_slot_bytes",
                       static_cast<Py_ssize_t>(l.dedup_slot_bytes), "signal_bytes",
                       static_cast<Py_ssize_t>(l.signal_bytes));
}

PyObject* py_buffer_bytes(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int s[4];
  if (!shape_args(args, n, s)) return nullptr;
  return PyLong_FromSize_t(buffer_bytes(s[0], s[1], s[2], s[3]));
}

PyMethodDef methods[] = {
    {"half_layout", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_half_layout)), METH_FASTCALL,
     "half_layout(max_tokens, hidden, num_ranks, num_experts) -> {half_bytes, send_off, recv_off, signal_off, "
     "msg_bytes, dedup_slot_bytes, signal_bytes}: byte layout of one half of the low-latency buffer."},
    {"buffer_bytes", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_buffer_bytes)), METH_FASTCALL,
     "buffer_bytes(max_tokens, hidden, num_ranks, num_experts) -> bytes of NVSHMEM buffer (both halves)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_layout", "The low-latency buffer layout (layout.h).", -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__layout() {
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  if (PyModule_AddIntConstant(m, "MAX_TOPK", kMaxTopk) < 0 || PyModule_AddIntConstant(m, "MAX_RANKS", kMaxRanks) < 0 ||
      PyModule_AddIntConstant(m, "MAX_EXPERTS", kMaxExperts) < 0 ||
      PyModule_AddIntConstant(m, "MAX_HIDDEN", kMaxHidden) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
