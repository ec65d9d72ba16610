// The device a native call runs on, made current for the call only when it is not already. Host only.
#pragma once

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

namespace moe_ep {

// A c10::cuda::CUDAGuard costs a device query when made and, when it ends, a driver query (whether the device
// it restores has a context) and another device query: a sizeable share of a call whose own work is one
// allocation and one launch. In the usual case the caller's current device already is the call's, for CUDA (the
// context a launch goes to) and for torch (the device its caching allocator serves, which c10 may hold apart from
// CUDA's: a set_device it deferred for a device without a context): then nothing is switched and nothing is
// restored. Otherwise it is a CUDAGuard. Both queries read thread-local state.
class DeviceScope {
 public:
  explicit DeviceScope(c10::DeviceIndex device) {
    int cuda_device = -1;
    if (cudaGetDevice(&cuda_device) != cudaSuccess) {
      cudaGetLastError();  // the guard below finds out what is wrong; a later launch check must not see this
      cuda_device = -1;
    }
    if (cuda_device != device || c10::cuda::current_device() != device) guard_.set_index(device);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  c10::cuda::OptionalCUDAGuard guard_;
};

}  // namespace moe_ep
