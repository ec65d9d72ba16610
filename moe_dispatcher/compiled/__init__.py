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

# The raw cudaStream_t of the current stream, cheaply: torch.cuda.current_stream() resolves the device through
# several Python layers (it was a third of a cached dispatch's host time). CUDA builds of torch expose the
# direct lookups that torch's own generated code uses; CPU builds (never launching) fall back.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def current_stream_ptr(device: Optional[int] = None) -> int:
    """The current CUDA stream of `device` (default: the current device), as the integer the bindings take."""
    if _raw_stream is not None and _get_device is not None:
        return _raw_stream(_get_device() if device is None else device)
    return torch.cuda.current_stream(device).cuda_stream


# How a plan's launch on the comm stream is ordered against the caller's stream (StreamJoin in
# csrc/intranode_bindings.cpp): not at all (the caller made the comm stream current after ordering it), the comm
# stream waits for the caller's stream first (async_finish), or also the caller's stream waits for the launch.
JOIN_NONE, JOIN_BEFORE, JOIN_BOTH = 0, 1, 2


class HandleState:
    """backend_state of a DispatchHandle from a backend whose cached calls run from launch plans (intranode).

    routing:        the backend's tables of the handle (intranode: (num_channels, recv_channel_offset)).
    dispatch_plans: [the plan of the latest cached dispatch of plain rows, that of FP8 rows with scales], None
                    before the first such call (see intranode.CachedCall); combine_plans likewise, [without,
                    with top-k weights]. One slot per kind, so that a model alternating the kinds on a handle
                    (combine, then combine with weights in the backward) keeps both. A plan holds no reference
                    to the handle (the handle owns it), so dropping the handle frees everything at once.
    """

    __slots__ = ("routing", "dispatch_plans", "combine_plans")

    def __init__(self, routing: tuple) -> None:
        self.routing = routing
        self.dispatch_plans: list = [None, None]
        self.combine_plans: list = [None, None]


def row_geometry(x: torch.Tensor, scales: Optional[torch.Tensor], kernels: str) -> Tuple[int, int]:
    """(hidden bytes, scales per row) of dispatch rows for the `kernels` ("intranode", ...) backend, checked:
    rows a multiple of 16 bytes, FP8 scales 2-D with 4-byte elements."""
    hidden_bytes = x.shape[1] * x.element_size()
    if hidden_bytes % 16:
        raise ValueError(f"dispatch: rows of x must be a multiple of 16 bytes for the {kernels} kernels, got "
                         f"{hidden_bytes} ({x.shape[1]} x {x.dtype})")
    num_scales = 0
    if scales is not None:
        if scales.element_size() != 4 or scales.dim() != 2:
            raise ValueError(f"dispatch: FP8 scales must be a 2-D 4-byte tensor, got {scales.dtype}"
                             f"{list(scales.shape)}")
        num_scales = scales.shape[1]
    return hidden_bytes, num_scales


def timeout_message(kernels: str, info, timeout_s: float, env: str) -> str:
    """The error of a Buffer whose kernels recorded a timeout: info = (code, phase, waiting rank, peer)."""
    _, phase, rank, peer = info
    return (f"moe_dispatcher {kernels}: rank {rank} timed out after {timeout_s:g} s in {phase} waiting for rank "
            f"{peer} (a peer skipped a call, or calls differ between ranks); this Buffer is unusable now: destroy "
            f"it on every rank and create a new one ({env} sets the timeout)")


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
    """The normal-mode backend for `buffer` (intranode for one NVLink domain, internode for several), or None
    and the reason."""
    mod, why = _extension_with(buffer, "intranode", "intranode")
    if mod is None:
        return None, why
    topo = buffer.topology
    if not topo.is_single_domain:
        return _create_internode(buffer, mod)
    if not 2 <= topo.num_ranks <= mod.intranode.MAX_RANKS:
        return None, (f"the compiled kernels serve one NVLink domain of 2 to {mod.intranode.MAX_RANKS} GPUs; this "
                      f"group has {topo.num_ranks} ranks")
    if buffer.num_nvl_bytes == 0:
        return None, "the Buffer has no NVLink buffer (num_nvl_bytes=0)"
    from .intranode import IntranodeBackend
    return IntranodeBackend(buffer), ""


def internode_decision(topology, num_nvl_bytes: int, num_rdma_bytes: int, has_internode: bool,
                       max_ranks: int = 64) -> str:
    """Why the internode backend cannot serve a multi-domain Buffer ("" when it can). Torch-free, so the
    CPU tests check it; a too-small (non-zero) num_rdma_bytes is a ValueError raised by the backend."""
    if not has_internode:
        return "the extension moe_dispatcher._C was built without the internode kernels"
    if topology.num_ranks > max_ranks:
        return f"the internode kernels serve at most {max_ranks} ranks; this group has {topology.num_ranks}"
    if num_rdma_bytes == 0:
        return (f"the group spans {topology.num_domains} NVLink domains of {topology.nvl_size} and the Buffer has no "
                f"NVSHMEM buffer (num_rdma_bytes=0; size it with Config.get_rdma_buffer_size_hint)")
    if num_nvl_bytes == 0:
        return "the Buffer has no NVLink buffer (num_nvl_bytes=0)"
    return ""


def _create_internode(buffer, mod) -> Tuple[Optional[object], str]:
    why = internode_decision(buffer.topology, buffer.num_nvl_bytes, buffer.num_rdma_bytes,
                             hasattr(mod, "internode"),
                             getattr(getattr(mod, "internode", None), "MAX_RANKS", 64))
    if why:
        return None, why
    from .internode import InternodeBackend
    return InternodeBackend(buffer), ""


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
