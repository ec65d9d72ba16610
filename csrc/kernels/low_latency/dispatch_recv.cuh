// Dispatch, receive phase: wait for the counts, then unpack the messages of each
// (local expert l, source rank s) into recv_x[l] rows [begin, begin + count).
//
// Work units are (l, s, part): `parts` blocks share one pair's messages (contiguous row ranges),
// each spreading its rows over all of its threads. begin = the counts of
// sources 0..s-1 for expert l, so a unit waits for the signals [l][0..s] (one lane each).
// Signal words: written once per call by the source PE (signal_peer), read here with
// ld_acquire_sys by every unit that needs them (wait_count: the count, its signature tag compared
// with this call's, common.cuh "Dispatch agreement"; a source that does not agree counts 0); the
// last block of the grid to finish polling (atomic on the workspace word kWsDispatchRecvDone, GPU
// scope) writes them back to 0, and the sources' signature words of this half with them. No source
// can write them again before this kernel ends: its next use of this half comes two calls later,
// after it has received this PE's signals of the call in between.
#pragma once

#include "kernels/low_latency/common.cuh"
#include "kernels/low_latency/fp8_cast.cuh"

namespace moe_ep::low_latency {

__device__ __forceinline__ void dispatch_recv_phase(const Common& c, const DispatchArgs& a,
                                                    const HalfLayout& lay, int parts) {
  __shared__ int s_begin, s_count;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int R = c.num_ranks, E = c.num_experts, L = E / R, H = c.hidden;
  const size_t RT = static_cast<size_t>(R) * c.max_tokens;
  const size_t half = c.half_offset;
  int* signals = reinterpret_cast<int*>(c.buffer + half + lay.signal_off);  // [L][R]
  const int units = L * R * parts;
  const int groups = H / 128;

  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const int pair = u % (L * R), part = u / (L * R);
    const int l = pair / R, s = pair % R;
    if (warp == 0) {
      int count = 0;
      uint64_t waited = 0;
      if (lane <= s) {
        const uint64_t start = now_ns();
        count = wait_count(c, a, signals + l * R + lane, kWaitDispatchCounts, lane);
        waited = now_ns() - start;
        if (part == 0 && lane == s) {
          trace_pair(c, kTracePairWait, l * R + s, start);
          trace_pair(c, kTracePairSeen, l * R + s, start + waited);
        }
      }
      const int begin = warp_sum(lane < s ? count : 0);
      const int mine = __shfl_sync(0xffffffffu, count, s);
      // warp_sum synchronised the warp: every lane's wait is over.
      if (u == static_cast<int>(blockIdx.x)) trace_event(c, kTraceDFirstArrival);
      trace_event(c, kTraceDLastArrival);  // the last unit's stamp stays
      if (lane == 0) {
        s_begin = begin;
        s_count = mine;
      }
      if (part == 0) {
        if (lane == s) {
          a.layout_range[l * R + s] = (static_cast<int64_t>(begin) << 32) | static_cast<int64_t>(mine);
          if (a.wait_stats != nullptr)
            atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + s),
                      static_cast<unsigned long long>(waited));
        }
        if (s == R - 1) {  // this unit saw every source of expert l
          const int total = warp_sum(count);
          if (lane == 0) {
            a.recv_count[l] = total;
            if (a.cumulative_recv_stats != nullptr) atomicAdd(a.cumulative_recv_stats + l, total);
          }
        }
      }
    }
    __syncthreads();
    const int begin = s_begin, count = s_count;

    // This part's rows [lo, hi) of the pair, spread over the whole block: 16-byte vectors with
    // kCopyUnroll loads in flight per thread before their stores (a row is 448 (FP8) or 896 (BF16)
    // vectors at H=7168, so one warp per row would wait on ~14-28 dependent load latencies).
    const int lo = static_cast<int>(static_cast<int64_t>(count) * part / parts);
    const int hi = static_cast<int>(static_cast<int64_t>(count) * (part + 1) / parts);
    const int n = hi - lo;
    const uint8_t* msgs = c.buffer + half + lay.recv_off +
                          ((static_cast<size_t>(l) * R + s) * c.max_tokens + lo) * lay.msg_bytes;
    const size_t out_row0 = static_cast<size_t>(l) * RT + begin + lo;
    const int row_vectors = a.fp8 ? H / 16 : H / 8;
    const size_t out_row_bytes = a.fp8 ? static_cast<size_t>(H) : static_cast<size_t>(H) * 2;
    uint8_t* out = static_cast<uint8_t*>(a.recv_x) + out_row0 * out_row_bytes;
    const int total = n * row_vectors;
    for (int base = 0; base < total; base += kCopyUnroll * blockDim.x) {
      int4 v[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int idx = base + u * blockDim.x + tid;
        if (idx < total) {
          const int i = idx / row_vectors, j = idx - i * row_vectors;
          v[u] = ld_cg(msgs + static_cast<size_t>(i) * lay.msg_bytes + 16 + 16 * j);
        }
      }
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int idx = base + u * blockDim.x + tid;
        if (idx < total) {
          const int i = idx / row_vectors, j = idx - i * row_vectors;
          st_v4(out + static_cast<size_t>(i) * out_row_bytes + 16 * j, v[u]);
        }
      }
    }
    for (int i = tid; i < n; i += blockDim.x) {
      const int token = ld_cg_s32(msgs + static_cast<size_t>(i) * lay.msg_bytes);
      a.src_info[out_row0 + i] = token;
      if (a.row_of != nullptr) a.row_of[static_cast<size_t>(l) * RT + s * c.max_tokens + token] = begin + lo + i;
    }
    if (a.fp8) {
      // Token-minor scales: element (l, row, g) lives at [l][g][row]; consecutive threads take
      // consecutive rows of one group (coalesced stores).
      if (a.ue8m0) {
        int* scales_out = static_cast<int*>(a.recv_scales);
        const int words = groups / 4;
        for (int idx = tid; idx < n * words; idx += blockDim.x) {
          const int w = idx / n, i = idx - w * n;
          const float* sc = reinterpret_cast<const float*>(msgs + static_cast<size_t>(i) * lay.msg_bytes + 16 + H);
          uint32_t word = 0;
#pragma unroll
          for (int b = 0; b < 4; ++b) word |= ue8m0_byte(ld_cg_f32(sc + 4 * w + b)) << (8 * b);
          scales_out[(static_cast<size_t>(l) * words + w) * RT + begin + lo + i] = static_cast<int>(word);
        }
      } else {
        float* scales_out = static_cast<float*>(a.recv_scales);
        for (int idx = tid; idx < n * groups; idx += blockDim.x) {
          const int g = idx / n, i = idx - g * n;
          const float* sc = reinterpret_cast<const float*>(msgs + static_cast<size_t>(i) * lay.msg_bytes + 16 + H);
          scales_out[(static_cast<size_t>(l) * groups + g) * RT + begin + lo + i] = ld_cg_f32(sc + g);
        }
      }
    }
    __syncthreads();  // s_begin / s_count are rewritten by the next unit
    trace_event(c, kTraceDCopyDone);  // the last unit's stamp stays
  }

  // Every block has finished polling when the counter reaches gridDim.x: the last one resets.
  if (tid == 0) {
    check_signatures(c, a);  // common.cuh: each source's full word, once per call, before the reset below
    int* done = c.workspace + kWsDispatchRecvDone;
    if (atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1) {
      for (int i = 0; i < L * R; ++i) signals[i] = 0;
      for (int s = 0; s < R; ++s) *signature_word(c, a, s) = 0;
      *done = 0;
    }
  }
}

}  // namespace moe_ep::low_latency
