// Notify: before a fresh dispatch, every rank tells every other rank how many rows it will send
// (per rank, per channel, per expert), then all ranks meet at a barrier, then each rank derives
// the rank prefix matrix, where each (source, channel) lands in its receive buffer, and its
// receive counts, which go to host-mapped memory (the host's only synchronisation).
//
// Memory ordering: messages are plain stores into the peers' buffers (double-buffered by barrier
// epoch parity), each thread fences at system scope, the block barrier collects them, and thread 0's
// st.release.sys of its epoch into each peer's barrier_signal publishes them; a reader acquires every
// peer's signal (ld.acquire.sys) before the block barrier that precedes its volatile reads.
// A message slot of parity p is rewritten two barriers later, after its reader passed the barrier
// in between, so no cleaning is needed.
//
// Agreement: each message also carries the source's signature hash and problem word (nvlink_buffer.h; the
// problem word also reports a disagreeing ring signature that this rank's cached calls found since its last
// notify, common/ring_signature.cuh). After
// the barrier every rank compares all sources' pairs, so every rank reaches the same verdict, before it derives
// any result. A disagreement refuses the call (common/refused_call.cuh): its tables are those of a call that
// received nothing, with kRefusedCall in recv_channel_offset[0][0], so that its data kernels move nothing on any
// rank; it sets kFlagSignatureMismatch in this call's flags and, sticky, the call's seq and the problem words in
// the mailbox, which the host reports (after one all-gather of the full signatures, on every rank) at this
// call's wait or, for a call that does not wait, at its next synchronised dispatch. A notify that gave up
// waiting (timeout) refuses its call on this rank too, with the same tables.
#include "kernels/common/launch_check.cuh"
#include "kernels/common/refused_call.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/intranode/protocol.h"

namespace moe_ep::intranode {
namespace {

constexpr int kNotifyThreads = 1024;

__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(NotifyArgs a) {
  const int num_ranks = a.c.num_ranks, me = a.c.rank, num_channels = a.num_channels;
  const int num_local = a.num_experts / num_ranks;
  auto* ctl = reinterpret_cast<Control*>(a.c.peers[me]);
  Mailbox* box = a.c.mailbox;

  __shared__ int count[kMaxChannels][kMaxRanks];  // my rows per (channel, destination)
  __shared__ int total[kMaxRanks];
  __shared__ int flags;
  __shared__ int arrived;
  __shared__ int refused;  // the verdict on this call (refused_call.cuh): 1 refused, 0 accepted
  __shared__ int problem;  // this rank's problem word: the host's, else one from the layout kernel's bad ids
  for (int i = threadIdx.x; i < kMaxChannels * kMaxRanks; i += blockDim.x) (&count[0][0])[i] = 0;
  if (threadIdx.x == 0) {
    flags = 0;
    problem = a.problem;
    if (a.bad_expert_ids != nullptr) {
      // Set (atomicOr) by layout kernels, which may run on another stream at the same time (a layout on the
      // caller's stream beside an async dispatch's notify): read and cleared in one atomic, so a bit set
      // meanwhile is kept for the next notify, never lost between a read and a clear.
      const int bad = atomicExch(a.bad_expert_ids, 0);
      if (bad != 0) {
        if (problem == 0) problem = (bad & kBadIdOutOfRange) ? kProblemIdOutOfRange : kProblemIdRepeated;
      }
    }
    // Set by this rank's receivers of earlier cached calls (common/ring_signature.cuh), ordered before this
    // kernel by the CommStream's events; read and cleared in one atomic like the bad ids, but only when no other
    // problem takes the word (else the next notify reports it).
    if (problem == 0 && atomicExch(&ctl->ring_mismatch_seen, 0) != 0) {
      problem = kProblemRingSignature;
    }
  }
  __syncthreads();

  // 1. Rows per (channel, destination): channel c holds tokens [c * per, (c + 1) * per). A warp takes 32
  // tokens at a time; the lanes sending to d in the same channel add their count with one atomic (one per
  // lane would serialise 32 same-address shared atomics per warp and destination).
  const int per = (a.num_tokens + num_channels - 1) / num_channels;
  const int lane = threadIdx.x & 31;
  for (int t0 = threadIdx.x - lane; t0 < a.num_tokens; t0 += blockDim.x) {  // warp-uniform trip count
    const int t = t0 + lane;
    const int c = t < a.num_tokens ? t / per : -1;
    for (int d = 0; d < num_ranks; ++d) {
      const bool hit = c >= 0 && a.is_token_in_rank[static_cast<int64_t>(t) * num_ranks + d];
      const unsigned same = __match_any_sync(0xffffffffu, hit ? c : -1);
      if (hit && lane == __ffs(same) - 1) atomicAdd(&count[c][d], __popc(same));
    }
  }
  __syncthreads();
  if (threadIdx.x < num_ranks) {
    const int d = threadIdx.x;
    int sum = 0;
    for (int c = 0; c < num_channels; ++c) {
      sum += count[c][d];
      count[c][d] = sum;  // inclusive prefix over channels
    }
    total[d] = sum;
    if (sum != a.num_tokens_per_rank[d]) atomicOr(&flags, kFlagLayoutMismatch);
  }
  __syncthreads();

  // 2. Messages to every rank (me included) into slot [parity][me] of its buffer.
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(&ctl->barrier_epoch) + 1;
  const int parity = static_cast<int>(epoch & 1);
  const int words = kNotifyExperts + num_local;
  for (int i = threadIdx.x; i < num_ranks * words; i += blockDim.x) {
    const int d = i / words, w = i % words;
    int value;
    if (w == kNotifyFlags) {
      value = flags;
    } else if (w < kNotifyCounts + num_ranks) {
      value = total[w - kNotifyCounts];
    } else if (w < kNotifyChannels) {
      continue;
    } else if (w < kNotifyChannels + num_channels) {
      value = count[w - kNotifyChannels][d];
    } else if (w < kNotifyExperts) {
      continue;
    } else {
      value = a.num_tokens_per_expert[d * num_local + (w - kNotifyExperts)];
    }
    reinterpret_cast<Control*>(a.c.peers[d])->notify[parity][me][w] = value;
  }
  if (threadIdx.x < num_ranks) {  // the signature words, after the expert counts (a plain store each, like above)
    int* dst = reinterpret_cast<Control*>(a.c.peers[threadIdx.x])->notify[parity][me];
    dst[kNotifySignatureHash] = a.signature_hash;
    dst[kNotifySignatureProblem] = problem;
  }
  __threadfence_system();
  __syncthreads();

  // 3. Barrier: publish my epoch to every rank, wait for every rank's. Then thread 0, whose acquires order the
  // messages before its reads, gives the verdict: every source's signature hash equal and no problem word.
  const int* msg = &ctl->notify[parity][0][0];
  auto word = [&](int s, int w) { return ptx::ld_volatile(msg + s * kNotifyStride + w); };
  if (threadIdx.x == 0) {
    const Watchdog dog = make_watchdog(a.c.timeout_ns, me, &ctl->timeout_claim, &box->timeout, ctl->peer_aborted);
    ctl->barrier_epoch = epoch;
    for (int d = 0; d < num_ranks; ++d) {
      ptx::st_release_sys(&reinterpret_cast<Control*>(a.c.peers[d])->barrier_signal[me], epoch);
    }
    int ok = 1;
    for (int s = 0; s < num_ranks && ok; ++s) {  // barrier_signal[s]: written by s only
      ok = wait_at_least(&ctl->barrier_signal[s], epoch, dog, kPhaseNotify, s);
    }
    arrived = ok;
    int disagree = 0;
    for (int s = 0; s < num_ranks && ok; ++s) {
      disagree |= word(s, kNotifySignatureHash) != word(0, kNotifySignatureHash);
      disagree |= word(s, kNotifySignatureProblem) != 0;
    }
    refused = !ok || disagree;
  }
  __syncthreads();

  // 4. Results from the messages of every source; a refused call's from no message at all (every count 0), and
  // kRefusedCall in recv_channel_offset[0][0]: its data kernels, later on this stream, read it first.
  const bool none = refused != 0;
  auto sent = [&](int s, int w) { return none ? 0 : word(s, w); };  // source s's count word, 0 if refused
  for (int i = threadIdx.x; i < num_ranks * num_ranks; i += blockDim.x) {
    const int row = i / num_ranks, col = i % num_ranks;
    int sum = 0;
    for (int s = 0; s <= row; ++s) sum += sent(s, kNotifyCounts + col);
    a.rank_prefix_matrix[i] = sum;
  }
  for (int i = threadIdx.x; i < num_ranks * (num_channels + 1); i += blockDim.x) {
    const int s = i / (num_channels + 1), c = i % (num_channels + 1);
    int base = 0;
    for (int p = 0; p < s; ++p) base += sent(p, kNotifyCounts + me);
    a.recv_channel_offset[i] = (none && i == 0) ? kRefusedCall : base + (c == 0 ? 0 : sent(s, kNotifyChannels + c - 1));
  }
  // The sender's side (direct dispatch): where my channel c's rows start in d's output, the rows that sources
  // before me send to d plus my rows to d in channels before c (count[][] is my inclusive prefix over channels).
  for (int i = threadIdx.x; a.send_row_offset != nullptr && i < num_ranks * num_channels; i += blockDim.x) {
    const int d = i / num_channels, c = i % num_channels;
    int base = 0;
    for (int p = 0; p < me; ++p) base += sent(p, kNotifyCounts + d);
    a.send_row_offset[i] = none ? 0 : base + (c == 0 ? 0 : count[c - 1][d]);
  }
  const int align = a.expert_alignment;
  for (int l = threadIdx.x; l < num_local; l += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < num_ranks; ++s) sum += sent(s, kNotifyExperts + l);
    box->expert_counts[l] = (sum + align - 1) / align * align;
  }
  if (a.em_layout != nullptr) {
    // Expert-major layout (block-uniform branch: every thread reaches the barriers). kNotifyThreads
    // == kMaxLocalExperts, so thread l owns expert l; an inclusive Hillis-Steele scan of the padded
    // counts gives each expert's first row. The table is read by the dispatch kernel that follows
    // on this stream (the kernel boundary orders it).
    static_assert(kNotifyThreads >= kMaxLocalExperts, "one thread per local expert");
    __shared__ int scan[kMaxLocalExperts];
    const ExpertMajorLayout lay{num_ranks, num_local};
    const int l = threadIdx.x;
    int n = 0, padded = 0;
    if (l < num_local) {
      for (int s = 0; s < num_ranks; ++s) n += sent(s, kNotifyExperts + l);
      padded = (n + align - 1) / align * align;
      scan[l] = padded;
    }
    __syncthreads();
    for (int off = 1; off < num_local; off <<= 1) {
      const int v = (l < num_local && l >= off) ? scan[l - off] : 0;
      __syncthreads();
      if (l < num_local) scan[l] += v;
      __syncthreads();
    }
    if (l < num_local) {
      int base = scan[l] - padded;
      a.em_layout[lay.start(l)] = base;
      a.em_layout[lay.count(l)] = n;
      a.em_layout[lay.padded(l)] = padded;
      for (int s = 0; s < num_ranks; ++s) {
        a.em_layout[lay.base(s, l)] = base;
        base += sent(s, kNotifyExperts + l);
      }
    }
    if (l == 0) a.em_layout[lay.start(num_local)] = scan[num_local - 1];
  }
  if (!arrived) {  // gave up waiting (a timeout, recorded): the refused tables above, no mailbox results
    if (threadIdx.x == 0) *reinterpret_cast<volatile int32_t*>(&box->seq) = a.seq;  // wake the host
    return;
  }
  if (threadIdx.x == 0) {
    int recv = 0, any = 0;
    for (int s = 0; s < num_ranks; ++s) {
      recv += sent(s, kNotifyCounts + me);
      any |= word(s, kNotifyFlags);
    }
    // Every rank checks every rank's total, so all of them report an overflow alike (none in a refused call:
    // nothing was received).
    for (int j = 0; j < num_ranks && a.num_worst_tokens > 0 && !none; ++j) {
      int rows = 0;
      for (int s = 0; s < num_ranks; ++s) rows += word(s, kNotifyCounts + j);
      if (rows > a.num_worst_tokens && *reinterpret_cast<volatile int32_t*>(&box->overflow_rows) == 0) {
        box->overflow_rank = j;
        box->overflow_worst = a.num_worst_tokens;
        box->overflow_rows = rows;
      }
    }
    // Agreement (the verdict of step 3: arrived, so refused means the sources disagree).
    if (none) {
      any |= kFlagSignatureMismatch;
      if (*reinterpret_cast<volatile int32_t*>(&box->signature_mismatch) == 0) {  // keep the first one
        for (int s = 0; s < num_ranks; ++s) box->signature_problems[s] = word(s, kNotifySignatureProblem);
        box->signature_mismatch = a.seq;  // host-visible with the results, after the fence below
      }
    }
    box->num_recv = recv;
    box->flags = any;
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) *reinterpret_cast<volatile int32_t*>(&box->seq) = a.seq;  // after the results
}

}  // namespace

void launch_notify(const NotifyArgs& args, cudaStream_t stream) {
  notify_kernel<<<1, kNotifyThreads, 0, stream>>>(args);
  check_launch("notify_kernel");
}

}  // namespace moe_ep::intranode
