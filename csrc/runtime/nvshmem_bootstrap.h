// NVSHMEM bootstrap for moe_dispatcher._C: host-side init/attach/allocation and a self-test.
//
// Why this exists: NVSHMEM device code keeps per-module device state (PE id, heap base, peer
// table) that stays zero until the module that holds it calls nvshmem_init/nvshmemx_init_attr.
// All our device code is device-linked into the single _C .so, so this file's init/attach is the
// one call that makes every kernel's nvshmem_* device functions work. NVSHMEM itself may already
// have been initialised by someone else (nvshmem4py, torch symmetric memory): then attach() only
// registers this module's device state (NVSHMEM counts init calls; finalize undoes one).
//
// All functions here are collective where NVSHMEM's are (init, malloc, free, barrier, finalize,
// selftest): every PE calls them in the same order. Errors throw std::runtime_error.
// Torch-free and pybind11-free; the Python bindings live in nvshmem_bootstrap.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace moe_ep {
namespace shmem {

// Size of nvshmemx_uniqueid_t (static_assert'ed against the header in the .cpp).
constexpr size_t kUniqueIdBytes = 128;

// nvshmemx_get_uniqueid on the calling rank (normally rank 0), as 128 raw bytes.
std::string get_unique_id();

// nvshmemx_set_attr_uniqueid_args + init with NVSHMEMX_INIT_WITH_UNIQUEID on the current CUDA
// device. Registers this module's device state.
void init_with_unique_id(const std::string& uid, int rank, int nranks);

// NVSHMEM is already initialised in this process (e.g. by nvshmem4py): register this module's
// device state. Throws if NVSHMEM is not initialised.
void attach();

// True once init_with_unique_id or attach succeeded in this module (and finalize has not run).
bool module_ready();

// nvshmemx_init_status() of the host library (0 = not initialised; >= 2 = initialised).
int host_init_status();

int my_pe();
int n_pes();

// Symmetric heap (collective). malloc throws on failure or when NVSHMEM is not ready.
void* malloc_symmetric(size_t nbytes);
void free_symmetric(void* ptr);

// Address of `ptr` (symmetric) on `pe` if it is load/store reachable (P2P), else nullptr.
void* peer_ptr(void* ptr, int pe);

// nvshmemx_barrier_all_on_stream: enqueued on `stream`, completes all prior NVSHMEM operations.
void barrier_all_on_stream(cudaStream_t stream);

// Undo one init/attach of this module (NVSHMEM finalizes for real when its count reaches 0).
void finalize();

// Result of one self-test round (filled on the device, copied back).
struct SelftestResult {
  unsigned long long wrong_words;  // received words that differ from what the previous PE sent
  int device_my_pe;                // nvshmem_my_pe() as THIS module's device code sees it
  int device_n_pes;                // nvshmem_n_pes() as THIS module's device code sees it
  int timed_out;                   // 1 if the signal from the previous PE never arrived
};

// Bytes the self-test needs at least (signal header + one word of receive and staging space).
constexpr size_t kSelftestHeaderBytes = 64;
constexpr size_t kSelftestMinBytes = kSelftestHeaderBytes + 2 * sizeof(uint32_t);

// Runs one round of the ring self-test on `stream` and waits for it (defined in
// nvshmem_selftest.cu). Collective. `buf` is a symmetric allocation of `nbytes` on every PE. Each
// PE puts a pattern that depends on (its PE id, round, word index) into the next PE's buffer with
// put-with-signal, then checks what the previous PE put into its own. The launcher clears the
// signal and brackets the kernel with NVSHMEM barriers, so rounds never overlap. `round` must be
// the same on every PE and grow from call to call.
SelftestResult launch_selftest(void* buf, size_t nbytes, uint64_t round, double timeout_s,
                               cudaStream_t stream);

}  // namespace shmem
}  // namespace moe_ep
