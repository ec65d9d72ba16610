"""The host side of refused calls (csrc/kernels/common/refused_call.cuh), on CPU over the stub extension
(tests/helpers/stub_extension.py): a num_worst_tokens dispatch does not wait for its notify, so a disagreement
of its ranks, which its kernels answer by moving nothing, is raised later. Besides the next synchronised
dispatch, a caller that checks its num_worst_tokens calls itself and then forgets their overflows
(Buffer._forget_dropped_rows: the Megatron integration's step end) gets it there: the backend first waits for
its latest notify, so every rank reads the same mailbox records, then raises SignatureMismatch on every rank.
GPU counterpart: tests/kernels/test_refused_calls_gpu.py.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from stub_extension import attach_stub_backend

from moe_dispatcher import Buffer
from moe_dispatcher.compiled import intranode
from moe_dispatcher.signature import SignatureMismatch

T, H, E, K = 16, 256, 8, 2
ROWS = 24


@pytest.fixture
def world(monkeypatch, tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        buf = Buffer(num_nvl_bytes=1 << 30, backend="reference", explicitly_destroy=True)
        backend = attach_stub_backend(buf, ROWS, monkeypatch.setattr)
        reports = []

        def report(group, device, signatures, seq, problems):  # raise_disagreement without its all-gather
            reports.append((seq, list(problems), signatures.get(seq)))
            raise SignatureMismatch(f"disagreement in call {seq}")
        monkeypatch.setattr(intranode, "raise_disagreement", report)
        g = torch.Generator().manual_seed(0)
        idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
        x = torch.randn(T, H, generator=g).bfloat16()

        def dispatch(num_worst_tokens: int = 0):
            return backend.dispatch(x, None, idx, None, torch.full((1,), T, dtype=torch.int32),
                                    torch.ones(T, 1, dtype=torch.bool), torch.zeros(E, dtype=torch.int32), 1,
                                    num_worst_tokens)
        yield types.SimpleNamespace(buf=buf, backend=backend, ipc=backend._ipc, dispatch=dispatch, reports=reports)
        buf.destroy()
    finally:
        dist.destroy_process_group()


def test_forgetting_overflows_raises_a_pending_disagreement(world):
    w = world
    w.dispatch(num_worst_tokens=T)  # does not wait for its notify
    refused = w.backend._seq
    w.dispatch(num_worst_tokens=T)
    latest = w.backend._seq
    assert w.ipc.waits == []
    w.ipc.mismatch = (refused, [0])  # what notify records on every rank for the refused call
    with pytest.raises(SignatureMismatch, match=f"disagreement in call {refused}"):
        w.buf._forget_dropped_rows()
    assert w.ipc.waits == [latest], "the host reads the records only after the latest notify published its results"
    seq, problems, signature = w.reports[0]
    assert (seq, problems) == (refused, [0]) and signature is not None and signature.values[0] == H
    w.buf._forget_dropped_rows()  # reported once
    assert len(w.reports) == 1


def test_forgetting_overflows_without_a_disagreement_raises_nothing(world):
    w = world
    w.buf._forget_dropped_rows()  # no fresh call yet: nothing to wait for
    assert w.ipc.waits == []
    w.dispatch(num_worst_tokens=T)
    w.buf._forget_dropped_rows()
    assert w.ipc.waits == [w.backend._seq] and w.reports == []

