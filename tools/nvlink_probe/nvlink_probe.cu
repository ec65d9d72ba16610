// NVLink all-to-all probe: what per-GPU throughput candidate intranode dispatch designs reach with S SMs.
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
// No hang: every wait spins against a clock64 timeout; on timeout it prints GPU, peer and phase, raises
// an abort word on every GPU (so the other waits give up at once) and records the failure in mapped host
// memory; the host exits with status 2 at its next synchronisation.
//
//   nvcc -arch=sm_90a -O3 -o /tmp/nvlink_probe tools/nvlink_probe/nvlink_probe.cu
//   /tmp/nvlink_probe [--gpus R] [--sms 4,8,16,24,32] [--threads 512,1024] [--hidden 7168,4096]
//                     [--tokens 4096] [--topk 8] [--experts 256] [--iters 10] [--warmup 2]
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

enum Phase { kPhaseBarrier = 0, kPhaseSendDone = 1, kPhaseTmaLoad = 2 };

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
         phase == kPhaseBarrier ? "barrier" : phase == kPhaseSendDone ? "send-done" : "tma-load", target, seen,
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

// ---------------------------------------------------------------------------------------- host
// tma: row slots that fit in the opt-in shared memory beside the kMaxSlots mbarriers, and the block's bytes:
// at least `spread` (over half an SM's), so that small rows too give one block per SM, as for direct.
static int tma_slots(int smem_optin, int row_bytes) {
  return std::min(kMaxSlots, static_cast<int>((smem_optin - kMaxSlots * sizeof(uint64_t)) / row_bytes));
}
static size_t tma_smem_bytes(int slots, int row_bytes, int spread) {
  return std::max(static_cast<size_t>(spread), static_cast<size_t>(slots) * row_bytes + kMaxSlots * sizeof(uint64_t));
}

enum Design { kDirect, kTma, kCePeer };
enum Epilogue { kEpiNone, kEpiSm, kEpiCe };

struct Rank {
  cudaStream_t stream;
  cudaStream_t side[kMaxRanks];
  cudaEvent_t fork, join[kMaxRanks];
  std::vector<cudaEvent_t> ev;  // 3 per iteration: start, after send, after epilogue
  uint8_t *x, *recv, *out, *packed;
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
  CK(cudaGetLastError());
}

// One call on every rank: barrier, [start] send [mid] epilogue [end]. Counter targets advance in step.
static void enqueue_call(Probe& P, const Config& c, int slots, int it) {
  P.barrier();
  if (c.design != kCePeer) P.send_target += c.sms;
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
}

static void fill_inputs(Probe& P, const Config& c, unsigned salt) {
  for (int r = 0; r < P.R; ++r) {
    CK(cudaSetDevice(r));
    Rank& k = P.rk[r];
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
  double bytes = 0;
  for (int r = 0; r < P.R; ++r) bytes += static_cast<double>(P.rk[r].num_recv) * row_bytes / P.R;
  res.gbps_send = bytes / (res.send_us * 1e3);
  res.gbps_total = bytes / (res.total_us * 1e3);
  // Verification: two calls on fresh data (a new salt each, so neither the previous call's rows nor the
  // previous design's pass), each checked on the receiver's stream right after the call.
  for (int r = 0; r < P.R; ++r) { CK(cudaSetDevice(r)); CK(cudaMemset(P.rk[r].mismatches, 0, 8)); }
  P.sync_all();
  for (int v = 0; v < 2; ++v) {
    const unsigned salt = ++P.salt;
    fill_inputs(P, c, salt);
    enqueue_call(P, c, slots, -1);
    for (int r = 0; r < P.R; ++r) {
      CK(cudaSetDevice(r));
      Rank& k = P.rk[r];
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
    "R defaults to every visible GPU (2..8, all pairs with peer access and native atomics).\n"
    "Exit status: 0 all designs pass their data check, 1 setup error, 2 a wait timed out, 3 a check failed.\n";

int main(int argc, char** argv) {
  const auto wall_start = std::chrono::steady_clock::now();
  int gpus = 0, tokens = 4096, topk = 8, experts = 256, iters = 10, warmup = 2;
  std::vector<int> sms = {4, 8, 16, 24, 32}, threads = {512, 1024}, hiddens = {7168, 4096};
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
    else { fprintf(stderr, "unknown option %s\n%s", a.c_str(), kUsage); return 1; }
  }
  if (tokens < 1 || topk < 1 || experts < 1 || iters < 1 || warmup < 0 || sms.empty() || threads.empty() ||
      hiddens.empty()) {
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
  P.sync_all();

  bool all_pass = true;
  for (int hidden : hiddens) {
    const int slots = tma_slots(P.smem_optin, hidden * 2);
    printf("\nhidden %d (%d B rows), GB/s per GPU (median us per call); tma: 1 issuing thread, %d row slots, "
           "%d stores reading at most; epilogue: %d SMs x 1024 threads or cudaMemcpyAsync\n",
           hidden, hidden * 2, slots, kStoreDepth, P.sm_count);
    printf("%-26s", "design");
    for (int s : sms) printf(" %16s", ("S=" + std::to_string(s)).c_str());
    printf("  check\n");
    struct Row { std::string name; Design d; int unroll, threads; Epilogue epi; };
    std::vector<std::pair<double, std::string>> best(sms.size(), {0.0, ""});  // best direct row per S
    auto run_row = [&](const Row& row) {
      std::vector<Result> res;
      unsigned long long bad = 0;
      for (int s : sms) {
        res.push_back(run_config(P, {row.d, row.unroll, row.threads, s, hidden, row.epi}, warmup, iters));
        bad += res.back().mismatches;
      }
      all_pass = all_pass && bad == 0;
      for (size_t i = 0; i < sms.size(); ++i)
        if (row.d == kDirect && row.epi == kEpiNone && res[i].gbps_send > best[i].first)
          best[i] = {res[i].gbps_send, row.name.substr(7)};
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
        printf("%-26s", row.epi == kEpiSm ? "  epilogue alone (SMs)" : "  epilogue alone (CE)");
        for (const Result& r : res) {
          snprintf(cell, sizeof(cell), "%.0f (%.0f)", r.gbps_total * r.total_us / r.epi_us, r.epi_us);
          printf(" %16s", cell);
        }
        printf("\n");
      }
      fflush(stdout);
    };
    // Order: the plain SM and copy-engine designs first, the bulk-copy (tma) rows last, so that the most
    // certain rows are already printed should the tma path fault and end the process.
    for (int u : {1, 2, 4})
      for (int t : threads) run_row({"direct x" + std::to_string(u) + " t" + std::to_string(t), kDirect, u, t, kEpiNone});
    printf("%-26s", "best direct (unroll, thr)");
    for (const auto& b : best) printf(" %16s", b.second.c_str());
    printf("\n");
    const std::string t0 = " t" + std::to_string(threads[0]);
    run_row({"direct x1" + t0 + " +epi_sm", kDirect, 1, threads[0], kEpiSm});
    run_row({"direct x1" + t0 + " +epi_ce", kDirect, 1, threads[0], kEpiCe});
    const Result ce = run_config(P, {kCePeer, 1, 0, 0, hidden, kEpiNone}, warmup, iters);
    all_pass = all_pass && ce.mismatches == 0;
    printf("%-26s %16s  %s\n", "ce_peer (0 SMs)",
           (std::to_string(static_cast<int>(ce.gbps_send)) + " (" + std::to_string(static_cast<int>(ce.send_us)) + ")").c_str(),
           ce.mismatches ? "FAIL" : "PASS");
    fflush(stdout);
    run_row({"tma", kTma, 1, 32, kEpiNone});
    run_row({"tma +epi_sm", kTma, 1, 32, kEpiSm});
    run_row({"tma +epi_ce", kTma, 1, 32, kEpiCe});
  }
  printf("\n%s (%.1f s)\n", all_pass ? "ALL PASS" : "SOME DESIGNS FAILED THE DATA CHECK",
         std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count());
  return all_pass ? 0 : 3;
}
