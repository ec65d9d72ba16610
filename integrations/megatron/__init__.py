"""Megatron-Core integration: moe_dispatcher as a Megatron MoE token dispatcher.

Importing this module registers the dispatcher types with Megatron-Core (see registration.py), so a
config needs only ``moe_token_dispatcher_type: "moe_dispatcher"`` (normal mode: training, prefill) or
``"moe_dispatcher_ll"`` (low-latency mode: small decode batches). On the Megatron-LM command line:
``--moe-token-dispatcher-type moe_dispatcher`` after importing this module, or run the script through
``python -m moe_dispatcher.integrations.megatron pretrain_gpt.py ...``, which imports it first.
"""
from __future__ import annotations

import warnings

with warnings.catch_warnings():
    # Megatron-Core announces each optional package it runs without (Transformer Engine, apex, absl);
    # importing it here on behalf of the user should not print those.
    warnings.filterwarnings("ignore", message=r".*not installed", category=UserWarning)
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("moe_dispatcher.integrations.megatron needs megatron-core (0.19.x): install it "
                          "with `bash tools/install_megatron.sh` (see docs/megatron.md)") from exc

    from .buffers import dispatch_group, get_buffer, megatron_topology, release_buffers
    from .dispatcher import MoEDispatcherLowLatencyTokenDispatcher, MoEDispatcherTokenDispatcher
    from .guard import check_expert_rows, run_step
    from .registration import (DISPATCHER_NAMES, LOW_LATENCY, NORMAL, guard_forward_backward, guard_training_steps,
                               is_registered, register)
    from .timing import comm_timer

    register()

__all__ = [
    "DISPATCHER_NAMES",
    "LOW_LATENCY",
    "NORMAL",
    "MoEDispatcherLowLatencyTokenDispatcher",
    "MoEDispatcherTokenDispatcher",
    "check_expert_rows",
    "comm_timer",
    "dispatch_group",
    "get_buffer",
    "guard_forward_backward",
    "guard_training_steps",
    "is_registered",
    "megatron_topology",
    "register",
    "release_buffers",
    "run_step",
]
