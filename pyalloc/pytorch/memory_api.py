"""PyTorch's CUDA memory API, answered from pyalloc's figures.

Why the memory API is patched: under a pluggable allocator PyTorch's own
``torch.cuda.memory_stats``, ``memory_allocated``, ``max_memory_allocated``,
``memory_reserved``, ``max_memory_reserved``, ``reset_peak_memory_stats``,
``reset_accumulated_memory_stats``, ``memory_summary``, ``memory_snapshot``,
``torch.cuda.memory._snapshot`` and ``_record_memory_history`` raise, which
breaks training loops and tools that log memory. :func:`pyalloc.install`
therefore replaces them, in both the ``torch.cuda`` and ``torch.cuda.memory``
namespaces, with functions that return pyalloc's figures in PyTorch's formats.
:func:`patch_torch_memory_api` and :func:`unpatch_torch_memory_api` do the
patching alone (they need no GPU, so they are testable on the host backend).
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from types import ModuleType
from typing import Any, Callable

from .._deps import require
from ..core import configure
from ..core import memory_stats as _pyalloc_memory_stats
from ..core import reset_accumulated_memory_stats as _pyalloc_reset_accumulated
from ..core import reset_peak_memory_stats as _pyalloc_reset_peak
from ..core import snapshot as _pyalloc_snapshot

__all__ = [
    "is_patched",
    "patch_torch_memory_api",
    "resolve_device",
    "unpatch_torch_memory_api",
]

# PyTorch's _record_memory_history defaults to sys.maxsize entries (its ring
# grows on demand); pyalloc's trace ring is allocated up front, so an unbounded
# request becomes this many entries (~40 B each).
DEFAULT_HISTORY_ENTRIES = 100_000
# The largest ring the library accepts (config key `trace`).
MAX_HISTORY_ENTRIES = 1 << 24

_lock = threading.Lock()


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
    require("torch.cuda.memory", "pyalloc's PyTorch memory API")  # makes both modules importable by name

    return [(name, sys.modules[name]) for name in _NAMESPACES]


# What the torch-facing layer answers from C++ with PyTorch's own stack
# contexts (Note [Memory history under PyTorch]).
HISTORY_FUNCTIONS = frozenset({"_snapshot", "memory_snapshot", "_record_memory_history"})
# What PyTorch's own functions get right once the torch-facing layer is its
# allocator: the stats through getDeviceStats and the resets (stats.hpp), the
# history and snapshots (history.hpp). Nothing is patched then; the patches
# serve the plain CUDAPluggableAllocator, whose C++ entry points raise.
ANSWERED_BY_LAYER = frozenset(_REPLACEMENTS)


def patch_torch_memory_api(*, keep: frozenset[str] = frozenset()) -> None:
    """Points PyTorch's CUDA memory-stats functions at pyalloc's figures.

    Idempotent. Works without CUDA (useful with the host backend in tests).
    The functions named in ``keep`` stay PyTorch's own.
    """
    with _lock:
        for module_name, module in _namespaces():
            for attr, replacement in _REPLACEMENTS.items():
                key = (module_name, attr)
                if attr in keep or key in _originals or not hasattr(module, attr):
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
