"""Environment variables (issue 16 item 5): every variable of the package is read by moe_dispatcher.env, whose
errors name the variable, the value given and what is accepted; unset or empty means the default.

Each variable is tested through its real reader (the Buffer, the topology, the size hints, the compiled
backends' settings, setup.py), so a reader that bypasses the helpers fails here.
"""
from __future__ import annotations

import os
import re
import runpy
import types

import pytest

from moe_dispatcher import Buffer, Topology, compiled, env
from moe_dispatcher.compiled import low_latency as ll_backend
from moe_dispatcher.config import Config, default_nvl_size

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
NAN_INF_GARBAGE = ("nan", "NaN", "inf", "-inf", "1e999", "abc", "1.5.2")


def _names(name: str, value: str) -> str:
    """The regex an error about `name`=`value` must match: the variable and the value as given."""
    return re.escape(f"{name}={value!r}")


# ------------------------------------------------------------------ the helpers
def test_helpers_default_when_unset_or_empty(monkeypatch):
    monkeypatch.delenv("MD_TEST", raising=False)
    assert env.env_choice("MD_TEST", ("a", "b"), "a") == "a"
    assert env.env_flag("MD_TEST") is False and env.env_flag("MD_TEST", True) is True
    assert env.env_int("MD_TEST", None, minimum=1) is None
    assert env.env_float("MD_TEST", 2.5, minimum=1.0) == 2.5
    for blank in ("", "  "):
        monkeypatch.setenv("MD_TEST", blank)
        assert env.env_choice("MD_TEST", ("a", "b"), "b") == "b"
        assert env.env_int("MD_TEST", 7) == 7
        assert env.env_float("MD_TEST", 1.5) == 1.5
        assert env.env_flag("MD_TEST", True) is True


def test_helpers_parse_valid_values(monkeypatch):
    for raw, want in ((" B ", "b"), ("a", "a")):
        monkeypatch.setenv("MD_TEST", raw)
        assert env.env_choice("MD_TEST", ("a", "b"), "a") == want
    for raw, want in (("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("False", False),
                      ("no", False), ("off", False)):
        monkeypatch.setenv("MD_TEST", raw)
        assert env.env_flag("MD_TEST") is want, raw
    for raw, want in (("8", 8), (" +3 ", 3), ("-2", -2), ("0", 0)):
        monkeypatch.setenv("MD_TEST", raw)
        assert env.env_int("MD_TEST", None) == want
    for raw, want in (("2", 2.0), ("0.5", 0.5), ("1e-3", 1e-3)):
        monkeypatch.setenv("MD_TEST", raw)
        assert env.env_float("MD_TEST", None) == want


@pytest.mark.parametrize("call, raw, accepted", [
    (lambda: env.env_choice("MD_TEST", ("auto", "exact"), "auto"), "bogus", "one of auto, exact"),
    (lambda: env.env_flag("MD_TEST"), "bogus", "1, true, yes or on"),
    (lambda: env.env_flag("MD_TEST"), "2", "0, false, no or off"),
    (lambda: env.env_int("MD_TEST", None, minimum=1), "2.5", "an integer >= 1"),
    (lambda: env.env_int("MD_TEST", None, minimum=1), "0", "an integer >= 1"),
    (lambda: env.env_int("MD_TEST", None, minimum=0, maximum=4), "5", "an integer >= 0 and <= 4"),
    (lambda: env.env_int("MD_TEST", None), "1_000", "an integer"),
    (lambda: env.env_float("MD_TEST", None, minimum=1.0), "nan", "a finite number >= 1.0"),
    (lambda: env.env_float("MD_TEST", None, minimum=1.0), "inf", "a finite number >= 1.0"),
    (lambda: env.env_float("MD_TEST", None, greater_than=0), "0", "a finite number > 0"),
    (lambda: env.env_float("MD_TEST", None), "abc", "a finite number"),
])
def test_helpers_errors_name_variable_value_and_accepted(monkeypatch, call, raw, accepted):
    monkeypatch.setenv("MD_TEST", raw)
    with pytest.raises(ValueError) as err:
        call()
    msg = str(err.value)
    assert f"MD_TEST={raw!r}" in msg and accepted in msg, msg


# ------------------------------------------------------------------ the package's variables, through their readers
def test_backend_variable(world, monkeypatch):
    monkeypatch.setenv("MOE_DISPATCHER_BACKEND", "bogus")
    with pytest.raises(ValueError, match=_names("MOE_DISPATCHER_BACKEND", "bogus") + ".*auto, reference, kernels"):
        Buffer()
    monkeypatch.setenv("MOE_DISPATCHER_BACKEND", "reference")
    assert Buffer().backend == "reference"
    monkeypatch.setenv("MOE_DISPATCHER_BACKEND", "")
    assert Buffer().backend == "auto"
    assert Buffer(backend="reference").backend == "reference"  # the argument wins over the variable


def test_ll_combine_variable(world, monkeypatch):
    monkeypatch.setenv("MOE_DISPATCHER_LL_COMBINE", "per-rank")
    with pytest.raises(ValueError, match=_names("MOE_DISPATCHER_LL_COMBINE", "per-rank") + ".*per_rank, per_expert"):
        Buffer(backend="reference")
    monkeypatch.setenv("MOE_DISPATCHER_LL_COMBINE", "per_expert")
    assert Buffer(backend="reference").low_latency_combine_reduction == "per_expert"
    monkeypatch.delenv("MOE_DISPATCHER_LL_COMBINE")
    assert Buffer(backend="reference").low_latency_combine_reduction == "per_rank"


@pytest.mark.parametrize("raw", ["two", "0", "-2", "2.0", "nan"])
def test_nvl_size_variable(world, monkeypatch, raw):
    monkeypatch.setenv("MOE_DISPATCHER_NVL_SIZE", raw)
    with pytest.raises(ValueError, match=_names("MOE_DISPATCHER_NVL_SIZE", raw) + ".*integer >= 1"):
        Topology.from_group()
    with pytest.raises(ValueError, match=_names("MOE_DISPATCHER_NVL_SIZE", raw)):
        default_nvl_size(4)
    with pytest.raises(ValueError, match=_names("MOE_DISPATCHER_NVL_SIZE", raw)):
        Config().get_rdma_buffer_size_hint(7168, 4)


def test_nvl_size_variable_valid(world, monkeypatch):
    """Valid sizes still work; one bad size per reader (before: default_nvl_size returned 0 for '0')."""
    monkeypatch.setenv("MOE_DISPATCHER_NVL_SIZE", " 1 ")
    assert Topology.from_group().source == "env" and default_nvl_size(4) == 1
    monkeypatch.setenv("MOE_DISPATCHER_NVL_SIZE", "")
    assert default_nvl_size(4) == 4
    monkeypatch.setenv("MOE_DISPATCHER_NVL_SIZE", "0")
    with pytest.raises(ValueError, match=_names("MOE_DISPATCHER_NVL_SIZE", "0")):
        default_nvl_size(4)


@pytest.mark.parametrize("raw", ["0", "-1", *NAN_INF_GARBAGE])
def test_timeout_variable(monkeypatch, raw):
    monkeypatch.setenv("MOE_DISPATCHER_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match=_names("MOE_DISPATCHER_TIMEOUT_S", raw) + ".*finite number > 0"):
        compiled.kernel_timeout_s()


def test_timeout_variable_valid(monkeypatch):
    monkeypatch.delenv("MOE_DISPATCHER_TIMEOUT_S", raising=False)
    assert compiled.kernel_timeout_s() == 10.0
    monkeypatch.setenv("MOE_DISPATCHER_TIMEOUT_S", "2.5")
    assert compiled.kernel_timeout_s() == 2.5
    monkeypatch.setenv("MOE_DISPATCHER_TIMEOUT_S", "")  # empty is unset (before: float('') raised)
    assert compiled.kernel_timeout_s() == 10.0


def _fake_low_latency_backend(monkeypatch):
    """The low-latency backend's constructor up to its first collective, on CPU: a fake extension, and a
    buffer whose group-dependent attributes are missing (reaching them means the settings were accepted)."""
    fake = types.SimpleNamespace(low_latency=types.SimpleNamespace(MAX_RANKS=8))
    monkeypatch.setattr(ll_backend._ext, "require", lambda what: fake)
    return types.SimpleNamespace(rank=0, group_size=1, num_rdma_bytes=0)


@pytest.mark.parametrize("raw", ["bogus", "2", "enabled"])
def test_ll_trace_variable(monkeypatch, raw):
    """MOE_DISPATCHER_LL_TRACE accepts the usual on/off words only (before: anything but '' and '0' was on)."""
    buffer = _fake_low_latency_backend(monkeypatch)
    monkeypatch.setenv("MOE_DISPATCHER_LL_TRACE", raw)
    with pytest.raises(ValueError, match=_names("MOE_DISPATCHER_LL_TRACE", raw)):
        ll_backend.LowLatencyBackend(buffer)


def test_low_latency_backend_reads_the_timeout(monkeypatch):
    buffer = _fake_low_latency_backend(monkeypatch)
    monkeypatch.setenv("MOE_DISPATCHER_TIMEOUT_S", "inf")
    with pytest.raises(ValueError, match=_names("MOE_DISPATCHER_TIMEOUT_S", "inf")):
        ll_backend.LowLatencyBackend(buffer)


def test_build_ext_variable(monkeypatch):
    """setup.py parses MOE_DISPATCHER_BUILD_EXT itself (it must not import the package), in the same style."""
    setup = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="setup_under_test")
    monkeypatch.setenv("MOE_DISPATCHER_BUILD_EXT", "yes please")
    with pytest.raises(SystemExit, match=_names("MOE_DISPATCHER_BUILD_EXT", "yes please") + ".*0, 1, auto"):
        setup["_should_build_extension"]()
    monkeypatch.setenv("MOE_DISPATCHER_BUILD_EXT", " 0 ")
    assert setup["_should_build_extension"]() is False
