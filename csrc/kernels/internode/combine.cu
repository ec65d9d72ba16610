// Internode combine: the reverse of dispatch, three blocks per channel c, all resident:
//   block 3c   NVLink sender: warp group l returns to local rank l (the forwarder of every source
//              (x, l)) the rows this rank received in channel c from sources (x, l), x ascending,
//              each source's rows in token order, through FIFO (c, me -> l). Slot: row | top-k weights.
//   block 3c+1 forwarder: for source domain x ascending, the tokens it forwarded in dispatch (their
//              local-rank masks are fwd_mask), 32 x fwd_windows at a time: waits until every local
//              rank's FIFO holds the rows of the batch, sums each token's rows over local ranks
//              ascending in float32, rounds to the row dtype (the partial that travels) and writes it
//              into ring (c, my domain) of the source (x, my local index): each warp puts the run of
//              partials it reduced (put + quiet), then one tail signal per batch; for my own domain
//              directly into my own ring.
//   block 3c+2 source receiver: for its channel's tokens, 32 x recv_windows at a time, waits for the
//              partial of each domain the token went to and writes
//              out = cast(bias0 + bias1 + sum over domains ascending of partial), float32, and the
//              top-k weights summed the same way.
// Order of the sum: ((bias0 + bias1) + partial_0 + partial_1 ...) with partial_x =
// round(sum over x's ranks ascending): equal to the reference (ranks ascending) when each token has
// at most one contributing rank per domain, else within the rounding of the partials.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/intranode/copy.cuh"
#include "kernels/intranode/launch_check.cuh"
#include "kernels/internode/common.cuh"

namespace moe_dispatcher::internode {
namespace {

using intranode::warp_copy;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float(float v) { return v; }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ float from_float(float v) { return v; }

template <typename T>
union Vec {
  static constexpr int kElems = 16 / sizeof(T);
  int4 raw;
  T elems[kElems];
};

// One warp: out[row] = cast(bias0 + bias1 + srcs[0] + srcs[1] + ...) in float32, in that order, and
// the K top-k weights after each row (srcs[i] + row_bytes) summed likewise into out_w (if non-null).
template <typename T>
__device__ void reduce_token(uint8_t* out, float* out_w, const uint8_t* const* srcs, int nsrc, const uint8_t* bias0,
                             const uint8_t* bias1, int row_bytes, int num_topk, int lane) {
  const int vecs = row_bytes / 16;
  constexpr int kBatch = 8;
  for (int v = lane; v < vecs; v += 32) {
    float acc[Vec<T>::kElems];
#pragma unroll
    for (int e = 0; e < Vec<T>::kElems; ++e) acc[e] = 0.f;
    if (bias0 != nullptr) {
      Vec<T> b;
      b.raw = ptx::ld_nc_v4(reinterpret_cast<const int4*>(bias0) + v);
#pragma unroll
      for (int e = 0; e < Vec<T>::kElems; ++e) acc[e] += to_float(b.elems[e]);
    }
    if (bias1 != nullptr) {
      Vec<T> b;
      b.raw = ptx::ld_nc_v4(reinterpret_cast<const int4*>(bias1) + v);
#pragma unroll
      for (int e = 0; e < Vec<T>::kElems; ++e) acc[e] += to_float(b.elems[e]);
    }
    for (int base = 0; base < nsrc; base += kBatch) {
      Vec<T> rows[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (base + u < nsrc) rows[u].raw = ptx::ld_cg_v4(reinterpret_cast<const int4*>(srcs[base + u]) + v);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (base + u < nsrc) {
#pragma unroll
          for (int e = 0; e < Vec<T>::kElems; ++e) acc[e] += to_float(rows[u].elems[e]);
        }
      }
    }
    Vec<T> o;
#pragma unroll
    for (int e = 0; e < Vec<T>::kElems; ++e) o.elems[e] = from_float<T>(acc[e]);
    reinterpret_cast<int4*>(out)[v] = o.raw;
  }
  if (out_w != nullptr && lane < num_topk) {
    float w = 0.f;
    for (int i = 0; i < nsrc; ++i) w += __int_as_float(ptx::ld_cg(reinterpret_cast<const int*>(srcs[i] + row_bytes) + lane));
    out_w[lane] = w;
  }
}

// ------------------------------------------------------------------ NVLink sender (rows back to forwarders)
__device__ void nvl_send(const CombineArgs& a, int ch, int l, int group_warp, int warps, int lane, int* shared_ok,
                         const Watchdog& dog, int row_bytes) {
  const Common& c = a.c;
  const int nvl = c.nvl_size, C = a.num_channels;
  intranode::Control* nctl = nvl_ctl(c, c.local);
  ChannelSender tx{nvl_ring(c, c.nvl[l], c.local, ch, a.nvl_slots, a.nvl_slot_bytes), &nvl_ctl(c, l)->fifo_tail[ch][c.local],
                   &nctl->fifo_head[ch][l], &nctl->tail_copy[ch][l], a.nvl_slots, a.nvl_slot_bytes,
                   *reinterpret_cast<volatile uint64_t*>(&nctl->tail_copy[ch][l])};
  const int bar = 1 + l, threads = warps * 32;
  const bool leader = group_warp == 0 && lane == 0;
  for (int x = 0; x < c.num_domains; ++x) {
    const int* off = a.recv_channel_offset + (x * nvl + l) * (C + 1);
    for (int row = off[ch], end = off[ch + 1]; row < end;) {
      const int n = min(a.nvl_chunk, end - row);
      if (leader) *shared_ok = tx.reserve(n, dog, kPhaseCombineNvlSend, c.domain * nvl + l);
      ptx::group_sync(bar, threads);
      if (!*shared_ok) return;
      for (int i = group_warp; i < n; i += warps) {
        uint8_t* slot = tx.slot(i);
        const int64_t r = row + i;
        if (r >= a.num_x_rows) continue;  // dropped by a num_worst_tokens overflow (reported by notify)
        warp_copy<false, 8>(reinterpret_cast<int4*>(slot), reinterpret_cast<const int4*>(a.x + r * row_bytes),
                            row_bytes / 16, lane);
        if (a.topk_weights != nullptr && lane < a.num_topk) {
          reinterpret_cast<float*>(slot + row_bytes)[lane] = a.topk_weights[r * a.num_topk + lane];
        }
      }
      ptx::group_sync(bar, threads);
      tx.advance(n, leader);
      row += n;
    }
  }
}

// ------------------------------------------------------------------ forwarder (reduce in the domain, one put back)
template <typename T>
__device__ void forward(const CombineArgs& a, int ch, int warp, int lane, const Watchdog& dog, int row_bytes) {
  const Common& c = a.c;
  const int nvl = c.nvl_size, C = a.num_channels, W = a.fwd_windows;
  RdmaControl* rctl = rdma_ctl(c);
  intranode::Control* nctl = nvl_ctl(c, c.local);
  __shared__ uint64_t nhead[kMaxNvl];
  __shared__ unsigned window_mask[kMaxWindows][kMaxNvl];
  __shared__ int window_offset[kMaxWindows][kMaxNvl];
  __shared__ int batch_rows[kMaxNvl];
  __shared__ int ok;
  __shared__ const uint8_t* srcs[kWarps][kMaxNvl];
  if (threadIdx.x < nvl) nhead[threadIdx.x] = *reinterpret_cast<volatile uint64_t*>(&nctl->head_copy[ch][threadIdx.x]);
  const uint8_t* ring0 = nvl_ring(c, c.nvl[c.local], 0, ch, a.nvl_slots, a.nvl_slot_bytes);
  __syncthreads();

  const bool has_weights = a.num_topk > 0;  // the slot layout of every rank (not this rank's pointer)
  bool any_remote = false;
  for (int x = 0; x < c.num_domains; ++x) {
    const int first = a.fwd_offset[x * (C + 1) + ch], count = a.fwd_offset[x * (C + 1) + ch + 1] - first;
    if (count == 0) continue;
    any_remote |= x != c.domain;
    uint64_t rtail = *reinterpret_cast<volatile uint64_t*>(&rctl->tail_copy[ch][x]);
    uint8_t* out_ring = rdma_write_ring(c, x, ch, a.rdma_slots, a.rdma_slot_bytes);
    for (int base = 0; base < count; base += 32 * W) {
      const int n = min(32 * W, count - base);
      if (warp < W) {
        const int k = base + warp * 32 + lane;
        const int idx = first + k;
        const int mask = (k < count && idx < a.fwd_capacity) ? a.fwd_mask[idx] : 0;
        for (int j = 0; j < nvl; ++j) {
          const unsigned m = __ballot_sync(0xffffffffu, (mask >> j) & 1);
          if (lane == 0) window_mask[warp][j] = m;
        }
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        int good = 1;
        for (int j = 0; j < nvl; ++j) {
          int rows = 0;
          for (int w = 0; w < W; ++w) {
            window_offset[w][j] = rows;
            rows += __popc(window_mask[w][j]);
          }
          batch_rows[j] = rows;
          if (good) good = wait_at_least(&nctl->fifo_tail[ch][j], nhead[j] + rows, dog, kPhaseCombineForward, c.domain * nvl + j);
        }
        while (good && rtail + n - ptx::ld_acquire_sys(&rctl->head[ch][x]) > static_cast<uint64_t>(a.rdma_slots)) {
          if (dog.expired(kPhaseCombineRdmaSend, team_pe(c, x))) good = 0;
        }
        ok = good;
      }
      __syncthreads();  // the tails acquired by thread 0 cover every slot read below
      if (!ok) return;
      // Warp w reduces a contiguous run of the batch's tokens into the staging slots and puts the run.
      const int per = (n + kWarps - 1) / kWarps;
      const int lo = min(n, warp * per), hi = min(n, lo + per);
      for (int i = lo; i < hi; ++i) {
        const int w = i >> 5;
        const unsigned below = (1u << (i & 31)) - 1u;
        int nsrc = 0;
        for (int j = 0; j < nvl; ++j) {
          const unsigned m = window_mask[w][j];
          if ((m >> (i & 31)) & 1u) {
            const uint64_t index = nhead[j] + window_offset[w][j] + __popc(m & below);
            if (lane == 0) srcs[warp][nsrc] = ring0 + j * c.layout.nvl_src_block_bytes + static_cast<size_t>(index % a.nvl_slots) * a.nvl_slot_bytes;
            ++nsrc;
          }
        }
        __syncwarp();
        uint8_t* dst = out_ring + static_cast<size_t>((rtail + i) % a.rdma_slots) * a.rdma_slot_bytes;
        reduce_token<T>(dst, has_weights ? reinterpret_cast<float*>(dst + row_bytes) : nullptr, srcs[warp], nsrc, nullptr,
                        nullptr, row_bytes, a.num_topk, lane);
        __syncwarp();
      }
      rdma_put_rows(c, x, ch, rtail + lo, hi - lo, a.rdma_slots, a.rdma_slot_bytes, lane);
      __syncthreads();  // every ring load, partial store and completed put of the batch precede the flags
      rtail += n;
      if (threadIdx.x == 0) {
        for (int j = 0; j < nvl; ++j) {
          if (batch_rows[j] == 0) continue;
          nhead[j] += batch_rows[j];
          ptx::st_release_sys(&nvl_ctl(c, j)->fifo_head[ch][c.local], nhead[j]);  // j may reuse these slots
        }
        rdma_signal_tail(c, x, ch, rtail);
        *reinterpret_cast<volatile uint64_t*>(&rctl->tail_copy[ch][x]) = rtail;
      }
      // No third barrier: thread 0 updates nhead / batch_rows, which the other warps read only
      // after the next batch's first barrier; warps < W rewrite window_mask, which thread 0 has
      // finished reading (it is in warp 0, which writes the next masks after this block).
    }
  }
  if (threadIdx.x == 0 && any_remote) nvshmem_quiet();  // complete the tail signals
  __syncthreads();  // thread 0's last nhead update before the copies below
  if (threadIdx.x < nvl) nctl->head_copy[ch][threadIdx.x] = nhead[threadIdx.x];
}

// ------------------------------------------------------------------ source receiver
template <typename T>
__device__ void receive(const CombineArgs& a, int ch, int warp, int lane, const Watchdog& dog, int row_bytes) {
  const Common& c = a.c;
  const int R = c.num_ranks, nvl = c.nvl_size, D = c.num_domains, W = a.recv_windows;
  RdmaControl* rctl = rdma_ctl(c);
  __shared__ uint64_t rhead[kMaxDomains];
  __shared__ unsigned window_mask[kMaxWindows][kMaxDomains];
  __shared__ int window_offset[kMaxWindows][kMaxDomains];
  __shared__ int batch_rows[kMaxDomains];
  __shared__ int ok;
  __shared__ const uint8_t* srcs[kWarps][kMaxDomains];
  for (int x = threadIdx.x; x < D; x += blockDim.x) rhead[x] = *reinterpret_cast<volatile uint64_t*>(&rctl->head_copy[ch][x]);
  __syncthreads();
  int begin, end;
  channel_range(a.num_tokens, a.num_channels, ch, begin, end);
  for (int base = begin; base < end; base += 32 * W) {
    if (warp < W) {
      const int t = base + warp * 32 + lane;
      for (int x = 0; x < D; ++x) {
        bool hit = false;
        for (int j = 0; j < nvl && t < end; ++j) hit |= a.is_token_in_rank[static_cast<int64_t>(t) * R + x * nvl + j];
        const unsigned m = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) window_mask[warp][x] = m;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int good = 1;
      for (int x = 0; x < D; ++x) {
        int rows = 0;
        for (int w = 0; w < W; ++w) {
          window_offset[w][x] = rows;
          rows += __popc(window_mask[w][x]);
        }
        batch_rows[x] = rows;
        if (good) good = wait_at_least(&rctl->tail[ch][x], rhead[x] + rows, dog, kPhaseCombineRecv, team_pe(c, x));
      }
      ok = good;
    }
    __syncthreads();
    if (!ok) return;
    const int count = min(32 * W, end - base);
    for (int i = warp; i < count; i += kWarps) {
      const int64_t token = base + i;
      const int w = i >> 5;
      const unsigned below = (1u << (i & 31)) - 1u;
      int nsrc = 0;
      for (int x = 0; x < D; ++x) {
        const unsigned m = window_mask[w][x];
        if ((m >> (i & 31)) & 1u) {
          const uint64_t index = rhead[x] + window_offset[w][x] + __popc(m & below);
          if (lane == 0) {
            srcs[warp][nsrc] = rdma_recv_ring(c, x, ch, a.rdma_slots, a.rdma_slot_bytes) +
                               static_cast<size_t>(index % a.rdma_slots) * a.rdma_slot_bytes;
          }
          ++nsrc;
        }
      }
      __syncwarp();
      reduce_token<T>(a.out + token * row_bytes, a.out_topk_weights != nullptr ? a.out_topk_weights + token * a.num_topk : nullptr,
                      srcs[warp], nsrc, a.bias0 != nullptr ? a.bias0 + token * row_bytes : nullptr,
                      a.bias1 != nullptr ? a.bias1 + token * row_bytes : nullptr, row_bytes, a.num_topk, lane);
      __syncwarp();
    }
    __syncthreads();  // every load of the batch's slots precedes the credits
    if (threadIdx.x == 0) {
      for (int x = 0; x < D; ++x) {
        if (batch_rows[x] == 0) continue;
        rhead[x] += batch_rows[x];
        rdma_credit(c, x, ch, rhead[x]);
      }
    }
    __syncthreads();
  }
  for (int x = threadIdx.x; x < D; x += blockDim.x) rctl->head_copy[ch][x] = rhead[x];
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(CombineArgs a) {
  __shared__ int shared_ok[kMaxNvl];
  const Common& c = a.c;
  const int ch = blockIdx.x / 3, role = blockIdx.x % 3;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row_bytes = a.hidden * static_cast<int>(sizeof(T));
  const Watchdog dog = make_watchdog(c.timeout_ns, c.rank, &nvl_ctl(c, c.local)->timeout_claim, &c.mailbox->timeout);
  if (!drain_previous_calls(c, dog)) return;  // earlier calls drained; no ring written before this
  if (role == 1) {
    forward<T>(a, ch, warp, lane, dog, row_bytes);
  } else if (role == 2) {
    receive<T>(a, ch, warp, lane, dog, row_bytes);
  } else {
    const int warps = kWarps / c.nvl_size;
    const int group = warp / warps, group_warp = warp % warps;
    if (group >= c.nvl_size) return;
    nvl_send(a, ch, group, group_warp, warps, lane, &shared_ok[group], dog, row_bytes);
  }
}

}  // namespace

void launch_combine(const CombineArgs& args, cudaStream_t stream) {
  const dim3 grid(3 * args.num_channels);
  switch (args.dtype) {
    case kBf16: combine_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(args); break;
    case kFp16: combine_kernel<__half><<<grid, kThreads, 0, stream>>>(args); break;
    default: combine_kernel<float><<<grid, kThreads, 0, stream>>>(args); break;
  }
  intranode::check_launch("internode combine_kernel");
}

}  // namespace moe_dispatcher::internode
