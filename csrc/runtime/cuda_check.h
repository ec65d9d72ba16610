// Error-check macros for host code (runtime/, bindings, kernel launchers).
//
// Every CUDA runtime and NVSHMEM host call goes through one of these. A failure throws
// std::runtime_error, which pybind11 turns into a Python RuntimeError whose message names
// the failing call, the reason and the source location. Torch-free: usable from .cu launchers.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace moe_ep {

// Builds "<what> failed: <reason> [file:line]" and throws it as std::runtime_error.
[[noreturn]] inline void throw_error(const char* what, const std::string& reason, const char* file,
                                     int line) {
  std::ostringstream msg;
  msg << what << " failed: " << reason << " [" << file << ":" << line << "]";
  throw std::runtime_error(msg.str());
}

// Name of an NVSHMEMX_ERROR_* status (values from nvshmemx_error.h; kept here so this header
// does not need NVSHMEM's include path).
inline const char* nvshmem_status_name(int status) {
  switch (status) {
    case 0: return "NVSHMEMX_SUCCESS";
    case 1: return "NVSHMEMX_ERROR_INVALID_VALUE";
    case 2: return "NVSHMEMX_ERROR_OUT_OF_MEMORY";
    case 3: return "NVSHMEMX_ERROR_NOT_SUPPORTED";
    case 4: return "NVSHMEMX_ERROR_SYMMETRY";
    case 5: return "NVSHMEMX_ERROR_GPU_NOT_SELECTED";
    case 6: return "NVSHMEMX_ERROR_COLLECTIVE_LAUNCH_FAILED";
    case 7: return "NVSHMEMX_ERROR_INTERNAL";
    default: return "unknown NVSHMEM status";
  }
}

}  // namespace moe_ep

// CUDA runtime call: throws with cudaGetErrorName/String on anything but cudaSuccess.
#define MOE_CUDA_CHECK(expr)                                                                 \
  do {                                                                                       \
    const cudaError_t moe_err_ = (expr);                                                     \
    if (moe_err_ != cudaSuccess) {                                                           \
      ::moe_ep::throw_error(#expr,                                                   \
                                    std::string(cudaGetErrorName(moe_err_)) + " (" +         \
                                        cudaGetErrorString(moe_err_) + ")",                  \
                                    __FILE__, __LINE__);                                     \
    }                                                                                        \
  } while (0)

// After a kernel launch: catches launch-configuration errors without synchronising.
#define MOE_CUDA_CHECK_LAUNCH() MOE_CUDA_CHECK(cudaGetLastError())

// NVSHMEM host call returning an int status (0 = success). NVSHMEM logs its own detail to
// stderr; NVSHMEM_DEBUG=WARN (or INFO) makes that log more verbose.
#define MOE_NVSHMEM_CHECK(expr)                                                              \
  do {                                                                                       \
    const int moe_status_ = (expr);                                                          \
    if (moe_status_ != 0) {                                                                  \
      ::moe_ep::throw_error(                                                         \
          #expr,                                                                             \
          "status " + std::to_string(moe_status_) + " (" +                                   \
              ::moe_ep::nvshmem_status_name(moe_status_) +                           \
              "); see NVSHMEM's messages on stderr, NVSHMEM_DEBUG=INFO for more",            \
          __FILE__, __LINE__);                                                               \
    }                                                                                        \
  } while (0)

// Precondition check with a message.
#define MOE_CHECK(cond, msg)                                                                 \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      ::moe_ep::throw_error("check `" #cond "`", (msg), __FILE__, __LINE__);         \
    }                                                                                        \
  } while (0)
