// Combine, send phase: every valid row of recv layout (l, s) goes back to source rank s, into
// that rank's receive region at [global expert me*L + l][source token] (bf16 [E][maxT][H]).
//
// Work units are (l, s, part). Flags (the combine flag [me*L + l] on rank s, value 1): each unit
// makes its stores visible (CTA barrier, then thread 0's __threadfence_system; puts: each warp's
// nvshmem_quiet before the barrier) and counts itself in workspace combine_finished[l*R + s]
// (atomicAdd, GPU scope). The unit that completes the count fences again (acquiring the other
// parts' fenced stores), resets the counter and raises the flag with signal_peer. Pairs with no
// rows raise it at once.
#pragma once

#include "kernels/low_latency/common.cuh"

namespace moe_dispatcher::low_latency {

__device__ __forceinline__ void combine_send_phase(const Common& c, const CombineArgs& a,
                                                   const HalfLayout& lay, int parts) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = blockDim.x / 32;
  const int R = c.num_ranks, E = c.num_experts, L = E / R, H = c.hidden;
  const size_t RT = static_cast<size_t>(R) * c.max_tokens;
  const size_t half = c.half_offset;
  const size_t row_bytes = static_cast<size_t>(H) * 2;
  int* flags = reinterpret_cast<int*>(c.buffer + half + lay.signal_off) + E;  // [E]
  uint8_t* send = c.buffer + half + lay.send_off;  // [L][R*maxT][H] bf16 (zero-copy rows)
  const int units = L * R * parts;

  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const int pair = u % (L * R), part = u / (L * R);
    const int l = pair / R, s = pair % R;
    const int64_t range = a.layout_range[l * R + s];
    const int begin = static_cast<int>(range >> 32), count = static_cast<int>(range & 0xFFFFFFFF);
    uint8_t* dst_base = c.buffer + half + lay.recv_off +
                        static_cast<size_t>(c.rank * L + l) * c.max_tokens * row_bytes;
    uint8_t* remote_base = peer_address(c, s, dst_base);
    bool put = false;
    for (int i = part * warps + warp; i < count; i += parts * warps) {
      const size_t row = static_cast<size_t>(l) * RT + begin + i;
      const int token = a.src_info[row];
      const uint8_t* src = a.x != nullptr ? static_cast<const uint8_t*>(a.x) + row * row_bytes
                                          : send + row * row_bytes;
      if (remote_base != nullptr) {
        uint8_t* dst = remote_base + static_cast<size_t>(token) * row_bytes;
        for (int j = lane; j < H / 8; j += 32)
          st_v4(dst + 16 * j, ld_nc(src + 16 * j));
      } else {
        // nvshmem puts read from the symmetric send region (stage the row there first).
        uint8_t* staged = send + row * row_bytes;
        if (src != staged)
          for (int j = lane; j < H / 8; j += 32) st_v4(staged + 16 * j, ld_nc(src + 16 * j));
        __syncwarp();
        nvshmemx_putmem_nbi_warp(dst_base + static_cast<size_t>(token) * row_bytes, staged,
                                 row_bytes, s);
        put = true;
      }
    }
    if (put) nvshmem_quiet();
    __syncthreads();
    if (tid == 0) {
      __threadfence_system();  // release this unit's stores at system scope
      int* finished = c.workspace + kWsCombineFinished + pair;
      if (atomicAdd(finished, 1) == parts - 1) {
        __threadfence_system();  // acquire the other parts' stores
        *finished = 0;
        signal_peer(c, flags + c.rank * L + l, 1, s);
      }
    }
  }
}

}  // namespace moe_dispatcher::low_latency
