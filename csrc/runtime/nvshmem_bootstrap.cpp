// NVSHMEM bootstrap: host-side init/attach/heap/barrier for moe_dispatcher._C, and its bindings.
// See nvshmem_bootstrap.h for why this module must run its own init.
#include "runtime/nvshmem_bootstrap.h"

// Host API only (nvshmem.h would also pull the device headers into this host TU).
#include <nvshmem_host.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include "bindings.h"
#include "runtime/cuda_check.h"

namespace py = pybind11;

namespace moe_ep {
namespace shmem {

static_assert(sizeof(nvshmemx_uniqueid_t) == kUniqueIdBytes, "unexpected nvshmemx_uniqueid_t size");

namespace {

// Guards g_module_inits. NVSHMEM's host API is used from one thread at a time (THREAD_SERIALIZED).
std::mutex g_mutex;
// Successful init/attach calls of this module not yet undone by finalize (NVSHMEM counts the same
// way: every init increments its counter, every finalize decrements it, the last one tears down).
int g_module_inits = 0;

// NVSHMEM's nvshmem_init()/nvshmemx_init_attr() are static inline wrappers (host/nvshmem_api.h,
// host/nvshmemx_api.h) around nvshmemi_init_thread() from libnvshmem_device.a, which initialises
// or joins NVSHMEM and registers the device state of the module it is linked into (this .so).
// The wrappers exit(-1) the whole process on failure; this is the same call, returning the status
// so that a failure becomes a Python RuntimeError instead.
int init_this_module(unsigned int flags, nvshmemx_init_attr_t* attr) {
  int provided = 0;
  nvshmemi_version_t app_version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                    NVSHMEM_VENDOR_PATCH_VERSION};
  if (attr != nullptr) {
    nvshmemx_init_init_attr_ver_only((*attr));
  }
  return nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, flags, attr, app_version);
}

bool host_initialized(int status) {
  return status >= NVSHMEM_STATUS_IS_INITIALIZED && status != NVSHMEM_STATUS_INVALID;
}

void require_ready(const char* what) {
  MOE_CHECK(g_module_inits > 0,
            std::string(what) +
                ": NVSHMEM is not initialised for moe_dispatcher._C; call "
                "nvshmem_init_with_unique_id() or nvshmem_attach() first "
                "(moe_dispatcher.runtime.nvshmem.bootstrap() does this)");
}

void require_pe(int pe) {
  MOE_CHECK(pe >= 0 && pe < nvshmem_n_pes(),
            "PE " + std::to_string(pe) + " out of range [0, " + std::to_string(nvshmem_n_pes()) +
                ")");
}

}  // namespace

std::string get_unique_id() {
  nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
  MOE_NVSHMEM_CHECK(nvshmemx_get_uniqueid(&uid));
  return std::string(reinterpret_cast<const char*>(&uid), sizeof(uid));
}

void init_with_unique_id(const std::string& uid_bytes, int rank, int nranks) {
  MOE_CHECK(uid_bytes.size() == kUniqueIdBytes,
            "unique id must be " + std::to_string(kUniqueIdBytes) + " bytes, got " +
                std::to_string(uid_bytes.size()));
  MOE_CHECK(nranks > 0 && rank >= 0 && rank < nranks,
            "bad rank/nranks " + std::to_string(rank) + "/" + std::to_string(nranks));
  int device = -1;
  MOE_CUDA_CHECK(cudaGetDevice(&device));  // NVSHMEM binds this PE to the current device

  std::lock_guard<std::mutex> lock(g_mutex);
  nvshmemx_uniqueid_t uid;
  std::memcpy(&uid, uid_bytes.data(), sizeof(uid));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  MOE_NVSHMEM_CHECK(nvshmemx_set_attr_uniqueid_args(rank, nranks, &uid, &attr));
  MOE_NVSHMEM_CHECK(init_this_module(NVSHMEMX_INIT_WITH_UNIQUEID, &attr));
  ++g_module_inits;
  MOE_CHECK(nvshmem_my_pe() == rank && nvshmem_n_pes() == nranks,
            "NVSHMEM came up as PE " + std::to_string(nvshmem_my_pe()) + " of " +
                std::to_string(nvshmem_n_pes()) + ", expected " + std::to_string(rank) + " of " +
                std::to_string(nranks) + " (already initialised with another group?)");
}

void attach() {
  std::lock_guard<std::mutex> lock(g_mutex);
  const int status = nvshmemx_init_status();
  MOE_CHECK(host_initialized(status),
            "nvshmem_attach: NVSHMEM is not initialised in this process (nvshmemx_init_status=" +
                std::to_string(status) +
                "); initialise it first (nvshmem4py) or use nvshmem_init_with_unique_id()");
  // Already initialised: no bootstrap happens, the call only registers this module's device state.
  MOE_NVSHMEM_CHECK(init_this_module(0, nullptr));
  ++g_module_inits;
}

bool module_ready() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_module_inits > 0;
}

int host_init_status() { return nvshmemx_init_status(); }

int my_pe() {
  require_ready("nvshmem_my_pe");
  return nvshmem_my_pe();
}

int n_pes() {
  require_ready("nvshmem_n_pes");
  return nvshmem_n_pes();
}

void* malloc_symmetric(size_t nbytes) {
  require_ready("nvshmem_malloc");
  MOE_CHECK(nbytes > 0, "nvshmem_malloc: nbytes must be positive");
  void* ptr = nvshmem_malloc(nbytes);
  MOE_CHECK(ptr != nullptr, "nvshmem_malloc(" + std::to_string(nbytes) +
                                " bytes) returned NULL: symmetric heap exhausted? Raise "
                                "NVSHMEM_SYMMETRIC_SIZE (set before init) or free buffers");
  return ptr;
}

void free_symmetric(void* ptr) {
  require_ready("nvshmem_free");
  nvshmem_free(ptr);
}

void* peer_ptr(void* ptr, int pe) {
  require_ready("nvshmem_ptr");
  require_pe(pe);
  return nvshmem_ptr(ptr, pe);
}

void barrier_all_on_stream(cudaStream_t stream) {
  require_ready("nvshmem_barrier_all");
  nvshmemx_barrier_all_on_stream(stream);
}

void finalize() {
  std::lock_guard<std::mutex> lock(g_mutex);
  MOE_CHECK(g_module_inits > 0, "nvshmem_finalize: not initialised by moe_dispatcher._C");
  // Unregisters this module's device state; tears NVSHMEM down when its init count reaches 0.
  nvshmem_finalize();
  --g_module_inits;
}

}  // namespace shmem

namespace {

// Python passes device pointers and streams as ints (tensor.data_ptr(), stream.cuda_stream).
void* as_ptr(uintptr_t value) { return reinterpret_cast<void*>(value); }
uintptr_t as_int(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); }

// Per-process round counter. The self-test is collective, so every PE calls it equally often and
// the counters agree; a growing round makes a signal left over from an earlier round useless.
uint64_t g_selftest_round = 0;

unsigned long long selftest(uintptr_t ptr, size_t nbytes, uintptr_t stream, double timeout_s) {
  using namespace shmem;
  require_ready("nvshmem_selftest");
  const int me = nvshmem_my_pe();
  MOE_CHECK(nvshmem_ptr(as_ptr(ptr), me) == as_ptr(ptr),
            "nvshmem_selftest: ptr is not an address in NVSHMEM's symmetric heap");
  const uint64_t round = ++g_selftest_round;
  SelftestResult r =
      launch_selftest(as_ptr(ptr), nbytes, round, timeout_s, reinterpret_cast<cudaStream_t>(stream));
  MOE_CHECK(r.device_my_pe == me && r.device_n_pes == nvshmem_n_pes(),
            "device code sees PE " + std::to_string(r.device_my_pe) + " of " +
                std::to_string(r.device_n_pes) + " but the host says " + std::to_string(me) +
                " of " + std::to_string(nvshmem_n_pes()) +
                ": this module's NVSHMEM device state is not initialised");
  MOE_CHECK(!r.timed_out, "nvshmem_selftest: PE " + std::to_string(me) +
                              " timed out waiting for the signal from the previous PE");
  return r.wrong_words;
}

}  // namespace

void register_nvshmem(py::module_& m) {
  using namespace shmem;
  // Calls that can block on other ranks release the GIL.
  using release = py::call_guard<py::gil_scoped_release>;

  m.def("nvshmem_get_unique_id", []() { return py::bytes(get_unique_id()); },
        "nvshmemx_get_uniqueid: 128 bytes to broadcast from one rank to all others.");
  m.def(
      "nvshmem_init_with_unique_id",
      [](py::bytes uid, int rank, int nranks) {
        std::string bytes = uid;  // copy out while holding the GIL
        py::gil_scoped_release no_gil;
        init_with_unique_id(bytes, rank, nranks);
      },
      py::arg("uid"), py::arg("rank"), py::arg("nranks"),
      "Collective: initialise NVSHMEM on the current CUDA device from a unique id and register "
      "this module's device state.");
  m.def("nvshmem_attach", &attach, release(),
        "NVSHMEM is already initialised in this process (e.g. by nvshmem4py): register this "
        "module's device state. Collective only if NVSHMEM needs it; call on every rank.");
  m.def("nvshmem_is_ready", &module_ready,
        "True when this module's NVSHMEM device state is initialised.");
  m.def("nvshmem_init_status", &host_init_status,
        "nvshmemx_init_status() of the NVSHMEM host library (0 = not initialised).");
  m.def("nvshmem_my_pe", &my_pe);
  m.def("nvshmem_n_pes", &n_pes);
  m.def(
      "nvshmem_malloc", [](size_t nbytes) { return as_int(malloc_symmetric(nbytes)); },
      py::arg("nbytes"), release(), "Collective: symmetric allocation; returns the pointer as int.");
  m.def(
      "nvshmem_free", [](uintptr_t ptr) { free_symmetric(as_ptr(ptr)); }, py::arg("ptr"),
      release(), "Collective: free a symmetric allocation.");
  m.def(
      "nvshmem_ptr", [](uintptr_t ptr, int pe) { return as_int(peer_ptr(as_ptr(ptr), pe)); },
      py::arg("ptr"), py::arg("pe"),
      "Address of symmetric `ptr` on `pe` for direct loads/stores, or 0 if not P2P-reachable.");
  m.def(
      "nvshmem_barrier_all",
      [](uintptr_t stream) { barrier_all_on_stream(reinterpret_cast<cudaStream_t>(stream)); },
      py::arg("stream") = 0, release(),
      "Collective: nvshmemx_barrier_all_on_stream on `stream` (a cudaStream_t as int).");
  m.def("nvshmem_finalize", &finalize, release(),
        "Collective: undo one init/attach of this module.");
  m.def("nvshmem_selftest", &selftest, py::arg("ptr"), py::arg("nbytes"), py::arg("stream") = 0,
        py::arg("timeout_s") = 10.0, release(),
        "Collective ring test of this module's device state: each PE put-with-signals a pattern "
        "into the next PE's symmetric buffer `ptr` (nbytes >= 72) and checks what it received. "
        "Returns the number of wrong words; raises on timeout or wrong device PE ids.");
}

}  // namespace moe_ep
