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
// Protocol, per call n (n = my Control::direct_calls + 1; every rank makes the same direct calls in the same
// order, so n is the same on every rank):
//  1. Ready: my block 0 stores my blocks' offsets, my rows and the call's layout word into every peer's
//     direct_out_offset / direct_meta_offset / direct_out_rows / direct_layout [me] (plain stores), then n into
//     its direct_ready[me] (st.release.sys: it publishes the words before it). My kernel of call n starts after
//     everything my stream queued before it, so whatever used the memory of my outputs before (the pool's
//     caching allocator hands a block back to its stream only in stream order) is done: a peer that sees n may
//     write there.
//  2. Verdict: threads 0..R-1 of every block acquire every rank's direct_ready (>= n) and read its words (after
//     the acquire in program order); the block barrier hands them to the block. Every rank's blocks peer-mapped
//     and every layout word equal to mine: direct. Else the call is missed: nobody writes rows (a missed call
//     still fills row_of_token), and the ring kernel queued next on every rank (ring_fallback_kernel) moves it;
//     its ring signature check reports a layout that differs. The same words reach every block of every rank, so
//     the verdict is the same everywhere.
//  3. Rows, then arrival: every thread of the block fences at system scope (__threadfence_system: its stores
//     before any later store of it, at system scope), the block barrier collects the threads, then thread d adds
//     1 to d's direct_arrivals[me] (red.release.sys, cumulative over the barrier), also in a missed call: the
//     arrival says the block is past its reads of call n's words.
//  4. Completion: my block 0 (thread s) waits with ld.acquire.sys until direct_arrivals[s] reaches 2C, which
//     orders every source's rows into my outputs before the end of my kernel, hence before any later work of my
//     stream. Then it resets direct_arrivals[s] to 0: no block of s adds to it again before s sees my
//     direct_ready of call n + 1, which my next kernel stores only after this one ended. Last, thread 0 marks a
//     missed call (direct_missed = n) and stores n into my direct_calls: every block of mine read direct_calls
//     before arriving at me (step 3), and block 0 saw all 2C of my arrivals, so no block of this call reads the
//     new value. The words of call n are not overwritten before every sender read them: a sender reads them
//     before it arrives, and my next kernel starts after this one saw every arrival.
// A call that notify refused (common/refused_call.cuh) moves nothing and touches no word: every block returns at
// its start (the ring kernel queued next pads the outputs of a refused call), so the next call starts from the
// same counters on every rank.
#include "kernels/common/copy.cuh"
#include "kernels/common/launch_check.cuh"
#include "kernels/common/refused_call.cuh"
#include "kernels/common/ring_layout.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/intranode/protocol.h"
#include "kernels/intranode/rings.cuh"  // warp_outcome
#include "kernels/intranode/token_scan.cuh"

namespace moe_ep::intranode {
namespace {

constexpr int kDirectWarps = 24;  // as the ring kernel: 1024 threads would cap ptxas at 64 registers (it spilled)
constexpr int kDirectThreads = kDirectWarps * 32;
constexpr int kDirectUnroll = 4;  // 16-byte loads in flight per lane while copying a row

// Arrival (step 3): release at system scope, cumulative over the block barrier that precedes it.
__device__ __forceinline__ void red_add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

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
  __shared__ uint64_t call;
  __shared__ int ready, in_pool, all_arrived;
  __shared__ int64_t out_rows[kMaxRanks], out_offset[kMaxRanks], meta_offset[kMaxRanks];
  const int num_ranks = a.c.num_ranks, me = a.c.rank, c = blockIdx.x >> 1, half = blockIdx.x & 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  auto* ctl = reinterpret_cast<Control*>(a.c.peers[me]);
  if (call_refused(a.recv_channel_offset)) return;  // the same word in every block of every rank
  if (threadIdx.x == 0) {
    call = *reinterpret_cast<volatile uint64_t*>(&ctl->direct_calls) + 1;
    ready = in_pool = all_arrived = 1;
  }
  __syncthreads();
  const uint64_t n = call;
  if (blockIdx.x == 0 && threadIdx.x < num_ranks) {  // 1. my words of call n, then ready for call n
    auto* peer = reinterpret_cast<Control*>(a.c.peers[threadIdx.x]);
    peer->direct_out_offset[me] = a.out_offset;
    peer->direct_meta_offset[me] = a.meta_offset;
    peer->direct_out_rows[me] = a.out_rows;
    peer->direct_layout[me] = a.layout;
    ptx::st_release_sys(&peer->direct_ready[me], n);
  }
  const Watchdog dog = make_watchdog(a.c.timeout_ns, me, &ctl->timeout_claim, &a.c.mailbox->timeout,
                                     ctl->peer_aborted);
  if (threadIdx.x < num_ranks) {  // 2. every rank's words of call n, and the verdict
    const int d = threadIdx.x;
    if (wait_at_least(&ctl->direct_ready[d], n, dog, kPhaseDirectReady, d)) {
      out_rows[d] = *reinterpret_cast<volatile int64_t*>(&ctl->direct_out_rows[d]);
      out_offset[d] = *reinterpret_cast<volatile int64_t*>(&ctl->direct_out_offset[d]);
      meta_offset[d] = *reinterpret_cast<volatile int64_t*>(&ctl->direct_meta_offset[d]);
      const uint64_t layout = *reinterpret_cast<volatile uint64_t*>(&ctl->direct_layout[d]);
      if (out_offset[d] < 0 || (a.write_meta && meta_offset[d] < 0) || layout != a.layout) in_pool = 0;
    } else {
      ready = 0;
    }
  }
  __syncthreads();
  if (!ready) return;  // a timeout, recorded: the call fails (no arrival anywhere: the peers time out too)

  // 3. Rows (and my padding: my own outputs, written by nobody else). A missed call still walks the rows when
  //    row_of_token is asked for (the pull combine along this handle needs it whichever kernel moved them).
  if (in_pool && a.pad_rows) pad_my_rows(a, a.c.peers[me] + a.out_offset, a.c.peers[me] + a.meta_offset);
  const int warps = kDirectWarps / num_ranks;  // warps per destination in this block
  const int d = warp / warps, w = half * warps + warp % warps, stride = 2 * warps;
  if ((in_pool || a.row_of_token != nullptr) && d < num_ranks) {
    const int64_t rows = out_rows[d];
    const DirectPayload o{rows, a.hidden_bytes, a.num_scales};
    const DirectMeta m{rows, a.num_topk};
    uint8_t* out = a.c.peers[d] + out_offset[d];
    uint8_t* meta = a.c.peers[d] + meta_offset[d];
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
      if (in_pool) write_row(a, o, out, m, meta, row, t, lo, hi, lane);
      if (a.row_of_token != nullptr && lane == 0) a.row_of_token[static_cast<int64_t>(t) * num_ranks + d] = row;
    }
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < num_ranks) {
    red_add_release_sys(&reinterpret_cast<Control*>(a.c.peers[threadIdx.x])->direct_arrivals[me], 1);
  }
  if (blockIdx.x != 0) return;  // one block completes the call (the channel's other block is block 1)

  // 4. Completion (block 0): every source's blocks arrived here.
  if (threadIdx.x < num_ranks) {
    const int s = threadIdx.x;
    if (wait_at_least(&ctl->direct_arrivals[s], static_cast<uint64_t>(gridDim.x), dog, kPhaseDirectArrive, s)) {
      ctl->direct_arrivals[s] = 0;
    } else {
      all_arrived = 0;  // a timeout (recorded): the counters are left as they are, the call fails
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && all_arrived) {
    if (!in_pool) {
      *reinterpret_cast<volatile uint64_t*>(&ctl->direct_missed) = n;
      ctl->direct_missed_total += 1;
    }
    *reinterpret_cast<volatile uint64_t*>(&ctl->direct_calls) = n;
  }
}

}  // namespace

void launch_direct_dispatch(const DirectDispatchArgs& args, cudaStream_t stream) {
  dispatch_direct_kernel<<<2 * args.num_channels, kDirectThreads, 0, stream>>>(args);
  check_launch("dispatch_direct_kernel");
}

}  // namespace moe_ep::intranode
