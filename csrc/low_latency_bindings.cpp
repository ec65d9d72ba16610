// The low-latency (NVSHMEM) runtime: the `low_latency` submodule of _C.
//
// One LowLatencyRuntime per compiled low-latency backend (moe_dispatcher/compiled/low_latency.py makes
// it once NVSHMEM is up and the symmetric buffer allocated). Each Buffer.low_latency_dispatch /
// low_latency_combine is ONE call into it: it checks the tensors' invariants against the call's plan
// (device, dtype, contiguity, sizes; the user-facing validation ran in Python on the first call of
// the shape), takes the buffer half, allocates the outputs (one allocation per call, on the current
// stream), launches the kernel on the current stream (or on the comm stream with async_finish, or
// the send half now and the receive half in the returned hook), and returns the outputs. The plan
// of a shape (layout of a buffer half, the kernels chosen, the launch context) is built once.
//
// Kernels chosen per plan (no switch, low_latency.h): the dedup dispatch and, for the per-rank
// reduction order, the per-rank combine when every peer is reachable through NVLink and there are two
// local experts or more; the per-expert kernels otherwise, and for a combine with return_recv_hook (its
// send phase must not wait on peers).
//
// Timeouts: the kernels record the first timed-out wait in a host-mapped TimeoutRecord this runtime
// allocates, and exit. Every later call (hooks included) raises a RuntimeError naming the waiting rank,
// the phase and the peer, and the runtime stays unusable.
// Agreement (docs/low_latency.md, "Agreement"): every dispatch carries its signature (low_latency.h,
// dispatch_signature: computed once per plan and FP8 flags, here) in its count words and signature words; a
// receive that finds a source's differing records it in a host-mapped SignatureRecord, and every later call
// (hooks included) raises the `signature_error` the backend gave (moe_dispatcher.signature.SignatureMismatch,
// naming this rank's fields and the source's), with no collective: every rank receives from every rank, so
// every rank finds it and raises at its own next call. It takes precedence over a recorded timeout.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "bindings/carve.h"
#include "bindings/device_scope.h"
#include "bindings/fast_call.h"
#include "bindings/stream_join.h"
#include "kernels/low_latency/low_latency.h"
#include "runtime/cuda_check.h"
#include "runtime/peer_abort.h"

namespace py = pybind11;

namespace moe_ep {
namespace {

using namespace low_latency;
using OptTensor = std::optional<at::Tensor>;

constexpr int kTraceKinds = 2;  // trace records: [kind (0 dispatch, 1 combine)][half][kTraceWords]
constexpr size_t kCarveAlign = 256;

size_t align_up(size_t n) { return (n + kCarveAlign - 1) / kCarveAlign * kCarveAlign; }

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }
[[noreturn]] void bad_value(const std::string& what) { throw py::value_error(what); }

// An int64 argument that the plan keeps as int: a value outside int's range is a ValueError naming it, never
// truncated into range (2**32 + 8 would otherwise pass as 8).
int narrow(int64_t value, const char* name) {
  if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max())
    bad_value(std::string("low-latency: ") + name + "=" + std::to_string(value) + " is out of range");
  return static_cast<int>(value);
}

// Invariant checks of one tensor argument (ValueError naming it).
void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int device) {
  if (!t.is_cuda() || t.get_device() != device)
    bad_value(std::string("low-latency: ") + name + " must be a CUDA tensor on device " + std::to_string(device));
  if (t.scalar_type() != dtype)
    bad_value(std::string("low-latency: ") + name + " must be " + c10::toString(dtype) + ", got " +
              c10::toString(t.scalar_type()));
  if (!t.is_contiguous()) bad_value(std::string("low-latency: ") + name + " must be contiguous");
}
void check_shape(const at::Tensor& t, const char* name, std::initializer_list<int64_t> shape) {
  if (t.sizes() != c10::IntArrayRef(shape)) {
    std::string want = "[";
    for (int64_t s : shape) want += std::to_string(s) + ",";
    want.back() = ']';
    bad_value(std::string("low-latency: ") + name + " must have shape " + want + ", got " +
              c10::str(t.sizes()));
  }
}

// What the calls of one (max tokens, hidden, experts, top-k) share, checked once when made.
struct Plan {
  int max_tokens, hidden, num_experts, num_topk, local, rows;
  HalfLayout layout;
  uint64_t signatures[8];  // dispatch_signature per (use_fp8, round_scale, use_ue8m0): index fp8 | rs << 1 | ue8m0 << 2
  bool dedup_dispatch;  // the dedup dispatch kernels serve this shape
  bool per_rank_ok;     // the per-rank combine kernels can serve it (used with the per-rank order)
};

class Runtime;

// What a LowLatencyHandle made by this runtime carries in its backend_state (a capsule named kStateName that
// owns it): the dispatch's routing (the handle's src_info and layout_range, plus row_of: [l][s*maxT + t] = the
// row of source s's token t at local expert l, for the per-rank combine) and what combine checks its arguments
// against. The routing is read through the dispatch's output block itself, which the state owns (its storage),
// never through the handle's tensors: those are the user's (src_info.set_(...) would move a tensor to other
// memory, and the kernels would read or write there). row_of has no tensor at all.
struct DispatchState {
  uint64_t owner;        // Runtime::id_ of the runtime that made it (ids are never reused, addresses could be)
  c10::Storage block;    // the dispatch's output block (every output is a view of it): kept alive by the state
  const int* src_info;   // int32 [L, R*maxT], in block
  const int* row_of;     // int32 [L, R*maxT], in block
  const int64_t* layout_range;  // int64 [L, R], in block
  int max_tokens, hidden, num_experts, num_tokens;
};
constexpr const char* kStateName = "moe_dispatcher.low_latency.DispatchState";
void free_state(PyObject* capsule) { delete static_cast<DispatchState*>(PyCapsule_GetPointer(capsule, kStateName)); }

// LowLatencyHandle's fields (moe_dispatcher/handle.py), in order: the runtime builds handles as tuples of its
// type (what its generated __new__ does, without the Python frame) and reads backend_state by position, so
// the runtime checks these names once when it is made.
constexpr std::array<const char*, 9> kHandleFields = {
    "src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts", "backend",
    "buffer_token", "backend_state", "num_tokens"};
constexpr int kHandleStateField = 7;

// The send-now / receive-later half of a call made with return_recv_hook.
struct PendingReceive {
  std::shared_ptr<Runtime> rt;
  bool dispatch;
  Common c;
  DispatchArgs da;
  CombineArgs ca;
  uint64_t call;
  int half;
  bool done = false;
  std::vector<at::Tensor> keep;  // inputs and outputs the receive kernel touches
};

class Runtime : public std::enable_shared_from_this<Runtime> {
 public:
  Runtime(const at::Tensor& buffer, size_t num_bytes, const std::vector<uint64_t>& peer_bases, int rank, int num_ranks,
          int device, int num_blocks, uint64_t timeout_ns, const py::object& comm_stream, bool rank_partials,
          const OptTensor& trace, py::object handle_cls, py::object event_cls, py::object no_event,
          py::object layout_round, py::object timeout_message, int64_t buffer_token, uint64_t peer_aborts,
          const std::vector<uint64_t>& abort_targets, py::object signature_error)
      : num_bytes_(num_bytes), rank_(rank), num_ranks_(num_ranks), device_(device), num_blocks_(num_blocks),
        timeout_ns_(timeout_ns), rank_partials_(rank_partials),
        handle_cls_(std::move(handle_cls)), event_cls_(std::move(event_cls)), no_event_(std::move(no_event)),
        layout_round_(std::move(layout_round)), timeout_message_(std::move(timeout_message)),
        signature_error_(std::move(signature_error)) {
    MOE_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "low_latency: bad number of ranks");
    MOE_CHECK(static_cast<int>(peer_bases.size()) == num_ranks, "low_latency: one peer base per rank");
    MOE_CHECK(static_cast<int>(abort_targets.size()) == num_ranks, "low_latency: one abort target per rank");
    MOE_CHECK(peer_aborts != 0 && peer_aborts % 8 == 0, "low_latency: the abort bytes must be 8-byte aligned");
    MOE_CHECK(num_blocks >= 1, "low_latency: num_blocks must be positive");
    check_handle_type(handle_cls_);
    handle_type_ = reinterpret_cast<PyTypeObject*>(handle_cls_.ptr());
    backend_name_ = py::str("low_latency");
    buffer_token_ = py::int_(buffer_token);
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    // The symmetric buffer as the backend's uint8 tensor: every view carved from it (the zero-copy combine buffer)
    // shares its storage, whose owner keeps the memory from being freed while a view lives.
    MOE_CHECK(buffer.is_cuda() && buffer.get_device() == device && buffer.scalar_type() == at::kByte &&
                  buffer.dim() == 1 && buffer.is_contiguous() && buffer.numel() == static_cast<int64_t>(num_bytes),
              "low_latency: the buffer must be a contiguous uint8 [num_bytes] tensor on the device");
    raw_ = buffer;
    nvlink_all_ = true;
    for (uint64_t p : peer_bases) nvlink_all_ = nvlink_all_ && p != 0;
    peer_bases_ = at::tensor(std::vector<int64_t>(peer_bases.begin(), peer_bases.end()), at::kLong)
                      .to(at::Device(at::kCUDA, device));
    workspace_ = at::zeros({kWorkspaceInts}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device));
    MOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_timeout_), sizeof(TimeoutRecord),
                                 cudaHostAllocMapped));
    *host_timeout_ = TimeoutRecord{};
    MOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_timeout_), host_timeout_, 0));
    MOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_mismatch_), sizeof(SignatureRecord),
                                 cudaHostAllocMapped));
    *host_mismatch_ = SignatureRecord{};
    MOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_mismatch_), host_mismatch_, 0));
    // The signature words follow the abort bytes (low_latency.h, kControlBytes of the allocation from there).
    signature_words_ = reinterpret_cast<uint64_t*>(peer_aborts + kSignatureWordsOffset);
    peer_aborts_ = reinterpret_cast<const uint8_t*>(peer_aborts);
    std::vector<uint8_t*> targets;
    for (uint64_t t : abort_targets) targets.push_back(reinterpret_cast<uint8_t*>(t));
    abort_.set_targets(targets);
    const auto id = comm_stream.attr("stream_id").cast<int64_t>();
    const auto index = comm_stream.attr("device_index").cast<int64_t>();
    const auto type = comm_stream.attr("device_type").cast<int64_t>();
    comm_.emplace(c10::Stream::unpack3(id, static_cast<c10::DeviceIndex>(index), static_cast<c10::DeviceType>(type)));
    MOE_CHECK(comm_->device_index() == device, "low_latency: the comm stream is on another device");
    if (trace.has_value()) {
      const at::Tensor& t = *trace;
      MOE_CHECK(num_blocks <= kTraceMaxBlocks, "low_latency: the phase trace records at most TRACE_MAX_BLOCKS blocks");
      MOE_CHECK(t.is_cuda() && t.get_device() == device && t.scalar_type() == at::kLong && t.is_contiguous() &&
                    t.numel() == kTraceKinds * 2 * kTraceWords,
                "low_latency: the trace must be a contiguous int64 [2, 2, TRACE_WORDS] tensor on the device");
      trace_ = t;
      auto* base = reinterpret_cast<unsigned long long*>(t.data_ptr<int64_t>());
      for (int k = 0; k < kTraceKinds; ++k)
        for (int h = 0; h < 2; ++h) traces_[k][h] = base + (k * 2 + h) * kTraceWords;
    }
  }

  ~Runtime() {
    if (host_timeout_ != nullptr) cudaFreeHost(host_timeout_);
    if (host_mismatch_ != nullptr) cudaFreeHost(host_mismatch_);
  }

  // ---------------------------------------------------------------------------- calls
  py::tuple dispatch(const at::Tensor& x, const at::Tensor& topk_idx, int64_t max_tokens, int64_t num_experts,
                     const OptTensor& cum_stats, const OptTensor& wait_stats, bool use_fp8, bool round_scale,
                     bool use_ue8m0, bool async_finish, bool return_recv_hook) {
    check_usable();
    if (async_finish && return_recv_hook) bad_value("async_finish and return_recv_hook cannot both be set");
    if (use_ue8m0 && !(use_fp8 && round_scale)) bad_value("use_ue8m0 needs use_fp8=True and round_scale=True");
    check_tensor(x, "x", at::kBFloat16, device_);
    check_tensor(topk_idx, "topk_idx", at::kLong, device_);
    if (x.dim() != 2 || topk_idx.dim() != 2 || topk_idx.size(0) != x.size(0))
      bad_value("low-latency dispatch: x must be [T, H] and topk_idx [T, K]");
    const int t = static_cast<int>(x.size(0)), h = static_cast<int>(x.size(1));
    const int k = static_cast<int>(topk_idx.size(1));
    if (t > max_tokens) bad_value("low-latency dispatch: x has " + std::to_string(t) +
                                  " tokens, more than num_max_dispatch_tokens_per_rank=" + std::to_string(max_tokens));
    if (use_ue8m0 && h % 512) bad_value("use_ue8m0 packs 4 scales per int32: hidden must be divisible by 512");
    const Plan& p =
        plan(narrow(max_tokens, "num_max_dispatch_tokens_per_rank"), h, narrow(num_experts, "num_experts"), k);
    if (cum_stats) {
      check_tensor(*cum_stats, "cumulative_local_expert_recv_stats", at::kInt, device_);
      check_shape(*cum_stats, "cumulative_local_expert_recv_stats", {p.local});
    }
    if (wait_stats) {
      check_tensor(*wait_stats, "dispatch_wait_recv_cost_stats", at::kLong, device_);
      check_shape(*wait_stats, "dispatch_wait_recv_cost_stats", {num_ranks_});
    }
    const DeviceScope scope(static_cast<c10::DeviceIndex>(device_));
    const int half = start_call(p);

    // Outputs, carved from one allocation (one block of the caching allocator, on the current stream; the views
    // share its storage, and so does the handle's state: the last of them to go frees it): recv_x [L, rows, H]
    // (fp8 or bf16), scales [L, rows, G] token-minor (fp8), recv_count [L], src_info and row_of [L, rows] (row_of:
    // no tensor, the handle's state keeps its address), layout_range [L, R].
    const int64_t L = p.local, rows = p.rows, H = h, R = num_ranks_;
    const int64_t groups = use_ue8m0 ? H / 512 : H / 128;
    const size_t data_bytes = align_up(static_cast<size_t>(L * rows * H) * (use_fp8 ? 1 : 2));
    const size_t scale_bytes = use_fp8 ? align_up(static_cast<size_t>(L * groups * rows) * 4) : 0;
    const size_t count_bytes = align_up(static_cast<size_t>(L) * 4);
    const size_t info_bytes = align_up(static_cast<size_t>(L * rows) * 4);
    const size_t range_bytes = align_up(static_cast<size_t>(L * R) * 8);
    const c10::Storage block = cuda_block(data_bytes + scale_bytes + count_bytes + 2 * info_bytes + range_bytes);
    size_t off = 0;
    at::Tensor data = carve(block, off, use_fp8 ? at::kFloat8_e4m3fn : at::kBFloat16, {L, rows, H},
                            {rows * H, H, 1});
    off += data_bytes;
    at::Tensor scales;
    if (use_fp8) {
      scales = carve(block, off, use_ue8m0 ? at::kInt : at::kFloat, {L, rows, groups}, {groups * rows, 1, rows});
      off += scale_bytes;
    }
    at::Tensor recv_count = carve(block, off, at::kInt, {L}, {1});
    off += count_bytes;
    at::Tensor src_info = carve(block, off, at::kInt, {L, rows}, {rows, 1});
    off += info_bytes;
    int* const row_of = reinterpret_cast<int*>(static_cast<uint8_t*>(block.mutable_data()) + off);
    off += info_bytes;
    at::Tensor layout_range = carve(block, off, at::kLong, {L, R}, {R, 1});

    Common c = common(p, half, 0);
    DispatchArgs a{};
    // A CUDA graph replays the captured word (generation included) on every rank alike; a word an earlier
    // replay of the same call left equals this one, so it cannot differ (low_latency.h, with_generation).
    a.signature = with_generation(p.signatures[(use_fp8 ? 1 : 0) | (round_scale ? 2 : 0) | (use_ue8m0 ? 4 : 0)],
                                  calls_);
    a.signature_words = signature_words_;
    a.mismatch = device_mismatch_;
    a.call = calls_;
    a.x = x.data_ptr();
    a.topk_idx = topk_idx.data_ptr<int64_t>();
    a.num_tokens = t;
    a.num_topk = k;
    a.fp8 = use_fp8;
    a.round_scale = round_scale;
    a.ue8m0 = use_ue8m0;
    a.recv_x = data.data_ptr();
    a.recv_scales = use_fp8 ? scales.data_ptr() : nullptr;
    a.src_info = src_info.data_ptr<int>();
    a.row_of = row_of;
    a.layout_range = layout_range.data_ptr<int64_t>();
    a.recv_count = recv_count.data_ptr<int>();
    a.cumulative_recv_stats = cum_stats ? cum_stats->data_ptr<int>() : nullptr;
    a.wait_stats = wait_stats ? wait_stats->data_ptr<int64_t>() : nullptr;

    py::object handle = make_handle(p, t, src_info, layout_range, std::make_unique<DispatchState>(DispatchState{
                                              id_, block, src_info.data_ptr<int>(), row_of,
                                              layout_range.data_ptr<int64_t>(), p.max_tokens, h, p.num_experts, t}));
    py::object recv_x = use_fp8 ? py::object(py::make_tuple(data, scales)) : py::cast(data);
    std::vector<at::Tensor> keep;
    if (async_finish || return_recv_hook) {
      keep = {x, topk_idx, src_info};  // src_info: a view of the output block (every output is one)
      if (cum_stats) keep.push_back(*cum_stats);
      if (wait_stats) keep.push_back(*wait_stats);
    }
    auto [event, hook] = launch(true, c, &a, nullptr, half, async_finish, return_recv_hook, std::move(keep));
    return py::make_tuple(std::move(recv_x), recv_count, std::move(handle), std::move(event), std::move(hook));
  }

  py::tuple combine(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                    const py::object& handle, bool zero_copy, bool async_finish, bool return_recv_hook,
                    const OptTensor& out, const OptTensor& wait_stats) {
    check_usable();
    if (async_finish && return_recv_hook) bad_value("async_finish and return_recv_hook cannot both be set");
    py::object state;  // the handle's backend_state, held for the call (s lives in it)
    const DispatchState& s = state_of(handle, state);
    check_tensor(topk_idx, "topk_idx", at::kLong, device_);
    check_tensor(topk_weights, "topk_weights", at::kFloat, device_);
    if (topk_idx.dim() != 2 || topk_idx.size(0) != s.num_tokens)
      bad_value("low_latency_combine: topk_idx must be [T, K] with the T of the handle's dispatch (" +
                std::to_string(s.num_tokens) + "); pass the topk_idx that dispatch was given");
    check_shape(topk_weights, "topk_weights", {topk_idx.size(0), topk_idx.size(1)});
    const int t = s.num_tokens, k = static_cast<int>(topk_idx.size(1));
    const Plan& p = plan(s.max_tokens, s.hidden, s.num_experts, k);
    check_tensor(x, "x", at::kBFloat16, device_);
    check_shape(x, "x", {p.local, p.rows, s.hidden});
    if (out) {
      check_tensor(*out, "out", at::kBFloat16, device_);
      check_shape(*out, "out", {t, s.hidden});
    }
    if (wait_stats) {
      check_tensor(*wait_stats, "combine_wait_recv_cost_stats", at::kLong, device_);
      check_shape(*wait_stats, "combine_wait_recv_cost_stats", {num_ranks_});
    }
    const DeviceScope scope(static_cast<c10::DeviceIndex>(device_));
    const int half = start_call(p);
    const int64_t hidden = s.hidden;
    at::Tensor result = out ? *out
                            : carve(cuda_block(static_cast<size_t>(t) * hidden * 2), 0, at::kBFloat16, {t, hidden},
                                    {hidden, 1});

    Common c = common(p, half, 1);
    // The per-rank send waits for every peer's routing; a hooked send must not wait on peers (the caller
    // overlaps it with its own work, as with DeepEP), so it runs the per-expert send, whose receiver computes
    // the same order (rank_partials) from the per-expert rows: the same bits either way.
    c.per_rank_combine = p.per_rank_ok && rank_partials_ && !return_recv_hook;
    CombineArgs a{};
    a.x = zero_copy ? nullptr : x.data_ptr();
    a.topk_idx = topk_idx.data_ptr<int64_t>();
    a.topk_weights = topk_weights.data_ptr<float>();
    a.src_info = s.src_info;
    a.row_of = s.row_of;
    a.layout_range = s.layout_range;
    a.out = result.data_ptr();
    a.num_tokens = t;
    a.num_topk = k;
    a.rank_partials = rank_partials_;
    a.wait_stats = wait_stats ? wait_stats->data_ptr<int64_t>() : nullptr;
    std::vector<at::Tensor> keep;
    if (async_finish || return_recv_hook) {
      // The dispatch's block (routing) as one byte tensor: what keeps and record_stream see.
      const at::Tensor routing = carve(s.block, 0, at::kByte, {static_cast<int64_t>(s.block.nbytes())}, {1});
      keep = {x, topk_idx, topk_weights, routing, result};
      if (wait_stats) keep.push_back(*wait_stats);
    }
    auto [event, hook] = launch(false, c, nullptr, &a, half, async_finish, return_recv_hook, std::move(keep));
    return py::make_tuple(result, std::move(event), std::move(hook));
  }

  // bf16 [L, R*maxT, H] view of the send region of the next call's half: the rows a zero-copy combine sends.
  at::Tensor next_combine_buffer(const py::object& handle) {
    check_usable();
    py::object state;
    const DispatchState& s = state_of(handle, state);
    const Plan& p = plan(s.max_tokens, s.hidden, s.num_experts, 1, /*clean_on_change=*/false);
    const size_t begin = next_half_ * p.layout.half_bytes + p.layout.send_off;
    const int64_t rows = p.rows, h = s.hidden;
    return carve(raw_, begin, at::kBFloat16, {p.local, rows, h}, {rows * h, h, 1});
  }

  // Zero both halves' signal words for these shapes and the workspace (collective: clean_layout's two rounds
  // around, the clear on the current stream). Also what a call with new shapes does first.
  void clean(int max_tokens, int hidden, int num_experts) {
    check_usable();
    const Plan& p = plan(max_tokens, hidden, num_experts, 1, /*clean_on_change=*/false);
    clean_layout(p);
  }

  void set_rank_partials(bool value) { rank_partials_ = value; }
  bool rank_partials() const { return rank_partials_; }

  // None, or (status, phase name, waiting rank, peer) of the first timed-out wait.
  py::object timeout_info() const {
    const volatile TimeoutRecord* r = host_timeout_;
    if (r == nullptr || r->status == 0) return py::none();
    return py::make_tuple(static_cast<int>(r->status), std::string(wait_phase_name(r->phase)),
                          static_cast<int>(r->rank), static_cast<int>(r->peer));
  }

  // None, or (call, source, seen, mine) of the first dispatch receive that found a source's signature differing
  // from its own (low_latency.h, SignatureRecord; seen / mine as dispatch_signature packs them).
  py::object signature_info() const {
    const volatile SignatureRecord* r = host_mismatch_;
    if (r == nullptr || r->status == 0) return py::none();
    return py::make_tuple(static_cast<uint64_t>(r->call), static_cast<int>(r->source), static_cast<uint64_t>(r->seen),
                          static_cast<uint64_t>(r->mine));
  }

  // Raise unless calls may be made: destroyed, a signature mismatch or a timeout recorded (then forever). A
  // mismatch raises signature_error_'s exception (a ValueError subclass) and wins over a timeout it caused.
  void check_usable() {
    if (mismatch_) raise_mismatch();
    if (!broken_.empty()) fail(broken_);
    if (!alive_) fail("the low-latency backend was destroyed");
    if (reinterpret_cast<const volatile SignatureRecord*>(host_mismatch_)->status != 0) {
      mismatch_ = true;
      raise_mismatch();
    }
    if (reinterpret_cast<const volatile TimeoutRecord*>(host_timeout_)->status != 0) {
      broken_ = timeout_message_(timeout_info()).cast<std::string>();
      fail(broken_);
    }
  }

  [[noreturn]] void raise_mismatch() {
    py::object error = signature_error_(signature_info(), rank_);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    throw py::error_already_set();
  }

  // Refuse every later call and hook, and drop this runtime's reference to the buffer (the backend frees it).
  void destroy() {
    alive_ = false;
    raw_ = at::Tensor();
    abort_.forget();
  }

  // The peer abort (kernels/common/wait.cuh, runtime/peer_abort.h): this rank raised in a Buffer call; common()
  // clears it at the next launch (one branch unless posted).
  void post_abort() {
    if (alive_) abort_.post();
  }

  // (half, num_experts) of the last launch of `kind` (0 dispatch, 1 combine) while tracing, else None.
  py::object trace_last(int kind) const {
    if (kind < 0 || kind >= kTraceKinds || trace_last_[kind].first < 0) return py::none();
    return py::make_tuple(trace_last_[kind].first, trace_last_[kind].second);
  }

  int num_blocks() const { return num_blocks_; }
  bool nvlink_all() const { return nvlink_all_; }
  // The kernels a (maxT, hidden, experts) call would run: (dedup dispatch, per-rank combine).
  py::tuple kernels_for(int max_tokens, int hidden, int num_experts) {
    const Plan& p = plan(max_tokens, hidden, num_experts, 1, /*clean_on_change=*/false);
    return py::make_tuple(p.dedup_dispatch, p.per_rank_ok && rank_partials_);
  }

 private:
  // The plan of these shapes, made and checked on first use. With clean_on_change, a call whose
  // (maxT, hidden, experts) differ from the previous call's first clears the signal words of the new
  // layout (collective), and refuses while a hook of the old layout is pending.
  const Plan& plan(int max_tokens, int hidden, int num_experts, int num_topk, bool clean_on_change = true) {
    Plan* found = nullptr;
    if (last_ != nullptr && last_->max_tokens == max_tokens && last_->hidden == hidden &&
        last_->num_experts == num_experts && last_->num_topk == num_topk) {
      found = last_;
    } else {
      for (auto& q : plans_) {
        if (q->max_tokens == max_tokens && q->hidden == hidden && q->num_experts == num_experts &&
            q->num_topk == num_topk) {
          found = q.get();
          break;
        }
      }
      if (found == nullptr) found = make_plan(max_tokens, hidden, num_experts, num_topk);
      last_ = found;
    }
    if (clean_on_change && !same_layout(*found)) {
      if (!pending_.empty())
        fail("low-latency call with new (max tokens, hidden, experts) while a hook of a call with the "
                  "previous shapes has not been called: call the hook first");
      if (layout_set_) clean_layout(*found);
      set_layout(*found);
    }
    return *found;
  }

  Plan* make_plan(int max_tokens, int hidden, int num_experts, int num_topk) {
    if (max_tokens < 1 || max_tokens > kMaxTokensPerRank)
      bad_value("the low-latency kernels take num_max_dispatch_tokens_per_rank from 1 to " +
                std::to_string(kMaxTokensPerRank) + ", got " + std::to_string(max_tokens));
    if (hidden < 128 || hidden % 128 || hidden > kMaxHidden)
      bad_value("the low-latency kernels take hidden sizes divisible by 128 up to " + std::to_string(kMaxHidden) +
                ", got " + std::to_string(hidden));
    if (num_experts < num_ranks_ || num_experts % num_ranks_ || num_experts > kMaxExperts)
      bad_value("the low-latency kernels take a multiple of the rank count up to " + std::to_string(kMaxExperts) +
                " experts, got " + std::to_string(num_experts));
    if (num_topk < 1 || num_topk > kMaxTopk)
      bad_value("the low-latency kernels take 1 to " + std::to_string(kMaxTopk) + " top-k slots, got " +
                std::to_string(num_topk));
    const HalfLayout lay = half_layout(max_tokens, hidden, num_ranks_, num_experts);
    if (2 * lay.half_bytes > num_bytes_)
      bad_value("num_rdma_bytes=" + std::to_string(num_bytes_) + " is too small for " + std::to_string(max_tokens) +
                " tokens per rank, hidden " + std::to_string(hidden) + ", " + std::to_string(num_experts) +
                " experts: get_low_latency_rdma_size_hint gives " + std::to_string(2 * lay.half_bytes));
    auto p = std::make_unique<Plan>();
    p->max_tokens = max_tokens;
    p->hidden = hidden;
    p->num_experts = num_experts;
    p->num_topk = num_topk;
    p->local = num_experts / num_ranks_;
    p->rows = num_ranks_ * max_tokens;
    p->layout = lay;
    for (int f = 0; f < 8; ++f)
      p->signatures[f] = dispatch_signature(hidden, max_tokens, num_experts, num_topk, f & 1, f & 2, f & 4);
    // The dedup dispatch and the per-rank combine store into peers over NVLink and need two local
    // experts (with one, a per-expert message or row is already one per rank).
    p->dedup_dispatch = nvlink_all_ && p->local >= 2;
    p->per_rank_ok = nvlink_all_ && p->local >= 2;
    plans_.push_back(std::move(p));
    return plans_.back().get();
  }

  bool same_layout(const Plan& p) const {
    return layout_set_ && layout_[0] == p.max_tokens && layout_[1] == p.hidden && layout_[2] == p.num_experts;
  }
  void set_layout(const Plan& p) {
    layout_ = {p.max_tokens, p.hidden, p.num_experts};
    layout_set_ = true;
  }

  // A layout change (docs/low_latency.md, "Layout change"): the backend's layout_round_(maxT, hidden, experts,
  // zeroed) around the clear. Each call synchronises the device and all-gathers every rank's new layout under the
  // Buffer's deadline (moe_dispatcher/compiled/low_latency.py, layout_round: the ordering argument). The first
  // raises SignatureMismatch on every rank when the ranks' layouts differ, before anything is cleared (this
  // runtime then keeps its layout), or a timeout naming the ranks that never came; after the second, every
  // peer's signal words are zero, so this rank's next kernel may store into them.
  void clean_layout(const Plan& p) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_).stream();
    layout_round_(p.max_tokens, p.hidden, p.num_experts, false);  // every rank agrees and is done with the buffer
    for (int h = 0; h < 2; ++h) {
      uint8_t* begin = static_cast<uint8_t*>(raw_.data_ptr()) + h * p.layout.half_bytes + p.layout.signal_off;
      MOE_CUDA_CHECK(cudaMemsetAsync(begin, 0, p.layout.signal_bytes, stream));
    }
    MOE_CUDA_CHECK(cudaMemsetAsync(workspace_.data_ptr(), 0, kWorkspaceInts * sizeof(int), stream));
    MOE_CUDA_CHECK(cudaMemsetAsync(signature_words_, 0, 2 * kMaxRanks * sizeof(uint64_t), stream));
    layout_round_(p.max_tokens, p.hidden, p.num_experts, true);  // nobody sends before every peer's signals are zero
    set_layout(p);
  }

  // Take the next buffer half for a new call (the layout's hooks were checked by plan()).
  int start_call(const Plan&) {
    const int half = next_half_;
    next_half_ ^= 1;
    half_owner_[half] = ++calls_;
    // A pending hook whose half was just taken is stale: it can no longer block anything.
    std::vector<uint64_t> alive;
    for (uint64_t id : pending_)
      if (id == half_owner_[0] || id == half_owner_[1]) alive.push_back(id);
    pending_.swap(alive);
    return half;
  }

  Common common(const Plan& p, int half, int kind) {
    Common c{};
    c.buffer = static_cast<uint8_t*>(raw_.data_ptr());
    c.peer_bases = reinterpret_cast<const uint64_t*>(peer_bases_.data_ptr<int64_t>());
    c.workspace = workspace_.data_ptr<int>();
    c.half_offset = half * p.layout.half_bytes;
    c.rank = rank_;
    c.num_ranks = num_ranks_;
    c.num_experts = p.num_experts;
    c.max_tokens = p.max_tokens;
    c.hidden = p.hidden;
    c.num_blocks = num_blocks_;
    c.dedup_dispatch = p.dedup_dispatch;
    c.per_rank_combine = false;
    c.timeout_ns = timeout_ns_;
    c.timeout = device_timeout_;
    c.peer_aborts = peer_aborts_;
    abort_.clear_if_posted();  // every launch asks for its Common first
    c.trace = traces_[kind][half];
    if (c.trace != nullptr) trace_last_[kind] = {half, p.num_experts};
    return c;
  }

  // Launch the call: both phases on the current stream; or on the comm stream after it waited for the
  // current one, with an event (async_finish); or the send phase now and a hook for the receive phase.
  std::pair<py::object, py::object> launch(bool dispatch, const Common& c, const DispatchArgs* da,
                                           const CombineArgs* ca, int half, bool async_finish,
                                           bool return_recv_hook, std::vector<at::Tensor> keep) {
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_);
    auto run = [&](int phases, cudaStream_t stream) {
      if (dispatch) {
        launch_dispatch(c, *da, phases, stream);
      } else {
        launch_combine(c, *ca, phases, stream);
      }
    };
    if (return_recv_hook) {
      run(kPhaseSend, current.stream());
      auto r = std::make_shared<PendingReceive>();
      r->rt = shared_from_this();
      r->dispatch = dispatch;
      r->c = c;
      if (da != nullptr) r->da = *da;
      if (ca != nullptr) r->ca = *ca;
      r->call = calls_;
      r->half = half;
      r->keep = std::move(keep);
      pending_.push_back(calls_);
      return {no_event_, py::cast(std::move(r))};
    }
    if (!async_finish) {
      run(kPhaseSend | kPhaseRecv, current.stream());
      return {no_event_, py::none()};
    }
    // async_finish: outputs were allocated on the current stream (which uses them next); the inputs and
    // outputs are recorded on the comm stream, so freeing them before the event fires cannot hand
    // their blocks to other work while the kernel runs, and the EventOverlap keeps them referenced.
    // Re-recording one event is safe: a wait captures the event's state when it is enqueued.
    before_.record(current);
    before_.block(*comm_);
    run(kPhaseSend | kPhaseRecv, comm_->stream());
    py::list extra;
    for (auto& t : keep) {
      t.record_stream(*comm_);
      extra.append(t);
    }
    return {event_cls_(py::cast(std::make_unique<CommEvent>(*comm_)), extra), py::none()};
  }

  // The DispatchState of a handle this runtime made (held: its backend_state, which owns it, for the call).
  const DispatchState& state_of(const py::object& handle, py::object& held) const {
    constexpr auto kFields = static_cast<Py_ssize_t>(kHandleFields.size());
    if (Py_TYPE(handle.ptr()) == handle_type_ && PyTuple_GET_SIZE(handle.ptr()) == kFields) {
      held = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(handle.ptr(), kHandleStateField));
    } else {
      held = handle.attr("backend_state");
    }
    if (!PyCapsule_IsValid(held.ptr(), kStateName))
      throw py::type_error("handle must be a LowLatencyHandle returned by this Buffer's low_latency_dispatch");
    const auto* s = static_cast<const DispatchState*>(PyCapsule_GetPointer(held.ptr(), kStateName));
    if (s->owner != id_)
      fail("handle was made by another Buffer; pass the handle this Buffer's dispatch returned");
    return *s;
  }

  // A LowLatencyHandle of a dispatch of plan p with t tokens, with src_info and layout_range as its tensors, owning
  // `state` (its backend_state): what its type's __new__ (tuple.__new__ of the type and the fields in order) builds,
  // with the constant fields' objects made once.
  py::object make_handle(const Plan& p, int t, const at::Tensor& src_info, const at::Tensor& layout_range,
                         std::unique_ptr<DispatchState> state) const {
    py::object capsule = py::reinterpret_steal<py::object>(PyCapsule_New(state.get(), kStateName, free_state));
    if (!capsule) throw py::error_already_set();
    state.release();  // the capsule owns it now
    std::array<py::object, kHandleFields.size()> fields{
        py::cast(src_info), py::cast(layout_range), py::int_(p.max_tokens), py::int_(p.hidden),
        py::int_(p.num_experts), backend_name_, buffer_token_, std::move(capsule), py::int_(t)};
    if constexpr (offsetof(PyTupleObject, ob_item) == sizeof(PyVarObject)) {
      // Tuples without a hash cache: tuple.__new__ of a subtype is the type's tp_alloc (zeroed, GC-tracked; a
      // null item is skipped by the collector) and the items set in place, which is done here directly (no
      // argument tuple, no copy of a fields tuple). The type has tuple's layout (check_handle_type).
      PyObject* handle = handle_type_->tp_alloc(handle_type_, static_cast<Py_ssize_t>(fields.size()));
      if (handle == nullptr) throw py::error_already_set();
      for (size_t i = 0; i < fields.size(); ++i)
        PyTuple_SET_ITEM(handle, static_cast<Py_ssize_t>(i), fields[i].release().ptr());
      return py::reinterpret_steal<py::object>(handle);
    } else {
      // Tuples that cache their hash: tuple.__new__ itself (it resets the cache, which a zeroed object lacks).
      py::tuple items(fields.size());
      for (size_t i = 0; i < fields.size(); ++i)
        PyTuple_SET_ITEM(items.ptr(), static_cast<Py_ssize_t>(i), fields[i].release().ptr());
      const py::tuple args = py::make_tuple(items);
      py::object handle =
          py::reinterpret_steal<py::object>(PyTuple_Type.tp_new(handle_type_, args.ptr(), nullptr));
      if (!handle) throw py::error_already_set();
      return handle;
    }
  }

  // The handle type must be a tuple type with LowLatencyHandle's fields in order (make_handle, state_of).
  static void check_handle_type(const py::object& cls) {
    bool ok = PyType_Check(cls.ptr()) &&
              PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(cls.ptr()), &PyTuple_Type) &&
              py::hasattr(cls, "_fields");
    if (ok) {
      const py::tuple fields = cls.attr("_fields");
      ok = fields.size() == kHandleFields.size();
      for (size_t i = 0; ok && i < kHandleFields.size(); ++i)
        ok = fields[i].cast<std::string>() == kHandleFields[i];
    }
    // tuple's own instance layout (no __dict__, no slots of its own): make_handle builds it as tuple.__new__ does.
    const auto* type = reinterpret_cast<const PyTypeObject*>(cls.ptr());
    ok = ok && type->tp_basicsize == PyTuple_Type.tp_basicsize && type->tp_itemsize == PyTuple_Type.tp_itemsize &&
         type->tp_dictoffset == 0;
    MOE_CHECK(ok, "low_latency: handle_cls must be a NamedTuple with LowLatencyHandle's fields in order");
  }

  static inline std::atomic<uint64_t> next_id_{1};
  const uint64_t id_ = next_id_++;
  at::Tensor raw_, peer_bases_, workspace_, trace_;
  size_t num_bytes_;
  int rank_, num_ranks_, device_, num_blocks_;
  uint64_t timeout_ns_;
  bool rank_partials_, nvlink_all_ = true, alive_ = true;
  std::optional<c10::cuda::CUDAStream> comm_;
  c10::cuda::CUDAEvent before_;  // comm stream waits for the current one (async_finish)
  TimeoutRecord* host_timeout_ = nullptr;
  TimeoutRecord* device_timeout_ = nullptr;
  SignatureRecord* host_mismatch_ = nullptr;
  SignatureRecord* device_mismatch_ = nullptr;
  uint64_t* signature_words_ = nullptr;  // this PE's [2][kMaxRanks] (low_latency.h), after the abort bytes
  bool mismatch_ = false;                // a SignatureRecord was seen: every later call raises it
  const uint8_t* peer_aborts_ = nullptr;  // this PE's abort bytes (after the two halves of the symmetric buffer)
  PeerAbort abort_;                       // this PE's byte on every peer
  std::string broken_;
  std::vector<std::unique_ptr<Plan>> plans_;
  Plan* last_ = nullptr;
  std::array<int, 3> layout_{};
  bool layout_set_ = false;
  int next_half_ = 0;
  uint64_t calls_ = 0;
  std::array<uint64_t, 2> half_owner_{};
  std::vector<uint64_t> pending_;  // call ids whose hook was returned and not called yet
  std::array<std::array<unsigned long long*, 2>, kTraceKinds> traces_{};
  std::array<std::pair<int, int>, kTraceKinds> trace_last_{{{-1, 0}, {-1, 0}}};
  py::object handle_cls_, event_cls_, no_event_, layout_round_, timeout_message_, signature_error_;
  PyTypeObject* handle_type_ = nullptr;          // handle_cls_ (check_handle_type)
  py::object backend_name_, buffer_token_;  // the handles' constant fields

 public:
  // For the hook: the stale / already-called rules, then the receive phase on the current stream.
  void receive(PendingReceive& r) {
    check_usable();
    if (r.done) fail("this low-latency hook was already called");
    if (half_owner_[r.half] != r.call)
      fail("stale low-latency hook: its buffer half was reused by a later call; call each hook before making "
           "two more low-latency calls");
    const DeviceScope scope(static_cast<c10::DeviceIndex>(device_));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_).stream();
    if (r.dispatch) {
      launch_dispatch(r.c, r.da, kPhaseRecv, stream);
    } else {
      launch_combine(r.c, r.ca, kPhaseRecv, stream);
    }
    r.done = true;
    r.keep.clear();
    std::vector<uint64_t> left;
    for (uint64_t id : pending_)
      if (id != r.call) left.push_back(id);
    pending_.swap(left);
  }
};

// ---------------------------------------------------------------------------- the hot calls
// Runtime.dispatch / Runtime.combine as METH_FASTCALL functions (bindings/fast_call.h: what pybind11's dispatcher
// would cost per call), each bound to a capsule that owns a reference to its runtime (the function's self).
constexpr const char* kBoundName = "moe_dispatcher.low_latency.Runtime";
void free_bound(PyObject* capsule) {
  delete static_cast<std::shared_ptr<Runtime>*>(PyCapsule_GetPointer(capsule, kBoundName));
}
Runtime& bound_runtime(PyObject* self) {
  return **static_cast<std::shared_ptr<Runtime>*>(PyCapsule_GetPointer(self, kBoundName));
}

PyObject* dispatch_call(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  namespace f = fast_call;
  return f::run([&] {
    f::expect_args(nargs, 11, "dispatch");
    // Converted in order (a call's arguments are evaluated in no set order): the first bad one is named.
    const at::Tensor& x = f::tensor(a[0], "x");
    const at::Tensor& topk_idx = f::tensor(a[1], "topk_idx");
    const int64_t max_tokens = f::integer(a[2], "num_max_dispatch_tokens_per_rank");
    const int64_t num_experts = f::integer(a[3], "num_experts");
    const OptTensor cum_stats = f::optional_tensor(a[4], "cumulative_local_expert_recv_stats");
    const OptTensor wait_stats = f::optional_tensor(a[5], "dispatch_wait_recv_cost_stats");
    const bool use_fp8 = f::flag(a[6], "use_fp8"), round_scale = f::flag(a[7], "round_scale");
    const bool use_ue8m0 = f::flag(a[8], "use_ue8m0"), async_finish = f::flag(a[9], "async_finish");
    const bool return_recv_hook = f::flag(a[10], "return_recv_hook");
    return bound_runtime(self).dispatch(x, topk_idx, max_tokens, num_experts, cum_stats, wait_stats, use_fp8,
                                        round_scale, use_ue8m0, async_finish, return_recv_hook);
  });
}

PyObject* combine_call(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  namespace f = fast_call;
  return f::run([&] {
    f::expect_args(nargs, 9, "combine");
    const at::Tensor& x = f::tensor(a[0], "x");
    const at::Tensor& topk_idx = f::tensor(a[1], "topk_idx");
    const at::Tensor& topk_weights = f::tensor(a[2], "topk_weights");
    const py::object handle = py::reinterpret_borrow<py::object>(a[3]);
    const bool zero_copy = f::flag(a[4], "zero_copy"), async_finish = f::flag(a[5], "async_finish");
    const bool return_recv_hook = f::flag(a[6], "return_recv_hook");
    const OptTensor out = f::optional_tensor(a[7], "out");
    const OptTensor wait_stats = f::optional_tensor(a[8], "combine_wait_recv_cost_stats");
    return bound_runtime(self).combine(x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook,
                                       out, wait_stats);
  });
}

PyMethodDef kDispatchDef{
    "dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(dispatch_call)), METH_FASTCALL,
    "dispatch(x, topk_idx, max_tokens, num_experts, cum_stats, wait_stats, use_fp8, round_scale, use_ue8m0, "
    "async_finish, return_recv_hook) -> (recv_x, recv_count, handle, EventOverlap, hook or None)"};
PyMethodDef kCombineDef{
    "combine", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(combine_call)), METH_FASTCALL,
    "combine(x, topk_idx, topk_weights, handle, zero_copy, async_finish, return_recv_hook, out, wait_stats) "
    "-> (combined_x, EventOverlap, hook or None)"};

// A new function object of `def` bound to `rt`.
py::object bound_call(PyMethodDef& def, const std::shared_ptr<Runtime>& rt) {
  auto owner = std::make_unique<std::shared_ptr<Runtime>>(rt);
  py::object capsule = py::reinterpret_steal<py::object>(PyCapsule_New(owner.get(), kBoundName, free_bound));
  if (!capsule) throw py::error_already_set();
  owner.release();  // the capsule owns it now
  py::object fn = py::reinterpret_steal<py::object>(PyCFunction_New(&def, capsule.ptr()));
  if (!fn) throw py::error_already_set();
  return fn;
}

}  // namespace

void register_low_latency(py::module_& parent) {
  py::module_ m = parent.def_submodule("low_latency", "Low-latency (NVSHMEM) dispatch/combine runtime");
  m.attr("MAX_TOPK") = kMaxTopk;
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_EXPERTS") = kMaxExperts;
  m.attr("MAX_HIDDEN") = kMaxHidden;
  m.attr("WORKSPACE_INTS") = kWorkspaceInts;
  m.attr("ABORT_BYTES") = kMaxAbortRanks;  // the abort bytes after the two halves (timeout_record.h)
  // Bytes of the allocation from the abort bytes on: the abort bytes, then the signature words (low_latency.h).
  m.attr("CONTROL_BYTES") = kControlBytes;
  m.attr("MAX_TOKENS_PER_RANK") = kMaxTokensPerRank;
  // The packing the kernels carry (low_latency.h); compiled/low_latency.py decodes it (tests compare the two).
  m.def("dispatch_signature", &dispatch_signature, py::arg("hidden"), py::arg("max_tokens"), py::arg("num_experts"),
        py::arg("num_topk"), py::arg("use_fp8"), py::arg("round_scale"), py::arg("use_ue8m0"));
  // Phase trace (low_latency.h, kTrace*): one record is TRACE_WORDS int64 words; events of block b at
  // [b * TRACE_EVENTS + index], the SM id at TRACE_SMID, per-pair words from TRACE_PAIR_{SENT,WAIT,SEEN}.
  m.attr("TRACE_MAX_BLOCKS") = kTraceMaxBlocks;
  m.attr("TRACE_EVENTS") = kTraceEvents;
  m.attr("TRACE_SMID") = kTraceSmid;
  m.attr("TRACE_PAIR_SENT") = kTracePairSent;
  m.attr("TRACE_PAIR_WAIT") = kTracePairWait;
  m.attr("TRACE_PAIR_SEEN") = kTracePairSeen;
  m.attr("TRACE_WORDS") = kTraceWords;
  {
    py::dict d, c;  // event name -> index, in the order the kernels pass them
    d["entry"] = kTraceDEntry;
    d["counted"] = kTraceDCounted;
    d["cast_done"] = kTraceDCastDone;
    d["stores_issued"] = kTraceDStoresIssued;
    d["signaled"] = kTraceDSignaled;
    d["recv_entry"] = kTraceDRecvEntry;
    d["first_arrival"] = kTraceDFirstArrival;
    d["last_arrival"] = kTraceDLastArrival;
    d["copy_done"] = kTraceDCopyDone;
    d["exit"] = kTraceDExit;
    c["entry"] = kTraceCEntry;
    c["sends_issued"] = kTraceCSendsIssued;
    c["flags_up"] = kTraceCFlagsUp;
    c["recv_entry"] = kTraceCRecvEntry;
    c["wait_done"] = kTraceCWaitDone;
    c["reduce_done"] = kTraceCReduceDone;
    c["exit"] = kTraceCExit;
    c["routed"] = kTraceCRouted;
    m.attr("TRACE_DISPATCH_EVENTS") = d;
    m.attr("TRACE_COMBINE_EVENTS") = c;
  }

  py::class_<PendingReceive, std::shared_ptr<PendingReceive>>(
      m, "ReceiveHook", "hook() of a return_recv_hook call: launches the receive phase on the current stream.")
      .def("__call__", [](PendingReceive& r) { r.rt->receive(r); });

  py::class_<Runtime, std::shared_ptr<Runtime>>(m, "LowLatencyRuntime",
                                                "The low-latency calls of one backend (see the file comment).")
      .def(py::init<const at::Tensor&, size_t, const std::vector<uint64_t>&, int, int, int, int, uint64_t, const py::object&,
                    bool, const OptTensor&, py::object, py::object, py::object, py::object, py::object, int64_t,
                    uint64_t, const std::vector<uint64_t>&, py::object>(),
           py::arg("buffer"), py::arg("num_bytes"), py::arg("peer_bases"), py::arg("rank"), py::arg("num_ranks"),
           py::arg("device"), py::arg("num_blocks"), py::arg("timeout_ns"), py::arg("comm_stream"),
           py::arg("rank_partials"), py::arg("trace"), py::arg("handle_cls"), py::arg("event_cls"),
           py::arg("no_event"), py::arg("layout_round"), py::arg("timeout_message"), py::arg("buffer_token"),
           py::arg("peer_aborts"), py::arg("abort_targets"), py::arg("signature_error"))
      // The calls, positional arguments only (their signatures: kDispatchDef, kCombineDef); each read gives a new
      // function object bound to this runtime: the backend keeps one.
      .def_property_readonly("dispatch",
                             [](const std::shared_ptr<Runtime>& rt) { return bound_call(kDispatchDef, rt); })
      .def_property_readonly("combine",
                             [](const std::shared_ptr<Runtime>& rt) { return bound_call(kCombineDef, rt); })
      .def("next_combine_buffer", &Runtime::next_combine_buffer, py::arg("handle"))
      .def("clean", &Runtime::clean, py::arg("max_tokens"), py::arg("hidden"), py::arg("num_experts"))
      .def("set_rank_partials", &Runtime::set_rank_partials)
      .def_property_readonly("rank_partials", &Runtime::rank_partials)
      .def("timeout_info", &Runtime::timeout_info)
      .def("signature_info", &Runtime::signature_info)
      .def("check_usable", &Runtime::check_usable)
      .def("destroy", &Runtime::destroy)
      .def("post_abort", &Runtime::post_abort)
      .def("trace_last", &Runtime::trace_last, py::arg("kind"))
      .def("kernels_for", &Runtime::kernels_for, py::arg("max_tokens"), py::arg("hidden"), py::arg("num_experts"))
      .def_property_readonly("num_blocks", &Runtime::num_blocks)
      .def_property_readonly("nvlink_all", &Runtime::nvlink_all);
}

}  // namespace moe_ep
