"""Plugging pyalloc into PyTorch and CuPy.

:func:`install` makes PyTorch allocate CUDA memory from libpyalloc.so through
``torch.cuda.memory.CUDAPluggableAllocator``. It must run before the process's
first CUDA call: PyTorch refuses to swap an allocator that was already used.
Call it first thing in the program, run the program under
``pyalloc run -- python train.py`` (which installs it at interpreter start, in
every Python process the command starts), or call it from ``sitecustomize``.

Why the memory API is patched: under a pluggable allocator PyTorch's own
``torch.cuda.memory_stats``, ``memory_allocated``, ``max_memory_allocated``,
``memory_reserved``, ``max_memory_reserved``, ``reset_peak_memory_stats``,
``reset_accumulated_memory_stats``, ``memory_summary``, ``memory_snapshot``,
``torch.cuda.memory._snapshot`` and ``_record_memory_history`` raise, which
breaks training loops and tools that log memory. :func:`install` therefore
replaces them, in both the ``torch.cuda`` and ``torch.cuda.memory``
namespaces, with functions that return pyalloc's figures in PyTorch's formats.
Opt out with ``install(patch_torch=False)`` or the environment variable
``PYALLOC_PATCH_TORCH=0``; :func:`patch_torch_memory_api` and
:func:`unpatch_torch_memory_api` do the patching alone (they need no GPU, so
they are testable on the host backend).

:func:`install_cupy` makes CuPy allocate from pyalloc on CuPy's current stream.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import warnings
from collections import OrderedDict
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from ._lib import PyallocError, last_error, lib, library_path
from .core import config, configure, device_count
from .core import memory_stats as _pyalloc_memory_stats
from .core import reset_accumulated_memory_stats as _pyalloc_reset_accumulated
from .core import reset_peak_memory_stats as _pyalloc_reset_peak
from .core import snapshot as _pyalloc_snapshot

if TYPE_CHECKING:
    import torch

__all__ = [
    "PyallocWarning",
    "cuda_unavailable_reason",
    "install",
    "install_cupy",
    "is_installed",
    "patch_torch_memory_api",
    "unpatch_torch_memory_api",
]

PATCH_ENV = "PYALLOC_PATCH_TORCH"

# PyTorch's _record_memory_history defaults to sys.maxsize entries (its ring
# grows on demand); pyalloc's trace ring is allocated up front, so an unbounded
# request becomes this many entries (~40 B each).
DEFAULT_HISTORY_ENTRIES = 100_000
# The largest ring the library accepts (config key `trace`).
MAX_HISTORY_ENTRIES = 1 << 24


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
    import torch

    with _lock:
        if _installed_allocator is not None:
            if conf:
                configure(conf)
            if patch_torch and _patch_enabled_by_env():
                patch_torch_memory_api()
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

        pluggable = torch.cuda.memory.CUDAPluggableAllocator(
            library_path(), "pyalloc_malloc", "pyalloc_free"
        )
        _wire_optional_hooks(pluggable.allocator())
        torch.cuda.memory.change_current_allocator(pluggable)
        _set_installed(pluggable)

        if patch_torch and _patch_enabled_by_env():
            patch_torch_memory_api()


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


def _patch_enabled_by_env() -> bool:
    return os.environ.get(PATCH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


# ---- device resolution ------------------------------------------------------


def _current_device() -> int:
    import torch

    # Without CUDA there is no "current device": pyalloc's host and sim
    # backends number their devices from 0, and 0 is the one tests use.
    if torch.cuda.is_available():
        return int(torch.cuda.current_device())
    return 0


def resolve_device(device: Any) -> int:
    """A device index, resolved as PyTorch resolves ``device`` arguments.

    None means the current device; an int is taken as is (no CUDA call);
    ``"cuda:1"``, ``torch.device`` and ``torch.cuda.device`` are accepted.
    """
    if device is None:
        return _current_device()
    if isinstance(device, bool):
        raise ValueError(f"Expected a cuda device, but got: {device!r}")
    if isinstance(device, int):
        return device
    import torch

    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return int(device.index) if device.index is not None else _current_device()
    if isinstance(device, torch.cuda.device):
        return int(device.idx)
    raise ValueError(f"Expected a cuda device, but got: {device!r}")


# ---- the patched memory API ---------------------------------------------------


def memory_stats(device: Any = None) -> "OrderedDict[str, Any]":
    """``torch.cuda.memory_stats`` from pyalloc: flat, sorted, PyTorch's keys."""
    return _pyalloc_memory_stats(resolve_device(device))


def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
    """``torch.cuda.memory_stats_as_nested_dict`` from pyalloc."""
    nested: dict[str, Any] = {}
    for key, value in memory_stats(device).items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def memory_allocated(device: Any = None) -> int:
    return int(memory_stats(device).get("allocated_bytes.all.current", 0))


def max_memory_allocated(device: Any = None) -> int:
    return int(memory_stats(device).get("allocated_bytes.all.peak", 0))


def memory_reserved(device: Any = None) -> int:
    return int(memory_stats(device).get("reserved_bytes.all.current", 0))


def max_memory_reserved(device: Any = None) -> int:
    return int(memory_stats(device).get("reserved_bytes.all.peak", 0))


def reset_peak_memory_stats(device: Any = None) -> None:
    _pyalloc_reset_peak(resolve_device(device))


def reset_accumulated_memory_stats(device: Any = None) -> None:
    _pyalloc_reset_accumulated(resolve_device(device))


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """PyTorch's memory summary table, filled from pyalloc's stats.

    PyTorch's own ``memory_summary`` only formats ``memory_stats(device)``
    (looked up in ``torch.cuda.memory`` at call time, hence patched), so it is
    reused with the device already resolved: the table is exactly PyTorch's.
    """
    original = _originals.get(("torch.cuda.memory", "memory_summary"))
    if original is None:
        import torch

        original = torch.cuda.memory.memory_summary
    return str(original(device=resolve_device(device), abbreviated=abbreviated))


def memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> list[dict[str, Any]]:
    """``torch.cuda.memory_snapshot``: the segments of pyalloc's snapshot."""
    return list(_pyalloc_snapshot()["segments"])


def _snapshot(device: Any = None, augment_with_fx_traces: bool = False) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot``: pyalloc's snapshot, in PyTorch's format."""
    return _pyalloc_snapshot()


def _history_entries(max_entries: Any) -> int:
    entries = int(max_entries)
    if entries >= sys.maxsize:
        return DEFAULT_HISTORY_ENTRIES
    return max(0, min(entries, MAX_HISTORY_ENTRIES))


def _record_memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
    """``torch.cuda.memory._record_memory_history`` mapped onto pyalloc's trace ring.

    ``enabled="all"`` records ``max_entries`` events (``trace=N``); ``None``
    and ``"state"`` record none (pyalloc's snapshot always holds the current
    state). The legacy boolean form maps ``trace_alloc_max_entries`` the same
    way. Stack frames are not recorded.
    """
    clear_history = False
    if isinstance(enabled, bool):
        # legacy: (enabled, record_context, trace_alloc_max_entries, ...)
        max_entries = kwargs.get("trace_alloc_max_entries", args[1] if len(args) > 1 else 1)
        entries = _history_entries(max_entries) if enabled else 0
        clear_history = bool(kwargs.get("clear_history", args[5] if len(args) > 5 else False))
    else:
        if enabled not in (None, "state", "all"):
            raise ValueError(f"enabled must be None, 'state' or 'all', got {enabled!r}")
        # (enabled, context, stacks, max_entries, device, clear_history, ...)
        max_entries = kwargs.get("max_entries", args[2] if len(args) > 2 else sys.maxsize)
        entries = _history_entries(max_entries) if enabled == "all" else 0
        clear_history = bool(kwargs.get("clear_history", args[4] if len(args) > 4 else False))
    if clear_history and entries > 0:
        configure("trace=0")  # resizing the ring drops what it recorded
    configure(f"trace={entries}")


_REPLACEMENTS: dict[str, Callable[..., Any]] = {
    "memory_stats": memory_stats,
    "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
    "memory_allocated": memory_allocated,
    "max_memory_allocated": max_memory_allocated,
    "memory_reserved": memory_reserved,
    "max_memory_reserved": max_memory_reserved,
    "reset_peak_memory_stats": reset_peak_memory_stats,
    "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
    "memory_summary": memory_summary,
    "memory_snapshot": memory_snapshot,
    "_snapshot": _snapshot,
    "_record_memory_history": _record_memory_history,
}

# Functions PyTorch defines on top of these (memory_cached, max_memory_cached,
# reset_max_memory_allocated, reset_max_memory_cached, _dump_snapshot,
# _save_segment_usage, ...) look their callee up in torch.cuda.memory at call
# time, so patching that namespace covers them too.
_NAMESPACES: tuple[str, ...] = ("torch.cuda.memory", "torch.cuda")

_originals: dict[tuple[str, str], Any] = {}


def _namespaces() -> list[tuple[str, ModuleType]]:
    import torch.cuda.memory  # noqa: F401  (makes both modules importable by name)

    return [(name, sys.modules[name]) for name in _NAMESPACES]


def patch_torch_memory_api() -> None:
    """Points PyTorch's CUDA memory-stats functions at pyalloc's figures.

    Idempotent. Works without CUDA (useful with the host backend in tests).
    """
    with _lock:
        for module_name, module in _namespaces():
            for attr, replacement in _REPLACEMENTS.items():
                key = (module_name, attr)
                if key in _originals or not hasattr(module, attr):
                    continue
                _originals[key] = getattr(module, attr)
                setattr(module, attr, replacement)


def unpatch_torch_memory_api() -> None:
    """Restores PyTorch's own functions replaced by :func:`patch_torch_memory_api`."""
    with _lock:
        for module_name, module in _namespaces():
            for attr in _REPLACEMENTS:
                original = _originals.pop((module_name, attr), None)
                if original is not None:
                    setattr(module, attr, original)


def is_patched() -> bool:
    return bool(_originals)


# ---- CuPy -------------------------------------------------------------------


class _CupyBlock:
    """Owner of one pyalloc block handed to CuPy; frees it when CuPy drops it.

    The free names the size, device and stream of the malloc, as the C ABI
    requires: the block becomes reusable in that stream's order.
    """

    __slots__ = ("ptr", "size", "device", "stream")

    def __init__(self, ptr: int, size: int, device: int, stream: int) -> None:
        self.ptr = ptr
        self.size = size
        self.device = device
        self.stream = stream

    def __del__(self) -> None:
        try:
            lib().pyalloc_free(self.ptr, self.size, self.device, self.stream)
        except Exception:  # interpreter shutdown: the library may already be gone
            pass


def _cupy_malloc(size: int) -> Any:
    """CuPy allocator function: a MemoryPointer to a pyalloc block on the current stream."""
    import cupy

    memory = cupy.cuda.memory
    device = int(cupy.cuda.runtime.getDevice())
    if size == 0:
        return memory.MemoryPointer(memory.Memory(0), 0)
    stream = int(cupy.cuda.get_current_stream().ptr)
    ptr = lib().pyalloc_malloc(size, device, stream)
    if not ptr:
        report = last_error() or "pyalloc_malloc failed"
        try:
            total = int(_pyalloc_memory_stats(device).get("reserved_bytes.all.current", 0))
        except PyallocError:
            total = 0
        raise memory.OutOfMemoryError(size, total) from PyallocError(report)
    owner = _CupyBlock(int(ptr), size, device, stream)
    return memory.MemoryPointer(memory.UnownedMemory(int(ptr), size, owner, device), 0)


def install_cupy() -> None:
    """Makes CuPy allocate from pyalloc, on CuPy's current stream.

    A Python allocator function is used (not CuPy's CFunctionAllocator) so
    that every allocation reads CuPy's current stream at the time it is made.
    """
    try:
        import cupy
    except ImportError as exc:
        raise PyallocError(
            f"pyalloc.install_cupy() needs CuPy, which cannot be imported ({exc}); "
            f"install it with `pip install pyalloc[cupy]` (or the cupy-cudaXXx wheel "
            f"matching your CUDA)"
        ) from exc
    lib()  # fail here, not on the first allocation, if the library is missing
    cupy.cuda.set_allocator(_cupy_malloc)
