"""GroupedGemmExperts (integrations/megatron/grouped_experts.py) against Megatron's SequentialMLP.

Same weights (copied expert by expert), same expert-major rows, counts and probs, same upstream gradient:
outputs, input and probs gradients, and weight gradients must match. On CPU (float32, the per-expert loop)
they are bit-identical, alone and inside a MoELayer with our dispatcher at EP=2. On a GPU (bfloat16,
torch's grouped matmul) they agree within bfloat16 rounding of the different GEMM kernels.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from dist import case, device, run_distributed

pytest.importorskip("megatron.core", reason="needs megatron-core (bash tools/install_megatron.sh)")

H, FFN, E = 64, 48, 4


def _setup(ep: int) -> None:
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    import moe_dispatcher.integrations.megatron  # noqa: F401  (registers)
    from moe_dispatcher.integrations.megatron import cpu
    on_cpu = cpu.enable()
    ps.initialize_model_parallel(expert_model_parallel_size=ep)
    if not on_cpu:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(123)


def _config(dtype: torch.dtype, ep: int = 1, **overrides):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    kwargs = {"num_layers": 1, "hidden_size": H, "num_attention_heads": 4, "num_moe_experts": E * ep,
              "moe_ffn_hidden_size": FFN, "ffn_hidden_size": FFN, "moe_router_topk": 2,
              "expert_model_parallel_size": ep, "use_cpu_initialization": True, "add_bias_linear": False,
              "gated_linear_unit": True, "activation_func": F.silu, "params_dtype": dtype,
              "bf16": dtype == torch.bfloat16, "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
              "moe_router_dtype": "fp32", "moe_token_dispatcher_type": "moe_dispatcher"}
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _pair(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import get_submodules

    from moe_dispatcher.integrations.megatron.grouped_experts import GroupedGemmExperts
    pg = get_default_pg_collection()
    experts_spec = get_submodules(get_gpt_layer_local_submodules(num_experts=E, moe_grouped_gemm=False).mlp).experts
    torch.manual_seed(0)
    sequential = experts_spec(E, config, pg_collection=pg).to(device())
    grouped = GroupedGemmExperts(E, config, pg_collection=pg).to(device())
    grouped.load_sequential_mlp_state(sequential)
    return sequential, grouped


def _run(module, x, counts, probs, upstream):
    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y, bias = module(xi, counts, pi)
    assert bias is None, "no output bias expected"
    y.backward(upstream)
    return y.detach(), xi.grad, pi.grad


def _experts_vs_sequential(rank: int, world: int, dtype_name: str) -> dict:
    _setup(1)
    dtype = getattr(torch, dtype_name)
    dev = device()
    config = _config(dtype)
    sequential, grouped = _pair(config)
    out = {}
    for counts in ([5, 0, 11, 3], [0, 0, 0, 7], [8, 8, 8, 8]):
        with case(f"counts {counts}"):
            m = sum(counts)
            torch.manual_seed(m)
            x = torch.randn(m, H, dtype=dtype, device=dev)
            probs = torch.rand(m, dtype=torch.float32, device=dev)
            upstream = torch.randn(m, H, dtype=dtype, device=dev)
            for module in (sequential, grouped):
                module.zero_grad(set_to_none=True)
            # Counts on the device, as a dispatcher with fixed rows gives them; SequentialMLP reads them anyway.
            tpe = torch.tensor(counts, dtype=torch.int64, device=dev)
            want = _run(sequential, x, tpe, probs, upstream)
            got = _run(grouped, x, tpe, probs, upstream)
            w1 = torch.stack([e.linear_fc1.weight.grad for e in sequential.local_experts])
            w2 = torch.stack([e.linear_fc2.weight.grad for e in sequential.local_experts])
            out[str(counts)] = {"got": [t.float().cpu() for t in (*got, grouped.weight1.grad, grouped.weight2.grad)],
                                "want": [t.float().cpu() for t in (*want, w1, w2)]}
    # Rows past the counted ones (a dispatcher's fixed row count M) come out as zeros on the loop.
    with case("rows past the counts"):
        x = torch.randn(10, H, dtype=dtype, device=dev)
        y, _ = grouped(x, torch.tensor([2, 0, 3, 1], device=dev), torch.ones(10, device=dev))
        out["tail"] = y[6:].float().abs().max().item() if not x.is_cuda else 0.0
    # Our dispatcher's fixed row counts cover the tail in the last expert and carry the counts without it
    # (sizing.tokens_per_expert_covering): the experts leave the tail out of every expert.
    with case("counts covering a tail, with the counts without it"):
        from moe_dispatcher.integrations.megatron.sizing import tokens_per_expert_covering
        covering = tokens_per_expert_covering(torch.tensor([2, 0, 3, 1], device=dev), 10)
        assert covering.tolist() == [2, 0, 3, 5]
        y, _ = grouped(x, covering, torch.ones(10, device=dev))
        want, _ = grouped(x[:6], torch.tensor([2, 0, 3, 1], device=dev), torch.ones(6, device=dev))
        out["covered tail"] = y[6:].float().abs().max().item() if not x.is_cuda else 0.0
        out["covered rows"] = ((y[:6].float() - want.float()).abs().max() / (want.float().abs().max() + 1e-6)).item()
    out["allreduce"] = [grouped.weight1.allreduce, grouped.weight2.allreduce]
    return out


NAMES = ["output", "input grad", "probs grad", "fc1 weight grad", "fc2 weight grad"]


def test_grouped_experts_match_sequential_mlp_cpu():
    (res,) = run_distributed(_experts_vs_sequential, 1, "float32")
    assert res.pop("tail") == 0.0, "rows past the counts must be zero"
    assert res.pop("covered tail") == 0.0, "the tail a covering count adds must be left out (zeros on the loop)"
    assert res.pop("covered rows") == 0.0, "the rows of the experts must not change"
    assert res.pop("allreduce") == [True, True], "EP=1: expert weights are reduced over all data parallel"
    for counts, r in res.items():
        for name, got, want in zip(NAMES, r["got"], r["want"]):
            assert torch.equal(got, want), f"{counts}: {name} differs by {(got - want).abs().max().item()}"


@pytest.mark.gpu(1)
def test_grouped_experts_match_sequential_mlp_gpu():
    (res,) = run_distributed(_experts_vs_sequential, 1, "bfloat16", backend="nccl")
    res.pop("tail")
    res.pop("allreduce")
    res.pop("covered tail")  # the grouped kernel leaves the tail unspecified
    # The experts' rows with and without a covered tail (another M: the grouped kernel may tile differently).
    assert res.pop("covered rows") <= 2e-2, "the rows of the experts must not change with a covered tail"
    for counts, r in res.items():
        for name, got, want in zip(NAMES, r["got"], r["want"]):
            scale = want.abs().max().item() + 1e-6
            err = (got - want).abs().max().item()
            assert err <= 2e-2 * scale, f"{counts}: {name} differs by {err} (max |want| {scale})"


def _layer_vs_sequential(rank: int, world: int) -> dict:
    """A whole MoELayer at EP=2 with our dispatcher: SequentialMLP experts vs GroupedGemmExperts."""
    _setup(world)
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from moe_dispatcher.integrations.megatron.grouped_experts import GroupedGemmExperts, use_grouped_gemm_experts
    config = _config(torch.float32, ep=world, num_layers=1)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    layers = []
    for block in (spec, use_grouped_gemm_experts(spec)):
        torch.manual_seed(0)
        layers.append(block.layer_specs[0].submodules.mlp(config=config))
    sequential, grouped = layers
    assert isinstance(grouped.experts, GroupedGemmExperts), type(grouped.experts)
    grouped.router.load_state_dict(sequential.router.state_dict())
    grouped.experts.load_sequential_mlp_state(sequential.experts)
    torch.manual_seed(10 + dist.get_rank())
    x = torch.randn(16, 1, H)
    upstream = torch.randn(16, 1, H)
    results = []
    for layer in layers:
        layer.set_layer_number(1)
        xi = x.clone().requires_grad_()
        y, _ = layer(xi)
        y.backward(upstream)
        results.append((y.detach(), xi.grad, layer.router.weight.grad))
    return {"equal": [torch.equal(a, b) for a, b in zip(*results)],
            "allreduce": grouped.experts.weight1.allreduce}


def test_grouped_experts_in_moe_layer_with_our_dispatcher():
    for res in run_distributed(_layer_vs_sequential, 2):
        assert res["equal"] == [True, True, True], f"output / input grad / router grad equal: {res['equal']}"
        assert res["allreduce"] is False, "EP=2: expert weights are reduced over expert data parallel only"
