// Python bindings of the internode (several NVLink domains) normal-mode backend. Glue only: launchers take
// tensors (optional ones as None) and launch on the current stream of their device; moe_dispatcher/
// compiled/internode.py validates the user's inputs and allocates the outputs; here only invariants are
// checked. The two buffers' layout is computed here from their sizes (buffer_layout: the one formula).
// The domain's NVLink buffer is an intranode.IpcBuffer (its mailbox, wait_notify, expert_counts and
// take_worst_overflow are reused as they are); the NVSHMEM buffer is allocated by the Python side through
// moe_dispatcher.runtime.nvshmem.
#include <torch/extension.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "bindings.h"
#include "bindings/cached_call.h"
#include "bindings/carve.h"
#include "bindings/direct_outputs.h"
#include "bindings/layout_call.h"
#include "bindings/stream_join.h"
#include "ipc_bindings.h"
#include "kernels/common/layout.h"
#include "kernels/internode/protocol.h"
#include "runtime/cuda_check.h"
#include "runtime/ipc_buffer.h"

namespace py = pybind11;

namespace moe_ep {

// The largest combine chunk (tokens per worker warp chunk). Smaller chunks start the forwarders' puts and the
// receivers' reductions sooner and spread a channel's tokens more evenly over the 15 forwarder and 15-30 receiver
// warps; the per-chunk waits and credits cost less than that wins down to 4 (4 x H200, 2 x 2 domains, 4096 tokens,
// Config(24), us per combine, pool / no pool: cap 4 616 / 791, 5 633, 6 644, 8 667 / 835, 12 838, 16 1015 / 1198;
// docs/internode.md).
constexpr int kCombineChunkCap = 4;

namespace {

using namespace internode;

// Everything a kernel needs about this rank's two buffers, built once per backend.
struct Context {
  Common c{};
};

constexpr int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

// Byte offsets of this rank's two buffers (protocol.h describes the regions), from their sizes. NVSHMEM buffer:
// control, team messages [2][D][rdma_msg_ints] and their staging copy, then D receive blocks and D send-staging
// blocks of rdma_domain_bytes each (fixed for the buffer's life, so a ring of one domain never moves onto
// another's between calls). NVLink buffer: the intranode control words, domain messages [2][R][nvl_msg_ints],
// then one ring block per source local rank. (Config's size hints, moe_dispatcher/config.py, repeat the
// headers' arithmetic so that they work without the extension; tests/kernels/test_internode_gpu.py compares them.)
Layout buffer_layout(int num_ranks, int nvl_size, int64_t num_rdma_bytes, int64_t num_nvl_bytes) {
  MOE_CHECK(nvl_size >= 1 && nvl_size <= kMaxNvl && num_ranks % nvl_size == 0, "bad NVLink domain size");
  const int64_t d = num_ranks / nvl_size;
  Layout l{};
  l.rdma_msg_ints =
      static_cast<int>(round_up(1 + num_ranks + kMaxChannels + nvl_size * (kMaxChannels + kMaxLocalExperts), 16));
  const int64_t msg_bytes = round_up(2 * d * l.rdma_msg_ints * 4, 4096);
  const int64_t recv = static_cast<int64_t>(kRdmaControlBytes) + 2 * msg_bytes;
  const int64_t rdma_block = std::max<int64_t>(0, (num_rdma_bytes - recv) / (2 * d) / 128 * 128);
  l.rdma_msg_offset = kRdmaControlBytes;
  l.rdma_msg_staging_offset = kRdmaControlBytes + msg_bytes;
  l.rdma_recv_offset = recv;
  l.rdma_send_offset = recv + d * rdma_block;
  l.rdma_domain_bytes = rdma_block;
  l.nvl_msg_ints = static_cast<int>(round_up(1 + num_ranks + kMaxChannels + kMaxLocalExperts, 16));
  const int64_t rings = round_up(static_cast<int64_t>(intranode::kRingsOffset) + 2 * num_ranks * l.nvl_msg_ints * 4,
                                 4096);
  l.nvl_msg_offset = intranode::kRingsOffset;
  l.nvl_rings_offset = rings;
  l.nvl_src_block_bytes = std::max<int64_t>(0, (num_nvl_bytes - rings) / nvl_size / 128 * 128);
  return l;
}

py::dict layout_dict(const Layout& l) {
  py::dict d;
  d["rdma_msg_offset"] = l.rdma_msg_offset;
  d["rdma_msg_staging_offset"] = l.rdma_msg_staging_offset;
  d["rdma_recv_offset"] = l.rdma_recv_offset;
  d["rdma_send_offset"] = l.rdma_send_offset;
  d["rdma_domain_bytes"] = l.rdma_domain_bytes;
  d["rdma_msg_ints"] = l.rdma_msg_ints;
  d["nvl_msg_offset"] = l.nvl_msg_offset;
  d["nvl_msg_ints"] = l.nvl_msg_ints;
  d["nvl_rings_offset"] = l.nvl_rings_offset;
  d["nvl_src_block_bytes"] = l.nvl_src_block_bytes;
  return d;
}

Context make_context(const IpcBuffer& b, uintptr_t rdma, int rank, int num_ranks, int nvl_size,
                     int64_t num_rdma_bytes) {
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
  c.layout = buffer_layout(num_ranks, nvl_size, num_rdma_bytes, static_cast<int64_t>(b.num_bytes()));
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
    case kPhaseNvlDirectReady: return "nvl direct ready (dispatch waiting for a domain peer's kernel to start)";
    case kPhaseNvlDirectArrive:
      return "nvl direct arrive (dispatch waiting for a domain peer's blocks to finish writing its rows here)";
    case kPhaseNvlPullReady: return "nvl pull ready (combine waiting for a domain peer's kernel to start)";
    case kPhaseNvlPullArrive:
      return "nvl pull arrive (combine waiting for a domain peer to finish reading this rank's rows)";
    case kPhaseCombinePut:
      return "combine put (pull mode: the put block waiting for this rank's forwarder to stage partial sums)";
    default: return "unknown phase " + std::to_string(phase);
  }
}

py::object timeout_info(const IpcBuffer& b) { return mailbox_timeout_info(b, phase_name); }

int num_forward(const IpcBuffer& b) { return b.host_mailbox()->num_forward; }

// notify of a fresh dispatch: T = rows of is_token_in_rank, E = elements of num_tokens_per_expert;
// recv_expert_counts (int32 [E / R], or None) receives the padded per-local-expert counts on the device;
// signature_hash / problem: this rank's call signature and problem word (moe_dispatcher/signature.py).
void notify(const Context& ctx, uint64_t timeout_ns, const at::Tensor& is_token_in_rank,
            const at::Tensor& num_tokens_per_rank, const at::Tensor& num_tokens_per_expert, int num_channels,
            int expert_alignment, int num_worst_tokens, int seq, const at::Tensor& rank_prefix_matrix,
            const at::Tensor& recv_channel_offset, const at::Tensor& fwd_offset, const at::Tensor& fwd_row_offset,
            const c10::optional<at::Tensor>& recv_expert_counts, int signature_hash, int problem) {
  const auto device = is_token_in_rank.get_device();
  MOE_CHECK(problem >= 0 && problem < 8, "a problem word travels in 3 bits");
  for (const at::Tensor* t : {&is_token_in_rank, &num_tokens_per_rank, &num_tokens_per_expert, &rank_prefix_matrix,
                              &recv_channel_offset, &fwd_offset, &fwd_row_offset}) {
    expect_cuda(*t, device, "internode notify");
  }
  const int num_experts = static_cast<int>(num_tokens_per_expert.numel());
  const c10::cuda::CUDAGuard guard(device);
  NotifyArgs a{};
  a.c = with_timeout(ctx, timeout_ns);
  MOE_CHECK(num_channels >= 1 && num_channels <= kMaxChannels, "bad channel count");
  MOE_CHECK(num_experts / a.c.num_ranks <= kMaxLocalExperts, "too many local experts");
  MOE_CHECK(1 + a.c.num_ranks + num_channels + a.c.nvl_size * (num_channels + num_experts / a.c.num_ranks) <=
                a.c.layout.rdma_msg_ints,
            "internode notify message larger than its slot");
  set_notify_counts(a, reinterpret_cast<uintptr_t>(is_token_in_rank.data_ptr()),
                    reinterpret_cast<uintptr_t>(num_tokens_per_rank.data_ptr()),
                    reinterpret_cast<uintptr_t>(num_tokens_per_expert.data_ptr()),
                    static_cast<int>(is_token_in_rank.size(0)), num_experts, num_channels, expert_alignment,
                    num_worst_tokens, seq, reinterpret_cast<uintptr_t>(rank_prefix_matrix.data_ptr()),
                    reinterpret_cast<uintptr_t>(recv_channel_offset.data_ptr()));
  a.fwd_offset = data_of<int>(fwd_offset);
  MOE_CHECK(fwd_row_offset.scalar_type() == at::kInt && fwd_row_offset.is_contiguous() &&
                fwd_row_offset.numel() == static_cast<int64_t>(a.c.num_domains) * a.c.nvl_size * num_channels,
            "internode notify: fwd_row_offset must be contiguous int32 [D, nvl, C]");
  a.fwd_row_offset = data_of<int>(fwd_row_offset);
  expect_cuda(recv_expert_counts, device, "internode notify: recv_expert_counts");
  MOE_CHECK(!recv_expert_counts.has_value() || (recv_expert_counts->scalar_type() == at::kInt &&
                                                recv_expert_counts->numel() == num_experts / a.c.num_ranks),
            "internode notify: recv_expert_counts must be int32 [num_experts / num_ranks]");
  a.recv_expert_counts = data_of<int>(recv_expert_counts);
  a.signature_hash = signature_hash;
  a.problem = problem;
  launch_notify(a, current_stream(device).stream());
}

// Geometry: (num_channels, nvl_chunk, nvl_slots, nvl_slot_bytes, rdma_chunk, rdma_slots, rdma_slot_bytes).
void check_geometry(const Common& c, int channels, int nvl_slots, int nvl_slot_bytes, int rdma_slots,
                    int rdma_slot_bytes) {
  MOE_CHECK(channels >= 1 && channels <= kMaxChannels, "bad channel count");
  MOE_CHECK(static_cast<size_t>(channels) * nvl_slots * nvl_slot_bytes <= c.layout.nvl_src_block_bytes,
            "NVLink buffer too small for this config");
  MOE_CHECK(static_cast<size_t>(channels) * rdma_slots * rdma_slot_bytes <= c.layout.rdma_domain_bytes,
            "NVSHMEM buffer too small for this config");
  // The RDMA hop copies whole runs of slots in 16-byte vectors where the peer's buffer is mapped
  // (kernels/internode/common.cuh rdma_put_rows), so a slot (and with it every ring offset) must hold whole vectors.
  MOE_CHECK(rdma_slot_bytes > 0 && rdma_slot_bytes % 16 == 0,
            "internode: RDMA slot size " + std::to_string(rdma_slot_bytes) +
                " bytes is not a positive multiple of 16 (the RDMA hop copies slots in 16-byte vectors)");
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

// The routing a handle holds: is_token_in_rank bool [T, R], recv_channel_offset int32 [R, C + 1], fwd_offset
// int32 [D, C + 1], fwd_mask int32 [max(fwd_capacity, 1)]: written by a fresh dispatch, read by combine; a
// dispatch along a handle passes None (and capacity 0), so that it cannot touch the handle's.
template <typename Args>
void set_routing(Args& a, const at::Tensor& is_token_in_rank, const at::Tensor& recv_channel_offset,
                 const at::Tensor& fwd_offset, const c10::optional<at::Tensor>& fwd_mask, int fwd_capacity) {
  a.is_token_in_rank = data_of<const bool>(is_token_in_rank);
  a.recv_channel_offset = data_of<const int>(recv_channel_offset);
  a.fwd_offset = data_of<const int>(fwd_offset);
  a.fwd_mask = data_of<int>(fwd_mask);
  a.fwd_capacity = fwd_capacity;
  a.num_tokens = static_cast<int>(is_token_in_rank.size(0));
}

// A cached call's ring signature of one hop (moe_dispatcher/signature.py ring_signature_word): nonzero, bit 63
// clear (kernels/common/ring_signature.cuh).
uint64_t checked_ring_signature(int64_t word) {
  MOE_CHECK(word > 0, "a cached call needs its ring signatures");
  return static_cast<uint64_t>(word);
}

// The dispatch arguments of a geometry, checked (the call's tensors and sizes are the caller's to set).
DispatchArgs dispatch_args(const Context& ctx, uint64_t timeout_ns, const std::vector<int>& geometry) {
  DispatchArgs a{};
  a.c = with_timeout(ctx, timeout_ns);
  set_geometry(a, geometry);
  a.rdma_chunk = geometry[4];
  MOE_CHECK(a.nvl_chunk >= 1 && a.nvl_chunk <= kMaxChunk && a.nvl_chunk <= a.nvl_slots, "bad NVLink chunk");
  MOE_CHECK(a.rdma_chunk >= 1 && a.rdma_chunk <= kMaxChunk && a.rdma_chunk <= a.rdma_slots, "bad RDMA chunk");
  return a;
}

// The combine arguments of a geometry and a handle's routing, for rows x [rows, H] (bf16/fp16/fp32) and top-k
// weights [rows, K] or None: everything but the tensors' addresses.
CombineArgs combine_args(const Context& ctx, uint64_t timeout_ns, const std::vector<int>& geometry,
                         const at::Tensor& is_token_in_rank, const at::Tensor& recv_channel_offset,
                         const at::Tensor& fwd_offset, const at::Tensor& fwd_mask, int fwd_capacity,
                         const at::Tensor& x, const c10::optional<at::Tensor>& topk_weights,
                         const std::vector<int64_t>& ring_signatures) {
  CombineArgs a{};
  a.c = with_timeout(ctx, timeout_ns);
  set_geometry(a, geometry);
  MOE_CHECK(ring_signatures.size() == 2, "combine: ring signatures (RDMA hop, NVLink hop)");
  a.rdma_signature = checked_ring_signature(ring_signatures[0]);
  a.nvl_signature = checked_ring_signature(ring_signatures[1]);
  // Progress (docs/internode.md): a forwarder chunk's rows must fit beside a sender chunk in the NVLink
  // ring, and two chunks in the RDMA ring. Checked for the largest chunk, so that every chunk_tokens
  // fits whatever the call's size.
  MOE_CHECK(a.nvl_slots >= a.nvl_chunk + kMaxCombineChunk,
            "combine needs num_max_nvl_chunked_recv_tokens >= send tokens + 32");
  MOE_CHECK(a.rdma_slots >= 2 * kMaxCombineChunk, "combine needs num_max_rdma_chunked_recv_tokens >= 64");
  set_routing(a, is_token_in_rank, recv_channel_offset, fwd_offset, fwd_mask, fwd_capacity);
  // Tokens per warp chunk of the forwarder and the receiver, from the tokens per channel, so that small calls
  // still spread over the worker warps (15 per block), at most kCombineChunkCap. Every chunk size drains the
  // same rings and sums in the same order (the same bits).
  const int per_channel = (a.num_tokens + a.num_channels - 1) / a.num_channels;
  a.chunk_tokens = std::clamp((per_channel + 14) / 15, 1, kCombineChunkCap);
  switch (x.scalar_type()) {
    case at::kBFloat16: a.dtype = intranode::kBf16; break;
    case at::kHalf: a.dtype = intranode::kFp16; break;
    case at::kFloat: a.dtype = intranode::kFp32; break;
    default: MOE_CHECK(false, "combine: the internode kernels reduce bf16, fp16 and fp32 only");
  }
  a.hidden = static_cast<int>(x.size(1));
  a.num_topk = topk_weights.has_value() ? static_cast<int>(topk_weights->size(1)) : 0;
  a.num_x_rows = static_cast<int>(x.size(0));
  return a;
}

// Dispatch (fresh, or along a handle without topk_idx): x [T, H] (bytes per row a multiple of 16), scales [T, S]
// 4-byte or None, topk_idx int64 [T, K] / topk_weights float32 [T, K] or None; outputs recv_x [rows, H],
// recv_scales [rows, S], recv_topk_idx / recv_topk_weights [rows, K] (with topk_idx), recv_src_idx int32 [rows]
// (fresh) or None. pad_rows: fill the rows past the received count (num_worst_tokens).
void dispatch(const Context& ctx, uint64_t timeout_ns, const at::Tensor& x, const c10::optional<at::Tensor>& scales,
              const c10::optional<at::Tensor>& topk_idx, const c10::optional<at::Tensor>& topk_weights,
              const at::Tensor& is_token_in_rank, const at::Tensor& recv_channel_offset, const at::Tensor& fwd_offset,
              const c10::optional<at::Tensor>& fwd_mask, int fwd_capacity, const at::Tensor& recv_x,
              const c10::optional<at::Tensor>& recv_scales, const c10::optional<at::Tensor>& recv_topk_idx,
              const c10::optional<at::Tensor>& recv_topk_weights, const c10::optional<at::Tensor>& recv_src_idx,
              int experts_per_rank, bool pad_rows, const std::vector<int>& geometry) {
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
  MOE_CHECK(fwd_mask.has_value() || fwd_capacity == 0, "dispatch: a forward capacity needs fwd_mask");
  const c10::cuda::CUDAGuard guard(device);
  DispatchArgs a = dispatch_args(ctx, timeout_ns, geometry);
  set_routing(a, is_token_in_rank, recv_channel_offset, fwd_offset, fwd_mask, fwd_capacity);
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
  a.hidden_bytes = static_cast<int>(x.size(1) * x.element_size());
  a.num_scales = scales.has_value() ? static_cast<int>(scales->size(1)) : 0;
  a.num_topk = topk_idx.has_value() ? static_cast<int>(topk_idx->size(1)) : 0;
  a.experts_per_rank = experts_per_rank;
  a.num_rows = static_cast<int>(recv_x.size(0));
  a.pad_rows = pad_rows ? 1 : 0;
  launch_dispatch(a, current_stream(device).stream());
}

// Dispatch of a Buffer with a peer pool (kernels/internode/dispatch.cu, "Direct mode"): the same kernel, which runs
// the direct-call protocol over the domain and writes the NVLink hop's rows straight into the domain peers' outputs
// when every rank of the domain has its outputs in its pool (else the FIFO path, into the same outputs). Fresh
// (ring_signatures empty: top-k when given, source indices, fwd_mask written, fwd_rows int32 [max(fwd_capacity, 1),
// nvl] written for every forwarded token) or cached (ring_signatures: (RDMA hop, NVLink hop); payload and scales only;
// handle_fwd_mask: the handle's, read only). The outputs are carved from `payload` (uint8, intranode
// direct_payload_bytes(...) at least: recv_x [rows, H] x.dtype, recv_scales [rows, S]) and, fresh, `meta` (uint8,
// direct_meta_bytes(...): recv_topk_idx int64 [rows, K], recv_topk_weights float32 [rows, K], recv_src_idx int32
// [rows]); out_offset / meta_offset: where they lie in this rank's NVLink buffer (its peer pool), or -1. fwd_row_offset
// int32 [D, nvl, C]: notify's (fresh) or the handle's. -> (recv_x, recv_scales or None, recv_topk_idx and
// recv_topk_weights or None, recv_src_idx or None (cached)).
py::tuple direct_dispatch(const Context& ctx, uint64_t timeout_ns, const at::Tensor& x,
                          const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& topk_idx,
                          const c10::optional<at::Tensor>& topk_weights, const at::Tensor& is_token_in_rank,
                          const at::Tensor& recv_channel_offset, const at::Tensor& fwd_offset,
                          const at::Tensor& fwd_row_offset, const c10::optional<at::Tensor>& fwd_mask,
                          int fwd_capacity, const c10::optional<at::Tensor>& fwd_rows, const at::Tensor& payload,
                          int64_t out_offset, const c10::optional<at::Tensor>& meta, int64_t meta_offset, int64_t rows,
                          int experts_per_rank, bool pad_rows, const std::vector<int>& geometry,
                          const std::vector<int64_t>& ring_signatures, const c10::optional<at::Tensor>& handle_fwd_mask) {
  const bool fresh = ring_signatures.empty();
  const auto device = x.get_device();
  for (const c10::optional<at::Tensor>* t : {&scales, &topk_idx, &topk_weights, &fwd_mask, &fwd_rows, &meta,
                                             &handle_fwd_mask}) {
    expect_cuda(*t, device, "internode direct dispatch");
  }
  expect_cuda(x, device, "internode direct dispatch: x");
  expect_cuda(payload, device, "internode direct dispatch: payload");
  expect_cuda(fwd_row_offset, device, "internode direct dispatch: fwd_row_offset");
  MOE_CHECK(!topk_weights.has_value() || topk_idx.has_value(), "direct dispatch: topk_weights without topk_idx");
  MOE_CHECK(fresh == meta.has_value() && fresh == fwd_mask.has_value() && fresh == fwd_rows.has_value() &&
                fresh != handle_fwd_mask.has_value() && (fresh || !topk_idx.has_value()),
            "internode direct dispatch: a fresh call has meta, fwd_mask and fwd_rows; a cached one the handle's "
            "fwd_mask and no topk_idx");
  const c10::cuda::CUDAGuard guard(device);
  DispatchArgs a = dispatch_args(ctx, timeout_ns, geometry);
  const int64_t nvl = a.c.nvl_size;
  MOE_CHECK(fwd_row_offset.scalar_type() == at::kInt && fwd_row_offset.is_contiguous() &&
                fwd_row_offset.numel() == a.c.num_domains * nvl * a.num_channels,
            "internode direct dispatch: fwd_row_offset must be contiguous int32 [D, nvl, C]");
  MOE_CHECK(!fwd_rows.has_value() || (fwd_rows->scalar_type() == at::kInt && fwd_rows->is_contiguous() &&
                                      fwd_rows->numel() >= static_cast<int64_t>(fwd_capacity) * nvl),
            "internode direct dispatch: fwd_rows must be contiguous int32 [fwd_capacity, nvl]");
  set_routing(a, is_token_in_rank, recv_channel_offset, fwd_offset, fwd_mask, fwd_capacity);
  MOE_CHECK(x.size(0) == a.num_tokens, "internode direct dispatch: x and is_token_in_rank differ in tokens");
  const intranode::DirectPayload o{rows, x.size(1) * x.element_size(),
                                   scales.has_value() ? scales->size(1) : 0};
  const intranode::DirectMeta m{rows, topk_idx.has_value() ? topk_idx->size(1) : 0};
  const uint8_t* local = ctx.c.nvl[ctx.c.local];
  check_direct_block(payload, out_offset, o.bytes(), local, "internode direct dispatch", "payload");
  if (fresh) check_direct_block(*meta, meta_offset, m.bytes(), local, "internode direct dispatch", "meta");
  const DirectOutputs outs = carve_direct_outputs(payload, meta, o, m, x.scalar_type(), scales.has_value(),
                                                  scales.has_value() ? scales->scalar_type() : at::kInt,
                                                  topk_idx.has_value());
  a.x = data_of<const uint8_t>(x);
  a.scales = data_of<const int32_t>(scales);
  a.topk_idx = data_of<const int64_t>(topk_idx);
  a.topk_weights = data_of<const float>(topk_weights);
  set_direct_outputs(a, outs);
  a.hidden_bytes = static_cast<int>(o.hidden_bytes);
  a.num_scales = static_cast<int>(o.num_scales);
  a.num_topk = static_cast<int>(m.num_topk);
  a.experts_per_rank = experts_per_rank;
  a.num_rows = static_cast<int>(rows);
  a.pad_rows = pad_rows ? 1 : 0;
  if (!fresh) {
    MOE_CHECK(ring_signatures.size() == 2, "cached dispatch: ring signatures (RDMA hop, NVLink hop)");
    a.rdma_signature = checked_ring_signature(ring_signatures[0]);
    a.nvl_signature = checked_ring_signature(ring_signatures[1]);
    a.handle_fwd_mask = data_of<const int>(handle_fwd_mask);
  }
  a.direct_call = 1;
  a.out_offset = out_offset;
  a.meta_offset = fresh ? meta_offset : 0;
  a.out_rows = rows;
  a.layout = a.nvl_signature;  // 0 fresh (notify checked the call), the NVLink hop's ring word cached
  a.write_meta = fresh ? 1 : 0;
  a.fwd_row_offset = data_of<const int>(fwd_row_offset);
  a.fwd_rows = data_of<int>(fwd_rows);
  launch_dispatch(a, current_stream(device).stream());
  return outs.to_python();
}

// Combine: x [rows, H] bf16/fp16/fp32, topk_weights float32 [rows, K] or None, bias0 / bias1 [T, H] of x's dtype or
// None -> out [T, H], out_topk_weights float32 [T, K] (with topk_weights). Along the handle of a Buffer with a peer
// pool, fwd_rows (int32 [fwd_capacity, nvl], the dispatch's) makes the kernel run the pull NVLink hop's protocol
// (combine.cu, "Pull mode"): x_offset / w_offset are where x and topk_weights lie in this rank's NVLink buffer (its
// peer pool), or -1 when they do not (then the domain's call takes the FIFOs).
void combine(const Context& ctx, uint64_t timeout_ns, const at::Tensor& x,
             const c10::optional<at::Tensor>& topk_weights,
             const c10::optional<at::Tensor>& bias0, const c10::optional<at::Tensor>& bias1,
             const at::Tensor& is_token_in_rank, const at::Tensor& recv_channel_offset, const at::Tensor& fwd_offset,
             const at::Tensor& fwd_mask, int fwd_capacity, const at::Tensor& out,
             const c10::optional<at::Tensor>& out_topk_weights, const std::vector<int>& geometry,
             const std::vector<int64_t>& ring_signatures, const c10::optional<at::Tensor>& fwd_rows,
             int64_t x_offset, int64_t w_offset) {
  const auto device = x.get_device();
  expect_cuda(x, device, "combine: x");
  expect_cuda(topk_weights, device, "combine: topk_weights");
  expect_cuda(bias0, device, "combine: bias0");
  expect_cuda(bias1, device, "combine: bias1");
  expect_cuda(out, device, "combine: out");
  MOE_CHECK(topk_weights.has_value() == out_topk_weights.has_value(),
            "combine: topk_weights and out_topk_weights go together");
  const c10::cuda::CUDAGuard guard(device);
  CombineArgs a = combine_args(ctx, timeout_ns, geometry, is_token_in_rank, recv_channel_offset, fwd_offset, fwd_mask,
                               fwd_capacity, x, topk_weights, ring_signatures);
  MOE_CHECK(out.size(0) == a.num_tokens, "combine: out and is_token_in_rank differ in tokens");
  a.x = data_of<const uint8_t>(x);
  a.topk_weights = data_of<const float>(topk_weights);
  a.bias0 = data_of<const uint8_t>(bias0);
  a.bias1 = data_of<const uint8_t>(bias1);
  a.out = data_of<uint8_t>(out);
  a.out_topk_weights = data_of<float>(out_topk_weights);
  if (fwd_rows.has_value()) {
    expect_cuda(*fwd_rows, device, "combine: fwd_rows");
    MOE_CHECK(fwd_rows->scalar_type() == at::kInt && fwd_rows->is_contiguous() &&
                  fwd_rows->numel() >= static_cast<int64_t>(fwd_capacity) * a.c.nvl_size,
              "combine: fwd_rows must be contiguous int32 [fwd_capacity, nvl]");
    // (an input without rows is read by nobody: any offset will do; rows of 0 bytes still have weights to read)
    const uint8_t* local = ctx.c.nvl[ctx.c.local];
    MOE_CHECK(x_offset < 0 || x.size(0) == 0 ||
                  (x_offset % 16 == 0 && static_cast<const uint8_t*>(x.data_ptr()) == local + x_offset &&
                   (!topk_weights.has_value() ||
                    static_cast<const uint8_t*>(topk_weights->data_ptr()) == local + w_offset)),
              "combine: x_offset / w_offset are not where x / topk_weights lie in this rank's NVLink buffer");
    a.pull_call = 1;
    a.fwd_rows = data_of<const int>(*fwd_rows);
    a.x_offset = x_offset < 0 ? -1 : x_offset;
    a.w_offset = a.x_offset < 0 ? -1 : w_offset;
  }
  launch_combine(a, current_stream(device).stream());
}

// Cached calls (csrc/bindings/cached_call.h): plans made by the backend's full path after its checks. `ipc`: the
// domain's IpcBuffer (its mailbox records the backend's timeouts).
using CachedDispatch = CachedCall<DispatchArgs, launch_dispatch, CallKind::kDispatch>;
using CachedCombine = CachedCall<CombineArgs, launch_combine, CallKind::kCombine>;

// Dispatch along a handle (no top-k, no source indices, the handle's forward mask read only where a source's ring
// signature differs, never written): x [T, H], scales [T, S] (FP8) or None -> recv_x [rows, H], recv_scales
// [rows, S]; rows = the handle's recv_src_idx rows. ring_signatures: (RDMA hop, NVLink hop).
std::unique_ptr<CachedDispatch> make_cached_dispatch(const Context& ctx, const IpcBuffer& ipc, CommStream& comm,
                                                     uint64_t timeout_ns, const py::tuple& handle,
                                                     const at::Tensor& recv_channel_offset,
                                                     const at::Tensor& fwd_offset, const at::Tensor& fwd_mask,
                                                     int fwd_capacity, const at::Tensor& x,
                                                     const c10::optional<at::Tensor>& scales,
                                                     const std::vector<int>& geometry, py::object config, int num_sms,
                                                     const std::vector<int64_t>& ring_signatures) {
  DispatchArgs a = dispatch_args(ctx, timeout_ns, geometry);
  const at::Tensor is_token_in_rank = py::cast<at::Tensor>(handle[kIsTokenInRank]);
  set_routing(a, is_token_in_rank, recv_channel_offset, fwd_offset, c10::nullopt, fwd_capacity);
  a.handle_fwd_mask = data_of<const int>(fwd_mask);
  MOE_CHECK(ring_signatures.size() == 2, "cached dispatch: ring signatures (RDMA hop, NVLink hop)");
  a.rdma_signature = checked_ring_signature(ring_signatures[0]);
  a.nvl_signature = checked_ring_signature(ring_signatures[1]);
  const int64_t rows = py::cast<at::Tensor>(handle[kRecvSrcIdx]).size(0);
  a.hidden_bytes = static_cast<int>(x.size(1) * x.element_size());
  a.num_scales = scales.has_value() ? static_cast<int>(scales->size(1)) : 0;
  a.experts_per_rank = 1;
  a.num_rows = static_cast<int>(rows);
  a.pad_rows = py::cast<int64_t>(handle[kNumWorstTokens]) != 0 ? 1 : 0;
  c10::optional<TensorSpec> aux, aux_out;
  if (scales.has_value()) {
    aux = TensorSpec{scales->scalar_type(), x.size(0), scales->size(1)};
    aux_out = TensorSpec{scales->scalar_type(), rows, scales->size(1)};
  }
  return std::make_unique<CachedDispatch>(
      ipc, comm, handle, std::vector<at::Tensor>{is_token_in_rank, recv_channel_offset, fwd_offset, fwd_mask}, a,
      TensorSpec{x.scalar_type(), x.size(0), x.size(1)}, aux, TensorSpec{x.scalar_type(), rows, x.size(1)}, aux_out,
      std::move(config), num_sms);
}

// Combine along a handle: x [rows, H] bf16/fp16/fp32, topk_weights float32 [rows, K] when given -> out [T, H],
// out_topk_weights float32 [T, K].
std::unique_ptr<CachedCombine> make_cached_combine(const Context& ctx, const IpcBuffer& ipc, CommStream& comm,
                                                   uint64_t timeout_ns, const py::tuple& handle,
                                                   const at::Tensor& recv_channel_offset, const at::Tensor& fwd_offset,
                                                   const at::Tensor& fwd_mask, int fwd_capacity, const at::Tensor& x,
                                                   const c10::optional<at::Tensor>& topk_weights,
                                                   const std::vector<int>& geometry, py::object config, int num_sms,
                                                   const std::vector<int64_t>& ring_signatures) {
  const at::Tensor is_token_in_rank = py::cast<at::Tensor>(handle[kIsTokenInRank]);
  const CombineArgs a = combine_args(ctx, timeout_ns, geometry, is_token_in_rank, recv_channel_offset, fwd_offset,
                                     fwd_mask, fwd_capacity, x, topk_weights, ring_signatures);
  const int64_t tokens = a.num_tokens;
  c10::optional<TensorSpec> aux, aux_out;
  if (topk_weights.has_value()) {
    aux = TensorSpec{at::kFloat, x.size(0), topk_weights->size(1)};
    aux_out = TensorSpec{at::kFloat, tokens, topk_weights->size(1)};
  }
  return std::make_unique<CachedCombine>(
      ipc, comm, handle, std::vector<at::Tensor>{is_token_in_rank, recv_channel_offset, fwd_offset, fwd_mask}, a,
      TensorSpec{x.scalar_type(), x.size(0), x.size(1)}, aux, TensorSpec{x.scalar_type(), tokens, x.size(1)}, aux_out,
      std::move(config), num_sms);
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
  // Byte offset of RdmaControl::peer_aborted in the symmetric buffer (the peer abort's targets: wait.cuh).
  sub.attr("RDMA_ABORT_OFFSET") = offsetof(RdmaControl, peer_aborted);

  py::class_<Context>(sub, "Context");
  sub.def("make_context", &make_context, py::arg("ipc"), py::arg("rdma"), py::arg("rank"), py::arg("num_ranks"),
          py::arg("nvl_size"), py::arg("num_rdma_bytes"));
  sub.def(
      "buffer_layout",
      [](int num_ranks, int nvl_size, int64_t num_rdma_bytes, int64_t num_nvl_bytes) {
        return layout_dict(buffer_layout(num_ranks, nvl_size, num_rdma_bytes, num_nvl_bytes));
      },
      py::arg("num_ranks"), py::arg("nvl_size"), py::arg("num_rdma_bytes"), py::arg("num_nvl_bytes"));
  sub.def("timeout_info", &timeout_info, py::arg("ipc"));
  sub.def("num_forward", &num_forward, py::arg("ipc"));
  // get_dispatch_layout (layout_call.h: layout_call_on).
  sub.def(
      "layout_call", &layout_call_on,
      py::arg("topk_idx"), py::arg("num_experts"), py::arg("num_ranks"), py::arg("nvl_size"),
      py::arg("buffer") = nullptr);
  sub.def("notify", &notify, py::arg("ctx"), py::arg("timeout_ns"), py::arg("is_token_in_rank"),
          py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_expert"), py::arg("num_channels"),
          py::arg("expert_alignment"), py::arg("num_worst_tokens"), py::arg("seq"), py::arg("rank_prefix_matrix"),
          py::arg("recv_channel_offset"), py::arg("fwd_offset"), py::arg("fwd_row_offset"),
          py::arg("recv_expert_counts") = py::none(),
          py::arg("signature_hash") = 0, py::arg("problem") = 0);
  sub.def("dispatch", &dispatch, py::arg("ctx"), py::arg("timeout_ns"), py::arg("x"), py::arg("scales"),
          py::arg("topk_idx"), py::arg("topk_weights"), py::arg("is_token_in_rank"), py::arg("recv_channel_offset"),
          py::arg("fwd_offset"), py::arg("fwd_mask"), py::arg("fwd_capacity"), py::arg("recv_x"),
          py::arg("recv_scales"), py::arg("recv_topk_idx"), py::arg("recv_topk_weights"), py::arg("recv_src_idx"),
          py::arg("experts_per_rank"), py::arg("pad_rows"), py::arg("geometry"));
  sub.def("direct_dispatch", &direct_dispatch, py::arg("ctx"), py::arg("timeout_ns"), py::arg("x"), py::arg("scales"),
          py::arg("topk_idx"), py::arg("topk_weights"), py::arg("is_token_in_rank"), py::arg("recv_channel_offset"),
          py::arg("fwd_offset"), py::arg("fwd_row_offset"), py::arg("fwd_mask"), py::arg("fwd_capacity"),
          py::arg("fwd_rows"), py::arg("payload"), py::arg("out_offset"), py::arg("meta"), py::arg("meta_offset"),
          py::arg("rows"), py::arg("experts_per_rank"), py::arg("pad_rows"), py::arg("geometry"),
          py::arg("ring_signatures") = std::vector<int64_t>{}, py::arg("handle_fwd_mask") = py::none());
  // A plan is a METH_FASTCALL function that owns it (cached_call.h: plan_function) and keeps the IpcBuffer and the
  // comm stream it points to referenced (the Context is copied into it).
  sub.def(
      "cached_dispatch",
      [](const Context& ctx, const py::object& ipc, const py::object& comm, uint64_t timeout_ns,
         const py::tuple& handle, const at::Tensor& recv_channel_offset, const at::Tensor& fwd_offset,
         const at::Tensor& fwd_mask, int fwd_capacity, const at::Tensor& x, const c10::optional<at::Tensor>& scales,
         const std::vector<int>& geometry, py::object config, int num_sms,
         const std::vector<int64_t>& ring_signatures) {
        return plan_function(make_cached_dispatch(ctx, ipc.cast<const IpcBuffer&>(), comm.cast<CommStream&>(),
                                                  timeout_ns, handle, recv_channel_offset, fwd_offset, fwd_mask,
                                                  fwd_capacity, x, scales, geometry, std::move(config), num_sms,
                                                  ring_signatures),
                             {ipc, comm});
      },
      py::arg("ctx"), py::arg("ipc"), py::arg("comm"), py::arg("timeout_ns"), py::arg("handle"),
      py::arg("recv_channel_offset"), py::arg("fwd_offset"), py::arg("fwd_mask"), py::arg("fwd_capacity"),
      py::arg("x"), py::arg("scales"), py::arg("geometry"), py::arg("config"), py::arg("num_sms"),
      py::arg("ring_signatures"));
  sub.def(
      "cached_combine",
      [](const Context& ctx, const py::object& ipc, const py::object& comm, uint64_t timeout_ns,
         const py::tuple& handle, const at::Tensor& recv_channel_offset, const at::Tensor& fwd_offset,
         const at::Tensor& fwd_mask, int fwd_capacity, const at::Tensor& x,
         const c10::optional<at::Tensor>& topk_weights, const std::vector<int>& geometry, py::object config,
         int num_sms, const std::vector<int64_t>& ring_signatures) {
        return plan_function(make_cached_combine(ctx, ipc.cast<const IpcBuffer&>(), comm.cast<CommStream&>(),
                                                 timeout_ns, handle, recv_channel_offset, fwd_offset, fwd_mask,
                                                 fwd_capacity, x, topk_weights, geometry, std::move(config), num_sms,
                                                 ring_signatures),
                             {ipc, comm});
      },
      py::arg("ctx"), py::arg("ipc"), py::arg("comm"), py::arg("timeout_ns"), py::arg("handle"),
      py::arg("recv_channel_offset"), py::arg("fwd_offset"), py::arg("fwd_mask"), py::arg("fwd_capacity"),
      py::arg("x"), py::arg("topk_weights"), py::arg("geometry"), py::arg("config"), py::arg("num_sms"),
      py::arg("ring_signatures"));
  sub.def("combine", &combine, py::arg("ctx"), py::arg("timeout_ns"), py::arg("x"), py::arg("topk_weights"),
          py::arg("bias0"), py::arg("bias1"), py::arg("is_token_in_rank"), py::arg("recv_channel_offset"),
          py::arg("fwd_offset"), py::arg("fwd_mask"), py::arg("fwd_capacity"), py::arg("out"),
          py::arg("out_topk_weights"), py::arg("geometry"), py::arg("ring_signatures"),
          py::arg("fwd_rows") = py::none(), py::arg("x_offset") = -1, py::arg("w_offset") = -1);
}

}  // namespace moe_ep
