"""Buffer._resolve: the one place that chooses between a compiled backend and the reference, from declared
Capabilities (moe_dispatcher/backend.py), on CPU.

A fake "compiled" backend declares what it serves; calls with facts outside that (a dtype it does not reduce,
more local experts than it holds, a mode it lacks, tensors on a device it does not take) go to the reference,
with one warning per process and reason for CUDA tensors under backend="auto", and an error under
backend="kernels". Device placement is simulated through the resolver's arguments (no GPU needed).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from moe_dispatcher import Buffer
from moe_dispatcher import buffer as buffer_module
from moe_dispatcher.backend import Backend, Capabilities

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


class FakeKernels(Backend):
    name = "fake"
    capabilities = Capabilities(normal=True, combine_dtypes=frozenset({torch.bfloat16}), max_local_experts=4,
                                devices=frozenset({"cuda"}))


@pytest.fixture
def buf(tmp_path, monkeypatch):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    monkeypatch.setattr(buffer_module, "_warned_fallbacks", set())
    try:
        b = Buffer(backend="reference", explicitly_destroy=True)
        b._kernels, b.backend = FakeKernels(), "auto"
        yield b
    finally:
        dist.destroy_process_group()


def test_served_calls_go_to_the_kernels(buf):
    assert buf._resolve("normal", CUDA) is buf._kernels
    assert buf._resolve("normal", CUDA, local_experts=4) is buf._kernels
    assert buf._resolve("normal", CUDA, combine_dtype=torch.bfloat16) is buf._kernels


@pytest.mark.parametrize("facts, reason", [
    (dict(local_experts=5), "at most 4 experts per rank"),
    (dict(combine_dtype=torch.float64), "do not reduce torch.float64"),
])
def test_uncovered_calls_fall_back_with_one_warning(buf, facts, reason):
    with pytest.warns(UserWarning, match=reason):
        assert buf._resolve("normal", CUDA, **facts) is buf._reference_normal
    buf._resolved.clear()  # a new decision for the same reason: no second warning in this process
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert buf._resolve("normal", CUDA, **facts) is buf._reference_normal


def test_missing_mode_and_cpu_tensors(buf):
    buf._kernels_ll = buf._kernels  # a compiled backend without low-latency mode
    with pytest.warns(UserWarning, match="low-latency"):
        assert buf._resolve("low_latency", CUDA) is buf._reference_ll
    with warnings.catch_warnings():  # CPU tensors are the reference's without a word
        warnings.simplefilter("error")
        assert buf._resolve("normal", CPU) is buf._reference_normal


def test_kernels_only_buffer_raises_instead_of_falling_back(buf):
    buf.backend = "kernels"
    with pytest.raises(RuntimeError, match="cannot serve this call: the compiled kernels serve at most 4"):
        buf._resolve("normal", CUDA, local_experts=8)
    assert buf._resolve("normal", CUDA, local_experts=2) is buf._kernels


def test_every_backend_declares_its_capabilities(buf):
    assert buf._reference_normal.capabilities.normal and not buf._reference_normal.capabilities.low_latency
    assert buf._reference_ll.capabilities.low_latency and not buf._reference_ll.capabilities.normal
    from moe_dispatcher.compiled.internode import InternodeBackend
    from moe_dispatcher.compiled.intranode import IntranodeBackend
    from moe_dispatcher.compiled.low_latency import LowLatencyBackend
    for cls in (IntranodeBackend, InternodeBackend, LowLatencyBackend):
        assert issubclass(cls, Backend)
