"""GroupedGemmExperts (integrations/megatron/grouped_experts.py) against Megatron's SequentialMLP.

Same weights (copied expert by expert), same expert-major rows, counts and probs, same upstream gradient:
outputs, input and probs gradients, and weight gradients must match. On CPU (float32, the per-expert loop)
they are bit-identical, alone and inside a MoELayer with our dispatcher at EP=2. On a GPU (bfloat16,
torch's grouped matmul) they agree within bfloat16 rounding of the different GEMM kernels.
"""
from __future__ import annotations

import contextlib
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
        out["covered rows"] = (y[:6].float() - want.float()).abs().max().item()
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
    for counts, r in res.items():
        for name, got, want in zip(NAMES, r["got"], r["want"]):
            scale = want.abs().max().item() + 1e-6
            err = (got - want).abs().max().item()
            assert err <= 2e-2 * scale, f"{counts}: {name} differs by {err} (max |want| {scale})"


class _Spy:
    """Records, per call, whether our combine got weights and whether GroupedGemmExperts multiplied by the
    probs, and the probs Megatron's experts were handed (patched in for one rank's whole run)."""

    def __init__(self) -> None:
        from moe_dispatcher.integrations.megatron import dispatcher, grouped_experts
        self.combine_weighted: list[bool] = []
        self.experts_multiplied: list[bool] = []
        self.megatron_probs: list[torch.Tensor] = []
        combine = dispatcher.md_autograd.expert_major_combine
        activation = grouped_experts.GroupedGemmExperts._activation

        def spy_combine(buffer, x, handle, weights=None, **kw):
            self.combine_weighted.append(weights is not None)
            return combine(buffer, x, handle, weights, **kw)

        def spy_activation(module, h, probs):
            self.experts_multiplied.append(probs is not None)
            return activation(module, h, probs)
        dispatcher.md_autograd = _Namespace(dispatcher.md_autograd, expert_major_combine=spy_combine)
        grouped_experts.GroupedGemmExperts._activation = spy_activation

    def reset(self) -> None:
        self.combine_weighted, self.experts_multiplied, self.megatron_probs = [], [], []


class _Namespace:
    """A module's attributes with some replaced."""

    def __init__(self, inner, **replaced) -> None:
        self._inner, self._replaced = inner, replaced

    def __getattr__(self, name):
        return self._replaced[name] if name in self._replaced else getattr(self._inner, name)


def _errors(got: torch.Tensor, want: torch.Tensor) -> list[float]:
    """[max |got - want|, max |want|]"""
    return [(got.float() - want.float()).abs().max().item(), want.float().abs().max().item()]


def _layer_results(layer, x, upstream) -> list[torch.Tensor]:
    """One forward + backward: output, input grad, router weight grad, fc1 / fc2 weight grads ([E, ...])."""
    from moe_dispatcher.integrations.megatron.grouped_experts import GroupedGemmExperts
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    y, _ = layer(xi)
    y.backward(upstream)
    if isinstance(layer.experts, GroupedGemmExperts):
        w1, w2 = layer.experts.weight1.grad, layer.experts.weight2.grad
    else:
        w1 = torch.stack([e.linear_fc1.weight.grad for e in layer.experts.local_experts])
        w2 = torch.stack([e.linear_fc2.weight.grad for e in layer.experts.local_experts])
    return [t.detach().float().cpu() for t in (y, xi.grad, layer.router.weight.grad, w1, w2)]


def _layer_vs_sequential(rank: int, world: int, dtype_name: str = "float32", num_tokens: int = 16) -> dict:
    """A whole MoELayer at EP=world with our dispatcher: SequentialMLP experts (the probs multiplied in the
    experts, a plain-sum combine) vs GroupedGemmExperts (the probs applied by the combine), same weights and
    inputs; and GroupedGemmExperts made to decline the offer, and under the EP-overlap setting (no offer):
    both must be exactly SequentialMLP's path."""
    _setup(world)
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from moe_dispatcher.integrations.megatron import grouped_experts
    from moe_dispatcher.integrations.megatron.grouped_experts import GroupedGemmExperts, use_grouped_gemm_experts
    dtype = getattr(torch, dtype_name)
    dev = device()
    config = _config(dtype, ep=world, num_layers=1)
    spy = _Spy()
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    layers = []
    for block in (spec, use_grouped_gemm_experts(spec)):
        torch.manual_seed(0)
        layers.append(block.layer_specs[0].submodules.mlp(config=config).to(dev, dtype))
    sequential, grouped = layers
    assert isinstance(grouped.experts, GroupedGemmExperts), type(grouped.experts)
    grouped.router.load_state_dict(sequential.router.state_dict())
    grouped.experts.load_sequential_mlp_state(sequential.experts)
    megatron_forward = sequential.experts.forward

    def megatron_experts(hidden, tokens_per_expert, permuted_probs, **kw):
        spy.megatron_probs.append(permuted_probs.detach().float().cpu())
        return megatron_forward(hidden, tokens_per_expert, permuted_probs, **kw)
    sequential.experts.forward = megatron_experts
    for layer in layers:
        layer.set_layer_number(1)
    torch.manual_seed(10 + dist.get_rank())
    x = torch.randn(num_tokens, 1, H, dtype=dtype).to(dev)
    upstream = torch.randn(num_tokens, 1, H, dtype=dtype).to(dev)
    out = {}
    want = _layer_results(sequential, x, upstream)
    out["sequential_calls"] = (spy.combine_weighted, spy.experts_multiplied)
    probs = spy.megatron_probs
    out["megatron_probs"] = [len(probs), bool(probs and probs[0].numel() and (probs[0] != 1).any())]
    spy.reset()
    got = _layer_results(grouped, x, upstream)
    out["grouped"] = [_errors(g, w) for g, w in zip(got, want)]
    out["grouped_calls"] = (spy.combine_weighted, spy.experts_multiplied)
    spy.reset()
    with _declining(grouped_experts):
        declined = _layer_results(grouped, x, upstream)
    out["declined"] = [_errors(g, w) for g, w in zip(declined, want)]
    out["grouped_vs_declined"] = [_errors(g, d) for g, d in zip(got, declined)]
    out["declined_calls"] = (spy.combine_weighted, spy.experts_multiplied)
    spy.reset()
    # The EP-overlap schedule (overlap_moe_expert_parallel_comm; set after validation, which wants CUDA and
    # more): the dispatcher makes no offer, the experts multiply.
    config.overlap_moe_expert_parallel_comm = True
    torch.manual_seed(0)
    overlap = use_grouped_gemm_experts(spec).layer_specs[0].submodules.mlp(config=config).to(dev, dtype)
    overlap.load_state_dict(grouped.state_dict())
    overlap.set_layer_number(1)
    overlap_results = _layer_results(overlap, x, upstream)
    out["overlap"] = [_errors(g, w) for g, w in zip(overlap_results, want)]
    out["overlap_vs_declined"] = [_errors(g, d) for g, d in zip(overlap_results, declined)]
    out["overlap_calls"] = (spy.combine_weighted, spy.experts_multiplied)
    out["allreduce"] = grouped.experts.weight1.allreduce
    return out


class _declining:
    """GroupedGemmExperts that decline the dispatcher's offer, within the block: the probs multiply stays in
    the experts (the path before the offer existed; a test-only switch, for parity and timing)."""

    def __init__(self, grouped_experts) -> None:
        self.module, self.leave = grouped_experts, grouped_experts.leave_probs_to_combine

    def __enter__(self) -> None:
        self.module.leave_probs_to_combine = lambda permuted_probs: False

    def __exit__(self, *exc) -> None:
        self.module.leave_probs_to_combine = self.leave


LAYER_NAMES = ["output", "input grad", "router weight grad", "fc1 weight grad", "fc2 weight grad"]


def _check_layer(res: dict, rtol: float, what: str) -> None:
    assert res["sequential_calls"] == ([False], []), f"{what}: Megatron's experts: plain-sum combine expected"
    assert res["megatron_probs"] == [1, True], f"{what}: Megatron's experts must get the real permuted probs"
    assert res["grouped_calls"] == ([True], [False]), \
        f"{what}: GroupedGemmExperts must leave the probs to a weighted combine: {res['grouped_calls']}"
    for name, (diff, scale) in zip(LAYER_NAMES, res["grouped"]):
        assert diff <= rtol * scale, f"{what}: {name} differs by {diff:.3g} (max |ref| {scale:.3g}, rtol {rtol})"
    for case_name in ("declined", "overlap"):
        assert res[f"{case_name}_calls"] == ([False], [True]), f"{what} {case_name}: {res[f'{case_name}_calls']}"
        assert all(diff == 0 for diff, _ in res[case_name]), f"{what} {case_name}: {res[case_name]}"


def test_grouped_experts_in_moe_layer_leave_probs_to_our_combine():
    """EP=2, float32 on CPU: GroupedGemmExperts behind our dispatcher skip the probs multiply and the combine
    applies the probs (forward and backward), SequentialMLP behind it gets the real probs and a plain-sum
    combine. Same function up to rounding: output, input grad, router grad and expert weight grads within
    1e-5 of their largest value (measured: at most 3.7e-7, float32 rounding of a different order of products).
    Experts that decline the offer, and the EP-overlap setting, give SequentialMLP's results bit for bit."""
    for rank, res in enumerate(run_distributed(_layer_vs_sequential, 2)):
        _check_layer(res, 1e-5, f"rank {rank}")
        assert res["allreduce"] is False, "EP=2: expert weights are reduced over expert data parallel only"


@pytest.mark.gpu(2)
def test_grouped_experts_leave_probs_to_our_combine_gpu():
    """The same on GPUs (NCCL, compiled kernels, bf16, torch's grouped matmul, 256 tokens per rank): the
    weighted combine against the same experts declining the offer within bf16 rounding (3e-2 of the largest
    value, the bound of the other bf16 layer parities), and the declining / EP-overlap paths against each
    other bit for bit."""
    n = min(torch.cuda.device_count(), 4)
    results = run_distributed(_layer_vs_sequential, n, "bfloat16", 256, backend="nccl",
                              env={"MOE_DISPATCHER_BACKEND": "kernels"}, timeout=300)
    for rank, res in enumerate(results):
        assert res["grouped_calls"] == ([True], [False]), res["grouped_calls"]
        assert res["declined_calls"] == res["overlap_calls"] == ([False], [True]), res
        assert res["sequential_calls"] == ([False], []) and res["megatron_probs"] == [1, True], res
        for name, (diff, scale) in zip(LAYER_NAMES, res["grouped_vs_declined"]):
            assert diff <= 3e-2 * scale, f"rank {rank}: {name} differs by {diff:.3g} (max |ref| {scale:.3g})"
        for name, (diff, scale) in zip(LAYER_NAMES, res["declined"]):  # grouped matmul vs per-expert F.linear
            assert diff <= 3e-2 * scale, f"rank {rank}: {name} vs SequentialMLP differs by {diff:.3g} ({scale:.3g})"
        assert all(diff == 0 for diff, _ in res["overlap_vs_declined"]), res["overlap_vs_declined"]


# MoE layer shapes for the timing: (name, hidden, expert FFN, experts per rank, top-k, tokens per rank).
TIMED_SHAPES = [("qwen3-30b-a3b-like", 2048, 768, 32, 8, 4096), ("deepseek-v3-like", 7168, 2048, 64, 8, 4096)]


def _layer_timing(rank: int, world: int, iters: int = 20) -> dict:
    """One MoELayer (GroupedGemmExperts, our dispatcher, bf16) per shape; forward + backward timed with CUDA
    events, the experts accepting the offer (probs in the combine) and declining it (probs multiplied in the
    experts) in alternating iterations, so both see the same GPU state. Returns median ms per variant."""
    _setup(world)
    out = {}
    for name, hidden, ffn, local, topk, tokens in TIMED_SHAPES:
        out[name] = _time_shape(rank, world, iters, hidden, ffn, local, topk, tokens)
        torch.cuda.empty_cache()
    return out


def _time_shape(rank: int, world: int, iters: int, hidden: int, ffn: int, local: int, topk: int,
                tokens: int) -> dict[str, float]:
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from moe_dispatcher.integrations.megatron import grouped_experts
    from moe_dispatcher.integrations.megatron.grouped_experts import use_grouped_gemm_experts
    dev = device()
    config = _config(torch.bfloat16, ep=world, hidden_size=hidden, moe_ffn_hidden_size=ffn, ffn_hidden_size=ffn,
                     num_moe_experts=local * world, moe_router_topk=topk, num_attention_heads=16,
                     use_cpu_initialization=False)
    spec = use_grouped_gemm_experts(get_gpt_decoder_block_spec(config, use_transformer_engine=False))
    layer = spec.layer_specs[0].submodules.mlp(config=config).to(dev, torch.bfloat16)
    layer.set_layer_number(1)
    torch.manual_seed(rank)
    x = torch.randn(tokens, 1, hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
    upstream = torch.randn(tokens, 1, hidden, dtype=torch.bfloat16, device=dev)
    times: dict[str, list[float]] = {"probs in combine": [], "probs in experts": []}
    for i in range(3 + iters):
        for variant, samples in times.items():
            declining = variant == "probs in experts"
            with _declining(grouped_experts) if declining else contextlib.nullcontext():
                layer.zero_grad(set_to_none=True)
                x.grad = None
                dist.barrier()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                y, _ = layer(x)
                y.backward(upstream)
                end.record()
                torch.cuda.synchronize()
            if i >= 3:
                samples.append(start.elapsed_time(end))
    return {variant: sorted(t)[len(t) // 2] for variant, t in times.items()}


@pytest.mark.gpu(2)
def test_probs_in_combine_layer_time_gpu():
    """Timing, not a pass/fail bound: prints the median forward + backward time of one MoELayer
    (GroupedGemmExperts, our dispatcher, bf16, 2-4 GPUs) with the probs applied in the combine and, in
    alternating iterations of the same process, multiplied in the experts. Run with -s to read it."""
    n = min(torch.cuda.device_count(), 4)
    results = run_distributed(_layer_timing, n, backend="nccl", env={"MOE_DISPATCHER_BACKEND": "kernels"},
                              timeout=500)
    for name, *_ in TIMED_SHAPES:
        per_rank = [res[name] for res in results]
        slowest = {v: max(r[v] for r in per_rank) for v in per_rank[0]}
        fused, unfused = slowest["probs in combine"], slowest["probs in experts"]
        saved = unfused - fused
        print(f"\n{name} EP={n}: MoE layer fwd+bwd (median, slowest rank) probs in combine {fused:.3f} ms | "
              f"probs in experts {unfused:.3f} ms | saved {saved:.3f} ms ({100 * saved / unfused:.1f}%)")
        assert fused > 0 and unfused > 0
