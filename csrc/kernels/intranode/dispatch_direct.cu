// Direct dispatch (fresh and cached): every block is a sender, two per channel (the ring kernel's SM count for the
// same channels). Blocks 2c and 2c + 1 walk channel c's tokens and write each row bound for rank d, exactly once
// and by one warp, straight into d's output tensors: d allocated them as blocks of its NVLink buffer (the peer
// pool, mapped by every peer; protocol.h, DirectPayload / DirectMeta) and published where they lie for this
// call. The k-th row of channel c for d goes to row send_row_offset[d][c] + k, which notify computed as (rows
// that ranks before me send to d) + (my rows to d in channels before c), so the rows sit in the (source rank,
// token) order of the contract, the order the ring kernel (dispatch.cu) gives. Nothing is copied afterwards:
// when d's kernel ends, its outputs are complete.
// The 2 x 24 warps of the channel's two blocks share all its rows, whatever their destination (RowScan: the
// channel's q-th row in (token, destination) order goes to warp q mod 48; block 2c + h's warp gw is warp
// h x 24 + gw), so every warp carries the same mix of rows for the peers and for me: a warp that served my own
// rows alone (local stores, much faster than NVLink ones) would sit idle for most of the call.
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
#include "kernels/common/launch_check.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/refused_call.cuh"
#include "kernels/common/ring_layout.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/intranode/direct_call.cuh"
#include "kernels/intranode/protocol.h"
#include "kernels/intranode/rings.cuh"  // warp_outcome
#include "kernels/intranode/row_scan.cuh"

namespace moe_ep::intranode {
namespace {

constexpr int kDirectWarps = 24;  // as the ring kernel: 1024 threads would cap ptxas at 64 registers (it spilled)
constexpr int kDirectThreads = kDirectWarps * 32;
constexpr int kDirectUnroll = 4;  // loads in flight per lane while copying a row (a round: 32 x 4 slots)

// Whole warp: one row's payload (n16 16-byte vectors) and its scales (num_scales 4-byte words) as one sequence of
// n16 + num_scales slots; lane l takes slots l, l + 32, ..., kDirectUnroll loads in flight before their stores. The
// rounds that hold only payload run unpredicated; the last round(s) carry the payload's rest and the scales, so the
// scales ride in the slots the payload leaves free (7168-byte FP8 rows with 56 scales: 448 + 56 = 504 slots, 4
// rounds; a loop of its own after the payload took 2 more load round trips, each load waiting for the store
// before it). Both loops stay rolled: unrolled, they need more than the 80 registers a thread of 768 has, and
// ptxas spills. Loads are ld.global.nc (the inputs are read-only while the kernel runs); stores are plain, to a
// peer over NVLink (end_direct_call publishes them).
__device__ __forceinline__ void copy_row(int4* dst_x, const int4* src_x, int n16, int32_t* dst_scales,
                                         const int32_t* src_scales, int num_scales, int lane) {
  constexpr int kRound = 32 * kDirectUnroll;
  int r = 0;  // the round's first slot (the same in every lane)
#pragma unroll 1
  for (; r + kRound <= n16; r += kRound) {
    int4 v[kDirectUnroll];
#pragma unroll
    for (int u = 0; u < kDirectUnroll; ++u) v[u] = ptx::ld_nc_v4(src_x + r + u * 32 + lane);
#pragma unroll
    for (int u = 0; u < kDirectUnroll; ++u) dst_x[r + u * 32 + lane] = v[u];
  }
  const int n = n16 + num_scales;
#pragma unroll 1
  for (; r < n; r += kRound) {
    int4 v[kDirectUnroll];
#pragma unroll
    for (int u = 0; u < kDirectUnroll; ++u) {
      const int i = r + u * 32 + lane;
      if (i < n16) {
        v[u] = ptx::ld_nc_v4(src_x + i);
      } else if (i < n) {
        v[u].x = __ldg(src_scales + (i - n16));
      }
    }
#pragma unroll
    for (int u = 0; u < kDirectUnroll; ++u) {
      const int i = r + u * 32 + lane;
      if (i < n16) {
        dst_x[i] = v[u];
      } else if (i < n) {
        dst_scales[i - n16] = v[u].x;
      }
    }
  }
}

// Where the rows for destination d go this call (a block's table, filled once from d's published blocks): byte
// offsets of d's outputs in d's buffer (pointers are formed from the kernel argument peers[d] at each use, so
// the compiler knows they are global and emits global stores), d's row count, the first row of this channel's
// rows for d, and d's first expert.
struct DirectDest {
  int64_t x, scales, topk_idx, topk_weights, src_idx;  // [rows, hidden_bytes], [rows, S], [rows, K] x 2, [rows]
  int64_t rows, row0;
  int lo;
};

// Whole warp: token t's row into row `row` of the outputs of destination d (`to`, in d's buffer `buf`): payload
// and scales (copy_row), top-k rebased to d's local experts (weights zeroed elsewhere), source index. A top-k
// lane loads its index and its weight together (one round trip; the weight of an entry outside d's experts is
// read and dropped).
__device__ __forceinline__ void write_row(const DirectDispatchArgs& a, uint8_t* buf, const DirectDest& to,
                                          int64_t row, int t, int lane) {
  copy_row(reinterpret_cast<int4*>(buf + to.x + row * a.hidden_bytes),
           reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.hidden_bytes), a.hidden_bytes / 16,
           reinterpret_cast<int32_t*>(buf + to.scales) + row * a.num_scales,
           a.scales + static_cast<int64_t>(t) * a.num_scales, a.num_scales, lane);
  if (!a.write_meta) return;
  if (a.topk_idx != nullptr && lane < a.num_topk) {
    const int64_t at = static_cast<int64_t>(t) * a.num_topk + lane;
    const int64_t e = __ldg(a.topk_idx + at);
    const float weight = a.topk_weights != nullptr ? __ldg(a.topk_weights + at) : 0.f;
    const int local = (e >= to.lo && e < to.lo + a.experts_per_rank) ? static_cast<int>(e - to.lo) : -1;
    reinterpret_cast<int64_t*>(buf + to.topk_idx)[row * a.num_topk + lane] = local;
    reinterpret_cast<float*>(buf + to.topk_weights)[row * a.num_topk + lane] = local >= 0 ? weight : 0.f;
  }
  if (lane == 0) reinterpret_cast<int32_t*>(buf + to.src_idx)[row] = t;
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
  __shared__ DirectDest dests[kMaxRanks];
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
  if (threadIdx.x < num_ranks) {  // the destinations' table, from the published blocks
    const int d = threadIdx.x;
    const DirectOutputBlocks& to = call.blocks[d];
    const DirectPayload o{to.out_rows, a.hidden_bytes, a.num_scales};
    const DirectMeta m{to.out_rows, a.num_topk};
    dests[d] = DirectDest{to.out_offset + o.x_offset(),
                          to.out_offset + o.scales_offset(),
                          to.meta_offset + m.idx_offset(),
                          to.meta_offset + m.weights_offset(),
                          to.meta_offset + m.src_offset(),
                          to.out_rows,
                          a.send_row_offset[d * a.num_channels + c],
                          d * a.experts_per_rank};
  }
  __syncthreads();
  if (call.in_pool || a.row_of_token != nullptr) {
    int begin, end;
    channel_range(a.num_tokens, a.num_channels, c, begin, end);
    RowScan scan;
    scan.start(a.is_token_in_rank + static_cast<int64_t>(begin) * num_ranks, (end - begin) * num_ranks, num_ranks,
               lane);
    ChannelRow at;
    for (int q = half * kDirectWarps + warp; scan.find(q, lane, at); q += 2 * kDirectWarps) {
      const DirectDest& to = dests[at.dst];
      const int64_t row = to.row0 + at.k;
      if (row >= to.rows) continue;  // past d's row count (num_worst_tokens): dropped
      const int t = begin + at.token;
      if (call.in_pool) write_row(a, a.c.peers[at.dst], to, row, t, lane);
      if (a.row_of_token != nullptr && lane == 0) {
        a.row_of_token[static_cast<int64_t>(t) * num_ranks + at.dst] = static_cast<int>(row);
      }
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
