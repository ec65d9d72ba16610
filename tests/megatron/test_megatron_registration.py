"""Selecting our dispatcher through Megatron's config and Megatron-LM's command line (one process, no ranks)."""
from __future__ import annotations

import sys
import typing
import warnings

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (bash tools/install_megatron.sh)")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Megatron's notes on unset options

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import moe_dispatcher.integrations.megatron as integration
    from megatron.core.transformer.moe import moe_layer
    from megatron.core.transformer.transformer_config import TransformerConfig


def _config(**kwargs):
    base = {"num_layers": 1, "hidden_size": 128, "num_attention_heads": 4, "num_moe_experts": 8, "moe_router_topk": 2}
    return TransformerConfig(**{**base, **kwargs})


@pytest.mark.parametrize("name", ["moe_dispatcher", "moe_dispatcher_ll"])
def test_config_selects_our_dispatcher(name):
    cfg = _config(moe_token_dispatcher_type=name)
    assert (cfg.moe_token_dispatcher_type, cfg.moe_flex_dispatcher_backend) == ("flex", name)
    # the long form (flex + backend) is accepted too
    cfg = _config(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=name)
    assert (cfg.moe_token_dispatcher_type, cfg.moe_flex_dispatcher_backend) == ("flex", name)


def test_flex_validation_applies_to_ours():
    # Megatron allows shared-expert overlap only for alltoall / flex: ours counts as flex.
    cfg = _config(moe_token_dispatcher_type="moe_dispatcher", moe_shared_expert_intermediate_size=64,
                  moe_shared_expert_overlap=True)
    assert cfg.moe_shared_expert_overlap


def test_megatron_choices_unchanged():
    for name in ("allgather", "alltoall"):
        cfg = _config(moe_token_dispatcher_type=name)
        assert (cfg.moe_token_dispatcher_type, cfg.moe_flex_dispatcher_backend) == (name, "deepep")


@pytest.mark.parametrize("kwargs,message", [
    ({"moe_token_dispatcher_type": "moe_dispatchr"}, "Did you mean 'moe_dispatcher'"),
    ({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "moe_dispatcher_lowlat"},
     "Did you mean 'moe_dispatcher_ll'"),
    ({"moe_token_dispatcher_type": "moe_dispatcher", "moe_flex_dispatcher_backend": "hybridep"}, "conflicts"),
    ({"moe_token_dispatcher_type": "moe_dispatcher", "moe_flex_dispatcher_backend": "moe_dispatcher_ll"},
     "conflicts"),
    ({"moe_token_dispatcher_type": "moe_dispatcher", "moe_enable_deepep": True}, "moe_enable_deepep"),
    ({"moe_token_dispatcher_type": "alltoall", "moe_flex_dispatcher_backend": "moe_dispatcher"}, "needs"),
])
def test_unknown_or_conflicting_names_are_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _config(**kwargs)


def test_unknown_buffer_backend_is_an_error(monkeypatch):
    with pytest.raises(ValueError, match="unknown Buffer backend 'cuda'"):
        integration.register(backend="cuda")
    monkeypatch.setenv("MOE_DISPATCHER_BACKEND", "kernel")
    with pytest.raises(ValueError, match="MOE_DISPATCHER_BACKEND"):
        integration.registration.buffer_backend()


def test_register_is_idempotent_and_rebinds_flex():
    flex = moe_layer.MoEFlexTokenDispatcher
    integration.register()
    assert moe_layer.MoEFlexTokenDispatcher is flex
    assert integration.is_registered()
    assert flex.__mro__[1].__module__ == "megatron.core.transformer.moe.token_dispatcher"


def test_ep_overlap_schedule_keeps_dispatch_inputs():
    """The dispatch node's inputs are kept for both our modes; the "mlp" node's input (the experts' saved input:
    our expert-major dispatch_postprocess copies nothing) in normal mode; Megatron's answers elsewhere."""
    from megatron.core.models.common import utils
    ours = _config(moe_token_dispatcher_type="moe_dispatcher")
    ours_ll = _config(moe_token_dispatcher_type="moe_dispatcher_ll")
    deepep = _config(moe_token_dispatcher_type="flex")
    alltoall = _config(moe_token_dispatcher_type="alltoall")
    assert utils.should_free_input("moe_dispatch", True, ours, 4) is False
    assert utils.should_free_input("moe_dispatch", True, ours_ll, 4) is False
    assert utils.should_free_input("moe_dispatch", True, deepep, 4) is False
    assert utils.should_free_input("moe_dispatch", True, alltoall, 4) is True
    assert utils.should_free_input("mlp", True, ours, 4) is False
    assert utils.should_free_input("mlp", True, deepep, 4) is True  # DeepEP's dispatch_postprocess copies
    assert utils.should_free_input("mlp", True, ours_ll, 4) is True  # so does our low-latency packing
    assert utils.should_free_input("moe_combine", True, ours, 4) is True
    assert utils.should_free_input("mlp", False, ours, None) is False


def test_training_steps_are_guarded_only_on_request():
    """register() leaves Megatron's schedules alone; guard_training_steps() (our Megatron-LM runner calls it)
    wraps get_forward_backward_func once, in both modules that export it."""
    import subprocess
    import sys
    code = """
import warnings; warnings.filterwarnings("ignore")
from megatron.core import pipeline_parallel
from megatron.core.pipeline_parallel import schedules
megatron_fb = schedules.get_forward_backward_func
import moe_dispatcher.integrations.megatron as integration
assert schedules.get_forward_backward_func is megatron_fb and pipeline_parallel.get_forward_backward_func is megatron_fb
integration.guard_training_steps(); wrapped = schedules.get_forward_backward_func
integration.guard_training_steps()
assert wrapped is not megatron_fb and wrapped.__wrapped__ is megatron_fb
assert schedules.get_forward_backward_func is wrapped and pipeline_parallel.get_forward_backward_func is wrapped
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def _argparse_field_choices(name: str) -> tuple:
    return typing.get_args(TransformerConfig.__dataclass_fields__[name].type)


def test_literal_annotations_widened():
    assert {"allgather", "alltoall", "flex", "moe_dispatcher", "moe_dispatcher_ll"} <= set(
        _argparse_field_choices("moe_token_dispatcher_type"))
    assert {"deepep", "moe_dispatcher"} <= set(_argparse_field_choices("moe_flex_dispatcher_backend"))
    assert "moe_dispatcher" in typing.get_args(typing.get_type_hints(TransformerConfig)["moe_token_dispatcher_type"])


def test_megatron_lm_command_line(monkeypatch):
    """Megatron-LM's parse_args builds --moe-token-dispatcher-type's choices from the Literal annotation."""
    if not hasattr(typing, "override"):  # megatron.training uses typing.override (Python 3.12)
        monkeypatch.setattr(typing, "override", lambda f: f, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from megatron.training.arguments import parse_args
        except ImportError as exc:
            pytest.skip(f"megatron.training is not importable here: {exc}")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--moe-token-dispatcher-type", "moe_dispatcher"])
    args = parse_args(ignore_unknown_args=True)
    assert args.moe_token_dispatcher_type == "moe_dispatcher"
    cfg = _config(moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                  moe_flex_dispatcher_backend=args.moe_flex_dispatcher_backend)
    assert (cfg.moe_token_dispatcher_type, cfg.moe_flex_dispatcher_backend) == ("flex", "moe_dispatcher")

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--moe-token-dispatcher-type", "moe_dispatchr"])
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parse_args(ignore_unknown_args=True)
