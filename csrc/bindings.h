// Registration hooks that csrc/bindings.cpp calls to build the moe_dispatcher._C module.
//
// Each subsystem defines one register_* function in its own .cpp and adds its Python functions
// and classes to `m` there; bindings.cpp only calls them. Add a declaration here for a new one.
#pragma once

#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>

#include <cstdint>

namespace moe_ep {

// Tensors and streams cross from Python as integers (data_ptr(), cuda_stream): back to typed pointers.
template <typename T>
inline T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}
inline cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// csrc/runtime/nvshmem_bootstrap.cpp: nvshmem_* bootstrap, allocation and self-test functions.
void register_nvshmem(pybind11::module_& m);

// csrc/intranode_bindings.cpp: intranode (NVLink, CUDA IPC) dispatch/combine.
void register_intranode(pybind11::module_& m);

// csrc/internode_bindings.cpp: internode (NVSHMEM across NVLink domains) dispatch/combine.
void register_internode(pybind11::module_& m);

// csrc/low_latency_bindings.cpp: low-latency (NVSHMEM) dispatch/combine.
void register_low_latency(pybind11::module_& m);

// csrc/peer_pool_bindings.cpp: the peer pool's regions (torch tensors in peer-mapped memory).
void register_peer_pool(pybind11::module_& m);

}  // namespace moe_ep
