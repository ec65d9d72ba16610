"""The compiled (CUDA) backends. `create(buffer)` returns the object that serves a Buffer's CUDA calls, or
None with the reason it cannot (no extension, CPU group, kernels not built for this case).

A backend object offers: serves_normal(topology), serves_low_latency(), get_dispatch_layout, dispatch,
cached_dispatch, combine (the signatures of reference.ReferenceNormal), low_latency_dispatch,
low_latency_combine, next_combine_buffer, clean_low_latency_buffer, local_buffer_tensor, destroy.

Collective: every rank of the Buffer's group calls create() at the same point (the intranode backend
exchanges CUDA IPC handles over the group), and all ranks take the same decision from shared facts.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .. import _ext


def _extension_with(buffer, submodule: str, what: str) -> Tuple[Optional[object], str]:
    """(the `_C` module, "") when `buffer` is on GPUs and `_C` has `submodule`; else (None, why not)."""
    if not torch.cuda.is_available():
        return None, "CUDA is not available in this process"
    if "nccl" not in str(dist.get_backend(buffer.group)).lower():
        return None, "the Buffer's process group has no NCCL backend (GPU tensors need a GPU group)"
    mod = _ext.load()
    if mod is None:
        return None, f"the extension moe_dispatcher._C is not available ({_ext.why_unavailable()})"
    if not hasattr(mod, submodule):
        return None, f"the extension moe_dispatcher._C was built without the {what} kernels"
    return mod, ""


def create(buffer) -> Tuple[Optional[object], str]:
    """The intranode (NVLink) normal-mode backend for `buffer`, or None and the reason."""
    mod, why = _extension_with(buffer, "intranode", "intranode")
    if mod is None:
        return None, why
    topo = buffer.topology
    if not topo.is_single_domain or not 2 <= topo.num_ranks <= mod.intranode.MAX_RANKS:
        return None, (f"the compiled kernels serve one NVLink domain of 2 to {mod.intranode.MAX_RANKS} GPUs; this "
                      f"group has {topo.num_ranks} ranks in {topo.num_domains} domain(s) (internode kernels are not "
                      f"built into this version yet)")
    if buffer.num_nvl_bytes == 0:
        return None, "the Buffer has no NVLink buffer (num_nvl_bytes=0)"
    from .intranode import IntranodeBackend
    return IntranodeBackend(buffer), ""


def create_low_latency(buffer) -> Tuple[Optional[object], str]:
    """The low-latency (NVSHMEM) backend for a Buffer(low_latency_mode=True), or None and the reason.

    Collective like create(): NVSHMEM bootstrap and the symmetric allocation involve every rank."""
    mod, why = _extension_with(buffer, "low_latency", "low-latency")
    if mod is None:
        return None, why
    if buffer.num_rdma_bytes == 0:
        return None, "the Buffer has no NVSHMEM buffer (num_rdma_bytes=0)"
    from .low_latency import LowLatencyBackend
    return LowLatencyBackend(buffer), ""
