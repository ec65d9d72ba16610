// Cached normal-mode calls as one native call each: the plan class both normal-mode bindings use.
#pragma once

#include <torch/extension.h>
#include <pybind11/pybind11.h>

#include <tuple>
#include <utility>
#include <vector>

#include "bindings/carve.h"
#include "bindings/device_scope.h"
#include "bindings/fast_call.h"
#include "bindings/owned_function.h"
#include "bindings/stream_join.h"
#include "runtime/cuda_check.h"
#include "runtime/ipc_buffer.h"

namespace moe_ep {

// The plans of cached normal-mode calls (dispatch along a handle, combine), shared by the intranode and internode
// bindings: one Python call each. A plan is made by the backend's full path after the call's checks passed
// (moe_dispatcher/compiled/intranode.py, internode.py) and kept in the handle's state; it holds the kernel's
// arguments with every field but the tensors' addresses filled in, the handle's routing tensors, and
// what a later call must look like to pass the same checks. run() checks that at the boundary (the handle's
// fields, the tensors' dtype / shape / device / contiguity, the config): anything else is "not mine" (None),
// and the Buffer takes the full path, which validates, raises or makes a new plan. (That the handle is the
// calling Buffer's, the Buffer checks before it calls.) Python holds a plan as a METH_FASTCALL function that owns
// it (plan_function below): plan(handle, x, aux, config, num_sms, mode), one native call with no pybind11 dispatch.

// May the backend still launch? Not once the buffer is destroyed or a kernel recorded a timeout or a peer's
// abort (sticky: the Buffer is unusable from then on); the plans answer None and the full path raises the
// reason. (The device writes the mailbox: read it through volatile, as timeout_info does.) A rank that posted
// an abort at an earlier call clears it here, before it launches (one branch otherwise).
inline bool usable(const IpcBuffer& b) {
  if (!b.alive()) return false;
  b.clear_abort_if_posted();
  const volatile intranode::Mailbox* box = b.host_mailbox();
  return box->timeout.status == 0;
}

// What a tensor argument of a plan must look like (and its output's shape): dtype and shape, on the plan's device,
// contiguous.
struct TensorSpec {
  at::ScalarType dtype;
  int64_t rows, cols;
  bool matches(const at::Tensor& t, c10::DeviceIndex device) const {
    return t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && t.is_cuda() &&
           t.get_device() == device && t.is_contiguous();
  }
  size_t bytes() const { return static_cast<size_t>(rows) * static_cast<size_t>(cols) * c10::elementSize(dtype); }
  // A view of `block` from byte `offset` of this shape and dtype (contiguous).
  at::Tensor carve_from(const c10::Storage& block, size_t offset) const {
    return carve(block, offset, dtype, {rows, cols}, {cols, 1});
  }
};

// Where a call's second output starts in the block of both: past the first, at a multiple of 256 bytes (as
// torch's allocator aligns blocks of their own), so the kernels' vector accesses find it aligned.
inline size_t second_output_offset(size_t first_bytes) { return (first_bytes + 255) / 256 * 256; }

// The fields of a DispatchHandle (moe_dispatcher/handle.py) a plan depends on, by position.
enum HandleField : int {
  kIsTokenInRank = 1,
  kRecvSrcIdx = 2,
  kNumTokens = 4,
  kNumWorstTokens = 5,
  kHandleFields = 9
};

// What a plan runs: a dispatch (x, FP8 scales -> recv_x, recv_scales) or a combine (x, top-k weights -> out,
// out_topk_weights). The Args of both backends name these fields alike.
enum class CallKind { kDispatch, kCombine };

// The plan of one cached call. Args: a DispatchArgs or CombineArgs (or a struct that names the same four tensor
// fields, as the pull combine's and the direct dispatch's plans do) whose every field but the four tensors of the
// call is set (routing included: `routing` keeps those tensors alive); an Args with
// output_block(output bytes, aux output bytes, launch stream) -> (block, aux output's byte offset) places the
// outputs itself, else they share one caching-allocator block; `input` / `aux` (FP8 scales of a
// dispatch, top-k weights of a combine; none: the call has none) describe the arguments; `output` /
// `aux_output` the outputs. `buffer`: the IpcBuffer whose mailbox records the backend's timeouts.
template <class Args, void (*Launch)(const Args&, cudaStream_t), CallKind kKind>
class CachedCall {
 public:
  CachedCall(const IpcBuffer& b, CommStream& comm, const pybind11::tuple& handle,
             std::vector<at::Tensor> routing, const Args& a, TensorSpec input, c10::optional<TensorSpec> aux,
             TensorSpec output, c10::optional<TensorSpec> aux_output, pybind11::object config, int num_sms)
      : a_(a), buffer_(&b), comm_(&comm), input_(input), aux_(aux), output_(output), aux_output_(aux_output),
        config_(std::move(config)), num_sms_(num_sms), routing_(std::move(routing)) {
    MOE_CHECK(handle.size() == kHandleFields, "a cached call needs a DispatchHandle");
    is_token_in_rank_ = handle[kIsTokenInRank];
    recv_src_idx_ = handle[kRecvSrcIdx];
    num_tokens_ = handle[kNumTokens].cast<int64_t>();
    num_worst_tokens_ = handle[kNumWorstTokens].cast<int64_t>();
  }

  // The call: (output, aux output or None, CommEvent or None), or None when the arguments are not those the plan
  // was made for, or the backend may no longer launch. mode (LaunchMode, stream_join.h): kOnCurrent launches on
  // the current stream (the full path, inside the Buffer's stream scope, which ordered it); kAsync on the comm
  // stream, after the caller's, returning the event; kSync on the caller's stream. The outputs are views of one
  // block of the caching allocator (one allocation; an aux output keeps the output's memory and vice versa),
  // allocated on the current stream: the caller's (fast path) or the comm stream the Buffer made current (full
  // path, which records them on the caller's stream afterwards). The device is switched only when it is not the
  // current one (DeviceScope).
  pybind11::object run(PyObject* handle, const at::Tensor& x, const c10::optional<at::Tensor>& aux, PyObject* config,
                       int64_t num_sms, int64_t mode) {
    if (!matches(handle, x, aux, config, num_sms) || !usable(*buffer_)) return pybind11::none();
    MOE_CHECK(mode >= kOnCurrent && mode <= kSync, "bad launch mode");
    const c10::DeviceIndex device = comm_->device();
    const DeviceScope scope(device);
    const c10::cuda::CUDAStream caller = current_stream(device);
    if (mode == kAsync) {
      comm_->enter_async(caller);
    } else if (mode == kSync) {
      comm_->enter_sync(caller);
    }
    const c10::cuda::CUDAStream& stream = mode == kAsync ? comm_->stream() : caller;
    const size_t out_bytes = output_.bytes();
    const size_t aux_bytes = aux_output_.has_value() ? aux_output_->bytes() : 0;
    c10::Storage block;
    size_t aux_offset = 0;
    if constexpr (requires(Args& a, size_t n, cudaStream_t s) { a.output_block(n, n, s); }) {
      // Args places the outputs itself (a direct dispatch's: in the peer pool, in its payload layout).
      std::tie(block, aux_offset) = a_.output_block(out_bytes, aux_bytes, stream.stream());
    } else {
      aux_offset = aux_output_.has_value() ? second_output_offset(out_bytes) : out_bytes;
      block = cuda_block(aux_offset + aux_bytes);
    }
    at::Tensor out = output_.carve_from(block, 0);
    c10::optional<at::Tensor> aux_out;
    if (aux_output_.has_value()) aux_out = aux_output_->carve_from(block, aux_offset);
    set_tensors(a_, x, aux, out, aux_out);
    Launch(a_, stream.stream());
    pybind11::object event = pybind11::none();
    if (mode == kAsync) {
      // The comm stream uses the inputs and outputs until the event: a free before it must not hand their
      // blocks to other work (the EventOverlap also keeps them referenced). The outputs share one block.
      record_on(x, stream);
      record_on(out, stream);
      if (aux.has_value()) record_on(*aux, stream);
      event = pybind11::cast(CommEvent(stream));
    }
    pybind11::object result = wrap(std::move(out));
    pybind11::object aux_result = aux_out.has_value() ? wrap(std::move(*aux_out)) : pybind11::none();
    return pybind11::make_tuple(std::move(result), std::move(aux_result), std::move(event));
  }

 private:
  // The Python object of a tensor (what pybind11's caster returns, without its dispatch).
  static pybind11::object wrap(at::Tensor t) {
    pybind11::object o = pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(std::move(t)));
    if (!o) throw pybind11::error_already_set();
    return o;
  }

  bool matches(PyObject* h, const at::Tensor& x, const c10::optional<at::Tensor>& aux, PyObject* config,
               int64_t num_sms) const {
    if (!PyTuple_Check(h) || PyTuple_GET_SIZE(h) != kHandleFields) return false;
    if (PyTuple_GET_ITEM(h, kIsTokenInRank) != is_token_in_rank_.ptr() ||
        PyTuple_GET_ITEM(h, kRecvSrcIdx) != recv_src_idx_.ptr() ||
        PyLong_AsLongLong(PyTuple_GET_ITEM(h, kNumTokens)) != num_tokens_ ||
        PyLong_AsLongLong(PyTuple_GET_ITEM(h, kNumWorstTokens)) != num_worst_tokens_) {
      PyErr_Clear();  // a field that is no int reads as -1 with an error set: not this plan's
      return false;
    }
    // The config: the same object (None: the Buffer's default for num_sms, so num_sms as well), or an equal one.
    if ((config == Py_None) != config_.is_none()) return false;
    if (config == Py_None) {
      if (num_sms != num_sms_) return false;
    } else if (config != config_.ptr()) {
      const int equal = PyObject_RichCompareBool(config, config_.ptr(), Py_EQ);
      if (equal != 1) {
        PyErr_Clear();
        return false;
      }
    }
    const c10::DeviceIndex device = comm_->device();
    if (!input_.matches(x, device) || aux.has_value() != aux_.has_value()) return false;
    return !aux.has_value() || aux_->matches(*aux, device);
  }

  static void set_tensors(Args& a, const at::Tensor& x, const c10::optional<at::Tensor>& aux, const at::Tensor& out,
                          const c10::optional<at::Tensor>& aux_out) {
    a.x = data_of<const uint8_t>(x);
    if constexpr (kKind == CallKind::kDispatch) {
      a.scales = data_of<const int32_t>(aux);
      a.recv_x = data_of<uint8_t>(out);
      a.recv_scales = data_of<int32_t>(aux_out);
    } else {
      a.topk_weights = data_of<const float>(aux);
      a.out = data_of<uint8_t>(out);
      a.out_topk_weights = data_of<float>(aux_out);
    }
  }

  Args a_;
  const IpcBuffer* buffer_;
  CommStream* comm_;
  TensorSpec input_;
  c10::optional<TensorSpec> aux_;
  TensorSpec output_;
  c10::optional<TensorSpec> aux_output_;
  pybind11::object config_;
  int num_sms_;
  pybind11::object is_token_in_rank_, recv_src_idx_;  // compared by identity: a handle with other routing is not mine
  int64_t num_tokens_ = 0, num_worst_tokens_ = 0;
  std::vector<at::Tensor> routing_;  // the handle's tensors whose addresses a_ holds: kept alive with the plan
};

// A plan as Python calls it: plan(handle, x, aux, config, num_sms, mode) -> run()'s answer (arguments by
// bindings/fast_call.h's rules: x a tensor, aux a tensor or None, num_sms and mode integers; handle and config
// any object, compared by run()).
template <class Plan>
PyObject* call_plan(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  namespace f = fast_call;
  return f::run([&] {
    f::expect_args(nargs, 6, "plan");
    const at::Tensor& x = f::tensor(a[1], "x");
    const c10::optional<at::Tensor> aux = f::optional_tensor(a[2], "aux");
    const int64_t num_sms = f::integer(a[4], "num_sms");
    const int64_t mode = f::integer(a[5], "mode");
    return owned_object<Plan>(self).run(a[0], x, aux, a[3], num_sms, mode);
  });
}

// `plan` as the METH_FASTCALL function Python holds in the handle's state, owning it and keeping `keep` (the
// Python objects of the IpcBuffer and CommStream it points to) referenced.
template <class Plan>
pybind11::object plan_function(std::unique_ptr<Plan> plan, std::vector<pybind11::object> keep) {
  static PyMethodDef def{"plan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_plan<Plan>)),
                         METH_FASTCALL,
                         "plan(handle, x, aux, config, num_sms, mode) -> (output, aux output or None, event or None), "
                         "or None when the call is not this plan's"};
  return owned_function(def, std::move(plan), std::move(keep));
}

}  // namespace moe_ep
