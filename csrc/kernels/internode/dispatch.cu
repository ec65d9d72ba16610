// Internode dispatch (fresh and cached): one kernel, three blocks per channel c, all resident at once
// so both hops overlap:
//   block 3c   RDMA sender: for each destination domain x, the channel's tokens with a destination in
//              x, in token order, once each, into ring (c, my domain) of the team member of x
//              (written straight into x's ring through nvshmem_ptr where x's buffer is mapped, else
//              staged and put with NVSHMEM; for x = my domain straight into my own ring). Slot:
//              payload | scales | top-k (global expert ids) | weights | source token | mask of x's
//              local ranks.
//   block 3c+1 forwarder: drains my RDMA rings (c, x) for every source domain x (round robin over
//              the rings with rows ready, up to nvl_chunk rows at a time) and copies each row to
//              every local rank in its mask through the NVLink FIFO (c, me -> j) (channel.cuh),
//              top-k rebased to j's experts, tagged with the source domain x. It records the masks
//              (fwd_mask) for combine.
//   block 3c+2 NVLink receiver: warp group l drains FIFO (c, l -> me). Rows of one source rank
//              s = (x, l) arrive in token order, so the k-th row tagged x goes to row
//              recv_channel_offset[s][c] + k: the (source rank, token) order of the contract.
// Start: every block takes part in drain_previous_calls (common.cuh): the rings this rank writes are
// drained of earlier calls' rows, then a grid barrier, before any block writes a ring.
// Progress: receivers depend on nothing, forwarders only on receivers (NVL credits) and senders
// only on forwarders (RDMA credits), so no cycle; each wait has a timeout naming rank and peer.
// A call that notify refused (common/refused_call.cuh) moves nothing: every block returns before the drain and
// the grid barrier (all blocks alike, so none waits there), after the receiver blocks padded every output row
// (num_worst_tokens; a refused call received nothing).
// A cached dispatch carries its ring signatures (common/ring_signature.cuh), one per hop: the RDMA sender puts
// rdma_signature into each team member's RdmaControl before its first tail signal there, the forwarder stores
// nvl_signature into each local rank's Control before its first FIFO tail release there (both right after the
// drain, whether or not rows follow). A forwarder whose source domain sent another RDMA signature reads no slot
// of that source's rings: it forwards zero rows (tagged with the domain) to the local ranks the handle's fwd_mask
// names, so every receiver still gets its rows. A receiver whose forwarder sent another NVLink signature reads
// no slot of that FIFO: it writes zero rows for every source the FIFO carries in the channel. Both still consume
// and credit every row, so every rank finishes the call and the counters stay in step.
//
// Two instantiations of the one kernel body (launch_dispatch picks by direct_call): kDirectCall = false for a Buffer
// without a peer pool (direct_call = 0), the FIFO path alone, with no direct-mode code (its registers and spills are
// those of the FIFO-only kernel); kDirectCall = true for a pool Buffer, whose per-call verdict picks direct or FIFO.
//
// Direct mode (a Buffer with a peer pool: direct_call = 1). The outputs of every rank are blocks of its peer pool
// (intranode DirectPayload / DirectMeta), which its domain peers map. The kernel runs intranode's direct-call
// protocol (intranode/direct_call.cuh) over the domain, on Control::direct of the NVLink buffer (indexed by local
// rank; nothing else uses those words here), phases kPhaseNvlDirectReady / kPhaseNvlDirectArrive:
//   ready + verdict, before the drain: block 0 publishes my blocks (offsets, rows) and the layout word (0 fresh,
//     nvl_signature cached); every block acquires every domain peer's and decides: direct when every peer's blocks
//     are peer-mapped and every layout word equals mine. Every rank of the domain reads the same words, so the
//     domain agrees; other domains need not (the RDMA traffic is the same in both modes).
//   direct: block 3c (RDMA sender) serves only the other domains (my own domain's ring stays unused); block 3c+1
//     (forwarder) writes each (row, local rank j) item straight into j's outputs at the FIFO receiver's row (no
//     FIFO, no reservation, no tail release); block 3c+2 becomes the local direct sender (local_direct_send: my
//     own tokens for my domain, straight into each j's outputs at fwd_row_offset[my domain][j][c] + rank). The rows
//     land where the FIFO path puts them, so the outputs are the same bits. fwd_mask is written by both writers.
//   missed (some peer's block not in its pool, a layout word that differs, a CUDA graph capture): the FIFO path as
//     described above, unchanged; the FIFO receivers write into the same (local) blocks.
//   arrival + completion, at the end of every block: arrive at every domain peer (after a system fence and a block
//     barrier: every store of the block into their outputs, either mode), and block 0 waits for every peer's 3C
//     arrivals, so my outputs are complete when my kernel ends; a missed call counts in direct.missed_total
//     (IpcBuffer.path_counters()).
// fwd_rows (pool Buffers, fresh calls): where forwarded token idx landed at each local rank, recorded by the
// forwarder (both modes, from the same row numbers) and the local direct sender: the pull combine's map.
#include "kernels/common/copy.cuh"
#include "kernels/common/launch_check.cuh"
#include "kernels/common/refused_call.cuh"
#include "kernels/common/ring_layout.cuh"
#include "kernels/internode/common.cuh"
#include "kernels/internode/domain_call.cuh"

namespace moe_ep::internode {
namespace {

using intranode::DirectMeta;
using intranode::DirectPayload;
using nvlink::DirectOutputBlocks;
using DirectCall = intranode::DirectCallState<DirectOutputBlocks>;

constexpr int kThreads = 768;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;

// Slots: DispatchSlot (ring_layout.cuh) with its tag: the local-rank mask in RDMA slots, the source domain in
// NVLink slots.

// One warp: slot `dst` holds a zero row (payload and scales 0, top-k -1 with weight 0, source -1), tag unset.
__device__ __forceinline__ void zero_slot(const DispatchSlot& layout, uint8_t* dst, int hidden_bytes, int num_scales,
                                          int num_topk, int lane) {
  int4* out = reinterpret_cast<int4*>(dst);
  for (int v = lane; v < hidden_bytes / 16; v += 32) out[v] = make_int4(0, 0, 0, 0);
  for (int k = lane; k < num_scales; k += 32) layout.scales(dst)[k] = 0;
  if (lane < num_topk) {
    layout.idx(dst)[lane] = -1;
    layout.weights(dst)[lane] = 0.f;
  }
  if (lane == 0) *layout.source(dst) = -1;
}

// One warp: received row `row` is a zero row (as pad_worst_rows writes it): its forwarder's NVLink ring signature
// differed, so nothing of it was read.
__device__ __forceinline__ void zero_row(const DispatchArgs& a, int64_t row, int lane) {
  int4* out = reinterpret_cast<int4*>(a.recv_x + row * a.hidden_bytes);
  for (int v = lane; v < a.hidden_bytes / 16; v += 32) out[v] = make_int4(0, 0, 0, 0);
  for (int j = lane; j < a.num_scales; j += 32) a.recv_scales[row * a.num_scales + j] = 0;
  if (a.recv_topk_idx != nullptr && lane < a.num_topk) {
    a.recv_topk_idx[row * a.num_topk + lane] = -1;
    a.recv_topk_weights[row * a.num_topk + lane] = 0.f;
  }
  if (a.recv_src_idx != nullptr && lane == 0) a.recv_src_idx[row] = -1;
}

// ------------------------------------------------------------------ RDMA sender
// skip_own (direct mode): my own domain's rows are written by the local direct sender, so the groups serve the
// D - 1 other domains (domain k, skipping mine).
__device__ void rdma_send(const DispatchArgs& a, int ch, int group, int groups, int group_warp, int warps, int lane,
                          int* chunk_tokens, int* chunk_masks, int* shared_ok, bool skip_own, const Watchdog& dog) {
  const Common& c = a.c;
  const int R = c.num_ranks, nvl = c.nvl_size;
  RdmaControl* ctl = rdma_ctl(c);
  const DispatchSlot layout{a.hidden_bytes, a.num_scales, a.num_topk};
  const int bar = 1 + group, threads = warps * 32;
  const bool leader = group_warp == 0 && lane == 0;
  int begin, end;
  channel_range(a.num_tokens, a.num_channels, ch, begin, end);
  bool any_remote = false;

  const int targets = skip_own ? c.num_domains - 1 : c.num_domains;
  for (int k = group; k < targets; k += groups) {
    const int x = skip_own && k >= c.domain ? k + 1 : k;
    any_remote |= x != c.domain;
    // Cached: the ring signature before the first tail signal to x (the leader signals every tail below).
    if (leader && a.rdma_signature != 0) rdma_publish_signature(c, x, a.rdma_signature);
    // Where the rows are written: x's ring itself through the mapped pointer where x's buffer is mapped
    // (rdma_peer_base, once per warp and destination domain: rows written once, no staging, no put), my own
    // ring for my domain, else my staging ring for x (then put + quiet: rdma_put_rows).
    uint8_t* const peer = rdma_peer_base(c, x);
    uint8_t* ring = peer != nullptr ? rdma_mapped_ring(c, peer, ch, a.rdma_slots, a.rdma_slot_bytes)
                                    : rdma_write_ring(c, x, ch, a.rdma_slots, a.rdma_slot_bytes);
    const uint64_t* head = &ctl->head[ch][x];
    uint64_t tail = *reinterpret_cast<volatile uint64_t*>(&ctl->tail_copy[ch][x]);
    int cursor = begin;
    while (true) {
      // Next chunk: up to rdma_chunk tokens with a destination in x (every warp computes the same).
      int n = 0;
      while (n < a.rdma_chunk && cursor < end) {
        const int t = cursor + lane;
        int mask = 0;
        if (t < end) {
          for (int j = 0; j < nvl; ++j) mask |= a.is_token_in_rank[static_cast<int64_t>(t) * R + x * nvl + j] << j;
        }
        const bool hit = mask != 0;
        const unsigned ballot = __ballot_sync(0xffffffffu, hit);
        const int pos = n + __popc(ballot & ((1u << lane) - 1u));
        if (hit && pos < a.rdma_chunk) {
          chunk_tokens[pos] = t;
          chunk_masks[pos] = mask;
        }
        const int found = __popc(ballot);
        if (n + found <= a.rdma_chunk) {
          n += found;
          cursor = min(cursor + 32, end);
        } else {
          const unsigned last = __ballot_sync(0xffffffffu, hit && pos == a.rdma_chunk - 1);
          cursor += __ffs(last);
          n = a.rdma_chunk;
        }
      }
      __syncwarp();
      if (n == 0) break;
      if (leader) {  // head: written by x's forwarder (rdma_credit) after its loads of the slots
        uint64_t consumed;
        *shared_ok = wait_while(head, consumed,
                                [&](uint64_t h) { return tail + n - h > static_cast<uint64_t>(a.rdma_slots); }, dog,
                                kPhaseRdmaSend, team_pe(c, x));
      }
      ptx::group_sync(bar, threads);  // the credit acquired by the leader covers the slots below
      if (!*shared_ok) return;
      // Warp w writes a contiguous run of the chunk's rows: into x's ring through the mapped pointer (then each
      // lane's system fence: rdma_mapped_stores_done), into my own ring, or into staging, and then puts that run
      // itself (rdma_put_rows: put + quiet).
      const int per = (n + warps - 1) / warps;
      const int lo = min(n, group_warp * per), hi = min(n, lo + per);
      for (int i = lo; i < hi; ++i) {
        const int t = chunk_tokens[i];
        uint8_t* slot = ring_slot(ring, tail + i, a.rdma_slots, a.rdma_slot_bytes);
        warp_copy<false, kUnroll>(reinterpret_cast<int4*>(slot),
                                  reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.hidden_bytes),
                                  a.hidden_bytes / 16, lane);
        for (int j = lane; j < a.num_scales; j += 32) layout.scales(slot)[j] = a.scales[static_cast<int64_t>(t) * a.num_scales + j];
        if (a.topk_idx != nullptr && lane < a.num_topk) {
          layout.idx(slot)[lane] = static_cast<int32_t>(a.topk_idx[static_cast<int64_t>(t) * a.num_topk + lane]);
          layout.weights(slot)[lane] = a.topk_weights != nullptr ? a.topk_weights[static_cast<int64_t>(t) * a.num_topk + lane] : 0.f;
        }
        if (lane == 0) {
          *layout.source(slot) = t;
          *layout.tag(slot) = chunk_masks[i];
        }
      }
      if (peer != nullptr) {
        rdma_mapped_stores_done();  // the lanes' stores into x's ring, fenced, before the group barrier and the tail
      } else {
        rdma_put_rows<kUnroll>(c, nullptr, x, ch, tail + lo, hi - lo, a.rdma_slots, a.rdma_slot_bytes, lane);
      }
      ptx::group_sync(bar, threads);  // every warp's (fenced) slot stores / completed puts precede the tail
      tail += n;
      if (leader) {
        rdma_signal_tail(c, x, ch, tail);
        *reinterpret_cast<volatile uint64_t*>(&ctl->tail_copy[ch][x]) = tail;
      }
    }
  }
  if (leader && any_remote) nvshmem_quiet();  // complete the tail signals before the kernel ends
}

// ------------------------------------------------------------------ direct mode: rows into the domain's outputs
// The output blocks of local rank j (call.blocks[j], published in its NVLink buffer, which this rank maps) as
// intranode's direct dispatch lays them out (DirectPayload: x, scales; DirectMeta: top-k idx int64, weights, source
// int32), `rows` rows each. Every writer: plain stores, published by end_direct_call (system fence, block barrier,
// red.release.sys of the arrival; j's block 0 acquires every arrival before its kernel ends).

// One warp: the row in RDMA slot `src` into row `row` of the outputs (out, meta) of the rank whose experts start at
// `lo`: the FIFO forwarder's field work (top-k rebased, weight 0 where not local) and the FIFO receiver's stores in
// one. zero: the slot is laid out by other arguments (cached, its source's RDMA ring signature differs): a zero row
// as zero_row writes it, nothing read.
__device__ __forceinline__ void write_slot_row(const DispatchArgs& a, const DispatchSlot& layout, uint8_t* src,
                                               uint8_t* out, uint8_t* meta, int64_t rows, int64_t row, int lo,
                                               bool zero, int lane) {
  const DirectPayload o{rows, a.hidden_bytes, a.num_scales};
  int4* x = reinterpret_cast<int4*>(out + o.x_offset() + row * a.hidden_bytes);
  int32_t* scales = reinterpret_cast<int32_t*>(out + o.scales_offset()) + row * a.num_scales;
  if (zero) {
    for (int v = lane; v < a.hidden_bytes / 16; v += 32) x[v] = make_int4(0, 0, 0, 0);
    for (int k = lane; k < a.num_scales; k += 32) scales[k] = 0;
  } else {
    warp_copy<true, kUnroll>(x, reinterpret_cast<const int4*>(src), a.hidden_bytes / 16, lane);
    for (int k = lane; k < a.num_scales; k += 32) scales[k] = ptx::ld_cg(layout.scales(src) + k);
  }
  if (!a.write_meta) return;
  const DirectMeta m{rows, a.num_topk};
  if (lane < a.num_topk) {
    int local = -1;
    float weight = 0.f;
    if (!zero) {
      const int e = ptx::ld_cg(layout.idx(src) + lane);
      local = (e >= lo && e < lo + a.experts_per_rank) ? e - lo : -1;
      if (local >= 0) weight = __int_as_float(ptx::ld_cg(reinterpret_cast<const int*>(layout.weights(src)) + lane));
    }
    reinterpret_cast<int64_t*>(meta + m.idx_offset())[row * a.num_topk + lane] = local;
    reinterpret_cast<float*>(meta + m.weights_offset())[row * a.num_topk + lane] = weight;
  }
  if (lane == 0) reinterpret_cast<int32_t*>(meta + m.src_offset())[row] = zero ? -1 : ptx::ld_cg(layout.source(src));
}

// One warp: my token t's row into row `row` of the outputs (out, meta) of the rank whose experts start at `lo`: the
// same fields as the RDMA sender's slot followed by the forwarder's rebase (write_slot_row), from my inputs.
__device__ __forceinline__ void write_token_row(const DispatchArgs& a, int t, uint8_t* out, uint8_t* meta,
                                                int64_t rows, int64_t row, int lo, int lane) {
  const DirectPayload o{rows, a.hidden_bytes, a.num_scales};
  warp_copy<false, kUnroll>(reinterpret_cast<int4*>(out + o.x_offset() + row * a.hidden_bytes),
                            reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.hidden_bytes),
                            a.hidden_bytes / 16, lane);
  int32_t* scales = reinterpret_cast<int32_t*>(out + o.scales_offset()) + row * a.num_scales;
  for (int k = lane; k < a.num_scales; k += 32) scales[k] = a.scales[static_cast<int64_t>(t) * a.num_scales + k];
  if (!a.write_meta) return;
  const DirectMeta m{rows, a.num_topk};
  if (lane < a.num_topk) {
    const int e = static_cast<int32_t>(a.topk_idx[static_cast<int64_t>(t) * a.num_topk + lane]);
    const int local = (e >= lo && e < lo + a.experts_per_rank) ? e - lo : -1;
    reinterpret_cast<int64_t*>(meta + m.idx_offset())[row * a.num_topk + lane] = local;
    reinterpret_cast<float*>(meta + m.weights_offset())[row * a.num_topk + lane] =
        (local >= 0 && a.topk_weights != nullptr) ? a.topk_weights[static_cast<int64_t>(t) * a.num_topk + lane] : 0.f;
  }
  if (lane == 0) reinterpret_cast<int32_t*>(meta + m.src_offset())[row] = t;
}

// ------------------------------------------------------------------ forwarder
// Steps of up to kFwdStep rows of one RDMA ring. Warp 0 picks the ring (lanes test the rings in
// parallel, round robin), reads the rows' masks (lane i: row i), ranks each row among the rows for
// local rank j (ballot) and reserves the NVL slots (lane j: FIFO j); CTA barrier; all warps copy;
// CTA barrier; warp 0 publishes the FIFO tails (lane j, st.release.sys: the barrier covers every
// warp's slot stores) and returns the RDMA credit (lane 0), then goes straight on to pick the next
// step while the other warps wait at the first barrier: two barriers per step.
// Direct mode (the domain's verdict): no ring of my own domain (its rows are the local direct sender's), no FIFO:
// item (row i, local rank j) goes straight to row fwd_row_offset[x][j][ch] + s_run[x][j] + s_pos[i][j] of j's
// outputs (the row j's FIFO receiver would give it: source (x, my local index)'s rows for j in this channel, in
// token order), dropped at or past j's row count; no reservation, no tail release, the RDMA credit as before.
// In both modes the forwarder records fwd_rows (when asked) from the same row numbers.
constexpr int kFwdStep = kMaxChunk;

template <bool kDirectCall>
__device__ void forward(const DispatchArgs& a, const DirectCall& call, bool direct_verdict, int ch, int warp, int lane,
                        const Watchdog& dog) {
  const bool direct = kDirectCall && direct_verdict;  // a constant false in the pool-less kernel
  const Common& c = a.c;
  const int D = c.num_domains, nvl = c.nvl_size, C = a.num_channels;
  RdmaControl* rctl = rdma_ctl(c);
  nvlink::Control* nctl = nvl_ctl(c, c.local);
  const DispatchSlot rlayout{a.hidden_bytes, a.num_scales, a.num_topk};
  const DispatchSlot nlayout = rlayout;
  const int L = a.experts_per_rank;
  const int step_max = min(kFwdStep, a.nvl_slots);

  __shared__ uint64_t rhead[kMaxDomains];   // rows consumed from my RDMA ring (ch, x)
  __shared__ int consumed[kMaxDomains], expect[kMaxDomains];
  __shared__ int s_x, s_n, s_ok, s_dis;
  __shared__ int s_bad[kMaxDomains];        // cached: 1 if source domain x's RDMA ring signature differs
  __shared__ int s_mask[kFwdStep];
  __shared__ int s_pos[kFwdStep][kMaxNvl];  // position of row i among the rows for j in this step, or -1
  __shared__ int s_cnt[kMaxNvl];            // rows for j in this step
  __shared__ uint64_t s_tail[kMaxNvl];      // tail of NVL FIFO (ch, me -> j) before this step
  // kDirectCall: rows of source (x, my local index) for j so far in this channel (direct rows and fwd_rows).
  __shared__ int s_run[kMaxDomains][kMaxNvl];
  for (int x = threadIdx.x; x < D; x += blockDim.x) {
    rhead[x] = *reinterpret_cast<volatile uint64_t*>(&rctl->head_copy[ch][x]);
    consumed[x] = 0;
    s_bad[x] = 0;
    expect[x] = (direct && x == c.domain) ? 0 : a.fwd_offset[x * (C + 1) + ch + 1] - a.fwd_offset[x * (C + 1) + ch];
  }
  if constexpr (kDirectCall) {
    for (int i = threadIdx.x; i < D * nvl; i += blockDim.x) s_run[i / nvl][i % nvl] = 0;
  }
  if (threadIdx.x < nvl) {
    s_tail[threadIdx.x] = *reinterpret_cast<volatile uint64_t*>(&nctl->tail_copy[ch][threadIdx.x]);
    // Cached: the NVLink ring signature into local rank j's Control, published by every FIFO tail release of
    // this block to j below (after the barrier that follows).
    if (a.nvl_signature != 0) publish_ring_signature(nvl_ctl(c, threadIdx.x), c.local, a.nvl_signature);
  }
  __syncthreads();

  int rr = 0;  // warp 0: round-robin start
  while (true) {
    if (warp == 0) {
      int pick = -1, avail = 0, ok = 1, waiting = -1;
      while (true) {
        int first_ready = -1;
        waiting = -1;
        for (int base = 0; base < D && first_ready < 0; base += 32) {
          const int k = base + lane;
          const int x = (rr + k) % D;
          bool pending = false, ready = false;
          int have = 0;
          if (k < D && consumed[x] < expect[x]) {
            pending = true;
            const uint64_t t = ptx::ld_acquire_sys(&rctl->tail[ch][x]);
            if (t > rhead[x]) {
              ready = true;
              have = static_cast<int>(min(t - rhead[x], static_cast<uint64_t>(expect[x] - consumed[x])));
            }
          }
          const unsigned rb = __ballot_sync(0xffffffffu, ready), pb = __ballot_sync(0xffffffffu, pending);
          if (waiting < 0 && pb != 0) waiting = (rr + base + __ffs(pb) - 1) % D;
          if (rb != 0) {
            const int src = __ffs(rb) - 1;
            first_ready = (rr + base + src) % D;
            avail = __shfl_sync(0xffffffffu, have, src);
          }
        }
        if (first_ready >= 0) {
          pick = first_ready;
          break;
        }
        if (waiting < 0) break;  // every ring finished
        int expired = 0;
        if (lane == 0) expired = dog.expired(kPhaseForward, team_pe(c, waiting));
        if (__shfl_sync(0xffffffffu, expired, 0)) {  // one answer for the whole warp
          ok = 0;
          break;
        }
      }
      __syncwarp();  // the lane's tail acquire before every lane's slot loads
      int n = 0, dis = 0;
      if (pick >= 0 && ok) {
        rr = pick + 1;
        n = min(avail, step_max);
        // Cached, the first rows of ring (ch, pick) in this call: the tail acquired past them published the
        // source's RDMA ring signature (rdma_publish_signature). Every lane reads it; lane 0 records a difference.
        if (a.rdma_signature != 0 && consumed[pick] == 0) {
          dis = ring_word_disagrees(&rctl->ring_signature[pick], nctl, c.mailbox, team_pe(c, pick), a.rdma_signature,
                                    lane == 0);
          if (lane == 0) s_bad[pick] = dis;
        } else {
          dis = s_bad[pick];
        }
        int mask = 0;
        if (lane < n) {
          if (dis) {  // the slots are laid out by other arguments: the handle names the row's local ranks
            const int idx = a.fwd_offset[pick * (C + 1) + ch] + consumed[pick] + lane;
            mask = a.handle_fwd_mask != nullptr && idx < a.fwd_capacity ? a.handle_fwd_mask[idx] : 0;
          } else {
            const uint8_t* slot = ring_slot(rdma_recv_ring(c, pick, ch, a.rdma_slots, a.rdma_slot_bytes),
                                            rhead[pick] + lane, a.rdma_slots, a.rdma_slot_bytes);
            mask = ptx::ld_cg(rlayout.tag(const_cast<uint8_t*>(slot)));
          }
          s_mask[lane] = mask;
        }
        int my_cnt = 0;
        for (int j = 0; j < nvl; ++j) {
          const unsigned b = __ballot_sync(0xffffffffu, lane < n && ((mask >> j) & 1));
          if (lane < n) s_pos[lane][j] = ((mask >> j) & 1) ? __popc(b & ((1u << lane) - 1u)) : -1;
          if (lane == j) my_cnt = __popc(b);
        }
        int good = 1;
        if (lane < nvl) {  // FIFO head: written by local rank `lane`'s receiver after its slot loads
          s_cnt[lane] = my_cnt;
          uint64_t consumed;
          good = my_cnt == 0 || direct ||
                 wait_while(&nctl->fifo_head[ch][lane], consumed,
                            [&](uint64_t h) { return s_tail[lane] + my_cnt - h > static_cast<uint64_t>(a.nvl_slots); },
                            dog, kPhaseForwardSend, c.domain * nvl + lane);
        }
        ok = __all_sync(0xffffffffu, good);
      }
      if (lane == 0) {
        s_x = pick;
        s_n = n;
        s_ok = ok;
        s_dis = dis;
      }
    }
    __syncthreads();  // warp 0's picks, masks, reservations (and acquires) before the copies
    if (!s_ok) return;
    const int x = s_x, n = s_n;
    if (n == 0) break;
    const uint8_t* ring = rdma_recv_ring(c, x, ch, a.rdma_slots, a.rdma_slot_bytes);
    // Items (row i, local rank j), one warp each: a loop per mode (one loop with a branch per item spills more in
    // the pool Buffer's kernel).
    for (int item = warp; direct && item < n * nvl; item += kWarps) {  // direct: into j's outputs
      const int i = item / nvl, j = item % nvl;
      const int pos = s_pos[i][j];
      if (pos < 0) continue;
      uint8_t* src = ring_slot(const_cast<uint8_t*>(ring), rhead[x] + i, a.rdma_slots, a.rdma_slot_bytes);
      const DirectOutputBlocks& to = call.blocks[j];
      const int64_t row = a.fwd_row_offset[(x * nvl + j) * C + ch] + s_run[x][j] + pos;
      if (row < to.out_rows) {  // else more rows than num_worst_tokens: dropped, as the FIFO receiver drops them
        write_slot_row(a, rlayout, src, c.nvl[j] + to.out_offset, c.nvl[j] + to.meta_offset, to.out_rows, row,
                       (c.domain * nvl + j) * L, s_dis, lane);
      }
    }
    for (int item = warp; !direct && item < n * nvl; item += kWarps) {  // FIFO: into FIFO (ch, me -> j)
      const int i = item / nvl, j = item % nvl;
      const int pos = s_pos[i][j];
      if (pos < 0) continue;
      uint8_t* src = ring_slot(const_cast<uint8_t*>(ring), rhead[x] + i, a.rdma_slots, a.rdma_slot_bytes);
      uint8_t* dst = ring_slot(nvl_ring(c, c.nvl[j], c.local, ch, a.nvl_slots, a.nvl_slot_bytes), s_tail[j] + pos,
                               a.nvl_slots, a.nvl_slot_bytes);
      if (s_dis) {  // a zero row in this rank's layout, tagged with its source domain (nothing read from src)
        zero_slot(nlayout, dst, a.hidden_bytes, a.num_scales, a.num_topk, lane);
        if (lane == 0) *nlayout.tag(dst) = x;
        continue;
      }
      warp_copy<true, kUnroll>(reinterpret_cast<int4*>(dst), reinterpret_cast<const int4*>(src), a.hidden_bytes / 16, lane);
      for (int k = lane; k < a.num_scales; k += 32) nlayout.scales(dst)[k] = ptx::ld_cg(rlayout.scales(src) + k);
      if (lane < a.num_topk) {
        const int e = ptx::ld_cg(rlayout.idx(src) + lane);
        const int lo = (c.domain * nvl + j) * L;
        const int local = (e >= lo && e < lo + L) ? e - lo : -1;
        nlayout.idx(dst)[lane] = local;
        nlayout.weights(dst)[lane] =
            local >= 0 ? __int_as_float(ptx::ld_cg(reinterpret_cast<const int*>(rlayout.weights(src)) + lane)) : 0.f;
      }
      if (lane == 0) {
        *nlayout.source(dst) = ptx::ld_cg(rlayout.source(src));
        *nlayout.tag(dst) = x;
      }
    }
    if (a.fwd_mask != nullptr && static_cast<int>(threadIdx.x) < n) {
      const int idx = a.fwd_offset[x * (C + 1) + ch] + consumed[x] + threadIdx.x;
      if (idx < a.fwd_capacity) a.fwd_mask[idx] = s_mask[threadIdx.x];
    }
    // fwd_rows (pool Buffers only: never set without one), thread (i, j): row i's row at j.
    if (kDirectCall && a.fwd_rows != nullptr && static_cast<int>(threadIdx.x) < n * nvl) {
      const int i = threadIdx.x / nvl, j = threadIdx.x % nvl, pos = s_pos[i][j];
      const int idx = a.fwd_offset[x * (C + 1) + ch] + consumed[x] + i;
      const int64_t row = a.fwd_row_offset[(x * nvl + j) * C + ch] + s_run[x][j] + pos;
      if (idx < a.fwd_capacity) {
        a.fwd_rows[static_cast<int64_t>(idx) * nvl + j] = (pos >= 0 && row < call.blocks[j].out_rows) ? row : -1;
      }
    }
    __syncthreads();  // every NVL slot store and RDMA slot load of the step precede the flags
    if (warp == 0) {
      // After every use of this step's s_run (the barrier above).
      if (kDirectCall && lane < nvl) s_run[x][lane] += s_cnt[lane];
      if (!direct && lane < nvl && s_cnt[lane] > 0) {
        s_tail[lane] += s_cnt[lane];
        ptx::st_release_sys(&nvl_ctl(c, lane)->fifo_tail[ch][c.local], s_tail[lane]);
        *reinterpret_cast<volatile uint64_t*>(&nctl->tail_copy[ch][lane]) = s_tail[lane];
      }
      __syncwarp();
      if (lane == 0) {
        rhead[x] += n;
        consumed[x] += n;
        rdma_credit(c, x, ch, rhead[x]);  // the sender may overwrite these slots now
      }
      __syncwarp();
    }
  }
  if (threadIdx.x == 0) {
    for (int x = 0; x < D; ++x) rctl->head_copy[ch][x] = rhead[x];
    nvshmem_quiet();  // complete the credit signals before the kernel ends
  }
}

// ------------------------------------------------------------------ NVLink receiver
__device__ void nvl_receive(const DispatchArgs& a, int ch, int l, int group_warp, int warps, int lane,
                            uint64_t* shared_tail, int* shared_bad, int* rows, int* next, const Watchdog& dog) {
  const Common& c = a.c;
  const int nvl = c.nvl_size, C = a.num_channels;
  nvlink::Control* nctl = nvl_ctl(c, c.local);
  ChannelReceiver rx{nvl_ring(c, c.nvl[c.local], l, ch, a.nvl_slots, a.nvl_slot_bytes), &nctl->fifo_tail[ch][l],
                     &nvl_ctl(c, l)->fifo_head[ch][c.local], &nctl->head_copy[ch][l], a.nvl_slots, a.nvl_slot_bytes,
                     *reinterpret_cast<volatile uint64_t*>(&nctl->head_copy[ch][l])};
  const DispatchSlot layout{a.hidden_bytes, a.num_scales, a.num_topk};
  const int bar = 1 + l, threads = warps * 32;
  const bool leader = group_warp == 0 && lane == 0;
  int total = 0;
  for (int x = 0; x < c.num_domains; ++x) {
    const int* off = a.recv_channel_offset + (x * nvl + l) * (C + 1);
    total += off[ch + 1] - off[ch];
    if (leader) next[x] = off[ch];  // next output row of source (x, l) in this channel
  }
  const uint64_t last = rx.head + total;
  const int k = a.num_topk;
  while (rx.head < last) {
    if (group_warp == 0) {
      // Lane 0 waits for rows; lane i ranks row i among this step's rows of its source domain
      // (match_any) to give it its output row; the last lane of each domain advances next[x].
      uint64_t seen = 0;
      if (lane == 0) {
        seen = rx.wait(rx.head + 1, dog, kPhaseNvlRecv, c.domain * nvl + l);
        *shared_tail = seen;
        // Cached, first step: lane 0's tail acquire (past the call's first row) published the forwarder's
        // NVLink ring signature (stored before its first tail release to me).
        // *shared_bad: 0 until then (and in a fresh dispatch), then 1 (signatures agree) or 2 (slots not read).
        if (seen != 0 && *shared_bad == 0 && a.nvl_signature != 0) {
          *shared_bad = ring_word_disagrees(&nctl->ring_signature[l], nctl, c.mailbox, c.domain * nvl + l,
                                            a.nvl_signature, true) ? 2 : 1;
        }
      }
      seen = __shfl_sync(0xffffffffu, seen, 0);
      __syncwarp();  // lane 0's tail acquire before every lane's slot loads
      if (seen != 0 && *shared_bad != 2) {
        const int n = static_cast<int>(min(min(seen, last) - rx.head, static_cast<uint64_t>(kMaxChunk)));
        const int x = lane < n ? ptx::ld_cg(layout.tag(const_cast<uint8_t*>(rx.slot(rx.head + lane)))) : -1;
        const unsigned same = __match_any_sync(0xffffffffu, x);
        const int base = lane < n ? next[x] : 0;
        __syncwarp();
        if (lane < n) {
          rows[lane] = base + __popc(same & ((1u << lane) - 1u));
          if (lane == 31 - __clz(same)) next[x] = base + __popc(same);
        }
        __syncwarp();
      }
    }
    ptx::group_sync(bar, threads);
    const uint64_t seen = *shared_tail;
    if (seen == 0) return;
    const int n = static_cast<int>(min(min(seen, last) - rx.head, static_cast<uint64_t>(kMaxChunk)));
    for (int i = group_warp; *shared_bad != 2 && i < n; i += warps) {
      const int64_t row = rows[i];
      if (row >= a.num_rows) continue;  // more rows than num_worst_tokens: reported by notify
      uint8_t* slot = const_cast<uint8_t*>(rx.slot(rx.head + i));
      warp_copy<true, kUnroll>(reinterpret_cast<int4*>(a.recv_x + row * a.hidden_bytes), reinterpret_cast<const int4*>(slot),
                               a.hidden_bytes / 16, lane);
      for (int j = lane; j < a.num_scales; j += 32) a.recv_scales[row * a.num_scales + j] = ptx::ld_cg(layout.scales(slot) + j);
      if (a.recv_topk_idx != nullptr && lane < k) {
        a.recv_topk_idx[row * k + lane] = ptx::ld_cg(layout.idx(slot) + lane);
        a.recv_topk_weights[row * k + lane] = __int_as_float(ptx::ld_cg(reinterpret_cast<const int*>(layout.weights(slot)) + lane));
      }
      if (a.recv_src_idx != nullptr && lane == 0) a.recv_src_idx[row] = ptx::ld_cg(layout.source(slot));
    }
    ptx::group_sync(bar, threads);  // every load of these slots precedes the release
    rx.release(n, leader);
  }
  rx.finish(leader);
  if (*shared_bad == 2) {  // no slot of this FIFO was read: every row of the sources it carries in the channel is zero
    for (int x = 0; x < c.num_domains; ++x) {
      const int* off = a.recv_channel_offset + (x * nvl + l) * (C + 1);
      for (int64_t row = off[ch] + group_warp; row < min(off[ch + 1], a.num_rows); row += warps) zero_row(a, row, lane);
    }
  }
}

// ------------------------------------------------------------------ local direct sender (direct mode)
// What the NVLink receiver block becomes in direct mode: a forwarder whose ring is my own inputs. The channel's
// tokens with a destination in my domain, in token order: the k-th one for local rank j goes to row
// fwd_row_offset[my domain][j][ch] + k of j's outputs (where notify put my rows of this channel at j: the row the
// FIFO path gives it), dropped at or past j's row count. Windows of kThreads tokens: thread i takes token w0 + i and
// builds its mask over my domain; warp ballots (one per local rank j, one for "any", kept in shared memory by
// window parity) rank each token among the window's tokens for j; lane j of each warp adds the earlier warps' and
// windows' counts (start). Then warp w writes the rows of its own 32 tokens, and records, for its tokens with a
// destination here, fwd_mask (index fwd_offset[my domain][ch] + rank among them: the combine's ring path needs it)
// and fwd_rows. Two block barriers per window: after the ballots, and after the writes (before the counts of the
// window move into `base`; the other parity's ballots are the next window's).
__device__ void local_direct_send(const DispatchArgs& a, const DirectCall& call, int ch, int warp, int lane) {
  const Common& c = a.c;
  const int nvl = c.nvl_size, R = c.num_ranks, C = a.num_channels, L = a.experts_per_rank;
  __shared__ unsigned ballots[2][kWarps][kMaxNvl + 1];  // [parity][warp][j]: tokens for j; [.][.][nvl]: any
  __shared__ int base[kMaxNvl + 1];                     // tokens for j (any) in the windows before this one
  if (threadIdx.x <= nvl) base[threadIdx.x] = 0;
  int begin, end;
  channel_range(a.num_tokens, C, ch, begin, end);
  const unsigned below = (1u << lane) - 1u;
  int parity = 0;
  for (int w0 = begin; w0 < end; w0 += kThreads, parity ^= 1) {
    const int t = w0 + static_cast<int>(threadIdx.x);
    int mask = 0;
    if (t < end) {
      for (int j = 0; j < nvl; ++j) mask |= a.is_token_in_rank[static_cast<int64_t>(t) * R + c.domain * nvl + j] << j;
    }
    for (int j = 0; j <= nvl; ++j) {
      const unsigned b = __ballot_sync(0xffffffffu, j < nvl ? ((mask >> j) & 1) : mask != 0);
      if (lane == 0) ballots[parity][warp][j] = b;
    }
    __syncthreads();  // every warp's ballots (and the previous window's base) before the starts
    int start = 0;    // lane j <= nvl: the first row (j < nvl) or forwarded index (j = nvl) of this warp's tokens
    if (lane <= nvl) {
      start = base[lane] + (lane < nvl ? a.fwd_row_offset[(c.domain * nvl + lane) * C + ch]
                                       : a.fwd_offset[c.domain * (C + 1) + ch]);
      for (int w = 0; w < warp; ++w) start += __popc(ballots[parity][w][lane]);
    }
    // fwd_mask / fwd_rows of this lane's token (idx: its rank among the channel's tokens with a destination here).
    const int idx = __shfl_sync(0xffffffffu, start, nvl) + __popc(ballots[parity][warp][nvl] & below);
    for (int j = 0; j < nvl; ++j) {
      const int64_t row = __shfl_sync(0xffffffffu, start, j) + __popc(ballots[parity][warp][j] & below);
      if (a.fwd_rows != nullptr && mask != 0 && idx < a.fwd_capacity) {
        a.fwd_rows[static_cast<int64_t>(idx) * nvl + j] = (((mask >> j) & 1) && row < call.blocks[j].out_rows) ? row : -1;
      }
    }
    if (a.fwd_mask != nullptr && mask != 0 && idx < a.fwd_capacity) a.fwd_mask[idx] = mask;
    // The rows: token i of this warp to each j of its mask.
    for (unsigned todo = ballots[parity][warp][nvl]; todo != 0; todo &= todo - 1) {
      const int i = __ffs(todo) - 1;
      const int token_mask = __shfl_sync(0xffffffffu, mask, i);
      for (int j = 0; j < nvl; ++j) {
        const int64_t row = __shfl_sync(0xffffffffu, start, j) + __popc(ballots[parity][warp][j] & ((1u << i) - 1u));
        const DirectOutputBlocks& to = call.blocks[j];
        if (!((token_mask >> j) & 1) || row >= to.out_rows) continue;  // warp-uniform
        write_token_row(a, w0 + warp * 32 + i, c.nvl[j] + to.out_offset, c.nvl[j] + to.meta_offset, to.out_rows, row,
                        (c.domain * nvl + j) * L, lane);
      }
    }
    __syncthreads();  // every warp read this window's base and ballots
    if (threadIdx.x <= nvl) {
      for (int w = 0; w < kWarps; ++w) base[threadIdx.x] += __popc(ballots[parity][w][threadIdx.x]);
    }
  }
}

// num_worst_tokens: rows past the received count are zero / -1 / 0 (as the intranode kernel). Every thread of the
// receiver blocks takes its share (block of channel ch of C).
__device__ void pad_worst_rows(const DispatchArgs& a, int ch) {
  const int R = a.c.num_ranks;
  const int received = a.recv_channel_offset[(R - 1) * (a.num_channels + 1) + a.num_channels];
  const int64_t first = min(received, a.num_rows), extra = a.num_rows - first;
  const int64_t stride = static_cast<int64_t>(a.num_channels) * blockDim.x;
  const int64_t start = static_cast<int64_t>(ch) * blockDim.x + threadIdx.x;
  const int vecs = a.hidden_bytes / 16;
  auto* x_pad = reinterpret_cast<int4*>(a.recv_x + first * a.hidden_bytes);
  for (int64_t i = start; i < extra * vecs; i += stride) x_pad[i] = make_int4(0, 0, 0, 0);
  for (int64_t i = start; i < extra * a.num_scales; i += stride) a.recv_scales[first * a.num_scales + i] = 0;
  for (int64_t i = start; a.recv_topk_idx != nullptr && i < extra * a.num_topk; i += stride) {
    a.recv_topk_idx[first * a.num_topk + i] = -1;
    a.recv_topk_weights[first * a.num_topk + i] = 0.f;
  }
  for (int64_t i = start; a.recv_src_idx != nullptr && i < extra; i += stride) a.recv_src_idx[first + i] = -1;
}

// The direct-call site of the NVLink hop: Control::direct, its phases, timeouts naming group ranks.
__device__ __forceinline__ intranode::DirectCallSite<DirectOutputBlocks> nvl_direct_site(const Common& c) {
  return {&nvlink::Control::direct, kPhaseNvlDirectReady, kPhaseNvlDirectArrive, c.domain * c.nvl_size};
}

// Steps 3-4 of the direct-call protocol (end_direct_call) for the NVLink hop, out of line: inlined into the kernel,
// the state it needs after the roles (the watchdog above all) stays live in registers through every role, and the
// pool Buffer's kernel spills more (ptxas); out of line, the watchdog lives in the kernel's stack frame instead.
__device__ __noinline__ void end_nvl_direct_call(DirectCall& call, const intranode::Common& domain, const Common& c,
                                                 const Watchdog& dog) {
  intranode::end_direct_call(call, domain, nvl_direct_site(c), dog);
}

// kDirectCall: the launch's a.direct_call (launch_dispatch picks the instantiation), so a pool-less Buffer runs a
// kernel with no direct-mode code at all (no protocol words, no local direct sender, no direct writes, no fwd_rows:
// the host passes fwd_rows only with a pool), while a pool Buffer's kernel still decides direct or FIFO per call.
template <bool kDirectCall>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(DispatchArgs a) {
  __shared__ DirectCall call;
  __shared__ intranode::Common domain;  // kDirectCall: the domain's buffers for the protocol
  __shared__ int chunk_tokens[kWarps][kMaxChunk];
  __shared__ int chunk_masks[kWarps][kMaxChunk];
  __shared__ int shared_ok[kMaxNvl];
  __shared__ uint64_t shared_tail[kMaxNvl];
  __shared__ int shared_bad[kMaxNvl];
  __shared__ int rows[kMaxNvl][kMaxChunk];
  __shared__ int next[kMaxNvl][kMaxDomains];
  const Common& c = a.c;
  const int ch = blockIdx.x / 3, role = blockIdx.x % 3;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (call_refused(a.recv_channel_offset)) {  // the same word in every block: all leave, none reaches the barrier
    if (role == 2 && a.pad_rows) pad_worst_rows(a, ch);
    return;  // no ring, counter, drain wait or grid barrier: the next call starts from the same counters
  }
  const Watchdog dog = make_watchdog(c.timeout_ns, c.rank, &nvl_ctl(c, c.local)->timeout_claim, &c.mailbox->timeout,
                                     rdma_ctl(c)->peer_aborted);
  if (threadIdx.x < kMaxNvl) shared_bad[threadIdx.x] = 0;  // before the drain's block barriers
  // Direct NVLink hop: ready and verdict (direct_call.cuh steps 1-2) before the drain, whose barriers hand
  // call.in_pool to every thread (without a pool: FIFO mode, no word touched).
  if constexpr (kDirectCall) {
    if (threadIdx.x == 0) set_domain_common(domain, c);
    __syncthreads();
    const DirectOutputBlocks mine{a.out_offset, a.write_meta ? a.meta_offset : 0, a.out_rows};
    const auto accepts = [&](const DirectOutputBlocks& o) {
      return o.out_offset >= 0 && (!a.write_meta || o.meta_offset >= 0);
    };
    if (!intranode::begin_direct_call(call, domain, nvl_direct_site(c), mine, a.layout, dog, accepts)) return;
  }
  if (!drain_previous_calls(c, dog)) return;  // earlier calls drained; no ring written before this
  // The same in every block of every rank of the domain; a constant false without a pool.
  const bool direct = kDirectCall && call.in_pool != 0;
  if (role == 2 && a.pad_rows) pad_worst_rows(a, ch);

  if (role == 1) {
    forward<kDirectCall>(a, call, direct, ch, warp, lane, dog);
  } else if (role == 2 && direct) {
    local_direct_send(a, call, ch, warp, lane);
  } else {
    const int groups = role == 0 ? min(direct ? c.num_domains - 1 : c.num_domains, kMaxNvl) : c.nvl_size;
    const int warps = kWarps / max(groups, 1);
    const int group = warp / warps, group_warp = warp % warps;
    if (group < groups) {  // idle warps when 24 % groups != 0 join no named barrier
      if (role == 0) {
        rdma_send(a, ch, group, groups, group_warp, warps, lane, chunk_tokens[warp], chunk_masks[warp],
                  &shared_ok[group], direct, dog);
      } else {
        nvl_receive(a, ch, group, group_warp, warps, lane, &shared_tail[group], &shared_bad[group], rows[group],
                    next[group], dog);
      }
    }
  }
  // Arrival at every domain peer, after this block's last store into their outputs (either mode), and (block 0)
  // completion: every peer's rows into my outputs are in before my kernel ends (direct_call.cuh steps 3-4).
  if constexpr (kDirectCall) end_nvl_direct_call(call, domain, c, dog);
}

}  // namespace

void launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  if (args.direct_call) {
    dispatch_kernel<true><<<3 * args.num_channels, kThreads, 0, stream>>>(args);
  } else {
    dispatch_kernel<false><<<3 * args.num_channels, kThreads, 0, stream>>>(args);
  }
  check_launch("internode dispatch_kernel");
}

}  // namespace moe_ep::internode
