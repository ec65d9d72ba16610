// Internode combine: the reverse of dispatch, three blocks per channel c, all resident:
//   block 3c   NVLink sender: warp group l returns to local rank l (the forwarder of every source
//              (x, l)) the rows this rank received in channel c from sources (x, l), x ascending,
//              each source's rows in token order, through FIFO (c, me -> l). Slot: row | top-k weights.
//   block 3c+1 forwarder: for source domain x ascending, the tokens it forwarded in dispatch (their
//              local-rank masks are fwd_mask): sums each token's rows over local ranks ascending in
//              float32, rounds to the row dtype (the partial that travels) and puts it into ring
//              (c, my domain) of the source (x, my local index); for my own domain directly into my
//              own ring.
//   block 3c+2 source receiver: for its channel's tokens, waits for the partial of each domain the
//              token went to and writes out = cast(bias0 + bias1 + sum over domains ascending of
//              partial), float32, and the top-k weights summed the same way (pull mode: with block 3c
//              as a second receiver block where it has nothing to put, "Pull mode" below).
// Order of the sum: ((bias0 + bias1) + partial_0 + partial_1 ...) with partial_x =
// round(sum over x's ranks ascending): equal to the reference (ranks ascending) when each token has
// at most one contributing rank per domain, else within the rounding of the partials.
//
// The forwarder and the source receiver work in small per-warp chunks (docs/internode.md):
//   worker warps (0 .. kWorkers-1) take chunks k = warp, warp + kWorkers, ... of chunk_tokens tokens
//     each (pull mode's source receiver with a second block: 2 x kWorkers workers, "Pull mode" below); a
//     worker waits only for its own chunk's rows (lane j polls tail j), reduces its tokens, and (forwarder,
//     FIFO mode) moves its chunk's partials to the source at once (rdma_put_rows: a copy through the mapped
//     pointer + fence, or put + quiet; in pull mode it writes them straight into a mapped source's ring, and
//     block 3c's put warps move the chunks of unmapped ones: "Pull mode" below);
//     then it raises its entry of the block's ChunkBoard to its next chunk (progress_board.cuh);
//   the commit warp (kCommitWarp) publishes in order: once chunks [kc, upto) are all done it
//     advances the FIFO heads (forwarder) / RDMA credits (receiver) and the RDMA tails (forwarder)
//     past them, so a consumer never sees a hole and a producer never reuses a slot still read.
// Nothing waits for a whole batch: the NVLink rows of chunk k+1 arrive while chunk k is reduced,
// the put of one warp overlaps the reduction of the others, and a source reduces each chunk as
// soon as every domain's partials of that chunk are published.
//
// Where a row sits in a ring is computed, not communicated: each warp keeps a running count of the
// rows every ring carried before its position in the token sequence (lane b counts ring b; rings
// b >= 32 in a second register) by scanning the masks of the tokens it skips; the commit warp keeps
// the same count for what it committed.
//
// Memory ordering (a CTA-scope release/acquire on the board entries carries each worker's accesses
// to the commit warp, which publishes them at system scope):
//   worker:  lane j ld.acquire.sys its tail (FIFO or RDMA) >= what the chunk needs; __syncwarp;
//            every lane loads the slots (ld.cg) and writes the outputs / staging / own-ring slots;
//            remote (FIFO mode), rdma_put_rows: where the source's buffer is mapped (nvshmem_ptr), a copy through
//            the mapped pointer (kPutUnroll loads in flight per lane) and a per-lane fence.acq_rel.sys; else
//            nvshmemx_putmem_nbi_warp + nvshmem_quiet; __syncwarp; lane 0: st.release.cta of its board entry.
//            (Pull mode, mapped source: the reduction's stores go through the mapped pointer into the source's
//            slots, then every lane's fence.acq_rel.sys and __syncwarp (rdma_mapped_stores_done), then the board
//            entry, and the same commit chain publishes the tail; unmapped source: put_worker / put_staged.)
//   commit:  lane w ld.acquire.cta of worker w's entry; __syncwarp; then the publishing lanes: FIFO head
//            st.release.sys, RDMA tail rdma_signal_tail (fence.sys + signal SET, or st.release.sys
//            for my own domain), credit rdma_credit (same). Causality order runs from every lane's
//            loads / stores / fenced remote stores / completed puts through the warp barrier, the CTA
//            release/acquire pair
//            and the commit warp's warp barrier to the system-scope release, so a peer that
//            acquires the published counter sees the data, and a producer that acquires a head
//            overwrites only slots whose loads are done.
//   credits: a forwarder worker writes staging / own-ring / (pull mode) mapped source-ring slots only after
//            acquiring the head (lane 31, ld.acquire.sys, then __all_sync / __syncwarp before any lane's store)
//            that covers them; staging slot i was last read by a copy (or put)
//            that was done (its loads returned; fence / quiet) before its tail, hence before the credit, was
//            published.
// Progress (no cycle): FIFO: slots >= nvl_chunk + chunk_tokens, so the oldest unfinished chunk's
// rows always fit behind the committed head; RDMA: slots >= 2 x chunk_tokens, so the forwarder
// chunk that holds the last partial of the receiver's oldest unfinished chunk always has credit.
// Forwarders serve source domains ascending and receivers tokens ascending, so the oldest blocked
// item can always be traced to a smaller source domain, which ends (docs/internode.md).
// A call that notify refused (common/refused_call.cuh) moves nothing: every block returns before the drain and
// the grid barrier (all blocks alike), after the source receivers wrote zero rows (and weights) for their
// channel's tokens.
// Ring signatures (common/ring_signature.cuh), one per hop: right after the drain each NVLink sender group stores
// nvl_signature into its forwarder's Control (before its first FIFO tail release there) and the forwarder block
// puts rdma_signature into each source's RdmaControl (completed before its first tail signal there). A forwarder
// worker lane j, at its first rows of FIFO j in the call, compares j's word; a source receiver lane x, at its
// first partials of domain x, compares x's word. A source whose word differs is left out of the sums (its slots
// are not read), but its rows are still waited for and credited, so every rank finishes the call.
//
// Pull mode (along the handle of a Buffer with a peer pool: pull_call = 1). The combine input x (and topk_weights)
// of every rank may be a block of its peer pool, which its domain peers map. The kernel runs intranode's
// direct-call protocol (intranode/direct_call.cuh) over the domain, on Control::pull of the NVLink buffer (indexed
// by local rank; nothing else uses those words here), phases kPhaseNvlPullReady / kPhaseNvlPullArrive:
//   ready + verdict, before the drain: block 0 publishes where my x / topk_weights lie in my buffer (-1: not
//     peer-mapped) with the layout word nvl_signature (row bytes, dtype, top-k columns); every block acquires every
//     domain peer's and decides: pull when every peer's x is peer-mapped and every word equals mine. Every rank of
//     the domain reads the same words, so the domain agrees; other domains need not (the RDMA traffic is the same
//     in both modes: the same partials, bit for bit).
//   pull: no FIFO is touched. The forwarder serves only the remote source domains (my own domain's ring stays
//     unused): for forwarded token idx and local rank j ascending in its mask it reads row fwd_rows[idx][j] of j's x
//     in place (the dispatch recorded where the token landed at j), reduces as in FIFO mode (the same rows in the
//     same order: the same partial); no FIFO wait, no head release (the inputs were complete when the verdict
//     acquired every peer's ready word). Where the source's RDMA buffer is mapped (rdma_peer_base not null: P2P,
//     as the dispatch RDMA sender writes its rows) the partials (and summed weights) go straight into the source's
//     ring slots through the mapped pointer, each lane's fence.acq_rel.sys and a warp barrier before the board
//     entry, and the forwarder's commit warp publishes the tails in order (forward_commit<kPullDirect>): one write
//     of each partial instead of a staging write, a staging read and a remote write by another block, and no
//     cross-block hand-off on the chunk's path. Where it is not mapped (a NIC), the partials go into the staging
//     slots and block 3c, whose NVL sender has nothing to send, puts them (put_staged): the forwarder's commit warp
//     publishes how many chunks are staged (RdmaControl::staged[c], st.release.sys), block 3c's worker warps move
//     each (rdma_put_rows) once they acquired it, and its commit warp publishes those domains' RDMA tails in order
//     (forward_commit<kPullPut>); each domain's tail has one publisher. The source receiver
//     waits for and credits only the remote domains' partials; my own domain's rows it reads in place, at
//     fwd_rows[fwd_offset[my domain][c] + k][j] for the k-th token of the channel that went to my domain, writes
//     their round(sum over j ascending) (the partial my own ring carried in FIFO mode) into the token's output row
//     for each token of a chunk BEFORE it waits for the chunk's remote partials (these reads depend on no counter,
//     so they overlap the wait), and reads it back (the same lanes) at my domain's place in out = cast(b0 + b1 +
//     sum over domains ascending of partial_x): the same bits. (A separate register-held own partial spilled: this
//     costs a local row write and read per token instead.) In both roles lane j loads fwd_rows[.][j] once per token
//     and writes its source entry itself (pull_sources).
//   second source receiver (pull mode, a channel with no chunk to put: every remote source domain with forwarded
//     tokens in it is mapped, pull_channel_puts, decided alike by the channel's three blocks from the same fwd_offset
//     and nvshmem_ptr): block 3c, which has neither rows to send nor chunks to put, takes half of the channel's
//     source receiver chunks. The receiver's chunks go to 30 workers, block 3c+2's warps 0-14 (workers 0-14) and
//     block 3c's warps 0-14 (workers 15-29), chunk k to worker k mod 30; each worker's work follows from the chunk
//     alone (its tokens; ring indices and my domain's forwarded indices from the worker's own scan of the tokens
//     before it), so the sums, and the bits, are the same whoever computes them. Block 3c+2's commit warp credits
//     in order over the 30 entries: lane w < 15 its board (cta acquire), lane 15 + w block 3c's worker w's word
//     RdmaControl::recv_next[c][w] (written st.release.gpu after the chunk's loads; read ld.relaxed.gpu while it
//     polls, then one ld.acquire.gpu), then the warp barrier and the credit's system-scope release: a causality
//     chain from block 3c's slot loads to the forwarder's acquire of the credit. Stop: a worker of either block
//     that gives up also sets RdmaControl::recv_stop[c]; block 3c+2's commit warp (when idle) and block 3c's spare
//     warp 15 (until its workers left) turn it into their block's shared stop flag, on which every wait of the block
//     gives up. recv_next / recv_stop are reset by block 3c before the grid barrier. Why: the source receiver's
//     chain per token (fwd_rows, the own-domain rows over NVLink into out, the tail wait, the remote partials and the
//     read-back of out, the top-k weights) made it the slowest stage with 15 workers a channel, the forwarder ahead.
//   missed (some peer's input not in its pool, a layout word that differs, a CUDA graph capture): this kernel as
//     described above, unchanged.
//   arrival + completion, at the end of every block (either mode): arrive at every domain peer after a system
//     fence and a block barrier (its reads of their x are done), and block 0 waits for every peer's 3C arrivals, so
//     no later work of my stream overwrites my x while a peer still reads it; a missed call counts in
//     pull.missed_total (IpcBuffer.path_counters()).
// Compiled per launch mode (kPullCall = pull_call, picked by launch_combine): a launch without a pool handle runs a
// kernel with the FIFO path alone (no protocol, no pull-mode code); a pool handle's kernel holds both modes, each
// its own instantiation of the forwarder and receiver roles (kPull), and decides per call. The workers' source
// tables are the kernel's, one per block whatever its role.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/common/vec.cuh"
#include "kernels/common/copy.cuh"
#include "kernels/common/launch_check.cuh"
#include "kernels/common/progress_board.cuh"
#include "kernels/common/refused_call.cuh"
#include "kernels/common/ring_layout.cuh"
#include "kernels/internode/common.cuh"
#include "kernels/internode/domain_call.cuh"

namespace moe_ep::internode {
namespace {

using nvlink::PullInputBlocks;
using PullCall = intranode::DirectCallState<PullInputBlocks>;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// ------------------------------------------------------------------ NVLink sender (rows back to forwarders)
__device__ void nvl_send(const CombineArgs& a, int ch, int l, int group_warp, int warps, int lane, int* shared_ok,
                         const Watchdog& dog, int row_bytes) {
  const Common& c = a.c;
  const int nvl = c.nvl_size, C = a.num_channels;
  nvlink::Control* nctl = nvl_ctl(c, c.local);
  ChannelSender tx{nvl_ring(c, c.nvl[l], c.local, ch, a.nvl_slots, a.nvl_slot_bytes), &nvl_ctl(c, l)->fifo_tail[ch][c.local],
                   &nctl->fifo_head[ch][l], &nctl->tail_copy[ch][l], a.nvl_slots, a.nvl_slot_bytes,
                   *reinterpret_cast<volatile uint64_t*>(&nctl->tail_copy[ch][l])};
  const int bar = 1 + l, threads = warps * 32;
  const bool leader = group_warp == 0 && lane == 0;
  // The ring signature before the leader's first tail release to l (tx.advance), in program order.
  if (leader) publish_ring_signature(nvl_ctl(c, l), c.local, a.nvl_signature);
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

// ------------------------------------------------------------------ worker / commit warps, row reduction
constexpr int kWorkers = kWarps - 1;
constexpr int kCommitWarp = kWarps - 1;
constexpr int kLoadUnroll = 4;  // 16-byte vectors per lane per source in flight
constexpr int kLoadGroup = 2;   // sources whose vectors are loaded together (8 loads per lane in flight)
constexpr int kWeightLoads = 2;  // sources whose top-k weights reduce_row loads before their rows
constexpr int kPutUnroll = 8;   // rdma_put_rows through a mapped pointer: 16-byte loads per lane in flight


// One warp: out = cast(bias0 + bias1 + srcs[0] + srcs[1] + ...) in float32, in that order, and the
// top-k weights after each source row summed likewise into out_w (if non-null; from wsrcs[i] when wsrcs is
// non-null, else from the slot layout: srcs[i] + row_bytes). kLoadGroup sources x kLoadUnroll vectors per lane are
// loaded before any of them is added, so a lane keeps 8 loads in flight instead of nsrc.
template <typename T>
__device__ __forceinline__ void reduce_row(uint8_t* out, float* out_w, const uint8_t* const* srcs, int nsrc,
                                           const uint8_t* bias0, const uint8_t* bias1, int row_bytes, int num_topk,
                                           int lane, const uint8_t* const* wsrcs = nullptr) {
  constexpr int E = Vec<T>::kElems;
  const int vecs = row_bytes / 16;
  // The first kWeightLoads sources' top-k weights are loaded before the rows and summed after them: their round
  // trip overlaps the rows' instead of following it (the sum's order, and so its bits, are unchanged).
  const bool weights = out_w != nullptr && lane < num_topk;
  float wv[kWeightLoads];
#pragma unroll
  for (int g = 0; g < kWeightLoads; ++g) {
    wv[g] = 0.f;
    if (weights && g < nsrc) {
      const uint8_t* ws = wsrcs != nullptr ? wsrcs[g] : srcs[g] + row_bytes;
      wv[g] = __int_as_float(ptx::ld_cg(reinterpret_cast<const int*>(ws) + lane));
    }
  }
  for (int v0 = lane; v0 < vecs; v0 += 32 * kLoadUnroll) {
    float acc[kLoadUnroll][E];
#pragma unroll
    for (int u = 0; u < kLoadUnroll; ++u) {
      const int v = v0 + u * 32;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[u][e] = 0.f;
      if (v < vecs && bias0 != nullptr) {
        Vec<T> b;
        b.raw = ptx::ld_nc_v4(reinterpret_cast<const int4*>(bias0) + v);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[u][e] += to_float(b.elems[e]);
      }
      if (v < vecs && bias1 != nullptr) {
        Vec<T> b;
        b.raw = ptx::ld_nc_v4(reinterpret_cast<const int4*>(bias1) + v);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[u][e] += to_float(b.elems[e]);
      }
    }
    for (int s0 = 0; s0 < nsrc; s0 += kLoadGroup) {
      Vec<T> rows[kLoadGroup][kLoadUnroll];
#pragma unroll
      for (int g = 0; g < kLoadGroup; ++g) {
#pragma unroll
        for (int u = 0; u < kLoadUnroll; ++u) {
          const int v = v0 + u * 32;
          if (s0 + g < nsrc && v < vecs) rows[g][u].raw = ptx::ld_cg_v4(reinterpret_cast<const int4*>(srcs[s0 + g]) + v);
        }
      }
#pragma unroll
      for (int g = 0; g < kLoadGroup; ++g) {
#pragma unroll
        for (int u = 0; u < kLoadUnroll; ++u) {
          if (s0 + g < nsrc && v0 + u * 32 < vecs) {
#pragma unroll
            for (int e = 0; e < E; ++e) acc[u][e] += to_float(rows[g][u].elems[e]);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kLoadUnroll; ++u) {
      const int v = v0 + u * 32;
      if (v < vecs) {
        Vec<T> o;
#pragma unroll
        for (int e = 0; e < E; ++e) o.elems[e] = from_float<T>(acc[u][e]);
        reinterpret_cast<int4*>(out)[v] = o.raw;
      }
    }
  }
  if (weights) {
    float w = 0.f;
#pragma unroll
    for (int g = 0; g < kWeightLoads; ++g) {
      if (g < nsrc) w += wv[g];
    }
    for (int i = kWeightLoads; i < nsrc; ++i) {
      const uint8_t* ws = wsrcs != nullptr ? wsrcs[i] : srcs[i] + row_bytes;
      w += __int_as_float(ptx::ld_cg(reinterpret_cast<const int*>(ws) + lane));
    }
    out_w[lane] = w;
  }
}

// Warp: add to lane b's count (b < 32: lo, else hi, lane b - 32) the lanes whose `bits` has bit b,
// for b < nbits. Lanes with no token pass bits = 0.
__device__ __forceinline__ void count_bits(uint64_t bits, int nbits, int lane, uint32_t& lo, uint32_t& hi) {
  for (int b = 0; b < nbits; ++b) {
    const int n = __popc(__ballot_sync(0xffffffffu, (bits >> b) & 1u));
    if (lane == (b & 31)) {
      if (b < 32) lo += n;
      else hi += n;
    }
  }
}

// Warp, uniform b: the count of ring b held by lane b & 31.
__device__ __forceinline__ uint32_t count_of(uint32_t lo, uint32_t hi, int b) {
  return __shfl_sync(0xffffffffu, b < 32 ? lo : hi, b & 31);
}

// Commit warp, nothing new to publish: false (in every lane: lane 0 decides) when the block must stop
// (a worker gave up, or, as a backstop that should never fire, a second past the deadline).
__device__ __forceinline__ bool commit_idle_ok(const Watchdog& dog, int phase, int rank, const volatile int* stop,
                                               int lane) {
  int ok = 1;
  if (lane == 0) {
    ok = !*stop && !(ptx::globaltimer_ns() > dog.deadline_ns() + 1000000000ull && dog.expired(phase, rank));
  }
  return __shfl_sync(0xffffffffu, ok, 0) != 0;
}

// The worker warps' progress (progress_board.cuh): one stream, the block's chunks; worker w takes chunks
// w, w + kWorkers, ... and its entry is its next chunk.
using ChunkBoard = ProgressBoard<1, kWorkers>;

// Commit warp: the chunks below the returned one are all done (every lane gets the answer after a warp
// barrier that orders the lanes' acquires of the board before the lanes' releases).
__device__ __forceinline__ int done_upto(const ChunkBoard& board, int total, int lane) {
  return min(board.lowest_in_warp(0, kWorkers, lane), total);
}

// A worker warp's sources of the row it reduces (the forwarder's up to kMaxNvl, the source receiver's up to
// kMaxDomains): one table per block, declared in the kernel (a block has one role), row w for worker w.
using WorkerSources = const uint8_t* [kWorkers][kMaxDomains];
static_assert(kMaxNvl <= kMaxDomains, "a receiver's own domain (pull mode) has up to kMaxNvl sources");
static_assert(kWorkers <= kMaxCombineHelpers && 2 * kWorkers <= 32,
              "RdmaControl::recv_next holds block 3c's receiver workers; block 3c+2's commit warp reads 2 x kWorkers "
              "entries, one per lane");

// Pull mode, warp: the sources read in place for one row, local ranks j ascending. Lane j passes `row`, the row of
// j's x it reads (fwd_rows; -1: none; lanes >= nvl pass -1); a lane with a row writes entry (rows of the lanes below
// it) of srcs (the row in j's x) and wsrcs (its top-k weights in j's topk_weights). Returns how many (every lane).
// The caller's __syncwarp orders these stores before the reduction's reads of the table.
__device__ __forceinline__ int pull_sources(const Common& c, const PullCall* pull, int row, int row_bytes,
                                            int num_topk, int lane, const uint8_t** srcs, const uint8_t** wsrcs) {
  const unsigned have = __ballot_sync(0xffffffffu, row >= 0);
  if (row >= 0) {
    const int at = __popc(have & ((1u << lane) - 1u));
    srcs[at] = c.nvl[lane] + pull->blocks[lane].x_offset + static_cast<int64_t>(row) * row_bytes;
    wsrcs[at] = c.nvl[lane] + pull->blocks[lane].w_offset + static_cast<int64_t>(row) * num_topk * 4;
  }
  return __popc(have);
}

// ------------------------------------------------------------------ forwarder (reduce in the domain, put back)
// Sequence of this channel's forwarded tokens: source domain x ascending, then token order (the
// order in which every local rank's NVL sender returns its rows). Chunks never span two domains.
struct FwdSeq {
  const int* first;   // [D] first fwd_mask index of (x, ch)
  const int* count;   // [D] tokens of (x, ch)
  const int* cstart;  // [D + 1] first chunk of x
  const int* fwd_mask;
  int fwd_capacity, nvl;

  __device__ int mask(int x, int k) const {
    const int idx = first[x] + k;
    return idx < fwd_capacity ? fwd_mask[idx] : 0;
  }
  // Warp: move the scan position (sx, sk) forward to (x, k), counting per local rank the rows of the
  // tokens passed (lane j: rows for j in `cnt`).
  __device__ void scan_to(int& sx, int& sk, int x, int k, uint32_t& cnt, int lane) const {
    uint32_t unused = 0;
    while (sx < x || sk < k) {
      const int limit = sx < x ? count[sx] : k;
      if (sk >= limit) {
        ++sx;
        sk = 0;
        continue;
      }
      const int m = min(32, limit - sk);
      const int bits = lane < m ? mask(sx, sk + lane) : 0;
      count_bits(static_cast<uint32_t>(bits), nvl, lane, cnt, unused);
      sk += m;
    }
  }
};

// kPull (pull mode): the token's rows are read in place from the domain's published inputs `pull` (wsrcs: their
// top-k weights), with no FIFO wait and no ring signature check (the verdict compared the words). Each mode is its
// own instantiation, so the FIFO mode's registers are today's.
template <typename T, bool kPull>
__device__ void forward_worker(const CombineArgs& a, const PullCall* pull, int ch, int warp, int lane,
                               const Watchdog& dog, int row_bytes, const FwdSeq& seq, const uint64_t* rtail0,
                               const uint64_t* nhead0, uint8_t* const* peer, ChunkBoard& board, volatile int* stop,
                               const uint8_t** srcs, const uint8_t** wsrcs) {
  const Common& c = a.c;
  const int nvl = c.nvl_size, K = a.chunk_tokens, total = seq.cstart[c.num_domains];
  RdmaControl* rctl = rdma_ctl(c);
  nvlink::Control* nctl = nvl_ctl(c, c.local);
  const uint8_t* ring0 = nvl_ring(c, c.nvl[c.local], 0, ch, a.nvl_slots, a.nvl_slot_bytes);
  const bool has_weights = a.num_topk > 0;  // the slot layout of every rank (not this rank's pointer)
  uint32_t cnt = 0, unused = 0;
  int sx = 0, sk = 0, cx = 0;
  int verdict = 0;  // lane j < nvl: 0 until its first rows of FIFO j in this call, then 1 (agrees) or 2 (left out)
  for (int k = warp; k < total; k += kWorkers) {
    while (k >= seq.cstart[cx + 1]) ++cx;
    const int x = cx, k0 = (k - seq.cstart[x]) * K, n = min(K, seq.count[x] - k0);
    const int mask = lane < n ? seq.mask(x, k0 + lane) : 0;
    uint32_t mine = 0;  // FIFO mode: lane j, rows of FIFO j in this chunk (cnt: before it)
    if constexpr (!kPull) {
      seq.scan_to(sx, sk, x, k0, cnt, lane);
      count_bits(static_cast<uint32_t>(mask), nvl, lane, mine, unused);
    }
    const uint64_t first_slot = rtail0[x] + k0;
    bool good = true;
    if (!kPull && lane < nvl && mine > 0) {
      // FIFO tail: written by local rank `lane`'s NVL sender (st.release.sys after a group barrier).
      good = wait_at_least(&nctl->fifo_tail[ch][lane], nhead0[lane] + cnt + mine, dog, kPhaseCombineForward,
                           c.domain * nvl + lane, AbortFlag{stop});
    } else if (lane == 31) {  // credit for slots [first_slot, first_slot + n) of the source's ring
      // head: written by the source's receive commit warp (rdma_credit) after its loads of the slots.
      uint64_t consumed;
      good = wait_while(&rctl->head[ch][x], consumed,
                        [&](uint64_t h) { return first_slot + n - h > static_cast<uint64_t>(a.rdma_slots); }, dog,
                        kPhaseCombineRdmaSend, team_pe(c, x), AbortFlag{stop});
    }
    if (!__all_sync(0xffffffffu, good)) {
      if (lane == 0) *stop = 1;
      return;
    }
    // Lane j's first rows of FIFO j: its tail acquire (past the call's first row) published j's signature.
    if (!kPull && lane < nvl && mine > 0 && verdict == 0) {
      verdict = ring_word_disagrees(&nctl->ring_signature[lane], nctl, c.mailbox, c.domain * nvl + lane,
                                    a.nvl_signature, true) ? 2 : 1;
    }
    const unsigned left_out = __ballot_sync(0xffffffffu, verdict == 2);  // bit j: FIFO j's slots are not read
    __syncwarp();  // the lanes' acquires before every lane's slot loads and stores
    // Pull mode, x mapped (peer[x] != null): the partials go straight into x's ring (c, my domain) through the mapped
    // pointer, at the slot index the staging slot would have had (no staging, no copy). Else staging (own domain:
    // my own ring).
    const bool direct = kPull && peer[x] != nullptr;  // uniform
    uint8_t* out_ring = direct ? rdma_mapped_ring(c, peer[x], ch, a.rdma_slots, a.rdma_slot_bytes)
                               : rdma_write_ring(c, x, ch, a.rdma_slots, a.rdma_slot_bytes);
    // Pull mode, lane j: the row of j's x of forwarded token i of the chunk (fwd_rows; -1: not sent to j, or
    // dropped). Token i + 1's is loaded before token i's reduction, so its round trip overlaps the reduction's.
    const auto fwd_row = [&](int i) {
      const int mi = __shfl_sync(0xffffffffu, mask, i & 31);
      const int64_t idx = seq.first[x] + k0 + i;
      return i < n && lane < nvl && ((mi >> lane) & 1) && idx < a.fwd_capacity ? a.fwd_rows[idx * nvl + lane] : -1;
    };
    int row = kPull ? fwd_row(0) : -1;
    for (int i = 0; i < n; ++i) {
      const int mi = __shfl_sync(0xffffffffu, mask, i);
      const unsigned below = (1u << i) - 1u;
      int nsrc = 0;
      if constexpr (kPull) {  // rows in place
        nsrc = pull_sources(c, pull, row, row_bytes, a.num_topk, lane, srcs, wsrcs);
        row = fwd_row(i + 1);
      }
      for (int j = 0; !kPull && j < nvl; ++j) {
        const unsigned b = __ballot_sync(0xffffffffu, (mask >> j) & 1);
        const uint32_t base = __shfl_sync(0xffffffffu, cnt, j);
        if (((mi & ~left_out) >> j) & 1) {  // uniform
          const uint64_t index = nhead0[j] + base + __popc(b & below);
          if (lane == 0) {
            srcs[nsrc] = ring_slot(ring0 + j * c.layout.nvl_src_block_bytes, index, a.nvl_slots, a.nvl_slot_bytes);
          }
          ++nsrc;
        }
      }
      __syncwarp();
      uint8_t* dst = ring_slot(out_ring, first_slot + i, a.rdma_slots, a.rdma_slot_bytes);
      reduce_row<T>(dst, has_weights ? reinterpret_cast<float*>(dst + row_bytes) : nullptr, srcs, nsrc, nullptr, nullptr,
                    row_bytes, a.num_topk, lane, kPull ? wsrcs : nullptr);
      __syncwarp();  // srcs is rewritten for the next token
    }
    // Remote: a copy through the mapped pointer + system fence, or put + quiet (rdma_put_rows). Pull mode: written in
    // place through the mapped pointer, each lane's stores into x's slots then its fence.acq_rel.sys and the warp
    // barrier (rdma_mapped_stores_done: the ordering argument is there), so the commit warp may publish the tail
    // once the board shows the chunk; not mapped (a NIC), block 3c puts the chunk once this block's commit warp
    // published it staged.
    if constexpr (!kPull) {
      rdma_put_rows<kPutUnroll>(c, peer[x], x, ch, first_slot, n, a.rdma_slots, a.rdma_slot_bytes, lane);
    } else {
      if (direct) rdma_mapped_stores_done();
    }
    // Every lane's slot loads, stores and fenced copies (or completed puts) before the board's release (warp
    // barrier inside).
    board.advance(0, warp, k + kWorkers, lane);
  }
}

// The commit warps that publish forwarder chunks (the ordered publisher over a ChunkBoard), by role:
enum class FwdCommit {
  kFifo,        // FIFO mode, forwarder block: every chunk's RDMA tail, and the FIFO heads of the rows consumed
  kPullDirect,  // pull mode, forwarder block: the tails of the chunks written in place (mapped source domains), and
                // RdmaControl::staged[ch] (all chunks so far) when some source domain of the channel is not mapped
  kPullPut,     // pull mode, block 3c: the tails of the chunks it put (source domains not mapped)
};

// Commit warp. peer: rdma_peer_base per source domain (the pull roles; null for kFifo). A domain's tail is published
// by exactly one commit warp of the channel: kPullDirect where peer[x] != null, kPullPut where null (both read the
// same nvshmem_ptr), so each tail word, and its tail_copy, has one writer in a call.
template <FwdCommit kRole>
__device__ void forward_commit(const CombineArgs& a, int ch, int lane, const Watchdog& dog, const FwdSeq& seq,
                               const uint64_t* rtail0, const uint64_t* nhead0, uint8_t* const* peer,
                               const ChunkBoard& board, const volatile int* stop) {
  constexpr bool kFifo = kRole == FwdCommit::kFifo;
  const Common& c = a.c;
  const int nvl = c.nvl_size, K = a.chunk_tokens, D = c.num_domains, total = seq.cstart[D];
  RdmaControl* rctl = rdma_ctl(c);
  // kPullDirect: whether block 3c has chunks to put (uniform; the same answer as put_staged's).
  bool any_staged = false;
  if constexpr (kRole == FwdCommit::kPullDirect) {
    for (int x = 0; x < D; ++x) any_staged |= seq.count[x] > 0 && peer[x] == nullptr;
  }
  uint32_t cnt = 0, published = 0;  // lane j: rows of FIFO j consumed by the committed chunks / published
  int sx = 0, sk = 0, kc = 0, cx = 0;
  bool any_remote = false;
  while (kc < total) {
    const int upto = done_upto(board, total, lane);
    if (upto == kc) {
      if (!commit_idle_ok(dog, kRole == FwdCommit::kPullPut ? kPhaseCombinePut : kPhaseCombineForward, c.rank, stop,
                          lane)) {
        return;
      }
      continue;
    }
    // Chunks [kc, upto) are done: publish the tail of every source domain they belong to (that is this warp's).
    while (kc < upto) {
      while (kc >= seq.cstart[cx + 1]) ++cx;
      const int x = cx, last = min(upto, seq.cstart[x + 1]);  // chunks [kc, last) are x's
      const int end = min((last - seq.cstart[x]) * K, seq.count[x]);
      if constexpr (kFifo) seq.scan_to(sx, sk, x, end, cnt, lane);  // the FIFO rows they consumed (pull mode: none)
      const bool mine = kFifo || ((peer[x] != nullptr) == (kRole == FwdCommit::kPullDirect));  // uniform
      if (mine) {
        if (lane == 0) {
          const uint64_t tail = rtail0[x] + end;
          rdma_signal_tail(c, x, ch, tail);
          *reinterpret_cast<volatile uint64_t*>(&rctl->tail_copy[ch][x]) = tail;
        }
        any_remote |= x != c.domain;
      }
      kc = last;
    }
    if constexpr (kRole == FwdCommit::kPullDirect) {
      // The staged chunks for block 3c's put warps: the board's acquires and the warp barrier in done_upto order
      // every worker's staging stores of chunks < upto before this release (chunks of mapped domains among them
      // are counted too; block 3c skips them).
      if (any_staged && lane == 0) ptx::st_release_sys(&rctl->staged[ch], upto);
    }
    // The FIFO heads: local rank j may reuse the slots of every committed row.
    if (kFifo && lane < nvl && cnt != published) {
      published = cnt;
      ptx::st_release_sys(&nvl_ctl(c, lane)->fifo_head[ch][c.local], nhead0[lane] + cnt);
    }
  }
  if (lane == 0 && any_remote) nvshmem_quiet();  // complete the tail signals before the kernel ends
  if (kFifo && lane < nvl) nvl_ctl(c, c.local)->head_copy[ch][lane] = nhead0[lane] + cnt;
}

// Pull mode, block 3c (the NVLink sender's: nothing to send), worker warp: the forwarder's puts to source domains
// that are not mapped (a NIC; a mapped domain's chunks the forwarder wrote in place: skipped, the board advanced
// over them). It takes chunks warp, warp + kWorkers, ... of the forwarder's sequence (every chunk of a remote
// source domain) and, once lane 0
// acquired RdmaControl::staged[ch] > k (relaxed polls, then one acquire; the forwarder block's commit warp: every
// staging store of chunks <= k before it; the acquire invalidates this SM's L1, so the put reads the staging rows
// from L2), moves chunk k's slots into the source's ring (rdma_put_rows: a mapped copy + fence, or put + quiet), then
// advances its board entry. Why a block of its own: NVSHMEM's warp put over P2P is a copy loop with one 16-byte load
// in flight per lane (512 bytes per L2 round trip and warp, an eighth of a reduction round's 4 KB), so the
// forwarder's workers spent most of their round trips putting; here the idle SM's 15 warps move chunks while the
// forwarder's 15 only reduce (and where mapped, the copy keeps kPutUnroll loads in flight per lane).
__device__ void put_worker(const CombineArgs& a, int ch, int warp, int lane, const Watchdog& dog, const FwdSeq& seq,
                           const uint64_t* rtail0, uint8_t* const* peer, ChunkBoard& board, volatile int* stop) {
  const Common& c = a.c;
  const int K = a.chunk_tokens, total = seq.cstart[c.num_domains];
  const int* staged = &rdma_ctl(c)->staged[ch];
  int cx = 0;
  for (int k = warp; k < total; k += kWorkers) {
    while (k >= seq.cstart[cx + 1]) ++cx;
    const int x = cx, k0 = (k - seq.cstart[x]) * K, n = min(K, seq.count[x] - k0);
    if (peer[x] != nullptr) {  // uniform: written in place by the forwarder, its tail that block's
      board.advance(0, warp, k + kWorkers, lane);
      continue;
    }
    bool good = true;
    if (lane == 0) {
      // staged: written by the forwarder block's commit warp (forward_commit<kPullDirect>), each value v by an st.release.sys issued
      // after the board showed chunks [0, v) reduced. Relaxed polls (an acquire per poll would be a strong load and
      // an invalidation of the SM's L1 each time, in an SM whose other warps are putting; lane 0 alone polls, one L2
      // round trip per poll, so no sleep), then one ld.acquire.sys: a later load of the same word by the same
      // thread, so it reads the value the relaxed load saw or a later one (one writer, which only raises it): > k.
      // It synchronizes with the release that wrote it, which follows chunk k's staging stores, and it invalidates
      // this SM's L1, so the put's loads read the staging rows from L2. A fresh acquire for every chunk (no cached
      // value).
      int seen;
      good = wait_while_relaxed(staged, seen, [&](int v) { return v <= k; }, dog, kPhaseCombinePut, c.rank, 0,
                                AbortFlag{stop});
    }
    if (!__all_sync(0xffffffffu, good)) {
      if (lane == 0) *stop = 1;
      return;
    }
    // rdma_put_rows' first warp barrier orders lane 0's acquire before every lane's loads of the staging slots.
    rdma_put_rows<kPutUnroll>(c, peer[x], x, ch, rtail0[x] + k0, n, a.rdma_slots, a.rdma_slot_bytes, lane);
    // Every lane's fenced copies (or completed puts) before the board's release (warp barrier inside).
    board.advance(0, warp, k + kWorkers, lane);
  }
}

// Thread 0 of a forwarding block: the chunk sequence of its channel, domains ascending, K tokens a chunk:
// cstart[x] = domain x's first chunk, cstart[D] = the chunk count (count[x]: domain x's tokens here).
__device__ __forceinline__ void chunk_starts(const int* count, int* cstart, int D, int K) {
  int s = 0;
  for (int x = 0; x < D; ++x) {
    cstart[x] = s;
    s += (count[x] + K - 1) / K;
  }
  cstart[D] = s;
}

// Pull mode, every thread of a block (a block barrier inside): whether channel ch has a source domain whose chunks
// block 3c must put, i.e. a remote source domain with forwarded tokens here (fwd_offset) whose RDMA buffer is not
// mapped here (rdma_peer_base null). The rule of forward_commit<kPullDirect>'s any_staged, on the same fwd_offset and
// nvshmem_ptr, so every block of the channel gets the same answer: true, block 3c puts (put_staged); false, block 3c
// is the channel's second source receiver block.
__device__ __forceinline__ bool pull_channel_puts(const CombineArgs& a, int ch) {
  const Common& c = a.c;
  const int C = a.num_channels;
  bool mine = false;
  for (int x = threadIdx.x; x < c.num_domains; x += blockDim.x) {
    const int* off = a.fwd_offset + x * (C + 1) + ch;
    mine |= x != c.domain && off[1] > off[0] && rdma_peer_base(c, x) == nullptr;
  }
  return __syncthreads_or(mine) != 0;
}

// Pull mode, block 3c: the forwarder's puts to the source domains that are not mapped (put_worker) and, on its own
// board, the tails of the put chunks in order (forward_commit<kPullPut>: RDMA tail signal per source domain after
// the puts' quiets (or copies' fences), tail_copy, final quiet). The tables are the forwarder block's (the same
// fwd_offset and kernel-start tail_copy: this block's commit advances tail_copy only after the forwarder block's
// first staged release, which follows its reads; it reads tail_copy[ch][x] only for unmapped x, the words of
// mapped x being the forwarder commit's to advance meanwhile). Called only where some source domain with chunks here
// is not mapped (pull_channel_puts); elsewhere (the emulated domains of one host, an NVLink fabric) block 3c is the
// channel's second source receiver block.
__device__ void put_staged(const CombineArgs& a, int ch, int warp, int lane, const Watchdog& dog) {
  const int D = a.c.num_domains, C = a.num_channels, K = a.chunk_tokens;
  __shared__ int s_first[kMaxDomains], s_count[kMaxDomains], s_cstart[kMaxDomains + 1];
  __shared__ uint64_t s_rtail0[kMaxDomains];
  __shared__ uint8_t* s_peer[kMaxDomains];  // rdma_peer_base of each source domain, once per block
  __shared__ ChunkBoard s_board;
  __shared__ int s_abort;
  for (int x = threadIdx.x; x < D; x += blockDim.x) {  // as forward()'s tables, pull mode
    s_first[x] = a.fwd_offset[x * (C + 1) + ch];
    s_count[x] = x == a.c.domain ? 0 : a.fwd_offset[x * (C + 1) + ch + 1] - s_first[x];
    s_peer[x] = rdma_peer_base(a.c, x);
    s_rtail0[x] = s_peer[x] == nullptr ? *reinterpret_cast<volatile uint64_t*>(&rdma_ctl(a.c)->tail_copy[ch][x]) : 0;
  }
  s_board.init();
  if (threadIdx.x == 0) s_abort = 0;
  __syncthreads();
  if (threadIdx.x == 0) chunk_starts(s_count, s_cstart, D, K);
  __syncthreads();  // the last block-wide barrier
  const FwdSeq seq{s_first, s_count, s_cstart, a.fwd_mask, a.fwd_capacity, a.c.nvl_size};
  if (warp == kCommitWarp) {
    forward_commit<FwdCommit::kPullPut>(a, ch, lane, dog, seq, s_rtail0, nullptr, s_peer, s_board, &s_abort);
  } else {
    put_worker(a, ch, warp, lane, dog, seq, s_rtail0, s_peer, s_board, &s_abort);
  }
}

// kPull (pull mode; pull: the domain's published inputs): my own domain's tokens are the source receivers' (no
// chunk of them here); the chunks are reduced straight into the source's ring where it is mapped (this block's
// commit warp publishes their tails), else into staging, put by block 3c (put_staged).
// srcs / wsrcs (pull mode only: else null): the block's source tables (the kernel's).
template <typename T, bool kPull>
__device__ void forward(const CombineArgs& a, const PullCall* pull, int ch, int warp, int lane, const Watchdog& dog,
                        int row_bytes, WorkerSources& srcs, WorkerSources* wsrcs) {
  const Common& c = a.c;
  const int D = c.num_domains, nvl = c.nvl_size, C = a.num_channels, K = a.chunk_tokens;
  RdmaControl* rctl = rdma_ctl(c);
  nvlink::Control* nctl = nvl_ctl(c, c.local);
  __shared__ int s_first[kMaxDomains], s_count[kMaxDomains], s_cstart[kMaxDomains + 1];
  __shared__ uint64_t s_rtail0[kMaxDomains];  // tail of ring (ch, my domain) at source x, at kernel start
  __shared__ uint64_t s_nhead0[kMaxNvl];      // head of FIFO (ch, j -> me), at kernel start
  __shared__ uint8_t* s_peer[kMaxDomains];    // rdma_peer_base of each source domain, once per block
  __shared__ ChunkBoard s_board;              // the worker warps' progress in this call
  __shared__ int s_abort;
  for (int x = threadIdx.x; x < D; x += blockDim.x) {
    s_first[x] = a.fwd_offset[x * (C + 1) + ch];
    s_count[x] = (kPull && x == c.domain) ? 0 : a.fwd_offset[x * (C + 1) + ch + 1] - s_first[x];
    s_rtail0[x] = *reinterpret_cast<volatile uint64_t*>(&rctl->tail_copy[ch][x]);
    s_peer[x] = rdma_peer_base(c, x);
    // The ring signature, completed before the barriers below, hence before the first tail signal (the commit
    // warp's, or in pull mode for an unmapped domain the put block's, which follows this block's staged release).
    rdma_publish_signature(c, x, a.rdma_signature);
  }
  if (threadIdx.x < nvl) s_nhead0[threadIdx.x] = *reinterpret_cast<volatile uint64_t*>(&nctl->head_copy[ch][threadIdx.x]);
  s_board.init();
  if (threadIdx.x == 0) s_abort = 0;
  __syncthreads();
  if (threadIdx.x == 0) chunk_starts(s_count, s_cstart, D, K);
  __syncthreads();  // the last block-wide barrier: from here on warps wait only on their own words
  const FwdSeq seq{s_first, s_count, s_cstart, a.fwd_mask, a.fwd_capacity, nvl};
  if (warp == kCommitWarp) {
    if constexpr (kPull) {
      forward_commit<FwdCommit::kPullDirect>(a, ch, lane, dog, seq, s_rtail0, nullptr, s_peer, s_board, &s_abort);
    } else {
      forward_commit<FwdCommit::kFifo>(a, ch, lane, dog, seq, s_rtail0, s_nhead0, nullptr, s_board, &s_abort);
    }
  } else {
    forward_worker<T, kPull>(a, pull, ch, warp, lane, dog, row_bytes, seq, s_rtail0, s_nhead0, s_peer, s_board,
                             &s_abort, srcs[warp], kPull ? (*wsrcs)[warp] : nullptr);
  }
}

// ------------------------------------------------------------------ source receiver
// Domains (bit x) that token t went to.
__device__ __forceinline__ uint64_t token_domains(const CombineArgs& a, int t) {
  const Common& c = a.c;
  const bool* row = a.is_token_in_rank + static_cast<int64_t>(t) * c.num_ranks;
  uint64_t bits = 0;
  for (int x = 0; x < c.num_domains; ++x) {
    bool hit = false;
    for (int j = 0; j < c.nvl_size; ++j) hit |= row[x * c.nvl_size + j];
    bits |= static_cast<uint64_t>(hit) << x;
  }
  return bits;
}

// Warp: move the scan position st forward to token `to`, counting per domain the partials passed.
__device__ __forceinline__ void recv_scan_to(const CombineArgs& a, int& st, int to, uint32_t& lo, uint32_t& hi,
                                             int lane) {
  while (st < to) {
    const int m = min(32, to - st);
    const uint64_t bits = lane < m ? token_domains(a, st + lane) : 0;
    count_bits(bits, a.c.num_domains, lane, lo, hi);
    st += m;
  }
}

// kPull (pull mode; pull: the domain's published inputs): my own domain's rows are read in place, at the forwarded
// index of the token among the channel's tokens that went to my domain (the scan's count of my domain, which is not
// waited for nor credited: no partial of it travels), and reduced into the output rows before the chunk's wait.
// Worker `first` of `stride` (pull mode with a second receiver block: 30, block 3c's warp w being worker 15 + w;
// else 15) takes chunks first, first + stride, ...: everything a chunk needs (its tokens, ring indices, output rows)
// follows from the chunk's first token and this warp's scan of the tokens before it, whichever warp takes it.
// `warp`: this warp in its block, the index of its progress entry: block 3c+2's ChunkBoard, or (helper: block 3c)
// RdmaControl::recv_next[ch] (st.release.gpu: block 3c+2's commit warp reads it, receive_done_upto).
template <typename T, bool kPull>
__device__ void receive_worker(const CombineArgs& a, const PullCall* pull, int ch, int warp, int first, int stride,
                               bool helper, int lane, const Watchdog& dog, int row_bytes, int begin, int end,
                               const uint64_t* rhead0, ChunkBoard& board, volatile int* stop, const uint8_t** srcs,
                               const uint8_t** wsrcs) {
  const Common& c = a.c;
  const int D = c.num_domains, K = a.chunk_tokens, total = (end - begin + K - 1) / K, nvl = c.nvl_size;
  const uint64_t own_bit = kPull ? 1ull << c.domain : 0;  // my domain, when its partial does not travel
  const int own_first = kPull ? a.fwd_offset[c.domain * (a.num_channels + 1) + ch] : 0;  // my domain's first fwd index
  RdmaControl* rctl = rdma_ctl(c);
  nvlink::Control* nctl = nvl_ctl(c, c.local);
  uint32_t lo = 0, hi = 0;  // lane x (& 31): partials of domain x (lo: x < 32, hi: x >= 32) before st
  // Lane x (& 31): 0 until its first partials of domain x (vlo: x < 32, vhi: x >= 32) in this call, then 1
  // (signatures agree) or 2 (domain x left out of the sums).
  int vlo = 0, vhi = 0;
  int st = begin;
  for (int k = first; k < total; k += stride) {
    const int t0 = begin + k * K, n = min(K, end - t0);
    recv_scan_to(a, st, t0, lo, hi, lane);  // from wherever this warp's previous chunk ended: any chunk -> warp map
    const uint64_t bits = lane < n ? token_domains(a, t0 + lane) : 0;
    uint32_t mlo = 0, mhi = 0;
    count_bits(bits & ~own_bit, D, lane, mlo, mhi);  // partials that travel: waited for, signatures checked
    if constexpr (kPull) {
      // My domain's partials first, before any wait: into each token's output row (and weights), round(sum over j
      // ascending) of its rows read in place, the partial my own ring carried in FIFO mode. They depend on no
      // counter (every domain peer's input was complete when the verdict acquired its ready word), so the remote
      // reads of the chunk's own rows overlap the wait for the other domains' partials below instead of following
      // it (the first chunk of every worker waited for a whole forwarder chunk, reduce and put, before these).
      const unsigned own_tokens = __ballot_sync(0xffffffffu, (bits & own_bit) != 0);  // bit i: token t0 + i
      const int64_t own_base = own_first + count_of(lo, hi, c.domain);  // fwd index of the chunk's first own token
      // Lane j: the row of j's x of the own token `todo`'s lowest bit stands for (-1: not sent to j, or none). The
      // next token's is loaded before this token's reduction, so its round trip overlaps the reduction's.
      const auto own_row = [&](unsigned todo) {
        if (todo == 0 || lane >= nvl) return -1;
        const int i = __ffs(static_cast<int>(todo)) - 1;
        const int64_t idx = own_base + __popc(own_tokens & ((1u << i) - 1u));
        return idx < a.fwd_capacity ? a.fwd_rows[idx * nvl + lane] : -1;
      };
      int row = own_row(own_tokens);
      for (unsigned todo = own_tokens; todo != 0; todo &= todo - 1) {  // uniform
        const int64_t token = t0 + __ffs(static_cast<int>(todo)) - 1;
        const int nown = pull_sources(c, pull, row, row_bytes, a.num_topk, lane, srcs, wsrcs);
        row = own_row(todo & (todo - 1));
        __syncwarp();
        reduce_row<T>(a.out + token * row_bytes, a.out_topk_weights != nullptr ? a.out_topk_weights + token * a.num_topk
                      : nullptr, srcs, nown, nullptr, nullptr, row_bytes, a.num_topk, lane, wsrcs);
        __syncwarp();  // srcs is rewritten by the next token
      }
    }
    bool good = true;
    // RDMA tails: written by the team member of domain `lane` (its forward commit warp, rdma_signal_tail).
    if (lane < D && mlo > 0) {
      good = wait_at_least(&rctl->tail[ch][lane], rhead0[lane] + lo + mlo, dog, kPhaseCombineRecv, team_pe(c, lane),
                           AbortFlag{stop});
    }
    if (good && lane + 32 < D && mhi > 0) {
      good = wait_at_least(&rctl->tail[ch][lane + 32], rhead0[lane + 32] + hi + mhi, dog, kPhaseCombineRecv,
                           team_pe(c, lane + 32), AbortFlag{stop});
    }
    if (!__all_sync(0xffffffffu, good)) {
      if (lane == 0) {
        *stop = 1;
        // Two receiver blocks: the other one's waits end too (its commit warp or spare warp reads the word).
        if (kPull && stride != kWorkers) *reinterpret_cast<volatile int*>(&rctl->recv_stop[ch]) = 1;
      }
      return;
    }
    // A lane's first partials of its domain: its tail acquire (past the call's first one) published the
    // forwarder's RDMA ring signature (rdma_publish_signature).
    if (lane < D && mlo > 0 && vlo == 0) {
      vlo = ring_word_disagrees(&rctl->ring_signature[lane], nctl, c.mailbox, team_pe(c, lane), a.rdma_signature, true)
                ? 2 : 1;
    }
    if (lane + 32 < D && mhi > 0 && vhi == 0) {
      vhi = ring_word_disagrees(&rctl->ring_signature[lane + 32], nctl, c.mailbox, team_pe(c, lane + 32),
                                a.rdma_signature, true) ? 2 : 1;
    }
    const uint64_t left_out = __ballot_sync(0xffffffffu, vlo == 2) |
                              static_cast<uint64_t>(__ballot_sync(0xffffffffu, vhi == 2)) << 32;  // bit x
    __syncwarp();  // the lanes' tail acquires before every lane's slot loads
    for (int i = 0; i < n; ++i) {
      const int64_t token = t0 + i;
      const unsigned below = (1u << i) - 1u;
      const uint64_t tbits = __shfl_sync(0xffffffffu, bits, i);
      const uint64_t rest = tbits & ~left_out & ~own_bit;
      int nsrc = 0;
      float* out_w = a.out_topk_weights != nullptr ? a.out_topk_weights + token * a.num_topk : nullptr;
      uint8_t* out = a.out + token * row_bytes;
      const bool own = (tbits & own_bit) != 0;  // pull mode, a token that went to my domain
      // The partials, domains ascending (uniform); my domain's (pull mode) is the output row written before the
      // wait, read back by the lanes that wrote it (reduce_row maps each vector and weight to the same lane every
      // call).
      for (uint64_t todo = rest | (own ? own_bit : 0); todo != 0; todo &= todo - 1) {
        const int x = __ffsll(static_cast<long long>(todo)) - 1;
        if (kPull && x == c.domain) {
          if (lane == 0) {
            srcs[nsrc] = out;
            wsrcs[nsrc] = reinterpret_cast<const uint8_t*>(out_w);
          }
          ++nsrc;
          continue;
        }
        const unsigned b = __ballot_sync(0xffffffffu, (bits >> x) & 1u);
        const uint64_t index = rhead0[x] + count_of(lo, hi, x) + __popc(b & below);
        if (lane == 0) {
          srcs[nsrc] = ring_slot(rdma_recv_ring(c, x, ch, a.rdma_slots, a.rdma_slot_bytes), index, a.rdma_slots,
                                 a.rdma_slot_bytes);
          if (kPull) wsrcs[nsrc] = srcs[nsrc] + row_bytes;
        }
        ++nsrc;
      }
      __syncwarp();
      reduce_row<T>(out, out_w, srcs, nsrc, a.bias0 != nullptr ? a.bias0 + token * row_bytes : nullptr,
                    a.bias1 != nullptr ? a.bias1 + token * row_bytes : nullptr, row_bytes, a.num_topk, lane,
                    kPull ? wsrcs : nullptr);
      __syncwarp();  // srcs is rewritten for the next token
    }
    // Every lane's slot loads (and output stores) before the entry's release (warp barrier first). Block 3c+2: its
    // board (st.release.cta). Block 3c: its word in global memory, st.release.gpu (its reader is another block's
    // commit warp, which acquires it at gpu scope and then releases the credit at system scope: a causality chain,
    // release and acquire being cumulative, from these loads to the producer's acquire of the credit).
    if (kPull && helper) {
      __syncwarp();
      if (lane == 0) ptx::st_release_gpu(&rctl->recv_next[ch][warp], k + stride);
    } else {
      board.advance(0, warp, k + stride, lane);
    }
  }
}

// Block 3c+2's commit warp: the chunks below the returned one are all done (every lane gets it). Lane w < 15
// acquires its block's worker w's board entry (ld.acquire.cta); with a second receiver block (far =
// RdmaControl::recv_next[ch], else null) lane 15 + w reads block 3c's worker w's entry: ld.relaxed.gpu polls
// (no acquire, so no L1 invalidation of this SM, whose worker warps read through it, per idle poll), and once the
// warp's minimum passed kc one ld.acquire.gpu per lane, whose value is the one used: a later load of the same word by
// the same thread, so it reads the polled value or a later one (one writer, which only raises it), and it
// synchronizes with the release that wrote it (receive_worker, after the chunk's loads). The warp barrier at the end
// orders every lane's acquire before any lane's later release (the credits, lane 0).
__device__ __forceinline__ int receive_done_upto(const ChunkBoard& board, const int* far, int total, int kc,
                                                 int lane) {
  const bool theirs = far != nullptr && lane >= kWorkers && lane < 2 * kWorkers;
  int v = lane < kWorkers ? ptx::ld_acquire_cta(&board.next[0][lane])
                          : theirs ? ptx::ld_relaxed_gpu(far + (lane - kWorkers)) : INT_MAX;
  int k = v;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) k = min(k, __shfl_xor_sync(0xffffffffu, k, o));
  if (far != nullptr && k > kc) {  // uniform
    if (theirs) v = ptx::ld_acquire_gpu(far + (lane - kWorkers));
    k = v;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) k = min(k, __shfl_xor_sync(0xffffffffu, k, o));
  }
  __syncwarp();
  return min(k, total);
}

// pull: pull mode (my own domain's ring carried nothing: neither credited nor its head copy moved). split: pull mode
// with block 3c as the second receiver block (its workers' entries in RdmaControl::recv_next[ch], the channel's
// RdmaControl::recv_stop[ch] shared with it).
__device__ void receive_commit(const CombineArgs& a, bool pull, bool split, int ch, int lane, const Watchdog& dog,
                               int begin, int end, const uint64_t* rhead0, const ChunkBoard& board,
                               volatile int* stop) {
  const Common& c = a.c;
  const int D = c.num_domains, K = a.chunk_tokens, total = (end - begin + K - 1) / K;
  RdmaControl* rctl = rdma_ctl(c);
  const int* far = split ? rctl->recv_next[ch] : nullptr;
  uint32_t lo = 0, hi = 0, plo = 0, phi = 0;  // lane x (& 31): partials of x consumed / credited
  int st = begin, kc = 0;
  bool any_remote = false;
  while (kc < total) {
    const int upto = receive_done_upto(board, far, total, kc, lane);
    if (upto == kc) {
      // A worker of block 3c gave up (recv_stop, relaxed: it publishes nothing): end this block's waits too, and
      // this loop (commit_idle_ok reads the flag after this lane's store).
      if (split && lane == 0 && *reinterpret_cast<const volatile int*>(&rctl->recv_stop[ch]) != 0) *stop = 1;
      if (!commit_idle_ok(dog, kPhaseCombineRecv, c.rank, stop, lane)) return;
      continue;
    }
    recv_scan_to(a, st, min(end, begin + upto * K), lo, hi, lane);
    kc = upto;
    // Credits (lane 0 issues every signal, so its final quiet completes them all).
    for (int x = 0; x < D; ++x) {
      const uint32_t now = count_of(lo, hi, x), before = count_of(plo, phi, x);
      if (lane == 0 && now != before && !(pull && x == c.domain)) {
        rdma_credit(c, x, ch, rhead0[x] + now);
        any_remote |= x != c.domain;
      }
    }
    plo = lo;
    phi = hi;
  }
  if (lane == 0 && any_remote) nvshmem_quiet();  // complete the credit signals before the kernel ends
  if (lane < D && !(pull && lane == c.domain)) rctl->head_copy[ch][lane] = rhead0[lane] + lo;
  if (lane + 32 < D && !(pull && lane + 32 == c.domain)) rctl->head_copy[ch][lane + 32] = rhead0[lane + 32] + hi;
}

// Block 3c as the second receiver block, its spare warp (lane 0): until every worker of the block left its loop,
// turn the channel's RdmaControl::recv_stop (a worker of block 3c+2 gave up, or one of this block: it set both)
// into this block's stop flag, so this block's waits end too. Relaxed polls, a few per microsecond: the word
// publishes nothing, and it only shortens a failing call (every wait also has the rank's deadline).
__device__ void receive_watch(const RdmaControl* rctl, int ch, int lane, const ChunkBoard& board, volatile int* stop) {
  if (lane == 0) {
    const volatile int* far_stop = &rctl->recv_stop[ch];
    while (board.left_count(0) < kWorkers) {
      if (*far_stop != 0) {
        *stop = 1;
        break;
      }
      __nanosleep(256);
    }
  }
  __syncwarp();  // the warp leaves together (the block barrier of end_nvl_pull_call follows)
}

// srcs / wsrcs (pull mode only: else null): the block's source tables (the kernel's). Pull mode only: split, block
// 3c is the channel's second receiver block ("second source receiver" at the top); helper, this block is block 3c.
template <typename T, bool kPull>
__device__ void receive(const CombineArgs& a, const PullCall* pull, int ch, int warp, int lane, const Watchdog& dog,
                        int row_bytes, WorkerSources& srcs, WorkerSources* wsrcs, bool split = false,
                        bool helper = false) {
  const Common& c = a.c;
  RdmaControl* rctl = rdma_ctl(c);
  __shared__ uint64_t s_rhead0[kMaxDomains];  // head of my ring (ch, from x), at kernel start
  __shared__ ChunkBoard s_board;
  __shared__ int s_abort;
  int begin, end;
  channel_range(a.num_tokens, a.num_channels, ch, begin, end);
  // Block 3c with no chunk (the channel's chunks <= 15): its entries (15 + w, reset before the grid barrier) are
  // already past the last chunk, and it does not read head_copy, which block 3c+2's commit warp may then rewrite.
  if (helper && (end - begin + a.chunk_tokens - 1) / a.chunk_tokens <= kWorkers) return;  // uniform
  // head_copy: written by block 3c+2's commit warp at its end, after it acquired every chunk of both blocks, hence
  // (block 3c) after this read, which precedes the block's first progress release.
  for (int x = threadIdx.x; x < c.num_domains; x += blockDim.x) {
    s_rhead0[x] = *reinterpret_cast<volatile uint64_t*>(&rctl->head_copy[ch][x]);
  }
  s_board.init();
  if (threadIdx.x == 0) s_abort = 0;
  __syncthreads();  // the last block-wide barrier
  if (warp == kCommitWarp) {
    if (kPull && helper) {
      receive_watch(rctl, ch, lane, s_board, &s_abort);
    } else {
      receive_commit(a, kPull, kPull && split, ch, lane, dog, begin, end, s_rhead0, s_board, &s_abort);
    }
  } else {
    const bool second = kPull && helper;
    receive_worker<T, kPull>(a, pull, ch, warp, second ? kWorkers + warp : warp,
                             kPull && split ? 2 * kWorkers : kWorkers, second, lane, dog, row_bytes, begin, end,
                             s_rhead0, s_board, &s_abort, srcs[warp], kPull ? (*wsrcs)[warp] : nullptr);
    if (second) s_board.leave(0, warp, -1, lane);  // for the spare warp's watch (left only; the entry is global)
  }
}

// The direct-call site of the pull NVLink hop: Control::pull, its phases, timeouts naming group ranks.
__device__ __forceinline__ intranode::DirectCallSite<PullInputBlocks> nvl_pull_site(const Common& c) {
  return {&nvlink::Control::pull, kPhaseNvlPullReady, kPhaseNvlPullArrive, c.domain * c.nvl_size};
}

// Steps 3-4 of the direct-call protocol (end_direct_call) for the pull NVLink hop, out of line: inlined, the state
// it needs after the roles (the watchdog above all) stays live in registers through every role.
__device__ __noinline__ void end_nvl_pull_call(PullCall& call, const intranode::Common& domain, const Common& c,
                                               const Watchdog& dog) {
  intranode::end_direct_call(call, domain, nvl_pull_site(c), dog);
}

// kPullCall: the launch's a.pull_call (launch_combine picks the instantiation), so a Buffer without a pool runs a
// kernel with no pull-mode code at all (no protocol words, no in-place reads, no fwd_rows: the host passes fwd_rows
// only along a pool handle), while a pool Buffer's kernel still decides pull or FIFO per call.
template <typename T, bool kPullCall>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(CombineArgs a) {
  __shared__ int shared_ok[kMaxNvl];
  __shared__ WorkerSources s_srcs;   // the worker warps' source rows (forwarder or source receiver)
  __shared__ WorkerSources s_wsrcs;  // kPullCall, pull mode: the top-k weights of s_srcs' rows
  __shared__ PullCall call;           // kPullCall: the domain's published inputs and the verdict
  __shared__ intranode::Common domain;  // kPullCall: the domain's buffers for the protocol
  const Common& c = a.c;
  const int ch = blockIdx.x / 3, role = blockIdx.x % 3;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row_bytes = a.hidden * static_cast<int>(sizeof(T));
  if (call_refused(a.recv_channel_offset)) {  // the same word in every block: all leave, none reaches the barrier
    if (role == 2) {
      int begin, end;
      channel_range(a.num_tokens, a.num_channels, ch, begin, end);
      zero_refused_outputs(a.out, a.out_topk_weights, begin, end, row_bytes, a.num_topk);
    }
    return;  // no ring, counter, drain wait or grid barrier: the next call starts from the same counters
  }
  const Watchdog dog = make_watchdog(c.timeout_ns, c.rank, &nvl_ctl(c, c.local)->timeout_claim, &c.mailbox->timeout,
                                     rdma_ctl(c)->peer_aborted);
  // Pull NVLink hop: ready and verdict (direct_call.cuh steps 1-2) before the drain, whose barriers hand
  // call.in_pool to every thread.
  if constexpr (kPullCall) {
    if (threadIdx.x == 0) set_domain_common(domain, c);
    __syncthreads();
    const PullInputBlocks mine{a.x_offset, a.w_offset};
    const auto accepts = [](const PullInputBlocks& in) { return in.x_offset >= 0; };  // w_offset goes with it
    if (!intranode::begin_direct_call(call, domain, nvl_pull_site(c), mine, a.nvl_signature, dog, accepts)) return;
  }
  // Pull mode's per-call words start over: the staged chunks at 0 (put_staged), the second receiver block's progress
  // entries at their first chunks (15 + w) and its stop word at 0. The grid barrier below publishes the resets before
  // any block's first read (each written before by the previous call's kernel only: the forwarder block, block 3c's
  // workers and either receiver block).
  if constexpr (kPullCall) {
    RdmaControl* rctl = rdma_ctl(c);
    if (role == 1 && threadIdx.x == 0) *reinterpret_cast<volatile int*>(&rctl->staged[ch]) = 0;
    if (role == 0 && threadIdx.x < kMaxCombineHelpers) {
      *reinterpret_cast<volatile int*>(&rctl->recv_next[ch][threadIdx.x]) = kWorkers + threadIdx.x;
    }
    if (role == 0 && threadIdx.x == 0) *reinterpret_cast<volatile int*>(&rctl->recv_stop[ch]) = 0;
  }
  if (!drain_previous_calls(c, dog)) return;  // earlier calls drained; no ring written before this
  // The same in every block of every rank of the domain; a constant false without a pool.
  const bool pull = kPullCall && call.in_pool != 0;
  if (role == 1) {
    if (pull) forward<T, true>(a, &call, ch, warp, lane, dog, row_bytes, s_srcs, &s_wsrcs);
    else forward<T, false>(a, nullptr, ch, warp, lane, dog, row_bytes, s_srcs, nullptr);
  } else if (pull) {
    // Pull mode: block 3c's NVLink senders have nothing to send. It puts the forwarder's chunks to source domains that
    // are not mapped, or, where there are none in the channel, it is the channel's second source receiver block.
    const bool puts = pull_channel_puts(a, ch);  // the same in blocks 3c, 3c+1 (any_staged) and 3c+2
    if (role == 2 || !puts) {
      receive<T, true>(a, &call, ch, warp, lane, dog, row_bytes, s_srcs, &s_wsrcs, !puts, role == 0);
    } else {
      put_staged(a, ch, warp, lane, dog);
    }
  } else if (role == 2) {
    receive<T, false>(a, nullptr, ch, warp, lane, dog, row_bytes, s_srcs, nullptr);
  } else {
    const int warps = kWarps / c.nvl_size;
    const int group = warp / warps, group_warp = warp % warps;
    if (group < c.nvl_size) nvl_send(a, ch, group, group_warp, warps, lane, &shared_ok[group], dog, row_bytes);
  }
  // Arrival at every domain peer, after this block's last read of their inputs (either mode), and (block 0)
  // completion: every peer's reads of my input are done before my kernel ends (direct_call.cuh steps 3-4).
  if constexpr (kPullCall) end_nvl_pull_call(call, domain, c, dog);
}

template <bool kPullCall>
void launch_typed(const CombineArgs& args, dim3 grid, cudaStream_t stream) {
  switch (args.dtype) {
    case kBf16: combine_kernel<__nv_bfloat16, kPullCall><<<grid, kThreads, 0, stream>>>(args); break;
    case kFp16: combine_kernel<__half, kPullCall><<<grid, kThreads, 0, stream>>>(args); break;
    default: combine_kernel<float, kPullCall><<<grid, kThreads, 0, stream>>>(args); break;
  }
}

}  // namespace

void launch_combine(const CombineArgs& args, cudaStream_t stream) {
  const dim3 grid(3 * args.num_channels);
  if (args.pull_call) {
    launch_typed<true>(args, grid, stream);
  } else {
    launch_typed<false>(args, grid, stream);
  }
  check_launch("internode combine_kernel");
}

}  // namespace moe_ep::internode