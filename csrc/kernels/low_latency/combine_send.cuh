// Combine, send phase: every valid row of recv layout (l, s) goes back to source rank s, into
// that rank's receive region at [global expert me*L + l][source token] (bf16 [E][maxT][H]).
//
// Work units are (l, s, part); a part is a contiguous range of the pair's rows, whose 16-byte
// vectors the whole block copies (kCopyUnroll loads in flight per thread). Flags (the combine flag
// [me*L + l] on rank s, value 1): a block first writes all of its units, then makes its stores
// visible once (puts: each warp's nvshmem_quiet; CTA barrier; then, per unit, one thread's
// __threadfence_system) and counts each unit in workspace combine_finished[l*R + s] (atomicAdd, GPU
// scope). The thread that completes a count fences again (acquiring the other parts' fenced
// stores), resets the counter and raises the flag with signal_peer. Pairs with no rows raise it at
// once. The receiver waits for every flag before reading anything, so raising a block's flags
// together at its end delays nothing and saves a fence per unit.
//
// Row copies to NVLink peers: the block's threads, kCopyUnroll 16-byte loads in flight per thread,
// then the stores; peers without a mapping get nvshmem puts of staged rows (one warp per row).
#pragma once

#include "kernels/low_latency/common.cuh"

namespace moe_ep::low_latency {

// Copy rows [lo, hi) of pair (l, s) to `remote_base` (the peer's [me*L + l] region) with the whole
// block; row i goes to the slot of its source token.
__device__ __forceinline__ void copy_pair_rows(const Common& c, const CombineArgs& a, const uint8_t* send,
                                               uint8_t* remote_base, size_t first_row, int n) {
  const int H = c.hidden, V = H / 8;
  const size_t row_bytes = static_cast<size_t>(H) * 2;
  const int total = n * V;
  for (int base = 0; base < total; base += kCopyUnroll * blockDim.x) {
    int4 v[kCopyUnroll];
    int token[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int idx = base + u * blockDim.x + threadIdx.x;
      if (idx < total) {
        const int i = idx / V, j = idx - i * V;
        const size_t row = first_row + i;
        const uint8_t* src = a.x != nullptr ? static_cast<const uint8_t*>(a.x) + row * row_bytes
                                            : send + row * row_bytes;
        token[u] = __ldg(a.src_info + row);
        v[u] = ld_nc(src + 16 * j);
      }
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int idx = base + u * blockDim.x + threadIdx.x;
      if (idx < total) {
        const int i = idx / V, j = idx - i * V;
        st_v4(remote_base + static_cast<size_t>(token[u]) * row_bytes + 16 * j, v[u]);
      }
    }
  }
}

// Raise flag [me*L + l] on rank s once `pair`'s rows are all written: this thread adds `rows` (units)
// to the pair's workspace counter; the add reaching `target` signals.
// Precondition: every store of the block this add covers precedes a CTA barrier before this call.
__device__ __forceinline__ void combine_pair_done(const Common& c, int* flags, int pair, int rows,
                                                  int target) {
  const int R = c.num_ranks, L = c.num_experts / R;
  __threadfence_system();  // release this block's stores at system scope
  int* finished = c.workspace + kWsCombineFinished + pair;
  if (atomicAdd(finished, rows) + rows == target) {
    __threadfence_system();  // acquire the other blocks' fenced stores of this pair
    *finished = 0;
    signal_peer(c, flags + c.rank * L + pair / R, 1, pair % R);
    trace_pair_now(c, kTracePairSent, pair);
  }
}

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

  bool put = false;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const int pair = u % (L * R), part = u / (L * R);
    const int l = pair / R, s = pair % R;
    const int64_t range = a.layout_range[l * R + s];
    const int begin = static_cast<int>(range >> 32), count = static_cast<int>(range & 0xFFFFFFFF);
    const int lo = static_cast<int>(static_cast<int64_t>(count) * part / parts);
    const int hi = static_cast<int>(static_cast<int64_t>(count) * (part + 1) / parts);
    uint8_t* dst_base = c.buffer + half + lay.recv_off +
                        static_cast<size_t>(c.rank * L + l) * c.max_tokens * row_bytes;
    uint8_t* remote_base = peer_address(c, s, dst_base);
    if (remote_base != nullptr) {
      const size_t first_row = static_cast<size_t>(l) * RT + begin + lo;
      copy_pair_rows(c, a, send, remote_base, first_row, hi - lo);
      continue;
    }
    for (int i = lo + warp; i < hi; i += warps) {
      const size_t row = static_cast<size_t>(l) * RT + begin + i;
      const int token = a.src_info[row];
      const uint8_t* src = a.x != nullptr ? static_cast<const uint8_t*>(a.x) + row * row_bytes
                                          : send + row * row_bytes;
      // nvshmem puts read from the symmetric send region (stage the row there first).
      uint8_t* staged = send + row * row_bytes;
      if (src != staged)
        for (int j = lane; j < H / 8; j += 32) st_v4(staged + 16 * j, ld_nc(src + 16 * j));
      __syncwarp();
      nvshmemx_putmem_nbi_warp(dst_base + static_cast<size_t>(token) * row_bytes, staged, row_bytes, s);
      put = true;
    }
  }
  if (put) nvshmem_quiet();
  __syncthreads();  // every store of the block's units precedes the fences in combine_pair_done
  trace_event(c, kTraceCSendsIssued);
  for (int u = blockIdx.x + tid * gridDim.x; u < units; u += blockDim.x * gridDim.x)
    combine_pair_done(c, flags, u % (L * R), 1, parts);
}

}  // namespace moe_ep::low_latency
