#include "runtime/ipc_buffer.h"

#include <cuda_runtime.h>

#include <cstring>

#include "runtime/cuda_check.h"
#include "runtime/peer_pool/peer_pool.h"

namespace moe_ep {

IpcBuffer::IpcBuffer(int rank, int num_ranks, size_t num_bytes, size_t pool_bytes)
    : rank_(rank),
      num_ranks_(num_ranks),
      num_bytes_(num_bytes),
      pool_offset_(pool_bytes ? (num_bytes + kPoolAlignment - 1) / kPoolAlignment * kPoolAlignment : num_bytes),
      pool_bytes_(pool_bytes) {
  MOE_CHECK(num_ranks >= 1 && num_ranks <= intranode::kMaxRanks, "intranode buffers serve 1 to 8 ranks");
  MOE_CHECK(rank >= 0 && rank < num_ranks, "rank out of range");
  MOE_CHECK(num_bytes > intranode::kRingsOffset, "NVLink buffer smaller than its control region");
  MOE_CUDA_CHECK(cudaMalloc(&local_, pool_offset_ + pool_bytes_));
  MOE_CUDA_CHECK(cudaMemset(local_, 0, intranode::kRingsOffset));
  MOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_mailbox_), sizeof(intranode::Mailbox),
                               cudaHostAllocMapped));
  std::memset(host_mailbox_, 0, sizeof(intranode::Mailbox));
  MOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_mailbox_), host_mailbox_, 0));
  MOE_CUDA_CHECK(cudaDeviceSynchronize());  // the control words are zero before any peer can see them
  peers_[rank_] = local_;
}

IpcBuffer::~IpcBuffer() {
  try {
    destroy();
  } catch (...) {
  }
}

std::string IpcBuffer::ipc_handle() const {
  MOE_CHECK(local_ != nullptr, "IpcBuffer was destroyed");
  cudaIpcMemHandle_t handle;
  MOE_CUDA_CHECK(cudaIpcGetMemHandle(&handle, local_));
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void IpcBuffer::open_peers(const std::vector<std::string>& handles) {
  MOE_CHECK(local_ != nullptr, "IpcBuffer was destroyed");
  MOE_CHECK(!opened_, "peers already opened");
  MOE_CHECK(static_cast<int>(handles.size()) == num_ranks_, "one IPC handle per rank expected");
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    MOE_CHECK(handles[r].size() == sizeof(cudaIpcMemHandle_t), "bad IPC handle size");
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, handles[r].data(), sizeof(handle));
    void* ptr = nullptr;
    MOE_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
    peers_[r] = static_cast<uint8_t*>(ptr);
  }
  std::vector<uint8_t*> aborts(num_ranks_, nullptr);
  for (int r = 0; r < num_ranks_; ++r) {
    if (r != rank_) aborts[r] = reinterpret_cast<intranode::Control*>(peers_[r])->peer_aborted + rank_;
  }
  abort_.set_targets(aborts);
  opened_ = true;
}

void IpcBuffer::set_abort_targets(const std::vector<uintptr_t>& targets) {
  MOE_CHECK(alive(), "IpcBuffer is closed or destroyed");
  std::vector<uint8_t*> aborts;
  for (uintptr_t t : targets) aborts.push_back(reinterpret_cast<uint8_t*>(t));
  abort_.set_targets(aborts);
}

void IpcBuffer::close() {
  if (local_ == nullptr || closed_) return;
  closed_ = true;  // first: a failure below must not leave launches allowed
  abort_.forget();  // before the mappings it writes through go
  MOE_CUDA_CHECK(cudaDeviceSynchronize());  // this rank's kernels no longer touch any peer's buffer
  for (int r = 0; r < num_ranks_; ++r) {
    if (r != rank_ && peers_[r] != nullptr) MOE_CUDA_CHECK(cudaIpcCloseMemHandle(peers_[r]));
    peers_[r] = r == rank_ ? local_ : nullptr;
  }
}

void IpcBuffer::destroy() {
  if (local_ == nullptr) return;
  close();
  // A pool region with live blocks takes the allocation over and frees it at its last block; else it is forgotten
  // (or never was registered) and the allocation goes now. Either way no peer maps it any more (see the header).
  if (pool_bytes_ == 0 || !peer_pool::retire_region(reinterpret_cast<uintptr_t>(local_ + pool_offset_), local_)) {
    MOE_CUDA_CHECK(cudaFree(local_));
  }
  local_ = peers_[rank_] = nullptr;
  MOE_CUDA_CHECK(cudaFreeHost(host_mailbox_));
  host_mailbox_ = device_mailbox_ = nullptr;
  opened_ = false;
}

void IpcBuffer::abandon() {
  if (local_ == nullptr) return;
  try {
    close();
  } catch (...) {  // abandoning is the way out of a failed teardown: it never throws
  }
  if (pool_bytes_ != 0) peer_pool::retire_region(reinterpret_cast<uintptr_t>(local_ + pool_offset_), nullptr);
  local_ = peers_[rank_] = nullptr;
  cudaFreeHost(host_mailbox_);
  host_mailbox_ = device_mailbox_ = nullptr;
  opened_ = false;
}

intranode::Common IpcBuffer::common(uint64_t timeout_ns) const {
  MOE_CHECK(alive() && opened_, "IpcBuffer is closed or destroyed, or its peers are not opened");
  intranode::Common c{};
  for (int r = 0; r < intranode::kMaxRanks; ++r) c.peers[r] = peers_[r];
  c.rank = rank_;
  c.num_ranks = num_ranks_;
  c.mailbox = device_mailbox_;
  c.timeout_ns = timeout_ns;
  c.src_block_bytes = (num_bytes_ - intranode::kRingsOffset) / num_ranks_ / 128 * 128;
  return c;
}

}  // namespace moe_ep
