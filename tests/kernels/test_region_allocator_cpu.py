"""The peer pool's sub-allocator (csrc/runtime/peer_pool/region_allocator.{h,cpp}) as a plain C++ program on CPU.

tests/cpp/region_allocator_test.cpp checks alignment, exhaustion, fragmentation with best fit, merging of free
ranges in every release order, double and foreign releases, a random run against a list of live blocks and four
threads at once; this test builds it with the host compiler (with AddressSanitizer and UBSan when they link) and
runs it. The allocator is torch-free and CUDA-free, so nothing else is needed.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = [os.path.join(ROOT, "tests", "cpp", "region_allocator_test.cpp"),
           os.path.join(ROOT, "csrc", "runtime", "peer_pool", "region_allocator.cpp")]
SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]


def _build(tmp_path) -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = str(tmp_path / "region_allocator_test")
    base = [cxx, "-std=c++20", "-O1", "-g", "-pthread", f"-I{os.path.join(ROOT, 'csrc')}", *SOURCES, "-o", exe]
    for flags in (SANITIZERS, []):  # sanitizers when this toolchain has them
        done = subprocess.run(base[:1] + flags + base[1:], capture_output=True, text=True)
        if done.returncode == 0:
            return exe
    pytest.fail(f"region_allocator_test does not compile:\n{done.stderr}")


def test_region_allocator(tmp_path):
    exe = _build(tmp_path)
    done = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 failed checks" in done.stdout
