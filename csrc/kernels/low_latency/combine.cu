// Low-latency combine: the kernel (send phase, receive phase, or both in one launch) and its
// launcher. The phases live in combine_send.cuh / combine_recv.cuh (every (token, expert) row goes
// back) and combine_rank_send.cuh / combine_rank_recv.cuh (Common::per_rank_combine: a partial sum per
// (token, rank)). As for dispatch, the grid never exceeds the SM count so that a fused launch's
// blocks are all resident.
#include "kernels/low_latency/combine_rank_recv.cuh"
#include "kernels/low_latency/combine_rank_send.cuh"
#include "kernels/low_latency/combine_recv.cuh"
#include "kernels/low_latency/combine_send.cuh"
#include "runtime/cuda_check.h"

namespace moe_ep::low_latency {

__global__ void __launch_bounds__(kThreads, 1)
    combine_kernel(Common c, CombineArgs a, int phases, int send_parts) {
  if (phases & kPhaseSend) trace_begin(c, kTraceCEntry);
  const HalfLayout lay = half_layout(c.max_tokens, c.hidden, c.num_ranks, c.num_experts);
  const bool per_rank = c.per_rank_combine;
  if (phases & kPhaseSend) {
    if (per_rank) {
      combine_rank_send_phase(c, a, lay);
    } else {
      combine_send_phase(c, a, lay, send_parts);
    }
    trace_block_event(c, kTraceCFlagsUp);
  }
  if (phases & kPhaseRecv) {
    trace_event(c, kTraceCRecvEntry);
    if (per_rank) {
      combine_rank_recv_phase(c, a, lay);
    } else {
      combine_recv_phase(c, a, lay);
    }
    trace_block_event(c, kTraceCReduceDone);
    trace_event(c, kTraceCExit);
  }
}


void launch_combine(const Common& c, const CombineArgs& a, int phases, cudaStream_t stream) {
  MOE_CHECK(phases >= 1 && phases <= 3, "low_latency combine: bad phases");
  const bool per_rank = c.per_rank_combine;
  // The per-rank kernels compute the rank-partial order and lays its rows out [R][maxT] (L >= 2).
  MOE_CHECK(!per_rank || (a.rank_partials && c.num_experts / c.num_ranks >= 2 && a.row_of != nullptr),
            "low_latency combine: the per-rank kernels need rank_partials, two experts per rank and row_of");
  const int pairs = c.num_experts;  // L * R
  const int parts = c.num_blocks > pairs ? c.num_blocks / pairs : 1;
  combine_kernel<<<c.num_blocks, kThreads, 0, stream>>>(c, a, phases, parts);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe_ep::low_latency
