// This rank's side of the peer abort (kernels/common/wait.cuh, "Peer abort"): writing this rank's abort byte in
// every peer's abort bytes, 1 when this rank raises in a Buffer call, 0 again at its next call. Torch-free.
//
// The write is a 1-byte cudaMemcpyAsync to the byte's address as mapped in this process (a CUDA IPC mapping of
// the peer's NVLink buffer, or nvshmem_ptr of its symmetric buffer) from a 2-byte {0, 1} source in this GPU's
// memory (a peer-to-peer copy; should the driver refuse it, from pinned host memory instead), on a private
// non-blocking stream: a copy-engine transfer, ordered after nothing this rank queued on its other streams (a
// kernel of its own that waits for a peer cannot hold it back) and needing no SM. The host then polls that
// stream for at most kWriteWaitS and gives up silently past it (the peers fall back to their timeout): raising
// never turns into a hang. Ordering: the byte publishes no data, so no fence goes with it (wait.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace moe_ep {

class PeerAbort {
 public:
  static constexpr double kWriteWaitS = 2.0;

  PeerAbort() = default;
  ~PeerAbort();
  PeerAbort(const PeerAbort&) = delete;
  PeerAbort& operator=(const PeerAbort&) = delete;

  // targets[q]: this rank's abort byte in peer q's memory as mapped here; null for this rank and for a peer
  // not mapped here (not written: such a peer falls back to its timeout). Replaces earlier targets; the stream
  // and the pinned source bytes are made on the current device at the first call.
  void set_targets(const std::vector<uint8_t*>& targets);
  // Forget the targets (before the mappings go): later posts write nothing.
  void forget() { targets_.clear(); }

  // This rank raised: write 1 on every peer (best effort, never throws).
  void post() { write(1); posted_ = true; }
  // A call of this rank starts: if it posted an abort, write 0 on every peer. Normal calls pay one branch.
  void clear_if_posted() {
    if (posted_) {
      posted_ = false;
      write(0);
    }
  }
  bool posted() const { return posted_; }

 private:
  void write(uint8_t value);

  std::vector<uint8_t*> targets_;
  int device_ = -1;
  cudaStream_t stream_ = nullptr;
  uint8_t* device_source_ = nullptr;  // {0, 1} in this GPU's memory
  uint8_t* host_source_ = nullptr;    // {0, 1}, pinned
  bool posted_ = false;
  bool pending_ = false;       // a write did not finish within kWriteWaitS: the stream and source stay allocated
};

}  // namespace moe_ep
