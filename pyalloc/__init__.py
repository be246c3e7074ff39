"""pyalloc: a caching, stream-ordered, fragmentation-aware GPU memory allocator."""

from __future__ import annotations

from ._lib import PyallocError, library_path
from .core import (
    check,
    config,
    configure,
    create_pool,
    current_pool,
    device_count,
    dump_snapshot,
    empty_cache,
    free,
    free_neighbours,
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
from .torch_compat import (
    install,
    install_cupy,
    patch_torch_memory_api,
    unpatch_torch_memory_api,
)

__all__ = [
    "PyallocError",
    "check",
    "config",
    "configure",
    "create_pool",
    "current_pool",
    "device_count",
    "dump_snapshot",
    "empty_cache",
    "free",
    "free_neighbours",
    "install",
    "install_cupy",
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
    # `import pyalloc` (and gpumemd, which never needs torch) stays light.
    if name == "offload":
        from .offload_manager import offload

        return offload
    if name == "relocate_training_state":
        from .training_state import relocate_training_state

        return relocate_training_state
    raise AttributeError(f"module 'pyalloc' has no attribute {name!r}")
