// Python bindings of the peer pool's region registry (csrc/runtime/peer_pool/peer_pool.h): the submodule
// moe_dispatcher._C.peer_pool that moe_dispatcher/compiled/peer_pool.py drives. The allocator functions torch
// calls are the C symbols ALLOC_SYMBOL / FREE_SYMBOL of this extension's file.
#include <torch/extension.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "bindings.h"
#include "runtime/peer_pool/peer_pool.h"

namespace py = pybind11;

namespace moe_ep {

namespace {

py::dict stats_dict(const peer_pool::RegionStats& s) {
  py::dict d;
  d["capacity"] = s.capacity;
  d["in_use"] = s.in_use;
  d["peak_in_use"] = s.peak_in_use;
  d["largest_free"] = s.largest_free;
  d["num_blocks"] = s.num_blocks;
  d["num_free_ranges"] = s.num_free_ranges;
  d["bad_releases"] = s.bad_releases;
  return d;
}

py::object region_info(uintptr_t base) {
  const auto info = peer_pool::region_info(base);
  if (!info) return py::none();
  py::dict d = stats_dict(info->stats);
  d["base"] = info->base;
  d["bytes"] = info->bytes;
  d["device"] = info->device;
  d["closed"] = info->closed;
  d["retired"] = info->retired;
  return d;
}

// A uint8 tensor over [ptr, ptr + nbytes) labelled with `device` (the device whose kernels access it: for a peer's
// region mapped through CUDA IPC, this rank's; torch would otherwise ask the pointer, which names the peer's GPU).
// It owns nothing: PeerPool.peer_view documents how long it may be used.
at::Tensor device_bytes(uintptr_t ptr, int64_t nbytes, int device) {
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  return at::for_blob(reinterpret_cast<void*>(ptr), {nbytes})
      .options(at::TensorOptions().dtype(at::kByte).device(dev))
      .target_device(dev)  // not asked from the pointer
      .make_tensor();
}

}  // namespace

void register_peer_pool(py::module_& m) {
  auto sub = m.def_submodule("peer_pool", "Regions of peer-mapped memory that torch tensors are allocated from");
  sub.attr("ALLOC_SYMBOL") = "moe_peer_pool_alloc";
  sub.attr("FREE_SYMBOL") = "moe_peer_pool_free";
  sub.attr("ALIGNMENT") = peer_pool::RegionAllocator::kDefaultAlignment;
  sub.def("register_region", &peer_pool::register_region, py::arg("base"), py::arg("bytes"), py::arg("device"),
          "Add [base, base + bytes) of `device` as a region (raises when it overlaps a registered one).");
  sub.def("close_region", &peer_pool::close_region, py::arg("base"),
          "No new blocks from the region; live blocks stay valid.");
  sub.def("set_active_region", &peer_pool::set_active_region, py::arg("device"), py::arg("base"),
          "This thread's pool allocations on `device` come from the region at `base` (0: none); returns the "
          "previous base.");
  sub.def("region_info", &region_info, py::arg("base"),
          "{base, bytes, device, closed, retired, capacity, in_use, peak_in_use, largest_free, num_blocks, "
          "num_free_ranges, bad_releases} of the region at `base`, or None when no region starts there.");
  sub.def("device_bytes", &device_bytes, py::arg("ptr"), py::arg("nbytes"), py::arg("device"),
          "uint8 [nbytes] tensor over a raw device range, on cuda:`device` (owns nothing).");
  sub.def("num_regions", &peer_pool::num_regions, "Regions registered and not yet forgotten.");
  sub.def("foreign_frees", &peer_pool::foreign_frees, "Frees of an address in no region (ignored).");
}

}  // namespace moe_ep
