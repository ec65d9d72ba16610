// Python bindings of the intranode (NVLink, CUDA IPC) backend: the IpcBuffer and the kernel
// launchers. Glue only. Tensors cross as raw device addresses (ints) and streams as cudaStream_t
// ints, so this file needs no torch headers; moe_dispatcher/compiled/intranode.py allocates and
// validates every tensor before it calls in here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bindings.h"
#include "ipc_bindings.h"
#include "kernels/common/layout.h"
#include "kernels/intranode/protocol.h"
#include "runtime/cuda_check.h"
#include "runtime/ipc_buffer.h"

namespace py = pybind11;

namespace moe_dispatcher {
namespace {

using namespace intranode;

std::string phase_name(int phase) {
  switch (phase) {
    case kPhaseNotify: return "notify (barrier before dispatch)";
    case kPhaseDispatchSend: return "dispatch (sender waiting for free ring slots)";
    case kPhaseDispatchRecv: return "dispatch (receiver waiting for rows)";
    case kPhaseCombineSend: return "combine (sender waiting for free ring slots)";
    case kPhaseCombineRecv: return "combine (receiver waiting for rows)";
    case kPhaseDrain: return "drain (sender waiting for a peer to finish the previous call)";
    default: return "unknown phase " + std::to_string(phase);
  }
}

// (status, phase name, waiting rank, peer) of the first timeout this rank recorded, or None.
py::object timeout_info(const IpcBuffer& b) { return mailbox_timeout_info(b, phase_name); }

// Spins on the mailbox until notify call `seq` has published its results. Returns
// (num_recv, flags), or (-1, 0) if a timeout was recorded. The GIL is released while spinning.
py::tuple wait_notify(const IpcBuffer& b, int seq, double timeout_s) {
  const volatile Mailbox* box = b.host_mailbox();
  MOE_CHECK(box != nullptr, "buffer destroyed");
  bool timed_out = false, host_timeout = false;
  {
    py::gil_scoped_release release;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    long spins = 0;
    while (box->seq != seq) {
      if (box->timeout.status != 0) {
        timed_out = true;
        break;
      }
      if ((++spins & 1023) == 0) {
        if (std::chrono::steady_clock::now() > deadline) {
          host_timeout = true;
          break;
        }
      }
    }
    if (!timed_out && box->timeout.status != 0) timed_out = true;
  }
  if (host_timeout) {
    throw std::runtime_error("moe_dispatcher intranode: rank " + std::to_string(b.rank()) +
                             " timed out in notify: the host waited " + std::to_string(timeout_s) +
                             " s for the receive counts (the stream may be blocked by earlier work)");
  }
  if (timed_out) return py::make_tuple(-1, 0);
  return py::make_tuple(static_cast<int>(box->num_recv), static_cast<int>(box->flags));
}

// (rank, rows, num_worst_tokens) of the first num_worst_tokens overflow since the last call, or None.
py::object take_worst_overflow(IpcBuffer& b) {
  volatile Mailbox* box = b.host_mailbox();
  if (box->overflow_rows == 0) return py::none();
  py::tuple out = py::make_tuple(static_cast<int>(box->overflow_rank), static_cast<int>(box->overflow_rows),
                                 static_cast<int>(box->overflow_worst));
  box->overflow_rows = 0;
  return out;
}

std::vector<int> expert_counts(const IpcBuffer& b, int n) {
  MOE_CHECK(n >= 0 && n <= kMaxLocalExperts, "too many local experts");
  const volatile Mailbox* box = b.host_mailbox();
  std::vector<int> out(n);
  for (int i = 0; i < n; ++i) out[i] = box->expert_counts[i];
  return out;
}

void layout(uintptr_t topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
            uintptr_t num_tokens_per_rank, uintptr_t num_tokens_per_expert, uintptr_t is_token_in_rank,
            uintptr_t stream) {
  // One NVLink domain: no per-domain counts.
  DispatchLayoutArgs a{ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_experts, num_ranks, num_ranks,
                       ptr<int>(num_tokens_per_rank), nullptr, ptr<int>(num_tokens_per_expert),
                       ptr<bool>(is_token_in_rank)};
  launch_dispatch_layout(a, stream_of(stream));
}

void notify(const IpcBuffer& b, uint64_t timeout_ns, uintptr_t is_token_in_rank, uintptr_t num_tokens_per_rank,
            uintptr_t num_tokens_per_expert, int num_tokens, int num_experts, int num_channels,
            int expert_alignment, int num_worst_tokens, int seq, uintptr_t rank_prefix_matrix,
            uintptr_t recv_channel_offset, uintptr_t stream, uintptr_t em_layout) {
  NotifyArgs a{};
  a.em_layout = ptr<int>(em_layout);
  a.c = b.common(timeout_ns);
  set_notify_counts(a, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, num_tokens, num_experts,
                    num_channels, expert_alignment, num_worst_tokens, seq, rank_prefix_matrix, recv_channel_offset);
  launch_notify(a, stream_of(stream));
}

// The ring arguments that direct calls and plans (below) share: checked and filled in one place.
DispatchArgs ring_dispatch_args(const IpcBuffer& b, uint64_t timeout_ns, uintptr_t is_token_in_rank,
                                uintptr_t recv_channel_offset, int num_tokens, int hidden_bytes, int num_scales,
                                int num_rows, int pad_rows, int num_channels, int chunk, int num_slots,
                                int slot_bytes, int protocol) {
  DispatchArgs a{};
  a.c = b.common(timeout_ns);
  MOE_CHECK(static_cast<size_t>(num_channels) * num_slots * slot_bytes <= a.c.src_block_bytes,
            "NVLink buffer too small for this config");
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.recv_channel_offset = ptr<const int>(recv_channel_offset);
  a.num_tokens = num_tokens;
  a.hidden_bytes = hidden_bytes;
  a.num_scales = num_scales;
  a.num_topk = 0;
  a.experts_per_rank = 1;
  a.num_rows = num_rows;
  a.pad_rows = pad_rows;
  a.num_channels = num_channels;
  a.chunk = chunk;
  a.num_slots = num_slots;
  a.slot_bytes = slot_bytes;
  return a;
}

CombineArgs ring_combine_args(const IpcBuffer& b, uint64_t timeout_ns, uintptr_t is_token_in_rank,
                              uintptr_t recv_channel_offset, int dtype, int num_tokens, int hidden, int num_topk,
                              int num_x_rows, int num_channels, int chunk, int num_slots, int slot_bytes,
                              int protocol) {
  CombineArgs a{};
  MOE_CHECK(num_slots - chunk >= 32, "combine needs num_max_nvl_chunked_recv_tokens >= send tokens + 32");
  a.c = b.common(timeout_ns);
  MOE_CHECK(static_cast<size_t>(num_channels) * num_slots * slot_bytes <= a.c.src_block_bytes,
            "NVLink buffer too small for this config");
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.recv_channel_offset = ptr<const int>(recv_channel_offset);
  a.dtype = dtype;
  a.num_tokens = num_tokens;
  a.hidden = hidden;
  a.num_topk = num_topk;
  a.num_x_rows = num_x_rows;
  a.num_channels = num_channels;
  a.chunk = chunk;
  a.num_slots = num_slots;
  a.slot_bytes = slot_bytes;
  return a;
}

// The tensors every dispatch / combine launch takes, plain or through a plan.
void set_dispatch_tensors(DispatchArgs& a, uintptr_t x, uintptr_t scales, uintptr_t recv_x, uintptr_t recv_scales) {
  a.x = ptr<const uint8_t>(x);
  a.scales = ptr<const int32_t>(scales);
  a.recv_x = ptr<uint8_t>(recv_x);
  a.recv_scales = ptr<int32_t>(recv_scales);
}

void set_combine_tensors(CombineArgs& a, uintptr_t x, uintptr_t topk_weights, uintptr_t bias0, uintptr_t bias1,
                         uintptr_t out, uintptr_t out_topk_weights) {
  a.x = ptr<const uint8_t>(x);
  a.topk_weights = ptr<const float>(topk_weights);
  a.bias0 = ptr<const uint8_t>(bias0);
  a.bias1 = ptr<const uint8_t>(bias1);
  a.out = ptr<uint8_t>(out);
  a.out_topk_weights = ptr<float>(out_topk_weights);
}

void dispatch(const IpcBuffer& b, uint64_t timeout_ns, uintptr_t x, uintptr_t scales, uintptr_t topk_idx,
              uintptr_t topk_weights, uintptr_t is_token_in_rank, uintptr_t recv_channel_offset, uintptr_t recv_x,
              uintptr_t recv_scales, uintptr_t recv_topk_idx, uintptr_t recv_topk_weights, uintptr_t recv_src_idx,
              int num_tokens, int hidden_bytes, int num_scales, int num_topk, int experts_per_rank, int num_rows,
              int pad_rows, int num_channels, int chunk, int num_slots, int slot_bytes, uintptr_t stream, int em_mode,
              uintptr_t pair_rank, uintptr_t em_layout, uintptr_t em_x, uintptr_t em_scales, uintptr_t em_weights,
              uintptr_t em_pair_row, uintptr_t em_pair_slot, uintptr_t em_inverse, int em_topk, int em_rows,
              int protocol) {
  DispatchArgs a = ring_dispatch_args(b, timeout_ns, is_token_in_rank, recv_channel_offset, num_tokens, hidden_bytes,
                                      num_scales, num_rows, pad_rows, num_channels, chunk, num_slots, slot_bytes,
                                      protocol);
  MOE_CHECK(em_mode == 0, "the dispatch kernel is rank-major only (expert-major: em_permute after it)");
  set_dispatch_tensors(a, x, scales, recv_x, recv_scales);
  a.topk_idx = ptr<const int64_t>(topk_idx);
  a.topk_weights = ptr<const float>(topk_weights);
  a.recv_topk_idx = ptr<int64_t>(recv_topk_idx);
  a.recv_topk_weights = ptr<float>(recv_topk_weights);
  a.recv_src_idx = ptr<int>(recv_src_idx);
  a.num_topk = num_topk;
  a.experts_per_rank = experts_per_rank;
  launch_dispatch(a, stream_of(stream));
}

void combine(const IpcBuffer& b, uint64_t timeout_ns, uintptr_t x, uintptr_t topk_weights, uintptr_t bias0,
             uintptr_t bias1, uintptr_t is_token_in_rank, uintptr_t recv_channel_offset, uintptr_t out,
             uintptr_t out_topk_weights, int dtype, int num_tokens, int hidden, int num_topk, int num_x_rows,
             int num_channels,
             int chunk, int num_slots, int slot_bytes, uintptr_t stream, uintptr_t em_inverse, uintptr_t em_weights,
             uintptr_t em_topk_weights, int em_topk, int protocol) {
  CombineArgs a = ring_combine_args(b, timeout_ns, is_token_in_rank, recv_channel_offset, dtype, num_tokens, hidden,
                                    num_topk, num_x_rows, num_channels, chunk, num_slots, slot_bytes, protocol);
  MOE_CHECK(em_inverse == 0, "the combine kernel is rank-major only (expert-major: em_unpermute before it)");
  set_combine_tensors(a, x, topk_weights, bias0, bias1, out, out_topk_weights);
  launch_combine(a, stream_of(stream));
}

// Split expert-major dispatch, local pass (em_permute.cu): received rows x -> expert-major rows em_x along the
// fresh call's positions (fresh = 1: from recv_topk_idx + pair_rank + layout, recording the tables) or the
// handle's em_inverse (fresh = 0); pad_blocks blocks zero the padding rows.
void em_permute(uintptr_t x, uintptr_t scales, uintptr_t recv_topk_idx, uintptr_t recv_topk_weights,
                uintptr_t pair_rank, uintptr_t layout, uintptr_t received, uintptr_t em_x, uintptr_t em_scales,
                uintptr_t em_weights, uintptr_t em_pair_row, uintptr_t em_pair_slot, uintptr_t em_inverse,
                uintptr_t recv_src_idx, int fresh,
                int num_rows, int hidden_bytes, int num_scales, int num_topk, int num_ranks, int num_local,
                int expert_alignment, int em_rows, int pad_blocks, uintptr_t stream) {
  MOE_CHECK(layout != 0 && received != 0 && em_inverse != 0 && num_topk > 0 && num_topk <= kMaxTopk,
            "em_permute: needs the layout, the received count, the inverse table and 1..MAX_TOPK slots");
  MOE_CHECK(!fresh || (recv_topk_idx != 0 && pair_rank != 0 && em_pair_row != 0 && em_pair_slot != 0 &&
                       recv_src_idx != 0 && (em_weights == 0 || recv_topk_weights != 0)),
            "em_permute: a fresh call needs the received top-k, the pair ranks, pair_row/pair_slot and the "
            "source indices");
  MOE_CHECK((scales != 0) == (em_scales != 0), "em_permute: scales and em_scales go together");
  MOE_CHECK(hidden_bytes % 16 == 0 && expert_alignment >= 1 && num_rows >= 0 && em_rows >= 0 && pad_blocks >= 0,
            "em_permute: bad geometry");
  MOE_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks && num_local >= 1 && num_local <= kMaxLocalExperts,
            "em_permute: bad ranks or local experts");
  EmPermuteArgs a{};
  a.x = ptr<const uint8_t>(x);
  a.scales = ptr<const int32_t>(scales);
  a.recv_topk_idx = ptr<const int64_t>(recv_topk_idx);
  a.recv_topk_weights = ptr<const float>(recv_topk_weights);
  a.pair_rank = ptr<const int>(pair_rank);
  a.layout = ptr<const int>(layout);
  a.received = ptr<const int>(received);
  a.fresh = fresh ? 1 : 0;
  a.num_rows = num_rows;
  a.hidden_bytes = hidden_bytes;
  a.num_scales = num_scales;
  a.num_topk = num_topk;
  a.num_ranks = num_ranks;
  a.num_local = num_local;
  a.expert_alignment = expert_alignment;
  a.em_rows = em_rows;
  a.row_blocks = (num_rows + kEmRowsPerBlock - 1) / kEmRowsPerBlock;
  a.em_x = ptr<uint8_t>(em_x);
  a.em_scales = ptr<int32_t>(em_scales);
  a.em_weights = ptr<float>(em_weights);
  a.em_pair_row = ptr<int>(em_pair_row);
  a.em_pair_slot = ptr<int>(em_pair_slot);
  a.em_inverse = ptr<int>(em_inverse);
  a.recv_src_idx = ptr<int>(recv_src_idx);
  launch_em_permute(a, pad_blocks, stream_of(stream));
}

// Split expert-major combine, local pass (em_unpermute.cu): rank-major rows out [num_rows, hidden] (and
// out_topk_weights [num_rows, num_topk] when topk_weights is given) from expert-major rows x through inverse.
void em_unpermute(uintptr_t x, uintptr_t inverse, uintptr_t weights, uintptr_t topk_weights, uintptr_t received,
                  uintptr_t out, uintptr_t out_topk_weights, int dtype, int hidden, int num_rows, int num_topk,
                  uintptr_t stream) {
  MOE_CHECK(inverse != 0 && received != 0 && num_topk > 0 && num_topk <= kMaxTopk,
            "em_unpermute: needs the inverse table, the received count and 1..MAX_TOPK slots");
  MOE_CHECK((topk_weights != 0) == (out_topk_weights != 0),
            "em_unpermute: topk_weights and out_topk_weights go together");
  MOE_CHECK(dtype == kBf16 || dtype == kFp16 || dtype == kFp32, "em_unpermute: bad dtype");
  MOE_CHECK((hidden * (dtype == kFp32 ? 4 : 2)) % 16 == 0, "em_unpermute: rows must be a multiple of 16 bytes");
  EmUnpermuteArgs a{};
  a.x = ptr<const uint8_t>(x);
  a.inverse = ptr<const int>(inverse);
  a.weights = ptr<const float>(weights);
  a.topk_weights = ptr<const float>(topk_weights);
  a.received = ptr<const int>(received);
  a.out = ptr<uint8_t>(out);
  a.out_topk_weights = ptr<float>(out_topk_weights);
  a.dtype = dtype;
  a.hidden = hidden;
  a.num_rows = num_rows;
  a.num_topk = num_topk;
  launch_em_unpermute(a, stream_of(stream));
}

void pair_rank(uintptr_t topk_idx, int num_tokens, int num_topk, int num_experts, uintptr_t out,
               uintptr_t workspace, uintptr_t stream, uintptr_t row_limit) {
  MOE_CHECK(num_experts > 0 && num_experts <= kMaxLocalExperts * kMaxRanks, "pair_rank: too many experts");
  PairRankArgs a{ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_experts, ptr<int>(out), ptr<int>(workspace),
                 ptr<const int>(row_limit)};
  launch_pair_rank(a, stream_of(stream));
}

// ---------------------------------------------------------------------------------------------------------
// Cached calls (dispatch along a handle, combine): their arguments are the same from call to call except the
// tensors' addresses, so a plan fills them in once (DispatchPlan, CombinePlan) and each call passes only the
// addresses and the streams. moe_dispatcher/compiled/intranode.py builds a plan after the call's checks
// passed and keeps it with the handle; buffer.py reuses it while the call's inputs look the same.

// May the backend still launch? Not once the buffer is destroyed or a kernel recorded a timeout (sticky: the
// Buffer is unusable from then on). Plans return false instead of launching; the caller raises the reason.
// (The device writes the mailbox: read it through volatile, as timeout_info does.)
bool usable(const IpcBuffer& b) {
  if (!b.alive()) return false;
  const volatile Mailbox* box = b.host_mailbox();
  return box->timeout.status == 0;
}

// Orders a launch on the comm stream against the caller's stream with two events made once per backend
// (on the backend's device) and re-recorded by every call: a stream wait captures the event as it is when
// the wait is enqueued, so re-recording cannot affect waits already queued. `join` of a launch:
//   0  nothing (the caller already ordered the streams: it launches on the stream it made current);
//   1  the comm stream first waits for the work queued on the caller's stream so far (async_finish);
//   2  as 1, then the caller's stream waits for the launch (a synchronous call).
class StreamJoin {
 public:
  StreamJoin() {
    MOE_CUDA_CHECK(cudaGetDevice(&device_));
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&before_, cudaEventDisableTiming));
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&after_, cudaEventDisableTiming));
  }
  ~StreamJoin() {
    cudaEventDestroy(before_);
    cudaEventDestroy(after_);
  }
  StreamJoin(const StreamJoin&) = delete;
  StreamJoin& operator=(const StreamJoin&) = delete;

  template <typename Launch>
  void run(cudaStream_t comm, cudaStream_t caller, int join, Launch&& launch) const {
    MOE_CHECK(join >= 0 && join <= 2, "bad stream join");
    const DeviceGuard guard(device_);
    if (join >= 1) {
      MOE_CUDA_CHECK(cudaEventRecord(before_, caller));
      MOE_CUDA_CHECK(cudaStreamWaitEvent(comm, before_, 0));
    }
    launch();
    if (join == 2) {
      MOE_CUDA_CHECK(cudaEventRecord(after_, comm));
      MOE_CUDA_CHECK(cudaStreamWaitEvent(caller, after_, 0));
    }
  }

 private:
  // The streams and events live on the backend's device: launch there whatever device is current.
  struct DeviceGuard {
    explicit DeviceGuard(int device) {
      MOE_CUDA_CHECK(cudaGetDevice(&previous));
      if (previous != device) MOE_CUDA_CHECK(cudaSetDevice(device));
      switched = previous != device;
    }
    ~DeviceGuard() {
      if (switched) cudaSetDevice(previous);
    }
    int previous = 0;
    bool switched = false;
  };

  int device_ = 0;
  cudaEvent_t before_ = nullptr, after_ = nullptr;
};

// What a plan holds: the buffer (checked before every launch), the stream join, and the kernel's arguments with
// every field but the tensors' addresses filled in; `launch` of the derived plan sets those into a_ and calls run.
template <class Args, void (*Launch)(const Args&, cudaStream_t)>
class RingPlan {
 protected:
  RingPlan(const IpcBuffer& b, const StreamJoin& join, const Args& a) : a_(a), buffer_(&b), join_(&join) {}

  bool ready() const { return usable(*buffer_); }  // false: launch nothing, the caller raises the reason
  bool run(uintptr_t stream, uintptr_t caller, int join) {
    join_->run(stream_of(stream), stream_of(caller), join, [&] { Launch(a_, stream_of(stream)); });
    return true;
  }

  Args a_;

 private:
  const IpcBuffer* buffer_;
  const StreamJoin* join_;
};

// Dispatch along a handle's routing (no top-k, no source indices: what cached dispatch sends).
class DispatchPlan : public RingPlan<DispatchArgs, launch_dispatch> {
 public:
  DispatchPlan(const IpcBuffer& b, const StreamJoin& join, uint64_t timeout_ns, uintptr_t is_token_in_rank,
               uintptr_t recv_channel_offset, int num_tokens, int hidden_bytes, int num_scales, int num_rows,
               int pad_rows, int num_channels, int chunk, int num_slots, int slot_bytes, int protocol)
      : RingPlan(b, join,
                 ring_dispatch_args(b, timeout_ns, is_token_in_rank, recv_channel_offset, num_tokens, hidden_bytes,
                                    num_scales, num_rows, pad_rows, num_channels, chunk, num_slots, slot_bytes,
                                    protocol)) {}

  bool launch(uintptr_t x, uintptr_t scales, uintptr_t recv_x, uintptr_t recv_scales, uintptr_t stream,
              uintptr_t caller, int join) {
    if (!ready()) return false;
    set_dispatch_tensors(a_, x, scales, recv_x, recv_scales);
    return run(stream, caller, join);
  }
};

// Combine along a handle's routing.
class CombinePlan : public RingPlan<CombineArgs, launch_combine> {
 public:
  CombinePlan(const IpcBuffer& b, const StreamJoin& join, uint64_t timeout_ns, uintptr_t is_token_in_rank,
              uintptr_t recv_channel_offset, int dtype, int num_tokens, int hidden, int num_topk, int num_x_rows,
              int num_channels, int chunk, int num_slots, int slot_bytes, int protocol)
      : RingPlan(b, join,
                 ring_combine_args(b, timeout_ns, is_token_in_rank, recv_channel_offset, dtype, num_tokens, hidden,
                                   num_topk, num_x_rows, num_channels, chunk, num_slots, slot_bytes, protocol)) {}

  bool launch(uintptr_t x, uintptr_t topk_weights, uintptr_t bias0, uintptr_t bias1, uintptr_t out,
              uintptr_t out_topk_weights, uintptr_t stream, uintptr_t caller, int join) {
    if (!ready()) return false;
    set_combine_tensors(a_, x, topk_weights, bias0, bias1, out, out_topk_weights);
    return run(stream, caller, join);
  }
};

}  // namespace

void register_intranode(py::module_& m) {
  auto sub = m.def_submodule("intranode", "Normal-mode intranode kernels over NVLink (CUDA IPC)");
  sub.attr("MAX_RANKS") = kMaxRanks;
  sub.attr("MAX_CHANNELS") = kMaxChannels;
  sub.attr("MAX_LOCAL_EXPERTS") = kMaxLocalExperts;
  sub.attr("MAX_TOPK") = kMaxTopk;
  sub.attr("MAX_CHUNK") = kMaxChunk;
  sub.attr("RINGS_OFFSET") = kRingsOffset;
  sub.attr("FLAG_LAYOUT_MISMATCH") = kFlagLayoutMismatch;
  sub.attr("PAIR_RANK_TOKENS") = kPairRankTokens;
  sub.def("em_layout_words", [](int r, int l) { return ExpertMajorLayout::words(r, l); });
  sub.def("pair_rank", &pair_rank, py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"),
          py::arg("num_experts"), py::arg("out"), py::arg("workspace"), py::arg("stream"), py::arg("row_limit") = 0);

  py::class_<IpcBuffer>(sub, "IpcBuffer")
      .def(py::init<int, int, size_t>(), py::arg("rank"), py::arg("num_ranks"), py::arg("num_bytes"))
      .def("ipc_handle", [](const IpcBuffer& b) { return py::bytes(b.ipc_handle()); })
      .def("open_peers",
           [](IpcBuffer& b, const std::vector<py::bytes>& handles) {
             std::vector<std::string> raw(handles.begin(), handles.end());
             b.open_peers(raw);
           })
      .def("destroy", &IpcBuffer::destroy)
      .def_property_readonly("alive", &IpcBuffer::alive)
      .def_property_readonly("local_ptr", [](const IpcBuffer& b) { return reinterpret_cast<uintptr_t>(b.local()); })
      .def_property_readonly("src_block_bytes", [](const IpcBuffer& b) { return b.common(0).src_block_bytes; })
      .def("timeout_info", &timeout_info)
      .def("wait_notify", &wait_notify, py::arg("seq"), py::arg("timeout_s"))
      .def("expert_counts", &expert_counts, py::arg("n"))
      .def("take_worst_overflow", &take_worst_overflow);

  py::class_<StreamJoin>(sub, "StreamJoin").def(py::init<>());
  // keep_alive: a plan holds raw pointers to the buffer and the events.
  py::class_<DispatchPlan>(sub, "DispatchPlan")
      .def(py::init<const IpcBuffer&, const StreamJoin&, uint64_t, uintptr_t, uintptr_t, int, int, int, int, int, int,
                    int, int, int, int>(),
           py::arg("buffer"), py::arg("join"), py::arg("timeout_ns"), py::arg("is_token_in_rank"),
           py::arg("recv_channel_offset"), py::arg("num_tokens"), py::arg("hidden_bytes"), py::arg("num_scales"),
           py::arg("num_rows"), py::arg("pad_rows"), py::arg("num_channels"), py::arg("chunk"), py::arg("num_slots"),
           py::arg("slot_bytes"), py::arg("protocol"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def("launch", &DispatchPlan::launch, py::arg("x"), py::arg("scales"), py::arg("recv_x"),
           py::arg("recv_scales"), py::arg("stream"), py::arg("caller"), py::arg("join"));
  py::class_<CombinePlan>(sub, "CombinePlan")
      .def(py::init<const IpcBuffer&, const StreamJoin&, uint64_t, uintptr_t, uintptr_t, int, int, int, int, int, int,
                    int, int, int, int>(),
           py::arg("buffer"), py::arg("join"), py::arg("timeout_ns"), py::arg("is_token_in_rank"),
           py::arg("recv_channel_offset"), py::arg("dtype"), py::arg("num_tokens"), py::arg("hidden"),
           py::arg("num_topk"), py::arg("num_x_rows"), py::arg("num_channels"), py::arg("chunk"), py::arg("num_slots"),
           py::arg("slot_bytes"), py::arg("protocol"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def("launch", &CombinePlan::launch, py::arg("x"), py::arg("topk_weights"), py::arg("bias0"), py::arg("bias1"),
           py::arg("out"), py::arg("out_topk_weights"), py::arg("stream"), py::arg("caller"), py::arg("join"));

  sub.def("layout", &layout, py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_experts"),
          py::arg("num_ranks"), py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_expert"),
          py::arg("is_token_in_rank"), py::arg("stream"));
  sub.def("notify", &notify, py::arg("buffer"), py::arg("timeout_ns"), py::arg("is_token_in_rank"),
          py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_expert"), py::arg("num_tokens"),
          py::arg("num_experts"), py::arg("num_channels"), py::arg("expert_alignment"), py::arg("num_worst_tokens"),
          py::arg("seq"), py::arg("rank_prefix_matrix"), py::arg("recv_channel_offset"), py::arg("stream"),
          py::arg("em_layout") = 0);
  sub.def("dispatch", &dispatch, py::arg("buffer"), py::arg("timeout_ns"), py::arg("x"), py::arg("scales"),
          py::arg("topk_idx"), py::arg("topk_weights"), py::arg("is_token_in_rank"), py::arg("recv_channel_offset"),
          py::arg("recv_x"), py::arg("recv_scales"), py::arg("recv_topk_idx"), py::arg("recv_topk_weights"),
          py::arg("recv_src_idx"), py::arg("num_tokens"), py::arg("hidden_bytes"), py::arg("num_scales"),
          py::arg("num_topk"), py::arg("experts_per_rank"), py::arg("num_rows"), py::arg("pad_rows"),
          py::arg("num_channels"), py::arg("chunk"), py::arg("num_slots"), py::arg("slot_bytes"), py::arg("stream"),
          py::arg("em_mode") = 0, py::arg("pair_rank") = 0, py::arg("em_layout") = 0, py::arg("em_x") = 0,
          py::arg("em_scales") = 0, py::arg("em_weights") = 0, py::arg("em_pair_row") = 0,
          py::arg("em_pair_slot") = 0, py::arg("em_inverse") = 0, py::arg("em_topk") = 0, py::arg("em_rows") = 0,
          py::arg("protocol") = 0);
  sub.def("combine", &combine, py::arg("buffer"), py::arg("timeout_ns"), py::arg("x"), py::arg("topk_weights"),
          py::arg("bias0"), py::arg("bias1"), py::arg("is_token_in_rank"), py::arg("recv_channel_offset"),
          py::arg("out"), py::arg("out_topk_weights"), py::arg("dtype"), py::arg("num_tokens"), py::arg("hidden"),
          py::arg("num_topk"), py::arg("num_x_rows"), py::arg("num_channels"), py::arg("chunk"), py::arg("num_slots"),
          py::arg("slot_bytes"), py::arg("stream"), py::arg("em_inverse") = 0, py::arg("em_weights") = 0,
          py::arg("em_topk_weights") = 0, py::arg("em_topk") = 0, py::arg("protocol") = 0);
  sub.def("em_permute", &em_permute, py::arg("x"), py::arg("scales"), py::arg("recv_topk_idx"),
          py::arg("recv_topk_weights"), py::arg("pair_rank"), py::arg("layout"), py::arg("received"), py::arg("em_x"),
          py::arg("em_scales"), py::arg("em_weights"), py::arg("em_pair_row"), py::arg("em_pair_slot"),
          py::arg("em_inverse"), py::arg("recv_src_idx"), py::arg("fresh"), py::arg("num_rows"), py::arg("hidden_bytes"), py::arg("num_scales"),
          py::arg("num_topk"), py::arg("num_ranks"), py::arg("num_local"), py::arg("expert_alignment"),
          py::arg("em_rows"), py::arg("pad_blocks"), py::arg("stream"));
  sub.def("em_unpermute", &em_unpermute, py::arg("x"), py::arg("inverse"), py::arg("weights"),
          py::arg("topk_weights"), py::arg("received"), py::arg("out"), py::arg("out_topk_weights"), py::arg("dtype"),
          py::arg("hidden"), py::arg("num_rows"), py::arg("num_topk"), py::arg("stream"));
}

}  // namespace moe_dispatcher
