// Direct dispatch (fresh and cached): every block is a sender, two per channel (the ring kernel's SM count for the
// same channels). Blocks 2c and 2c + 1 walk channel c's tokens and write each row bound for rank d, exactly once
// and by one warp, straight into d's output tensors: d allocated them as blocks of its NVLink buffer (the peer
// pool, mapped by every peer; protocol.h, DirectPayload / DirectMeta) and published where they lie for this
// call. The k-th row of channel c for d goes to row send_row_offset[d][c] + k, which notify computed as (rows
// that ranks before me send to d) + (my rows to d in channels before c), so the rows sit in the (source rank,
// token) order of the contract, the order the ring kernel (dispatch.cu) gives. Nothing is copied afterwards:
// when d's kernel ends, its outputs are complete.
// In each block 24 / R warps serve each destination; the W = 2 x 24 / R warps of the channel's two blocks for d
// take rows w, w + W, ... (warp w: block 2c + h's warp gw is w = h x 24 / R + gw; TokenScan).
// Rows at or past d's row count (more rows than num_worst_tokens) are dropped, as the ring receiver drops them.
//
// Protocol (direct_call.cuh, on Control::direct, phases kPhaseDirectReady / kPhaseDirectArrive): my block 0
// publishes my output blocks (DirectOutputBlocks: payload and meta offsets in my buffer, my rows) with the call's
// layout word (0 in a fresh call, which notify checked; a cached call's ring signature); every block reads every
// rank's and decides. Direct: every rank's blocks peer-mapped (and, when the call writes meta, its meta block)
// and every layout word equal to mine. Missed: nobody writes rows (a missed call still fills row_of_token), and
// ring_fallback_kernel (dispatch.cu), queued next on every rank, moves the call. A block arrives at d after its
// last row into d's outputs, so d's kernel ends only after every source's rows landed in d's outputs; the
// arrival is made in a missed call too.
// A call that notify refused (common/refused_call.cuh) moves nothing and touches no word: every block returns at
// its start (the ring kernel queued next pads the outputs of a refused call).
#include "kernels/common/copy.cuh"
#include "kernels/common/launch_check.cuh"
#include "kernels/common/refused_call.cuh"
#include "kernels/common/ring_layout.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/intranode/direct_call.cuh"
#include "kernels/intranode/protocol.h"
#include "kernels/intranode/rings.cuh"  // warp_outcome
#include "kernels/intranode/token_scan.cuh"

namespace moe_ep::intranode {
namespace {

constexpr int kDirectWarps = 24;  // as the ring kernel: 1024 threads would cap ptxas at 64 registers (it spilled)
constexpr int kDirectThreads = kDirectWarps * 32;
// 16-byte loads in flight per lane while copying a row: 7 moves an FP8 7,168-byte row in 2 load round trips (6: 3)
// and BF16 in 4 (80 registers, no spill; 8 spills).
constexpr int kDirectUnroll = 7;

// Whole warp: token t's row into row `row` of the outputs (payload `out` laid out as `o`, meta block `meta` as
// `m`) of the rank whose experts are [lo, hi): payload, scales, top-k rebased to its local experts (weights zeroed
// elsewhere), source index.
__device__ __forceinline__ void write_row(const DirectDispatchArgs& a, const DirectPayload& o, uint8_t* out,
                                          const DirectMeta& m, uint8_t* meta, int64_t row, int t, int lo, int hi,
                                          int lane) {
  warp_copy<false, kDirectUnroll>(
      reinterpret_cast<int4*>(out + o.x_offset() + row * a.hidden_bytes),
      reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.hidden_bytes), a.hidden_bytes / 16, lane);
  auto* scales = reinterpret_cast<int32_t*>(out + o.scales_offset()) + row * a.num_scales;
  for (int j = lane; j < a.num_scales; j += 32) scales[j] = a.scales[static_cast<int64_t>(t) * a.num_scales + j];
  if (!a.write_meta) return;
  if (a.topk_idx != nullptr && lane < a.num_topk) {
    const int64_t e = a.topk_idx[static_cast<int64_t>(t) * a.num_topk + lane];
    const int local = (e >= lo && e < hi) ? static_cast<int>(e - lo) : -1;
    reinterpret_cast<int64_t*>(meta + m.idx_offset())[row * a.num_topk + lane] = local;
    reinterpret_cast<float*>(meta + m.weights_offset())[row * a.num_topk + lane] =
        (local >= 0 && a.topk_weights != nullptr) ? a.topk_weights[static_cast<int64_t>(t) * a.num_topk + lane] : 0.f;
  }
  if (lane == 0) reinterpret_cast<int32_t*>(meta + m.src_offset())[row] = t;
}

// num_worst_tokens: my rows past the received count get zero payload and scales, top-k -1, weight 0, source
// -1 (as the ring receiver pads them); every thread of my blocks takes its share.
__device__ void pad_my_rows(const DirectDispatchArgs& a, uint8_t* out, uint8_t* meta) {
  const DirectPayload o{a.out_rows, a.hidden_bytes, a.num_scales};
  const DirectMeta m{a.out_rows, a.num_topk};
  const int received = a.recv_channel_offset[(a.c.num_ranks - 1) * (a.num_channels + 1) + a.num_channels];
  const int64_t first = min(static_cast<int64_t>(received), o.rows), extra = o.rows - first;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  auto* x = reinterpret_cast<int4*>(out + o.x_offset() + first * a.hidden_bytes);
  for (int64_t i = start; i < extra * (a.hidden_bytes / 16); i += stride) x[i] = make_int4(0, 0, 0, 0);
  auto* scales = reinterpret_cast<int32_t*>(out + o.scales_offset()) + first * a.num_scales;
  for (int64_t i = start; i < extra * a.num_scales; i += stride) scales[i] = 0;
  if (!a.write_meta) return;
  auto* idx = reinterpret_cast<int64_t*>(meta + m.idx_offset()) + first * a.num_topk;
  auto* weights = reinterpret_cast<float*>(meta + m.weights_offset()) + first * a.num_topk;
  for (int64_t i = start; i < extra * a.num_topk; i += stride) {
    idx[i] = -1;
    weights[i] = 0.f;
  }
  auto* src = reinterpret_cast<int32_t*>(meta + m.src_offset()) + first;
  for (int64_t i = start; i < extra; i += stride) src[i] = -1;
}

__global__ void __launch_bounds__(kDirectThreads, 1) dispatch_direct_kernel(DirectDispatchArgs a) {
  __shared__ DirectCallState<DirectOutputBlocks> call;
  const int num_ranks = a.c.num_ranks, me = a.c.rank, c = blockIdx.x >> 1, half = blockIdx.x & 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  auto* ctl = reinterpret_cast<Control*>(a.c.peers[me]);
  if (call_refused(a.recv_channel_offset)) return;  // the same word in every block of every rank
  const Watchdog dog = make_watchdog(a.c.timeout_ns, me, &ctl->timeout_claim, &a.c.mailbox->timeout,
                                     ctl->peer_aborted);
  const DirectCallSite<DirectOutputBlocks> site{&Control::direct, kPhaseDirectReady, kPhaseDirectArrive};
  const DirectOutputBlocks mine{a.out_offset, a.meta_offset, a.out_rows};
  const auto accepts = [&](const DirectOutputBlocks& o) {
    return o.out_offset >= 0 && (!a.write_meta || o.meta_offset >= 0);
  };
  if (!begin_direct_call(call, a.c, site, mine, a.layout, dog, accepts)) return;

  // Rows (and my padding: my own outputs, written by nobody else). A missed call still walks the rows when
  // row_of_token is asked for (the pull combine along this handle needs it whichever kernel moved them).
  if (call.in_pool && a.pad_rows) pad_my_rows(a, a.c.peers[me] + a.out_offset, a.c.peers[me] + a.meta_offset);
  const int warps = kDirectWarps / num_ranks;  // warps per destination in this block
  const int d = warp / warps, w = half * warps + warp % warps, stride = 2 * warps;
  if ((call.in_pool || a.row_of_token != nullptr) && d < num_ranks) {
    const DirectOutputBlocks& to = call.blocks[d];
    const int64_t rows = to.out_rows;
    const DirectPayload o{rows, a.hidden_bytes, a.num_scales};
    const DirectMeta m{rows, a.num_topk};
    uint8_t* out = a.c.peers[d] + to.out_offset;
    uint8_t* meta = a.c.peers[d] + to.meta_offset;
    const int lo = d * a.experts_per_rank, hi = lo + a.experts_per_rank;
    const int64_t row0 = a.send_row_offset[d * a.num_channels + c];
    int begin, end;
    channel_range(a.num_tokens, a.num_channels, c, begin, end);
    TokenScan scan{a.is_token_in_rank, num_ranks, d, end};
    scan.start(begin, lane);
    for (int k = w;; k += stride) {
      const int t = scan.find(k, lane);
      const int64_t row = row0 + k;
      if (t < 0 || row >= rows) break;  // rows grow with k: the rest are dropped too
      if (call.in_pool) write_row(a, o, out, m, meta, row, t, lo, hi, lane);
      if (a.row_of_token != nullptr && lane == 0) a.row_of_token[static_cast<int64_t>(t) * num_ranks + d] = row;
    }
  }
  end_direct_call(call, a.c, site, dog);
}

}  // namespace

void launch_direct_dispatch(const DirectDispatchArgs& args, cudaStream_t stream) {
  dispatch_direct_kernel<<<2 * args.num_channels, kDirectThreads, 0, stream>>>(args);
  check_launch("dispatch_direct_kernel");
}

}  // namespace moe_ep::intranode
