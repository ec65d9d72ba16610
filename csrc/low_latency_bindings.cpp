// Python bindings of the low-latency (NVSHMEM) backend. Stub: the low-latency kernels fill this in.
#include "bindings.h"

namespace moe_dispatcher {
void register_low_latency(pybind11::module_& /*m*/) {}
}  // namespace moe_dispatcher
