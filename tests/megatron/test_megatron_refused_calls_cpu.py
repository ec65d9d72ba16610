"""A refused dispatch in Megatron training with fixed expert rows raises by the step's end, on every rank (CPU).

With ``bound`` sizing or a capacity factor every dispatch after the first is a num_worst_tokens call, which never
waits for the compiled kernels' notify. A call whose ranks disagree is refused by notify on every rank: it moves
no row, returns padding rows, and was reported only at the next synchronised dispatch, which such training never
makes, so every token of it was dropped without an error. The step-end check (guard.run_step) now asks the
Buffers those calls used to raise it (Buffer.check_refused_calls): SignatureMismatch on every rank, naming the
field as the synchronised dispatch would.

Two gloo ranks run the real dispatcher (MoEDispatcherTokenDispatcher: dispatch and combine, three steps of two
calls each) over the real IntranodeBackend on the stub extension (tests/helpers/stub_extension.py), whose notify
exchanges every rank's signature hash and problem word over gloo and refuses a call as the native notify does (the
same verdict and mailbox record on every rank). In step 1 the last rank's Buffer.num_sms differs (so does the
config its dispatches carry). Also: the default exact sizing (each dispatch synchronised: it raises at the call,
and the step's end reads nothing), and the reference backend (it agrees at every call: it raises at the call).
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from dist import case, run_distributed

pytest.importorskip("megatron.core", reason="needs megatron-core (bash tools/install_megatron.sh)")

H, E, K, FFN, T = 128, 4, 2, 64, 16
ROWS = 24  # the rows the stub's notify reports to a synchronised dispatch
STEPS, ODD_STEP, CALLS_PER_STEP = 3, 1, 2
CASES = ("kernels bound", "kernels capacity factor", "kernels exact", "reference bound")


def _setup() -> None:
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    import moe_dispatcher.integrations.megatron  # noqa: F401  (registers)
    from moe_dispatcher.integrations.megatron import cpu
    cpu.enable()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1)


def _dispatcher(capacity_factor: float | None):
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_dispatcher.integrations.megatron import MoEDispatcherTokenDispatcher
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_ffn_hidden_size=FFN,
        ffn_hidden_size=FFN, moe_router_topk=K, moe_token_dispatcher_type="moe_dispatcher", use_cpu_initialization=True,
        add_bias_linear=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=2, gated_linear_unit=True, activation_func=F.silu)
    config.moe_expert_rank_capacity_factor = capacity_factor  # after the config's own check (docs/megatron.md)
    pg = get_default_pg_collection()
    local = E // 2
    first = dist.get_rank(pg.ep) * local
    return MoEDispatcherTokenDispatcher(local, list(range(first, first + local)), config=config, pg_collection=pg)


def _exchange_verdict(group):
    """The stub notify's verdict: every rank's (signature hash, problem word) gathered, refused when the hashes
    differ or a word is set, and the first refusal since the last report recorded in the mailbox (seq and every
    rank's problem word), as the native notify records it on every rank alike."""
    import torch.distributed as dist

    def verdict(ipc, seq: int, signature_hash: int, problem: int) -> bool:
        words = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(words, torch.tensor([signature_hash, problem], dtype=torch.int64), group=group)
        problems = [int(w[1]) for w in words]
        refused = len({int(w[0]) for w in words}) > 1 or any(problems)
        if refused and ipc.signature_mismatch is None:
            ipc.signature_mismatch = (seq, problems)
        return refused
    return verdict


def _flat_all_gather_into_tensor(real):
    """gloo's all_gather_into_tensor takes a flat output only (NCCL's takes [R, W] too, as signature.py passes)."""
    def gather(out, inp, group=None):
        flat = out.new_empty(out.numel())
        real(flat, inp.reshape(-1), group=group)
        out.copy_(flat.view(out.shape))
    return gather


def _steps(rank: int, world: int, label: str) -> dict[str, Any]:
    """Three steps through guard.run_step, each two dispatch + combine calls of the real dispatcher; the last rank's
    num_sms differs in step ODD_STEP. Returns what each step ended with and what the host waited for."""
    import torch.distributed as dist

    from moe_dispatcher import Buffer
    from moe_dispatcher.integrations.megatron import buffers, guard, sizing
    from moe_dispatcher.signature import SignatureMismatch
    kernels, mode = label.split(" ", 1)
    if mode == "bound":
        os.environ[sizing.ROWS_ENV] = "bound"
    d = _dispatcher(1.5 if mode == "capacity factor" else None)
    buf = Buffer(d.group, num_nvl_bytes=1 << 30, backend="reference", explicitly_destroy=True)
    backend = None
    if kernels == "kernels":
        from stub_extension import attach_stub_backend
        backend = attach_stub_backend(buf, ROWS)
        backend.capabilities = backend.capabilities._replace(devices=frozenset({"cpu", "cuda"}))  # serve CPU calls
        backend.device = torch.device("cpu")  # where the disagreement's signatures are gathered (gloo)
        backend._mod.verdict = _exchange_verdict(d.group)
    buffers._buffers[(id(d.group), False)] = (d.group, buf)  # the group's Buffer, which get_buffer returns
    g = torch.Generator().manual_seed(rank)
    ended, fresh = [], 0
    default_sms = Buffer.num_sms

    def call() -> None:
        nonlocal fresh
        x = torch.randn(T, 1, H, generator=g)
        scores = torch.randn(T, E, generator=g)
        routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, scores.topk(K, dim=1).indices, True)
        h, p = d.dispatch_preprocess(x, routing_map, scores.softmax(-1) * routing_map)
        fresh += 1  # a fresh dispatch (the call may raise)
        h, p = d.token_dispatch(h, p)
        rows, _, probs = d.dispatch_postprocess(h, p)
        d.combine_postprocess(d.token_combine(d.combine_preprocess(rows * probs.unsqueeze(-1))))

    for step in range(STEPS):
        with case(f"{label}: step {step}"):
            if step == ODD_STEP and rank == world - 1:
                Buffer.set_num_sms(8)
            try:
                guard.run_step(lambda: [call() for _ in range(CALLS_PER_STEP)])
                ended.append("ok")
            except SignatureMismatch as exc:
                ended.append(f"SignatureMismatch: {exc}")
            finally:
                Buffer.num_sms = default_sms
            dist.barrier()
    waits = list(backend._ipc.waits) if backend is not None else []
    result = {"ended": ended, "waits": waits, "fresh": fresh, "noted": len(getattr(guard, "_fixed_row_buffers", ()))}
    buf.destroy()
    buffers.release_buffers()
    os.environ.pop(sizing.ROWS_ENV, None)
    return result


def _world(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    _setup()
    dist.all_gather_into_tensor = _flat_all_gather_into_tensor(dist.all_gather_into_tensor)
    return {label: _steps(rank, world, label) for label in CASES}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_world, 2, timeout=240)


def _check_refused_step(results: list[dict[str, Any]], label: str) -> None:
    ended = [r[label]["ended"] for r in results]
    for rank, steps in enumerate(ended):
        assert steps[0] == "ok" and steps[2] == "ok", (label, rank, steps)
        assert steps[1].startswith("SignatureMismatch: ") and "config.num_sms differs" in steps[1] \
            and "on rank 1" in steps[1], (label, rank, steps)  # every rank, naming the field and the rank
    assert ended[0] == ended[1], ended


@pytest.mark.parametrize("label", ["kernels bound", "kernels capacity factor"])
def test_a_refused_fixed_row_dispatch_raises_on_every_rank_by_the_step_end(results, label):
    """Before: both ranks ended every step "ok" (the refused calls' tokens were dropped, never reported). The
    step's end waits for the latest notify of the Buffer once per step (the first, exact call of bound sizing
    waits too), and nothing stays noted after the check."""
    _check_refused_step(results, label)
    for r in results:
        exact_calls = 1 if label == "kernels bound" else 0
        assert r[label]["fresh"] == STEPS * CALLS_PER_STEP, r[label]
        assert len(r[label]["waits"]) == exact_calls + STEPS, r[label]
        assert r[label]["noted"] == 0, r[label]


def test_exact_sizing_raises_at_the_call_and_reads_nothing_at_the_step_end(results):
    """Default sizing: every dispatch is synchronised and raises a disagreement at its own host wait (the step
    raises there); the step's end waits for no notify of its own (one wait per dispatch, none more) and notes no
    Buffer."""
    _check_refused_step(results, "kernels exact")
    for r in results:
        info = r["kernels exact"]
        assert len(info["waits"]) == info["fresh"] and info["noted"] == 0, info


def test_the_reference_backend_raises_at_the_call_in_bound_mode(results):
    """The reference backend agrees every call in the call's own all-gather, num_worst_tokens or not: the same
    SignatureMismatch on every rank, at the call (the step then raises before its end)."""
    _check_refused_step(results, "reference bound")
