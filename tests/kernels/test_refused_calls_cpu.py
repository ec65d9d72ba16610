"""Buffer.check_refused_calls on the compiled backends' host side (CPU, the stub extension of
tests/helpers/stub_extension.py): a dispatch with num_worst_tokens never waits for notify, so a refusal notify
recorded for it (its ranks disagreed) was raised only by the next synchronised dispatch. check_refused_calls raises
it now, through the synchronised dispatch's own report: it waits for the notify of the latest fresh dispatch
launched, then raises SignatureMismatch naming the fields (once: the record is taken), a recorded timeout as any
call does, and makes no collective when nothing is pending. The reference backend raises at the call: nothing to
do there. (Two ranks and the Megatron step-end check: tests/megatron/test_megatron_refused_calls_cpu.py.)
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from stub_extension import attach_stub_internode, single_rank_stub

from moe_dispatcher import Buffer
from moe_dispatcher.compiled.intranode import KEPT_SIGNATURES
from moe_dispatcher.signature import KeptSignatures, SignatureMismatch, dispatch_signature

T, H, E, K = 16, 256, 8, 2
ROWS = 24


@pytest.fixture
def world(monkeypatch, tmp_path):
    with single_rank_stub(str(tmp_path / "store"), ROWS, monkeypatch.setattr, T, H, E, K) as (buf, backend, _, x, idx):
        backend.device = torch.device("cpu")  # where a disagreement's signatures are gathered
        yield types.SimpleNamespace(buf=buf, backend=backend, ipc=backend._ipc, x=x, idx=idx)


def _bounded(w, x=None) -> None:
    """An expert-major dispatch with num_worst_tokens (no host wait) on the stub backend."""
    w.backend.expert_major_dispatch(w.x if x is None else x, None, w.idx, None, E, 1, 64)


def _no_collective(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("check_refused_calls made a collective with nothing to report")
    monkeypatch.setattr(dist, "all_gather_into_tensor", fail)


def test_a_refusal_of_a_bounded_call_is_raised_now_naming_the_field(world, monkeypatch):
    """notify refused the second of three bounded calls (the mailbox holds its seq and the problem words): before,
    nothing but a synchronised dispatch raised it. check_refused_calls waits for the latest notify, raises
    SignatureMismatch naming the field and the call, posts no abort, and takes the record: the next check raises
    nothing and makes no collective."""
    w = world
    _bounded(w)
    _bounded(w)  # the call notify refused: this rank's layout kernel found bad expert ids (problem word 4)
    refused = w.backend._seq
    _bounded(w)
    w.ipc.signature_mismatch = (refused, [4])  # what every rank's notify of that call recorded
    # One rank's gather of [1, W] is a copy (gloo's all-gather takes no stacked output as NCCL's does).
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, inp, group=None: out.copy_(inp.view(out.shape)))
    waits = len(w.ipc.waits)
    with pytest.raises(SignatureMismatch, match=f"expert-major dispatch: the ranks' calls do not agree: on rank 0, "
                                                f"get_dispatch_layout was given expert ids outside .*found by the "
                                                f"notify of fresh dispatch {refused} of this Buffer") as err:
        w.buf.check_refused_calls()
    assert w.ipc.waits[waits:] == [w.backend._seq], w.ipc.waits  # the latest notify, once
    assert not w.ipc.abort_posted and w.ipc.signature_mismatch is None
    assert getattr(err.value, "raised_on_every_rank", False)
    _no_collective(monkeypatch)
    w.buf.check_refused_calls()


def test_a_refusal_a_whole_step_of_calls_back_still_names_its_fields(world, monkeypatch):
    """A step makes hundreds of bounded dispatches (every layer's and microbatch's) before its end reports: the
    refused call's signature must still be kept then. Before, only the latest 64 calls' were (KEPT_SIGNATURES), and
    the error said only that the hashes differ. Now equal consecutive signatures share one kept run."""
    w = world
    _bounded(w)  # refused: this rank's problem word
    refused = w.backend._seq
    for _ in range(3 * KEPT_SIGNATURES):
        _bounded(w)
    w.ipc.signature_mismatch = (refused, [4])
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, inp, group=None: out.copy_(inp.view(out.shape)))
    with pytest.raises(SignatureMismatch, match="expert-major dispatch: the ranks' calls do not agree: on rank 0, "
                                                "get_dispatch_layout was given expert ids outside"):
        w.buf.check_refused_calls()


def test_kept_signatures_keep_runs_of_equal_signatures():
    """KeptSignatures: the signature of every call of the latest `runs` runs, by seq; older calls and seqs never
    added answer None; numbers that wrap start afresh."""
    x = torch.zeros(4, H)
    sig = lambda hidden: dispatch_signature("dispatch", x[:, :hidden], None, None, None, E, Buffer.get_dispatch_config(2))
    kept = KeptSignatures(2)
    for seq, hidden in enumerate([8, 8, 16, 16, 16, 8, 8], start=1):
        kept.add(seq, sig(hidden))
    hidden_of = lambda seq: kept.get(seq).values[0] if kept.get(seq) is not None else None
    assert [hidden_of(seq) for seq in range(1, 9)] == [None, None, 16, 16, 16, 8, 8, None]
    kept.add(1, sig(32))  # wrapped
    assert hidden_of(1) == 32 and hidden_of(3) is None


def test_nothing_pending_makes_no_collective(world, monkeypatch):
    """No refusal recorded: a wait for the latest notify (done in practice) and nothing else; before any fresh
    dispatch, not even that."""
    w = world
    _no_collective(monkeypatch)
    w.buf.check_refused_calls()
    assert w.ipc.waits == []
    _bounded(w)
    _bounded(w)
    w.buf.check_refused_calls()
    assert w.ipc.waits == [w.backend._seq]


def test_a_notify_that_never_launched_is_not_waited_for(world, monkeypatch):
    """A fresh dispatch whose notify launch raised (the native launcher's checks) publishes no seq: the check waits
    for the latest notify that did launch, not for one that never comes (the host's wait would spin to its
    timeout)."""
    w = world
    _bounded(w)
    launched = w.backend._seq

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")
    monkeypatch.setattr(w.backend._mod, "notify", broken)
    with pytest.raises(RuntimeError, match="launch failed"):
        _bounded(w)
    assert w.backend._seq == launched + 1
    w.buf.check_refused_calls()
    assert w.ipc.waits == [launched]


def test_a_recorded_timeout_raises_and_posts_the_abort(world):
    """A kernel of this rank recorded a timeout: the check raises it as any call does, and posts this rank's abort
    (its peers' next calls fail fast)."""
    w = world
    _bounded(w)
    w.ipc.timeout = (1, "notify (barrier before dispatch)", 0, 1)
    with pytest.raises(RuntimeError, match="rank 0 timed out .* in notify"):
        w.buf.check_refused_calls()
    assert w.ipc.abort_posted


def test_the_internode_backend_reports_alike(world, monkeypatch):
    """The internode backend's check: the same wait and report (its notify publishes into the domain's mailbox)."""
    w = world
    b = attach_stub_internode(w.buf, 0, 2, 1, monkeypatch.setattr)
    _no_collective(monkeypatch)
    b.check_refused_calls()  # nothing launched, nothing pending
    assert b._ipc.waits == []
    sig = dispatch_signature("dispatch", w.x, None, w.idx, None, E, Buffer.get_dispatch_config(2))
    b._signatures.add(7, sig)
    b._notified = b._ipc.seq = 7
    b._ipc.signature_mismatch = (7, [4])  # this rank's layout kernel found bad expert ids (a world of one)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, inp, group=None: out.copy_(inp.view(out.shape)))
    with pytest.raises(SignatureMismatch, match="on rank 0, get_dispatch_layout was given expert ids outside"):
        b.check_refused_calls()
    assert b._ipc.waits == [7]


def test_the_reference_backend_has_nothing_to_check(tmp_path, monkeypatch):
    """A Buffer without compiled kernels raised every disagreement at its call: the check makes no wait and no
    collective."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        buf = Buffer(backend="reference", explicitly_destroy=True)
        monkeypatch.setattr(dist, "all_gather", lambda *a, **k: (_ for _ in ()).throw(AssertionError("collective")))
        _no_collective(monkeypatch)
        buf.check_refused_calls()
        monkeypatch.undo()
        buf.destroy()
        with pytest.raises(RuntimeError, match="destroyed"):
            buf.check_refused_calls()
    finally:
        dist.destroy_process_group()
