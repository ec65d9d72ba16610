// Combine: the reverse path of dispatch. Block 2c sends the rows this rank received in channel c
// back to their source ranks (group g serves source g, rows in received order = token order);
// block 2c+1 reduces, for each of its channel's tokens, the rows returned by every rank that got
// the token: out = cast(bias_0 + bias_1 + sum over ranks ascending), accumulated in float32 in that
// order, exactly like the reference; the returned top-k weights are summed the same way.
//
// Rows move as in dispatch (rings.cuh): sender warps at their own pace behind a publisher warp; a receiver
// warp takes tokens round robin and waits only for its own token's rows, and a release warp returns the
// slots of every token below the smallest one still in progress. No block-wide barrier, so reducing overlaps
// the arrival of later rows.
// A call that notify refused (common/refused_call.cuh) moves nothing: every block returns at its start, after
// the receiver blocks wrote zero rows (and weights) for their channel's tokens.
// Every combine carries its ring signature with row 0 of every ring; a receiver lane whose source sent another
// one leaves that source out of its sums (common/ring_signature.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/common/channel.cuh"
#include "kernels/common/copy.cuh"
#include "kernels/common/launch_check.cuh"
#include "kernels/common/refused_call.cuh"
#include "kernels/common/ring_layout.cuh"
#include "kernels/common/ring_signature.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/intranode/protocol.h"
#include "kernels/intranode/reduce_token.cuh"
#include "kernels/intranode/rings.cuh"

namespace moe_ep::intranode {
namespace {

// Whole warp: received row r and its top-k weights into a ring slot.
__device__ __forceinline__ void send_row(const CombineArgs& a, int64_t r, uint8_t* slot, int row_bytes, int lane) {
  warp_copy<false, 8>(reinterpret_cast<int4*>(slot), reinterpret_cast<const int4*>(a.x + r * row_bytes),
                      row_bytes / 16, lane);
  if (a.topk_weights != nullptr && lane < a.num_topk) {
    reinterpret_cast<float*>(slot + row_bytes)[lane] = a.topk_weights[r * a.num_topk + lane];
  }
}

// Sender blocks: 19 copy warps (19 / R per ring) and the publisher warp. Receiver blocks: 19 reduce warps and
// the release warp. 20 warps are 5 per SM sub-partition, which leaves 96 registers per thread (17 would too).
constexpr int kCombineWarps = 19;
constexpr int kCombineThreads = (kCombineWarps + 1) * 32;

// Sender warp `gw` of the `warps` serving source rank s: received rows gw, gw + warps, ... of channel c
// (those that came from s) into ring (c, me -> s).
template <typename T>
__device__ void send_ring(const CombineArgs& a, int c, int s, int gw, int warps, int lane, uint64_t tail0,
                            RingBoard& board, int* shared_ok, const Watchdog& dog) {
  const int me = a.c.rank;
  auto* ctl = reinterpret_cast<Control*>(a.c.peers[me]);
  uint8_t* ring = ring_at(a.c.peers[s] + kRingsOffset, a.c.src_block_bytes, me, c, a.num_slots, a.slot_bytes);
  const uint64_t* head = &ctl->fifo_head[c][s];
  const int row_bytes = a.hidden * static_cast<int>(sizeof(T));

  if (!sender_group_ready(ctl, s, gw == 0 && lane == 0, warps * 32, shared_ok, dog)) {
    board.leave(s, gw, -1, lane);
    return;
  }
  const int* offsets = a.recv_channel_offset + s * (a.num_channels + 1);
  const int row0 = offsets[c], count = offsets[c + 1] - row0;
  uint64_t head_seen = 0;
  int k = gw;
  for (; k < count; k += warps) {
    const uint64_t row = tail0 + static_cast<uint64_t>(k);
    if (!warp_outcome(lane != 0 || wait_free_slot(head, head_seen, row, a.num_slots, dog, kPhaseCombineSend, s))) {
      board.leave(s, gw, -1, lane);
      return;
    }
    // Row 0 of the call on this ring: the ring signature first, published with the row (ring_signature.cuh),
    // even when the row itself is dropped below.
    if (k == 0 && lane == 0) publish_ring_signature(reinterpret_cast<Control*>(a.c.peers[s]), me, a.ring_signature);
    const int64_t r = row0 + static_cast<int64_t>(k);
    if (r < a.num_x_rows) {  // else dropped by a num_worst_tokens overflow (reported by notify)
      uint8_t* slot = ring_slot(ring, row, a.num_slots, a.slot_bytes);
      send_row(a, r, slot, row_bytes, lane);
    }
    board.advance(s, gw, k + warps, lane);
  }
  board.leave(s, gw, k, lane);
}

// A warp's walk over its channel's tokens for every ring at once, 32 tokens at a time: lane d (< R) holds
// ring d's hits in the window [base, base + 32) (`mask`) and in the windows before it (`before`); lane i
// holds the flags of token base + 32 + i (`next_bits`, bit d for ring d), loaded one window ahead.
template <int kRanks>
struct RingScan {
  const bool* in_rank;
  int num_ranks, end;
  int base, before;
  unsigned mask, next_bits;

  __device__ unsigned flags(int t) const {
    unsigned bits = 0;
    if (t < end) {
#pragma unroll
      for (int d = 0; d < kRanks; ++d) {
        if (d < num_ranks && in_rank[static_cast<int64_t>(t) * num_ranks + d]) bits |= 1u << d;
      }
    }
    return bits;
  }
  __device__ void load(int lane) {  // mask: the window at base (from next_bits); next_bits: base + 32
    unsigned mine = 0;
#pragma unroll
    for (int d = 0; d < kRanks; ++d) {
      const unsigned m = __ballot_sync(0xffffffffu, (next_bits >> d) & 1u);
      if (lane == d) mine = m;
    }
    mask = mine;
    next_bits = flags(base + 32 + lane);
  }
  __device__ void start(int begin, int lane) {
    base = begin;
    before = 0;
    next_bits = flags(begin + lane);
    load(lane);
  }
  // Moves to the window of token t (t >= the last t, at most end).
  __device__ void seek(int t, int lane) {
    while (t >= base + 32) {
      before += __popc(mask);
      base += 32;
      load(lane);
    }
  }
  // Lane d, after seek(t): rows of ring d for the tokens before t; whether ring d has a row for t.
  __device__ int rows_before(int t) const { return before + __popc(mask & ((1u << (t - base)) - 1u)); }
  __device__ bool has(int t) const { return (mask >> (t - base)) & 1u; }
};

// Reduce warp `warp`: tokens begin + warp, begin + warp + 19, ... of channel c. Lane d waits (cached
// ld.acquire.sys of ring d's tail) only for this token's row of ring d; then the warp reduces the token.
// Board entry next[0][warp]: the warp's next token (relative to begin); tokens below it are done.
template <typename T, int kRanks>
__device__ void reduce_tokens(const CombineArgs& a, int c, int warp, int lane, uint64_t head0, RingBoard& board,
                              const Watchdog& dog) {
  const int me = a.c.rank, num_ranks = a.c.num_ranks;
  auto* ctl = reinterpret_cast<Control*>(a.c.peers[me]);
  const int row_bytes = a.hidden * static_cast<int>(sizeof(T));
  int begin, end;
  channel_range(a.num_tokens, a.num_channels, c, begin, end);
  const bool ring_lane = lane < num_ranks;
  const uint8_t* ring =
      ring_lane ? ring_at(a.c.peers[me] + kRingsOffset, a.c.src_block_bytes, lane, c, a.num_slots, a.slot_bytes) : nullptr;
  const uint64_t* tail = ring_lane ? &ctl->fifo_tail[c][lane] : nullptr;
  uint64_t seen = 0;
  // Lane d: 0 until its first row of ring d in this call, then 1 (signatures agree) or 2 (ring d left out).
  int verdict = 0;
  RingScan<kRanks> scan{a.is_token_in_rank, num_ranks, end};
  scan.start(begin, lane);
  int j = warp;
  for (; begin + j < end; j += kCombineWarps) {
    const int t = begin + j;
    scan.seek(t, lane);
    const bool has = ring_lane && scan.has(t);
    const uint64_t index = head0 + static_cast<uint64_t>(scan.rows_before(t));
    const bool ok = !has || wait_published(tail, seen, index, dog, kPhaseCombineRecv, lane);
    if (!__all_sync(0xffffffffu, ok)) {
      board.leave(0, warp, -1, lane);
      return;
    }
    __syncwarp();  // every lane's tail acquire before every lane's slot loads
    // Lane d's first row of ring d: its tail acquire (past row 0 of the call) published the sender's ring
    // signature. Every reduce warp of the block compares it once; the first lanes to differ record it.
    if (has && verdict == 0) verdict = ring_disagrees(ctl, a.c.mailbox, lane, a.ring_signature, true) ? 2 : 1;
    const uint8_t* mine = has && verdict == 1 ? ring_slot(ring, index, a.num_slots, a.slot_bytes) : nullptr;
    const uint8_t* src[kRanks];  // ascending d = sum order
#pragma unroll
    for (int d = 0; d < kRanks; ++d) {
      src[d] = reinterpret_cast<const uint8_t*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(mine), d));
    }
    const uint8_t* weights[kRanks];  // a slot's top-k weights follow its row
#pragma unroll
    for (int d = 0; d < kRanks; ++d) weights[d] = src[d] != nullptr ? src[d] + row_bytes : nullptr;
    reduce_token<T, kRanks>(a, t, src, weights, row_bytes, lane);
    board.advance(0, warp, j + kCombineWarps, lane);
  }
  board.leave(0, warp, j, lane);
}

// The release warp of a receiver block: lane d returns to rank d the slots of ring d that hold the rows of
// every token below the smallest board entry (all reduced), st.release.sys of the head in d's buffer, as soon
// as it moves; at the end, head_copy for the next kernel.
template <int kRanks>
__device__ void release_rings(const CombineArgs& a, int c, int lane, uint64_t head0, const RingBoard& board) {
  const int me = a.c.rank, num_ranks = a.c.num_ranks;
  auto* ctl = reinterpret_cast<Control*>(a.c.peers[me]);
  int begin, end;
  channel_range(a.num_tokens, a.num_channels, c, begin, end);
  uint64_t* word = lane < num_ranks ? &reinterpret_cast<Control*>(a.c.peers[lane])->fifo_head[c][me] : nullptr;
  RingScan<kRanks> scan{a.is_token_in_rank, num_ranks, end};
  scan.start(begin, lane);
  int released = 0;
  while (true) {
    // `left` first (lane 0, then a warp barrier): when every warp has left, the entries read after are final.
    int left = lane == 0 ? board.left_count(0) : 0;
    left = __shfl_sync(0xffffffffu, left, 0);
    __syncwarp();
    // Tokens all reduced (the barrier inside orders every lane's acquire before any lane's release below).
    const int j = board.lowest_in_warp(0, kCombineWarps, lane);
    const int t = begin + min(j, end - begin);
    scan.seek(t, lane);
    const int rows = scan.rows_before(t);
    bool moved = false;
    if (lane < num_ranks && rows > released) {
      ptx::st_release_sys(word, head0 + static_cast<uint64_t>(rows));  // d may overwrite these slots
      released = rows;
      moved = true;
    }
    if (left == kCombineWarps) break;
    if (!__any_sync(0xffffffffu, moved)) __nanosleep(64);
  }
  if (lane < num_ranks) ctl->head_copy[c][lane] = head0 + static_cast<uint64_t>(released);
}

template <typename T, int kRanks>
__device__ void receive_channel(const CombineArgs& a, int c, int warp, int lane, uint64_t head0, RingBoard& board,
                               const Watchdog& dog) {
  if (warp == kCombineWarps) {
    release_rings<kRanks>(a, c, lane, head0, board);
  } else {
    reduce_tokens<T, kRanks>(a, c, warp, lane, head0, board, dog);
  }
}

// One instantiation per dtype and rank count (rounded up to 2, 4, 8), so that each compiles only its own
// paths within the 96 registers.
// The kernels below own the shared memory (board, shared_ok[kMaxRanks]) and pass it in.
template <typename T, int kRanks>
__device__ __forceinline__ void ring_combine(const CombineArgs& a, RingBoard& board, int* shared_ok) {
  const int num_ranks = a.c.num_ranks, me = a.c.rank;
  const int c = blockIdx.x >> 1;
  const bool sender = (blockIdx.x & 1) == 0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int warps = kCombineWarps / num_ranks;  // sender warps per ring
  const bool extra = warp == kCombineWarps;     // publisher (sender block) or release warp (receiver)
  auto* ctl = reinterpret_cast<Control*>(a.c.peers[me]);
  // The ring whose counter this thread starts from. Sender: the warp's ring (lane p's for the publisher);
  // receiver: lane d holds ring d's head.
  const int ring = sender && !extra ? warp / warps : lane;
  const bool refused = call_refused(a.recv_channel_offset);  // tested after ring_block_start (as dispatch)
  const uint64_t base = ring_block_start(ctl, board, c, ring, num_ranks, sender);
  if (refused) {
    if (!sender) {
      int begin, end;
      channel_range(a.num_tokens, a.num_channels, c, begin, end);
      zero_refused_outputs(a.out, a.out_topk_weights, begin, end, a.hidden * static_cast<int>(sizeof(T)), a.num_topk);
    }
    return;
  }
  const Watchdog dog = make_watchdog(a.c.timeout_ns, me, &ctl->timeout_claim, &a.c.mailbox->timeout,
                                     ctl->peer_aborted);
  if (!sender) {
    receive_channel<T, kRanks>(a, c, warp, lane, base, board, dog);
    return;
  }
  if (extra) {
    uint64_t* word = lane < num_ranks ? &reinterpret_cast<Control*>(a.c.peers[lane])->fifo_tail[c][me] : nullptr;
    uint64_t* mirror = lane < num_ranks ? &ctl->tail_copy[c][lane] : nullptr;
    publish_in_order(board, num_ranks, warps, max(1, min(a.chunk, a.num_slots / 2)), word, base, mirror, lane);
    return;
  }
  if (ring >= num_ranks) return;  // idle warps when 19 % R != 0
  send_ring<T>(a, c, ring, warp % warps, warps, lane, base, board, &shared_ok[ring], dog);
}

template <typename T, int kRanks>
__global__ void __launch_bounds__(kCombineThreads, 1) combine_kernel(CombineArgs a) {
  __shared__ RingBoard board;
  __shared__ int shared_ok[kMaxRanks];
  ring_combine<T, kRanks>(a, board, shared_ok);
}

// The ring combine queued after a pull combine (combine_pull.cu): it moves the call only if the pull kernel, which
// ended before it on the stream, missed it (Control::pull: missed == calls, this rank's words, the same verdict
// on every rank). Named apart from the call's kernel: a profile shows one kernel named for the combine.
template <typename T, int kRanks>
__global__ void __launch_bounds__(kCombineThreads, 1) ring_reduce_fallback_kernel(CombineArgs a) {
  const auto* ctl = reinterpret_cast<const Control*>(a.c.peers[a.c.rank]);
  if (call_refused(a.recv_channel_offset) || *reinterpret_cast<const volatile uint64_t*>(&ctl->pull.missed) !=
                                                 *reinterpret_cast<const volatile uint64_t*>(&ctl->pull.calls)) {
    return;  // the pull kernel moved the call, or zeroed the outputs of a refused one
  }
  __shared__ RingBoard board;
  __shared__ int shared_ok[kMaxRanks];
  ring_combine<T, kRanks>(a, board, shared_ok);
}

template <typename T>
void launch_typed(const CombineArgs& args, dim3 grid, cudaStream_t stream, bool fallback) {
  if (args.c.num_ranks <= 2) {
    (fallback ? ring_reduce_fallback_kernel<T, 2> : combine_kernel<T, 2>)<<<grid, kCombineThreads, 0, stream>>>(args);
  } else if (args.c.num_ranks <= 4) {
    (fallback ? ring_reduce_fallback_kernel<T, 4> : combine_kernel<T, 4>)<<<grid, kCombineThreads, 0, stream>>>(args);
  } else {
    (fallback ? ring_reduce_fallback_kernel<T, 8> : combine_kernel<T, 8>)<<<grid, kCombineThreads, 0, stream>>>(args);
  }
}

void launch_any(const CombineArgs& args, cudaStream_t stream, bool fallback) {
  const dim3 grid(2 * args.num_channels);
  switch (args.dtype) {
    case kBf16: launch_typed<__nv_bfloat16>(args, grid, stream, fallback); break;
    case kFp16: launch_typed<__half>(args, grid, stream, fallback); break;
    default: launch_typed<float>(args, grid, stream, fallback); break;
  }
  check_launch(fallback ? "ring_reduce_fallback_kernel" : "combine_kernel");
}

}  // namespace

void launch_combine(const CombineArgs& args, cudaStream_t stream) { launch_any(args, stream, false); }

void launch_ring_reduce_fallback(const CombineArgs& args, cudaStream_t stream) { launch_any(args, stream, true); }

}  // namespace moe_ep::intranode
