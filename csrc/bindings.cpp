// The moe_dispatcher._C module: version queries plus each subsystem's register_* hook.
// Glue only; the functionality lives in runtime/ and kernels/.
#include <cuda_runtime.h>
// Host API only (nvshmem.h would also pull the device headers into this host TU).
#include <nvshmem_host.h>
#include <torch/extension.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <string>

#include "bindings.h"
#include "bindings/stream_join.h"

// setup.py passes -DMOE_DISPATCHER_VERSION=0.1.0 unquoted (quotes would not survive the ninja
// command line); stringify it here.
#define MOE_STRINGIFY_IMPL(x) #x
#define MOE_STRINGIFY(x) MOE_STRINGIFY_IMPL(x)
#ifdef MOE_DISPATCHER_VERSION
#define MOE_DISPATCHER_VERSION_STR MOE_STRINGIFY(MOE_DISPATCHER_VERSION)
#else
#define MOE_DISPATCHER_VERSION_STR "unknown"
#endif

// setup.py passes -DMOE_DISPATCHER_SM90=1 when TORCH_CUDA_ARCH_LIST (the -gencode list torch compiles
// every .cu for) includes sm_90; a build that does not say counts as not compiled for it.
#ifndef MOE_DISPATCHER_SM90
#define MOE_DISPATCHER_SM90 0
#endif

namespace py = pybind11;

namespace {

// 13000 -> "13.0" (CUDA encodes versions as 1000 * major + 10 * minor).
std::string cuda_version_string(int v) {
  if (v <= 0) return "none";
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

std::map<std::string, std::string> cuda_versions() {
  int runtime = 0, driver = 0;
  // Neither call needs a GPU; a missing driver reports 0 rather than failing the query.
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  return {{"compiled", cuda_version_string(CUDART_VERSION)},
          {"runtime", cuda_version_string(runtime)},
          {"driver", cuda_version_string(driver)}};
}

std::map<std::string, std::string> nvshmem_versions() {
  int major = 0, minor = 0, patch = 0;
  // Host library's vendor version (the libnvshmem_host.so.3 actually loaded); no init needed.
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  auto dotted = [](int a, int b, int c) {
    return std::to_string(a) + "." + std::to_string(b) + "." + std::to_string(c);
  };
  return {{"headers", dotted(NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                             NVSHMEM_VENDOR_PATCH_VERSION)},
          {"library", dotted(major, minor, patch)}};
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "moe_dispatcher compiled kernels (CUDA + NVSHMEM)";

  m.def("version", []() { return std::string(MOE_DISPATCHER_VERSION_STR); },
        "moe_dispatcher version this extension was built from.");
  m.def("cuda_version", &cuda_versions,
        "CUDA versions as {'compiled', 'runtime', 'driver'} -> 'major.minor' ('none' if absent).");
  m.def("nvshmem_version", &nvshmem_versions,
        "NVSHMEM versions as {'headers': built against, 'library': libnvshmem_host loaded}.");
  m.def("is_sm90_compiled", []() { return MOE_DISPATCHER_SM90 != 0; },
        "True when the device code was compiled for sm_90 (Hopper): Buffer.is_sm90_compiled().");

  // The event an async_finish call returns (EventOverlap.event), of every mode: csrc/bindings/stream_join.h.
  py::class_<moe_ep::CommEvent>(m, "CommEvent", "The CUDA event of an async_finish call.")
      .def("wait", &moe_ep::CommEvent::wait, py::arg("stream") = py::none(),
           "Make `stream` (default: the current one) wait for the event, without blocking the host.")
      .def("query", &moe_ep::CommEvent::query)
      .def("synchronize", &moe_ep::CommEvent::synchronize);

  moe_ep::register_nvshmem(m);
  moe_ep::register_intranode(m);
  moe_ep::register_internode(m);
  moe_ep::register_low_latency(m);
  moe_ep::register_peer_pool(m);
}
