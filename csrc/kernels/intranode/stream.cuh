// The "stream" protocol of the intranode rings (MOE_DISPATCHER_NVL_VARIANT=stream; torch-free). Same rings,
// slots and counters as the chunked protocol of channel.cuh, so calls of either protocol may follow each
// other on one Buffer (a dispatch of one and a combine of the other included).
//
// Chunked (channel.cuh): a group of warps takes `chunk` rows, every warp copies its share, a group barrier,
// then the leader's st.release.sys of the tail; the next chunk starts after that release. Every chunk ends
// with the group idle: waiting for its slowest warp, for the system-scope fence (a round trip over NVLink),
// and for the scan of the next chunk's tokens.
//
// Stream: the W warps that serve one ring take its rows round robin (warp w: rows w, w + W, ...), each at its
// own pace. A sender warp waits (lane 0, ld.acquire.sys of the head, cached) only for the slot of its own next
// row; a receiver warp waits only until the tail passes its own next row. After a row the warp stores the
// index of its next row in a shared board (__syncwarp, then st.release.cta). One more warp per block, the
// publisher, owns the system-scope counters: lane p takes the smallest board entry of ring p -- every row
// below it is done, since a warp raises its entry only after its row -- and stores base + that count to the
// ring's remote counter with st.release.sys (sender block: the tail in the receiver's buffer; receiver block:
// the head in the sender's buffer). Ordering: a warp's slot stores (or loads) -> __syncwarp -> its
// st.release.cta -> the publisher's ld.acquire.cta -> the publisher's st.release.sys; causality order is
// transitive, so a peer that acquires the counter sees the rows (tail) or may overwrite the slots (head).
// Only the publisher pays the system-scope fence, and no copy warp waits for it.
//
// Progress: a sender warp blocked on ring row i needs head > i - slots. Every row below the smallest
// unfinished row is done; the publisher publishes whenever at least `batch` <= slots / 2 rows are new (and
// all of them once the ring's warps have left), the receiver consumes published rows and releases them at
// once (batch 1), so the head always moves up to the smallest blocked row's slot.
#pragma once

#include <climits>
#include <cstdint>

#include "kernels/common/channel.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/intranode/protocol.h"

namespace moe_dispatcher::intranode {

constexpr int kBoardWarps = kWarps;  // copy warps of one ring at most

// Shared by the copy warps and the publisher of one block.
struct StreamBoard {
  int next[kMaxRanks][kBoardWarps];  // [ring][warp]: the warp's next row; its rows below it are done
  int left[kMaxRanks];               // warps of the ring that left their loop (their `next` is final)
};

// Every thread of the block, before a __syncthreads: warp w of every ring starts at row w.
__device__ __forceinline__ void board_init(StreamBoard& b) {
  for (int i = threadIdx.x; i < kMaxRanks * kBoardWarps; i += blockDim.x) {
    b.next[i / kBoardWarps][i % kBoardWarps] = i % kBoardWarps;
  }
  if (threadIdx.x < kMaxRanks) b.left[threadIdx.x] = 0;
}

// Whole copy warp, after the loads/stores of a row: the warp's next row is `next`.
__device__ __forceinline__ void board_advance(StreamBoard& b, int ring, int warp, int next, int lane) {
  __syncwarp();
  if (lane == 0) ptx::st_release_cta(&b.next[ring][warp], next);
}

// Whole copy warp, leaving: `next` >= 0 is its final entry (the first of its rows past the ring's last row,
// so the smallest final entry of the ring is its row count); -1 (a timeout) keeps the entry, so nothing
// the warp did not finish is ever published.
__device__ __forceinline__ void board_leave(StreamBoard& b, int ring, int warp, int next, int lane) {
  __syncwarp();
  if (lane == 0) {
    if (next >= 0) ptx::st_release_cta(&b.next[ring][warp], next);
    ptx::red_add_release_cta(&b.left[ring], 1);
  }
}

// Lane 0 of a sender warp: wait until ring row `row` (counter value) has a free slot, i.e. the receiver
// released row - slots. `seen` caches the last head read (acquired, so older acquires still order this
// warp's later stores after the receiver's loads once the caller's __syncwarp extends them to every lane).
__device__ __forceinline__ bool wait_free_slot(const uint64_t* head, uint64_t& seen, uint64_t row, int slots,
                                               const Watchdog& dog, int phase, int peer) {
  while (row >= seen + static_cast<uint64_t>(slots)) {
    seen = ptx::ld_acquire_sys(head);
    if (row < seen + static_cast<uint64_t>(slots)) break;
    if (dog.expired(phase, peer)) return false;
  }
  return true;
}

// Lane 0 of a receiver warp: wait until the tail passed ring row `row`; `seen` caches the last tail read.
__device__ __forceinline__ bool wait_published(const uint64_t* tail, uint64_t& seen, uint64_t row,
                                               const Watchdog& dog, int phase, int peer) {
  while (row >= seen) {
    seen = ptx::ld_acquire_sys(tail);
    if (row < seen) break;
    if (dog.expired(phase, peer)) return false;
  }
  return true;
}

// Whole warp: lane 0's wait outcome in every lane, then a warp barrier that orders lane 0's acquire
// before every lane's accesses to the slot.
__device__ __forceinline__ bool warp_outcome(bool ok_in_lane0) {
  const int ok = __shfl_sync(0xffffffffu, ok_in_lane0 ? 1 : 0, 0);
  __syncwarp();
  return ok != 0;
}

// The publisher warp. Lane p < rings owns ring p: `word` is its remote counter, `base` the counter's value
// at kernel start, `mirror` (or null) a local word that gets every published value. Ring p is published
// when at least `batch` rows are new, or when all its `warps` copy warps have left. Returns, in lane p, the
// rows published: at the end the ring's row count (or, after a timeout, the rows finished before it).
__device__ __forceinline__ int publish_rings(const StreamBoard& b, int rings, int warps, int batch, uint64_t* word,
                                             uint64_t base, uint64_t* mirror, int lane) {
  int count = 0;
  while (true) {
    bool finished = true, moved = false;
    if (lane < rings) {
      // `left` first: when every warp has left, the entries read after it are final.
      const bool all_left = ptx::ld_acquire_cta(&b.left[lane]) == warps;
      int k = INT_MAX;
      for (int w = 0; w < warps; ++w) k = min(k, ptx::ld_acquire_cta(&b.next[lane][w]));
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

// ------------------------------------------------------------------ bulk-copy (TMA) senders
// MOE_DISPATCHER_NVL_VARIANT=tma: the stream protocol (same board, publisher and receivers), but a sender block
// moves each ring's rows with bulk copies through shared memory instead of warp loads and stores: one warp
// per ring, B = num_bufs slot-sized buffers. Row q: lane 0 bulk-loads the payload (local HBM -> shared,
// mbarrier q % B) and the lanes write the slot's metadata beside it; B - 1 (B - 2 when B >= 4, so that two
// stores read their buffers at once) rows later, once the ring slot is free, lane 0 bulk-stores the whole slot
// (shared -> the receiver's ring over NVLink, one bulk async-group per row). A row is done, and goes on the board, once its group is complete (cp.async.bulk.wait_group: its
// writes are performed and, through the implicit proxy fence of the completion, visible to lane 0, whose
// release then covers them). Per ring up to `lag` loads and kTmaStoresInFlight + 1 stores are in flight,
// with no registers held. A buffer is reloaded once the store that read it has read it (wait_group.read).
// Proxies: the lanes' metadata stores (generic) reach the bulk store (async) through fence.proxy.async on
// shared memory; the receiver's reads of a slot, acquired through the head (generic), come before the bulk
// store that overwrites it through fence.proxy.async on global memory after each head acquire.
// Progress: before waiting for a taken slot, lane 0 completes every earlier store and the warp puts it on the
// board, so every earlier row gets published (the batch is at most half a ring) and the slot is freed.
constexpr int kMaxTmaBuffers = 8;
constexpr int kTmaStoresInFlight = 4;       // stores of a ring not yet known complete, besides the newest
constexpr int kTmaSmemBytes = 200 * 1024;   // dynamic shared memory of a bulk-copy sender block at most

// Buffers per ring for a slot size: 0 when fewer than 2 fit (the launcher then takes the stream protocol).
inline int tma_buffers(int num_ranks, int slot_bytes) {
  const int buf = (slot_bytes + 127) / 128 * 128;
  const int n = kTmaSmemBytes / (num_ranks * buf);
  return n < 2 ? 0 : (n > kMaxTmaBuffers ? kMaxTmaBuffers : n);
}

// Lane 0 of a bulk-copy sender: wait for the load of the row that used buffer `b` for the u-th time (false
// only past the deadline: local loads take microseconds, so that would be a bug, reported as a timeout).
__device__ __forceinline__ bool wait_landed(uint64_t* bars, int b, int u, const Watchdog& dog, int phase, int peer) {
  while (!ptx::mbarrier_try_wait(&bars[b], static_cast<uint32_t>(u & 1))) {
    if (dog.expired(phase, peer)) return false;
  }
  return true;
}

// Whole warp, the only one serving ring `ring` of the board: rows q = 0, 1, ... of the ring until
// source(q, payload, key) returns false. payload: the row's bulk-loaded part (payload_bytes from it; null: a
// row whose slot keeps what it holds), key: passed to meta(key, buf, lane), which writes the rest of the slot
// into the shared buffer. slots: the receiver's ring; head: my head word of it; tail0: its tail at start.
template <typename Source, typename Meta>
__device__ __forceinline__ void tma_send_ring(Source&& source, Meta&& meta, uint8_t* bufs, uint64_t* bars,
                                              int num_bufs, int buf_bytes, int payload_bytes, uint8_t* slots,
                                              int num_slots, int slot_bytes, const uint64_t* head, uint64_t tail0,
                                              StreamBoard& board, int ring, const Watchdog& dog, int phase,
                                              int peer, int lane) {
  // Stores that may read their buffers at once (2 when 4 buffers or more fit), and how many rows after its
  // load a row is stored: when row q is loaded, the store that read its buffer is the oldest of them.
  const int reading = num_bufs >= 4 ? 2 : 1;
  const int lag = num_bufs - reading;
  if (lane == 0) {
    for (int b = 0; b < num_bufs; ++b) ptx::mbarrier_init(&bars[b], 1);
    ptx::fence_mbarrier_init();
  }
  __syncwarp();
  int n = INT_MAX;             // the ring's rows, once source() has said so
  int loaded = 0, landed = 0;  // rows whose load was issued / waited for
  int done = 0;                // rows on the board
  uint64_t head_seen = 0;      // lane 0
  bool ok = true;
  for (int q = 0;; ++q) {
    if (q < n) {  // load row q
      const uint8_t* payload = nullptr;
      int key = 0;
      if (!source(q, payload, key)) {
        n = q;
      } else {
        const int b = q % num_bufs;
        uint8_t* buf = bufs + static_cast<size_t>(b) * buf_bytes;
        if (lane == 0) {
          // The buffer's previous row (q - B) was stored `reading` iterations ago: let that store read it.
          if (reading == 2) {
            ptx::bulk_wait_read<1>();
          } else {
            ptx::bulk_wait_read<0>();
          }
          if (payload != nullptr) {
            ptx::mbarrier_arrive_expect_tx(&bars[b], static_cast<uint32_t>(payload_bytes));
            ptx::bulk_load(buf, payload, static_cast<uint32_t>(payload_bytes), &bars[b]);
          } else {
            ptx::mbarrier_arrive(&bars[b]);
          }
        }
        __syncwarp();  // lane 0's wait for the buffer before the lanes' metadata stores into it
        meta(key, buf, lane);
        ptx::fence_proxy_async_smem();  // this lane's metadata stores before the bulk store reads them
        ++loaded;
      }
    }
    const int s = q - lag;
    if (s >= n) break;
    if (s < 0) continue;
    // Store row s.
    const int b = s % num_bufs;
    const uint64_t row = tail0 + static_cast<uint64_t>(s);
    int good = 1, blocked = 0;
    if (lane == 0) {
      good = wait_landed(bars, b, s / num_bufs, dog, phase, peer);
      if (good && row >= head_seen + static_cast<uint64_t>(num_slots)) {  // the cached head is not enough
        head_seen = ptx::ld_acquire_sys(head);
        ptx::fence_proxy_async_global();
        if (row >= head_seen + static_cast<uint64_t>(num_slots)) {
          ptx::bulk_wait<0>();  // the slot is taken: complete every earlier row, so they all get published
          blocked = 1;
        }
      }
    }
    ++landed;
    if (__shfl_sync(0xffffffffu, blocked, 0)) {
      if (s > done) {
        done = s;
        board_advance(board, ring, 0, done, lane);
      }
      if (lane == 0) {
        good = wait_free_slot(head, head_seen, row, num_slots, dog, phase, peer);
        ptx::fence_proxy_async_global();
      }
    }
    if (!warp_outcome(good)) {
      ok = false;
      break;
    }
    // Every lane's metadata of row s was fenced before the warp barriers above.
    if (lane == 0) {
      ptx::fence_proxy_async_smem();
      ptx::bulk_store(slots + static_cast<size_t>(row % num_slots) * slot_bytes,
                      bufs + static_cast<size_t>(b) * buf_bytes, static_cast<uint32_t>(slot_bytes));
      ptx::bulk_commit();
      ptx::bulk_wait<kTmaStoresInFlight>();  // rows <= s - kTmaStoresInFlight are complete
    }
    if (s - kTmaStoresInFlight + 1 > done) {
      done = s - kTmaStoresInFlight + 1;
      board_advance(board, ring, 0, done, lane);
    }
  }
  if (!ok && lane == 0) {  // timed out: let the loads already issued land (1 ms more) before the block may exit
    Watchdog grace = dog;
    grace.deadline_ns = ptx::globaltimer_ns() + 1000000ull;
    for (int r = landed; r < loaded; ++r) {
      if (!wait_landed(bars, r % num_bufs, r / num_bufs, grace, phase, peer)) break;
    }
  }
  if (lane == 0) ptx::bulk_wait<0>();
  board_leave(board, ring, 0, ok ? n : -1, lane);
}

}  // namespace moe_dispatcher::intranode
