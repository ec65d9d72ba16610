"""Make Megatron-Core build our dispatcher from a config, with no change to Megatron's code.

Megatron-Core has no dispatcher registry: MoELayer picks its dispatcher class with an if/elif on
``config.moe_token_dispatcher_type`` ("allgather", "alltoall", "flex"), and the flex dispatcher picks its
communication backend with another on ``config.moe_flex_dispatcher_backend``. We hook in at three points:

1. ``moe_layer.MoEFlexTokenDispatcher`` (the name MoELayer looks up when it builds a flex dispatcher) is
   rebound to a subclass whose ``__new__`` returns our dispatcher when the backend is one of ours and
   Megatron's flex dispatcher otherwise. Everything Megatron does for "flex" (the EP-overlap schedule,
   shared-expert overlap, config checks) therefore applies to ours.
2. ``TransformerConfig.__post_init__`` first normalises ``moe_token_dispatcher_type="moe_dispatcher"``
   (or ``"moe_dispatcher_ll"``) to ``"flex"`` + ``moe_flex_dispatcher_backend=<ours>`` -- the way Megatron
   treats its deprecated ``moe_enable_deepep`` flag -- and rejects names nobody knows, with the choices.
3. The ``Literal[...]`` annotations of both fields are widened, so Megatron-LM's argparse (which turns them
   into ``choices``) accepts ``--moe-token-dispatcher-type moe_dispatcher`` and rejects misspellings.

Plus one schedule detail: Megatron's EP-overlap schedule frees the inputs of some schedule nodes after their
forward. For our normal mode it must keep two that it frees for backends it does not know: the dispatch
node's inputs (our dispatch's autograd graph reaches back to them, as Megatron assumes for DeepEP) and the
"mlp" node's input, which is the dispatch's expert-major output handed to the experts as it is
(dispatch_postprocess copies nothing), so the experts saved it for their backward (Megatron keeps it for
HybridEP and NCCL EP for the same reason). Freeing either makes the schedule's backward read a freed tensor
(tests/megatron/test_megatron_ep_overlap.py runs Megatron's schedule on CPU).

That is all ``register()`` changes: the config class (a wrapped ``__post_init__``, two widened annotations),
one name in ``moe_layer`` and one function in ``models.common.utils``. Training steps are not wrapped at
import. ``guard_training_steps()`` (our Megatron-LM runner, ``python -m moe_dispatcher.integrations.megatron``,
calls it) wraps ``get_forward_backward_func`` so that each step's fixed-size expert rows (``bound`` sizing, a
capacity factor; sizing.py) are checked at the step's end, before the optimizer applies it (guard.py);
``guard_forward_backward(func)`` does it for one forward_backward function, ``run_step`` in a loop of one's
own (train.py). With the default exact sizing there is nothing to check.
"""
from __future__ import annotations

import difflib
import functools
import typing
from collections.abc import Callable

from .buffers import buffer_backend, choose_buffer_backend, choose_pool_bytes  # noqa: F401  (buffer_backend: API)
from .guard import run_step

NORMAL = "moe_dispatcher"
LOW_LATENCY = "moe_dispatcher_ll"
DISPATCHER_NAMES = (NORMAL, LOW_LATENCY)

_state = {"registered": False, "megatron_types": (), "megatron_backends": ()}


def _unknown(kind: str, name: object, choices: tuple) -> ValueError:
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"Unknown {kind} {name!r}; choose one of {', '.join(map(repr, choices))}.{hint} "
                      f"(The {', '.join(map(repr, DISPATCHER_NAMES))} choices come from moe_dispatcher.)")


def normalise_dispatcher_fields(config) -> None:
    """Rewrite our dispatcher type into Megatron's flex + our backend; reject unknown names.

    Runs at the start of TransformerConfig.__post_init__, before Megatron's own validation, so that
    validation sees "flex" (which allows shared-expert overlap, EP-communication overlap and fp8 padding).
    """
    kind = config.moe_token_dispatcher_type
    backend = config.moe_flex_dispatcher_backend
    all_types = tuple(_state["megatron_types"]) + DISPATCHER_NAMES
    all_backends = tuple(_state["megatron_backends"]) + DISPATCHER_NAMES
    if kind not in all_types:
        raise _unknown("moe_token_dispatcher_type", kind, all_types)
    if backend not in all_backends:
        raise _unknown("moe_flex_dispatcher_backend", backend, all_backends)
    if kind in DISPATCHER_NAMES:
        if getattr(config, "moe_enable_deepep", False):
            raise ValueError(f"moe_token_dispatcher_type={kind!r} conflicts with moe_enable_deepep=True, "
                             "which selects DeepEP; set only one of them")
        # "deepep" is the field's default, so it cannot be told apart from "not set": accept it.
        if backend != kind and backend != "deepep":
            raise ValueError(f"moe_token_dispatcher_type={kind!r} conflicts with moe_flex_dispatcher_backend="
                             f"{backend!r}; leave the backend unset or set it to {kind!r}")
        config.moe_token_dispatcher_type = "flex"
        config.moe_flex_dispatcher_backend = kind
    elif backend in DISPATCHER_NAMES and kind != "flex":
        raise ValueError(f"moe_flex_dispatcher_backend={backend!r} needs moe_token_dispatcher_type 'flex' (or "
                         f"{backend!r} itself), got {kind!r}")


def _widen_literal(cls, name: str, extra: tuple) -> tuple:
    """Add `extra` to the Literal choices of dataclass field `name`; returns Megatron's own choices."""
    field = cls.__dataclass_fields__[name]
    choices = typing.get_args(field.type)
    if not choices:
        raise RuntimeError(f"moe_dispatcher: {cls.__name__}.{name} is annotated {field.type!r}, not a Literal; "
                           "this megatron-core version is not supported by the registration")
    own = tuple(c for c in choices if c not in extra)
    widened = typing.Literal[own + tuple(extra)]
    field.type = widened  # what dataclasses.fields() (and so Megatron-LM's argparse) reads
    cls.__annotations__[name] = widened  # what typing.get_type_hints() reads
    return own


def register(backend: str | None = None, pool_bytes: int | None = None) -> None:
    """Teach Megatron-Core the dispatcher types "moe_dispatcher" and "moe_dispatcher_ll". Idempotent.

    Importing ``moe_dispatcher.integrations.megatron`` calls this. ``backend`` picks the Buffer backend
    ("auto", "kernels" or "reference"; default: $MOE_DISPATCHER_BACKEND, else "auto"); ``pool_bytes`` the peer
    pool of the normal-mode Buffers (bytes per GPU; default: $MOE_DISPATCHER_POOL_BYTES, else 0: none).
    """
    if backend is not None:
        choose_buffer_backend(backend)
    if pool_bytes is not None:
        choose_pool_bytes(pool_bytes)
    if _state["registered"]:
        return
    from megatron.core.models.common import utils as schedule_utils
    from megatron.core.transformer import transformer_config
    from megatron.core.transformer.moe import moe_layer

    from .dispatcher import MoEDispatcherLowLatencyTokenDispatcher, MoEDispatcherTokenDispatcher

    implementations = {NORMAL: MoEDispatcherTokenDispatcher, LOW_LATENCY: MoEDispatcherLowLatencyTokenDispatcher}
    config_cls = transformer_config.TransformerConfig
    _state["megatron_types"] = _widen_literal(config_cls, "moe_token_dispatcher_type", DISPATCHER_NAMES)
    _state["megatron_backends"] = _widen_literal(config_cls, "moe_flex_dispatcher_backend", DISPATCHER_NAMES)

    megatron_post_init = config_cls.__post_init__

    @functools.wraps(megatron_post_init)
    def __post_init__(self):
        normalise_dispatcher_fields(self)
        megatron_post_init(self)

    config_cls.__post_init__ = __post_init__

    megatron_flex = moe_layer.MoEFlexTokenDispatcher

    class MoEFlexTokenDispatcher(megatron_flex):
        """Megatron's flex dispatcher, which builds moe_dispatcher's for our backends."""

        def __new__(cls, *args, **kwargs):
            config = kwargs["config"] if "config" in kwargs else args[2]
            ours = implementations.get(config.moe_flex_dispatcher_backend)
            if ours is not None:
                return ours(*args, **kwargs)  # not an instance of cls, so Python skips cls.__init__
            return super().__new__(cls)

    MoEFlexTokenDispatcher.__qualname__ = megatron_flex.__qualname__
    MoEFlexTokenDispatcher.__module__ = megatron_flex.__module__
    moe_layer.MoEFlexTokenDispatcher = MoEFlexTokenDispatcher

    # The EP-overlap schedule's free-input policy (module docstring): keep the dispatch node's inputs, and in
    # normal mode the "mlp" node's input (the experts' saved input: our dispatch_postprocess copies nothing).
    megatron_should_free_input = schedule_utils.should_free_input

    @functools.wraps(megatron_should_free_input)
    def should_free_input(name, is_moe, config, num_local_experts):
        backend = config.moe_flex_dispatcher_backend if config.moe_token_dispatcher_type == "flex" else None
        if is_moe and (name == "moe_dispatch" and backend in DISPATCHER_NAMES or name == "mlp" and backend == NORMAL):
            return False
        return megatron_should_free_input(name, is_moe, config, num_local_experts)

    schedule_utils.should_free_input = should_free_input
    _state["registered"] = True


def guard_training_steps() -> None:
    """Opt-in: make ``megatron.core.pipeline_parallel.get_forward_backward_func`` return its schedule wrapped
    in guard_forward_backward, so Megatron-LM's training loop checks every step's fixed-size expert rows at
    the step's end (guard.py; needed only with ``bound`` sizing or a capacity factor). Must run before
    ``megatron.training`` is imported (it binds the function at import). Idempotent. Our Megatron-LM runner
    (``python -m moe_dispatcher.integrations.megatron``) calls it."""
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    megatron_get_fb = schedules.get_forward_backward_func
    if getattr(megatron_get_fb, "_moe_dispatcher_guarded", False):
        return

    @functools.wraps(megatron_get_fb)
    def get_forward_backward_func(*args, **kwargs):
        return guard_forward_backward(megatron_get_fb(*args, **kwargs))

    get_forward_backward_func._moe_dispatcher_guarded = True
    schedules.get_forward_backward_func = get_forward_backward_func
    pipeline_parallel.get_forward_backward_func = get_forward_backward_func


def guard_forward_backward(forward_backward_func: Callable) -> Callable:
    """Wrap one of Megatron-Core's forward_backward functions (what get_forward_backward_func returns) in
    run_step: the step runs as it is, then its fixed-row dispatches are checked (guard.check_expert_rows:
    their overflows and the calls the kernels refused; a collective only to report a refusal, nothing to do
    with exact sizing). guard_training_steps() wraps get_forward_backward_func
    with this, so Megatron-LM training loops are checked as they are."""
    if getattr(forward_backward_func, "_moe_dispatcher_guarded", False):
        return forward_backward_func

    @functools.wraps(forward_backward_func)
    def guarded(*args, **kwargs):
        return run_step(lambda: forward_backward_func(*args, **kwargs))

    guarded._moe_dispatcher_guarded = True
    return guarded


def is_registered() -> bool:
    return _state["registered"]
