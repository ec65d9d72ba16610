// Internode (several NVLink domains) normal-mode protocol: buffer layouts and kernel arguments.
// Plain C++ (no device code, no torch). docs/internode.md describes the protocol.
//
// Ranks: r = domain * nvl_size + local. The "team" of a rank is the set of ranks with its local
// index, one per domain; tokens cross domains only inside a team, over NVSHMEM (public API, any
// transport). Inside a domain, rows move over CUDA IPC through the channel FIFOs
// (kernels/common/channel.cuh), in the NVLink buffer of intranode::IpcBuffer opened over the domain.
//
// Every byte offset below is computed by the Python backend (moe_dispatcher/compiled/internode.py,
// one formula shared with Config.get_rdma_buffer_size_hint) and passed in; only the fixed-size
// control structs are defined here (their sizes are exported and checked against Python's).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/nvlink_buffer.h"

namespace moe_ep::internode {

constexpr int kMaxRanks = 64;
static_assert(kMaxRanks <= nvlink::kMaxGroupRanks && kMaxRanks <= kMaxAbortRanks,
              "the mailbox keeps a problem word, RdmaControl an abort byte, per rank of the group");
constexpr int kMaxDomains = 64;
constexpr int kMaxNvl = nvlink::kMaxRanks;  // 8
constexpr int kMaxChannels = nvlink::kMaxChannels;
constexpr int kMaxLocalExperts = nvlink::kMaxLocalExperts;
constexpr int kMaxTopk = nvlink::kMaxTopk;
constexpr int kMaxChunk = nvlink::kMaxChunk;
constexpr int kMaxCombineHelpers = 16;  // RdmaControl::recv_next entries per channel (>= the combine's worker warps)

// Phases named in timeout errors (distinct from the intranode ones; same TimeoutRecord).
enum Phase : int32_t {
  kPhaseNotifyTeam = 21,    // notify: waiting for a team member's counts (NVSHMEM)
  kPhaseNotifyDomain = 22,  // notify: barrier inside the domain (NVLink)
  kPhaseRdmaSend = 23,      // dispatch: sender waiting for free slots in a forwarder's RDMA ring
  kPhaseForward = 24,       // dispatch: forwarder waiting for rows in its RDMA rings
  kPhaseForwardSend = 25,   // dispatch: forwarder waiting for free slots in a local rank's NVL ring
  kPhaseNvlRecv = 26,       // dispatch: receiver waiting for rows from a forwarder
  kPhaseCombineNvlSend = 27,  // combine: local rank waiting for free slots in the forwarder's NVL ring
  kPhaseCombineForward = 28,  // combine: forwarder waiting for rows from local ranks
  kPhaseCombineRdmaSend = 29,  // combine: forwarder waiting for free slots in the source's RDMA ring
  kPhaseCombineRecv = 30,   // combine: source waiting for partial sums
  kPhaseRdmaDrain = 31,     // RDMA sender waiting for a team member to drain an earlier call
  kPhaseNvlDrain = 32,      // NVL sender waiting for a local rank to drain an earlier call
  kPhaseNvlDirectReady = 33,   // dispatch, direct NVLink hop: waiting for a domain peer's kernel to start
  kPhaseNvlDirectArrive = 34,  // dispatch, direct NVLink hop: waiting for a domain peer's blocks to finish writing here
  kPhaseNvlPullReady = 35,     // combine, pull NVLink hop: waiting for a domain peer's kernel to start
  kPhaseNvlPullArrive = 36,    // combine, pull NVLink hop: waiting for a domain peer to finish reading this rank's rows
  kPhaseCombinePut = 37,       // combine, pull NVLink hop: block 3c waiting for this rank's forwarder to stage chunks
};

// Start of the symmetric (NVSHMEM) buffer of every rank. Every word is written by exactly one
// remote (or local) writer and read locally (ld.acquire.sys); the index x is a domain, i.e. the
// team member of domain x. Monotonic counters, never reset (zeroed once at creation), except the pull combine's
// words at the end (staged, recv_next, recv_stop): local words of one call, reset by every combine kernel launched
// along a pool handle (combine.cu).
struct RdmaControl {
  uint64_t notify_signal[kMaxDomains];           // [x]: epoch of x's latest notify message (putmem_signal)
  uint64_t tail[kMaxChannels][kMaxDomains];      // [c][x]: rows x published into my ring (c, x)
  uint64_t head[kMaxChannels][kMaxDomains];      // [c][x]: rows x consumed from its ring (c, my domain)
  uint64_t tail_copy[kMaxChannels][kMaxDomains]; // [c][x]: rows I published into x's ring (c, my domain)
  uint64_t head_copy[kMaxChannels][kMaxDomains]; // [c][x]: rows I consumed from my ring (c, x)
  // Grid barrier of this rank's dispatch / combine kernel (local, gpu-scope atomics; common.cuh).
  uint32_t grid_arrived;  // blocks arrived at the current barrier (reset by the last one)
  uint32_t grid_gen;      // barrier generation, bumped by the last block to arrive
  // [p]: group rank p raised in a Buffer call (1) or came back (0); written by p's host (runtime/peer_abort.h,
  // a 1-byte copy to nvshmem_ptr of this word), read by this rank's Watchdog (wait.cuh).
  alignas(8) uint8_t peer_aborted[kMaxAbortRanks];
  // [x]: the ring signature (common/ring_signature.cuh) of the cached call whose rows the team member of domain
  // x is putting into my RDMA rings (dispatch: its RDMA sender; combine: its forwarder). Written only by that
  // member (x = my domain: by me), once per channel block of each cached call, after its drain of earlier calls
  // and before its first tail signal to me (a put completed by nvshmem_quiet, then the tail's fence + SET);
  // read by my forwarder (dispatch) / source receiver (combine) after its first tail acquire of the call on a
  // ring from x. Last, so that no word above moves.
  uint64_t ring_signature[kMaxDomains];
  // [c]: chunks of channel c that my combine forwarder block has staged in this call (pull mode, source domains whose
  // buffer is not mapped here: block 3c puts them, combine.cu; mapped ones are written in place). Local only: reset to 0 by the forwarder block before the kernel's grid barrier, then written by its
  // commit warp (st.release.sys, chunks in order) and read by block 3c's put warps (ld.relaxed.sys polls, then one
  // ld.acquire.sys: wait_while_relaxed, whose words are int). Appended last, so that no word above moves.
  int staged[kMaxChannels];
  // Pull mode, a channel c whose block 3c is free (every remote source domain with chunks in c mapped: combine.cu's
  // header, "second source receiver"): block 3c's worker warp w is source receiver worker 15 + w of channel c (block
  // 3c+2's are 0-14). Local only, both reset by block 3c before the kernel's grid barrier (every call of a pool
  // kernel: recv_next[c][w] = 15 + w, recv_stop[c] = 0).
  // recv_next[c][w]: the next chunk of block 3c's worker w (its chunks below it are done), written by that warp's
  // lane 0 (st.release.gpu, after a warp barrier), read by block 3c+2's commit warp (ld.relaxed.gpu polls, then one
  // ld.acquire.gpu) before it credits the chunks. recv_stop[c]: 1 once a worker of either block gave up (a
  // timeout, recorded by it): relaxed (volatile) stores and loads, no data published; each block turns it into
  // its own shared stop flag (block 3c+2: its commit warp; block 3c: its spare warp). Appended last.
  int recv_next[kMaxChannels][kMaxCombineHelpers];
  int recv_stop[kMaxChannels];
};
static_assert(sizeof(RdmaControl) <= 69632, "RdmaControl must keep the size Python assumes (RDMA_CONTROL_BYTES)");
constexpr size_t kRdmaControlBytes = (sizeof(RdmaControl) + 4095) / 4096 * 4096;

// Byte offsets (computed in Python). RDMA buffer:
//   [RdmaControl][team messages [2][D][msg_ints]][team message staging [2][D][msg_ints]]
//   [receive rings [D][C][slots][slot_bytes]][send staging [D][C][slots][slot_bytes]]
// NVLink buffer (intranode::IpcBuffer over the domain; common/nvlink_buffer.h):
//   [nvlink::Control (barrier, FIFO words)][domain messages [2][R][nvl_msg_ints]][rings [nvl][C][slots][slot]]
struct Layout {
  size_t rdma_msg_offset, rdma_msg_staging_offset, rdma_recv_offset, rdma_send_offset;
  size_t rdma_domain_bytes;   // bytes of one domain's block of rings (C x slots x slot_bytes, rounded)
  int rdma_msg_ints;          // ints of one team message
  size_t nvl_msg_offset;
  int nvl_msg_ints;           // ints of one domain message
  size_t nvl_rings_offset;
  size_t nvl_src_block_bytes; // ring bytes per source local rank
};

struct Common {
  uint8_t* nvl[kMaxNvl];      // the domain's NVLink buffers as mapped here (index = local rank)
  uint8_t* rdma;              // this rank's symmetric buffer (a symmetric address for NVSHMEM calls)
  int rank, num_ranks, nvl_size, num_domains, local, domain;
  nvlink::Mailbox* mailbox;
  uint64_t timeout_ns;
  Layout layout;
};

struct NotifyArgs {
  Common c;
  const bool* is_token_in_rank;      // [T, R]
  const int* num_tokens_per_rank;    // [R]
  const int* num_tokens_per_expert;  // [E]
  int num_tokens, num_experts, num_channels, expert_alignment, num_worst_tokens, seq;
  int* rank_prefix_matrix;           // out [R, R]
  int* recv_channel_offset;          // out [R, C + 1]: first row here of channel c from source s
  int* fwd_offset;                   // out [D, C + 1]: first forwarded token of (source domain x, channel c)
  int* fwd_row_offset;               // out [D, nvl, C]: as the forwarder of source s = (x, my local index), the row
                                     // of local rank j's output where s's rows of channel c start, i.e. (my domain,
                                     // j)'s recv_channel_offset[s][c] (the direct NVLink hop writes there); all 0
                                     // in a refused call
  int* recv_expert_counts;           // out [L] or null: pairs received per local expert, rounded up to the
                                     // alignment (the mailbox's expert_counts, for the stream's later kernels)
  int signature_hash;                // hash of this call's signature (moe_dispatcher/signature.py); 24 bits travel
  int problem;                       // this rank's problem word (0: none; < 8), with the layout kernel's bad-id bits
};

struct DispatchArgs {
  Common c;
  const uint8_t* x;                 // [T, hidden_bytes]
  const int32_t* scales;            // [T, S] or null
  const int64_t* topk_idx;          // [T, K] or null (cached)
  const float* topk_weights;        // [T, K] or null
  const bool* is_token_in_rank;     // [T, R]
  const int* recv_channel_offset;   // [R, C + 1]
  const int* fwd_offset;            // [D, C + 1]
  int* fwd_mask;                    // [fwd_capacity] out: local ranks of each forwarded token, or null (cached)
  int fwd_capacity;
  uint8_t* recv_x;
  int32_t* recv_scales;
  int64_t* recv_topk_idx;
  float* recv_topk_weights;
  int* recv_src_idx;
  int num_tokens, hidden_bytes, num_scales, num_topk, experts_per_rank;
  int num_rows, pad_rows;
  int num_channels;
  int nvl_chunk, nvl_slots, nvl_slot_bytes;
  int rdma_chunk, rdma_slots, rdma_slot_bytes;
  // Cached dispatch: this call's ring signatures (moe_dispatcher/signature.py ring_signature_word), one per hop
  // (they differ in the slot count they carry); 0 in a fresh dispatch, whose notify compared the full signatures.
  uint64_t rdma_signature, nvl_signature;
  // Cached dispatch: the handle's fwd_mask (read only, fwd_capacity entries): where the forwarder sends the rows of
  // a source domain whose RDMA ring signature differs from this call's (their slots' masks are not read). Null in
  // a fresh dispatch.
  const int* handle_fwd_mask;
  // The direct NVLink hop (a Buffer with a peer pool; dispatch.cu, "Direct mode"). direct_call 1: the kernel runs
  // the direct-call protocol (intranode/direct_call.cuh) over the domain, on Control::direct of the NVLink buffer
  // (indexed by local rank), and the domain's verdict picks direct or FIFO mode; 0 (no pool): FIFO mode, no word
  // touched. Published per call: where MY output blocks lie in my NVLink buffer (intranode DirectPayload /
  // DirectMeta, 16-aligned; -1 when not peer-mapped, which makes the domain's call missed), my rows (recv_x's),
  // and the layout word (0 fresh, which notify checked; nvl_signature cached). recv_x .. recv_src_idx above are
  // the same blocks as carved here: FIFO mode's receivers write them locally.
  int direct_call;
  int64_t out_offset, meta_offset, out_rows;
  uint64_t layout;
  int write_meta;                   // 1: top-k and source index too (fresh); 0: payload and scales (cached)
  const int* fwd_row_offset;        // [D, nvl, C]: notify's (fresh) or the handle's (cached)
  int* fwd_rows;                    // [fwd_capacity, nvl] out or null (cached, no pool): the row of forwarded token
                                    // idx in local rank j's outputs, -1 where not sent there or dropped; every
                                    // entry of a forwarded token is written, in both modes (pull combine's map)
};

enum CombineDtype : int { kBf16 = 0, kFp16 = 1, kFp32 = 2 };

struct CombineArgs {
  Common c;
  const uint8_t* x;                 // [rows, hidden]
  const float* topk_weights;        // [rows, K] or null
  const uint8_t* bias0;             // [T, hidden] or null
  const uint8_t* bias1;
  const bool* is_token_in_rank;     // [T, R]
  const int* recv_channel_offset;   // [R, C + 1]
  const int* fwd_offset;            // [D, C + 1]
  const int* fwd_mask;              // [fwd_capacity]
  int fwd_capacity;
  uint8_t* out;                     // [T, hidden]
  float* out_topk_weights;          // [T, K] or null
  int dtype, num_tokens, hidden, num_topk, num_x_rows;
  int num_channels;
  int nvl_chunk, nvl_slots, nvl_slot_bytes;
  int rdma_slots, rdma_slot_bytes;
  uint64_t rdma_signature, nvl_signature;  // this call's ring signatures, one per hop (as DispatchArgs'), nonzero
  int chunk_tokens;                 // tokens per warp chunk of the forwarder and receiver (1..kMaxCombineChunk)
  // The pull NVLink hop (along the handle of a Buffer with a peer pool; combine.cu, "Pull mode"). pull_call 1: the
  // kernel runs the direct-call protocol (intranode/direct_call.cuh) over the domain on Control::pull of the NVLink
  // buffer (indexed by local rank), and the domain's verdict picks pull or FIFO mode; 0: FIFO mode, no word touched.
  // Published per call: where MY x and topk_weights lie in my NVLink buffer (its peer pool; 16-aligned, -1 when not
  // peer-mapped, which makes the domain's call missed) and the layout word (nvl_signature).
  int pull_call;
  int64_t x_offset, w_offset;
  const int* fwd_rows;              // [fwd_capacity, nvl] (pull_call): the dispatch's row of forwarded token idx in
                                    // local rank j's x, -1 where not sent there
};
constexpr int kMaxCombineChunk = 32;  // a chunk's tokens are one warp's lanes

void launch_notify(const NotifyArgs& args, cudaStream_t stream);
void launch_dispatch(const DispatchArgs& args, cudaStream_t stream);
void launch_combine(const CombineArgs& args, cudaStream_t stream);

}  // namespace moe_ep::internode
