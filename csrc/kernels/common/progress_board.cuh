// The ordered publisher (torch-free): warps finish their items out of order, one warp publishes them in order.
//
// Items of a stream (a ring's rows, a channel's tokens, a list of chunks) are dealt round robin to the W
// warps that serve it: warp w takes items w, w + W, w + 2W, ... After an item the warp raises its board
// entry `next[stream][w]` to the index of its next item (so every item of w below the entry is done). The
// smallest entry over the W warps is then a count of items that are ALL done: any item i below it belongs to
// some warp whose entry passed i. One warp of the block (the publisher) reads that count and publishes it,
// so a consumer never sees a hole and a producer never reuses a slot still being read, while no copy warp
// ever waits for another or for the publisher's system-scope release.
//
// Memory ordering (all CTA scope, shared memory): a warp's accesses for an item -> __syncwarp -> lane 0's
// st.release.cta of its entry -> the publisher's ld.acquire.cta of the entry -> (a warp barrier, when several
// lanes acquired) -> the publisher's release at system scope (st.release.sys, or fence + NVSHMEM signal).
// Causality order is transitive through these, so a peer that acquires the published counter observes the
// copy warps' slot stores (a tail), or knows their slot loads are done (a head). The publisher needs no
// fence of its own before its release.
//
// Leaving: a warp leaves its loop through leave(): its final entry (the first of its items past the stream's
// end, so the smallest final entry of the stream is its item count), then `left` is raised. A warp that
// gives up (timeout) leaves with -1, which keeps its entry where it was, so nothing it did not finish is ever
// published. The publisher reads `left` BEFORE the entries: once it reads that every warp has left, the
// entries it acquires afterwards are final.
//
// Users: the intranode dispatch / combine senders and the dispatch receivers (publish_in_order below: the
// count of each ring goes to its counter), the intranode combine receiver (its release warp turns the count
// of reduced tokens into the rows of each ring), and the internode combine forwarder and receiver (their
// commit warps, over chunks).
#pragma once

#include <climits>
#include <cstdint>

#include "kernels/common/ptx.cuh"

namespace moe_ep {

// Shared memory of one block: kStreams streams of at most kWarps warps each.
template <int kStreams, int kWarps>
struct ProgressBoard {
  int next[kStreams][kWarps];  // [stream][warp]: the warp's next item; its items below it are done
  int left[kStreams];          // warps of the stream that left their loop (their `next` is final)

  // Every thread of the block, before a __syncthreads: warp w of every stream starts at item w.
  __device__ __forceinline__ void init() {
    for (int i = threadIdx.x; i < kStreams * kWarps; i += blockDim.x) next[i / kWarps][i % kWarps] = i % kWarps;
    if (threadIdx.x < kStreams) left[threadIdx.x] = 0;
  }

  // Whole warp, after its accesses for an item: the warp's next item is `item`.
  __device__ __forceinline__ void advance(int stream, int warp, int item, int lane) {
    __syncwarp();
    if (lane == 0) ptx::st_release_cta(&next[stream][warp], item);
  }

  // Whole warp, leaving its loop: `item` >= 0 is its final entry; -1 (a timeout) keeps the entry.
  __device__ __forceinline__ void leave(int stream, int warp, int item, int lane) {
    __syncwarp();
    if (lane == 0) {
      if (item >= 0) ptx::st_release_cta(&next[stream][warp], item);
      ptx::red_add_release_cta(&left[stream], 1);
    }
  }

  // One thread: warps of `stream` that have left (acquire: read it before the entries).
  __device__ __forceinline__ int left_count(int stream) const { return ptx::ld_acquire_cta(&left[stream]); }

  // One thread: the items of `stream` all done, i.e. the smallest entry of its first `warps` warps.
  __device__ __forceinline__ int lowest(int stream, int warps) const {
    int k = INT_MAX;
    for (int w = 0; w < warps; ++w) k = min(k, ptx::ld_acquire_cta(&next[stream][w]));
    return k;
  }

  // Whole warp (warps <= 32): the same, lane w acquiring warp w's entry; the result in every lane, after a
  // warp barrier that orders every lane's acquire before any lane's later release.
  __device__ __forceinline__ int lowest_in_warp(int stream, int warps, int lane) const {
    int k = lane < warps ? ptx::ld_acquire_cta(&next[stream][lane]) : INT_MAX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) k = min(k, __shfl_xor_sync(0xffffffffu, k, o));
    __syncwarp();
    return k;
  }
};

// The publisher warp of a block whose streams are rings. Lane p < rings owns ring p: `word` is its counter
// (in the peer's buffer), `base` the counter's value at kernel start, `mirror` (or null) a local word that
// gets every published value (relaxed; read by sibling blocks and the next kernel). Ring p is published
// (st.release.sys of base + count) when at least `batch` items are new, or when all its `warps` warps have
// left. Returns, in lane p, the items published: at the end the ring's item count (or, after a timeout, the
// items finished before it). Ends when every ring's warps have left.
template <int kStreams, int kWarps>
__device__ __forceinline__ int publish_in_order(const ProgressBoard<kStreams, kWarps>& b, int rings, int warps,
                                                int batch, uint64_t* word, uint64_t base, uint64_t* mirror,
                                                int lane) {
  int count = 0;
  while (true) {
    bool finished = true, moved = false;
    if (lane < rings) {
      // `left` first: when every warp has left, the entries read after it are final.
      const bool all_left = b.left_count(lane) == warps;
      const int k = b.lowest(lane, warps);
      if (k > count && (all_left || k - count >= batch)) {
        ptx::st_release_sys(word, base + static_cast<uint64_t>(k));
        if (mirror != nullptr) *reinterpret_cast<volatile uint64_t*>(mirror) = base + static_cast<uint64_t>(k);
        count = k;
        moved = true;
      }
      finished = all_left;
    }
    if (__all_sync(0xffffffffu, finished)) break;
    if (!__any_sync(0xffffffffu, moved)) __nanosleep(64);
  }
  return count;
}

}  // namespace moe_ep
