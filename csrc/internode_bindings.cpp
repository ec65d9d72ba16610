// Python bindings of the internode (several NVLink domains) normal-mode backend. Glue only: tensors
// cross as raw device addresses, streams as cudaStream_t ints; moe_dispatcher/compiled/internode.py
// validates and allocates everything. The domain's NVLink buffer is an intranode.IpcBuffer (its
// mailbox, wait_notify, expert_counts and take_worst_overflow are reused as they are); the NVSHMEM
// buffer is allocated by the Python side through moe_dispatcher.runtime.nvshmem.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <vector>

#include "bindings.h"
#include "ipc_bindings.h"
#include "kernels/common/layout.h"
#include "kernels/internode/protocol.h"
#include "runtime/cuda_check.h"
#include "runtime/ipc_buffer.h"

namespace py = pybind11;

namespace moe_dispatcher {
namespace {

using namespace internode;

// Everything a kernel needs about this rank's two buffers, built once per backend.
struct Context {
  Common c{};
};

Context make_context(const IpcBuffer& b, uintptr_t rdma, int rank, int num_ranks, int nvl_size,
                     const std::vector<int64_t>& layout) {
  MOE_CHECK(layout.size() == 10, "internode layout: 10 values expected");
  MOE_CHECK(nvl_size >= 1 && nvl_size <= kMaxNvl && num_ranks % nvl_size == 0, "bad NVLink domain size");
  MOE_CHECK(num_ranks <= kMaxRanks && num_ranks / nvl_size <= kMaxDomains, "too many ranks for the internode kernels");
  MOE_CHECK(b.num_ranks() == nvl_size && b.rank() == rank % nvl_size, "the IpcBuffer must span this rank's domain");
  const intranode::Common ic = b.common(0);
  Context ctx;
  Common& c = ctx.c;
  for (int j = 0; j < kMaxNvl; ++j) c.nvl[j] = ic.peers[j];
  c.rdma = reinterpret_cast<uint8_t*>(rdma);
  c.rank = rank;
  c.num_ranks = num_ranks;
  c.nvl_size = nvl_size;
  c.num_domains = num_ranks / nvl_size;
  c.local = rank % nvl_size;
  c.domain = rank / nvl_size;
  c.mailbox = ic.mailbox;
  Layout& l = c.layout;
  l.rdma_msg_offset = layout[0];
  l.rdma_msg_staging_offset = layout[1];
  l.rdma_recv_offset = layout[2];
  l.rdma_send_offset = layout[3];
  l.rdma_domain_bytes = layout[4];
  l.rdma_msg_ints = static_cast<int>(layout[5]);
  l.nvl_msg_offset = layout[6];
  l.nvl_msg_ints = static_cast<int>(layout[7]);
  l.nvl_rings_offset = layout[8];
  l.nvl_src_block_bytes = layout[9];
  return ctx;
}

Common with_timeout(const Context& ctx, uint64_t timeout_ns) {
  Common c = ctx.c;
  c.timeout_ns = timeout_ns;
  return c;
}

std::string phase_name(int phase) {
  switch (phase) {
    case kPhaseNotifyTeam: return "internode notify (waiting for a team member's counts over NVSHMEM)";
    case kPhaseNotifyDomain: return "internode notify (barrier inside the NVLink domain)";
    case kPhaseRdmaSend: return "rdma send (dispatch sender waiting for free slots at a forwarder)";
    case kPhaseForward: return "forward (dispatch forwarder waiting for rows over NVSHMEM)";
    case kPhaseForwardSend: return "forward (dispatch forwarder waiting for free NVLink ring slots)";
    case kPhaseNvlRecv: return "nvl receive (dispatch receiver waiting for rows from a forwarder)";
    case kPhaseCombineNvlSend: return "combine nvl send (waiting for free ring slots at a forwarder)";
    case kPhaseCombineForward: return "combine forward (forwarder waiting for rows from a local rank)";
    case kPhaseCombineRdmaSend: return "combine rdma send (forwarder waiting for free slots at the source)";
    case kPhaseCombineRecv: return "combine receive (source waiting for partial sums)";
    case kPhaseRdmaDrain: return "rdma drain (waiting for a team member to finish the previous call)";
    case kPhaseNvlDrain: return "nvl drain (waiting for a local rank to finish the previous call)";
    default: return "unknown phase " + std::to_string(phase);
  }
}

py::object timeout_info(const IpcBuffer& b) { return mailbox_timeout_info(b, phase_name); }

int num_forward(const IpcBuffer& b) { return b.host_mailbox()->num_forward; }

void layout(uintptr_t topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks, int nvl_size,
            uintptr_t num_tokens_per_rank, uintptr_t num_tokens_per_domain, uintptr_t num_tokens_per_expert,
            uintptr_t is_token_in_rank, uintptr_t stream) {
  DispatchLayoutArgs a{ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_experts, num_ranks, nvl_size,
                       ptr<int>(num_tokens_per_rank), ptr<int>(num_tokens_per_domain),
                       ptr<int>(num_tokens_per_expert), ptr<bool>(is_token_in_rank)};
  launch_dispatch_layout(a, stream_of(stream));
}

void notify(const Context& ctx, uint64_t timeout_ns, uintptr_t is_token_in_rank, uintptr_t num_tokens_per_rank,
            uintptr_t num_tokens_per_expert, int num_tokens, int num_experts, int num_channels, int expert_alignment,
            int num_worst_tokens, int seq, uintptr_t rank_prefix_matrix, uintptr_t recv_channel_offset,
            uintptr_t fwd_offset, uintptr_t stream) {
  NotifyArgs a{};
  a.c = with_timeout(ctx, timeout_ns);
  MOE_CHECK(num_channels >= 1 && num_channels <= kMaxChannels, "bad channel count");
  MOE_CHECK(num_experts / a.c.num_ranks <= kMaxLocalExperts, "too many local experts");
  MOE_CHECK(1 + a.c.num_ranks + num_channels + a.c.nvl_size * (num_channels + num_experts / a.c.num_ranks) <=
                a.c.layout.rdma_msg_ints,
            "internode notify message larger than its slot");
  set_notify_counts(a, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, num_tokens, num_experts,
                    num_channels, expert_alignment, num_worst_tokens, seq, rank_prefix_matrix, recv_channel_offset);
  a.fwd_offset = ptr<int>(fwd_offset);
  launch_notify(a, stream_of(stream));
}

// Geometry: (num_channels, nvl_chunk, nvl_slots, nvl_slot_bytes, rdma_chunk, rdma_slots, rdma_slot_bytes).
void check_geometry(const Common& c, int channels, int nvl_slots, int nvl_slot_bytes, int rdma_slots,
                    int rdma_slot_bytes) {
  MOE_CHECK(channels >= 1 && channels <= kMaxChannels, "bad channel count");
  MOE_CHECK(static_cast<size_t>(channels) * nvl_slots * nvl_slot_bytes <= c.layout.nvl_src_block_bytes,
            "NVLink buffer too small for this config");
  MOE_CHECK(static_cast<size_t>(channels) * rdma_slots * rdma_slot_bytes <= c.layout.rdma_domain_bytes,
            "NVSHMEM buffer too small for this config");
}

// The geometry that dispatch and combine (Args) share into `a` (a.c set), checked; combine has no RDMA chunk
// (its forwarders send chunk_tokens rows at a time), dispatch takes geometry[4] itself.
template <typename Args>
void set_geometry(Args& a, const std::vector<int>& geometry) {
  MOE_CHECK(geometry.size() == 7, "geometry: 7 values expected");
  a.num_channels = geometry[0];
  a.nvl_chunk = geometry[1];
  a.nvl_slots = geometry[2];
  a.nvl_slot_bytes = geometry[3];
  a.rdma_slots = geometry[5];
  a.rdma_slot_bytes = geometry[6];
  check_geometry(a.c, a.num_channels, a.nvl_slots, a.nvl_slot_bytes, a.rdma_slots, a.rdma_slot_bytes);
}

void dispatch(const Context& ctx, uint64_t timeout_ns, uintptr_t x, uintptr_t scales, uintptr_t topk_idx,
              uintptr_t topk_weights, uintptr_t is_token_in_rank, uintptr_t recv_channel_offset, uintptr_t fwd_offset,
              uintptr_t fwd_mask, int fwd_capacity, uintptr_t recv_x, uintptr_t recv_scales, uintptr_t recv_topk_idx,
              uintptr_t recv_topk_weights, uintptr_t recv_src_idx, int num_tokens, int hidden_bytes, int num_scales,
              int num_topk, int experts_per_rank, int num_rows, int pad_rows, const std::vector<int>& geometry,
              uintptr_t stream) {
  DispatchArgs a{};
  a.c = with_timeout(ctx, timeout_ns);
  set_geometry(a, geometry);
  a.rdma_chunk = geometry[4];
  MOE_CHECK(a.nvl_chunk >= 1 && a.nvl_chunk <= kMaxChunk && a.nvl_chunk <= a.nvl_slots, "bad NVLink chunk");
  MOE_CHECK(a.rdma_chunk >= 1 && a.rdma_chunk <= kMaxChunk && a.rdma_chunk <= a.rdma_slots, "bad RDMA chunk");
  a.x = ptr<const uint8_t>(x);
  a.scales = ptr<const int32_t>(scales);
  a.topk_idx = ptr<const int64_t>(topk_idx);
  a.topk_weights = ptr<const float>(topk_weights);
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.recv_channel_offset = ptr<const int>(recv_channel_offset);
  a.fwd_offset = ptr<const int>(fwd_offset);
  a.fwd_mask = ptr<int>(fwd_mask);
  a.fwd_capacity = fwd_capacity;
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
  launch_dispatch(a, stream_of(stream));
}

void combine(const Context& ctx, uint64_t timeout_ns, uintptr_t x, uintptr_t topk_weights, uintptr_t bias0,
             uintptr_t bias1, uintptr_t is_token_in_rank, uintptr_t recv_channel_offset, uintptr_t fwd_offset,
             uintptr_t fwd_mask, int fwd_capacity, uintptr_t out, uintptr_t out_topk_weights, int dtype, int num_tokens,
             int hidden, int num_topk, int num_x_rows, const std::vector<int>& geometry, uintptr_t stream) {
  CombineArgs a{};
  a.c = with_timeout(ctx, timeout_ns);
  set_geometry(a, geometry);
  // Progress (docs/internode.md): a forwarder chunk's rows must fit beside a sender chunk in the NVLink
  // ring, and two chunks in the RDMA ring. Checked for the largest chunk, so that every chunk_tokens
  // fits whatever the call's size.
  MOE_CHECK(a.nvl_slots >= a.nvl_chunk + kMaxCombineChunk,
            "combine needs num_max_nvl_chunked_recv_tokens >= send tokens + 32");
  MOE_CHECK(a.rdma_slots >= 2 * kMaxCombineChunk, "combine needs num_max_rdma_chunked_recv_tokens >= 64");
  // Tokens per warp chunk of the forwarder and the receiver, from the tokens per channel, so that small calls
  // still spread over the worker warps (15 per block). Every chunk size drains the same rings and sums in the
  // same order (the same bits).
  const int per_channel = (num_tokens + a.num_channels - 1) / a.num_channels;
  a.chunk_tokens = std::clamp((per_channel + 14) / 15, 1, 8);
  a.x = ptr<const uint8_t>(x);
  a.topk_weights = ptr<const float>(topk_weights);
  a.bias0 = ptr<const uint8_t>(bias0);
  a.bias1 = ptr<const uint8_t>(bias1);
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.recv_channel_offset = ptr<const int>(recv_channel_offset);
  a.fwd_offset = ptr<const int>(fwd_offset);
  a.fwd_mask = ptr<const int>(fwd_mask);
  a.fwd_capacity = fwd_capacity;
  a.out = ptr<uint8_t>(out);
  a.out_topk_weights = ptr<float>(out_topk_weights);
  a.dtype = dtype;
  a.num_tokens = num_tokens;
  a.hidden = hidden;
  a.num_topk = num_topk;
  a.num_x_rows = num_x_rows;
  launch_combine(a, stream_of(stream));
}

}  // namespace

void register_internode(py::module_& m) {
  auto sub = m.def_submodule("internode", "Normal-mode internode kernels (NVSHMEM across domains, NVLink inside)");
  sub.attr("MAX_RANKS") = kMaxRanks;
  sub.attr("MAX_DOMAINS") = kMaxDomains;
  sub.attr("MAX_NVL") = kMaxNvl;
  sub.attr("MAX_CHANNELS") = kMaxChannels;
  sub.attr("MAX_LOCAL_EXPERTS") = kMaxLocalExperts;
  sub.attr("MAX_TOPK") = kMaxTopk;
  sub.attr("MAX_CHUNK") = kMaxChunk;
  sub.attr("RDMA_CONTROL_BYTES") = kRdmaControlBytes;
  sub.attr("NVL_CONTROL_BYTES") = intranode::kRingsOffset;

  py::class_<Context>(sub, "Context");
  sub.def("make_context", &make_context, py::arg("ipc"), py::arg("rdma"), py::arg("rank"), py::arg("num_ranks"),
          py::arg("nvl_size"), py::arg("layout"));
  sub.def("timeout_info", &timeout_info, py::arg("ipc"));
  sub.def("num_forward", &num_forward, py::arg("ipc"));
  sub.def("layout", &layout, py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_experts"),
          py::arg("num_ranks"), py::arg("nvl_size"), py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_domain"),
          py::arg("num_tokens_per_expert"), py::arg("is_token_in_rank"), py::arg("stream"));
  sub.def("notify", &notify, py::arg("ctx"), py::arg("timeout_ns"), py::arg("is_token_in_rank"),
          py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_expert"), py::arg("num_tokens"),
          py::arg("num_experts"), py::arg("num_channels"), py::arg("expert_alignment"), py::arg("num_worst_tokens"),
          py::arg("seq"), py::arg("rank_prefix_matrix"), py::arg("recv_channel_offset"), py::arg("fwd_offset"),
          py::arg("stream"));
  sub.def("dispatch", &dispatch);
  sub.def("combine", &combine);
}

}  // namespace moe_dispatcher
