"""Megatron's process groups -> our Topology, and one Buffer per group shared by every MoE layer.

The dispatcher communicates over Megatron's ``tp_ep`` group (expert-TP x EP ranks, a contiguous block with
the expert-TP rank fastest). Its NVLink domains come from the ranks' hostnames (Topology.from_group), or
from MOE_DISPATCHER_NVL_SIZE. Buffers are sized from the tensors the first layer dispatches and re-created
only when a later call needs more room; every rank of the group sees the same shapes, so all of them
re-create together (creating a Buffer is collective).
"""
from __future__ import annotations

import torch.distributed as dist

from moe_dispatcher import Buffer, Topology
from moe_dispatcher.buffer import BACKEND_ENV
from moe_dispatcher.buffer import BACKENDS as BUFFER_BACKENDS
from moe_dispatcher.env import env_choice, env_int

POOL_ENV = "MOE_DISPATCHER_POOL_BYTES"
_backend = {"chosen": None}  # register(backend=...)'s choice; None: $MOE_DISPATCHER_BACKEND, else auto
_pool = {"bytes": None}  # register(pool_bytes=...)'s choice; None: $MOE_DISPATCHER_POOL_BYTES, else 0
_topologies: dict[int, tuple[dist.ProcessGroup, Topology]] = {}
_buffers: dict[tuple[int, bool], tuple[dist.ProcessGroup, Buffer]] = {}


def buffer_backend() -> str | None:
    """The Buffer backend our dispatchers ask for: register(backend=...), else $MOE_DISPATCHER_BACKEND,
    else None (auto: the compiled kernels on CUDA tensors when built, the reference backend otherwise)."""
    name = _backend["chosen"] or env_choice(BACKEND_ENV, BUFFER_BACKENDS, None)
    return None if name in (None, "auto") else check_buffer_backend(name, BACKEND_ENV)


def choose_buffer_backend(name: str) -> None:
    """register(backend=...): the Buffer backend every dispatcher built afterwards asks for."""
    _backend["chosen"] = check_buffer_backend(name, "register(backend=...)")


def check_buffer_backend(name: str, where: str) -> str:
    if name not in BUFFER_BACKENDS:
        raise ValueError(f"moe_dispatcher: unknown Buffer backend {name!r} (from {where}); "
                         f"choose one of {', '.join(BUFFER_BACKENDS)}")
    return name


def pool_bytes() -> int:
    """Bytes of peer pool per GPU of the normal-mode Buffers (Buffer(num_pool_bytes=...)): register(pool_bytes=...),
    else $MOE_DISPATCHER_POOL_BYTES, else 0 (none). With a pool the dispatch writes rows straight into the
    receivers' memory and the combine pulls them (docs/intranode.md, "direct dispatch", "pull combine")."""
    chosen = _pool["bytes"]
    return chosen if chosen is not None else env_int(POOL_ENV, 0, minimum=0)


def choose_pool_bytes(num_bytes: int) -> None:
    """register(pool_bytes=...): the peer pool of every normal-mode Buffer created afterwards."""
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
        raise ValueError(f"moe_dispatcher: register(pool_bytes=...) must be an int >= 0, got {num_bytes!r}")
    _pool["bytes"] = num_bytes


def dispatch_group(pg_collection=None) -> dist.ProcessGroup:
    """The group the dispatcher exchanges tokens over: pg_collection.tp_ep, else Megatron's parallel state."""
    if pg_collection is not None:
        return pg_collection.tp_ep
    from megatron.core import parallel_state
    return parallel_state.get_expert_tensor_and_model_parallel_group()


def topology_of(group: dist.ProcessGroup) -> Topology:
    """Topology of `group`, computed once (collective the first time: hostnames are exchanged in a round bounded by
    MOE_DISPATCHER_TIMEOUT_S, Topology.from_group)."""
    entry = _topologies.get(id(group))
    if entry is None or entry[0] is not group:
        entry = (group, Topology.from_group(group))
        _topologies[id(group)] = entry
    return entry[1]


def megatron_topology(pg_collection=None) -> Topology:
    """NVLink domains of the ranks Megatron's MoE layers dispatch over (see dispatch_group)."""
    return topology_of(dispatch_group(pg_collection))


def normal_buffer_bytes(hidden_bytes: int, num_ranks: int, num_domains: int) -> tuple[int, int]:
    """(num_nvl_bytes, num_rdma_bytes) for normal-mode dispatch and combine of rows of `hidden_bytes`."""
    configs = (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks))
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) for c in configs) if num_domains > 1 else 0
    return nvl, rdma


def get_buffer(group: dist.ProcessGroup, *, hidden: int, element_size: int, low_latency: bool = False,
               num_max_dispatch_tokens_per_rank: int = 0, num_experts: int = 0,
               backend: str | None = None) -> Buffer:
    """The group's Buffer for this mode, big enough for rows of `hidden` elements (and, in low-latency mode,
    `num_max_dispatch_tokens_per_rank` tokens over `num_experts` experts). A Buffer that is too small is
    replaced, not destroyed: handles of calls still in flight (their backward passes) keep it alive."""
    topology = topology_of(group)
    num_ranks = topology.num_ranks
    if low_latency:
        nvl, rdma = 0, Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                             num_experts)
    else:
        # DeepEP's convention: rows are sized for at least 2 bytes per element (bf16 combine of fp8 dispatch).
        nvl, rdma = normal_buffer_bytes(hidden * max(element_size, 2), num_ranks, topology.num_domains)
    pool = 0 if low_latency else pool_bytes()
    key = (id(group), low_latency)
    entry = _buffers.get(key)
    if entry is not None and entry[0] is group:
        buffer = entry[1]
        if (buffer.num_nvl_bytes >= nvl and buffer.num_rdma_bytes >= rdma and buffer.num_pool_bytes == pool
                and (backend is None or buffer.backend == backend)):
            return buffer
    # DeepEP's low-latency convention: one queue pair per local expert.
    qps = {"num_qps_per_rank": max(1, num_experts // num_ranks)} if low_latency else {}
    buffer = Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=low_latency, backend=backend,
                    topology=topology, num_pool_bytes=pool, **qps)
    _buffers[key] = (group, buffer)
    return buffer


def destroy_buffers() -> None:
    """Collective (every rank, at the same point, e.g. the end of training): destroy() every cached Buffer, in the
    order they were cached (the same on every rank), so their memory and peer mappings go now and nothing of ours
    holds their groups afterwards; then forget them (release_buffers). Without it, the Buffers would be parked
    by garbage collection until every peer posted (runtime/release.py), holding their groups meanwhile."""
    for _, buffer in list(_buffers.values()):
        buffer.destroy()
    release_buffers()


def release_buffers() -> None:
    """Forget every cached Buffer and Topology (for tests and re-initialised process groups)."""
    _buffers.clear()
    _topologies.clear()
