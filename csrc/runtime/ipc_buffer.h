// The NVLink buffer of one rank for intranode kernels: cudaMalloc'd device memory exported with a
// CUDA IPC handle, the peers' buffers opened from theirs, and a host-mapped mailbox
// (cudaHostAlloc mapped) where notify leaves receive counts and timeouts for the host.
// Torch-free and pybind11-free; the exchange of handles happens in Python over the process group.
// With pool_bytes > 0 the allocation has a tail past the kernels' buffer: the region of the peer pool
// (runtime/peer_pool/peer_pool.h), exported and mapped by the peers with the rest, so peers map nothing new.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/intranode/protocol.h"
#include "runtime/peer_abort.h"

namespace moe_ep {

class IpcBuffer {
 public:
  // Allocates `num_bytes` on the current device and zeroes its control words; with pool_bytes > 0, a tail of
  // pool_bytes more from pool_offset() (num_bytes rounded up to kPoolAlignment) for the peer pool. The kernels'
  // geometry (common()) reads num_bytes only.
  IpcBuffer(int rank, int num_ranks, size_t num_bytes, size_t pool_bytes = 0);
  static constexpr size_t kPoolAlignment = size_t{2} << 20;
  ~IpcBuffer();
  IpcBuffer(const IpcBuffer&) = delete;
  IpcBuffer& operator=(const IpcBuffer&) = delete;

  // cudaIpcMemHandle_t of the local buffer, as raw bytes.
  std::string ipc_handle() const;
  // Opens every peer's buffer from its handle (handles[rank] is ignored).
  void open_peers(const std::vector<std::string>& handles);
  // Teardown, in three steps because the local buffer is exported (moe_dispatcher/runtime/release.py runs them):
  // close() waits for the device and closes this rank's mappings of the peers' buffers; the local buffer and
  // the mailbox stay allocated (views of the buffer stay valid) but no launch may use them (alive() turns
  // false). Local: no peer takes part. Idempotent.
  void close();
  // close(), then frees the local buffer and the mailbox. Freeing exported memory that a peer still maps is
  // undefined under CUDA IPC, so this runs only once every peer has closed its mapping (the destructor calls
  // it: the last reference goes after that point). When the peer pool's region in the tail still has live
  // blocks, the allocation goes to the pool (peer_pool::retire_region), which frees it at its last block.
  // Idempotent.
  void destroy();
  // close(), then forgets the local buffer without freeing it: a peer that never confirmed its close may still
  // map it, so it stays allocated until the process exits (the pool's region too: retired, never freed). The
  // mailbox (not exported) is freed. Idempotent.
  void abandon();

  // The peer abort (runtime/peer_abort.h). open_peers targets this rank's byte of Control::peer_aborted in every
  // domain peer's buffer; the internode backend replaces the targets with the group's (RdmaControl's, over
  // NVSHMEM). post_abort: this rank raised in a Buffer call (a no-op once closed). clear_abort_if_posted: every
  // launch path calls it first (cached plans in usable(), fresh calls through the backend); one branch unless
  // this rank posted.
  void set_abort_targets(const std::vector<uintptr_t>& targets);
  void post_abort() {
    if (alive()) abort_.post();
  }
  void clear_abort_if_posted() const {
    if (alive()) abort_.clear_if_posted();
  }

  bool alive() const { return local_ != nullptr && !closed_; }
  bool opened() const { return opened_; }
  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  size_t num_bytes() const { return num_bytes_; }
  uint8_t* local() const { return local_; }
  // The peer pool's tail: its offset in the allocation (the same on every rank) and size (0: none). Rank r's
  // region in this process is peer(r) + pool_offset() while the peers are open.
  size_t pool_offset() const { return pool_offset_; }
  size_t pool_bytes() const { return pool_bytes_; }
  // Rank r's allocation as this process maps it (the local one for r == rank), nullptr once closed.
  uint8_t* peer(int r) const { return r >= 0 && r < num_ranks_ ? peers_[r] : nullptr; }
  intranode::Mailbox* host_mailbox() const { return host_mailbox_; }
  // Kernel-side view: peer pointers, mailbox, timeout, ring geometry.
  intranode::Common common(uint64_t timeout_ns) const;

 private:
  int rank_, num_ranks_;
  size_t num_bytes_;
  size_t pool_offset_, pool_bytes_;
  uint8_t* local_ = nullptr;
  uint8_t* peers_[intranode::kMaxRanks] = {};
  bool opened_ = false;
  bool closed_ = false;
  intranode::Mailbox* host_mailbox_ = nullptr;
  intranode::Mailbox* device_mailbox_ = nullptr;
  mutable PeerAbort abort_;  // mutable: a launch path holding a const IpcBuffer& clears this rank's abort
};

}  // namespace moe_ep
