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
// Row copies to NVLink peers, by variant (low_latency.h): the block's threads, kCopyUnroll 16-byte
// loads in flight per thread, then the stores; or (kVariantCombineBulk) the copy engine: the block's rows, in unit order, go round-robin to `stages`
// owner threads (lane 0 of warps 0 .. stages-1), each with a row buffer in shared memory: bulk load
// of the row, wait for it, bulk store to the peer slot; before its next load the owner waits until
// the store has read the buffer. Before the CTA barrier that precedes the flags, every owner waits
// for its stores to complete (bulk_wait), so the fences below cover them as they cover
// plain stores.
#pragma once

#include "kernels/low_latency/common.cuh"

namespace moe_dispatcher::low_latency {

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

// Variant kVariantCombineBulk: the state of one owner thread (see the top of the file). Every thread
// of the block keeps `seq` (rows of the block's units so far), which names the owner of each row.
struct BulkPipe {
  uint8_t* buffer;   // this owner's row buffer (shared memory)
  uint64_t* bar;     // its mbarrier
  uint32_t parity;   // parity of the next phase of `bar`
  int seq, stages;
};

// Dynamic shared memory of the bulk variant: kBulkStages mbarriers, then `stages` row buffers
// (stages = min(kBulkStages, kBulkRowBytes / row bytes), set by the launcher; <= the warps of a block).
constexpr int kBulkStages = 8;
constexpr int kBulkBarBytes = 128;  // >= 8 * kBulkStages, keeps the row buffers 128-byte aligned
constexpr int kBulkRowBytes = 192 * 1024;

__device__ __forceinline__ BulkPipe bulk_pipe(uint8_t* smem, int stages, size_t row_bytes) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int own = warp < stages ? warp : 0;
  BulkPipe p{smem + kBulkBarBytes + own * row_bytes, reinterpret_cast<uint64_t*>(smem) + own, 0, 0, stages};
  if (lane == 0 && warp < stages) {
    ptx::mbarrier_init(p.bar, 1);
    ptx::fence_mbarrier_init();
  }
  return p;
}

// Rows [first_row, first_row + n) of a pair to `remote_base`, each by its owner thread.
__device__ __forceinline__ void bulk_pair_rows(const Common& c, const CombineArgs& a, const uint8_t* send,
                                               uint8_t* remote_base, size_t first_row, int n, BulkPipe& p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t row_bytes = static_cast<uint32_t>(c.hidden) * 2;
  const uint8_t* rows = a.x != nullptr ? static_cast<const uint8_t*>(a.x) : send;
  if (lane == 0 && warp < p.stages) {
    for (int i = (warp - p.seq % p.stages + p.stages) % p.stages; i < n; i += p.stages) {
      const size_t row = first_row + i;
      ptx::bulk_wait_read<0>();  // the previous store from this buffer has read it
      ptx::mbarrier_arrive_expect_tx(p.bar, row_bytes);
      ptx::bulk_load(p.buffer, rows + row * row_bytes, row_bytes, p.bar);
      while (!ptx::mbarrier_try_wait(p.bar, p.parity)) {
      }
      p.parity ^= 1;
      ptx::bulk_store(remote_base + static_cast<size_t>(__ldg(a.src_info + row)) * row_bytes, p.buffer, row_bytes);
      ptx::bulk_commit();
    }
  }
  p.seq += n;
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
                                                   const HalfLayout& lay, int parts, uint8_t* smem,
                                                   int bulk_stages) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = blockDim.x / 32;
  const int R = c.num_ranks, E = c.num_experts, L = E / R, H = c.hidden;
  const size_t RT = static_cast<size_t>(R) * c.max_tokens;
  const size_t half = c.half_offset;
  const size_t row_bytes = static_cast<size_t>(H) * 2;
  int* flags = reinterpret_cast<int*>(c.buffer + half + lay.signal_off) + E;  // [E]
  uint8_t* send = c.buffer + half + lay.send_off;  // [L][R*maxT][H] bf16 (zero-copy rows)
  const int units = L * R * parts;

  const bool bulk = bulk_stages > 0;
  BulkPipe pipe{};
  if (bulk) pipe = bulk_pipe(smem, bulk_stages, row_bytes);
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
      if (bulk) {
        bulk_pair_rows(c, a, send, remote_base, first_row, hi - lo, pipe);
      } else {
        copy_pair_rows(c, a, send, remote_base, first_row, hi - lo);
      }
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
  if (bulk && lane == 0 && warp < bulk_stages) {  // this owner's stores are complete, before the fences below
    ptx::bulk_wait<0>();
    ptx::fence_proxy_async_global();
  }
  __syncthreads();  // every store of the block's units precedes the fences in combine_pair_done
  trace_event(c, kTraceCSendsIssued);
  for (int u = blockIdx.x + tid * gridDim.x; u < units; u += blockDim.x * gridDim.x)
    combine_pair_done(c, flags, u % (L * R), 1, parts);
}

}  // namespace moe_dispatcher::low_latency
