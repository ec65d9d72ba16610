"""The reference backend: the semantics of docs/semantics.md in plain torch.distributed (gloo or NCCL).

It runs wherever torch.distributed runs (CPU machines and CI included) and is the oracle the compiled kernels
are tested against. Readability beats speed here.
"""
from .fp8 import dequantize, per_token_cast_to_fp8
from .low_latency import ReferenceLowLatency
from .normal import ReferenceNormal, dispatch_layout

__all__ = ["ReferenceNormal", "ReferenceLowLatency", "dispatch_layout", "per_token_cast_to_fp8", "dequantize"]
