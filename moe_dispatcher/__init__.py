"""moe_dispatcher: expert-parallel token dispatch and combine for MoE training and inference.

`import moe_dispatcher as deep_ep` works for DeepEP V1 code: Buffer, Config, EventOverlap, EventHandle, topk_idx_t.
Ours beside it: Topology, the autograd functions (moe_dispatcher.autograd), the reference backend
(moe_dispatcher.reference) and the Megatron-Core integration (moe_dispatcher.integrations.megatron).
Importing never needs the compiled extension: without it every call runs on the reference backend.
"""
import torch

from .buffer import Buffer
from .config import Config
from .event import EventHandle, EventOverlap
from .expert_major import ExpertMajorHandle
from .handle import DispatchHandle, LowLatencyHandle
from .reference.board import CreationFailed
from .topology import Topology

topk_idx_t = torch.int64

__version__ = "0.1.0"

__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle", "Topology", "DispatchHandle", "LowLatencyHandle",
           "ExpertMajorHandle", "CreationFailed", "topk_idx_t", "__version__"]
