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
py::object timeout_info(const IpcBuffer& b) {
  const volatile TimeoutRecord* rec = &b.host_mailbox()->timeout;
  if (rec->status == 0) return py::none();
  return py::make_tuple(rec->phase, phase_name(rec->phase), rec->rank, rec->peer);
}

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
  LayoutArgs a{ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_experts, num_ranks,
               ptr<int>(num_tokens_per_rank), ptr<int>(num_tokens_per_expert), ptr<bool>(is_token_in_rank)};
  launch_layout(a, stream_of(stream));
}

void notify(const IpcBuffer& b, uint64_t timeout_ns, uintptr_t is_token_in_rank, uintptr_t num_tokens_per_rank,
            uintptr_t num_tokens_per_expert, int num_tokens, int num_experts, int num_channels,
            int expert_alignment, int num_worst_tokens, int seq, uintptr_t rank_prefix_matrix,
            uintptr_t recv_channel_offset, uintptr_t stream, uintptr_t em_layout) {
  NotifyArgs a{};
  a.em_layout = ptr<int>(em_layout);
  a.c = b.common(timeout_ns);
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.num_tokens_per_rank = ptr<const int>(num_tokens_per_rank);
  a.num_tokens_per_expert = ptr<const int>(num_tokens_per_expert);
  a.num_tokens = num_tokens;
  a.num_experts = num_experts;
  a.num_channels = num_channels;
  a.expert_alignment = expert_alignment;
  a.num_worst_tokens = num_worst_tokens;
  a.seq = seq;
  a.rank_prefix_matrix = ptr<int>(rank_prefix_matrix);
  a.recv_channel_offset = ptr<int>(recv_channel_offset);
  launch_notify(a, stream_of(stream));
}

void dispatch(const IpcBuffer& b, uint64_t timeout_ns, uintptr_t x, uintptr_t scales, uintptr_t topk_idx,
              uintptr_t topk_weights, uintptr_t is_token_in_rank, uintptr_t recv_channel_offset, uintptr_t recv_x,
              uintptr_t recv_scales, uintptr_t recv_topk_idx, uintptr_t recv_topk_weights, uintptr_t recv_src_idx,
              int num_tokens, int hidden_bytes, int num_scales, int num_topk, int experts_per_rank, int num_rows,
              int pad_rows, int num_channels, int chunk, int num_slots, int slot_bytes, uintptr_t stream, int em_mode,
              uintptr_t pair_rank, uintptr_t em_layout, uintptr_t em_x, uintptr_t em_scales, uintptr_t em_weights,
              uintptr_t em_pair_row, uintptr_t em_pair_slot, uintptr_t em_inverse, int em_topk, int em_rows,
              int protocol) {
  DispatchArgs a{};
  MOE_CHECK(protocol == kChunked || protocol == kStream, "unknown ring protocol");
  a.protocol = protocol;
  MOE_CHECK(em_mode >= 0 && em_mode <= 2, "bad em_mode");
  MOE_CHECK(em_mode == 0 || (em_layout != 0 && em_inverse != 0 && em_topk > 0 && em_topk <= kMaxTopk),
            "expert-major dispatch needs the layout table and the inverse table");
  MOE_CHECK(em_mode != 1 || (pair_rank != 0 && em_pair_row != 0 && em_pair_slot != 0 && em_topk == num_topk),
            "fresh expert-major dispatch needs pair ranks and pair_row/pair_slot");
  a.em_mode = em_mode;
  a.pair_rank = ptr<const int>(pair_rank);
  a.em_layout = ptr<const int>(em_layout);
  a.em_x = ptr<uint8_t>(em_x);
  a.em_scales = ptr<int32_t>(em_scales);
  a.em_weights = ptr<float>(em_weights);
  a.em_pair_row = ptr<int>(em_pair_row);
  a.em_pair_slot = ptr<int>(em_pair_slot);
  a.em_inverse = ptr<int>(em_inverse);
  a.em_topk = em_topk;
  a.em_rows = em_rows;
  a.c = b.common(timeout_ns);
  MOE_CHECK(static_cast<size_t>(num_channels) * num_slots * slot_bytes <= a.c.src_block_bytes,
            "NVLink buffer too small for this config");
  a.x = ptr<const uint8_t>(x);
  a.scales = ptr<const int32_t>(scales);
  a.topk_idx = ptr<const int64_t>(topk_idx);
  a.topk_weights = ptr<const float>(topk_weights);
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.recv_channel_offset = ptr<const int>(recv_channel_offset);
  a.recv_x = ptr<uint8_t>(recv_x);
  a.recv_scales = ptr<int32_t>(recv_scales);
  a.recv_topk_idx = ptr<int64_t>(recv_topk_idx);
  a.recv_topk_weights = ptr<float>(recv_topk_weights);
  a.recv_src_idx = ptr<int>(recv_src_idx);
  a.num_tokens = num_tokens;
  a.hidden_bytes = hidden_bytes;
  a.num_scales = num_scales;
  a.num_topk = num_topk;
  a.experts_per_rank = experts_per_rank;
  a.num_rows = num_rows;
  a.pad_rows = pad_rows;
  a.num_channels = num_channels;
  a.chunk = chunk;
  a.num_slots = num_slots;
  a.slot_bytes = slot_bytes;
  launch_dispatch(a, stream_of(stream));
}

void combine(const IpcBuffer& b, uint64_t timeout_ns, uintptr_t x, uintptr_t topk_weights, uintptr_t bias0,
             uintptr_t bias1, uintptr_t is_token_in_rank, uintptr_t recv_channel_offset, uintptr_t out,
             uintptr_t out_topk_weights, int dtype, int num_tokens, int hidden, int num_topk, int num_x_rows,
             int num_channels,
             int chunk, int num_slots, int slot_bytes, uintptr_t stream, uintptr_t em_inverse, uintptr_t em_weights,
             uintptr_t em_topk_weights, int em_topk, int protocol) {
  CombineArgs a{};
  MOE_CHECK(protocol == kChunked || protocol == kStream, "unknown ring protocol");
  a.protocol = protocol;
  MOE_CHECK(em_inverse == 0 || (em_topk > 0 && em_topk <= kMaxTopk), "expert-major combine: bad top-k");
  MOE_CHECK(em_inverse == 0 || num_topk == (em_topk_weights != 0 ? em_topk : 0),
            "expert-major combine: num_topk must be em_topk with topk_weights, else 0");
  a.em_inverse = ptr<const int>(em_inverse);
  a.em_weights = ptr<const float>(em_weights);
  a.em_topk_weights = ptr<const float>(em_topk_weights);
  a.em_topk = em_topk;
  // Tokens per receiver batch: as many 32-token windows as fit beside a sender chunk in the ring.
  a.batch_windows = std::min(kMaxWindows, (num_slots - chunk) / 32);
  MOE_CHECK(a.batch_windows >= 1, "combine needs num_max_nvl_chunked_recv_tokens >= send tokens + 32");
  a.c = b.common(timeout_ns);
  MOE_CHECK(static_cast<size_t>(num_channels) * num_slots * slot_bytes <= a.c.src_block_bytes,
            "NVLink buffer too small for this config");
  a.x = ptr<const uint8_t>(x);
  a.topk_weights = ptr<const float>(topk_weights);
  a.bias0 = ptr<const uint8_t>(bias0);
  a.bias1 = ptr<const uint8_t>(bias1);
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.recv_channel_offset = ptr<const int>(recv_channel_offset);
  a.out = ptr<uint8_t>(out);
  a.out_topk_weights = ptr<float>(out_topk_weights);
  a.dtype = dtype;
  a.num_tokens = num_tokens;
  a.hidden = hidden;
  a.num_topk = num_topk;
  a.num_x_rows = num_x_rows;
  a.num_channels = num_channels;
  a.chunk = chunk;
  a.num_slots = num_slots;
  a.slot_bytes = slot_bytes;
  launch_combine(a, stream_of(stream));
}

// Split expert-major combine, local pre-pass: rank-major rows out [num_x_rows, hidden] (and out_topk_weights
// [num_x_rows, em_topk] when em_topk_weights is given) from expert-major rows x through em_inverse.
void em_unpermute(uintptr_t x, uintptr_t em_inverse, uintptr_t em_weights, uintptr_t em_topk_weights,
                  uintptr_t recv_channel_offset, uintptr_t out, uintptr_t out_topk_weights, int dtype, int hidden,
                  int num_x_rows, int em_topk, int num_ranks, int num_channels, int num_blocks, uintptr_t stream) {
  MOE_CHECK(em_inverse != 0 && em_topk > 0 && em_topk <= kMaxTopk, "em_unpermute: bad inverse or top-k");
  MOE_CHECK((em_topk_weights != 0) == (out_topk_weights != 0),
            "em_unpermute: topk_weights and out_topk_weights go together");
  MOE_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks && num_channels >= 1 && num_channels <= kMaxChannels,
            "em_unpermute: bad ranks or channels");
  CombineArgs a{};
  a.c.num_ranks = num_ranks;
  a.x = ptr<const uint8_t>(x);
  a.em_inverse = ptr<const int>(em_inverse);
  a.em_weights = ptr<const float>(em_weights);
  a.em_topk_weights = ptr<const float>(em_topk_weights);
  a.em_topk = em_topk;
  a.recv_channel_offset = ptr<const int>(recv_channel_offset);
  a.out = ptr<uint8_t>(out);
  a.out_topk_weights = ptr<float>(out_topk_weights);
  a.dtype = dtype;
  a.hidden = hidden;
  a.num_x_rows = num_x_rows;
  a.num_channels = num_channels;
  launch_em_unpermute(a, num_blocks, stream_of(stream));
}

void pair_rank(uintptr_t topk_idx, int num_tokens, int num_topk, int num_experts, uintptr_t out,
               uintptr_t workspace, uintptr_t stream) {
  MOE_CHECK(num_experts > 0 && num_experts <= kMaxLocalExperts * kMaxRanks, "pair_rank: too many experts");
  PairRankArgs a{ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_experts, ptr<int>(out), ptr<int>(workspace)};
  launch_pair_rank(a, stream_of(stream));
}

}  // namespace

void register_intranode(py::module_& m) {
  auto sub = m.def_submodule("intranode", "Normal-mode intranode kernels over NVLink (CUDA IPC)");
  sub.attr("MAX_RANKS") = kMaxRanks;
  sub.attr("MAX_CHANNELS") = kMaxChannels;
  sub.attr("MAX_LOCAL_EXPERTS") = kMaxLocalExperts;
  sub.attr("MAX_TOPK") = kMaxTopk;
  sub.attr("MAX_CHUNK") = kMaxChunk;
  sub.attr("MAX_COMBINE_WINDOWS") = kMaxWindows;
  sub.attr("RINGS_OFFSET") = kRingsOffset;
  sub.attr("FLAG_LAYOUT_MISMATCH") = kFlagLayoutMismatch;
  sub.attr("PAIR_RANK_TOKENS") = kPairRankTokens;
  sub.attr("PROTOCOL_CHUNKED") = static_cast<int>(kChunked);
  sub.attr("PROTOCOL_STREAM") = static_cast<int>(kStream);
  sub.def("em_layout_words", [](int r, int l) { return ExpertMajorLayout::words(r, l); });
  sub.def("pair_rank", &pair_rank, py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"),
          py::arg("num_experts"), py::arg("out"), py::arg("workspace"), py::arg("stream"));

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
  sub.def("em_unpermute", &em_unpermute, py::arg("x"), py::arg("em_inverse"), py::arg("em_weights"),
          py::arg("em_topk_weights"), py::arg("recv_channel_offset"), py::arg("out"), py::arg("out_topk_weights"),
          py::arg("dtype"), py::arg("hidden"), py::arg("num_x_rows"), py::arg("em_topk"), py::arg("num_ranks"),
          py::arg("num_channels"), py::arg("num_blocks"), py::arg("stream"));
}

}  // namespace moe_dispatcher
