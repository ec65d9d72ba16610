"""The host side of the internode cached calls' ring signatures (issue 16 item 2), on CPU: the real
InternodeBackend's Python over the stub modules of tests/helpers/stub_extension.py (attach_stub_internode).

Checked: every cached plan (dispatch along a handle, combine) and the bias combine's launch get two ring signature
words, [RDMA hop, NVLink hop], each the fields that fix the slot layout of that hop's rings with that hop's slot
count; a cached dispatch hands its kernels the handle's fwd_mask (read only: where a forwarder sends the rows of a
source whose RDMA word differs). A recorded disagreement (mailbox pairs by group rank, problem 6 from notify) raises
SignatureMismatch at the fresh dispatch's host wait, naming the field; for a source in another NVLink domain (the
RDMA hop) the slot count is config.num_max_rdma_chunked_recv_tokens.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from stub_extension import attach_stub_internode

from moe_dispatcher import Buffer
from moe_dispatcher.compiled import HandleState
from moe_dispatcher.handle import DispatchHandle
from moe_dispatcher.signature import SignatureMismatch, dispatch_signature, ring_disagreement, ring_signature_word

T, H, K, ROWS = 16, 256, 2, 24
RANKS, NVL = 4, 2  # two NVLink domains of two; this process is rank 0


@pytest.fixture
def backend(monkeypatch, tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        buf = Buffer(backend="reference", explicitly_destroy=True)
        yield attach_stub_internode(buf, 0, RANKS, NVL, monkeypatch.setattr)
        buf.destroy()
    finally:
        dist.destroy_process_group()


def _handle(channels: int) -> DispatchHandle:
    """A handle as the internode fresh dispatch makes it (routing: channels, recv_channel_offset, fwd_offset,
    fwd_mask, fwd_capacity, fwd_row_offset, fwd_rows; no peer pool)."""
    fwd_mask = torch.ones(10, dtype=torch.int32)
    routing = (channels, torch.zeros(RANKS, channels + 1, dtype=torch.int32),
               torch.zeros(RANKS // NVL, channels + 1, dtype=torch.int32), fwd_mask, 10,
               torch.zeros(RANKS // NVL, NVL, channels, dtype=torch.int32), None)
    return DispatchHandle(torch.zeros(RANKS, RANKS, dtype=torch.int32), torch.ones(T, RANKS, dtype=torch.bool),
                          torch.zeros(ROWS, dtype=torch.int32), ROWS, T, 0, "internode", 0,
                          backend_state=HandleState(routing))


def test_cached_internode_calls_carry_one_ring_signature_per_hop(backend):
    b = backend
    dispatch_config, combine_config = Buffer.get_dispatch_config(RANKS), Buffer.get_combine_config(RANKS)
    h = _handle(dispatch_config.num_channels)
    x = torch.randn(T, H).bfloat16()
    y = torch.randn(ROWS, H).bfloat16()
    w = torch.rand(ROWS, K)
    scales = torch.ones(T, H // 128)
    other = dataclasses.replace(dispatch_config, num_max_rdma_chunked_recv_tokens=128)
    b.cached_dispatch(x, None, h)
    b.cached_dispatch(x.to(torch.float8_e4m3fn), scales, h)
    b.cached_dispatch(x, None, h, config=other)
    b.combine(y, h, None, ())
    b.combine(y.float(), h, w, ())

    def words(operation, hidden, dtype, scales_dtype, scales_columns, weights, config):
        return [ring_signature_word(operation, hidden, dtype, scales_dtype, scales_columns, weights, slots)
                for slots in (config.num_max_rdma_chunked_recv_tokens, config.num_max_nvl_chunked_recv_tokens)]

    want = [words("cached dispatch", H, torch.bfloat16, None, 0, 0, dispatch_config),
            words("cached dispatch", H, torch.float8_e4m3fn, torch.float32, H // 128, 0, dispatch_config),
            words("cached dispatch", H, torch.bfloat16, None, 0, 0, other),
            words("combine", H, torch.bfloat16, None, 0, 0, combine_config),
            words("combine", H, torch.float32, None, 0, K, combine_config)]
    got = [args[-1] for _, args in b._intra.plans]
    assert got == want, (got, want)
    assert len({tuple(v) for v in got}) == len(got) and all(0 < v < 1 << 63 for pair in got for v in pair)
    assert want[2][0] != want[0][0] and want[2][1] == want[0][1]  # only the RDMA hop's word changed
    # The cached dispatch reads the handle's forward mask (never writes it: the kernels take it read only).
    _, _, _, fwd_mask, capacity, _, _ = h.backend_state.routing
    assert all(args[3] is fwd_mask and args[4] == capacity for kind, args in b._intra.plans if kind == "CachedDispatch")
    # The bias combine (no plan) launches with the same words as the plan of its arguments.
    b.combine(y, h, None, (torch.zeros(T, H, dtype=torch.bfloat16),))
    assert [args[-1] for kind, args in b._intra.launches if kind == "internode combine"] == [want[3]]


def test_a_recorded_internode_ring_mismatch_raises_naming_the_hop_fields(backend, monkeypatch):
    """Rank 0's forwarder found rank 2's RDMA word differing (another domain: its slot count field is the RDMA
    rings'), its receiver found rank 1's NVLink word differing; the fresh dispatch's notify reported problem 6:
    _raise_disagreement names both, and takes the records."""
    b = backend
    mine = ring_signature_word("cached dispatch", H, torch.bfloat16, None, 0, 0, 256)
    b._ipc.ring_mismatch = [(1, ring_signature_word("cached dispatch", H, torch.bfloat16, None, 0, 0, 128), mine),
                            (2, ring_signature_word("cached dispatch", H, torch.bfloat16, None, 0, 0, 64), mine)]
    b._ipc.signature_mismatch = (1, [6])
    idx = torch.zeros(T, K, dtype=torch.int64)
    b._signatures.add(1, dispatch_signature("dispatch", torch.zeros(T, H).bfloat16(), None, idx, None, 8,
                                            Buffer.get_dispatch_config(RANKS)))  # the fresh dispatch 1 notify refused
    # (gloo's all-gather takes no stacked output as NCCL's does: one rank's gather is a copy)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, inp, group=None: out.copy_(inp.view(out.shape)))
    with pytest.raises(SignatureMismatch) as err:
        b._raise_disagreement()
    text = str(err.value)
    assert "on rank 0, a cached dispatch or combine along a handle received rows laid out by another" in text, text
    assert "config.num_max_nvl_chunked_recv_tokens differs: 256 on rank 0; 128 on rank 1" in text, text
    assert "config.num_max_rdma_chunked_recv_tokens differs: 256 on rank 0; 64 on rank 2" in text, text
    assert b._ipc.ring_mismatch is None


def test_ring_disagreement_names_the_rdma_slots_for_sources_in_other_domains():
    word = lambda slots: ring_signature_word("combine", H, torch.bfloat16, None, 0, 0, slots)
    same_domain = ring_disagreement(2, [(3, word(64), word(256))], nvl_size=2)
    other_domain = ring_disagreement(2, [(1, word(64), word(256))], nvl_size=2)
    intranode = ring_disagreement(2, [(1, word(64), word(256))])
    assert "config.num_max_nvl_chunked_recv_tokens differs: 256 on rank 2; 64 on rank 3" in same_domain
    assert "config.num_max_rdma_chunked_recv_tokens differs: 256 on rank 2; 64 on rank 1" in other_domain
    assert "config.num_max_nvl_chunked_recv_tokens differs: 256 on rank 2; 64 on rank 1" in intranode
