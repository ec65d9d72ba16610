// RowScan: a sender warp's walk over every row its channel sends, whatever the destination (the direct dispatch,
// dispatch_direct.cu, where the warps of a channel share its rows for all destinations).
#pragma once

#include <cstdint>

namespace moe_ep::intranode {

// Where a channel row goes: its token (relative to the channel's first), destination and k, the row's index
// among the channel's rows for that destination.
struct ChannelRow {
  int token, dst, k;
};

// The channel's rows are its hits of is_token_in_rank read as one flat sequence of entries f = token * R + dst
// (tokens ascending, then destinations), 32 entries a window; the q-th hit is the channel's q-th row. Every
// lane holds the same window state: [base, base + 32), its hits `mask`, `before` (the hits of the earlier
// windows); lane d < R also holds `dst_before` (the hits for destination d in the earlier windows) and
// `dst_lanes` (the lanes whose entry in this window is destination d). Lane i's own entry base + i is
// (my_token, my_dst). The flags of the next two windows are held ahead (ahead1, ahead2: lane i's entries
// base + 32 + i and base + 64 + i). A warp takes one row in 48 (one in 2 x 24 warps), so it crosses about one
// and a half windows a row when every flag is set and more at sparser routings (about 2.3 at R = 8 with top-8
// of 256). The compiler packs the held bools into one register at their load, so the load's latency is paid
// at the crossing that issues it, not two windows later (the block's warps read the same 32-byte windows,
// mostly from L1).
struct RowScan {
  const bool* flags;  // is_token_in_rank of the channel's first token: (end - begin) x R entries
  int n, num_ranks;
  int step_tokens, step_dst;  // 32 entries = step_tokens tokens + step_dst destinations
  int from_lane;              // lane d < R: destination d's lanes in the next window are (d - step_dst) mod R's now
  int base, before, dst_before;
  unsigned dst_lanes;
  int my_token, my_dst;
  unsigned mask;
  bool ahead1, ahead2;

  __device__ bool hit(int f) const { return f < n && flags[f]; }

  __device__ void start(const bool* channel_flags, int num_entries, int ranks, int lane) {
    flags = channel_flags;
    n = num_entries;
    num_ranks = ranks;
    step_tokens = 32 / ranks;
    step_dst = 32 % ranks;
    from_lane = lane < ranks ? (lane - step_dst + ranks) % ranks : lane;
    base = before = dst_before = 0;
    my_token = lane / ranks;
    my_dst = lane % ranks;
    dst_lanes = 0;
    for (int d = 0; d < ranks; ++d) {
      const unsigned lanes = __ballot_sync(0xffffffffu, my_dst == d);
      if (lane == d) dst_lanes = lanes;
    }
    mask = __ballot_sync(0xffffffffu, hit(lane));
    ahead1 = hit(32 + lane);
    ahead2 = hit(64 + lane);
  }

  // The next window: lane d < R counts the hits for destination d of the window it leaves, every lane moves its
  // entry on by 32 (and lane d takes destination d's lanes of the next window).
  __device__ void advance(int lane) {
    if (lane < num_ranks) dst_before += __popc(mask & dst_lanes);
    dst_lanes = __shfl_sync(0xffffffffu, dst_lanes, from_lane);
    before += __popc(mask);
    base += 32;
    my_token += step_tokens;
    my_dst += step_dst;
    if (my_dst >= num_ranks) {
      my_dst -= num_ranks;
      my_token += 1;
    }
    mask = __ballot_sync(0xffffffffu, ahead1);
    ahead1 = ahead2;
    ahead2 = hit(base + 64 + lane);
  }

  // The channel's q-th row (q never decreases between calls): false past the last.
  __device__ bool find(int q, int lane, ChannelRow& row) {
    while (q >= before + __popc(mask)) {
      if (base + 32 >= n) return false;
      advance(lane);
    }
    const int j = q - before;
    const bool mine = ((mask >> lane) & 1u) && __popc(mask & ((1u << lane) - 1u)) == j;
    const int at = __ffs(__ballot_sync(0xffffffffu, mine)) - 1;  // the lane whose entry is the row
    row.token = __shfl_sync(0xffffffffu, my_token, at);
    row.dst = __shfl_sync(0xffffffffu, my_dst, at);
    const unsigned earlier_same_dst = __shfl_sync(0xffffffffu, dst_lanes, row.dst) & mask & ((1u << at) - 1u);
    row.k = __shfl_sync(0xffffffffu, dst_before, row.dst) + __popc(earlier_same_dst);
    return true;
  }
};

}  // namespace moe_ep::intranode
