// Internode notify (1 block): before a fresh dispatch every rank learns what it receives (per source
// rank and channel, per local expert) and, as its team's forwarder, how many tokens it forwards per
// (source domain, channel). Two stages, so counts never cross domains except inside a team:
//
// 1. Team stage (NVSHMEM). Rank s builds, for every domain x, one message in its symmetric staging
//    area: flags, its totals towards every rank [R], its inclusive per-channel prefix of tokens bound
//    for domain x [C], and for each local rank j of x: its per-channel prefix of rows for (x, j) [C]
//    and its counts of (x, j)'s experts [L]. One warp puts it with putmem_signal into slot
//    [parity][my domain] of the team member of x (signal notify_signal[my domain] = epoch), then
//    nvshmem_quiet. Each rank waits (ld.acquire.sys on its own words) for the epoch from every team
//    member.
// 2. Domain stage (NVLink). The forwarder relays, for every source s of its team and every local
//    rank j, the part meant for j into j's NVLink buffer (message [parity][s]: flags, totals [R],
//    channel prefix [C], experts [L]); system fence; then the intranode-style barrier of the domain
//    (epoch stored with st.release.sys into every local rank's barrier_signal[me], acquired back).
//    After it every rank holds one message from each of the R sources and derives what intranode
//    notify derives (rank prefix matrix, channel offsets, expert counts, overflow) plus, as a
//    forwarder, fwd_offset and fwd_row_offset, and writes the mailbox (sequence number last).
//
// Reuse of message slots: slot parity p is rewritten two notifies later. A team message of epoch
// e + 2 is put only after its writer received every team member's message of epoch e + 1, which
// each member sent after finishing notify e (including reading the parity-p slot); the domain
// messages follow the intranode argument (two barriers). The staging area is double-buffered by
// parity too, and each put is completed (quiet) inside the kernel.
//
// Agreement: a source's flags word (word 0 of both its messages, relayed unchanged) also carries its problem
// word in bits 1-3 (the host's, else one made from the layout kernel's bad-id bits in Control::bad_expert_ids,
// read and cleared here, else kProblemRingSignature when Control::ring_mismatch_seen is set) and 24 bits of its
// signature hash in bits 8-31. After the domain barrier every rank holds every source's flags word, so all
// reach the same verdict, before any result is derived; a disagreement refuses the call
// (common/refused_call.cuh: the tables of a call that received nothing, fwd_offset included, and kRefusedCall in
// recv_channel_offset[0][0], so that its data kernels move nothing on any rank) and is recorded like intranode
// notify's (kFlagSignatureMismatch, and sticky in the mailbox: the seq and each source's problem word). A notify
// that gave up waiting (timeout, either stage) refuses its call on this rank.
// fwd_offset is derived after the verdict (from the team messages, which stay in place until two notifies
// later), so a refused call's forwarders see no tokens either.
#include "kernels/common/launch_check.cuh"
#include "kernels/common/refused_call.cuh"
#include "kernels/internode/common.cuh"

namespace moe_ep::internode {
namespace {

constexpr int kNotifyThreads = 1024;
constexpr unsigned kProblemMask = 7;  // problem words travel in bits 1-3 of the flags word
static_assert(nvlink::kProblemRingSignature <= static_cast<int>(kProblemMask), "every problem word fits 3 bits");

__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(NotifyArgs a) {
  const Common& c = a.c;
  const int R = c.num_ranks, D = c.num_domains, nvl = c.nvl_size, me = c.rank;
  const int C = a.num_channels, L = a.num_experts / R;
  RdmaControl* rctl = rdma_ctl(c);
  nvlink::Control* nctl = nvl_ctl(c, c.local);
  nvlink::Mailbox* box = c.mailbox;

  __shared__ int count[kMaxChannels][kMaxRanks];     // my rows per (channel, destination rank)
  __shared__ int dcount[kMaxChannels][kMaxDomains];  // my tokens per (channel, destination domain)
  __shared__ int flags, arrived;
  __shared__ int refused;  // the verdict on this call (refused_call.cuh): 1 refused, 0 accepted
  __shared__ int problem;  // this rank's problem word (bits 1-3 of its flags word)
  for (int i = threadIdx.x; i < kMaxChannels * kMaxRanks; i += blockDim.x) (&count[0][0])[i] = 0;
  for (int i = threadIdx.x; i < kMaxChannels * kMaxDomains; i += blockDim.x) (&dcount[0][0])[i] = 0;
  if (threadIdx.x == 0) {
    flags = 0;
    arrived = 1;
    refused = 1;  // until the verdict after the domain barrier
    problem = a.problem;
    // Set (atomicOr) by layout kernels, which may run on another stream at the same time: read and cleared in
    // one atomic, so a bit set meanwhile is kept for the next notify, never lost between a read and a clear.
    const int bad = atomicExch(&nctl->bad_expert_ids, 0);
    if (bad != 0) {
      if (problem == 0) {
        problem = (bad & nvlink::kBadIdOutOfRange) ? nvlink::kProblemIdOutOfRange : nvlink::kProblemIdRepeated;
      }
    }
    // Set by this rank's receivers of earlier cached calls, either hop (common/ring_signature.cuh), ordered
    // before this kernel by the CommStream's events; read and cleared in one atomic like the bad ids, but only
    // when no other problem takes the word (else the next notify reports it). kProblemRingSignature (6) fits
    // the 3 bits a problem word travels in.
    if (problem == 0 && atomicExch(&nctl->ring_mismatch_seen, 0) != 0) problem = nvlink::kProblemRingSignature;
  }
  __syncthreads();

  const int per = (a.num_tokens + C - 1) / max(C, 1);
  for (int t = threadIdx.x; t < a.num_tokens; t += blockDim.x) {
    const int ch = t / per;
    for (int x = 0; x < D; ++x) {
      bool any = false;
      for (int j = 0; j < nvl; ++j) {
        const int r = x * nvl + j;
        if (a.is_token_in_rank[static_cast<int64_t>(t) * R + r]) {
          atomicAdd(&count[ch][r], 1);
          any = true;
        }
      }
      if (any) atomicAdd(&dcount[ch][x], 1);
    }
  }
  __syncthreads();
  // Inclusive prefixes over channels (rank columns, then domain columns).
  for (int col = threadIdx.x; col < R + D; col += blockDim.x) {
    int sum = 0;
    for (int ch = 0; ch < C; ++ch) {
      int& v = col < R ? count[ch][col] : dcount[ch][col - R];
      sum += v;
      v = sum;
    }
    if (col < R && sum != a.num_tokens_per_rank[col]) atomicOr(&flags, nvlink::kFlagLayoutMismatch);
  }
  __syncthreads();

  // 1. Team messages.
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(&nctl->barrier_epoch) + 1;
  const int parity = static_cast<int>(epoch & 1);
  const int M = c.layout.rdma_msg_ints;
  const int head_words = 1 + R + C, per_rank = C + L;
  const int words = head_words + nvl * per_rank;
  int* staging = reinterpret_cast<int*>(c.rdma + c.layout.rdma_msg_staging_offset) + static_cast<size_t>(parity) * D * M;
  int* inbox = reinterpret_cast<int*>(c.rdma + c.layout.rdma_msg_offset) + static_cast<size_t>(parity) * D * M;
  for (int i = threadIdx.x; i < D * words; i += blockDim.x) {
    const int x = i / words, w = i % words;
    int v;
    if (w == 0) {
      v = (flags & nvlink::kFlagLayoutMismatch) | ((problem & kProblemMask) << 1) |
          static_cast<int>((static_cast<unsigned>(a.signature_hash) & 0xFFFFFFu) << 8);
    } else if (w < 1 + R) {
      v = count[C - 1][w - 1];  // inclusive prefix at the last channel = total
    } else if (w < head_words) {
      v = dcount[w - 1 - R][x];
    } else {
      const int j = (w - head_words) / per_rank, k = (w - head_words) % per_rank, r = x * nvl + j;
      v = k < C ? count[k][r] : a.num_tokens_per_expert[r * L + (k - C)];
    }
    staging[static_cast<size_t>(x) * M + w] = v;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int x = warp; x < D; x += kNotifyThreads / 32) {
    if (lane == 0) __threadfence_system();
    __syncwarp();
    nvshmemx_putmem_signal_nbi_warp(inbox + static_cast<size_t>(c.domain) * M, staging + static_cast<size_t>(x) * M,
                                    static_cast<size_t>(words) * sizeof(int), &rctl->notify_signal[c.domain], epoch,
                                    NVSHMEM_SIGNAL_SET, team_pe(c, x));
  }
  if (warp < D) nvshmem_quiet();
  const Watchdog dog = make_watchdog(c.timeout_ns, me, &nctl->timeout_claim, &box->timeout, rctl->peer_aborted);
  if (threadIdx.x < D) {
    const int x = threadIdx.x;
    if (!wait_at_least(&rctl->notify_signal[x], epoch, dog, kPhaseNotifyTeam, team_pe(c, x))) atomicAnd(&arrived, 0);
  }
  __syncthreads();
  const bool team_arrived = arrived != 0;  // block-uniform (read before the barrier below lets thread 0 rewrite it)

  // 2. Relay (when every team message arrived; else straight to the refused results): message [parity][s] into
  // every local rank j's NVLink buffer, s = (x, my local index).
  auto team_word = [&](int x, int w) { return ptx::ld_volatile(inbox + static_cast<size_t>(x) * M + w); };
  const int N = c.layout.nvl_msg_ints, nwords = 1 + R + C + L;
  const int* mine = reinterpret_cast<const int*>(c.nvl[c.local] + c.layout.nvl_msg_offset) + static_cast<size_t>(parity) * R * N;
  auto word = [&](int s, int w) { return ptx::ld_volatile(mine + static_cast<size_t>(s) * N + w); };
  for (int i = threadIdx.x; team_arrived && i < D * nvl * nwords; i += blockDim.x) {
    const int x = i / (nvl * nwords), j = (i / nwords) % nvl, w = i % nwords;
    int v;
    if (w < 1 + R) {
      v = team_word(x, w);
    } else {
      v = team_word(x, head_words + j * per_rank + (w - 1 - R));
    }
    const int s = x * nvl + c.local;
    int* msg = reinterpret_cast<int*>(c.nvl[j] + c.layout.nvl_msg_offset) + (static_cast<size_t>(parity) * R + s) * N;
    msg[w] = v;
  }
  __threadfence_system();
  __syncthreads();

  // Domain barrier (the intranode barrier's words). Then thread 0, whose acquires order the R messages before
  // its reads, gives the verdict from their flags words: every source's 24 hash bits equal, no problem word.
  if (threadIdx.x == 0 && team_arrived) {
    nctl->barrier_epoch = epoch;
    for (int j = 0; j < nvl; ++j) ptx::st_release_sys(&nvl_ctl(c, j)->barrier_signal[c.local], epoch);
    int ok = 1;
    for (int j = 0; j < nvl && ok; ++j) {
      ok = wait_at_least(&nctl->barrier_signal[j], epoch, dog, kPhaseNotifyDomain, c.domain * nvl + j);
    }
    arrived = ok;
    int disagree = 0;
    for (int s = 0; s < R && ok; ++s) {
      const unsigned f = static_cast<unsigned>(word(s, 0));
      disagree |= (f >> 8) != (static_cast<unsigned>(word(0, 0)) >> 8);
      disagree |= ((f >> 1) & kProblemMask) != 0;
    }
    refused = !ok || disagree;
  }
  __syncthreads();

  // 3. Results from the R messages in my NVLink buffer (and, as the forwarder, the D team messages); a refused
  // call's from no message at all (every count 0), and kRefusedCall in recv_channel_offset[0][0]: its data
  // kernels, later on this stream, read it first.
  const bool none = refused != 0;
  auto sent = [&](int s, int w) { return none ? 0 : word(s, w); };  // source s's count word, 0 if refused
  auto team_sent = [&](int x, int w) { return none ? 0 : team_word(x, w); };
  // As the forwarder: fwd_offset [D][C + 1] over the flattened (source domain, channel) order.
  for (int i = threadIdx.x; i < D * (C + 1); i += blockDim.x) {
    const int x = i / (C + 1), ch = i % (C + 1);
    int base = 0;
    for (int p = 0; p < x; ++p) base += team_sent(p, 1 + R + C - 1);
    a.fwd_offset[i] = base + (ch == 0 ? 0 : team_sent(x, 1 + R + ch - 1));
  }
  // As the forwarder: fwd_row_offset [D][nvl][C]. Rank (my domain, j)'s rows from s = (x, my local index) start
  // after every earlier source's rows to it (the totals [R] of their messages, relayed unchanged into my buffer)
  // plus s's own rows to it in channels before c (s's channel prefix for (my domain, j), in x's team message):
  // the sum (d, j)'s notify forms for its recv_channel_offset[s][c] from the same words.
  for (int i = threadIdx.x; i < D * nvl * C; i += blockDim.x) {
    const int x = i / (nvl * C), j = (i / C) % nvl, ch = i % C;
    const int s = x * nvl + c.local, dest = c.domain * nvl + j;
    int base = 0;
    for (int p = 0; p < s; ++p) base += sent(p, 1 + dest);
    a.fwd_row_offset[i] = base + (ch == 0 ? 0 : team_sent(x, head_words + j * per_rank + ch - 1));
  }
  for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
    const int row = i / R, col = i % R;
    int sum = 0;
    for (int s = 0; s <= row; ++s) sum += sent(s, 1 + col);
    a.rank_prefix_matrix[i] = sum;
  }
  for (int i = threadIdx.x; i < R * (C + 1); i += blockDim.x) {
    const int s = i / (C + 1), ch = i % (C + 1);
    int base = 0;
    for (int p = 0; p < s; ++p) base += sent(p, 1 + me);
    a.recv_channel_offset[i] = (none && i == 0) ? nvlink::kRefusedCall : base + (ch == 0 ? 0 : sent(s, 1 + R + ch - 1));
  }
  const int align = a.expert_alignment;
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < R; ++s) sum += sent(s, 1 + R + C + l);
    const int padded = (sum + align - 1) / align * align;
    box->expert_counts[l] = padded;
    // On the device too: they count every pair sent here, so with num_worst_tokens they say how many rows
    // were needed even where the dispatch drops rows (read by kernels later on this stream).
    if (a.recv_expert_counts != nullptr) a.recv_expert_counts[l] = padded;
  }
  if (!arrived) {  // gave up waiting (a timeout, recorded): the refused tables above, no mailbox results
    if (threadIdx.x == 0) *reinterpret_cast<volatile int32_t*>(&box->seq) = a.seq;  // wake the host
    return;
  }
  if (threadIdx.x == 0) {
    int recv = 0, any = 0, fwd = 0;
    for (int s = 0; s < R; ++s) {
      recv += sent(s, 1 + me);
      any |= word(s, 0) & nvlink::kFlagLayoutMismatch;
    }
    // Agreement (the verdict after the domain barrier: arrived, so refused means the sources disagree; the same
    // R flags words on every rank, so the same verdict everywhere).
    if (none) {
      any |= nvlink::kFlagSignatureMismatch;
      if (*reinterpret_cast<volatile int32_t*>(&box->signature_mismatch) == 0) {  // keep the first one
        for (int s = 0; s < R; ++s) {
          box->signature_problems[s] = static_cast<int>((static_cast<unsigned>(word(s, 0)) >> 1) & kProblemMask);
        }
        box->signature_mismatch = a.seq;  // host-visible with the results, after the fence below
      }
    }
    for (int x = 0; x < D; ++x) fwd += team_sent(x, 1 + R + C - 1);
    for (int j = 0; j < R && a.num_worst_tokens > 0 && !none; ++j) {  // a refused call received nothing
      int rows = 0;
      for (int s = 0; s < R; ++s) rows += word(s, 1 + j);
      if (rows > a.num_worst_tokens && *reinterpret_cast<volatile int32_t*>(&box->overflow_rows) == 0) {
        box->overflow_rank = j;
        box->overflow_worst = a.num_worst_tokens;
        box->overflow_rows = rows;
      }
    }
    box->num_recv = recv;
    box->num_forward = fwd;
    box->flags = any;
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) *reinterpret_cast<volatile int32_t*>(&box->seq) = a.seq;
}

}  // namespace

void launch_notify(const NotifyArgs& args, cudaStream_t stream) {
  notify_kernel<<<1, kNotifyThreads, 0, stream>>>(args);
  check_launch("internode notify_kernel");
}

}  // namespace moe_ep::internode
