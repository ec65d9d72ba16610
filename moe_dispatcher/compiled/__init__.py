"""The compiled (CUDA) backends. `create(buffer)` returns the object that serves a Buffer's CUDA calls, or
None with the reason it cannot (no extension, CPU group, kernels not built for this case).

A backend object offers: serves_normal(topology), serves_low_latency(), get_dispatch_layout, dispatch,
cached_dispatch, combine (the signatures of reference.ReferenceNormal), low_latency_dispatch,
low_latency_combine, next_combine_buffer, clean_low_latency_buffer, local_buffer_tensor, destroy.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .. import _ext


def create(buffer) -> Tuple[Optional[object], str]:
    if not torch.cuda.is_available():
        return None, "CUDA is not available in this process"
    if "nccl" not in str(dist.get_backend(buffer.group)).lower():
        return None, "the Buffer's process group has no NCCL backend (GPU tensors need a GPU group)"
    if _ext.load() is None:
        return None, f"the extension moe_dispatcher._C is not available ({_ext.why_unavailable()})"
    return None, "the compiled normal-mode and low-latency kernels are not built into this version yet"
