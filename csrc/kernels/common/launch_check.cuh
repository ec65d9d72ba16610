// Launch-error check for the torch-free launchers of every mode: throws std::runtime_error naming the kernel.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace moe_ep {

inline void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("moe_dispatcher: launching ") + kernel + " failed: " +
                             cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

}  // namespace moe_ep
