// Python bindings of the intranode (NVLink, CUDA IPC) backend: the IpcBuffer, the kernel launchers and the
// plans of cached calls. Glue only: launchers take tensors (optional ones as None) and launch on the current
// stream of their device; moe_dispatcher/compiled/intranode.py validates the user's inputs (first call of a
// shape) and allocates the outputs of fresh calls. Here only invariants are checked (MOE_CHECK: a failure is
// a caller's bug), and the kernels' Args structs (csrc/kernels/intranode/protocol.h) are filled.
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bindings.h"
#include "bindings/cached_call.h"
#include "bindings/carve.h"
#include "bindings/device_scope.h"
#include "bindings/direct_outputs.h"
#include "bindings/layout_call.h"
#include "bindings/stream_join.h"
#include "ipc_bindings.h"
#include "kernels/common/layout.h"
#include "kernels/intranode/protocol.h"
#include "runtime/cuda_check.h"
#include "runtime/ipc_buffer.h"
#include "runtime/peer_pool/peer_pool.h"

namespace py = pybind11;

namespace moe_ep {
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
    case kPhaseDirectReady: return "direct dispatch ready (waiting for a peer's kernel of the same call to start)";
    case kPhaseDirectArrive: return "direct dispatch arrival (waiting for a peer's rows of this call)";
    case kPhasePullReady: return "pull combine ready (waiting for a peer's kernel of the same call to start)";
    case kPhasePullArrive: return "pull combine arrival (waiting for a peer to finish reading this rank's rows)";
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

// (seq, [problem word of each source]) of the first notify since the last call whose sources' signatures
// disagreed (every rank records the same), or None; cleared once taken.
// (seq, the problem word of each of the group's num_ranks ranks) of the first disagreement notify recorded since
// the last call, or None. num_ranks: ranks of the Buffer's group (internode: more than the domain's IpcBuffer).
py::object take_signature_mismatch(IpcBuffer& b, int num_ranks) {
  volatile Mailbox* box = b.host_mailbox();
  MOE_CHECK(box != nullptr, "buffer destroyed");
  MOE_CHECK(num_ranks >= 1 && num_ranks <= nvlink::kMaxGroupRanks, "take_signature_mismatch: bad num_ranks");
  const int seq = box->signature_mismatch;
  if (seq == 0) return py::none();
  std::vector<int> problems(num_ranks);
  for (int s = 0; s < num_ranks; ++s) problems[s] = box->signature_problems[s];
  box->signature_mismatch = 0;
  return py::make_tuple(seq, problems);
}

// [(source rank, the source's ring signature, this rank's)] of the cached calls whose senders' ring signatures
// differed from this rank's (the first pair per source since the last take; ring_signature.cuh), or None;
// cleared once taken.
py::object take_ring_mismatch(IpcBuffer& b) {
  volatile Mailbox* box = b.host_mailbox();
  MOE_CHECK(box != nullptr, "buffer destroyed");
  if (box->ring_mismatch == 0) return py::none();
  box->ring_mismatch = 0;
  py::list records;
  for (int s = 0; s < nvlink::kMaxGroupRanks; ++s) {  // internode: sources are group ranks
    const int64_t sent = box->ring_mismatch_sent[s];
    if (sent == 0) continue;
    records.append(py::make_tuple(s, sent, static_cast<int64_t>(box->ring_mismatch_expected[s])));
    box->ring_mismatch_sent[s] = 0;
  }
  return records;
}

// A cached call's ring signature (moe_dispatcher/signature.py ring_signature_word): nonzero, bit 63 clear.
uint64_t checked_ring_signature(int64_t word) {
  MOE_CHECK(word > 0, "a cached call needs its ring signature");
  return static_cast<uint64_t>(word);
}

// (direct calls, of them missed, pull combines, of them missed) so far on this rank (Control's direct.calls,
// direct.missed_total, pull.calls, pull.missed_total; the ring kernel moved a missed call): for tests and the
// bench, which tell from them which path ran. Synchronises the device.
py::tuple path_counters(const IpcBuffer& b) {
  MOE_CHECK(b.alive(), "buffer destroyed");
  const auto* ctl = reinterpret_cast<const Control*>(b.local());
  uint64_t words[4];
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  MOE_CUDA_CHECK(cudaMemcpy(&words[0], &ctl->direct.calls, 8, cudaMemcpyDeviceToHost));
  MOE_CUDA_CHECK(cudaMemcpy(&words[1], &ctl->direct.missed_total, 8, cudaMemcpyDeviceToHost));
  MOE_CUDA_CHECK(cudaMemcpy(&words[2], &ctl->pull.calls, 8, cudaMemcpyDeviceToHost));
  MOE_CUDA_CHECK(cudaMemcpy(&words[3], &ctl->pull.missed_total, 8, cudaMemcpyDeviceToHost));
  return py::make_tuple(words[0], words[1], words[2], words[3]);
}

std::vector<int> expert_counts(const IpcBuffer& b, int n) {
  MOE_CHECK(n >= 0 && n <= kMaxLocalExperts, "too many local experts");
  const volatile Mailbox* box = b.host_mailbox();
  std::vector<int> out(n);
  for (int i = 0; i < n; ++i) out[i] = box->expert_counts[i];
  return out;
}

// The kernels' dtype code of combine input (bf16, fp16, fp32: what the backend's capabilities declare).
int combine_dtype(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kBFloat16: return kBf16;
    case at::kHalf: return kFp16;
    case at::kFloat: return kFp32;
    default: MOE_CHECK(false, "combine: the intranode kernels reduce bf16, fp16 and fp32 only");
  }
  return -1;
}

int row_bytes(const at::Tensor& t) { return static_cast<int>(t.size(1) * t.element_size()); }
int columns(const c10::optional<at::Tensor>& t) { return t.has_value() ? static_cast<int>(t->size(1)) : 0; }

// notify of a fresh dispatch: T = rows of is_token_in_rank, E = elements of num_tokens_per_expert; em_layout
// (expert-major dispatch) receives the layout table.
void notify(const IpcBuffer& b, uint64_t timeout_ns, const at::Tensor& is_token_in_rank,
            const at::Tensor& num_tokens_per_rank, const at::Tensor& num_tokens_per_expert, int num_channels,
            int expert_alignment, int num_worst_tokens, int seq, const at::Tensor& rank_prefix_matrix,
            const at::Tensor& recv_channel_offset, const c10::optional<at::Tensor>& em_layout, int signature_hash,
            int problem, const c10::optional<at::Tensor>& send_row_offset) {
  const auto device = is_token_in_rank.get_device();
  for (const at::Tensor* t : {&is_token_in_rank, &num_tokens_per_rank, &num_tokens_per_expert, &rank_prefix_matrix,
                              &recv_channel_offset}) {
    expect_cuda(*t, device, "notify");
  }
  expect_cuda(em_layout, device, "notify: em_layout");
  expect_cuda(send_row_offset, device, "notify: send_row_offset");
  const c10::cuda::CUDAGuard guard(device);
  NotifyArgs a{};
  a.em_layout = data_of<int>(em_layout);
  a.send_row_offset = data_of<int>(send_row_offset);
  a.signature_hash = signature_hash;
  a.problem = problem;
  a.bad_expert_ids = &reinterpret_cast<Control*>(b.local())->bad_expert_ids;
  a.c = b.common(timeout_ns);
  set_notify_counts(a, reinterpret_cast<uintptr_t>(is_token_in_rank.data_ptr()),
                    reinterpret_cast<uintptr_t>(num_tokens_per_rank.data_ptr()),
                    reinterpret_cast<uintptr_t>(num_tokens_per_expert.data_ptr()),
                    static_cast<int>(is_token_in_rank.size(0)), static_cast<int>(num_tokens_per_expert.numel()),
                    num_channels, expert_alignment, num_worst_tokens, seq,
                    reinterpret_cast<uintptr_t>(rank_prefix_matrix.data_ptr()),
                    reinterpret_cast<uintptr_t>(recv_channel_offset.data_ptr()));
  launch_notify(a, current_stream(device).stream());
}

// The ring geometry of one call: a Config's channels, send chunk and ring slots, and the slot size.
struct Ring {
  int num_channels, chunk, num_slots, slot_bytes;
};

// The ring arguments that fresh calls and plans (below) share (Args: DispatchArgs or CombineArgs), checked and
// filled in one place.
template <typename Args>
Args ring_args(const IpcBuffer& b, uint64_t timeout_ns, const Ring& ring) {
  Args a{};
  a.c = b.common(timeout_ns);
  MOE_CHECK(static_cast<size_t>(ring.num_channels) * ring.num_slots * ring.slot_bytes <= a.c.src_block_bytes,
            "NVLink buffer too small for this config");
  a.num_channels = ring.num_channels;
  a.chunk = ring.chunk;
  a.num_slots = ring.num_slots;
  a.slot_bytes = ring.slot_bytes;
  return a;
}

DispatchArgs ring_dispatch_args(const IpcBuffer& b, uint64_t timeout_ns, const Ring& ring) {
  DispatchArgs a = ring_args<DispatchArgs>(b, timeout_ns, ring);
  a.experts_per_rank = 1;
  return a;
}

CombineArgs ring_combine_args(const IpcBuffer& b, uint64_t timeout_ns, const Ring& ring) {
  return ring_args<CombineArgs>(b, timeout_ns, ring);
}

// The routing tensors of a handle (is_token_in_rank bool [T, R], recv_channel_offset int32 [R, C + 1]).
template <typename Args>
void set_routing(Args& a, const at::Tensor& is_token_in_rank, const at::Tensor& recv_channel_offset) {
  a.is_token_in_rank = data_of<const bool>(is_token_in_rank);
  a.recv_channel_offset = data_of<const int>(recv_channel_offset);
  a.num_tokens = static_cast<int>(is_token_in_rank.size(0));
}

// Fresh dispatch (rank-major): x [T, H] (bytes per row a multiple of 16), scales [T, S] 4-byte or None,
// topk_idx int64 [T, K] / topk_weights float32 [T, K] or None; outputs recv_x [rows, H], recv_scales [rows, S],
// recv_topk_idx / recv_topk_weights [rows, K] (with topk_idx), recv_src_idx int32 [rows]. pad_rows: fill the
// rows past the received count (num_worst_tokens).
void dispatch(const IpcBuffer& b, uint64_t timeout_ns, const at::Tensor& x, const c10::optional<at::Tensor>& scales,
              const c10::optional<at::Tensor>& topk_idx, const c10::optional<at::Tensor>& topk_weights,
              const at::Tensor& is_token_in_rank, const at::Tensor& recv_channel_offset, const at::Tensor& recv_x,
              const c10::optional<at::Tensor>& recv_scales, const c10::optional<at::Tensor>& recv_topk_idx,
              const c10::optional<at::Tensor>& recv_topk_weights, const at::Tensor& recv_src_idx,
              int experts_per_rank, bool pad_rows, int num_channels, int chunk, int num_slots, int slot_bytes) {
  const auto device = x.get_device();
  expect_cuda(x, device, "dispatch: x");
  expect_cuda(scales, device, "dispatch: scales");
  expect_cuda(topk_idx, device, "dispatch: topk_idx");
  expect_cuda(topk_weights, device, "dispatch: topk_weights");
  expect_cuda(recv_x, device, "dispatch: recv_x");
  MOE_CHECK(scales.has_value() == recv_scales.has_value(), "dispatch: scales and recv_scales go together");
  MOE_CHECK(topk_idx.has_value() == recv_topk_idx.has_value() &&
                recv_topk_idx.has_value() == recv_topk_weights.has_value(),
            "dispatch: topk_idx, recv_topk_idx and recv_topk_weights go together");
  MOE_CHECK(!topk_weights.has_value() || topk_idx.has_value(), "dispatch: topk_weights without topk_idx");
  const c10::cuda::CUDAGuard guard(device);
  DispatchArgs a = ring_dispatch_args(b, timeout_ns, Ring{num_channels, chunk, num_slots, slot_bytes});
  set_routing(a, is_token_in_rank, recv_channel_offset);
  MOE_CHECK(x.size(0) == a.num_tokens, "dispatch: x and is_token_in_rank differ in tokens");
  a.x = data_of<const uint8_t>(x);
  a.scales = data_of<const int32_t>(scales);
  a.topk_idx = data_of<const int64_t>(topk_idx);
  a.topk_weights = data_of<const float>(topk_weights);
  a.recv_x = data_of<uint8_t>(recv_x);
  a.recv_scales = data_of<int32_t>(recv_scales);
  a.recv_topk_idx = data_of<int64_t>(recv_topk_idx);
  a.recv_topk_weights = data_of<float>(recv_topk_weights);
  a.recv_src_idx = data_of<int>(recv_src_idx);
  a.hidden_bytes = row_bytes(x);
  a.num_scales = columns(scales);
  a.num_topk = columns(topk_idx);
  a.experts_per_rank = experts_per_rank;
  a.num_rows = static_cast<int>(recv_x.size(0));
  a.pad_rows = pad_rows ? 1 : 0;
  launch_dispatch(a, current_stream(device).stream());
}

// Direct dispatch (kernels/intranode/dispatch_direct.cu) of a fresh dispatch (ring_signature 0: top-k, when
// given, and source indices too) or a cached one (ring_signature: its ring word; payload and scales only). The
// outputs are carved from `payload` (uint8, direct_payload_bytes(...) at least: recv_x [rows, H] x.dtype,
// recv_scales [rows, S]) and, fresh, `meta` (uint8, direct_meta_bytes(...): recv_topk_idx int64 [rows, K],
// recv_topk_weights float32 [rows, K], recv_src_idx int32 [rows]). out_offset / meta_offset: where the blocks lie
// in this rank's NVLink buffer (the peer pool), or -1 when they do not: then no rank writes directly and the ring
// kernel queued after the direct one moves the call on every rank (it is queued always, and leaves at once when
// the direct kernel moved the call). send_row_offset int32 [R, C] is notify's (fresh) or the handle's (cached).
// row_of_token (fresh, optional): int32 [T, R] filled with -1, receives where each token landed in each
// destination's outputs (the pull combine's map). -> (recv_x, recv_scales or None, recv_topk_idx and
// recv_topk_weights or None (no topk_idx), recv_src_idx or None (cached)).
py::tuple direct_dispatch(const IpcBuffer& b, uint64_t timeout_ns, const at::Tensor& x,
                          const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& topk_idx,
                          const c10::optional<at::Tensor>& topk_weights, const at::Tensor& is_token_in_rank,
                          const at::Tensor& recv_channel_offset, const at::Tensor& send_row_offset,
                          const at::Tensor& payload, int64_t out_offset, const c10::optional<at::Tensor>& meta,
                          int64_t meta_offset, int64_t rows, int experts_per_rank, bool pad_rows, int num_channels,
                          int chunk, int num_slots, int slot_bytes, int64_t ring_signature,
                          const c10::optional<at::Tensor>& row_of_token) {
  const bool fresh = ring_signature == 0;
  const auto device = x.get_device();
  expect_cuda(x, device, "direct dispatch: x");
  expect_cuda(scales, device, "direct dispatch: scales");
  expect_cuda(topk_idx, device, "direct dispatch: topk_idx");
  expect_cuda(topk_weights, device, "direct dispatch: topk_weights");
  expect_cuda(payload, device, "direct dispatch: payload");
  expect_cuda(meta, device, "direct dispatch: meta");
  expect_cuda(row_of_token, device, "direct dispatch: row_of_token");
  MOE_CHECK(!topk_weights.has_value() || topk_idx.has_value(), "direct dispatch: topk_weights without topk_idx");
  MOE_CHECK(fresh || (!topk_idx.has_value() && !row_of_token.has_value()),
            "direct dispatch: a cached call takes no topk_idx or row_of_token");
  MOE_CHECK(fresh == meta.has_value(), "direct dispatch: a fresh call (only) has a meta block");
  MOE_CHECK(send_row_offset.numel() >= static_cast<int64_t>(b.num_ranks()) * num_channels,
            "direct dispatch: send_row_offset must be [R, C]");
  const DirectPayload o{rows, row_bytes(x), columns(scales)};
  const DirectMeta m{rows, columns(topk_idx)};
  check_direct_block(payload, out_offset, o.bytes(), b.local(), "direct dispatch", "payload");
  if (fresh) check_direct_block(*meta, meta_offset, m.bytes(), b.local(), "direct dispatch", "meta");
  if (row_of_token.has_value()) {
    MOE_CHECK(row_of_token->scalar_type() == at::kInt && row_of_token->is_contiguous() &&
                  row_of_token->numel() == is_token_in_rank.size(0) * static_cast<int64_t>(b.num_ranks()),
              "direct dispatch: row_of_token must be a contiguous int32 [T, R]");
  }
  MOE_CHECK(x.size(0) == is_token_in_rank.size(0), "direct dispatch: x and is_token_in_rank differ in tokens");
  const c10::cuda::CUDAGuard guard(device);
  const DirectOutputs outs = carve_direct_outputs(payload, meta, o, m, x.scalar_type(), scales.has_value(),
                                                  scales.has_value() ? scales->scalar_type() : at::kInt,
                                                  topk_idx.has_value());

  // The ring kernel's arguments first (their checks may throw): a rank must queue both kernels or neither.
  DispatchArgs a = ring_dispatch_args(b, timeout_ns, Ring{num_channels, chunk, num_slots, slot_bytes});
  set_routing(a, is_token_in_rank, recv_channel_offset);
  a.x = data_of<const uint8_t>(x);
  a.scales = data_of<const int32_t>(scales);
  a.topk_idx = data_of<const int64_t>(topk_idx);
  a.topk_weights = data_of<const float>(topk_weights);
  set_direct_outputs(a, outs);
  a.hidden_bytes = o.hidden_bytes;
  a.num_scales = o.num_scales;
  a.num_topk = m.num_topk;
  a.experts_per_rank = experts_per_rank;
  a.num_rows = static_cast<int>(rows);
  a.pad_rows = pad_rows ? 1 : 0;
  a.ring_signature = fresh ? 0 : checked_ring_signature(ring_signature);  // cached: its ring word

  DirectDispatchArgs d{};
  d.c = a.c;
  d.x = a.x;
  d.scales = a.scales;
  d.topk_idx = a.topk_idx;
  d.topk_weights = a.topk_weights;
  d.is_token_in_rank = a.is_token_in_rank;
  d.recv_channel_offset = a.recv_channel_offset;
  d.send_row_offset = data_of<const int>(send_row_offset);
  d.out_offset = out_offset;
  d.meta_offset = fresh ? meta_offset : 0;
  d.out_rows = rows;
  d.layout = a.ring_signature;
  d.row_of_token = data_of<int>(row_of_token);
  d.num_tokens = a.num_tokens;
  d.hidden_bytes = a.hidden_bytes;
  d.num_scales = a.num_scales;
  d.num_topk = a.num_topk;
  d.experts_per_rank = experts_per_rank;
  d.write_meta = fresh ? 1 : 0;
  d.pad_rows = a.pad_rows;
  d.num_channels = num_channels;
  const cudaStream_t stream = current_stream(device).stream();
  launch_direct_dispatch(d, stream);
  launch_ring_fallback(a, stream);
  return outs.to_python();
}

// Where a pull combine's inputs lie in this rank's NVLink buffer: x (x_rows rows, x_bytes bytes from x) and, when
// has_w, topk_weights (w_bytes bytes from w) -> {x_offset, w_offset (-1 without weights)}, or {-1, -1} when either
// is outside the buffer's peer pool, the buffer has none or is closed, or `stream` (the launch's) is capturing a
// CUDA graph (the graph's tensors come from its own pool, and a replay must not depend on this call's addresses).
// -1 makes the pull kernel's verdict "missed" on every rank, and the ring kernel queued after it moves the call. An
// x without rows is read by nobody: any offset will do (0, 0); rows of 0 bytes have no address (torch gives a
// tensor without elements a null data pointer) but their weights are read, so they count as outside, as do weights
// without elements. The pool is the tail of the allocation, [pool_offset, pool_offset + pool_bytes) from local();
// torch's own allocations never lie there, so a tensor whose bytes lie there is a pool tensor.
std::pair<int64_t, int64_t> pull_offsets(const IpcBuffer& b, const void* x, int64_t x_rows, size_t x_bytes,
                                         bool has_w, const void* w, size_t w_bytes, cudaStream_t stream) {
  constexpr std::pair<int64_t, int64_t> kElsewhere{-1, -1};
  if (!b.alive() || b.pool_bytes() == 0) return kElsewhere;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return kElsewhere;
  if (x_rows == 0) return {0, 0};
  if (x == nullptr || x_bytes == 0) return kElsewhere;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(b.local()) + b.pool_offset();
  const uintptr_t end = begin + b.pool_bytes();
  auto offset_of = [&](const void* p, size_t n) -> int64_t {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    if (a < begin || a > end || n > end - a) return -1;
    return static_cast<int64_t>(a - reinterpret_cast<uintptr_t>(b.local()));
  };
  const int64_t x_offset = offset_of(x, x_bytes);
  if (x_offset < 0) return kElsewhere;
  if (!has_w) return {x_offset, -1};
  const int64_t w_offset = w == nullptr || w_bytes == 0 ? -1 : offset_of(w, w_bytes);
  if (w_offset < 0) return kElsewhere;
  return {x_offset, w_offset};
}

int64_t tensor_bytes(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->numel() * t->element_size() : 0; }

// The pull combine, then the ring combine, which moves the call only when some rank's input is not peer-mapped
// (the pull kernel's verdict, the same on every rank). `a`: the ring combine's arguments with the call's tensors.
// has_w: the call has top-k weights (a.topk_weights, w_bytes bytes; null when they have no elements).
void launch_pull_then_ring(const IpcBuffer& b, const CombineArgs& a, const int* row_of_token, size_t x_bytes,
                           bool has_w, size_t w_bytes, cudaStream_t stream) {
  const auto offsets = pull_offsets(b, a.x, a.num_x_rows, x_bytes, has_w, a.topk_weights, w_bytes, stream);
  CombinePullArgs p{};
  p.base = a;
  p.row_of_token = row_of_token;
  p.x_offset = offsets.first;
  p.w_offset = offsets.second;
  launch_combine_pull(p, stream);
  launch_ring_reduce_fallback(a, stream);
}

// Combine (rank-major): x [rows, H] bf16/fp16/fp32, topk_weights float32 [rows, K] or None, bias0 / bias1 [T, H]
// of x's dtype or None -> out [T, H], out_topk_weights float32 [T, K] (with topk_weights). Along a direct
// dispatch's handle, row_of_token (int32 [T, R], the dispatch's) makes it a pull combine (pull_offsets: whether
// x and topk_weights lie in this rank's peer pool).
void combine(const IpcBuffer& b, uint64_t timeout_ns, const at::Tensor& x,
             const c10::optional<at::Tensor>& topk_weights,
             const c10::optional<at::Tensor>& bias0, const c10::optional<at::Tensor>& bias1,
             const at::Tensor& is_token_in_rank, const at::Tensor& recv_channel_offset, const at::Tensor& out,
             const c10::optional<at::Tensor>& out_topk_weights, int num_channels, int chunk, int num_slots,
             int slot_bytes, int64_t ring_signature, const c10::optional<at::Tensor>& row_of_token) {
  const auto device = x.get_device();
  expect_cuda(x, device, "combine: x");
  expect_cuda(row_of_token, device, "combine: row_of_token");
  expect_cuda(topk_weights, device, "combine: topk_weights");
  expect_cuda(bias0, device, "combine: bias0");
  expect_cuda(bias1, device, "combine: bias1");
  expect_cuda(out, device, "combine: out");
  MOE_CHECK(topk_weights.has_value() == out_topk_weights.has_value(),
            "combine: topk_weights and out_topk_weights go together");
  const c10::cuda::CUDAGuard guard(device);
  CombineArgs a = ring_combine_args(b, timeout_ns, Ring{num_channels, chunk, num_slots, slot_bytes});
  set_routing(a, is_token_in_rank, recv_channel_offset);
  MOE_CHECK(out.size(0) == a.num_tokens, "combine: out and is_token_in_rank differ in tokens");
  a.x = data_of<const uint8_t>(x);
  a.topk_weights = data_of<const float>(topk_weights);
  a.bias0 = data_of<const uint8_t>(bias0);
  a.bias1 = data_of<const uint8_t>(bias1);
  a.out = data_of<uint8_t>(out);
  a.out_topk_weights = data_of<float>(out_topk_weights);
  a.dtype = combine_dtype(x);
  a.hidden = static_cast<int>(x.size(1));
  a.num_topk = columns(topk_weights);
  a.num_x_rows = static_cast<int>(x.size(0));
  a.ring_signature = checked_ring_signature(ring_signature);
  const cudaStream_t stream = current_stream(device).stream();
  if (!row_of_token.has_value()) {
    launch_combine(a, stream);
    return;
  }
  MOE_CHECK(row_of_token->numel() == static_cast<int64_t>(a.num_tokens) * b.num_ranks(),
            "combine: row_of_token must be [T, R]");
  MOE_CHECK(row_of_token->scalar_type() == at::kInt && row_of_token->is_contiguous(),
            "combine: row_of_token must be a contiguous int32 tensor");
  launch_pull_then_ring(b, a, data_of<const int>(row_of_token), x.numel() * x.element_size(),
                        topk_weights.has_value(), tensor_bytes(topk_weights), stream);
}

// Expert-major dispatch, local pass after the rank-major dispatch (em_permute.cu): received rows x [N, H] (scales
// [N, S] or None) -> expert-major rows em_x [M, H] (em_scales [M, S]). Fresh (recv_topk_idx given): positions from
// recv_topk_idx [N, K] + pair_rank [N, K] + layout, recording em_inverse [N, K], em_pair_row / em_pair_slot [M],
// em_weights [M] (from recv_topk_weights, when given) and recv_src_idx [N] (-1 past the received count); cached:
// positions from em_inverse. received: int32 [1], the rows that arrived (device). pad_blocks blocks zero the
// padding rows.
void em_permute(const at::Tensor& x, const c10::optional<at::Tensor>& scales,
                const c10::optional<at::Tensor>& recv_topk_idx, const c10::optional<at::Tensor>& recv_topk_weights,
                const c10::optional<at::Tensor>& pair_rank, const at::Tensor& layout, const at::Tensor& received,
                const at::Tensor& em_x, const c10::optional<at::Tensor>& em_scales,
                const c10::optional<at::Tensor>& em_weights, const c10::optional<at::Tensor>& em_pair_row,
                const c10::optional<at::Tensor>& em_pair_slot, const at::Tensor& em_inverse,
                const c10::optional<at::Tensor>& recv_src_idx, int num_ranks, int num_local, int expert_alignment,
                int pad_blocks) {
  const auto device = em_inverse.get_device();
  expect_cuda(x, device, "em_permute: x");
  expect_cuda(em_x, device, "em_permute: em_x");
  const bool fresh = recv_topk_idx.has_value();
  MOE_CHECK(!fresh || (pair_rank.has_value() && em_pair_row.has_value() && em_pair_slot.has_value() &&
                       recv_src_idx.has_value() && (!em_weights.has_value() || recv_topk_weights.has_value())),
            "em_permute: a fresh call needs the received top-k, the pair ranks, pair_row/pair_slot and the "
            "source indices");
  MOE_CHECK(scales.has_value() == em_scales.has_value(), "em_permute: scales and em_scales go together");
  const int num_topk = static_cast<int>(em_inverse.size(1));
  MOE_CHECK(num_topk > 0 && num_topk <= kMaxTopk, "em_permute: 1..MAX_TOPK slots");
  MOE_CHECK(row_bytes(x) % 16 == 0 && expert_alignment >= 1 && pad_blocks >= 0, "em_permute: bad geometry");
  MOE_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks && num_local >= 1 && num_local <= kMaxLocalExperts,
            "em_permute: bad ranks or local experts");
  const c10::cuda::CUDAGuard guard(device);
  EmPermuteArgs a{};
  a.x = data_of<const uint8_t>(x);
  a.scales = data_of<const int32_t>(scales);
  a.recv_topk_idx = data_of<const int64_t>(recv_topk_idx);
  a.recv_topk_weights = data_of<const float>(recv_topk_weights);
  a.pair_rank = data_of<const int>(pair_rank);
  a.layout = data_of<const int>(layout);
  a.received = data_of<const int>(received);
  a.fresh = fresh ? 1 : 0;
  a.num_rows = static_cast<int>(em_inverse.size(0));
  a.hidden_bytes = row_bytes(x);
  a.num_scales = columns(scales);
  a.num_topk = num_topk;
  a.num_ranks = num_ranks;
  a.num_local = num_local;
  a.expert_alignment = expert_alignment;
  a.em_rows = static_cast<int>(em_x.size(0));
  a.row_blocks = (a.num_rows + kEmRowsPerBlock - 1) / kEmRowsPerBlock;
  a.em_x = data_of<uint8_t>(em_x);
  a.em_scales = data_of<int32_t>(em_scales);
  a.em_weights = data_of<float>(em_weights);
  a.em_pair_row = data_of<int>(em_pair_row);
  a.em_pair_slot = data_of<int>(em_pair_slot);
  a.em_inverse = data_of<int>(em_inverse);
  a.recv_src_idx = data_of<int>(recv_src_idx);
  launch_em_permute(a, pad_blocks, current_stream(device).stream());
}

// Expert-major combine, local pass before the rank-major combine (em_unpermute.cu): expert-major rows x [M, H]
// (bf16/fp16/fp32) -> out [N, H], each received row's pairs through inverse [N, K] (weighted by weights [M] when
// given), and out_topk_weights [N, K] from topk_weights [M] (when given). received: int32 [1] on the device.
void em_unpermute(const at::Tensor& x, const at::Tensor& inverse, const c10::optional<at::Tensor>& weights,
                  const c10::optional<at::Tensor>& topk_weights, const at::Tensor& received, const at::Tensor& out,
                  const c10::optional<at::Tensor>& out_topk_weights) {
  const auto device = inverse.get_device();
  expect_cuda(x, device, "em_unpermute: x");
  expect_cuda(out, device, "em_unpermute: out");
  MOE_CHECK(topk_weights.has_value() == out_topk_weights.has_value(),
            "em_unpermute: topk_weights and out_topk_weights go together");
  const int num_topk = static_cast<int>(inverse.size(1));
  MOE_CHECK(num_topk > 0 && num_topk <= kMaxTopk, "em_unpermute: 1..MAX_TOPK slots");
  MOE_CHECK(row_bytes(x) % 16 == 0, "em_unpermute: rows must be a multiple of 16 bytes");
  const c10::cuda::CUDAGuard guard(device);
  EmUnpermuteArgs a{};
  a.x = data_of<const uint8_t>(x);
  a.inverse = data_of<const int>(inverse);
  a.weights = data_of<const float>(weights);
  a.topk_weights = data_of<const float>(topk_weights);
  a.received = data_of<const int>(received);
  a.out = data_of<uint8_t>(out);
  a.out_topk_weights = data_of<float>(out_topk_weights);
  a.dtype = combine_dtype(x);
  a.hidden = static_cast<int>(x.size(1));
  a.num_rows = static_cast<int>(inverse.size(0));
  a.num_topk = num_topk;
  launch_em_unpermute(a, current_stream(device).stream());
}

// out[t][k] (int32 [T, K]) = rank of pair (t, k) among the pairs of topk_idx [T, K] for the same expert, in (t, k)
// order; rows at or past the device count row_limit (int32 [1], optional) are left out.
void pair_rank(const at::Tensor& topk_idx, int num_experts, const at::Tensor& out,
               const c10::optional<at::Tensor>& row_limit) {
  MOE_CHECK(num_experts > 0 && num_experts <= kMaxLocalExperts * kMaxRanks, "pair_rank: too many experts");
  const auto device = topk_idx.get_device();
  expect_cuda(topk_idx, device, "pair_rank: topk_idx");
  expect_cuda(out, device, "pair_rank: out");
  const c10::cuda::CUDAGuard guard(device);
  const int num_tokens = static_cast<int>(topk_idx.size(0));
  const int blocks = std::max((num_tokens + kPairRankTokens - 1) / kPairRankTokens, 1);
  // Allocated on the launch stream (the current one): freed when this returns, reused after the kernel only.
  const at::Tensor workspace = at::empty({static_cast<int64_t>(blocks) * num_experts}, out.options());
  PairRankArgs a{data_of<const int64_t>(topk_idx), num_tokens, static_cast<int>(topk_idx.size(1)), num_experts,
                 data_of<int>(out), data_of<int>(workspace), data_of<const int>(row_limit)};
  launch_pair_rank(a, current_stream(device).stream());
}

// Cached calls (csrc/bindings/cached_call.h): plans made by the backend's full path after its checks.
using CachedDispatch = CachedCall<DispatchArgs, launch_dispatch, CallKind::kDispatch>;
using CachedCombine = CachedCall<CombineArgs, launch_combine, CallKind::kCombine>;

// Dispatch along a handle (no top-k, no source indices: what a cached dispatch sends): x [T, H], scales [T, S]
// (FP8) or None -> recv_x [rows, H], recv_scales [rows, S]; rows = the handle's recv_src_idx rows.
std::unique_ptr<CachedDispatch> make_cached_dispatch(const IpcBuffer& b, CommStream& comm, uint64_t timeout_ns,
                                                     const py::tuple& handle, const at::Tensor& recv_channel_offset,
                                                     const at::Tensor& x, const c10::optional<at::Tensor>& scales,
                                                     int num_channels, int chunk, int num_slots, int slot_bytes,
                                                     py::object config, int num_sms, int64_t ring_signature) {
  DispatchArgs a = ring_dispatch_args(b, timeout_ns, Ring{num_channels, chunk, num_slots, slot_bytes});
  const at::Tensor is_token_in_rank = py::cast<at::Tensor>(handle[kIsTokenInRank]);
  set_routing(a, is_token_in_rank, recv_channel_offset);
  const at::Tensor recv_src_idx = py::cast<at::Tensor>(handle[kRecvSrcIdx]);
  const int64_t rows = recv_src_idx.size(0);
  a.hidden_bytes = row_bytes(x);
  a.num_scales = columns(scales);
  a.num_rows = static_cast<int>(rows);
  a.pad_rows = py::cast<int64_t>(handle[kNumWorstTokens]) != 0 ? 1 : 0;
  a.ring_signature = checked_ring_signature(ring_signature);
  const TensorSpec input{x.scalar_type(), x.size(0), x.size(1)};
  c10::optional<TensorSpec> aux, aux_out;
  if (scales.has_value()) {
    aux = TensorSpec{scales->scalar_type(), x.size(0), scales->size(1)};
    aux_out = TensorSpec{scales->scalar_type(), rows, scales->size(1)};
  }
  return std::make_unique<CachedDispatch>(b, comm, handle,
                                          std::vector<at::Tensor>{is_token_in_rank, recv_channel_offset}, a,
                                          input, aux,
                                          TensorSpec{x.scalar_type(), rows, x.size(1)}, aux_out, std::move(config),
                                          num_sms);
}

// The arguments of a cached combine along a direct dispatch's handle (a pull plan): the ring combine's, with the
// fields CachedCall sets per call (x, topk_weights, out, out_topk_weights, by the names of CombineArgs), the
// dispatch's row_of_token, and what pull_offsets needs (the buffer, the inputs' bytes).
struct PullCombineArgs {
  CombineArgs ring{};
  const int* row_of_token = nullptr;
  const IpcBuffer* buffer = nullptr;
  size_t x_bytes = 0, w_bytes = 0;
  bool has_weights = false;
  const uint8_t* x = nullptr;
  const float* topk_weights = nullptr;
  uint8_t* out = nullptr;
  float* out_topk_weights = nullptr;
};

void launch_pull_plan(const PullCombineArgs& p, cudaStream_t stream) {
  CombineArgs a = p.ring;
  a.x = p.x;
  a.topk_weights = p.topk_weights;
  a.out = p.out;
  a.out_topk_weights = p.out_topk_weights;
  launch_pull_then_ring(*p.buffer, a, p.row_of_token, p.x_bytes, p.has_weights, p.w_bytes, stream);
}

using CachedPullCombine = CachedCall<PullCombineArgs, launch_pull_plan, CallKind::kCombine>;

// A uint8 block of at least `nbytes` bytes for a direct dispatch's outputs (or rows a pull combine reads) and its
// offset in this rank's NVLink buffer: from the peer pool through torch's caching allocator, what PeerPool.allocate
// does (this rank's region made active for the thread, the allocator routed to the pool's MemPool `pool_id` for
// this thread as torch.cuda.use_mem_pool routes it, then the routing ended and its use released), the size rounded
// up to a power of two (2 MiB at least) so that torch's cached blocks of the pool serve the next calls, whose sizes
// vary (torch cannot hand a live pool's cached segments back to the region); or from torch's own memory with offset
// -1 when the pool has no room (PeerPoolExhausted) or `stream` (where the block is used) is capturing a CUDA graph.
// The block belongs to the current stream of `device`, which the caller made current.
std::pair<c10::Storage, int64_t> pool_block(const IpcBuffer& b, c10::DeviceIndex device, c10::MempoolId_t pool_id,
                                            size_t nbytes, cudaStream_t stream) {
  MOE_CHECK(b.alive() && b.pool_bytes() > 0, "pool_block: the buffer has no open peer pool");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture == cudaStreamCaptureStatusNone) {
    size_t size = size_t{2} << 20;
    while (size < nbytes) size <<= 1;
    const uintptr_t base = reinterpret_cast<uintptr_t>(b.local()) + b.pool_offset();
    const uintptr_t previous = peer_pool::set_active_region(device, base);
    if (previous != 0 && previous != base) {
      peer_pool::set_active_region(device, previous);
      throw std::runtime_error("PeerPool.allocating(): another PeerPool's context is active on this device and "
                               "thread; pool contexts of one device do not nest");
    }
    // Inside this pool's own allocating() context (previous == base) the thread is routed to the pool already.
    const bool routed_here = previous == base;
    const std::thread::id thread = std::this_thread::get_id();
    if (!routed_here) {
      try {
        c10::cuda::CUDACachingAllocator::beginAllocateToPool(
            device, pool_id, [thread](cudaStream_t) { return std::this_thread::get_id() == thread; });
      } catch (...) {
        peer_pool::set_active_region(device, previous);
        throw;
      }
    }
    auto end_routing = [&] {
      if (routed_here) return;
      c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool_id);
      c10::cuda::CUDACachingAllocator::releasePool(device, pool_id);
      peer_pool::set_active_region(device, previous);
    };
    c10::Storage block;
    bool exhausted = false;
    try {
      block = cuda_block(size);
    } catch (const c10::OutOfMemoryError&) {
      exhausted = true;  // PeerPoolExhausted: the ring kernel moves this call on every rank
    } catch (...) {
      end_routing();
      throw;
    }
    end_routing();
    if (!exhausted) {
      // Only a block inside the region may be published to the peers: an allocator path that ignores the routing
      // (PYTORCH_NO_CUDA_MEMORY_CACHING=1 allocates with cudaMalloc) gives ordinary memory, which takes the ring.
      const uintptr_t at = reinterpret_cast<uintptr_t>(block.mutable_data());
      if (at >= base && at + size <= base + b.pool_bytes() && at % 16 == 0) {
        return {std::move(block), static_cast<int64_t>(at - reinterpret_cast<uintptr_t>(b.local()))};
      }
      return {std::move(block), -1};
    }
  }
  return {cuda_block(std::max<size_t>(nbytes, 1)), -1};
}

// The arguments of a cached dispatch along a direct dispatch's handle (a direct plan): the direct kernel's and those
// of the ring kernel queued after it (which moves the call when some rank's outputs are not in its pool), with the
// fields CachedCall sets per call (x, scales, recv_x, recv_scales, by the names of DispatchArgs). output_block (the
// CachedCall hook) takes the call's outputs from one pool_block in DirectPayload's layout (offset -1: no rank writes
// directly, the ring kernel moves the call on every rank). The block is kept
// as the backend's latest direct block (`latest`, its list [payload, meta]): a peer late with this call writes into
// it, never into memory handed out again.
struct DirectDispatchPlanArgs {
  DispatchArgs ring{};
  DirectDispatchArgs direct{};
  const IpcBuffer* buffer = nullptr;
  c10::DeviceIndex device = 0;
  c10::MempoolId_t pool_id{0, 0};
  PyObject* latest = nullptr;  // the backend's list (the plan's function keeps it referenced)
  int64_t out_offset = -1;     // this call's block in this rank's NVLink buffer, or -1 (output_block sets it)
  const uint8_t* x = nullptr;
  const int32_t* scales = nullptr;
  uint8_t* recv_x = nullptr;
  int32_t* recv_scales = nullptr;

  std::pair<c10::Storage, size_t> output_block(size_t out_bytes, size_t aux_bytes, cudaStream_t stream) {
    const DirectPayload o{static_cast<int64_t>(ring.num_rows), ring.hidden_bytes, ring.num_scales};
    MOE_CHECK(static_cast<size_t>(o.scales_offset()) >= out_bytes &&
                  static_cast<size_t>(o.bytes() - o.scales_offset()) >= aux_bytes,
              "cached direct dispatch: the outputs do not fit the payload layout");
    const size_t nbytes = static_cast<size_t>(o.bytes());
    auto [block, offset] = pool_block(*buffer, device, pool_id, nbytes, stream);
    out_offset = offset;
    // The backend keeps the latest direct call's blocks: this call's payload (a cached call has no meta block).
    PyObject* payload = THPVariable_Wrap(carve(block, 0, at::kByte, {static_cast<int64_t>(block.nbytes())}, {1}));
    if (payload == nullptr) throw pybind11::error_already_set();
    // `latest` is the backend's list of two (_direct_blocks): the stores fail only if it were not.
    if (PyList_SetItem(latest, 0, payload) != 0) throw pybind11::error_already_set();  // steals payload
    Py_INCREF(Py_None);
    if (PyList_SetItem(latest, 1, Py_None) != 0) throw pybind11::error_already_set();
    return {std::move(block), static_cast<size_t>(o.scales_offset())};
  }
};

void launch_direct_plan(const DirectDispatchPlanArgs& p, cudaStream_t stream) {
  DispatchArgs a = p.ring;
  a.x = p.x;
  a.scales = p.scales;
  a.recv_x = p.recv_x;
  a.recv_scales = p.recv_scales;
  DirectDispatchArgs d = p.direct;
  d.x = a.x;
  d.scales = a.scales;
  d.out_offset = p.out_offset;
  launch_direct_dispatch(d, stream);
  launch_ring_fallback(a, stream);
}

using CachedDirectDispatch = CachedCall<DirectDispatchPlanArgs, launch_direct_plan, CallKind::kDispatch>;

// Combine along a handle: x [rows, H] bf16/fp16/fp32, topk_weights float32 [rows, K] when given -> out [T, H],
// out_topk_weights float32 [T, K].
std::unique_ptr<CachedCombine> make_cached_combine(const IpcBuffer& b, CommStream& comm, uint64_t timeout_ns,
                                                   const py::tuple& handle, const at::Tensor& recv_channel_offset,
                                                   const at::Tensor& x, const c10::optional<at::Tensor>& topk_weights,
                                                   int num_channels, int chunk, int num_slots, int slot_bytes,
                                                   py::object config, int num_sms, int64_t ring_signature) {
  CombineArgs a = ring_combine_args(b, timeout_ns, Ring{num_channels, chunk, num_slots, slot_bytes});
  const at::Tensor is_token_in_rank = py::cast<at::Tensor>(handle[kIsTokenInRank]);
  set_routing(a, is_token_in_rank, recv_channel_offset);
  const int64_t tokens = py::cast<int64_t>(handle[kNumTokens]);
  a.dtype = combine_dtype(x);
  a.hidden = static_cast<int>(x.size(1));
  a.num_topk = columns(topk_weights);
  a.num_x_rows = static_cast<int>(x.size(0));
  a.ring_signature = checked_ring_signature(ring_signature);
  const TensorSpec input{x.scalar_type(), x.size(0), x.size(1)};
  c10::optional<TensorSpec> aux, aux_out;
  if (topk_weights.has_value()) {
    aux = TensorSpec{at::kFloat, x.size(0), topk_weights->size(1)};
    aux_out = TensorSpec{at::kFloat, tokens, topk_weights->size(1)};
  }
  return std::make_unique<CachedCombine>(b, comm, handle,
                                         std::vector<at::Tensor>{is_token_in_rank, recv_channel_offset}, a,
                                         input, aux,
                                         TensorSpec{x.scalar_type(), tokens, x.size(1)}, aux_out, std::move(config),
                                         num_sms);
}

// Dispatch along a direct dispatch's handle (the direct kernel into outputs in the peer pool, the ring kernel after
// it): as make_cached_dispatch, with the handle's send_row_offset (int32 [R, C]), the pool's MemPool id and the
// backend's list of its latest direct blocks.
std::unique_ptr<CachedDirectDispatch> make_cached_direct_dispatch(
    const IpcBuffer& b, CommStream& comm, uint64_t timeout_ns, const py::tuple& handle,
    const at::Tensor& recv_channel_offset, const at::Tensor& send_row_offset, const at::Tensor& x,
    const c10::optional<at::Tensor>& scales, int num_channels, int chunk, int num_slots, int slot_bytes,
    py::object config, int num_sms, int64_t ring_signature, c10::MempoolId_t pool_id, const py::list& latest) {
  MOE_CHECK(b.pool_bytes() > 0, "cached direct dispatch: the buffer has no peer pool");
  MOE_CHECK(py::len(latest) == 2, "cached direct dispatch: latest must be the backend's [payload, meta] list");
  MOE_CHECK(send_row_offset.scalar_type() == at::kInt && send_row_offset.is_contiguous() &&
                send_row_offset.numel() >= static_cast<int64_t>(b.num_ranks()) * num_channels,
            "cached direct dispatch: send_row_offset must be a contiguous int32 [R, C]");
  DirectDispatchPlanArgs p{};
  DispatchArgs& a = p.ring;
  a = ring_dispatch_args(b, timeout_ns, Ring{num_channels, chunk, num_slots, slot_bytes});
  const at::Tensor is_token_in_rank = py::cast<at::Tensor>(handle[kIsTokenInRank]);
  set_routing(a, is_token_in_rank, recv_channel_offset);
  const int64_t rows = py::cast<at::Tensor>(handle[kRecvSrcIdx]).size(0);
  a.hidden_bytes = row_bytes(x);
  a.num_scales = columns(scales);
  a.num_rows = static_cast<int>(rows);
  a.pad_rows = py::cast<int64_t>(handle[kNumWorstTokens]) != 0 ? 1 : 0;
  a.ring_signature = checked_ring_signature(ring_signature);
  DirectDispatchArgs& d = p.direct;
  d.c = a.c;
  d.is_token_in_rank = a.is_token_in_rank;
  d.recv_channel_offset = a.recv_channel_offset;
  d.send_row_offset = data_of<const int>(send_row_offset);
  d.meta_offset = 0;
  d.out_rows = rows;
  d.layout = a.ring_signature;
  d.num_tokens = a.num_tokens;
  d.hidden_bytes = a.hidden_bytes;
  d.num_scales = a.num_scales;
  d.num_topk = 0;
  d.experts_per_rank = a.experts_per_rank;
  d.write_meta = 0;
  d.pad_rows = a.pad_rows;
  d.num_channels = num_channels;
  p.buffer = &b;
  p.device = comm.device();
  p.pool_id = pool_id;
  p.latest = latest.ptr();
  const TensorSpec input{x.scalar_type(), x.size(0), x.size(1)};
  c10::optional<TensorSpec> aux, aux_out;
  if (scales.has_value()) {
    aux = TensorSpec{scales->scalar_type(), x.size(0), scales->size(1)};
    aux_out = TensorSpec{scales->scalar_type(), rows, scales->size(1)};
  }
  return std::make_unique<CachedDirectDispatch>(
      b, comm, handle, std::vector<at::Tensor>{is_token_in_rank, recv_channel_offset, send_row_offset}, p, input,
      aux, TensorSpec{x.scalar_type(), rows, x.size(1)}, aux_out, std::move(config), num_sms);
}

// Combine along a direct dispatch's handle (the pull combine, with the ring combine after it): as
// make_cached_combine, with the dispatch's row_of_token (int32 [T, R]).
std::unique_ptr<CachedPullCombine> make_cached_pull_combine(
    const IpcBuffer& b, CommStream& comm, uint64_t timeout_ns, const py::tuple& handle,
    const at::Tensor& recv_channel_offset, const at::Tensor& row_of_token, const at::Tensor& x,
    const c10::optional<at::Tensor>& topk_weights, int num_channels, int chunk, int num_slots, int slot_bytes,
    py::object config, int num_sms, int64_t ring_signature) {
  PullCombineArgs p{};
  p.ring = ring_combine_args(b, timeout_ns, Ring{num_channels, chunk, num_slots, slot_bytes});
  const at::Tensor is_token_in_rank = py::cast<at::Tensor>(handle[kIsTokenInRank]);
  set_routing(p.ring, is_token_in_rank, recv_channel_offset);
  const int64_t tokens = py::cast<int64_t>(handle[kNumTokens]);
  MOE_CHECK(row_of_token.scalar_type() == at::kInt && row_of_token.is_contiguous() &&
                row_of_token.numel() == static_cast<int64_t>(p.ring.num_tokens) * b.num_ranks(),
            "cached pull combine: row_of_token must be a contiguous int32 [T, R]");
  p.ring.dtype = combine_dtype(x);
  p.ring.hidden = static_cast<int>(x.size(1));
  p.ring.num_topk = columns(topk_weights);
  p.ring.num_x_rows = static_cast<int>(x.size(0));
  p.ring.ring_signature = checked_ring_signature(ring_signature);
  p.row_of_token = data_of<const int>(row_of_token);
  p.buffer = &b;
  p.x_bytes = static_cast<size_t>(x.numel() * x.element_size());
  p.w_bytes = static_cast<size_t>(tensor_bytes(topk_weights));
  p.has_weights = topk_weights.has_value();
  const TensorSpec input{x.scalar_type(), x.size(0), x.size(1)};
  c10::optional<TensorSpec> aux, aux_out;
  if (topk_weights.has_value()) {
    aux = TensorSpec{at::kFloat, x.size(0), topk_weights->size(1)};
    aux_out = TensorSpec{at::kFloat, tokens, topk_weights->size(1)};
  }
  return std::make_unique<CachedPullCombine>(
      b, comm, handle, std::vector<at::Tensor>{is_token_in_rank, recv_channel_offset, row_of_token}, p, input, aux,
      TensorSpec{x.scalar_type(), tokens, x.size(1)}, aux_out, std::move(config), num_sms);
}

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
  sub.attr("FLAG_SIGNATURE_MISMATCH") = kFlagSignatureMismatch;
  sub.def("em_layout_words", [](int r, int l) { return ExpertMajorLayout::words(r, l); });

  py::class_<IpcBuffer>(sub, "IpcBuffer")
      .def(py::init<int, int, size_t, size_t>(), py::arg("rank"), py::arg("num_ranks"), py::arg("num_bytes"),
           py::arg("num_pool_bytes") = 0)
      .def("ipc_handle", [](const IpcBuffer& b) { return py::bytes(b.ipc_handle()); })
      .def("open_peers",
           [](IpcBuffer& b, const std::vector<py::bytes>& handles) {
             std::vector<std::string> raw(handles.begin(), handles.end());
             b.open_peers(raw);
           })
      .def("close", &IpcBuffer::close)
      .def("destroy", &IpcBuffer::destroy)
      .def("abandon", &IpcBuffer::abandon)
      .def_property_readonly("alive", &IpcBuffer::alive)
      .def_property_readonly("local_ptr", [](const IpcBuffer& b) { return reinterpret_cast<uintptr_t>(b.local()); })
      // The peer pool's tail (runtime/ipc_buffer.h): offset and size; peer_ptrs: every rank's allocation as this
      // process maps it (0 once closed).
      .def_property_readonly("pool_offset", &IpcBuffer::pool_offset)
      .def_property_readonly("pool_bytes", &IpcBuffer::pool_bytes)
      .def("peer_ptrs",
           [](const IpcBuffer& b) {
             std::vector<uintptr_t> ptrs;
             for (int r = 0; r < b.num_ranks(); ++r) ptrs.push_back(reinterpret_cast<uintptr_t>(b.peer(r)));
             return ptrs;
           })
      .def_property_readonly("src_block_bytes", [](const IpcBuffer& b) { return b.common(0).src_block_bytes; })
      .def("timeout_info", &timeout_info)
      // The peer abort (runtime/peer_abort.h): this rank raised in a Buffer call / its next call starts.
      .def("post_abort", &IpcBuffer::post_abort)
      .def("clear_abort_if_posted", &IpcBuffer::clear_abort_if_posted)
      .def("set_abort_targets", &IpcBuffer::set_abort_targets, py::arg("targets"))
      .def("wait_notify", &wait_notify, py::arg("seq"), py::arg("timeout_s"))
      .def("expert_counts", &expert_counts, py::arg("n"))
      .def("take_worst_overflow", &take_worst_overflow)
      .def("take_signature_mismatch", &take_signature_mismatch, py::arg("num_ranks"))
      .def("take_ring_mismatch", &take_ring_mismatch)
      .def("path_counters", &path_counters);

  py::class_<CommStream>(sub, "CommStream")
      .def(py::init<const c10::Stream&>(), py::arg("stream"))
      .def("enter_current", &CommStream::enter_current)
      .def("enter_full_path", &CommStream::enter_full_path, py::arg("joined_any"), py::arg("joined"))
      .def("caller_joined", &CommStream::caller_joined, py::arg("caller"));
  // A plan is a METH_FASTCALL function that owns it (cached_call.h: plan_function) and keeps the buffer and the comm
  // stream it points to referenced.
  sub.def(
      "cached_dispatch",
      [](const py::object& buffer, const py::object& comm, uint64_t timeout_ns, const py::tuple& handle,
         const at::Tensor& recv_channel_offset, const at::Tensor& x, const c10::optional<at::Tensor>& scales,
         int num_channels, int chunk, int num_slots, int slot_bytes, py::object config, int num_sms,
         int64_t ring_signature) {
        return plan_function(make_cached_dispatch(buffer.cast<const IpcBuffer&>(), comm.cast<CommStream&>(),
                                                  timeout_ns, handle, recv_channel_offset, x, scales, num_channels,
                                                  chunk, num_slots, slot_bytes, std::move(config), num_sms,
                                                  ring_signature),
                             {buffer, comm});
      },
      py::arg("buffer"), py::arg("comm"), py::arg("timeout_ns"), py::arg("handle"), py::arg("recv_channel_offset"),
      py::arg("x"), py::arg("scales"), py::arg("num_channels"), py::arg("chunk"), py::arg("num_slots"),
      py::arg("slot_bytes"), py::arg("config"), py::arg("num_sms"), py::arg("ring_signature"));
  sub.def(
      "cached_combine",
      [](const py::object& buffer, const py::object& comm, uint64_t timeout_ns, const py::tuple& handle,
         const at::Tensor& recv_channel_offset, const at::Tensor& x, const c10::optional<at::Tensor>& topk_weights,
         int num_channels, int chunk, int num_slots, int slot_bytes, py::object config, int num_sms,
         int64_t ring_signature) {
        return plan_function(make_cached_combine(buffer.cast<const IpcBuffer&>(), comm.cast<CommStream&>(),
                                                 timeout_ns, handle, recv_channel_offset, x, topk_weights,
                                                 num_channels, chunk, num_slots, slot_bytes, std::move(config),
                                                 num_sms, ring_signature),
                             {buffer, comm});
      },
      py::arg("buffer"), py::arg("comm"), py::arg("timeout_ns"), py::arg("handle"), py::arg("recv_channel_offset"),
      py::arg("x"), py::arg("topk_weights"), py::arg("num_channels"), py::arg("chunk"), py::arg("num_slots"),
      py::arg("slot_bytes"), py::arg("config"), py::arg("num_sms"), py::arg("ring_signature"));

  // IntranodeBackend._pool_block: (uint8 tensor of the block, its offset in the NVLink buffer or -1).
  sub.def(
      "pool_block",
      [](const IpcBuffer& b, int device, c10::MempoolId_t pool_id, int64_t nbytes) {
        MOE_CHECK(nbytes >= 0, "pool_block: nbytes must be >= 0");
        const auto index = static_cast<c10::DeviceIndex>(device);
        const DeviceScope scope(index);
        auto [block, offset] = pool_block(b, index, pool_id, static_cast<size_t>(nbytes),
                                          current_stream(index).stream());
        const int64_t size = static_cast<int64_t>(block.nbytes());
        return py::make_tuple(carve(block, 0, at::kByte, {size}, {1}), offset);
      },
      py::arg("buffer"), py::arg("device"), py::arg("pool_id"), py::arg("nbytes"));
  sub.def(
      "cached_direct_dispatch",
      [](const py::object& buffer, const py::object& comm, uint64_t timeout_ns, const py::tuple& handle,
         const at::Tensor& recv_channel_offset, const at::Tensor& send_row_offset, const at::Tensor& x,
         const c10::optional<at::Tensor>& scales, int num_channels, int chunk, int num_slots, int slot_bytes,
         py::object config, int num_sms, int64_t ring_signature, c10::MempoolId_t pool_id, const py::list& latest) {
        return plan_function(
            make_cached_direct_dispatch(buffer.cast<const IpcBuffer&>(), comm.cast<CommStream&>(), timeout_ns, handle,
                                        recv_channel_offset, send_row_offset, x, scales, num_channels, chunk,
                                        num_slots, slot_bytes, std::move(config), num_sms, ring_signature, pool_id,
                                        latest),
            {buffer, comm, latest});
      },
      py::arg("buffer"), py::arg("comm"), py::arg("timeout_ns"), py::arg("handle"), py::arg("recv_channel_offset"),
      py::arg("send_row_offset"), py::arg("x"), py::arg("scales"), py::arg("num_channels"), py::arg("chunk"),
      py::arg("num_slots"), py::arg("slot_bytes"), py::arg("config"), py::arg("num_sms"), py::arg("ring_signature"),
      py::arg("pool_id"), py::arg("latest"));
  sub.def(
      "cached_pull_combine",
      [](const py::object& buffer, const py::object& comm, uint64_t timeout_ns, const py::tuple& handle,
         const at::Tensor& recv_channel_offset, const at::Tensor& row_of_token, const at::Tensor& x,
         const c10::optional<at::Tensor>& topk_weights, int num_channels, int chunk, int num_slots, int slot_bytes,
         py::object config, int num_sms, int64_t ring_signature) {
        return plan_function(make_cached_pull_combine(buffer.cast<const IpcBuffer&>(), comm.cast<CommStream&>(),
                                                      timeout_ns, handle, recv_channel_offset, row_of_token, x,
                                                      topk_weights, num_channels, chunk, num_slots, slot_bytes,
                                                      std::move(config), num_sms, ring_signature),
                             {buffer, comm});
      },
      py::arg("buffer"), py::arg("comm"), py::arg("timeout_ns"), py::arg("handle"), py::arg("recv_channel_offset"),
      py::arg("row_of_token"), py::arg("x"), py::arg("topk_weights"), py::arg("num_channels"), py::arg("chunk"),
      py::arg("num_slots"), py::arg("slot_bytes"), py::arg("config"), py::arg("num_sms"), py::arg("ring_signature"));

  // get_dispatch_layout (layout_call.h: layout_call_on).
  sub.def(
      "layout_call", &layout_call_on,
      py::arg("topk_idx"), py::arg("num_experts"), py::arg("num_ranks"), py::arg("nvl_size"),
      py::arg("buffer") = nullptr);
  sub.def("notify", &notify, py::arg("buffer"), py::arg("timeout_ns"), py::arg("is_token_in_rank"),
          py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_expert"), py::arg("num_channels"),
          py::arg("expert_alignment"), py::arg("num_worst_tokens"), py::arg("seq"), py::arg("rank_prefix_matrix"),
          py::arg("recv_channel_offset"), py::arg("em_layout") = py::none(), py::arg("signature_hash") = 0,
          py::arg("problem") = 0, py::arg("send_row_offset") = py::none());
  sub.def("dispatch", &dispatch, py::arg("buffer"), py::arg("timeout_ns"), py::arg("x"), py::arg("scales"),
          py::arg("topk_idx"), py::arg("topk_weights"), py::arg("is_token_in_rank"), py::arg("recv_channel_offset"),
          py::arg("recv_x"), py::arg("recv_scales"), py::arg("recv_topk_idx"), py::arg("recv_topk_weights"),
          py::arg("recv_src_idx"), py::arg("experts_per_rank"), py::arg("pad_rows"), py::arg("num_channels"),
          py::arg("chunk"), py::arg("num_slots"), py::arg("slot_bytes"));
  sub.def("direct_dispatch", &direct_dispatch, py::arg("buffer"), py::arg("timeout_ns"), py::arg("x"),
          py::arg("scales"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("is_token_in_rank"),
          py::arg("recv_channel_offset"), py::arg("send_row_offset"), py::arg("payload"), py::arg("out_offset"),
          py::arg("meta"), py::arg("meta_offset"), py::arg("rows"), py::arg("experts_per_rank"), py::arg("pad_rows"),
          py::arg("num_channels"), py::arg("chunk"), py::arg("num_slots"), py::arg("slot_bytes"),
          py::arg("ring_signature") = 0, py::arg("row_of_token") = py::none());
  // Bytes of a direct dispatch's output blocks for `rows` rows (DirectPayload / DirectMeta: the layouts' one
  // source).
  sub.def(
      "direct_payload_bytes",
      [](int64_t rows, int64_t hidden_bytes, int64_t num_scales) {
        return DirectPayload{rows, hidden_bytes, num_scales}.bytes();
      },
      py::arg("rows"), py::arg("hidden_bytes"), py::arg("num_scales"));
  sub.def(
      "direct_meta_bytes", [](int64_t rows, int64_t num_topk) { return DirectMeta{rows, num_topk}.bytes(); },
      py::arg("rows"), py::arg("num_topk"));
  sub.def("combine", &combine, py::arg("buffer"), py::arg("timeout_ns"), py::arg("x"), py::arg("topk_weights"),
          py::arg("bias0"), py::arg("bias1"), py::arg("is_token_in_rank"), py::arg("recv_channel_offset"),
          py::arg("out"), py::arg("out_topk_weights"), py::arg("num_channels"), py::arg("chunk"),
          py::arg("num_slots"), py::arg("slot_bytes"), py::arg("ring_signature"), py::arg("row_of_token") = py::none());
  sub.def("em_permute", &em_permute, py::arg("x"), py::arg("scales"), py::arg("recv_topk_idx"),
          py::arg("recv_topk_weights"), py::arg("pair_rank"), py::arg("layout"), py::arg("received"), py::arg("em_x"),
          py::arg("em_scales"), py::arg("em_weights"), py::arg("em_pair_row"), py::arg("em_pair_slot"),
          py::arg("em_inverse"), py::arg("recv_src_idx"), py::arg("num_ranks"), py::arg("num_local"),
          py::arg("expert_alignment"), py::arg("pad_blocks"));
  sub.def("em_unpermute", &em_unpermute, py::arg("x"), py::arg("inverse"), py::arg("weights"),
          py::arg("topk_weights"), py::arg("received"), py::arg("out"), py::arg("out_topk_weights"));
  sub.def("pair_rank", &pair_rank, py::arg("topk_idx"), py::arg("num_experts"), py::arg("out"),
          py::arg("row_limit") = py::none());
}

}  // namespace moe_ep
