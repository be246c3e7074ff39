"""pyalloc: a caching, stream-ordered, fragmentation-aware GPU memory allocator.

This module is the public API. The package, by layer (each subpackage's docstring says what it
may import and what must never come to it; tests/test_package_layers.py checks):

- the core binding, here at the top: ``_lib`` (loading libpyalloc.so with ctypes), ``core``
  (configure, malloc, free, stats, pools, snapshots), ``cupy_allocator`` (CuPy's hook) and
  ``cli`` (the ``pyalloc`` command, which finds the commands of the subpackages by name);
- ``pytorch``: installing pyalloc into PyTorch, PyTorch's memory API, training-state pools,
  ``pyalloc run``;
- ``offloading``: the activation offload manager (``pyalloc.offload``);
- ``traces``: the trace format, record, replay, the stress suite and its workloads;
- ``gpumemd``: the node daemon, with the registry reader; it needs neither torch nor the
  library;
- ``diagnosis``: ``pyalloc doctor`` and ``pyalloc.doctor()``: why memory grows, who holds it,
  what to change.
"""

from __future__ import annotations

from ._deps import MissingDependency, require
from ._lib import PyallocError, library_path
from .core import (
    capturing,
    check,
    config,
    configure,
    create_pool,
    current_pool,
    device_count,
    dump_snapshot,
    empty_cache,
    empty_pool,
    free,
    free_neighbours,
    hold_pool,
    ipc_close,
    ipc_export,
    ipc_import,
    malloc,
    memory_stats,
    pool,
    record_stream,
    register_pressure_callback,
    release_cached,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    set_memory_fraction,
    snapshot,
    startup_error,
    unregister_pressure_callback,
    version,
)
from .cupy_allocator import install_cupy
from .pytorch.install import install
from .pytorch.memory_api import patch_torch_memory_api, unpatch_torch_memory_api

__all__ = [
    "MissingDependency",
    "PyallocError",
    "capturing",
    "check",
    "config",
    "configure",
    "create_pool",
    "current_pool",
    "device_count",
    "doctor",
    "dump_snapshot",
    "empty_cache",
    "empty_pool",
    "free",
    "free_neighbours",
    "hold_pool",
    "install",
    "install_cupy",
    "ipc_close",
    "ipc_export",
    "ipc_import",
    "library_path",
    "malloc",
    "memory_stats",
    "offload",
    "patch_torch_memory_api",
    "pool",
    "record_stream",
    "register_pressure_callback",
    "relocate_training_state",
    "release_cached",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_memory_fraction",
    "snapshot",
    "startup_error",
    "unpatch_torch_memory_api",
    "unregister_pressure_callback",
    "version",
]


def __getattr__(name: str) -> object:
    # The offload manager needs torch; import it only when asked for, so that
    # `import pyalloc` (and gpumemd, which never needs torch) stays light. Without torch (the base
    # install) the ImportError says what to install (pyalloc/_deps.py).
    if name in ("offload", "doctor", "relocate_training_state"):
        require("torch", f"pyalloc.{name}")
    if name == "offload":
        from .offloading.session import offload

        return offload
    if name == "doctor":
        from .diagnosis.session import Doctor

        return Doctor
    if name == "relocate_training_state":
        from .pytorch.training_state import relocate_training_state

        return relocate_training_state
    raise AttributeError(f"module 'pyalloc' has no attribute {name!r}")
