"""CPU checks of the internode backend's host-side logic: size hints, routing decisions (the buffer layout is the
extension's: tests/kernels/test_internode_gpu.py checks that the hints cover it)."""
from __future__ import annotations

import pytest

from moe_dispatcher.compiled import internode_decision
from moe_dispatcher.config import (Config, get_combine_config, get_dispatch_config, internode_nvl_header_bytes,
                                   internode_rdma_header_bytes)
from moe_dispatcher.topology import Topology


@pytest.mark.parametrize("num_ranks,nvl", [(4, 2), (4, 1), (8, 4), (8, 2), (16, 8), (64, 1)])
def test_rdma_hint_is_header_plus_rings(num_ranks: int, nvl: int) -> None:
    hidden_bytes = 7168 * 2
    header = internode_rdma_header_bytes(num_ranks, nvl)
    assert header % 4096 == 0
    for cfg in (get_dispatch_config(num_ranks, 24), get_combine_config(num_ranks, 24), Config(64, 32, 256, 32, 256)):
        hint = cfg.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, nvl)
        need = cfg.num_channels * cfg.num_max_rdma_chunked_recv_tokens * Config.slot_bytes(hidden_bytes)
        assert hint >= header + 2 * (num_ranks // nvl) * need


def test_rdma_hint_zero_for_one_domain(monkeypatch) -> None:
    monkeypatch.delenv("MOE_DISPATCHER_NVL_SIZE", raising=False)
    assert Config().get_rdma_buffer_size_hint(14336, 8) == 0
    assert Config().get_rdma_buffer_size_hint(14336, 4, 4) == 0
    monkeypatch.setenv("MOE_DISPATCHER_NVL_SIZE", "2")
    assert Config().get_rdma_buffer_size_hint(14336, 4) == Config().get_rdma_buffer_size_hint(14336, 4, 2) > 0
    with pytest.raises(ValueError):
        Config().get_rdma_buffer_size_hint(14336, 4, 3)


@pytest.mark.parametrize("num_ranks,nvl", [(4, 2), (4, 1), (8, 2)])
def test_nvl_hint_is_header_plus_rings(num_ranks: int, nvl: int) -> None:
    hidden_bytes = 7168 * 2
    for cfg in (get_dispatch_config(num_ranks, 24), get_combine_config(num_ranks, 24)):
        hint = cfg.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)
        need = cfg.num_channels * cfg.num_max_nvl_chunked_recv_tokens * Config.slot_bytes(hidden_bytes)
        assert (hint - internode_nvl_header_bytes(num_ranks)) // nvl >= need


def test_routing_decision() -> None:
    two = Topology(0, 4, 2)
    assert internode_decision(two, 1 << 20, 1 << 20, True) == ""
    assert "num_rdma_bytes=0" in internode_decision(two, 1 << 20, 0, True)
    assert "get_rdma_buffer_size_hint" in internode_decision(two, 1 << 20, 0, True)
    assert "without the internode kernels" in internode_decision(two, 1 << 20, 1 << 20, False)
    assert "at most 64" in internode_decision(Topology(0, 128, 2), 1, 1, True)
    assert internode_decision(Topology(0, 4, 1), 1 << 20, 1 << 20, True) == ""
