"""Count arguments (issue 16 item 5): sizes, token and expert numbers and Config fields must be Python ints.
Bools are refused (True is not a count), and so are floats, strings and numpy / torch scalars (TypeError, naming
the argument; the message suggests int(...) for integer-like scalars); a value out of range is a ValueError
naming the argument. Valid ints still work, int subclasses (IntEnum) included.
"""
from __future__ import annotations

import enum
import re

import numpy as np
import pytest
import torch

from moe_dispatcher import Buffer, Config, Topology
from moe_dispatcher.config import get_dispatch_config
from moe_dispatcher.validation import check_count

NOT_COUNTS = [True, False, 2.0, "2", None, np.int64(2), torch.tensor(2)]
T, H, E, K = 6, 128, 4, 2


class Sms(enum.IntEnum):
    TWENTY = 20


def _type_error(name: str, call) -> str:
    with pytest.raises(TypeError, match=re.escape(name) + " must be an int") as err:
        call()
    return str(err.value)


@pytest.mark.parametrize("value", NOT_COUNTS, ids=repr)
def test_check_count_refuses_non_ints(value):
    msg = _type_error("num_widgets", lambda: check_count("num_widgets", value, 1))
    assert type(value).__name__ in msg
    if isinstance(value, (np.integer, torch.Tensor)):
        assert "int(...)" in msg  # integer-like scalars: the message says how to pass them


def test_check_count_range_and_valid_values():
    with pytest.raises(ValueError, match="num_widgets must be an int >= 1, got 0"):
        check_count("num_widgets", 0, 1)
    assert check_count("num_widgets", 3, 1) == 3
    assert check_count("num_widgets", Sms.TWENTY, 1) == 20


# ------------------------------------------------------------------ Config and Topology fields
@pytest.mark.parametrize("field", ["num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                                   "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"])
@pytest.mark.parametrize("value", [True, 20.0, "20", np.int64(20)], ids=repr)
def test_config_fields_are_ints(field, value):
    _type_error(f"Config.{field}", lambda: Config(**{field: value}))


def test_config_values_name_the_field():
    with pytest.raises(ValueError, match="Config.num_sms must be an int >= 1, got 0"):
        Config(num_sms=0)
    with pytest.raises(ValueError, match="Config.num_sms must be a positive even number, got 7"):
        Config(num_sms=7)
    with pytest.raises(ValueError, match="Config.num_max_rdma_chunked_send_tokens must be an int >= 1, got -1"):
        Config(num_max_rdma_chunked_send_tokens=-1)
    assert Config(Sms.TWENTY, 6, 256, 6, 256).num_channels == 10
    assert get_dispatch_config(4, 24).num_sms == 24


def test_size_hints_and_tables_take_int_counts():
    cfg = Config()
    _type_error("hidden_bytes", lambda: cfg.get_nvl_buffer_size_hint(7168.0, 4))
    _type_error("num_ranks", lambda: cfg.get_nvl_buffer_size_hint(7168, True))
    _type_error("hidden_bytes", lambda: cfg.get_rdma_buffer_size_hint("7168", 4))
    _type_error("nvl_size", lambda: cfg.get_rdma_buffer_size_hint(7168, 4, True))
    _type_error("num_ranks", lambda: get_dispatch_config(4.0, 20))
    for args in ((True, 128, 2, 4), (8, True, 2, 4), (8, 128, 2.0, 4), (8, 128, 2, np.int32(4))):
        with pytest.raises(TypeError, match="must be an int"):
            Buffer.get_low_latency_rdma_size_hint(*args)
    assert cfg.get_nvl_buffer_size_hint(7168, 4) > 0 and Buffer.get_low_latency_rdma_size_hint(8, 128, 2, 4) > 0


def test_topology_fields_are_ints():
    _type_error("Topology.nvl_size", lambda: Topology(0, 2, True))
    _type_error("Topology.rank", lambda: Topology(False, 2, 2))
    _type_error("Topology.num_ranks", lambda: Topology(0, 2.0, 2))
    assert Topology(1, 4, 2).domain == 0


# ------------------------------------------------------------------ Buffer
@pytest.mark.parametrize("name", ["num_nvl_bytes", "num_rdma_bytes", "num_qps_per_rank"])
@pytest.mark.parametrize("value", [True, 1.0, np.int64(1)], ids=repr)
def test_buffer_sizes_are_ints(world, name, value):
    _type_error(name, lambda: Buffer(backend="reference", **{name: value}))


def test_buffer_sizes_range_and_topology_size(world):
    with pytest.raises(ValueError, match="num_rdma_bytes must be an int >= 0, got -1"):
        Buffer(backend="reference", num_rdma_bytes=-1)
    _type_error("nvl_size", lambda: Topology.from_group(nvl_size=True))
    assert Buffer(backend="reference", num_nvl_bytes=0, num_qps_per_rank=Sms.TWENTY).num_qps_per_rank == 20


@pytest.mark.parametrize("value", [True, 24.0, np.int64(24)], ids=repr)
def test_set_num_sms_takes_an_int(value):
    before = Buffer.num_sms
    _type_error("num_sms", lambda: Buffer.set_num_sms(value))
    assert Buffer.num_sms == before
    with pytest.raises(ValueError, match="num_sms must be a positive even int, got 23"):
        Buffer.set_num_sms(23)


def _routing():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    return x, idx, torch.rand(T, K, generator=g)


@pytest.mark.parametrize("name", ["num_worst_tokens", "expert_alignment"])
@pytest.mark.parametrize("value", [True, 1.0, np.int64(1)], ids=repr)
def test_dispatch_counts_are_ints(world, name, value):
    """Before: num_worst_tokens=True / expert_alignment=True were taken as 1."""
    buf = Buffer(backend="reference")
    x, idx, w = _routing()
    nt_rank, _, nt_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    _type_error(name, lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=nt_rank,
                                           is_token_in_rank=in_rank, num_tokens_per_expert=nt_expert, **{name: value}))
    _type_error(name, lambda: buf.expert_major_dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                        **{name: value}))
    # the cached call (handle only) checks them too
    _, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=nt_rank,
                                         is_token_in_rank=in_rank, num_tokens_per_expert=nt_expert)
    _type_error(name, lambda: buf.dispatch(x, handle=handle, **{name: value}))


def test_dispatch_valid_counts_still_work(world):
    buf = Buffer(backend="reference")
    x, idx, w = _routing()
    px, _, counts, _, _, _ = buf.expert_major_dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                       expert_alignment=Sms.TWENTY, num_worst_tokens=0)
    assert all(c % 20 == 0 for c in counts) and px.shape[0] == sum(counts)
    _type_error("num_experts", lambda: buf.expert_major_dispatch(x, topk_idx=idx, num_experts=True))
    _type_error("expert_alignment", lambda: buf.expert_major_dispatch(x, topk_idx=idx, num_experts=E,
                                                                      expert_alignment=True))
    _type_error("num_experts", lambda: buf.get_dispatch_layout(idx, float(E)))


@pytest.mark.parametrize("name, position", [("num_max_dispatch_tokens_per_rank", 2), ("num_experts", 3)])
@pytest.mark.parametrize("value", [True, 8.0, np.int64(8)], ids=repr)
def test_low_latency_counts_are_ints(world, name, position, value):
    """Before: num_max_dispatch_tokens_per_rank=True was taken as 1 (then failed for more than one token)."""
    buf = Buffer(backend="reference", low_latency_mode=True,
                 num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(8, H, 1, 8))
    x, idx, _ = _routing()
    args = [x.bfloat16()[:1], idx[:1], 8, 8]
    args[position] = value
    _type_error(name, lambda: buf.low_latency_dispatch(*args, use_fp8=False))
    clean = [8, H, 8]
    clean[0 if position == 2 else 2] = value
    _type_error(name, lambda: buf.clean_low_latency_buffer(*clean))
    _type_error("hidden", lambda: buf.clean_low_latency_buffer(8, True, 8))
    recv = buf.low_latency_dispatch(x.bfloat16()[:1], idx[:1], 8, 8, use_fp8=False)
    assert recv[1].sum() == K  # valid ints still work
