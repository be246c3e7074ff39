"""Making pyalloc PyTorch's CUDA allocator.

:func:`install` makes PyTorch allocate CUDA memory from libpyalloc.so through
the torch-facing layer (:mod:`pyalloc.pytorch.layer`: a subclass of PyTorch's
CUDAPluggableAllocator, built against this torch on first use, that raises
torch.OutOfMemoryError and answers cacheInfo and getDeviceStats), or, when
the layer cannot be built (a warning says why) or ``PYALLOC_TORCH_LAYER=0``,
through ``torch.cuda.memory.CUDAPluggableAllocator``. It must run before the process's
first CUDA call: PyTorch refuses to swap an allocator that was already used.
Call it first thing in the program, run the program under
``pyalloc run -- python train.py`` (which installs it at interpreter start, in
every Python process the command starts), or call it from ``sitecustomize``.

Through the plain ``CUDAPluggableAllocator`` (whose C++ stats and history
entry points raise) it also points PyTorch's memory API at pyalloc's figures
(:mod:`pyalloc.pytorch.memory_api`), unless ``install(patch_torch=False)`` or
``PYALLOC_PATCH_TORCH=0``; through the layer PyTorch's own functions are right
and stay.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.util
import os
import sys
import threading
import warnings
from types import ModuleType
from typing import Any, Callable

from .._deps import require
from .._lib import PyallocError, lib, library_path
from ..core import config, configure, device_count, startup_error
from ..core import snapshot as _pyalloc_snapshot
from . import layer
from .memory_api import ANSWERED_BY_LAYER, patch_torch_memory_api

__all__ = [
    "LAYER_ENV",
    "PATCH_ENV",
    "PyallocWarning",
    "cuda_unavailable_reason",
    "install",
    "is_installed",
]

PATCH_ENV = "PYALLOC_PATCH_TORCH"
# 0: install PyTorch's plain pluggable allocator instead of the torch-facing
# layer (pyalloc/pytorch/layer.py), which is built against this torch on first use.
LAYER_ENV = "PYALLOC_TORCH_LAYER"


class PyallocWarning(RuntimeWarning):
    """A degraded but working setup (e.g. record_stream not wired). Shown by default."""


_lock = threading.RLock()
_installed_allocator: Any = None  # the CUDAPluggableAllocator; kept alive for the process


def is_installed() -> bool:
    """True once :func:`install` has made pyalloc PyTorch's CUDA allocator."""
    return _installed_allocator is not None


# ---- install ---------------------------------------------------------------


def install(conf: str | None = None, *, patch_torch: bool = True) -> None:
    """Makes pyalloc PyTorch's CUDA allocator for this process.

    ``conf`` (PYALLOC_CONF syntax) is applied on top of the PYALLOC_CONF the
    library read at load. A second call only applies ``conf`` (and patches
    the memory API if it was not). Raises PyallocError when torch has no
    CUDA, when CUDA is already initialized, or when the configuration selects
    a backend other than ``cuda``.
    """
    torch = require("torch", "pyalloc.install()")

    error = startup_error()  # a bad $PYALLOC_CONF is the user's to fix: say it now, not at the first malloc
    if error is not None and error.startswith("PYALLOC_CONF"):
        raise PyallocError(error)
    with _lock:
        if _installed_allocator is not None:
            if conf:
                configure(conf)
            if patch_torch and _patch_enabled_by_env():
                patch_torch_memory_api(keep=_kept_by_torch())
            return

        _require_cuda(torch)
        if torch.cuda.is_initialized():
            raise PyallocError(
                "pyalloc.install() must run before the first CUDA call, and CUDA is already "
                "initialized in this process; call pyalloc.install() first thing (before any "
                "tensor is put on the GPU), run the program as "
                "`pyalloc run -- python train.py`, or call it from sitecustomize"
            )
        if conf:
            configure(conf)
        backend = config().get("backend")
        if backend != "cuda":
            raise PyallocError(
                f"pyalloc.install() needs backend=cuda, but the configuration selects "
                f"backend={backend} (host and sim hand out pointers the GPU cannot use); "
                f"fix PYALLOC_CONF"
            )
        if device_count() == 0:
            # Every allocation would fail: refuse now, with the backend's reason.
            reason = _pyalloc_snapshot().get("error") or "no device found"
            raise PyallocError(f"pyalloc.install(): the cuda backend did not start: {reason}")

        if _layer_enabled_by_env():
            try:
                layer.install_cuda_allocator()
                _set_installed(layer)
                _after_import("torch._inductor.config", _without_cudagraph_trees)
            except layer.LayerError as e:
                warnings.warn(
                    f"{e}. Falling back to PyTorch's plain pluggable allocator: a failed allocation "
                    f"will not raise torch.OutOfMemoryError, and cudnn.benchmark will fail; set "
                    f"{LAYER_ENV}=0 to choose this without the warning",
                    PyallocWarning,
                    stacklevel=2,
                )
        if _installed_allocator is None:
            pluggable = torch.cuda.memory.CUDAPluggableAllocator(
                library_path(), "pyalloc_malloc", "pyalloc_free"
            )
            _wire_optional_hooks(pluggable.allocator())
            torch.cuda.memory.change_current_allocator(pluggable)
            _set_installed(pluggable)

        if patch_torch and _patch_enabled_by_env():
            patch_torch_memory_api(keep=_kept_by_torch())


def _without_cudagraph_trees(inductor_config: ModuleType) -> None:
    """torch.compile(mode="reduce-overhead") without cudagraph trees.

    The trees checkpoint their private pool's allocator state after every recording
    (``torch._C._cuda_getCheckpointState``) and restore it when a tree branches, which the
    torch-facing layer cannot do yet (docs/torch-layer.md): with trees, the first recorded graph
    would raise. Without them inductor captures each compiled graph with ``torch.cuda.graph`` into
    a private pool, which the layer serves (Note [Private pools under PyTorch]). Set at the
    config's import, so that a program's own setting afterwards still wins.
    """
    inductor_config.triton.cudagraph_trees = False


def _after_import(name: str, apply: Callable[[ModuleType], None]) -> None:
    """Runs ``apply`` on module ``name`` now if it is imported, else once it is (importing it
    here would cost a second of start-up for programs that never compile)."""
    module = sys.modules.get(name)
    if module is not None:
        apply(module)
        return

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            loader: Any = spec.loader
            run = loader.exec_module

            def exec_module(module: ModuleType) -> None:
                run(module)
                apply(module)

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())


def _kept_by_torch() -> frozenset[str]:
    """PyTorch's own functions that stay: all of them when the layer answers them from C++."""
    return ANSWERED_BY_LAYER if _installed_allocator is layer else frozenset()


def _set_installed(pluggable: Any) -> None:
    global _installed_allocator
    _installed_allocator = pluggable


def cuda_unavailable_reason(torch_module: ModuleType) -> str | None:
    """Why pyalloc cannot be PyTorch's CUDA allocator here, or None if it can."""
    if not hasattr(torch_module._C, "_cuda_customAllocator"):
        return (
            f"torch {torch_module.__version__} is built without CUDA "
            f"(torch._C._cuda_customAllocator is missing)"
        )
    if not torch_module.cuda.is_available():
        return (
            "torch.cuda.is_available() is False "
            "(no GPU or no NVIDIA driver visible to this process)"
        )
    return None


def _require_cuda(torch_module: ModuleType) -> None:
    reason = cuda_unavailable_reason(torch_module)
    if reason is not None:
        raise PyallocError(f"pyalloc.install() needs CUDA: {reason}")


def _function_address(name: str) -> int:
    """Raw address of a libpyalloc entry point, as PyTorch's set_*_fn setters take it."""
    address = ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value
    if not address:
        raise PyallocError(f"{library_path()} does not export {name}")
    return int(address)


# (setter on PyTorch's pluggable allocator, libpyalloc entry point)
_OPTIONAL_HOOKS: tuple[tuple[str, str], ...] = (
    ("set_reset_fn", "pyalloc_empty_cache"),
    ("set_record_stream_fn", "pyalloc_record_stream"),
    ("set_memory_fraction_fn", "pyalloc_set_memory_fraction"),
)


def _wire_optional_hooks(native: Any) -> None:
    for setter, symbol in _OPTIONAL_HOOKS:
        fn = getattr(native, setter, None)
        if fn is not None:
            fn(_function_address(symbol))
        elif setter == "set_record_stream_fn":
            # Without it Tensor.record_stream is silently a no-op: a block used on
            # a side stream could be reused while that stream still reads it.
            warnings.warn(
                "this PyTorch build cannot pass record_stream to a pluggable allocator "
                "(no set_record_stream_fn): Tensor.record_stream() will be a no-op under "
                "pyalloc, so memory used on a second stream may be reused while that "
                "stream still uses it; synchronize streams before freeing, or upgrade PyTorch",
                PyallocWarning,
                stacklevel=3,
            )


def _layer_enabled_by_env() -> bool:
    return os.environ.get(LAYER_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _patch_enabled_by_env() -> bool:
    return os.environ.get(PATCH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
