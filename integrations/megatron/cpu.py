"""Running Megatron-Core on a machine without a GPU (CI, laptops): gloo + our reference backend.

Megatron-Core mostly runs on CPU tensors, but a few places ask for ``torch.cuda.current_device()``
(the router moves its weight there; some buffers are allocated there), and its model-parallel RNG
tracker forks CUDA generator states around dropout. `enable()` points the first at the CPU and installs
Megatron's own no-op tracker (the one it uses for inference), so dropout draws from the CPU generator.
It changes nothing when CUDA is available.
"""
from __future__ import annotations

import torch


def enable() -> bool:
    """Make Megatron-Core usable on a CPU-only machine. Returns True when it did (no CUDA here)."""
    if torch.cuda.is_available():
        return False
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = lambda: "cpu"
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return True
