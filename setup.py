"""Build script: the moe_dispatcher package, plus the moe_dispatcher._C CUDA extension when possible.

moe_dispatcher._layout (the low-latency buffer layout, a tiny CUDA-free module) is built on every install that
has a C++ compiler, whatever happens to the CUDA extension.

How the CUDA extension build decides (docs/build.md has the long version):
  * MOE_DISPATCHER_BUILD_EXT=0        never build the extension (pure Python install);
  * MOE_DISPATCHER_BUILD_EXT=1        build it or fail with the reason;
  * unset / auto                      build it when torch is a CUDA build, nvcc exists and NVSHMEM
                                      (the nvidia-nvshmem-cu13 wheel, or NVSHMEM_HOME) is found;
                                      otherwise install pure Python and print one line saying why.
torch is not a build requirement: install torch first and build with
`pip install --no-build-isolation [-e] .` so the extension matches the installed torch.

The flag lists below are also read by tools/check_kernels_compile.sh (via `python setup.py` being
importable without side effects), so the CI compile check and the real build cannot drift apart.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
ENV_BUILD_EXT = "MOE_DISPATCHER_BUILD_EXT"

# nvcc flags for every .cu (torch's BuildExtension adds -gencode for TORCH_CUDA_ARCH_LIST, -fPIC
# and its -D__CUDA_NO_HALF*__ defines first; the -U flags below come after and undo those, which
# NVSHMEM's headers need). No --use_fast_math: FP8 scales need IEEE division to be bit-exact.
NVCC_FLAGS = [
    "-O3",
    "-lineinfo",
    "-std=c++20",  # torch >= 2.10 headers are C++20; NVSHMEM's headers compile as C++20 too
    "-rdc=true",  # NVSHMEM device calls are resolved at device-link time
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    # C++20 deprecations of `volatile` (parameters, compound assignment) inside NVSHMEM's headers.
    "-diag-suppress=3012,3013",
]
# Host compiler flags for every .cpp.
CXX_FLAGS = ["-O3", "-std=c++20"]
DEFAULT_ARCH_LIST = "9.0"
# torch's names for whole architecture families in TORCH_CUDA_ARCH_LIST, with the versions they stand for.
_NAMED_ARCHS = {"hopper": ("9.0",)}


def compiled_for_sm90(arch_list: str) -> bool:
    """True when a TORCH_CUDA_ARCH_LIST value makes torch emit sm_90 device code.

    The value's grammar is torch's: entries separated by ';' or spaces, each "major.minor" with an optional
    arch-specific "a" suffix and/or "+PTX" ("9.0", "9.0a", "8.0;9.0+PTX"), or a family name ("Hopper").
    bindings.cpp reports the answer as is_sm90_compiled() (DeepEP V1's Buffer.is_sm90_compiled: its tests
    run their FP8 cases only when it is true).
    """
    versions = []
    for entry in re.split(r"[;\s]+", arch_list.strip()):
        entry = entry.lower().removesuffix("+ptx")
        versions += _NAMED_ARCHS.get(entry, (entry.removesuffix("a"),))
    return "9.0" in versions


def _project_version() -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        match = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError("pyproject.toml has no [project] version")
    return match.group(1)


def find_nvshmem() -> str | None:
    """NVSHMEM root (with include/ and lib/): $NVSHMEM_HOME, else the nvidia-nvshmem-cu13 wheel."""
    home = os.environ.get("NVSHMEM_HOME")
    if home:
        return home
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except ModuleNotFoundError:  # no `nvidia` namespace package at all
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))  # namespace package: __file__ is None


def find_cuda_home() -> str | None:
    """CUDA toolkit root (bin/nvcc + include/): $CUDA_HOME/$CUDA_PATH, /usr/local/cuda, nvcc on PATH."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:  # may be a wrapper script outside the toolkit; then the include/ check rejects it
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in candidates:
        if (
            home
            and os.path.isfile(os.path.join(home, "bin", "nvcc"))
            and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h"))
        ):
            return home
    return None


def extension_sources() -> list[str]:
    """bindings.cpp + every csrc/*_bindings.cpp + every .cu/.cpp under csrc/runtime and csrc/kernels.

    Paths are relative to the project root (setuptools wants them so). Note for new files: two
    sources with the same stem in one folder (x.cpp and x.cu) would both compile to x.o.
    """
    sources = ["csrc/bindings.cpp"] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "*_bindings.cpp"))
    )
    for folder in ("csrc/runtime", "csrc/kernels"):
        for ext in ("cu", "cpp"):
            sources += sorted(
                os.path.relpath(p, ROOT)
                for p in glob.glob(os.path.join(ROOT, folder, "**", f"*.{ext}"), recursive=True)
            )
    return sources


def _why_extension_cannot_build() -> str | None:
    """None when the extension can be built here, else the reason (one line)."""
    try:
        import torch
    except ImportError:
        return (
            "torch is not importable in the build environment (install torch first, then "
            "`pip install --no-build-isolation .`)"
        )
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    if find_cuda_home() is None:
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    nvshmem = find_nvshmem()
    if nvshmem is None:
        return "NVSHMEM not found (pip install nvidia-nvshmem-cu13, or set NVSHMEM_HOME)"
    for rel in ("include/nvshmem.h", "lib/libnvshmem_host.so.3", "lib/libnvshmem_device.a"):
        if not os.path.exists(os.path.join(nvshmem, rel)):
            return f"NVSHMEM at {nvshmem} lacks {rel}"
    return None


def _should_build_extension() -> bool:
    # Parsed here, not by moe_dispatcher.env (setup.py must not import the package), by the same rules:
    # unset or empty is the default, whitespace and case are ignored, the error names what is accepted.
    raw = os.environ.get(ENV_BUILD_EXT, "")
    mode = raw.strip().lower() or "auto"
    if mode not in ("0", "1", "auto"):
        raise SystemExit(f"moe_dispatcher: {ENV_BUILD_EXT}={raw!r} is not valid: expected one of 0, 1, auto "
                         f"(or leave {ENV_BUILD_EXT} unset)")
    if mode == "0":
        print(
            f"moe_dispatcher: installing pure Python without moe_dispatcher._C ({ENV_BUILD_EXT}=0)",
            file=sys.stderr,
        )
        return False
    problem = _why_extension_cannot_build()
    if problem is None:
        return True
    if mode == "1":
        raise SystemExit(
            f"moe_dispatcher: {ENV_BUILD_EXT}=1 but moe_dispatcher._C cannot be built: {problem}"
        )
    print(
        f"moe_dispatcher: installing pure Python without moe_dispatcher._C: {problem} "
        f"(set {ENV_BUILD_EXT}=1 to make this an error)",
        file=sys.stderr,
    )
    return False


def _cuda_extension():
    """The moe_dispatcher._C extension and the BuildExtension command class."""
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    # torch reads TORCH_CUDA_ARCH_LIST itself (the GPU machines set 9.0a); without it torch would
    # guess from the visible GPUs, so pin our default instead.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    nvshmem = find_nvshmem()
    nvshmem_lib = os.path.join(nvshmem, "lib")
    cuda_home = find_cuda_home()
    version = _project_version()

    ext = CUDAExtension(
        name="moe_dispatcher._C",
        sources=extension_sources(),
        include_dirs=[os.path.join(ROOT, "csrc"), os.path.join(nvshmem, "include")],
        # Stringified in bindings.cpp (a quoted -D value would not survive ninja's shell).
        define_macros=[("MOE_DISPATCHER_VERSION", version),
                       ("MOE_DISPATCHER_SM90", "1" if compiled_for_sm90(os.environ["TORCH_CUDA_ARCH_LIST"]) else "0")],
        extra_compile_args={
            # CUDA 13 moved cuda/std/* (used by nvshmem.h) under include/cccl; nvcc finds it alone.
            "cxx": CXX_FLAGS + [f"-I{os.path.join(cuda_home, 'include', 'cccl')}"],
            "nvcc": NVCC_FLAGS,
            # One device link over all objects with NVSHMEM's device library. Not dlink=True: that
            # adds -dlto and the wheel ships no LTO-IR.
            "nvcc_dlink": ["-dlink", f"-L{nvshmem_lib}", "-lnvshmem_device"],
        },
        extra_link_args=[
            f"-L{nvshmem_lib}",
            # The wheel has only the versioned host library; the device library's host part
            # (nvshmemi_init_thread etc.) is linked statically and kept private, so our init
            # registers OUR device state rather than torch's libtorch_nvshmem's.
            "-l:libnvshmem_host.so.3",
            "-l:libnvshmem_device.a",
            f"-Wl,-rpath,{nvshmem_lib}",
            "-Wl,--exclude-libs,libnvshmem_device.a",
        ],
    )
    # MAX_JOBS is honoured by torch's ninja build.
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


def _layout_extension():
    """moe_dispatcher._layout: the low-latency buffer layout (csrc/kernels/low_latency/layout.h) as a tiny
    CUDA-free, torch-free CPython module, built on every install that has a C++ compiler (optional: a failed
    build leaves it out and Buffer.get_low_latency_rdma_size_hint says so)."""
    from setuptools import Extension

    return Extension(
        "moe_dispatcher._layout",
        sources=["csrc/layout/ll_layout_module.cpp"],
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args=list(CXX_FLAGS),  # a copy: torch's BuildExtension appends to it
        language="c++",
        optional=True,
    )


def _packages() -> tuple[list[str], dict[str, str]]:
    """moe_dispatcher and its subpackages, plus integrations/ installed as moe_dispatcher.integrations.

    integrations/ may not exist yet (another part of the tree); then it is simply left out.
    """
    packages = find_packages(where=ROOT, include=["moe_dispatcher", "moe_dispatcher.*"])
    package_dir: dict[str, str] = {}
    if os.path.isfile(os.path.join(ROOT, "integrations", "__init__.py")):
        package_dir["moe_dispatcher.integrations"] = "integrations"
        packages.append("moe_dispatcher.integrations")
        packages += [
            f"moe_dispatcher.integrations.{sub}"
            for sub in find_packages(where=os.path.join(ROOT, "integrations"))
        ]
    return packages, package_dir


if __name__ == "__main__":
    packages, package_dir = _packages()
    ext_modules, cmdclass = _cuda_extension() if _should_build_extension() else ([], {})
    ext_modules = [_layout_extension(), *ext_modules]
    setup(
        packages=packages,
        package_dir=package_dir,
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        zip_safe=False,
    )
