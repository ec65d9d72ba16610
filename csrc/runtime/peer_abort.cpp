#include "runtime/peer_abort.h"

#include <chrono>
#include <thread>

#include "runtime/cuda_check.h"

namespace moe_ep {

PeerAbort::~PeerAbort() {
  if (pending_ && stream_ != nullptr && cudaStreamQuery(stream_) == cudaErrorNotReady) return;  // leave them be
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (device_source_ != nullptr) cudaFree(device_source_);
  if (host_source_ != nullptr) cudaFreeHost(host_source_);
  cudaGetLastError();  // a failure here must not surface as a later call's error
}

void PeerAbort::set_targets(const std::vector<uint8_t*>& targets) {
  if (stream_ == nullptr) {
    MOE_CUDA_CHECK(cudaGetDevice(&device_));
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_source_), 2, cudaHostAllocDefault));
    host_source_[0] = 0;
    host_source_[1] = 1;
    MOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&device_source_), 2));
    MOE_CUDA_CHECK(cudaMemcpyAsync(device_source_, host_source_, 2, cudaMemcpyHostToDevice, stream_));
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  targets_ = targets;
}

void PeerAbort::write(uint8_t value) {
  if (stream_ == nullptr || targets_.empty()) return;
  if (pending_ && cudaStreamQuery(stream_) == cudaErrorNotReady) return;  // an earlier write is still stuck
  pending_ = false;
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) current = -1;
  if (current != device_) cudaSetDevice(device_);
  bool failed = false;
  for (uint8_t* target : targets_) {
    if (target == nullptr) continue;
    if (cudaMemcpyAsync(target, device_source_ + value, 1, cudaMemcpyDefault, stream_) != cudaSuccess) {
      failed = true;
      cudaMemcpyAsync(target, host_source_ + value, 1, cudaMemcpyDefault, stream_);
    }
  }
  // Poll (never block): the copies need only the copy engine, so they finish in microseconds; past
  // kWriteWaitS something is wrong with the device and the peers time out as they would without this.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(kWriteWaitS);
  cudaError_t state;
  while ((state = cudaStreamQuery(stream_)) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() > deadline) {
      pending_ = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  failed |= state != cudaSuccess && state != cudaErrorNotReady;
  if (current != device_ && current >= 0) cudaSetDevice(current);
  if (failed) cudaGetLastError();  // best effort: a failed write leaves no error for the caller's next CUDA call
}

}  // namespace moe_ep
