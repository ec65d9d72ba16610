// Torch glue the normal-mode bindings share: typed addresses of (optional) tensors, the current stream of a
// tensor's device, a Buffer's comm stream with the joins that order it against the caller's stream, and the
// event an async_finish call returns. Everything here runs on the host, once per call.
#pragma once

// c10's CUDA headers, not ATen/cuda's (those pull in cuSPARSE / cuBLAS headers that a CPU check machine lacks);
// c10::cuda::CUDAStream and getCurrentCUDAStream are these same c10 names.
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <optional>
#include <string>

#include "runtime/cuda_check.h"

namespace moe_ep {

// Typed address of a tensor's first element (null for a tensor without elements: the kernels read null as
// "nothing there", which is exact for an empty tensor: no row refers to it).
template <typename T>
inline T* data_of(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}
template <typename T>
inline T* data_of(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? static_cast<T*>(t->data_ptr()) : nullptr;
}

// Invariants of a tensor the Python side allocated or validated: a CUDA tensor of `device`, contiguous.
// A failure is a bug of the caller (validation lives in moe_dispatcher/validation.py), reported by name.
inline void expect_cuda(const at::Tensor& t, c10::DeviceIndex device, const char* name) {
  MOE_CHECK(t.defined() && t.is_cuda() && t.get_device() == device && t.is_contiguous(),
            std::string(name) + ": expected a contiguous CUDA tensor on the call's device");
}
inline void expect_cuda(const c10::optional<at::Tensor>& t, c10::DeviceIndex device, const char* name) {
  if (t.has_value()) expect_cuda(*t, device, name);
}

// The caller's current stream on `device`: where fresh calls launch (the Buffer made its comm stream current
// when the call needs one) and what cached calls join.
inline c10::cuda::CUDAStream current_stream(c10::DeviceIndex device) {
  return c10::cuda::getCurrentCUDAStream(device);
}

// Records that `stream` uses t's memory, so that freeing t before the stream's queued work reaches this point
// cannot hand its block to other work (what Tensor.record_stream does, without the dispatcher).
inline void record_on(const at::Tensor& t, const c10::cuda::CUDAStream& stream) {
  const c10::DataPtr& data = t.storage().data_ptr();
  if (data.get() != nullptr) c10::cuda::CUDACachingAllocator::recordStream(data, stream);
}

// The event of an async_finish call, recorded on the comm stream after its launch. EventOverlap
// (moe_dispatcher/event.py) wraps it with the same methods as torch.cuda.Event that it uses:
// wait(stream=None) makes a stream (default: the current one) wait for it, without blocking the host.
class CommEvent {
 public:
  explicit CommEvent(const c10::cuda::CUDAStream& stream) : device_(stream.device_index()) { event_.record(stream); }
  void wait(const c10::optional<c10::Stream>& stream) {
    const c10::cuda::CUDAGuard guard(device_);
    event_.block(stream.has_value() ? c10::cuda::CUDAStream(*stream) : current_stream(device_));
  }
  bool query() const { return event_.query(); }
  void synchronize() const { event_.synchronize(); }

 private:
  c10::DeviceIndex device_;
  c10::cuda::CUDAEvent event_;
};

// A Buffer's comm stream and two events made once and re-recorded by every synchronous cached call: a stream
// wait captures the event as it is when the wait is enqueued, so re-recording cannot affect waits already
// queued. How a launch is ordered against the caller's stream (moe_dispatcher/compiled/__init__.py, JOIN_*):
//   kJoinNone    nothing: launch on the current stream (the Buffer made the comm stream current and ordered it);
//   kJoinBefore  the comm stream waits for the work queued on the caller's stream so far (async_finish);
//   kJoinBoth    as kJoinBefore, then the caller's stream waits for the launch (a synchronous call).
enum Join : int { kJoinNone = 0, kJoinBefore = 1, kJoinBoth = 2 };

class CommStream {
 public:
  explicit CommStream(const c10::Stream& comm) : comm_(comm) {
    const c10::cuda::CUDAGuard guard(comm_.device_index());
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&before_, cudaEventDisableTiming));
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&after_, cudaEventDisableTiming));
  }
  ~CommStream() {
    cudaEventDestroy(before_);
    cudaEventDestroy(after_);
  }
  CommStream(const CommStream&) = delete;
  CommStream& operator=(const CommStream&) = delete;

  c10::DeviceIndex device() const { return comm_.device_index(); }
  const c10::cuda::CUDAStream& stream() const { return comm_; }

  // The comm stream waits for what `caller` queued so far.
  void wait_for(const c10::cuda::CUDAStream& caller) const {
    MOE_CUDA_CHECK(cudaEventRecord(before_, caller.stream()));
    MOE_CUDA_CHECK(cudaStreamWaitEvent(comm_.stream(), before_, 0));
  }
  // `caller` waits for what the comm stream queued so far.
  void then(const c10::cuda::CUDAStream& caller) const {
    MOE_CUDA_CHECK(cudaEventRecord(after_, comm_.stream()));
    MOE_CUDA_CHECK(cudaStreamWaitEvent(caller.stream(), after_, 0));
  }

 private:
  c10::cuda::CUDAStream comm_;
  cudaEvent_t before_ = nullptr, after_ = nullptr;
};

}  // namespace moe_ep
