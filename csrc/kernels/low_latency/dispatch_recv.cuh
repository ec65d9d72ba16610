// Dispatch, receive phase: wait for the counts, then unpack the messages of each
// (local expert l, source rank s) into recv_x[l] rows [begin, begin + count).
//
// Work units are (l, s, part): `parts` blocks share one pair's messages. begin = the counts of
// sources 0..s-1 for expert l, so a unit waits for the signals [l][0..s] (one lane each).
// Signal words: written once per call by the source PE (signal_peer), read here with
// ld_acquire_sys by every unit that needs them; the last block of the grid to finish polling
// (atomic on the workspace word kWsDispatchRecvDone, GPU scope) writes them back to 0. No source
// can write them again before this kernel ends: its next use of this half comes two calls later,
// after it has received this PE's signals of the call in between.
#pragma once

#include "kernels/low_latency/common.cuh"
#include "kernels/low_latency/fp8_cast.cuh"

namespace moe_dispatcher::low_latency {

__device__ __forceinline__ void dispatch_recv_phase(const Common& c, const DispatchArgs& a,
                                                    const HalfLayout& lay, int parts) {
  __shared__ int s_begin, s_count;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = blockDim.x / 32;
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
        count = wait_signal(c, signals + l * R + lane, "low_latency_dispatch (receive)", lane) - 1;
        waited = now_ns() - start;
      }
      const int begin = warp_sum(lane < s ? count : 0);
      const int mine = __shfl_sync(0xffffffffu, count, s);
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

    for (int i = part * warps + warp; i < count; i += parts * warps) {
      const uint8_t* msg = c.buffer + half + lay.recv_off +
                           ((static_cast<size_t>(l) * R + s) * c.max_tokens + i) * lay.msg_bytes;
      const size_t row = static_cast<size_t>(l) * RT + begin + i;
      if (lane == 0) a.src_info[row] = ld_cg_s32(msg);
      if (a.fp8) {
        const int4* src = reinterpret_cast<const int4*>(msg + 16);
        int4* dst = reinterpret_cast<int4*>(static_cast<uint8_t*>(a.recv_x) + row * H);
        for (int j = lane; j < H / 16; j += 32) st_v4(dst + j, ld_cg(src + j));
        const float* scales = reinterpret_cast<const float*>(msg + 16 + H);
        // Token-minor scales: element (l, row, g) lives at [l][g][row].
        if (a.ue8m0) {
          int* out = static_cast<int*>(a.recv_scales);
          for (int j = lane; j < groups / 4; j += 32) {
            uint32_t word = 0;
#pragma unroll
            for (int b = 0; b < 4; ++b) word |= ue8m0_byte(ld_cg_f32(scales + 4 * j + b)) << (8 * b);
            out[(static_cast<size_t>(l) * (groups / 4) + j) * RT + begin + i] = static_cast<int>(word);
          }
        } else {
          float* out = static_cast<float*>(a.recv_scales);
          for (int g = lane; g < groups; g += 32)
            out[(static_cast<size_t>(l) * groups + g) * RT + begin + i] = ld_cg_f32(scales + g);
        }
      } else {
        const int4* src = reinterpret_cast<const int4*>(msg + 16);
        int4* dst = reinterpret_cast<int4*>(static_cast<uint8_t*>(a.recv_x) + row * 2 * H);
        for (int j = lane; j < H / 8; j += 32) st_v4(dst + j, ld_cg(src + j));
      }
    }
    __syncthreads();  // s_begin / s_count are rewritten by the next unit
  }

  // Every block has finished polling when the counter reaches gridDim.x: the last one resets.
  if (tid == 0) {
    int* done = c.workspace + kWsDispatchRecvDone;
    if (atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1) {
      for (int i = 0; i < L * R; ++i) signals[i] = 0;
      *done = 0;
    }
  }
}

}  // namespace moe_dispatcher::low_latency
