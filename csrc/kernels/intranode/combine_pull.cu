// Pull combine (the combine of a direct dispatch's handle when every rank's combine input lies in its peer pool):
// each rank reduces its OWN tokens, reading each token's rows straight from the holders' inputs over NVLink, in
// place of the holders pushing rows through rings and a receiver reducing them. Blocks 2c and 2c + 1 take channel
// c's tokens (the ring combine's SM count for the same channels), warps interleaved: the W = 2 x (16 or 20) warps
// of the pair take tokens begin + w, begin + w + W, ... For token t and rank d in ascending order, the row is
// row_of_token[t][d] of d's input (the direct dispatch wrote where t landed in d's outputs, which are d's received
// rows); out = cast(bias0 + bias1 + rows of ranks ascending), float32 in that order (as reduce_token.cuh): the
// ring combine's and the reference's bits. Remote reads are latency-bound: see kStagedMaxChannels for the two
// read paths and when each is taken.
//
// Protocol (direct_call.cuh, on Control::pull, phases kPhasePullReady / kPhasePullArrive): my block 0 publishes
// where my input lies (PullInputBlocks: x and top-k weights offsets in my buffer, -1: not peer-mapped) with the
// call's layout word (its ring signature: row bytes, dtype, top-k columns); every block reads every rank's and
// decides. One x offset -1 or one word unlike mine and nobody reads: the call is missed and
// ring_reduce_fallback_kernel (combine.cu), queued next on every rank, moves it, so no rank reads rows of another
// layout. A block arrives at d after its last load of d's input (the system fence: its values were used), so d's
// kernel ends, and d's stream may write its input again, only after every reader is done with it.
// A call that notify refused (common/refused_call.cuh) moves nothing: every block zeroes its share of the outputs
// and returns at its start, touching no word.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/common/launch_check.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/refused_call.cuh"
#include "kernels/common/ring_layout.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/intranode/direct_call.cuh"
#include "kernels/intranode/protocol.h"
#include "kernels/intranode/reduce_token.cuh"

namespace moe_ep::intranode {
namespace {

// Two ways to read the holders' rows, chosen by the channel count (the SMs the call may use), both measured on
// 4 x H200 (BF16 combine, 4096 tokens x 7168, DeepEP's byte formula):
//  - registers (reduce_token.cuh): 20 warps, 8 loads of 16 bytes in flight per lane (4 KB per warp; 96
//    registers). 302 / 383 / 413 / 419 GB/s at 8 / 12 / 16 / 24 SMs: at few SMs the bytes in flight set the rate.
//  - staged (pull_tokens below): 16 warps stream rows through shared memory with cp.async (12 KB per warp in
//    flight, 192 KiB of stages per SM). 348 GB/s at 8 SMs, but ~350 at any count (605 us at 8 to 24 SMs: the
//    device's throughput of cp.async over NVLink, not the SMs, bounds it).
// So the staged reads serve calls of at most kStagedMaxChannels channels (8 SMs), registers the rest.
constexpr int kStagedMaxChannels = 4;
constexpr int kRegisterWarps = 20;
constexpr int kStagedWarps = 16;
__host__ __device__ constexpr int pull_warps(bool staged) { return staged ? kStagedWarps : kRegisterWarps; }
// Each staged warp streams its tokens' rows through kPullStages shared-memory stages (cp.async, 16 bytes per lane
// and vector): a stage holds one chunk of a token, 8 vectors per lane in all (8 / kRanks of each rank's row), so a
// warp keeps up to kPullStages x 4 KB of remote loads in flight without holding them in registers.
constexpr int kPullStages = 3;
constexpr int kPullStageBytes = 8 * 32 * 16;
constexpr size_t kPullSmemBytes = static_cast<size_t>(kStagedWarps) * kPullStages * kPullStageBytes;  // 192 KiB

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Token t's row pointers in the holders' inputs (null: rank d holds no row of t), and its top-k weights'.
// inputs: every rank's published input blocks of this call (shared memory, DirectCallState).
template <int kRanks>
__device__ __forceinline__ void token_sources(const CombinePullArgs& p, const PullInputBlocks* inputs, int t,
                                              int row_bytes, const uint8_t** src, const uint8_t** weights) {
  const CombineArgs& a = p.base;
  const int num_ranks = a.c.num_ranks;
#pragma unroll
  for (int d = 0; d < kRanks; ++d) {
    src[d] = nullptr;
    if (weights != nullptr) weights[d] = nullptr;
    if (d < num_ranks && a.is_token_in_rank[static_cast<int64_t>(t) * num_ranks + d]) {
      const int row = p.row_of_token[static_cast<int64_t>(t) * num_ranks + d];
      if (row >= 0) {
        src[d] = a.c.peers[d] + inputs[d].x_offset + static_cast<int64_t>(row) * row_bytes;
        if (weights != nullptr && a.out_topk_weights != nullptr) {  // every rank passed weights (layout word)
          weights[d] = a.c.peers[d] + inputs[d].w_offset + static_cast<int64_t>(row) * a.num_topk * 4;
        }
      }
    }
  }
}

// Whole warp: the tokens first, first + step, ... below end, reduced as reduce_token does (the same float32 order:
// bias0, bias1, ranks ascending; the ring combine's and the reference's bits), their rows streamed through the
// warp's stages. Work items are (token, chunk) with chunk c covering vectors [c x 32U, (c + 1) x 32U) of the row
// (U = 8 / kRanks); the load cursor runs kPullStages - 1 items ahead of the reduce cursor, one commit group per
// item (empty past the end), so wait_group(kPullStages - 1) leaves exactly the reduce cursor's item complete.
template <typename T, int kRanks>
__device__ void pull_tokens(const CombinePullArgs& p, const PullInputBlocks* inputs, int first, int end, int step,
                            int row_bytes, int lane, uint8_t* stages) {
  constexpr int kU = 8 / kRanks;
  const CombineArgs& a = p.base;
  // At least one chunk per token, also for rows of 0 bytes (its weights are summed after its last chunk).
  const int vecs = row_bytes / 16, chunks = max(1, (vecs + 32 * kU - 1) / (32 * kU));
  int lt = first, lc = 0, rt = first, rc = 0, ls = 0, rs = 0;
  const uint8_t* lsrc[kRanks];
  const uint8_t* rsrc[kRanks];
  if (lt < end) token_sources<kRanks>(p, inputs, lt, row_bytes, lsrc, nullptr);
  auto issue = [&]() {  // the load cursor's item into stage ls, then advance the cursor
    if (lt < end) {
      int4* stage = reinterpret_cast<int4*>(stages + ls * kPullStageBytes);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int v = lc * 32 * kU + u * 32 + lane;
#pragma unroll
        for (int d = 0; d < kRanks; ++d) {
          if (v < vecs && lsrc[d] != nullptr) {
            cp_async_16(stage + (u * kRanks + d) * 32 + lane, reinterpret_cast<const int4*>(lsrc[d]) + v);
          }
        }
      }
      if (++lc == chunks) {
        lc = 0;
        lt += step;
        if (lt < end) token_sources<kRanks>(p, inputs, lt, row_bytes, lsrc, nullptr);
      }
    }
    cp_async_commit();
    ls = ls + 1 == kPullStages ? 0 : ls + 1;
  };
#pragma unroll
  for (int s = 0; s < kPullStages - 1; ++s) issue();
  if (rt < end) token_sources<kRanks>(p, inputs, rt, row_bytes, rsrc, nullptr);
  while (rt < end) {
    issue();  // into the stage reduced last (every lane passed the __syncwarp after reading it)
    cp_async_wait<kPullStages - 1>();
    __syncwarp();  // every lane's copies of this item landed
    const int4* stage = reinterpret_cast<const int4*>(stages + rs * kPullStageBytes);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = rc * 32 * kU + u * 32 + lane;
      if (v >= vecs) break;
      float acc[Vec<T>::kElems];
#pragma unroll
      for (int e = 0; e < Vec<T>::kElems; ++e) acc[e] = 0.f;
      add_biases<T>(acc, a, rt, row_bytes, v);
#pragma unroll
      for (int d = 0; d < kRanks; ++d) {
        if (rsrc[d] != nullptr) {
          Vec<T> r;
          r.raw = stage[(u * kRanks + d) * 32 + lane];
#pragma unroll
          for (int e = 0; e < Vec<T>::kElems; ++e) acc[e] += to_float(r.elems[e]);
        }
      }
      Vec<T> out;
#pragma unroll
      for (int e = 0; e < Vec<T>::kElems; ++e) out.elems[e] = from_float<T>(acc[e]);
      reinterpret_cast<int4*>(a.out + rt * static_cast<int64_t>(row_bytes))[v] = out.raw;
    }
    __syncwarp();  // every lane is done with the stage before it is refilled
    rs = rs + 1 == kPullStages ? 0 : rs + 1;
    if (++rc == chunks) {
      if (a.out_topk_weights != nullptr) {
        const uint8_t* weights[kRanks];
        token_sources<kRanks>(p, inputs, rt, row_bytes, rsrc, weights);
        if (lane < a.num_topk) {
          float wsum = 0.f;
#pragma unroll
          for (int d = 0; d < kRanks; ++d) {
            if (weights[d] != nullptr) wsum += __int_as_float(ptx::ld_cg(reinterpret_cast<const int*>(weights[d]) + lane));
          }
          a.out_topk_weights[static_cast<int64_t>(rt) * a.num_topk + lane] = wsum;
        }
      }
      rc = 0;
      rt += step;
      if (rt < end) token_sources<kRanks>(p, inputs, rt, row_bytes, rsrc, nullptr);
    }
  }
  cp_async_wait<0>();  // the empty groups past the end
}

template <typename T, int kRanks, bool kStaged>
__global__ void __launch_bounds__(pull_warps(kStaged) * 32, 1) combine_pull_kernel(CombinePullArgs p) {
  constexpr int kPullWarps = pull_warps(kStaged);
  extern __shared__ __align__(16) uint8_t pull_stages[];
  __shared__ DirectCallState<PullInputBlocks> call;
  const CombineArgs& a = p.base;
  const int me = a.c.rank, c = blockIdx.x >> 1, half = blockIdx.x & 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row_bytes = a.hidden * static_cast<int>(sizeof(T));
  auto* ctl = reinterpret_cast<Control*>(a.c.peers[me]);
  int begin, end;
  channel_range(a.num_tokens, a.num_channels, c, begin, end);
  if (call_refused(a.recv_channel_offset)) {  // the same word in every block of every rank
    const int mid = begin + (end - begin) / 2;
    zero_refused_outputs(a.out, a.out_topk_weights, half ? mid : begin, half ? end : mid, row_bytes, a.num_topk);
    return;
  }
  const Watchdog dog = make_watchdog(a.c.timeout_ns, me, &ctl->timeout_claim, &a.c.mailbox->timeout,
                                     ctl->peer_aborted);
  const DirectCallSite<PullInputBlocks> site{&Control::pull, kPhasePullReady, kPhasePullArrive};
  const PullInputBlocks mine{p.x_offset, p.w_offset};
  const auto accepts = [](const PullInputBlocks& in) { return in.x_offset >= 0; };
  if (!begin_direct_call(call, a.c, site, mine, a.ring_signature, dog, accepts)) return;

  // My tokens, from every holder's input.
  if (call.in_pool) {
    if constexpr (kStaged) {
      pull_tokens<T, kRanks>(p, call.blocks, begin + half * kPullWarps + warp, end, 2 * kPullWarps, row_bytes, lane,
                             pull_stages + static_cast<size_t>(warp) * kPullStages * kPullStageBytes);
    } else {
      for (int t = begin + half * kPullWarps + warp; t < end; t += 2 * kPullWarps) {
        const uint8_t* src[kRanks];
        const uint8_t* weights[kRanks];
        token_sources<kRanks>(p, call.blocks, t, row_bytes, src, weights);
        reduce_token<T, kRanks>(a, t, src, weights, row_bytes, lane);
      }
    }
  }
  end_direct_call(call, a.c, site, dog);
}

template <typename T, int kRanks>
void launch_ranks(const CombinePullArgs& args, dim3 grid, cudaStream_t stream) {
  if (args.base.num_channels > kStagedMaxChannels) {
    combine_pull_kernel<T, kRanks, false><<<grid, pull_warps(false) * 32, 0, stream>>>(args);
    return;
  }
  // The stages exceed the 48 KiB a kernel gets without opting in: once per device (a bit per device here).
  static std::atomic<uint64_t> opted_in{0};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) {
    throw std::runtime_error("moe_dispatcher: combine_pull_kernel: no current CUDA device");
  }
  if (!((opted_in.load(std::memory_order_relaxed) >> device) & 1u)) {
    const cudaError_t err = cudaFuncSetAttribute(combine_pull_kernel<T, kRanks, true>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(kPullSmemBytes));
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("moe_dispatcher: combine_pull_kernel's shared memory opt-in failed: ") +
                               cudaGetErrorString(err));
    }
    opted_in.fetch_or(uint64_t{1} << device, std::memory_order_relaxed);
  }
  combine_pull_kernel<T, kRanks, true><<<grid, pull_warps(true) * 32, kPullSmemBytes, stream>>>(args);
}

template <typename T>
void launch_typed(const CombinePullArgs& args, dim3 grid, cudaStream_t stream) {
  if (args.base.c.num_ranks <= 2) {
    launch_ranks<T, 2>(args, grid, stream);
  } else if (args.base.c.num_ranks <= 4) {
    launch_ranks<T, 4>(args, grid, stream);
  } else {
    launch_ranks<T, 8>(args, grid, stream);
  }
}

}  // namespace

void launch_combine_pull(const CombinePullArgs& args, cudaStream_t stream) {
  const dim3 grid(2 * args.base.num_channels);
  switch (args.base.dtype) {
    case kBf16: launch_typed<__nv_bfloat16>(args, grid, stream); break;
    case kFp16: launch_typed<__half>(args, grid, stream); break;
    default: launch_typed<float>(args, grid, stream); break;
  }
  check_launch("combine_pull_kernel");
}

}  // namespace moe_ep::intranode
