"""setup.py's compiled_for_sm90: the TORCH_CUDA_ARCH_LIST parse behind the extension's is_sm90_compiled()."""
import os
import runpy

import pytest

import moe_dispatcher

_SETUP = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "..", "setup.py"), run_name="setup_under_test")


@pytest.mark.parametrize("arch_list, expected", [
    ("9.0", True), ("9.0a", True), ("9.0+PTX", True), ("9.0a+PTX", True), ("8.0;9.0", True), ("8.0 9.0a", True),
    (" 9.0a ", True), ("Hopper", True), ("8.0", False), ("8.0;8.6+PTX", False), ("10.0", False),
    ("10.0a;12.0", False), ("19.0", False),
])
def test_compiled_for_sm90(arch_list, expected):
    assert _SETUP["compiled_for_sm90"](arch_list) is expected


def test_buffer_reads_the_extension(monkeypatch):
    class FakeExtension:
        @staticmethod
        def is_sm90_compiled():
            return True

    monkeypatch.setattr(moe_dispatcher._ext, "load", lambda: FakeExtension)
    assert moe_dispatcher.Buffer.is_sm90_compiled() is True
    monkeypatch.setattr(moe_dispatcher._ext, "load", lambda: None)
    assert moe_dispatcher.Buffer.is_sm90_compiled() is False
