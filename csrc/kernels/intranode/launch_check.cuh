// Launch helpers of the torch-free launchers: the launch-error check (throws std::runtime_error naming the
// kernel) and the dynamic shared memory opt-in.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace moe_dispatcher::intranode {

inline void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("moe_dispatcher intranode: launching ") + kernel +
                             " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

// Lets kKernel take `bytes` of dynamic shared memory (above the default 48 KB), once per device.
template <auto kKernel>
void allow_dynamic_smem(int bytes) {
  constexpr int kMaxDevices = 64;
  static bool done[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices || done[dev]) return;
  const cudaError_t err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("moe_dispatcher intranode: cudaFuncSetAttribute (dynamic shared memory) "
                                         "failed: ") + cudaGetErrorString(err));
  }
  done[dev] = true;
}

}  // namespace moe_dispatcher::intranode
