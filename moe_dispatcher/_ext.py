"""Optional access to the compiled extension ``moe_dispatcher._C``.

The package works without the extension (pure-Python reference backend), so importing it must
never fail. ``load()`` tries the import once and caches the outcome; ``why_unavailable()`` says what
went wrong; ``require(feature)`` turns a missing extension into an actionable error.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_BUILD_HINT = (
    "build it on a machine with a CUDA build of torch, nvcc and nvidia-nvshmem-cu13: "
    "`MOE_DISPATCHER_BUILD_EXT=1 pip install --no-build-isolation -e .` (docs/build.md)"
)

_module: ModuleType | None = None
_error: str | None = None
_tried = False


def load() -> ModuleType | None:
    """The ``moe_dispatcher._C`` module, or None when it cannot be imported. Never raises."""
    global _module, _error, _tried
    if not _tried:
        _tried = True
        try:
            # _C links against libtorch/libc10 without an rpath to them: torch's import loads them.
            import torch  # noqa: F401

            _module = importlib.import_module("moe_dispatcher._C")
        except ModuleNotFoundError as exc:
            if exc.name == "moe_dispatcher._C":
                _error = "moe_dispatcher._C is not built (this is a pure-Python install)"
            else:
                _error = f"importing moe_dispatcher._C failed: {type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 -- a broken .so (ImportError/OSError) or init error
            _error = f"importing moe_dispatcher._C failed: {type(exc).__name__}: {exc}"
    return _module


def available() -> bool:
    """True when the compiled extension can be used in this process."""
    return load() is not None


def why_unavailable() -> str | None:
    """Why the extension is unavailable (None when it is available)."""
    load()
    return _error


def require(feature: str) -> ModuleType:
    """The extension module; raises RuntimeError naming ``feature`` when it is unavailable."""
    module = load()
    if module is None:
        raise RuntimeError(
            f"{feature} needs the compiled extension moe_dispatcher._C, which is unavailable: "
            f"{_error}. To get it, {_BUILD_HINT}."
        )
    return module
