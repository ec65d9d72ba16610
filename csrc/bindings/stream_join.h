// Torch glue the normal-mode bindings share: typed addresses of (optional) tensors, the current stream of a
// tensor's device, a Buffer's comm stream with the joins that order it against the caller's stream, and the
// event an async_finish call returns. Everything here runs on the host, once per call.
#pragma once

// c10's CUDA headers, not ATen/cuda's (those pull in cuSPARSE / cuBLAS headers that a CPU check machine lacks);
// c10::cuda::CUDAStream and getCurrentCUDAStream are these same c10 names.
#include <ATen/ATen.h>
#include <ATen/cuda/EmptyTensor.h>
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

// An uninitialised contiguous CUDA tensor on `device` from the caching allocator (at::detail::empty_cuda: what
// at::empty does for CUDA, without the operator dispatch, which is a sizeable share of a cached call's host
// time). The block belongs to the stream current at the call, as with at::empty.
inline at::Tensor empty_on(c10::DeviceIndex device, at::ScalarType dtype, at::IntArrayRef size) {
  return at::Tensor(at::detail::empty_cuda(size, dtype, c10::Device(c10::DeviceType::CUDA, device), std::nullopt));
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

// How a normal-mode launch is placed (moe_dispatcher/compiled/__init__.py, LAUNCH_*):
//   kOnCurrent  on the current stream, as it is: the full path, inside Buffer._stream_scope, which ordered it
//               (CommStream::enter_current for a synchronous call, enter_full_path on the comm stream);
//   kAsync      on the comm stream, after the work queued on the caller's stream so far (async_finish): the
//               caller gets an event;
//   kSync       on the caller's stream itself (a synchronous call): what the caller queues next runs after it
//               by stream order, with no event record or wait on the host (the cost of a cached call is its
//               launch, not its joins).
enum LaunchMode : int { kOnCurrent = 0, kAsync = 1, kSync = 2 };

// A Buffer's comm stream, and the launch order of the kernels that use the Buffer's memory.
//
// Launch order: two kernels that use the same Buffer must not run at the same time (they share its rings and
// counters), so each launch is enqueued after the previous one. Launches go to different streams (synchronous
// calls to the caller's, async ones to the comm stream), so the stream of the latest launch is kept (last_):
// a launch on another stream first makes that stream wait for last_ (one event record and wait, only when the
// stream changes; none in a steady loop on one stream). Invariant: every launch so far is ordered before the
// work queued on last_ from now on.
// Graph capture: a capturing stream may only wait for work of its own capture, so a switch between a stream
// in capture and one outside it (or in another capture) is not joined; the graph's launches are ordered
// against eager ones by how the caller orders the replay (as for any captured work). The events are made
// once and re-recorded: a stream wait captures the event as it is when the wait is enqueued.
class CommStream {
 public:
  explicit CommStream(const c10::Stream& comm) : comm_(comm) {
    const c10::cuda::CUDAGuard guard(comm_.device_index());
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&caller_done_, cudaEventDisableTiming));
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&handoff_, cudaEventDisableTiming));
  }
  ~CommStream() {
    cudaEventDestroy(caller_done_);
    cudaEventDestroy(handoff_);
  }
  CommStream(const CommStream&) = delete;
  CommStream& operator=(const CommStream&) = delete;

  c10::DeviceIndex device() const { return comm_.device_index(); }
  const c10::cuda::CUDAStream& stream() const { return comm_; }

  // An async_finish launch: the comm stream waits for what `caller` queued so far (the inputs) and for the
  // latest launch, and becomes the stream of the latest launch.
  void enter_async(const c10::cuda::CUDAStream& caller) {
    MOE_CUDA_CHECK(cudaEventRecord(caller_done_, caller.stream()));
    MOE_CUDA_CHECK(cudaStreamWaitEvent(comm_.stream(), caller_done_, 0));
    follow(comm_.stream(), true, caller.stream());
  }
  // A synchronous launch on `caller`: it waits for the latest launch if that was on another stream.
  void enter_sync(const c10::cuda::CUDAStream& caller) { follow(caller.stream(), false, nullptr); }
  // A synchronous call of the full path (Buffer._stream_scope) launches on the caller's current stream: it
  // waits for the latest launch if that was on another stream.
  void enter_current() { follow(current_stream(comm_.device_index()).stream(), false, nullptr); }
  // An async_finish / previous_event call of the full path (Buffer._stream_scope) launches on the comm stream,
  // which it made wait for the stream `joined` when joined_any (not when it waited for previous_event instead).
  // Streams come as their cudaStream_t value (torch.cuda.Stream.cuda_stream; 0 is the legacy default stream).
  void enter_full_path(bool joined_any, uintptr_t joined) {
    follow(comm_.stream(), joined_any, reinterpret_cast<cudaStream_t>(joined));
  }
  // The full path of a synchronous call made `caller` wait for the comm stream after its launches: the next
  // launch may follow `caller` (so a synchronous cached call after it needs no join).
  void caller_joined(uintptr_t caller) {
    if (has_last_ && last_ == comm_.stream()) last_ = reinterpret_cast<cudaStream_t>(caller);
  }

 private:
  // Order the next launch, on `next`, after the latest one. has_joined: `next` already waits for the stream
  // `joined` (a stream value is no flag: the legacy default stream is 0).
  void follow(cudaStream_t next, bool has_joined, cudaStream_t joined) {
    if (has_last_ && last_ != next && !(has_joined && last_ == joined) && joinable(last_, next)) {
      MOE_CUDA_CHECK(cudaEventRecord(handoff_, last_));
      MOE_CUDA_CHECK(cudaStreamWaitEvent(next, handoff_, 0));
    }
    last_ = next;
    has_last_ = true;
  }
  // Whether `next` may wait for `last`: both outside capture, or both in the same capture. The legacy
  // default stream (torch's default stream, 0) is never captured and is not queried while `next` captures
  // (touching it during a global-mode capture invalidates the capture).
  static bool joinable(cudaStream_t last, cudaStream_t next) {
    cudaStreamCaptureStatus next_status, last_status;
    unsigned long long next_id = 0, last_id = 0;
    MOE_CUDA_CHECK(cudaStreamGetCaptureInfo(next, &next_status, &next_id));
    const bool last_is_legacy = last == nullptr || last == cudaStreamLegacy || last == cudaStreamPerThread;
    if (last_is_legacy) return next_status == cudaStreamCaptureStatusNone;
    MOE_CUDA_CHECK(cudaStreamGetCaptureInfo(last, &last_status, &last_id));
    if (next_status == cudaStreamCaptureStatusNone) return last_status == cudaStreamCaptureStatusNone;
    return next_status == cudaStreamCaptureStatusActive && last_status == cudaStreamCaptureStatusActive &&
           next_id == last_id;
  }

  c10::cuda::CUDAStream comm_;
  cudaEvent_t caller_done_ = nullptr, handoff_ = nullptr;
  cudaStream_t last_ = nullptr;  // the stream of the latest launch that used the Buffer (when has_last_)
  bool has_last_ = false;
};

}  // namespace moe_ep
