// Ring self-test for the NVSHMEM device state of moe_dispatcher._C.
//
// Proves three things across ranks, with the device code of THIS .so:
//   1. nvshmem_my_pe()/nvshmem_n_pes() on the device agree with the host (they read this module's
//      device state, which is all zeros until nvshmem_bootstrap.cpp's init/attach ran);
//   2. a put-with-signal to the next PE lands in that PE's symmetric buffer;
//   3. the signal is ordered after the data: the receiver never sees the signal with stale data.
//
// Buffer layout (the same symmetric allocation on every PE):
//   [0, 8)                         signal   u64, written remotely by the previous PE (value = round)
//   [64, 64 + 4W)                  receive  W u32 words, written remotely by the previous PE
//   [64 + 4W, 64 + 8W)             staging  W u32 words, written locally, source of our put
// with W = (nbytes - 64) / 8.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "runtime/cuda_check.h"
#include "runtime/nvshmem_bootstrap.h"

namespace moe_ep {
namespace shmem {
namespace {

constexpr int kSelftestThreads = 256;

// Word i of the pattern PE `src_pe` sends in `round`: differs per source PE, round and index, so
// a wrong PE id, stale data from an earlier round or a misplaced word all show up as mismatches.
__device__ __forceinline__ uint32_t pattern_word(int src_pe, uint64_t round, size_t i) {
  uint32_t x = static_cast<uint32_t>(i) * 2654435761u;
  x ^= (static_cast<uint32_t>(src_pe) + 1u) * 0x9E3779B9u;
  x ^= (static_cast<uint32_t>(round) + 1u) * 0x85EBCA6Bu;
  return x;
}

// Acquire load at system scope. The signal is written by another GPU, so GPU scope is not enough:
// only .sys orders our later reads of the receive area after the remote writer's data.
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* ptr) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One block. Roles: every thread fills staging and verifies; the block issues the put together;
// thread 0 waits for the signal.
__global__ void __launch_bounds__(kSelftestThreads)
    nvshmem_selftest_kernel(uint8_t* buf, size_t words, uint64_t round, uint64_t timeout_ns,
                            SelftestResult* result) {
  const int me = nvshmem_my_pe();
  const int npes = nvshmem_n_pes();
  const int next = (me + 1) % npes;
  const int prev = (me + npes - 1) % npes;

  uint64_t* signal = reinterpret_cast<uint64_t*>(buf);
  uint32_t* recv = reinterpret_cast<uint32_t*>(buf + kSelftestHeaderBytes);
  uint32_t* staging = recv + words;

  for (size_t i = threadIdx.x; i < words; i += blockDim.x) staging[i] = pattern_word(me, round, i);
  // The put below is block-collective and reads staging written by all threads: CTA barrier first.
  __syncthreads();

  // Data, then signal: NVSHMEM's put-with-signal guarantees the signal update at `next` becomes
  // visible only after the data is delivered there. Writer: this block; reader: thread 0 of the
  // kernel on `next`, with the acquire below.
  nvshmemx_putmem_signal_block(recv, staging, words * sizeof(uint32_t), signal, round,
                               NVSHMEM_SIGNAL_SET, next);

  __shared__ int timed_out;
  if (threadIdx.x == 0) {
    timed_out = 0;
    const uint64_t start = globaltimer_ns();
    // Our own signal, written by `prev`. The acquire (system scope) pairs with NVSHMEM's ordering
    // of the signal after the data, so once we read `round`, `prev`'s data is visible to us.
    while (ld_acquire_sys(signal) != round) {
      if (globaltimer_ns() - start > timeout_ns) {
        timed_out = 1;
        break;
      }
    }
  }
  // CTA barrier: extends thread 0's acquire to every thread of the block before they read recv.
  __syncthreads();

  unsigned long long wrong = 0;
  for (size_t i = threadIdx.x; i < words; i += blockDim.x) {
    if (recv[i] != pattern_word(prev, round, i)) ++wrong;
  }
  if (wrong != 0) atomicAdd(&result->wrong_words, wrong);
  if (threadIdx.x == 0) {
    result->device_my_pe = me;
    result->device_n_pes = npes;
    result->timed_out = timed_out;
  }
}

}  // namespace

SelftestResult launch_selftest(void* buf, size_t nbytes, uint64_t round, double timeout_s,
                               cudaStream_t stream) {
  MOE_CHECK(nbytes >= kSelftestMinBytes, "selftest buffer must hold at least " +
                                             std::to_string(kSelftestMinBytes) + " bytes");
  MOE_CHECK(timeout_s > 0, "selftest timeout must be positive");
  const size_t words = (nbytes - kSelftestHeaderBytes) / (2 * sizeof(uint32_t));
  const uint64_t timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);

  SelftestResult* d_result = nullptr;
  MOE_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&d_result), sizeof(SelftestResult),
                                 stream));
  MOE_CUDA_CHECK(cudaMemsetAsync(d_result, 0, sizeof(SelftestResult), stream));

  // Clear our signal, then barrier: after it every PE's signal is 0, so no PE's put of this round
  // can be wiped by its target's memset, and a signal equal to `round` can only come from it.
  MOE_CUDA_CHECK(cudaMemsetAsync(buf, 0, kSelftestHeaderBytes, stream));
  nvshmemx_barrier_all_on_stream(stream);

  nvshmem_selftest_kernel<<<1, kSelftestThreads, 0, stream>>>(static_cast<uint8_t*>(buf), words,
                                                              round, timeout_ns, d_result);
  MOE_CUDA_CHECK_LAUNCH();

  // Barrier after: nobody starts the next round (or frees the buffer) while a peer still reads.
  nvshmemx_barrier_all_on_stream(stream);

  SelftestResult result{};
  MOE_CUDA_CHECK(cudaMemcpyAsync(&result, d_result, sizeof(SelftestResult),
                                 cudaMemcpyDeviceToHost, stream));
  MOE_CUDA_CHECK(cudaFreeAsync(d_result, stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return result;
}

}  // namespace shmem
}  // namespace moe_ep
