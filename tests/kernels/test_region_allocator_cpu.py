"""The peer pool's host code as plain C++ programs on CPU (no GPU, no torch).

tests/cpp/region_allocator_test.cpp checks the sub-allocator (csrc/runtime/peer_pool/region_allocator.{h,cpp}):
alignment, exhaustion, fragmentation with best fit, merging of free ranges in every release order, double and
foreign releases, a random run against a list of live blocks and four threads at once.
tests/cpp/peer_pool_registry_test.cpp checks the region registry and the C entry points torch calls
(csrc/runtime/peer_pool/peer_pool.cpp) over fake addresses: overlapping registrations refused, allocations routed by
the thread's active region and device, frees found by address from any thread, double and foreign frees counted
and ignored, closed regions refusing, retired regions forgotten at their last free and their address reusable. It
needs the CUDA runtime's headers and library to build (not a GPU: no path it runs calls CUDA).
Each program is built with the host compiler (with AddressSanitizer and UBSan when they link) and run.
"""
from __future__ import annotations

import os
import runpy
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]


def _cuda_flags() -> list:
    home = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="moe_dispatcher_setup")["find_cuda_home"]()
    if home is None:
        pytest.skip("the CUDA toolkit (headers, libcudart) is not installed")
    lib = os.path.join(home, "lib64")
    return [f"-I{os.path.join(home, 'include')}", f"-L{lib}", "-lcudart", f"-Wl,-rpath,{lib}"]


def _build_and_run(tmp_path, name: str, sources: list, extra: list) -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = str(tmp_path / name)
    paths = [os.path.join(ROOT, "tests", "cpp", f"{name}.cpp")] + [os.path.join(ROOT, s) for s in sources]
    base = ["-std=c++20", "-O1", "-g", "-pthread", f"-I{os.path.join(ROOT, 'csrc')}", *paths, "-o", exe, *extra]
    for flags in (SANITIZERS, []):  # sanitizers when this toolchain has them
        built = subprocess.run([cxx, *flags, *base], capture_output=True, text=True)
        if built.returncode == 0:
            break
    assert built.returncode == 0, f"{name} does not compile:\n{built.stderr}"
    done = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_region_allocator(tmp_path):
    out = _build_and_run(tmp_path, "region_allocator_test", ["csrc/runtime/peer_pool/region_allocator.cpp"], [])
    assert "0 failed checks" in out


def test_peer_pool_registry(tmp_path):
    out = _build_and_run(tmp_path, "peer_pool_registry_test",
                         ["csrc/runtime/peer_pool/peer_pool.cpp", "csrc/runtime/peer_pool/region_allocator.cpp"],
                         _cuda_flags())
    assert "0 failed checks" in out
