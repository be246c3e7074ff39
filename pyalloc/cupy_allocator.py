"""Making CuPy allocate from pyalloc, on CuPy's current stream.

Needs only the core binding: CuPy's allocator hook is a Python function that
returns a ``MemoryPointer`` to a pyalloc block.
"""

from __future__ import annotations

from typing import Any

from ._finalizers import finalize
from ._lib import PyallocError, last_error, lib
from .core import memory_stats as _pyalloc_memory_stats

__all__ = ["install_cupy"]


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

    def __del__(self) -> None:  # (at interpreter shutdown the library may already be gone)
        finalize(lambda: lib().pyalloc_free(self.ptr, self.size, self.device, self.stream))


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
