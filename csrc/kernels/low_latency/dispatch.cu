// Low-latency dispatch: the kernel (send phase, receive phase, or both in one launch) and its
// launcher. The phases live in dispatch_send.cuh / dispatch_recv.cuh (per-expert messages) and
// dispatch_dedup_send.cuh / dispatch_dedup_recv.cuh (Common::dedup_dispatch: one message per rank).
//
// In the fused launch every block first sends its tokens, then receives. The receive phase of a
// block can wait on sends of other blocks of this grid, so the grid never exceeds the SM count
// (one block of kThreads per SM: all blocks are resident together).
#include "kernels/low_latency/dispatch_dedup_recv.cuh"
#include "kernels/low_latency/dispatch_dedup_send.cuh"
#include "kernels/low_latency/dispatch_recv.cuh"
#include "kernels/low_latency/dispatch_send.cuh"
#include "runtime/cuda_check.h"

namespace moe_ep::low_latency {

__global__ void __launch_bounds__(kThreads, 1)
    dispatch_kernel(Common c, DispatchArgs a, int phases, int recv_parts) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (phases & kPhaseSend) trace_begin(c, kTraceDEntry);
  const HalfLayout lay = half_layout(c.max_tokens, c.hidden, c.num_ranks, c.num_experts);
  const bool dedup = c.dedup_dispatch;
  if (phases & kPhaseSend) {
    if (dedup) {
      dispatch_dedup_send_phase(c, a, lay, smem);
    } else {
      dispatch_send_phase(c, a, lay, smem);
    }
  }
  if (phases & kPhaseRecv) {
    trace_event(c, kTraceDRecvEntry);
    if (dedup) {
      dispatch_dedup_recv_phase(c, a, lay);
    } else {
      dispatch_recv_phase(c, a, lay, recv_parts);
    }
    trace_event(c, kTraceDExit);
  }
}


void launch_dispatch(const Common& c, const DispatchArgs& a, int phases, cudaStream_t stream) {
  MOE_CHECK(phases >= 1 && phases <= 3, "low_latency dispatch: bad phases");
  const bool dedup = c.dedup_dispatch;
  // The dedup staging fits the receive region only with two local experts or more (low_latency.h).
  MOE_CHECK(!dedup || c.num_experts / c.num_ranks >= 2,
            "low_latency dispatch: the dedup kernels need at least two experts per rank");
  const int pairs = c.num_experts;  // L * R
  const int parts = c.num_blocks > pairs ? c.num_blocks / pairs : 1;
  size_t smem = 0;
  if (phases & kPhaseSend) {
    const size_t shared = dedup ? sizeof(DedupSendShared) : sizeof(DispatchSendShared);
    smem = (shared + 15) / 16 * 16 + message_used_bytes(c.hidden, a.fp8);
  }
  // Static (the receive phases', ~6 KB) + dynamic shared memory stay under the 48 KB default limit:
  // the largest dynamic part is a kMaxHidden BF16 message + the dedup counters, ~38 KB.
  dispatch_kernel<<<c.num_blocks, kThreads, smem, stream>>>(c, a, phases, parts);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe_ep::low_latency
