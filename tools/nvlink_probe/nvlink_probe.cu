// NVLink all-to-all probe: what per-GPU throughput candidate intranode dispatch and combine designs reach with S SMs.
//
// One process drives GPUs 0..R-1 (peer access, peer pointers; no MPI/NVSHMEM/torch). Every GPU holds
// T tokens of `hidden` bf16 (here raw 16-bit words: the copy is bitwise) and routes each token to the
// ranks that own any of its top-k experts (E experts spread evenly over R ranks; one row per (token,
// destination rank), the local rank included, as the normal mode does). Rows from source s to
// destination d land in d's receive buffer at their final offset: sources in rank order, each source's
// rows in token order. Offsets are computed on the host.
//
// Designs (see tools/README.md for how to read the table):
//   direct xU  every block sends: each warp copies whole rows, lanes move 16-byte vectors, U loads in
//              flight per lane before the U stores go out to the peer (U = 1, 2, 4);
//   tma        every block sends through shared memory: one thread runs a pipeline of bulk copies
//              (cp.async.bulk global->shared with an mbarrier, then shared->global to the peer);
//   +epi_sm    the send, then on each receiver a separate copy kernel on every SM moves the received
//              region into an output tensor; +epi_ce: the same copy by cudaMemcpyAsync (copy engine);
//   ce_peer    reference: each GPU pushes pre-packed per-destination rows with cudaMemcpyPeerAsync,
//              one stream per destination (copy engines only, 0 SMs).
// GB/s = mean over ranks of (received rows x row bytes) / time (DeepEP's formula), time = median over
// iterations of the slowest rank's time between CUDA events recorded after a GPU-side barrier of all
// ranks and after the call. Every design is then checked: data stamped with a fresh salt, one more call,
// every received row (and the output tensor) compared on the receiver against pattern(src, token, col,
// salt), twice, so a design that does not deliver prints FAIL (one that signals before its data is visible
// can only show on the epilogue rows, whose copy starts as soon as the counts are seen, when it loses the race).
//
// Combine (the reverse; `--ops` picks dispatch, combine or both): every rank holds one expert-output bf16 row per
// row it received in the dispatch, in the dispatch's receive layout, and each goes back to the token's owner,
// which sums (fp32) the rows of every rank holding that token into one bf16 row of its output [T, hidden]:
//   pull xU tN        S blocks; each first joins a barrier of all ranks' blocks (rows ready; timed, like the
//                     push's counters), then the owner's blocks split its T tokens, one warp per token: per
//                     holder (remote NVLink loads, a local one for itself) U 16-byte loads in flight per lane,
//                     summed in fp32, one bf16 row stored; an untimed barrier after (no holder rewrites its
//                     rows while a peer still reads them);
//   push+reduce xU tN `direct xU tN` moving each row to its (token, holder) slot in the owner's staging buffer
//                     (compact: a token's slots contiguous, holders in rank order; offsets from the host), the
//                     same counters, then a reduce kernel of S blocks x N threads summing each token's slots.
// Received bytes (and so the GB/s formula) are the dispatch's. Check: expert-output elements are integers in
// [-8, 8] (pattern of holder, owner, token, column, salt), so every sum is exact; after timing, two calls on
// fresh salts with the output poisoned (NaN) first, every output element of every rank compared with the sum
// over the token's holders taken from the routing (0 for a token no rank holds).
//
// No hang: every wait spins against a clock64 timeout; on timeout it prints GPU, peer and phase, raises
// an abort word on every GPU (so the other waits give up at once) and records the failure in mapped host
// memory; the host exits with status 2 at its next synchronisation.
//
//   nvcc -arch=sm_90a -O3 -o /tmp/nvlink_probe tools/nvlink_probe/nvlink_probe.cu
//   /tmp/nvlink_probe [--gpus R] [--sms 4,8,16,24,32] [--threads 512,1024] [--hidden 7168,4096]
//                     [--tokens 4096] [--topk 8] [--experts 256] [--iters 10] [--warmup 2]
//                     [--ops dispatch,combine]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CK(call)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));        \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

constexpr int kMaxRanks = 8;
constexpr long long kTimeoutCycles = 4000000000LL;  // ~2 s at the H100/H200 SM clock
constexpr int kStoreDepth = 4;                      // tma: bulk stores whose shared-memory reads may be pending
constexpr int kMaxSlots = 32;                       // tma: shared-memory row buffers per block at most

enum Phase { kPhaseBarrier = 0, kPhaseSendDone = 1, kPhaseTmaLoad = 2, kPhasePullReady = 3 };

// Written by a timed-out wait into mapped host memory; read by the host after each synchronisation.
struct ErrorRecord {
  int failed, gpu, peer, phase;
  unsigned target, seen;
};

// What a kernel on rank `rank` sees of the mesh: every rank's receive buffer and counter block (peer
// pointers through UVA). Counter block of a rank: [0, R) barrier arrivals by source, [R, 2R) send
// arrivals by source, [2R] abort word. Counters only grow; the host tracks the targets.
struct Mesh {
  int rank, ranks;
  uint8_t* recv[kMaxRanks];
  unsigned* counters[kMaxRanks];
  ErrorRecord* err;
};

// One row a rank sends: its token, the destination rank and the row index in the destination's buffer.
struct SendRow {
  int token, dest, dst_row, pad;
};

__host__ __device__ inline uint16_t pattern(int src, int token, int col, unsigned salt) {
  uint32_t h = src * 0x9E3779B1u ^ token * 0x85EBCA77u ^ col * 0xC2B2AE3Du ^ salt * 0x27D4EB2Fu;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  return h & 0x7FFF;
}

// ---------------------------------------------------------------------------------------- sync helpers
__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_sys(unsigned* p, unsigned v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ void raise_timeout(const Mesh& m, int peer, int phase, unsigned target, unsigned seen) {
  printf("TIMEOUT gpu %d peer %d phase %s target %u seen %u (block %d thread %d)\n", m.rank, peer,
         phase == kPhaseBarrier    ? "barrier"
         : phase == kPhaseSendDone ? "send-done"
         : phase == kPhaseTmaLoad  ? "tma-load"
                                   : "pull-ready",
         target, seen,
         blockIdx.x, threadIdx.x);
  volatile ErrorRecord* e = m.err;
  e->gpu = m.rank; e->peer = peer; e->phase = phase; e->target = target; e->seen = seen;
  e->failed = 1;
  for (int p = 0; p < m.ranks; ++p) *reinterpret_cast<volatile unsigned*>(m.counters[p] + 2 * m.ranks) = 1;
  __threadfence_system();
}

__device__ __forceinline__ bool aborted(const Mesh& m) {
  return *reinterpret_cast<volatile unsigned*>(m.counters[m.rank] + 2 * m.ranks) != 0;
}

// Spins until the local counter reaches `target` (wrap-safe compare); the acquire load that sees it makes
// everything the releasing source did before its release visible to this thread. Gives up on timeout or
// when any GPU raised the abort word.
__device__ bool wait_count(const Mesh& m, const unsigned* counter, unsigned target, int peer, int phase) {
  const long long start = clock64();
  while (true) {
    const unsigned seen = ld_acquire_sys(counter);
    if (static_cast<int>(seen - target) >= 0) return true;
    if (aborted(m)) return false;
    if (clock64() - start > kTimeoutCycles) {
      raise_timeout(m, peer, phase, target, seen);
      return false;
    }
  }
}

// Every block: arrive at every rank (counter slot `base + my rank`), then wait until every source's
// counter at this rank reached `target`.
// Ordering: each warp's stores to the peers (generic proxy; the tma path first completes its bulk stores
// and fences the async proxy, see tma_send) precede the __syncthreads; thread t's release add at system
// scope is cumulative over everything ordered before it through that barrier, so a receiver whose acquire
// load sees the count sees every row of the block. The count reaches target only when all blocks of that
// source arrived. The trailing __syncthreads orders the acquires before anything the block does next.
__device__ void arrive_all_and_wait(const Mesh& m, int base, unsigned target, int phase) {
  __syncthreads();
  if (threadIdx.x < m.ranks) {
    red_release_sys(m.counters[threadIdx.x] + base + m.rank, 1);
    wait_count(m, m.counters[m.rank] + base + threadIdx.x, target, threadIdx.x, phase);
  }
  __syncthreads();
}

// One block of >= R threads: every rank arrives, then waits for all (ranks start their timed call together).
__global__ void barrier_kernel(Mesh m, unsigned target) { arrive_all_and_wait(m, 0, target, kPhaseBarrier); }

// ---------------------------------------------------------------------------------------- direct write
// Warp w of the grid sends rows w, w + W, ... (W warps in all); lane l moves vectors l, l + 32, ... of a
// row, kUnroll loads in flight before their stores.
template <int kUnroll>
__global__ void __launch_bounds__(1024, 1) direct_send(Mesh m, const int4* __restrict__ x, const SendRow* __restrict__ rows, int num_rows,
                            int row_vecs, unsigned send_target) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int first = blockIdx.x * warps + (threadIdx.x >> 5), stride = gridDim.x * warps;
#pragma unroll 1
  for (int i = first; i < num_rows; i += stride) {
    const SendRow r = rows[i];
    const int4* src = x + static_cast<size_t>(r.token) * row_vecs;
    int4* dst = reinterpret_cast<int4*>(m.recv[r.dest]) + static_cast<size_t>(r.dst_row) * row_vecs;
#pragma unroll 1
    for (int c = lane; c < row_vecs; c += 32 * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (c + 32 * u < row_vecs) v[u] = __ldg(src + c + 32 * u);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (c + 32 * u < row_vecs) dst[c + 32 * u] = v[u];
    }
  }
  arrive_all_and_wait(m, m.ranks, send_target, kPhaseSendDone);
}

// ---------------------------------------------------------------------------------------- tma (bulk copy)
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}
__device__ __forceinline__ void bulk_load(uint32_t dst_smem, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   dst_smem), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, uint32_t src_smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src_smem), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Block b sends rows b, b + S, ... (k-th of them: row b + k S) through `slots` row buffers in shared memory,
// all issued by thread 0: row k sits in slot k % slots; its load completes phase k / slots of that slot's
// mbarrier. After issuing the store of row k, the slot of row k - (kStoreDepth - 1) is refilled with row
// k - (kStoreDepth - 1) + slots once `wait_group.read kStoreDepth - 1` says that row's store has read it
// (stores are committed one per group, so at most the kStoreDepth - 1 newest may still be reading).
// Loads in flight: about slots - kStoreDepth; the store of a row waits only for that row's load.
// Shared memory written by the bulk load (async proxy) is read only by the bulk store (async proxy) issued
// by the thread that observed the mbarrier phase complete, so no generic<->async proxy fence is needed there.
__global__ void tma_send(Mesh m, const uint8_t* __restrict__ x, const SendRow* __restrict__ rows, int num_rows,
                         int row_bytes, int slots, unsigned send_target) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + static_cast<size_t>(slots) * row_bytes);
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bars + s)) : "memory");
    // make the initialised barriers visible to the async proxy (the bulk loads complete on them)
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const int n = num_rows > static_cast<int>(blockIdx.x) ? (num_rows - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    auto row_of = [&](int k) { return rows[blockIdx.x + static_cast<size_t>(k) * gridDim.x]; };
    auto load = [&](int k) {
      const int s = k % slots;
      bulk_load(smem_u32(smem + static_cast<size_t>(s) * row_bytes),
                x + static_cast<size_t>(row_of(k).token) * row_bytes, row_bytes, smem_u32(bars + s));
    };
    for (int k = 0; k < n && k < slots; ++k) load(k);
    bool ok = true;
    for (int k = 0; k < n && ok; ++k) {
      const int s = k % slots;
      const long long start = clock64();
      while (!mbar_try_wait(smem_u32(bars + s), (k / slots) & 1)) {
        if (clock64() - start > kTimeoutCycles) {
          raise_timeout(m, m.rank, kPhaseTmaLoad, k, 0);
          ok = false;
          break;
        }
      }
      if (!ok) break;
      const SendRow r = row_of(k);
      bulk_store(m.recv[r.dest] + static_cast<size_t>(r.dst_row) * row_bytes,
                 smem_u32(smem + static_cast<size_t>(s) * row_bytes), row_bytes);
      const int j = k - (kStoreDepth - 1);
      if (j >= 0 && j + slots < n) {
        asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kStoreDepth - 1) : "memory");
        load(j + slots);
      }
    }
    // Full completion of every bulk store (writes performed, not only the shared memory read), then a
    // proxy fence so these async-proxy writes are ordered before the generic-proxy release in
    // arrive_all_and_wait. (On timeout, pending loads are abandoned; the host exits.)
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  arrive_all_and_wait(m, m.ranks, send_target, kPhaseSendDone);
}

// ---------------------------------------------------------------------------------------- helpers
// Epilogue on all SMs: contiguous int4 copy, 4 vectors in flight per thread.
__global__ void copy_kernel(int4* __restrict__ dst, const int4* __restrict__ src, size_t n) {
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * step < n; i += 4 * step) {
    const int4 a = __ldg(src + i), b = __ldg(src + i + step), c = __ldg(src + i + 2 * step),
               d = __ldg(src + i + 3 * step);
    dst[i] = a; dst[i + step] = b; dst[i + 2 * step] = c; dst[i + 3 * step] = d;
  }
  for (; i < n; i += step) dst[i] = __ldg(src + i);
}

__global__ void fill_kernel(uint16_t* x, int rank, int tokens, int hidden, unsigned salt) {
  const size_t n = static_cast<size_t>(tokens) * hidden;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    x[i] = pattern(rank, static_cast<int>(i / hidden), static_cast<int>(i % hidden), salt);
}

// packed[p] = x[tokens[p]]: the per-destination contiguous rows the ce_peer design pushes (untimed).
__global__ void gather_kernel(int4* __restrict__ packed, const int4* __restrict__ x, const int* __restrict__ tokens,
                              int num_rows, int row_vecs) {
  for (int p = blockIdx.x; p < num_rows; p += gridDim.x)
    for (int c = threadIdx.x; c < row_vecs; c += blockDim.x)
      packed[static_cast<size_t>(p) * row_vecs + c] = x[static_cast<size_t>(tokens[p]) * row_vecs + c];
}

// Counts elements of received row b that differ from pattern(expect[b].x = source, expect[b].y = token).
__global__ void check_kernel(const uint16_t* __restrict__ got, const int2* __restrict__ expect, int num_rows,
                             int hidden, unsigned salt, unsigned long long* mismatches) {
  unsigned long long bad = 0;
  for (int b = blockIdx.x; b < num_rows; b += gridDim.x)
    for (int c = threadIdx.x; c < hidden; c += blockDim.x)
      bad += got[static_cast<size_t>(b) * hidden + c] != pattern(expect[b].x, expect[b].y, c, salt);
  if (bad) atomicAdd(mismatches, bad);
}

// ---------------------------------------------------------------------------------------- combine
// Element `col` of the expert-output row that rank `holder` returns to `owner` for the owner's token `token`:
// an integer in [-8, 8], stored as bf16. A token's sum has <= 8 terms (|sum| <= 64): exact in fp32 and bf16.
__device__ __forceinline__ int combine_value(int holder, int owner, int token, int col, unsigned salt) {
  return static_cast<int>(pattern(holder * kMaxRanks + owner, token, col, salt) % 17) - 8;
}
__device__ __forceinline__ uint16_t bf16_bits(float f) { return static_cast<uint16_t>(__float_as_uint(f) >> 16); }

// Where a combine kernel reads rank p's rows: pull, every rank's expert-output buffer (peer pointers);
// reduce, the own rank's staging buffer.
struct Bases {
  const uint8_t* p[kMaxRanks];
};

// 16-byte loads of rows read once. kNc (the reduce epilogue): non-coherent path without L1 allocation, valid
// because no one writes the staging buffer while the kernel runs (the push kernels before it filled it, the
// next call's pushes wait for the barrier behind it). Else (pull: a holder may still be writing its rows when
// the owner's kernel starts) a plain weak load cached at L2 only (ld.global.cg), ordered after the acquire of
// the kernel's own barrier by the __syncthreads that ends it.
template <bool kNc>
__device__ __forceinline__ int4 ld_row(const int4* p) {
  if (!kNc) return __ldcg(p);
  int4 v;
  asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& v) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                         static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += __uint_as_float(w[i] << 16);             // element 2i: the low half
    acc[2 * i + 1] += __uint_as_float(w[i] & 0xFFFF0000u);  // element 2i + 1: the high half
  }
}
__device__ __forceinline__ int4 pack_bf16x8(const float (&acc)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)  // round to nearest even; the first source goes to the upper half
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(acc[2 * i + 1]), "f"(acc[2 * i]));
  return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
}

// out[t] = sum over j in [tok_off[t], tok_off[t + 1]) of row srcs[j].y of rank srcs[j].x's buffer (bases),
// fp32 accumulation, bf16 result; a token without sources gets zeros. Warp w of the grid takes tokens
// w, w + W, ...; lane l holds the row pointer of the token's l-th source (a token has at most R <= 8, one
// per holder rank, by construction of the tables) and broadcasts it by shuffle; per source, each lane has
// kUnroll 16-byte loads in flight (vectors c + 32 u, c = l, l + 32 kUnroll, ...) before adding them.
// kPull: sources on every rank (remote loads, a local one for the own rank); first a barrier of all ranks
// inside the kernel (every block adds 1 at every rank's barrier counters, release, and waits until every
// rank's count reached ready_target, acquire: the holders' rows are ready), so its time holds one all-rank
// handshake as push+reduce's holds its counters. Else the push+reduce epilogue: sources in the local staging
// buffer, no waits (the push kernel before it acquired every source's rows).
template <int kUnroll, bool kPull>
__global__ void __launch_bounds__(1024, 1)
    combine_reduce(Mesh m, unsigned ready_target, const __grid_constant__ Bases b, const int* __restrict__ tok_off,
                   const int2* __restrict__ srcs, int tokens, int row_vecs, int4* __restrict__ out) {
  if (kPull) arrive_all_and_wait(m, 0, ready_target, kPhasePullReady);
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int first = blockIdx.x * warps + (threadIdx.x >> 5), stride = gridDim.x * warps;
#pragma unroll 1
  for (int t = first; t < tokens; t += stride) {  // warp-uniform: every shuffle below has all 32 lanes
    const int j0 = tok_off[t], n = tok_off[t + 1] - j0;
    unsigned long long mine = 0;
    if (lane < n) {
      const int2 s = srcs[j0 + lane];
      mine = reinterpret_cast<unsigned long long>(b.p[s.x] + static_cast<size_t>(s.y) * row_vecs * 16);
    }
#pragma unroll 1
    for (int c = lane; c - lane < row_vecs; c += 32 * kUnroll) {  // c - lane: the warp's first vector, uniform
      float acc[kUnroll][8];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
#pragma unroll 1
      for (int j = 0; j < n; ++j) {
        const int4* src = reinterpret_cast<const int4*>(__shfl_sync(0xFFFFFFFFu, mine, j)) + c;
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (c + 32 * u < row_vecs) v[u] = ld_row<!kPull>(src + 32 * u);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (c + 32 * u < row_vecs) add_bf16x8(acc[u], v[u]);
      }
      int4* dst = out + static_cast<size_t>(t) * row_vecs + c;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (c + 32 * u < row_vecs) dst[32 * u] = pack_bf16x8(acc[u]);
    }
  }
}

// Row b of a holder's expert-output buffer (dispatch receive layout: expect[b] = (owner, token)).
__global__ void combine_fill_kernel(uint16_t* rows, const int2* __restrict__ expect, int num_rows, int hidden,
                                    int holder, unsigned salt) {
  const size_t n = static_cast<size_t>(num_rows) * hidden;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int2 e = expect[i / hidden];
    rows[i] = bf16_bits(static_cast<float>(combine_value(holder, e.x, e.y, static_cast<int>(i % hidden), salt)));
  }
}

// Counts output elements of `owner` that differ from the sum over the token's holders (bit d of holders[t],
// from the routing, independent of the kernels' offset tables); a poisoned (NaN) element never compares equal.
__global__ void combine_check_kernel(const uint16_t* __restrict__ out, const uint8_t* __restrict__ holders,
                                     int tokens, int hidden, int ranks, int owner, unsigned salt,
                                     unsigned long long* mismatches) {
  unsigned long long bad = 0;
  for (int t = blockIdx.x; t < tokens; t += gridDim.x)
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
      int want = 0;
      for (int d = 0; d < ranks; ++d)
        if ((holders[t] >> d) & 1) want += combine_value(d, owner, t, c, salt);
      const float got = __uint_as_float(static_cast<uint32_t>(out[static_cast<size_t>(t) * hidden + c]) << 16);
      bad += !(got == static_cast<float>(want));
    }
  if (bad) atomicAdd(mismatches, bad);
}

// ---------------------------------------------------------------------------------------- host
// tma: row slots that fit in the opt-in shared memory beside the kMaxSlots mbarriers, and the block's bytes:
// at least `spread` (over half an SM's), so that small rows too give one block per SM, as for direct.
static int tma_slots(int smem_optin, int row_bytes) {
  return std::min(kMaxSlots, static_cast<int>((smem_optin - kMaxSlots * sizeof(uint64_t)) / row_bytes));
}
static size_t tma_smem_bytes(int slots, int row_bytes, int spread) {
  return std::max(static_cast<size_t>(spread), static_cast<size_t>(slots) * row_bytes + kMaxSlots * sizeof(uint64_t));
}

enum Design { kDirect, kTma, kCePeer, kPull, kPushReduce };  // the last two: combine
enum Epilogue { kEpiNone, kEpiSm, kEpiCe, kEpiReduce };
static bool is_combine(Design d) { return d == kPull || d == kPushReduce; }

struct Rank {
  cudaStream_t stream;
  cudaStream_t side[kMaxRanks];
  cudaEvent_t fork, join[kMaxRanks];
  std::vector<cudaEvent_t> ev;  // 3 per iteration: start, after send, after epilogue
  // recv: the dispatch's receive buffer, and the combine's expert-output rows (same layout, peer-readable)
  uint8_t *x, *recv, *out, *packed;
  // combine: cout [T, hidden] the owner's output; stage: push+reduce slots (num_send rows: one per (token,
  // holder) of this owner, a token's slots contiguous, holders in rank order); tok_off [T + 1] a token's first
  // slot; pull_src / reduce_src [num_send] (rank, row) a slot's source row (holder's expert-output buffer /
  // own staging); push_rows [num_recv] this rank's expert-output rows -> (owner, slot); holders [T] bit d:
  // rank d holds the token (for the check, from the routing)
  uint8_t *cout, *stage, *holders;
  int* tok_off;
  int2 *pull_src, *reduce_src;
  SendRow* push_rows;
  unsigned* counters;
  unsigned long long* mismatches;
  SendRow* rows;
  int* pack_tokens;
  int2* expect;
  int num_send, num_recv;
  size_t pack_off[kMaxRanks], recv_off[kMaxRanks], count_to[kMaxRanks];  // in rows
};

struct Probe {
  int R, T, sm_count, smem_optin, spread_smem;
  std::vector<Rank> rk;
  ErrorRecord* err;
  unsigned barrier_target = 0, send_target = 0, salt = 100;

  Mesh mesh(int r) const {
    Mesh m{};
    m.rank = r; m.ranks = R; m.err = err;
    for (int p = 0; p < R; ++p) { m.recv[p] = rk[p].recv; m.counters[p] = rk[p].counters; }
    return m;
  }
  Mesh push_mesh(int r) const {  // push+reduce: rows go to the owners' staging buffers; the same counters
    Mesh m = mesh(r);
    for (int p = 0; p < R; ++p) m.recv[p] = rk[p].stage;
    return m;
  }
  Bases pull_bases() const {
    Bases b{};
    for (int p = 0; p < R; ++p) b.p[p] = rk[p].recv;
    return b;
  }
  Bases reduce_bases(int r) const {  // reduce_src names only rank r
    Bases b{};
    b.p[r] = rk[r].stage;
    return b;
  }
  void sync_all() {
    for (int r = 0; r < R; ++r) { CK(cudaSetDevice(r)); CK(cudaDeviceSynchronize()); }
    if (err->failed) {
      fprintf(stderr, "FAILED: timeout on gpu %d waiting for peer %d (phase %d, target %u, seen %u)\n", err->gpu,
              err->peer, err->phase, err->target, err->seen);
      exit(2);
    }
  }
  void barrier() {  // enqueue a barrier of all ranks on every rank's stream
    ++barrier_target;
    for (int r = 0; r < R; ++r) {
      CK(cudaSetDevice(r));
      barrier_kernel<<<1, 32, 0, rk[r].stream>>>(mesh(r), barrier_target);
      CK(cudaGetLastError());
    }
  }
};

struct Config {
  Design design;
  int unroll, threads, sms, hidden;
  Epilogue epi;
};

struct Result {
  double send_us, epi_us, total_us, gbps_send, gbps_total;
  unsigned long long mismatches;
};

// combine_reduce<unroll, pull> with S blocks of N threads, one per SM (the spread shared memory, as
// direct_send): pull reads every rank's expert-output rows after its in-kernel barrier (target
// P.barrier_target, advanced by the caller); the reduce reads the own staging buffer.
template <bool kPull>
static void launch_reduce(Probe& P, int r, const Config& c) {
  Rank& k = P.rk[r];
  const int row_vecs = c.hidden * 2 / 16;
  const size_t spread = P.spread_smem;
  const Mesh m = P.mesh(r);
  const unsigned t = P.barrier_target;
  const Bases b = kPull ? P.pull_bases() : P.reduce_bases(r);
  const int2* srcs = kPull ? k.pull_src : k.reduce_src;
  int4* out = reinterpret_cast<int4*>(k.cout);
  if (c.unroll == 1) combine_reduce<1, kPull><<<c.sms, c.threads, spread, k.stream>>>(m, t, b, k.tok_off, srcs, P.T, row_vecs, out);
  if (c.unroll == 2) combine_reduce<2, kPull><<<c.sms, c.threads, spread, k.stream>>>(m, t, b, k.tok_off, srcs, P.T, row_vecs, out);
  if (c.unroll == 4) combine_reduce<4, kPull><<<c.sms, c.threads, spread, k.stream>>>(m, t, b, k.tok_off, srcs, P.T, row_vecs, out);
}

static void enqueue_send(Probe& P, int r, const Config& c, int slots) {
  Rank& k = P.rk[r];
  const int row_bytes = c.hidden * 2, row_vecs = row_bytes / 16;
  const Mesh m = P.mesh(r);
  if (c.design == kDirect) {
    // unused dynamic shared memory over half an SM's: no two blocks share an SM, so S blocks use S SMs
    const unsigned t = P.send_target;
    const size_t spread = P.spread_smem;
    if (c.unroll == 1) direct_send<1><<<c.sms, c.threads, spread, k.stream>>>(m, (const int4*)k.x, k.rows, k.num_send, row_vecs, t);
    if (c.unroll == 2) direct_send<2><<<c.sms, c.threads, spread, k.stream>>>(m, (const int4*)k.x, k.rows, k.num_send, row_vecs, t);
    if (c.unroll == 4) direct_send<4><<<c.sms, c.threads, spread, k.stream>>>(m, (const int4*)k.x, k.rows, k.num_send, row_vecs, t);
  } else if (c.design == kPushReduce) {
    // the direct send of this rank's expert-output rows to their slots in the owners' staging buffers
    const Mesh pm = P.push_mesh(r);
    const unsigned t = P.send_target;
    const size_t spread = P.spread_smem;
    const int4* src = reinterpret_cast<const int4*>(k.recv);
    if (c.unroll == 1) direct_send<1><<<c.sms, c.threads, spread, k.stream>>>(pm, src, k.push_rows, k.num_recv, row_vecs, t);
    if (c.unroll == 2) direct_send<2><<<c.sms, c.threads, spread, k.stream>>>(pm, src, k.push_rows, k.num_recv, row_vecs, t);
    if (c.unroll == 4) direct_send<4><<<c.sms, c.threads, spread, k.stream>>>(pm, src, k.push_rows, k.num_recv, row_vecs, t);
  } else if (c.design == kPull) {
    launch_reduce<true>(P, r, c);
  } else if (c.design == kTma) {
    tma_send<<<c.sms, c.threads, tma_smem_bytes(slots, row_bytes, P.spread_smem), k.stream>>>(m, k.x, k.rows, k.num_send, row_bytes, slots, P.send_target);
  } else {  // ce_peer: one stream per destination, joined back, then a barrier so the time covers every push
    CK(cudaEventRecord(k.fork, k.stream));
    for (int d = 0; d < P.R; ++d) {
      CK(cudaStreamWaitEvent(k.side[d], k.fork, 0));
      const size_t bytes = k.count_to[d] * row_bytes;
      uint8_t* dst = P.rk[d].recv + P.rk[d].recv_off[r] * row_bytes;
      const uint8_t* src = k.packed + k.pack_off[d] * row_bytes;
      if (bytes) CK(cudaMemcpyPeerAsync(dst, d, src, r, bytes, k.side[d]));
      CK(cudaEventRecord(k.join[d], k.side[d]));
      CK(cudaStreamWaitEvent(k.stream, k.join[d], 0));
    }
  }
  CK(cudaGetLastError());
}

static void enqueue_epilogue(Probe& P, int r, const Config& c) {
  Rank& k = P.rk[r];
  const size_t bytes = static_cast<size_t>(k.num_recv) * c.hidden * 2;
  if (c.epi == kEpiSm) copy_kernel<<<P.sm_count, 1024, 0, k.stream>>>((int4*)k.out, (const int4*)k.recv, bytes / 16);
  if (c.epi == kEpiCe) CK(cudaMemcpyAsync(k.out, k.recv, bytes, cudaMemcpyDeviceToDevice, k.stream));
  if (c.epi == kEpiReduce) launch_reduce<false>(P, r, c);
  CK(cudaGetLastError());
}

// One call on every rank: barrier, [start] send [mid] epilogue [end]. Counter targets advance in step.
// Combine buffer reuse: pull reads a holder's rows only after its kernel's own barrier (every rank's pull
// kernel started, so each holder's fill before it is done) and a holder rewrites them only after the trailing
// barrier (every rank's pull finished); a staging slot (push+reduce) is written by the next call's push only
// after the next call's leading barrier, which the owner reaches only after its reduce of this call finished.
// Barrier counters: leading +1, pull +S (one per block), trailing +1 per rank, in the same order everywhere.
static void enqueue_call(Probe& P, const Config& c, int slots, int it) {
  P.barrier();
  if (c.design == kDirect || c.design == kTma || c.design == kPushReduce) P.send_target += c.sms;
  if (c.design == kPull) P.barrier_target += c.sms;  // the pull kernel's own barrier: S arrivals per rank
  for (int r = 0; r < P.R; ++r) {
    CK(cudaSetDevice(r));
    Rank& k = P.rk[r];
    if (it >= 0) CK(cudaEventRecord(k.ev[3 * it], k.stream));
    enqueue_send(P, r, c, slots);
  }
  if (c.design == kCePeer) P.barrier();
  for (int r = 0; r < P.R; ++r) {
    CK(cudaSetDevice(r));
    Rank& k = P.rk[r];
    if (it >= 0) CK(cudaEventRecord(k.ev[3 * it + 1], k.stream));
    enqueue_epilogue(P, r, c);
    if (it >= 0) CK(cudaEventRecord(k.ev[3 * it + 2], k.stream));
  }
  // pull, untimed: no holder goes on (e.g. to refill its rows for the check) while a peer still reads them
  if (c.design == kPull) P.barrier();
}

static void fill_inputs(Probe& P, const Config& c, unsigned salt) {
  for (int r = 0; r < P.R; ++r) {
    CK(cudaSetDevice(r));
    Rank& k = P.rk[r];
    if (is_combine(c.design)) {  // the expert-output rows this rank returns
      combine_fill_kernel<<<1024, 256, 0, k.stream>>>((uint16_t*)k.recv, k.expect, k.num_recv, c.hidden, r, salt);
      CK(cudaGetLastError());
      continue;
    }
    fill_kernel<<<1024, 256, 0, k.stream>>>((uint16_t*)k.x, r, P.T, c.hidden, salt);
    if (c.design == kCePeer)
      gather_kernel<<<1024, 256, 0, k.stream>>>((int4*)k.packed, (const int4*)k.x, k.pack_tokens, k.num_send,
                                                 c.hidden * 2 / 16);
    CK(cudaGetLastError());
  }
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

static Result run_config(Probe& P, const Config& c, int warmup, int iters) {
  const int row_bytes = c.hidden * 2;
  const int slots = tma_slots(P.smem_optin, row_bytes);
  fill_inputs(P, c, P.salt);
  for (int i = 0; i < warmup; ++i) enqueue_call(P, c, slots, -1);
  for (int i = 0; i < iters; ++i) enqueue_call(P, c, slots, i);
  P.sync_all();
  std::vector<double> send(iters), epi(iters), total(iters);
  for (int i = 0; i < iters; ++i) {
    double s = 0, e = 0, t = 0;
    for (int r = 0; r < P.R; ++r) {
      float a, b;
      CK(cudaSetDevice(r));
      CK(cudaEventElapsedTime(&a, P.rk[r].ev[3 * i], P.rk[r].ev[3 * i + 1]));
      CK(cudaEventElapsedTime(&b, P.rk[r].ev[3 * i + 1], P.rk[r].ev[3 * i + 2]));
      s = std::max(s, 1e3 * a); e = std::max(e, 1e3 * b); t = std::max(t, 1e3 * (a + b));
    }
    send[i] = s; epi[i] = e; total[i] = t;
  }
  Result res{};
  res.send_us = median(send); res.epi_us = median(epi); res.total_us = median(total);
  double bytes = 0;  // combine: a rank receives one row per (token, holder), i.e. as many as it sent in dispatch
  for (int r = 0; r < P.R; ++r)
    bytes += static_cast<double>(is_combine(c.design) ? P.rk[r].num_send : P.rk[r].num_recv) * row_bytes / P.R;
  res.gbps_send = bytes / (res.send_us * 1e3);
  res.gbps_total = bytes / (res.total_us * 1e3);
  // Verification: two calls on fresh data (a new salt each, so neither the previous call's rows nor the
  // previous design's pass), each checked on the receiver's stream right after the call.
  for (int r = 0; r < P.R; ++r) { CK(cudaSetDevice(r)); CK(cudaMemset(P.rk[r].mismatches, 0, 8)); }
  P.sync_all();
  for (int v = 0; v < 2; ++v) {
    const unsigned salt = ++P.salt;
    fill_inputs(P, c, salt);
    for (int r = 0; r < P.R && is_combine(c.design); ++r) {  // poison: 0xFFFF is a NaN, equal to nothing
      CK(cudaSetDevice(r));
      CK(cudaMemsetAsync(P.rk[r].cout, 0xFF, static_cast<size_t>(P.T) * row_bytes, P.rk[r].stream));
    }
    enqueue_call(P, c, slots, -1);
    for (int r = 0; r < P.R; ++r) {
      CK(cudaSetDevice(r));
      Rank& k = P.rk[r];
      if (is_combine(c.design)) {
        combine_check_kernel<<<1024, 256, 0, k.stream>>>((const uint16_t*)k.cout, k.holders, P.T, c.hidden, P.R, r,
                                                         salt, k.mismatches);
        CK(cudaGetLastError());
        continue;
      }
      check_kernel<<<1024, 256, 0, k.stream>>>((const uint16_t*)k.recv, k.expect, k.num_recv, c.hidden, salt, k.mismatches);
      if (c.epi != kEpiNone)
        check_kernel<<<1024, 256, 0, k.stream>>>((const uint16_t*)k.out, k.expect, k.num_recv, c.hidden, salt, k.mismatches);
      CK(cudaGetLastError());
    }
  }
  P.sync_all();
  for (int r = 0; r < P.R; ++r) {
    unsigned long long bad;
    CK(cudaSetDevice(r));
    CK(cudaMemcpy(&bad, P.rk[r].mismatches, 8, cudaMemcpyDeviceToHost));
    res.mismatches += bad;
  }
  return res;
}

static std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

static const char kUsage[] =
    "usage: nvlink_probe [--gpus R] [--sms 4,8,16,24,32] [--threads 512,1024] [--hidden 7168,4096]\n"
    "                    [--tokens 4096] [--topk 8] [--experts 256] [--iters 10] [--warmup 2]\n"
    "                    [--ops dispatch,combine]\n"
    "R defaults to every visible GPU (2..8, all pairs with peer access and native atomics).\n"
    "Exit status: 0 all designs pass their data check, 1 setup error, 2 a wait timed out, 3 a check failed.\n";

int main(int argc, char** argv) {
  const auto wall_start = std::chrono::steady_clock::now();
  int gpus = 0, tokens = 4096, topk = 8, experts = 256, iters = 10, warmup = 2;
  std::vector<int> sms = {4, 8, 16, 24, 32}, threads = {512, 1024}, hiddens = {7168, 4096};
  bool do_dispatch = true, do_combine = true;
  for (int i = 1; i < argc; ++i)
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { fputs(kUsage, stdout); return 0; }
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (i + 1 == argc) { fprintf(stderr, "option %s needs a value\n%s", a.c_str(), kUsage); return 1; }
    if (a == "--gpus") gpus = atoi(argv[i + 1]);
    else if (a == "--sms") sms = parse_list(argv[i + 1]);
    else if (a == "--threads") threads = parse_list(argv[i + 1]);
    else if (a == "--hidden") hiddens = parse_list(argv[i + 1]);
    else if (a == "--tokens") tokens = atoi(argv[i + 1]);
    else if (a == "--topk") topk = atoi(argv[i + 1]);
    else if (a == "--experts") experts = atoi(argv[i + 1]);
    else if (a == "--iters") iters = atoi(argv[i + 1]);
    else if (a == "--warmup") warmup = atoi(argv[i + 1]);
    else if (a == "--ops") {
      do_dispatch = do_combine = false;
      for (const char* q = argv[i + 1]; *q;) {
        const char* e = q;
        while (*e && *e != ',') ++e;
        const std::string op(q, e);
        if (op == "dispatch") do_dispatch = true;
        else if (op == "combine") do_combine = true;
        else { fprintf(stderr, "--ops: unknown table %s (dispatch, combine)\n%s", op.c_str(), kUsage); return 1; }
        q = *e ? e + 1 : e;
      }
    }
    else { fprintf(stderr, "unknown option %s\n%s", a.c_str(), kUsage); return 1; }
  }
  if (tokens < 1 || topk < 1 || experts < 1 || iters < 1 || warmup < 0 || sms.empty() || threads.empty() ||
      hiddens.empty() || !(do_dispatch || do_combine)) {
    fprintf(stderr, "need tokens, topk, experts, iters >= 1, warmup >= 0 and non-empty lists\n%s", kUsage);
    return 1;
  }
  // Load every kernel when each context is created. With lazy loading a kernel's first launch may wait for
  // its device to go idle, while a barrier or send kernel already running there spins for a peer whose
  // launch the host has not issued yet: the waits would time out. Set before the first CUDA call.
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  const int R = gpus > 0 ? gpus : ndev;
  if (R < 2 || R > ndev || R > kMaxRanks || topk > experts) {
    fprintf(stderr, "need 2..%d GPUs (have %d, asked %d) and topk <= experts\n", kMaxRanks, ndev, R);
    return 1;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int max_hidden = *std::max_element(hiddens.begin(), hiddens.end());
  for (int h : hiddens)
    if (h <= 0 || (h * 2) % 16) { fprintf(stderr, "hidden %d: rows must be a multiple of 16 bytes\n", h); return 1; }
  for (int s : sms)  // every block of a call must be resident at once: it waits for the peers' blocks
    if (s < 1 || s > prop.multiProcessorCount) { fprintf(stderr, "sms %d: need 1..%d\n", s, prop.multiProcessorCount); return 1; }
  for (int t : threads)
    if (t < 32 || t > 1024 || t % 32) { fprintf(stderr, "threads %d: need a multiple of 32 in [32, 1024]\n", t); return 1; }

  Probe P;
  P.R = R; P.T = tokens; P.rk.resize(R);
  CK(cudaHostAlloc(&P.err, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  memset(P.err, 0, sizeof(ErrorRecord));
  P.sm_count = prop.multiProcessorCount;
  CK(cudaDeviceGetAttribute(&P.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  int smem_per_sm = 0;
  CK(cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
  P.spread_smem = smem_per_sm / 2 + 1024;
  for (int h : hiddens)  // tma refills a slot kStoreDepth - 1 rows after its store: needs more slots than that
    if (tma_slots(P.smem_optin, 2 * h) < kStoreDepth) {
      fprintf(stderr, "hidden %d: tma needs %d row slots in %d B of shared memory\n", h, kStoreDepth, P.smem_optin);
      return 1;
    }
  for (int r = 0; r < R; ++r) {
    CK(cudaSetDevice(r));
    for (int p = 0; p < R; ++p) {
      if (p == r) continue;
      int can = 0, atomics = 0;
      CK(cudaDeviceCanAccessPeer(&can, r, p));
      CK(cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, r, p));
      if (!can || !atomics) { fprintf(stderr, "gpu %d -> %d: peer access %d, native atomics %d\n", r, p, can, atomics); return 1; }
      CK(cudaDeviceEnablePeerAccess(p, 0));
    }
    CK(cudaFuncSetAttribute(tma_send, cudaFuncAttributeMaxDynamicSharedMemorySize, P.smem_optin));
    CK(cudaFuncSetAttribute(direct_send<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, P.spread_smem));
    CK(cudaFuncSetAttribute(direct_send<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, P.spread_smem));
    CK(cudaFuncSetAttribute(direct_send<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, P.spread_smem));
    const void* combine_kernels[6] = {
        reinterpret_cast<const void*>(combine_reduce<1, true>), reinterpret_cast<const void*>(combine_reduce<2, true>),
        reinterpret_cast<const void*>(combine_reduce<4, true>), reinterpret_cast<const void*>(combine_reduce<1, false>),
        reinterpret_cast<const void*>(combine_reduce<2, false>), reinterpret_cast<const void*>(combine_reduce<4, false>)};
    for (const void* f : combine_kernels)
      CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, P.spread_smem));
    // Every block of a send kernel waits for every block of every source, its own GPU's included, so the S
    // blocks of a call must all be resident at once (S <= SM count, checked above): each launch shape must
    // fit exactly one block per SM. Checked here so a shape that cannot launch fails before any timing.
    auto one_per_sm = [&](const void* f, int block, size_t smem, const char* name) {
      int n = 0;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, f, block, smem));
      if (n != 1) {
        fprintf(stderr, "gpu %d: %s with %d threads and %zu B shared memory fits %d blocks per SM, need 1\n", r,
                name, block, smem, n);
        exit(1);
      }
    };
    for (int t : threads) {
      one_per_sm(reinterpret_cast<const void*>(direct_send<1>), t, P.spread_smem, "direct x1");
      one_per_sm(reinterpret_cast<const void*>(direct_send<2>), t, P.spread_smem, "direct x2");
      one_per_sm(reinterpret_cast<const void*>(direct_send<4>), t, P.spread_smem, "direct x4");
      // pull waits for every rank's blocks as the senders do; the reduce does not wait, but its S blocks must
      // mean S SMs all the same
      const char* names[6] = {"pull x1", "pull x2", "pull x4", "reduce x1", "reduce x2", "reduce x4"};
      for (int f = 0; f < 6; ++f) one_per_sm(combine_kernels[f], t, P.spread_smem, names[f]);
    }
    for (int h : hiddens)
      one_per_sm(reinterpret_cast<const void*>(tma_send), 32, tma_smem_bytes(tma_slots(P.smem_optin, 2 * h), 2 * h, P.spread_smem),
                 "tma");
  }

  // Routing: each token of source s picks topk distinct experts uniformly (seeded by s); its destination
  // ranks are the owners of those experts (expert e lives on rank e * R / E).
  std::vector<std::vector<std::vector<int>>> to(R, std::vector<std::vector<int>>(R));  // to[s][d] = tokens
  for (int s = 0; s < R; ++s) {
    std::mt19937 rng(1234 + s);
    std::vector<int> ex(experts);
    for (int t = 0; t < tokens; ++t) {
      for (int e = 0; e < experts; ++e) ex[e] = e;
      bool hit[kMaxRanks] = {};
      for (int j = 0; j < topk; ++j) {
        std::swap(ex[j], ex[j + rng() % (experts - j)]);
        hit[static_cast<long long>(ex[j]) * R / experts] = true;
      }
      for (int d = 0; d < R; ++d)
        if (hit[d]) to[s][d].push_back(t);
    }
  }
  printf("nvlink_probe: %d x %s, %d SMs; T=%d top-%d of %d experts; iters %d (median) after %d warm-up\n", R,
         prop.name, P.sm_count, tokens, topk, experts, iters, warmup);
  std::vector<std::vector<int2>> held(R);  // held[r][b] = (source, token) of r's receive row b
  for (int r = 0; r < R; ++r) {
    Rank& k = P.rk[r];
    std::vector<SendRow> rows;
    std::vector<int> pack_tokens;
    std::vector<int2> expect;
    size_t off = 0;
    for (int s = 0; s < R; ++s) {
      k.recv_off[s] = off;
      off += to[s][r].size();
      for (int t : to[s][r]) expect.push_back(make_int2(s, t));
    }
    k.num_recv = static_cast<int>(off);
    for (int d = 0; d < R; ++d) {
      k.pack_off[d] = pack_tokens.size();
      k.count_to[d] = to[r][d].size();
      for (int t : to[r][d]) pack_tokens.push_back(t);
    }
    k.num_send = static_cast<int>(pack_tokens.size());
    // send rows in token order (a token's destinations in rank order), as a dispatch walks its tokens
    std::vector<size_t> next(R, 0);
    for (int t = 0; t < tokens; ++t)
      for (int d = 0; d < R; ++d)
        if (next[d] < to[r][d].size() && to[r][d][next[d]] == t) {
          size_t off_in_d = 0;
          for (int s = 0; s < r; ++s) off_in_d += to[s][d].size();
          rows.push_back({t, d, static_cast<int>(off_in_d + next[d]++), 0});
        }
    CK(cudaSetDevice(r));
    const size_t row_max = static_cast<size_t>(max_hidden) * 2;
    CK(cudaMalloc(&k.x, tokens * row_max));
    CK(cudaMalloc(&k.recv, std::max(1, k.num_recv) * row_max));
    CK(cudaMalloc(&k.out, std::max(1, k.num_recv) * row_max));
    CK(cudaMalloc(&k.packed, std::max(1, k.num_send) * row_max));
    CK(cudaMalloc(&k.counters, (2 * kMaxRanks + 1) * sizeof(unsigned)));
    CK(cudaMemset(k.counters, 0, (2 * kMaxRanks + 1) * sizeof(unsigned)));
    CK(cudaMalloc(&k.mismatches, 8));
    CK(cudaMalloc(&k.rows, std::max<size_t>(1, rows.size()) * sizeof(SendRow)));
    CK(cudaMalloc(&k.pack_tokens, std::max<size_t>(1, pack_tokens.size()) * sizeof(int)));
    CK(cudaMalloc(&k.expect, std::max<size_t>(1, expect.size()) * sizeof(int2)));
    CK(cudaMemcpy(k.rows, rows.data(), rows.size() * sizeof(SendRow), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(k.pack_tokens, pack_tokens.data(), pack_tokens.size() * sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(k.expect, expect.data(), expect.size() * sizeof(int2), cudaMemcpyHostToDevice));
    held[r] = expect;
    CK(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&k.fork, cudaEventDisableTiming));
    for (int d = 0; d < R; ++d) {
      CK(cudaStreamCreateWithFlags(&k.side[d], cudaStreamNonBlocking));
      CK(cudaEventCreateWithFlags(&k.join[d], cudaEventDisableTiming));
    }
    k.ev.resize(3 * iters);
    for (auto& e : k.ev) CK(cudaEventCreate(&e));
    printf("  rank %d: sends %d rows, receives %d rows (from each source:", r, k.num_send, k.num_recv);
    for (int s = 0; s < R; ++s) printf(" %zu", to[s][r].size());
    printf(")\n");
  }
  // Combine tables. Owner s: the holders of its token t are the ranks d with t in to[s][d] (bit d of
  // holders[s][t]); the token's slots tok_off[t] .. tok_off[t + 1] - 1 list them in rank order. The slot j of
  // (t, d): pull reads d's expert-output row for (s, t), i.e. d's dispatch receive row recv_off[s] + (index
  // of t in to[s][d]); d's push writes that row to s's staging row j; s's reduce reads its staging row j.
  std::vector<std::vector<std::vector<SendRow>>> push_by_owner(R, std::vector<std::vector<SendRow>>(R));
  std::vector<std::vector<int2>> pull_h(R);  // each owner's pull_src, for the consistency check below
  // A table error here would show as FAIL on the GPU; checked on the host too so it reads as a setup error.
  auto table_error = [](const char* what, int a, int b, int c) {
    fprintf(stderr, "combine tables: %s (%d, %d, %d)\n", what, a, b, c);
    exit(1);
  };
  for (int s = 0; s < R && do_combine; ++s) {
    std::vector<uint8_t> holders(tokens, 0);
    std::vector<int> tok_off(tokens + 1, 0);
    for (int d = 0; d < R; ++d)
      for (int t : to[s][d]) holders[t] |= 1u << d;
    for (int t = 0; t < tokens; ++t) tok_off[t + 1] = tok_off[t] + __builtin_popcount(holders[t]);
    const int slots_s = tok_off[tokens];
    if (slots_s != P.rk[s].num_send) {
      fprintf(stderr, "rank %d: %d combine slots but %d dispatch rows\n", s, slots_s, P.rk[s].num_send);
      return 1;
    }
    std::vector<int2> pull_src(slots_s), reduce_src(slots_s);
    for (int d = 0; d < R; ++d)
      for (size_t i = 0; i < to[s][d].size(); ++i) {
        const int t = to[s][d][i], row = static_cast<int>(P.rk[d].recv_off[s] + i);
        const int j = tok_off[t] + __builtin_popcount(holders[t] & ((1u << d) - 1));
        pull_src[j] = make_int2(d, row);
        push_by_owner[d][s].push_back({row, s, j, 0});
      }
    for (int j = 0; j < slots_s; ++j) reduce_src[j] = make_int2(s, j);
    for (int t = 0; t < tokens; ++t)  // slot j of token t names a holder of t, in rank order, and its row of (s, t)
      for (int j = tok_off[t]; j < tok_off[t + 1]; ++j) {
        const int2 q = pull_src[j];
        if (q.x < 0 || q.x >= R || !((holders[t] >> q.x) & 1) || (j > tok_off[t] && pull_src[j - 1].x >= q.x))
          table_error("slot names no holder / holders out of order: owner, token, slot", s, t, j);
        if (q.y < 0 || q.y >= P.rk[q.x].num_recv || held[q.x][q.y].x != s || held[q.x][q.y].y != t)
          table_error("slot's source row is not the holder's row of the token: owner, token, slot", s, t, j);
      }
    pull_h[s] = pull_src;
    Rank& k = P.rk[s];
    CK(cudaSetDevice(s));
    const size_t row_max = static_cast<size_t>(max_hidden) * 2;
    CK(cudaMalloc(&k.cout, tokens * row_max));
    CK(cudaMalloc(&k.stage, std::max(1, slots_s) * row_max));
    CK(cudaMalloc(&k.holders, tokens));
    CK(cudaMalloc(&k.tok_off, (tokens + 1) * sizeof(int)));
    CK(cudaMalloc(&k.pull_src, std::max(1, slots_s) * sizeof(int2)));
    CK(cudaMalloc(&k.reduce_src, std::max(1, slots_s) * sizeof(int2)));
    CK(cudaMemcpy(k.holders, holders.data(), tokens, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(k.tok_off, tok_off.data(), (tokens + 1) * sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(k.pull_src, pull_src.data(), slots_s * sizeof(int2), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(k.reduce_src, reduce_src.data(), slots_s * sizeof(int2), cudaMemcpyHostToDevice));
  }
  for (int d = 0; d < R && do_combine; ++d) {
    // a holder pushes its rows alternating owners (its own first), so its warps write to every owner at once
    // rather than to one owner after another (its buffer holds them owner by owner)
    std::vector<SendRow> rows;
    for (size_t i = 0, more = 1; more; ++i) {
      more = 0;
      for (int q = 0; q < R; ++q) {
        const std::vector<SendRow>& v = push_by_owner[d][(d + q) % R];
        if (i < v.size()) { rows.push_back(v[i]); more = 1; }
      }
    }
    Rank& k = P.rk[d];
    if (static_cast<int>(rows.size()) != k.num_recv)
      table_error("holder pushes not every row: holder, rows, held", d, static_cast<int>(rows.size()), k.num_recv);
    std::vector<char> pushed(k.num_recv, 0);
    for (const SendRow& w : rows) {  // each held row once, to the slot whose pull reads that same row
      if (w.token < 0 || w.token >= k.num_recv || pushed[w.token]++ || w.dest != held[d][w.token].x ||
          w.dst_row < 0 || w.dst_row >= P.rk[w.dest].num_send || pull_h[w.dest][w.dst_row].x != d ||
          pull_h[w.dest][w.dst_row].y != w.token)
        table_error("push row mismatch: holder, row, slot", d, w.token, w.dst_row);
    }
    CK(cudaSetDevice(d));
    CK(cudaMalloc(&k.push_rows, std::max<size_t>(1, rows.size()) * sizeof(SendRow)));
    CK(cudaMemcpy(k.push_rows, rows.data(), rows.size() * sizeof(SendRow), cudaMemcpyHostToDevice));
  }
  P.sync_all();

  bool all_pass = true;
  struct Row { std::string name; Design d; int unroll, threads; Epilogue epi; };
  typedef std::vector<std::pair<double, std::string>> Best;  // per S: best GB/s and the row's "xU tN"
  for (int hidden : hiddens) {
    auto header = [&](const char* title) {
      printf("%-26s", title);
      for (int s : sms) printf(" %16s", ("S=" + std::to_string(s)).c_str());
      printf("  check\n");
    };
    // Runs a row at every S and prints it (epilogue rows: the total, then the epilogue alone); a row with
    // `best` competes there with its GB/s (the total for epilogue rows) under the name's "xU tN" part.
    auto run_row = [&](const Row& row, Best* best) {
      std::vector<Result> res;
      unsigned long long bad = 0;
      for (int s : sms) {
        res.push_back(run_config(P, {row.d, row.unroll, row.threads, s, hidden, row.epi}, warmup, iters));
        bad += res.back().mismatches;
      }
      all_pass = all_pass && bad == 0;
      for (size_t i = 0; best && i < sms.size(); ++i) {
        const double g = row.epi != kEpiNone ? res[i].gbps_total : res[i].gbps_send;
        if (g > (*best)[i].first) (*best)[i] = {g, row.name.substr(row.name.find(" x") + 1)};
      }
      const std::string verdict = bad ? "FAIL (" + std::to_string(bad) + " bad elements)" : "PASS";
      char cell[64];
      printf("%-26s", (row.name + (row.epi != kEpiNone ? " total" : "")).c_str());
      for (const Result& r : res) {
        snprintf(cell, sizeof(cell), "%.0f (%.0f)", row.epi != kEpiNone ? r.gbps_total : r.gbps_send,
                 row.epi != kEpiNone ? r.total_us : r.send_us);
        printf(" %16s", cell);
      }
      printf("  %s\n", verdict.c_str());
      if (row.epi != kEpiNone) {
        printf("%-26s", row.epi == kEpiSm ? "  epilogue alone (SMs)"
                        : row.epi == kEpiCe ? "  epilogue alone (CE)" : "  reduce alone");
        for (const Result& r : res) {
          snprintf(cell, sizeof(cell), "%.0f (%.0f)", r.gbps_total * r.total_us / r.epi_us, r.epi_us);
          printf(" %16s", cell);
        }
        printf("\n");
      }
      fflush(stdout);
    };
    auto print_best = [&](const char* title, const Best& best) {
      printf("%-26s", title);
      for (const auto& b : best) printf(" %16s", b.second.c_str());
      printf("\n");
    };
    // The combine table first: it is plain SM loads and stores, printed before the dispatch table's tma rows
    // (which run last, should the bulk-copy path fault and end the process).
    if (do_combine) {
      printf("\ncombine, hidden %d (%d B rows), GB/s per GPU (median us per call); pull: all-rank barrier in the "
             "kernel, then loads from every holder; push+reduce: direct push to staging slots, counters, then a "
             "reduce kernel of S blocks x N threads\n", hidden, hidden * 2);
      header("combine design");
      Best best_pull(sms.size(), {0.0, ""}), best_push(sms.size(), {0.0, ""});
      for (int u : {1, 2, 4})
        for (int t : threads)
          run_row({"pull x" + std::to_string(u) + " t" + std::to_string(t), kPull, u, t, kEpiNone}, &best_pull);
      print_best("best pull (unroll, thr)", best_pull);
      for (int u : {1, 2, 4})
        for (int t : threads)
          run_row({"push+reduce x" + std::to_string(u) + " t" + std::to_string(t), kPushReduce, u, t, kEpiReduce},
                  &best_push);
      print_best("best push+reduce (total)", best_push);
    }
    if (!do_dispatch) continue;
    const int slots = tma_slots(P.smem_optin, hidden * 2);
    printf("\ndispatch, hidden %d (%d B rows), GB/s per GPU (median us per call); tma: 1 issuing thread, %d row "
           "slots, %d stores reading at most; epilogue: %d SMs x 1024 threads or cudaMemcpyAsync\n",
           hidden, hidden * 2, slots, kStoreDepth, P.sm_count);
    header("design");
    Best best(sms.size(), {0.0, ""});  // best direct row per S
    // Order: the plain SM and copy-engine designs first, the bulk-copy (tma) rows last, so that the most
    // certain rows are already printed should the tma path fault and end the process.
    for (int u : {1, 2, 4})
      for (int t : threads)
        run_row({"direct x" + std::to_string(u) + " t" + std::to_string(t), kDirect, u, t, kEpiNone}, &best);
    print_best("best direct (unroll, thr)", best);
    const std::string t0 = " t" + std::to_string(threads[0]);
    run_row({"direct x1" + t0 + " +epi_sm", kDirect, 1, threads[0], kEpiSm}, nullptr);
    run_row({"direct x1" + t0 + " +epi_ce", kDirect, 1, threads[0], kEpiCe}, nullptr);
    const Result ce = run_config(P, {kCePeer, 1, 0, 0, hidden, kEpiNone}, warmup, iters);
    all_pass = all_pass && ce.mismatches == 0;
    printf("%-26s %16s  %s\n", "ce_peer (0 SMs)",
           (std::to_string(static_cast<int>(ce.gbps_send)) + " (" + std::to_string(static_cast<int>(ce.send_us)) + ")").c_str(),
           ce.mismatches ? "FAIL" : "PASS");
    fflush(stdout);
    run_row({"tma", kTma, 1, 32, kEpiNone}, nullptr);
    run_row({"tma +epi_sm", kTma, 1, 32, kEpiSm}, nullptr);
    run_row({"tma +epi_ce", kTma, 1, 32, kEpiCe}, nullptr);
  }
  printf("\n%s (%.1f s)\n", all_pass ? "ALL PASS" : "SOME DESIGNS FAILED THE DATA CHECK",
         std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count());
  return all_pass ? 0 : 3;
}
