// A C++ object called from Python as a METH_FASTCALL function that owns it: the function's self is a capsule
// holding the object and the Python objects it points into, so a call costs no attribute lookup, no bound
// method and no pybind11 dispatch (bindings/fast_call.h converts its arguments), and dropping the function
// frees the object, then releases those Python objects. Host only; the GIL is held (the capsule's destructor runs
// under it, as any deallocation does).
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <utility>
#include <vector>

namespace moe_ep {

// What the capsule of an owned function holds: the object, then the Python objects it keeps alive (what
// pybind11::keep_alive did for a bound class instance). The object is destroyed before they are released.
template <class T>
struct Owned {
  std::unique_ptr<T> object;
  std::vector<pybind11::object> keep;
  ~Owned() { object.reset(); }  // the object first: it may point into what keep holds
};

// The capsule name of Owned<T> for every T: the functions of `def` are only ever made by owned_function<T> with
// their own def, so the name does not need to tell the types apart.
inline constexpr const char* kOwnedName = "moe_dispatcher.owned_function";

// The object of the owned function whose self is `self` (the capsule owned_function made).
template <class T>
T& owned_object(PyObject* self) {
  return *static_cast<Owned<T>*>(PyCapsule_GetPointer(self, kOwnedName))->object;
}

// A new function object of `def` (METH_FASTCALL, reading its object through owned_object<T>(self)) that owns
// `object` and keeps `keep` referenced until it is freed.
template <class T>
pybind11::object owned_function(PyMethodDef& def, std::unique_ptr<T> object, std::vector<pybind11::object> keep) {
  auto owned = std::make_unique<Owned<T>>();
  owned->object = std::move(object);
  owned->keep = std::move(keep);
  pybind11::object capsule = pybind11::reinterpret_steal<pybind11::object>(
      PyCapsule_New(owned.get(), kOwnedName, [](PyObject* c) {
        delete static_cast<Owned<T>*>(PyCapsule_GetPointer(c, kOwnedName));
      }));
  if (!capsule) throw pybind11::error_already_set();
  owned.release();  // the capsule owns it now
  pybind11::object fn = pybind11::reinterpret_steal<pybind11::object>(PyCFunction_New(&def, capsule.ptr()));
  if (!fn) throw pybind11::error_already_set();
  return fn;
}

}  // namespace moe_ep
