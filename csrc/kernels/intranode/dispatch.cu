// Dispatch (fresh and cached): block 2c sends channel c's tokens to every rank, block 2c+1 receives
// channel c's rows from every rank. Inside a block, the 24 / R copy warps of group g serve peer g, each
// at its own pace, and one more warp publishes the rings' counters in order (rings.cuh).
//
// Sender warps for destination d: walk their channel's tokens with is_token_in_rank[t][d] set; the k-th
// such token is row k of ring (c, me -> d), taken by warp k % W: payload, scales, top-k rebased to d's
// local experts with weights zeroed elsewhere, source index. Rows therefore sit in token order.
// Receiver warps for source s: the k-th row of channel c from s goes to row
// recv_channel_offset[s][c] + k (computed by notify, or kept in the handle for cached dispatch),
// which gives exactly the (source rank, token) order of the contract.
// A call that notify refused (common/refused_call.cuh) moves nothing: every block returns at its start, after
// the receiver blocks padded every output row (num_worst_tokens; a refused call received nothing).
// A cached dispatch (a.ring_signature != 0) carries its ring signature with row 0 of every ring; a receiver warp
// whose source sent another one writes zero rows for that source's rows (common/ring_signature.cuh).
#include "kernels/common/channel.cuh"
#include "kernels/common/copy.cuh"
#include "kernels/common/launch_check.cuh"
#include "kernels/common/refused_call.cuh"
#include "kernels/common/ring_layout.cuh"
#include "kernels/common/ring_signature.cuh"
#include "kernels/intranode/protocol.h"
#include "kernels/intranode/rings.cuh"
#include "kernels/intranode/token_scan.cuh"

namespace moe_ep::intranode {
namespace {

// 16-byte loads in flight per lane while copying a row (6 and 8 measured no faster than 4).
constexpr int kDispatchUnroll = 4;

// Whole warp: the slot fields after the payload of token t's row bound for the rank whose experts are
// [lo, hi): scales, top-k rebased to that rank's local experts (weights zeroed elsewhere), source index.
__device__ __forceinline__ void write_meta(const DispatchArgs& a, const DispatchSlot& layout, uint8_t* slot, int t,
                                           int lo, int hi, int lane) {
  for (int j = lane; j < a.num_scales; j += 32) {
    layout.scales(slot)[j] = a.scales[static_cast<int64_t>(t) * a.num_scales + j];
  }
  if (a.topk_idx != nullptr && lane < a.num_topk) {
    const int64_t e = a.topk_idx[static_cast<int64_t>(t) * a.num_topk + lane];
    const int local = (e >= lo && e < hi) ? static_cast<int>(e - lo) : -1;
    layout.idx(slot)[lane] = local;
    layout.weights(slot)[lane] =
        (local >= 0 && a.topk_weights != nullptr) ? a.topk_weights[static_cast<int64_t>(t) * a.num_topk + lane] : 0.f;
  }
  if (lane == 0) *layout.source(slot) = t;
}

// Whole warp: token t's row (payload and write_meta's fields) into a ring slot.
__device__ __forceinline__ void send_row(const DispatchArgs& a, const DispatchSlot& layout, uint8_t* slot, int t,
                                         int lo, int hi, int lane) {
  warp_copy<false, kDispatchUnroll>(reinterpret_cast<int4*>(slot),
                                    reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.hidden_bytes),
                                    a.hidden_bytes / 16, lane);
  write_meta(a, layout, slot, t, lo, hi, lane);
}

// Whole warp: the ring slot of received row `row` into the outputs.
__device__ __forceinline__ void receive_row(const DispatchArgs& a, const DispatchSlot& layout, int64_t row,
                                            uint8_t* slot, int lane) {
  const int k = a.num_topk;
  warp_copy<true, kDispatchUnroll>(reinterpret_cast<int4*>(a.recv_x + row * a.hidden_bytes),
                                   reinterpret_cast<const int4*>(slot), a.hidden_bytes / 16, lane);
  for (int j = lane; j < a.num_scales; j += 32) {
    a.recv_scales[row * a.num_scales + j] = ptx::ld_cg(layout.scales(slot) + j);
  }
  if (a.recv_topk_idx != nullptr && lane < k) {
    a.recv_topk_idx[row * k + lane] = ptx::ld_cg(layout.idx(slot) + lane);
    a.recv_topk_weights[row * k + lane] =
        __int_as_float(ptx::ld_cg(reinterpret_cast<const int*>(layout.weights(slot)) + lane));
  }
  if (a.recv_src_idx != nullptr && lane == 0) a.recv_src_idx[row] = ptx::ld_cg(layout.source(slot));
}

// Whole warp: received row `row` of a source whose ring signature disagrees (a cached dispatch, so no top-k and
// no source index): zero payload and scales, nothing read from the slot.
__device__ __forceinline__ void zero_row(const DispatchArgs& a, int64_t row, int lane) {
  int4* out = reinterpret_cast<int4*>(a.recv_x + row * a.hidden_bytes);
  for (int v = lane; v < a.hidden_bytes / 16; v += 32) out[v] = make_int4(0, 0, 0, 0);
  for (int j = lane; j < a.num_scales; j += 32) a.recv_scales[row * a.num_scales + j] = 0;
}

// num_worst_tokens: rows past the received count get zero payload and scales (as the reference pads),
// top-k -1, weight 0, source -1. Every thread of the receiver blocks takes its share (block c of C).
__device__ void pad_worst_rows(const DispatchArgs& a, int c) {
  const int received = a.recv_channel_offset[(a.c.num_ranks - 1) * (a.num_channels + 1) + a.num_channels];
  const int64_t first = min(received, a.num_rows), extra = a.num_rows - first;
  const int64_t stride = static_cast<int64_t>(a.num_channels) * blockDim.x;
  const int64_t start = static_cast<int64_t>(c) * blockDim.x + threadIdx.x;
  const int vecs = a.hidden_bytes / 16;
  auto* x_pad = reinterpret_cast<int4*>(a.recv_x + first * a.hidden_bytes);
  for (int64_t i = start; a.recv_x != nullptr && i < extra * vecs; i += stride) x_pad[i] = make_int4(0, 0, 0, 0);
  for (int64_t i = start; a.recv_scales != nullptr && i < extra * a.num_scales; i += stride) {
    a.recv_scales[first * a.num_scales + i] = 0;
  }
  for (int64_t i = start; a.recv_topk_idx != nullptr && i < extra * a.num_topk; i += stride) {
    a.recv_topk_idx[first * a.num_topk + i] = -1;
    a.recv_topk_weights[first * a.num_topk + i] = 0.f;
  }
  for (int64_t i = start; a.recv_src_idx != nullptr && i < extra; i += stride) a.recv_src_idx[first + i] = -1;
}

// 24 copy warps (24 / R per ring) and the publisher warp.
constexpr int kCopyWarps = kWarps;
constexpr int kDispatchThreads = (kCopyWarps + 1) * 32;

// Sender warp `gw` of the `warps` serving destination d: rows gw, gw + warps, ... of ring (c, me -> d).
__device__ void send_ring(const DispatchArgs& a, int c, int d, int gw, int warps, int lane, uint64_t tail0,
                            RingBoard& board, int* shared_ok, const Watchdog& dog) {
  const int me = a.c.rank;
  auto* ctl = reinterpret_cast<Control*>(a.c.peers[me]);
  uint8_t* ring = ring_at(a.c.peers[d] + kRingsOffset, a.c.src_block_bytes, me, c, a.num_slots, a.slot_bytes);
  const uint64_t* head = &ctl->fifo_head[c][d];
  const DispatchSlot layout{a.hidden_bytes, a.num_scales, a.num_topk};
  const int lo = d * a.experts_per_rank, hi = lo + a.experts_per_rank;

  if (!sender_group_ready(ctl, d, gw == 0 && lane == 0, warps * 32, shared_ok, dog)) {
    board.leave(d, gw, -1, lane);
    return;
  }
  int begin, end;
  channel_range(a.num_tokens, a.num_channels, c, begin, end);
  TokenScan scan{a.is_token_in_rank, a.c.num_ranks, d, end};
  scan.start(begin, lane);
  uint64_t head_seen = 0;
  int k = gw;
  for (;; k += warps) {
    const int t = scan.find(k, lane);
    if (t < 0) break;
    const uint64_t row = tail0 + static_cast<uint64_t>(k);
    if (!warp_outcome(lane != 0 || wait_free_slot(head, head_seen, row, a.num_slots, dog, kPhaseDispatchSend, d))) {
      board.leave(d, gw, -1, lane);
      return;
    }
    // Row 0 of the call on this ring: the ring signature first, published with the row (ring_signature.cuh).
    if (k == 0 && lane == 0 && a.ring_signature != 0) {
      publish_ring_signature(reinterpret_cast<Control*>(a.c.peers[d]), me, a.ring_signature);
    }
    send_row(a, layout, ring_slot(ring, row, a.num_slots, a.slot_bytes), t, lo, hi, lane);
    board.advance(d, gw, k + warps, lane);
  }
  board.leave(d, gw, k, lane);
}

// Receiver warp `gw` of the `warps` serving source s: rows gw, gw + warps, ... of ring (c, s -> me); the k-th
// goes to row recv_channel_offset[s][c] + k.
__device__ void receive_ring(const DispatchArgs& a, int c, int s, int gw, int warps, int lane, uint64_t head0,
                               RingBoard& board, const Watchdog& dog) {
  const int me = a.c.rank;
  auto* ctl = reinterpret_cast<Control*>(a.c.peers[me]);
  uint8_t* ring = ring_at(a.c.peers[me] + kRingsOffset, a.c.src_block_bytes, s, c, a.num_slots, a.slot_bytes);
  const uint64_t* tail = &ctl->fifo_tail[c][s];
  const DispatchSlot layout{a.hidden_bytes, a.num_scales, a.num_topk};
  const int* offsets = a.recv_channel_offset + s * (a.num_channels + 1);
  const int row0 = offsets[c], count = offsets[c + 1] - row0;
  uint64_t tail_seen = 0;
  bool disagrees = false;  // the source's ring signature differs from this call's: its slots are not read
  int k = gw;
  for (; k < count; k += warps) {
    const uint64_t index = head0 + static_cast<uint64_t>(k);
    if (!warp_outcome(lane != 0 || wait_published(tail, tail_seen, index, dog, kPhaseDispatchRecv, s))) {
      board.leave(s, gw, -1, lane);
      return;
    }
    // The warp's first row of the call: the tail acquired past it is past row 0, whose release published the
    // sender's ring signature (warp_outcome's __syncwarp orders lane 0's acquire before every lane's load).
    if (k == gw && a.ring_signature != 0) disagrees = ring_disagrees(ctl, a.c.mailbox, s, a.ring_signature, lane == 0);
    const int64_t row = row0 + static_cast<int64_t>(k);
    if (row < a.num_rows) {  // more rows than num_worst_tokens: dropped, reported by notify
      if (disagrees) {
        zero_row(a, row, lane);
      } else {
        receive_row(a, layout, row, ring_slot(ring, index, a.num_slots, a.slot_bytes), lane);
      }
    }
    board.advance(s, gw, k + warps, lane);
  }
  board.leave(s, gw, k, lane);
}

// Block 2c sends channel c, 2c + 1 receives it; warp 24 is the publisher: tails of
// the rings to every destination (sender block), heads of the rings from every source (receiver block).
// The kernels below own the shared memory (board, shared_ok[kMaxRanks]) and pass it in.
__device__ __forceinline__ void ring_dispatch(const DispatchArgs& a, RingBoard& board, int* shared_ok) {
  const int num_ranks = a.c.num_ranks, me = a.c.rank;
  const int c = blockIdx.x >> 1;
  const bool sender = (blockIdx.x & 1) == 0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int warps = kCopyWarps / num_ranks;  // copy warps per ring
  const bool publisher = warp == kCopyWarps;
  auto* ctl = reinterpret_cast<Control*>(a.c.peers[me]);
  // The ring whose counter this thread starts from (the publisher's lane p: ring p).
  const int ring = publisher ? lane : warp / warps;
  // Loaded before ring_block_start's counter load and barrier, tested after them (its latency hides behind
  // theirs); the same word in every block, so all blocks of every rank leave alike.
  const bool refused = call_refused(a.recv_channel_offset);
  const uint64_t base = ring_block_start(ctl, board, c, ring, num_ranks, sender);

  if (!sender && a.pad_rows) pad_worst_rows(a, c);
  if (refused) return;  // no ring, counter or drain touched: the next call starts from the same counters
  if (publisher) {
    uint64_t* word = nullptr;
    if (lane < num_ranks) {
      auto* peer = reinterpret_cast<Control*>(a.c.peers[lane]);
      word = sender ? &peer->fifo_tail[c][me] : &peer->fifo_head[c][me];
    }
    // Sender: a tail update per `chunk` rows at least (at most half a ring, see rings.cuh); receiver: every
    // consumed row is released at once.
    const int batch = sender ? max(1, min(a.chunk, a.num_slots / 2)) : 1;
    uint64_t* mirror = sender && lane < num_ranks ? &ctl->tail_copy[c][lane] : nullptr;
    const int n = publish_in_order(board, num_ranks, warps, batch, word, base, mirror, lane);
    if (!sender && lane < num_ranks) ctl->head_copy[c][lane] = base + n;  // read by the next kernel
    return;
  }
  const int gw = warp % warps;
  if (ring >= num_ranks) return;  // idle warps when 24 % R != 0
  const Watchdog dog = make_watchdog(a.c.timeout_ns, me, &ctl->timeout_claim, &a.c.mailbox->timeout,
                                     ctl->peer_aborted);
  if (sender) {
    send_ring(a, c, ring, gw, warps, lane, base, board, &shared_ok[ring], dog);
  } else {
    receive_ring(a, c, ring, gw, warps, lane, base, board, dog);
  }
}

__global__ void __launch_bounds__(kDispatchThreads, 1) dispatch_kernel(DispatchArgs a) {
  __shared__ RingBoard board;
  __shared__ int shared_ok[kMaxRanks];
  ring_dispatch(a, board, shared_ok);
}

// The ring kernel queued after a direct dispatch (dispatch_direct.cu): it moves the call only if the direct kernel,
// which ended before it on the stream, missed it (Control::direct: missed == calls; both words are this
// rank's, written by that kernel's block 0, and the verdict is the same on every rank, so all blocks of every rank
// leave alike, before any counter is touched), or notify refused it (the ring kernel's refused path pads the
// outputs and touches no counter; the direct kernel moved nothing). Named apart from the call's kernel: a profile shows one kernel
// named for the dispatch (the direct one), and this one's few microseconds when it moves nothing.
__global__ void __launch_bounds__(kDispatchThreads, 1) ring_fallback_kernel(DispatchArgs a) {
  const auto* ctl = reinterpret_cast<const Control*>(a.c.peers[a.c.rank]);
  if (!call_refused(a.recv_channel_offset) && *reinterpret_cast<const volatile uint64_t*>(&ctl->direct.missed) !=
                                                  *reinterpret_cast<const volatile uint64_t*>(&ctl->direct.calls)) {
    return;
  }
  __shared__ RingBoard board;
  __shared__ int shared_ok[kMaxRanks];
  ring_dispatch(a, board, shared_ok);
}

}  // namespace

void launch_ring_fallback(const DispatchArgs& args, cudaStream_t stream) {
  ring_fallback_kernel<<<2 * args.num_channels, kDispatchThreads, 0, stream>>>(args);
  check_launch("ring_fallback_kernel");
}

void launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  dispatch_kernel<<<2 * args.num_channels, kDispatchThreads, 0, stream>>>(args);
  check_launch("dispatch_kernel");
}

}  // namespace moe_ep::intranode
