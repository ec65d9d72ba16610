// Python bindings of the low-latency (NVSHMEM) backend: the `low_latency` submodule of _C.
// Glue only. Tensors cross as raw device addresses (ints) and streams as cudaStream_t ints;
// moe_dispatcher/compiled/low_latency.py allocates and validates every tensor before calling in.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "kernels/low_latency/low_latency.h"
#include "runtime/cuda_check.h"

namespace py = pybind11;

namespace moe_dispatcher {
namespace {

using namespace low_latency;

// The launcher of one (buffer half, shapes, variant) of a backend: the fields every launch shares,
// checked once when it is made; its methods take only what changes between calls (addresses, sizes,
// flags, stream), as positional arguments (the per-call host cost is the point: docs/low_latency.md).
class Launcher {
 public:
  Launcher(uintptr_t buffer, uintptr_t peer_bases, uintptr_t workspace, size_t half_offset, int rank,
           int num_ranks, int num_experts, int max_tokens, int hidden, int num_blocks,
           uint64_t timeout_ns, int variant, uintptr_t dispatch_trace, uintptr_t combine_trace) {
    MOE_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "low_latency: bad number of ranks");
    MOE_CHECK(num_experts % num_ranks == 0 && num_experts <= kMaxExperts,
              "low_latency: bad number of experts");
    MOE_CHECK(max_tokens >= 1, "low_latency: bad max_tokens");
    MOE_CHECK(hidden % 128 == 0 && hidden <= kMaxHidden, "low_latency: bad hidden size");
    MOE_CHECK(num_blocks >= 1, "low_latency: num_blocks must be positive");
    MOE_CHECK((variant & ~kVariantMask) == 0, "low_latency: unknown kernel variant bits");
    MOE_CHECK(!(variant & (kVariantDispatchDedup | kVariantCombinePerRank)) || num_experts / num_ranks >= 2,
              "low_latency: the dedup dispatch and the per-rank combine need at least two experts per rank");
    MOE_CHECK((dispatch_trace == 0 && combine_trace == 0) || num_blocks <= kTraceMaxBlocks,
              "low_latency: the phase trace records at most TRACE_MAX_BLOCKS blocks");
    c_.buffer = ptr<uint8_t>(buffer);
    c_.peer_bases = ptr<const uint64_t>(peer_bases);
    c_.workspace = ptr<int>(workspace);
    c_.half_offset = half_offset;
    c_.rank = rank;
    c_.num_ranks = num_ranks;
    c_.num_experts = num_experts;
    c_.max_tokens = max_tokens;
    c_.hidden = hidden;
    c_.num_blocks = num_blocks;
    c_.timeout_ns = timeout_ns;
    c_.variant = variant;
    dispatch_trace_ = ptr<unsigned long long>(dispatch_trace);
    combine_trace_ = ptr<unsigned long long>(combine_trace);
  }

  void dispatch(uintptr_t x, uintptr_t topk_idx, int num_tokens, int num_topk, bool fp8, bool round_scale,
                bool ue8m0, uintptr_t recv_x, uintptr_t recv_scales, uintptr_t src_info, uintptr_t row_of,
                uintptr_t layout_range, uintptr_t recv_count, uintptr_t cum_stats, uintptr_t wait_stats,
                int phases, uintptr_t stream) const {
    const Common c = call_context("dispatch", num_tokens, num_topk, dispatch_trace_);
    DispatchArgs a{};
    a.x = ptr<const void>(x);
    a.topk_idx = ptr<const int64_t>(topk_idx);
    a.num_tokens = num_tokens;
    a.num_topk = num_topk;
    a.fp8 = fp8;
    a.round_scale = round_scale;
    a.ue8m0 = ue8m0;
    a.recv_x = ptr<void>(recv_x);
    a.recv_scales = ptr<void>(recv_scales);
    a.src_info = ptr<int>(src_info);
    a.row_of = ptr<int>(row_of);
    a.layout_range = ptr<int64_t>(layout_range);
    a.recv_count = ptr<int>(recv_count);
    a.cumulative_recv_stats = ptr<int>(cum_stats);
    a.wait_stats = ptr<int64_t>(wait_stats);
    launch_dispatch(c, a, phases, stream_of(stream));
  }

  void combine(uintptr_t x, uintptr_t topk_idx, uintptr_t topk_weights, uintptr_t src_info, uintptr_t row_of,
               uintptr_t layout_range, uintptr_t out, int num_tokens, int num_topk, bool rank_partials,
               uintptr_t wait_stats, int phases, uintptr_t stream) const {
    const Common c = call_context("combine", num_tokens, num_topk, combine_trace_);
    CombineArgs a{};
    a.x = ptr<const void>(x);
    a.topk_idx = ptr<const int64_t>(topk_idx);
    a.topk_weights = ptr<const float>(topk_weights);
    a.src_info = ptr<const int>(src_info);
    a.row_of = ptr<const int>(row_of);
    a.layout_range = ptr<const int64_t>(layout_range);
    a.out = ptr<void>(out);
    a.num_tokens = num_tokens;
    a.num_topk = num_topk;
    a.rank_partials = rank_partials;
    a.wait_stats = ptr<int64_t>(wait_stats);
    launch_combine(c, a, phases, stream_of(stream));
  }

 private:
  // This context for one call (`what`: "dispatch" or "combine") recording into `trace`, after the checks that
  // both calls make.
  Common call_context(const char* what, int num_tokens, int num_topk, unsigned long long* trace) const {
    MOE_CHECK(num_topk >= 1 && num_topk <= kMaxTopk, std::string("low_latency ") + what + ": bad top-k");
    MOE_CHECK(num_tokens >= 0 && num_tokens <= c_.max_tokens, std::string("low_latency ") + what + ": bad T");
    Common c = c_;
    c.trace = trace;
    return c;
  }

  Common c_{};
  unsigned long long* dispatch_trace_ = nullptr;
  unsigned long long* combine_trace_ = nullptr;
};

}  // namespace

void register_low_latency(py::module_& parent) {
  py::module_ m = parent.def_submodule("low_latency", "Low-latency (NVSHMEM) dispatch/combine");
  m.attr("MAX_TOPK") = kMaxTopk;
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_EXPERTS") = kMaxExperts;
  m.attr("MAX_HIDDEN") = kMaxHidden;
  m.attr("WORKSPACE_INTS") = kWorkspaceInts;
  m.attr("PHASE_SEND") = kPhaseSend;
  m.attr("PHASE_RECV") = kPhaseRecv;
  m.attr("VARIANT_DISPATCH_DEDUP") = kVariantDispatchDedup;
  m.attr("VARIANT_COMBINE_PER_RANK") = kVariantCombinePerRank;
  m.attr("VARIANT_MASK") = kVariantMask;
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

  m.def(
      "half_layout",
      [](int max_tokens, int hidden, int num_ranks, int num_experts) {
        const HalfLayout l = half_layout(max_tokens, hidden, num_ranks, num_experts);
        py::dict d;
        d["half_bytes"] = l.half_bytes;
        d["send_off"] = l.send_off;
        d["recv_off"] = l.recv_off;
        d["signal_off"] = l.signal_off;
        d["msg_bytes"] = l.msg_bytes;
        d["dedup_slot_bytes"] = l.dedup_slot_bytes;
        d["signal_bytes"] = l.signal_bytes;
        return d;
      },
      py::arg("max_tokens"), py::arg("hidden"), py::arg("num_ranks"), py::arg("num_experts"),
      "Byte layout of one buffer half: {half_bytes, send_off, recv_off, signal_off, msg_bytes, "
      "dedup_slot_bytes, signal_bytes}.");

  py::class_<Launcher>(m, "Launcher",
                       "Launches of one buffer half with fixed shapes and variant (checked once here).")
      .def(py::init<uintptr_t, uintptr_t, uintptr_t, size_t, int, int, int, int, int, int, uint64_t, int,
                    uintptr_t, uintptr_t>(),
           py::arg("buffer"), py::arg("peer_bases"), py::arg("workspace"), py::arg("half_offset"),
           py::arg("rank"), py::arg("num_ranks"), py::arg("num_experts"), py::arg("max_tokens"),
           py::arg("hidden"), py::arg("num_blocks"), py::arg("timeout_ns"), py::arg("variant"),
           py::arg("dispatch_trace"), py::arg("combine_trace"))
      .def("dispatch", &Launcher::dispatch,
           "dispatch(x, topk_idx, num_tokens, num_topk, fp8, round_scale, ue8m0, recv_x, recv_scales, "
           "src_info, row_of, layout_range, recv_count, cum_stats, wait_stats, phases, stream): enqueue the "
           "dispatch kernel (addresses as ints, 0 = none; phases: PHASE_SEND | PHASE_RECV).")
      .def("combine", &Launcher::combine,
           "combine(x, topk_idx, topk_weights, src_info, row_of, layout_range, out, num_tokens, num_topk, "
           "rank_partials, wait_stats, phases, stream): enqueue the combine kernel (x = 0: zero-copy, rows "
           "in the send region; rank_partials: the per-rank reduction order).");
}

}  // namespace moe_dispatcher
