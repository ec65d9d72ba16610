"""A refused dispatch in Megatron training with fixed expert rows raises by the step's end on every rank (GPUs).

With ``bound`` sizing or a capacity factor every dispatch after the first is a num_worst_tokens call, which never
waits for notify. A call whose ranks disagree is refused by notify on every rank (it moves no row and returns
padding rows, csrc/kernels/common/refused_call.cuh) and was reported only at the next synchronised dispatch, which
such training never makes: its tokens were dropped without an error, step after step. The step-end check
(guard.run_step -> Buffer.check_refused_calls) now raises SignatureMismatch on every rank, naming the field.

Two ranks on NCCL, the compiled kernels (intranode, and internode with NVLink domains of 1 emulated by
MOE_DISPATCHER_NVL_SIZE). The real dispatcher (MoEDispatcherTokenDispatcher) runs three training steps of two
microbatches (dispatch, combine, backward) through guard.run_step; in step 1 the last rank's Buffer.num_sms
differs, so the config its dispatches carry differs. Then the Buffer alone: a bounded expert-major dispatch with
bad expert ids on the last rank (its layout kernel's problem word) raises at check_refused_calls. The calls never
wait for a peer (MOE_DISPATCHER_TIMEOUT_S is 30: a step that waited would exceed STEP_S), and the Buffer stays
usable afterwards.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Any

import pytest
import torch
from dist import case, nvl_env, run_distributed

pytest.importorskip("megatron.core", reason="needs megatron-core (bash tools/install_megatron.sh)")

pytestmark = pytest.mark.gpu

H, E, K, FFN, T = 128, 8, 2, 64, 64
STEPS, ODD_STEP, CALLS_PER_STEP = 3, 1, 2
STEP_S = 15.0  # a step whose refused calls waited for a peer would take MOE_DISPATCHER_TIMEOUT_S (30) at least
ENV = {"MOE_DISPATCHER_TIMEOUT_S": "30", "MOE_DISPATCHER_BACKEND": "kernels"}


def _setup(world: int) -> None:
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import moe_dispatcher.integrations.megatron  # noqa: F401  (registers)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world,
                                 expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(123)


def _dispatcher(world: int, capacity_factor: float | None):
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_dispatcher.integrations.megatron import MoEDispatcherTokenDispatcher
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_ffn_hidden_size=FFN,
        ffn_hidden_size=FFN, moe_router_topk=K, moe_token_dispatcher_type="moe_dispatcher", add_bias_linear=False,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, expert_model_parallel_size=world,
        gated_linear_unit=True, activation_func=F.silu, bf16=True, params_dtype=torch.bfloat16)
    config.moe_expert_rank_capacity_factor = capacity_factor  # set after the config's own check (docs/megatron.md)
    pg = get_default_pg_collection()
    local = E // world
    first = dist.get_rank(pg.ep) * local
    return MoEDispatcherTokenDispatcher(local, list(range(first, first + local)), config=config, pg_collection=pg)


def _steps(rank: int, world: int, mode: str, kernels: str) -> dict[str, Any]:
    """Three guarded steps of the real dispatcher; the last rank's num_sms differs in step ODD_STEP. Returns how
    each step ended and how long it took."""
    import torch.distributed as dist

    from moe_dispatcher import Buffer
    from moe_dispatcher.integrations.megatron import buffers, guard, sizing
    from moe_dispatcher.signature import SignatureMismatch
    if mode == "bound":
        os.environ[sizing.ROWS_ENV] = "bound"
    d = _dispatcher(world, 1.5 if mode == "capacity factor" else None)
    g = torch.Generator(device="cuda").manual_seed(rank)
    default_sms = Buffer.num_sms
    ended, took = [], []

    def microbatch() -> None:
        x = torch.randn(T, 1, H, device="cuda", generator=g).bfloat16().requires_grad_()
        scores = torch.randn(T, E, device="cuda", generator=g)
        routing_map = torch.zeros(T, E, dtype=torch.bool, device="cuda").scatter_(1, scores.topk(K, dim=1).indices,
                                                                                   True)
        h, p = d.dispatch_preprocess(x, routing_map, scores.softmax(-1) * routing_map)
        h, p = d.token_dispatch(h, p)
        rows, _, probs = d.dispatch_postprocess(h, p)
        y = d.combine_postprocess(d.token_combine(d.combine_preprocess(rows * probs.unsqueeze(-1).to(rows.dtype))))
        y.float().sum().backward()

    for step in range(STEPS):
        with case(f"{kernels}, {mode}: step {step}"):
            if step == ODD_STEP and rank == world - 1:
                Buffer.set_num_sms(8)
            start = time.monotonic()
            try:
                guard.run_step(lambda: [microbatch() for _ in range(CALLS_PER_STEP)])
                ended.append("ok")
            except SignatureMismatch as exc:
                ended.append(f"SignatureMismatch: {exc}")
            finally:
                Buffer.num_sms = default_sms
            torch.cuda.synchronize()
            took.append(time.monotonic() - start)
            dist.barrier()
    served = [b._kernels.name for _, b in buffers._buffers.values() if b._kernels is not None]
    buffers.destroy_buffers()
    os.environ.pop(sizing.ROWS_ENV, None)
    return {"ended": ended, "took": took, "kernels": served}


def _buffer_alone(rank: int, world: int, kernels: str) -> list[str]:
    """A bounded expert-major dispatch with bad expert ids on the last rank (notify refuses it on every rank; it
    returns padding rows), then check_refused_calls: SignatureMismatch naming the rank and the problem. Then a
    bounded call that agrees: nothing to report, and its rows arrive."""
    from dist import make_buffer

    from moe_dispatcher.signature import SignatureMismatch
    buf = make_buffer(hidden_bytes=H * 2, backend="kernels", explicitly_destroy=True)
    assert buf._kernels is not None and buf._kernels.name == kernels, f"the {kernels} kernels must serve this Buffer"
    e = E
    g = torch.Generator(device="cuda").manual_seed(rank)
    idx = torch.rand(T, e, device="cuda", generator=g).topk(K, dim=1).indices
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    bad = idx.clone()
    if rank == world - 1:
        bad[3, 1] = e + 5
    seen = []
    with case(f"{kernels}: bad expert ids on the last rank, num_worst_tokens"):
        px, *_ = buf.expert_major_dispatch(x, topk_idx=bad, num_experts=e, num_worst_tokens=T * K * world)
        torch.cuda.synchronize()
        assert torch.count_nonzero(px) == 0, "the refused call moved rows"
        try:
            buf.check_refused_calls()
            seen.append("no error")
        except SignatureMismatch as exc:
            seen.append(str(exc))
    with case(f"{kernels}: an agreeing bounded call afterwards"):
        px, _, _, _, handle, _ = buf.expert_major_dispatch(x, topk_idx=idx, num_experts=e,
                                                           num_worst_tokens=T * K * world)
        buf.check_refused_calls()
        torch.cuda.synchronize()
        seen.append(f"rows needed {int(handle.rows_needed)}, non-zero rows {int((px != 0).any(1).sum())}")
    buf.destroy()
    return seen


def _world(rank: int, world: int, kernels: str) -> dict[str, Any]:
    _setup(world)
    out: dict[str, Any] = {mode: _steps(rank, world, mode, kernels) for mode in ("bound", "capacity factor")}
    out["buffer"] = _buffer_alone(rank, world, kernels)
    return out


@pytest.mark.parametrize("kernels,nvl", [("intranode", None), ("internode", 1)])
def test_a_refused_fixed_row_dispatch_raises_on_every_rank_by_the_step_end(kernels: str, nvl: int | None) -> None:
    results = run_distributed(_world, 2, kernels, backend="nccl", env={**ENV, **nvl_env(nvl)}, timeout=300)
    for mode in ("bound", "capacity factor"):
        ended = [r[mode]["ended"] for r in results]
        for rank, r in enumerate(results):
            info = r[mode]
            assert info["kernels"] and set(info["kernels"]) == {kernels}, (mode, rank, info)
            steps = info["ended"]
            # Before: ["ok", "ok", "ok"] (the refused calls' tokens dropped, never reported).
            assert steps[0] == "ok" and steps[2] == "ok", (mode, rank, steps)
            assert steps[1].startswith("SignatureMismatch: ") and "config.num_sms differs" in steps[1] \
                and "8 on rank 1" in steps[1], (mode, rank, steps)
            assert info["took"][ODD_STEP] < STEP_S, (mode, rank, info["took"])
        assert ended[0] == ended[1], ended
    for rank, r in enumerate(results):
        refusal, after = r["buffer"]
        assert "on rank 1, get_dispatch_layout was given expert ids outside" in refusal, (rank, refusal)
        assert after.startswith("rows needed ") and not after.endswith(" 0"), (rank, after)
