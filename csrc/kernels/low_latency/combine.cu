// Low-latency combine: the kernel (send phase, receive phase, or both in one launch) and its
// launcher. The phases live in combine_send.cuh and combine_recv.cuh. As for dispatch, the grid never
// exceeds the SM count so that a fused launch's blocks are all resident.
#include "kernels/low_latency/combine_recv.cuh"
#include "kernels/low_latency/combine_send.cuh"
#include "runtime/cuda_check.h"

namespace moe_dispatcher::low_latency {
namespace {

__global__ void __launch_bounds__(kThreads, 1)
    low_latency_combine_kernel(Common c, CombineArgs a, int phases, int send_parts, int bulk_stages) {
  extern __shared__ __align__(128) uint8_t smem[];
  if (phases & kPhaseSend) trace_begin(c, kTraceCEntry);
  const HalfLayout lay = half_layout(c.max_tokens, c.hidden, c.num_ranks, c.num_experts);
  if (phases & kPhaseSend) {
    combine_send_phase(c, a, lay, send_parts, smem, bulk_stages);
    trace_block_event(c, kTraceCFlagsUp);
  }
  if (phases & kPhaseRecv) {
    trace_event(c, kTraceCRecvEntry);
    combine_recv_phase(c, a, lay);
    trace_block_event(c, kTraceCReduceDone);
    trace_event(c, kTraceCExit);
  }
}

}  // namespace

void launch_combine(const Common& c, const CombineArgs& a, int phases, cudaStream_t stream) {
  MOE_CHECK(phases >= 1 && phases <= 3, "low_latency combine: bad phases");
  const int pairs = c.num_experts;  // L * R
  const int parts = c.num_blocks > pairs ? c.num_blocks / pairs : 1;
  // kVariantCombineBulk: row buffers in dynamic shared memory, above the 48 KB default (opted in once
  // per device for the largest size asked so far).
  int stages = 0;
  size_t smem = 0;
  if ((c.variant & kVariantCombineBulk) && (phases & kPhaseSend)) {
    const size_t row_bytes = static_cast<size_t>(c.hidden) * 2;
    stages = static_cast<int>(kBulkRowBytes / row_bytes);
    if (stages > kBulkStages) stages = kBulkStages;
    smem = kBulkBarBytes + stages * row_bytes;
    static size_t opted_in[64] = {};
    int device = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    if (device < 64 && smem > opted_in[device]) {
      MOE_CUDA_CHECK(cudaFuncSetAttribute(low_latency_combine_kernel,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
      opted_in[device] = smem;
    }
  }
  low_latency_combine_kernel<<<c.num_blocks, kThreads, smem, stream>>>(c, a, phases, parts, stages);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe_dispatcher::low_latency
