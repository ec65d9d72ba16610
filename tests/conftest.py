"""Test configuration: markers, and tests/helpers on sys.path so the shared helpers import as `dist`, `oracle`,
`normal_cases`, `stub_extension`, `stub_low_latency`.

Layout: tests/reference (the reference backend, the API and its validation: CPU, some also over NCCL),
tests/kernels (the compiled backends: host glue on CPU through stubs, kernels on GPUs), tests/megatron (the
Megatron-Core integration), tests/tools (the tools, the example, the repository's import graph).

Markers:
  gpu   needs CUDA GPUs: `@pytest.mark.gpu` (as many GPUs as the test's `world_size` parameter, else 1) or
        `@pytest.mark.gpu(n)`. Skipped when torch has no CUDA or fewer GPUs are visible. Select with -m gpu.
  slow  long-running; deselect with -m "not slow".
"""
from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist

_HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)


@pytest.fixture
def world(tmp_path):
    """A one-rank gloo group for the CPU tests that make a Buffer (it needs torch.distributed); a test module
    may define its own `world` (a group plus the objects its tests share)."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu(n=world_size): needs n CUDA GPUs (NCCL runs of the distributed tests)")
    config.addinivalue_line("markers", "slow: long-running test")


def _gpus_needed(item: pytest.Item, marker: pytest.Mark) -> int:
    if marker.args:
        return int(marker.args[0])
    if "n" in marker.kwargs:
        return int(marker.kwargs["n"])
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "world_size" in callspec.params:
        return int(callspec.params["world_size"])
    return 1


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    import torch
    needed = _gpus_needed(item, marker)
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.device_count() < needed:
        pytest.skip(f"needs {needed} GPUs, found {torch.cuda.device_count()}")
