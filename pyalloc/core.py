"""The allocator from Python: configuration, raw allocation, stats, snapshots, pools."""

from __future__ import annotations

import contextlib
import ctypes
import operator
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from . import sizes
from ._lib import PressureCallback, PyallocError, check_status, last_error, lib, read_json


def parse_size(text: str) -> int:
    """Parses sizes as PYALLOC_CONF does (pyalloc.sizes): ``512``, ``64KiB``, ``1.5GiB``, ``2GB``
    (10^9 bytes). A bad one raises PyallocError naming it."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise PyallocError(str(exc)) from None


def parse_budget(text: str) -> int | None:
    """Parses an offload budget as ``pyalloc run --offload`` and ``$PYALLOC_OFFLOAD`` take it:
    ``auto`` (None: no budget, only the allocator's pressure ladder evicts) or a size as
    :func:`parse_size` reads it."""
    if text.strip().lower() == "auto":
        return None
    try:
        return parse_size(text)
    except PyallocError:
        raise PyallocError(f"bad offload budget {text!r}: expected auto, a number of bytes, "
                           "or a size such as 512MiB or 2GB") from None


def configure(conf: str) -> None:
    """Applies a PYALLOC_CONF-style string (``"backend=host,capacity=1GiB"``).

    Only the keys named change; the others keep the values in force, an earlier call's included
    (``config()`` shows them all). Raises PyallocError naming the bad key and the accepted form,
    and then nothing changes.
    """
    if not isinstance(conf, str):
        raise TypeError(f"configure() takes a PYALLOC_CONF string such as 'backend=host', not {conf!r}")
    check_status(lib().pyalloc_configure(conf.encode()), "pyalloc_configure")


def config() -> dict[str, Any]:
    """The configuration in force (every PYALLOC_CONF key)."""
    settings = read_json(lib().pyalloc_config_json)
    settings.pop("startup_error", None)
    return settings


def startup_error() -> str | None:
    """Why the allocator is not running (a bad PYALLOC_CONF, no driver), or None."""
    error = read_json(lib().pyalloc_config_json).get("startup_error")
    return str(error) if error else None


def device_count() -> int:
    return int(lib().pyalloc_device_count())


def version() -> str:
    return lib().pyalloc_version().decode()


_WORD_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1
_INT_RANGE = (-(1 << 31), (1 << 31) - 1)


def _c_args(call: str, **args: int) -> None:
    """Refuses an integer argument the C type would not hold: ctypes passes ``2**64 + 4096`` as
    4096 and device ``2**32`` as 0, silently. Sizes, pointers and streams are words; devices and
    pool ids C ints."""
    for name, value in args.items():
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):  # (ctypes: "wrong type")
            raise TypeError(f"{call}: {name} must be a whole number, got {value!r}")
        lo, hi = _INT_RANGE if name in ("device", "pool_id") else (0, _WORD_MAX)
        if not lo <= operator.index(value) <= hi:
            raise PyallocError(f"{call}: {name} {value} is out of range ({lo} to {hi})")


def malloc(size: int, device: int = 0, stream: int = 0) -> int:
    """Allocates ``size`` bytes; returns the address, raises PyallocError on failure.

    ``malloc(0)`` returns 0 (NULL), as the C ABI does.
    """
    _c_args("pyalloc_malloc", device=device, stream=stream)
    if isinstance(size, int) and not isinstance(size, bool) and size < 0:
        raise PyallocError(f"pyalloc_malloc: size {size} is negative")
    _c_args("pyalloc_malloc", size=size)
    ptr = lib().pyalloc_malloc(size, device, stream)
    if not ptr:
        if size == 0:
            return 0
        raise PyallocError(last_error() or "pyalloc_malloc failed")
    return int(ptr)


ANY_STREAM = (1 << (8 * ctypes.sizeof(ctypes.c_void_p))) - 1  # PYALLOC_ANY_STREAM


def free(ptr: int, size: int, device: int = 0, stream: int | None = None) -> None:
    """Frees a block; a bad call raises PyallocError (the allocator stays intact).

    ``stream`` is the stream the block was allocated on; a different one is refused (a use on
    another stream is declared with ``record_stream``). None: not checked.
    """
    stream = ANY_STREAM if stream is None else stream
    _c_args("pyalloc_free", ptr=ptr, size=size, device=device, stream=stream)
    lib().pyalloc_clear_last_error()
    lib().pyalloc_free(ptr, size, device, stream)
    _raise_if_error()


def record_stream(ptr: int, stream: int) -> None:
    _c_args("pyalloc_record_stream", ptr=ptr, stream=stream)
    lib().pyalloc_clear_last_error()
    lib().pyalloc_record_stream(ptr, stream)
    _raise_if_error()


def free_neighbours(ptr: int) -> tuple[int, int]:
    """Bytes of the free blocks just below and above the live allocation at ``ptr`` (0 where the
    neighbour is not free): the contiguous space freeing it would open. Raises for a pointer
    pyalloc did not allocate."""
    _c_args("pyalloc_free_neighbours", ptr=ptr)
    below, above = ctypes.c_size_t(0), ctypes.c_size_t(0)
    check_status(lib().pyalloc_free_neighbours(ptr, ctypes.byref(below), ctypes.byref(above)),
                 "pyalloc_free_neighbours")
    return below.value, above.value


def _raise_if_error() -> None:
    # The void entry points report only through last_error, which the caller
    # cleared just before the call.
    message = last_error()
    if message:
        raise PyallocError(message)


def empty_cache() -> None:
    lib().pyalloc_empty_cache()


def set_memory_fraction(fraction: float, device: int = 0) -> None:
    _c_args("pyalloc_set_memory_fraction", device=device)
    lib().pyalloc_clear_last_error()
    lib().pyalloc_set_memory_fraction(fraction, device)
    _raise_if_error()


def release_cached(device: int = 0, nbytes: int = 0) -> int:
    """Releases cached free segments (oldest first) until ``nbytes`` (0 = all); returns bytes."""
    _c_args("pyalloc_release_cached", device=device, nbytes=nbytes)
    released = ctypes.c_size_t(0)
    check_status(
        lib().pyalloc_release_cached(device, nbytes, ctypes.byref(released)),
        "pyalloc_release_cached",
    )
    return int(released.value)


def check(device: int = 0) -> None:
    """Walks every invariant of ``device``; raises PyallocError on the first violation."""
    _c_args("pyalloc_check", device=device)
    check_status(lib().pyalloc_check(device), "pyalloc_check")


_MEMORY_INFO = ("device_total", "device_free", "reserved", "allocated", "limit", "largest_cached", "largest_request")


class _MemoryInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MEMORY_INFO]  # pyalloc_memory_info_t


def memory_info(device: int = 0) -> dict[str, int]:
    """pyalloc_memory_info: the device's total and free bytes, what this allocator reserves,
    allocates and may reserve (``limit``), its largest cached block and largest request it can
    serve without releasing anything. Raises PyallocError when the allocator is not running."""
    _c_args("pyalloc_memory_info", device=device)
    info = _MemoryInfo()
    check_status(lib().pyalloc_memory_info(device, ctypes.addressof(info)), "pyalloc_memory_info")
    return {name: int(getattr(info, name)) for name in _MEMORY_INFO}


def memory_stats(device: int = 0) -> "OrderedDict[str, Any]":
    """Stats in the flat format of ``torch.cuda.memory_stats()``, keys sorted.

    While an offload session exists in the process (``pyalloc.offload``, ``pyalloc run
    --offload``), its counters are included as ``offload.*`` (process-wide, whatever the
    device; see ``ActivationOffload.stats``).
    """
    stats = read_json(lib().pyalloc_stats_json, device)
    if "error" in stats:
        raise PyallocError(stats["error"])
    stats.update(extra_stats())
    return OrderedDict(sorted(stats.items()))


# Figures other parts of pyalloc add to memory_stats() (the offload session's, as offload.*),
# by prefix: read at each call. The core never imports those parts.
_stats_sources: dict[str, Callable[[], Mapping[str, float] | None]] = {}


def add_stats_source(prefix: str, source: Callable[[], Mapping[str, float] | None]) -> None:
    """Adds ``<prefix>.<key>`` figures to :func:`memory_stats`: ``source()`` is called each time
    and returns the figures, or None when it has none now."""
    _stats_sources[prefix] = source


def extra_stats() -> dict[str, float]:
    """The figures of every source added with :func:`add_stats_source`, as ``<prefix>.<key>``."""
    out: dict[str, float] = {}
    for prefix, source in list(_stats_sources.items()):
        for key, value in (source() or {}).items():
            out[f"{prefix}.{key}"] = value
    return out


def reset_peak_memory_stats(device: int = 0) -> None:
    _c_args("pyalloc_reset_peak_stats", device=device)
    check_status(lib().pyalloc_reset_peak_stats(device), "pyalloc_reset_peak_stats")


def reset_accumulated_memory_stats(device: int = 0) -> None:
    _c_args("pyalloc_reset_accumulated_stats", device=device)
    check_status(
        lib().pyalloc_reset_accumulated_stats(device), "pyalloc_reset_accumulated_stats"
    )


def snapshot() -> dict[str, Any]:
    """A dict in the format of ``torch.cuda.memory._snapshot()``."""
    return read_json(lib().pyalloc_snapshot_json)


def dump_snapshot(path: str | Path) -> None:
    """Pickles :func:`snapshot` to ``path``, readable by ``python -m torch.cuda._memory_viz``."""
    with open(path, "wb") as f:
        pickle.dump(snapshot(), f)


def create_pool(name: str) -> int:
    if not isinstance(name, str):
        raise TypeError(f"a pool is named by a string, not {name!r}")
    pool_id = ctypes.c_int(0)
    check_status(lib().pyalloc_pool_create(name.encode(), ctypes.byref(pool_id)), "pyalloc_pool_create")
    return int(pool_id.value)


def current_pool() -> int:
    return int(lib().pyalloc_current_pool())


@contextlib.contextmanager
def pool(name: str) -> Iterator[int]:
    """Routes this thread's allocations to the named user pool inside the block."""
    pool_id = create_pool(name)
    previous = current_pool()
    check_status(lib().pyalloc_set_current_pool(pool_id), "pyalloc_set_current_pool")
    try:
        yield pool_id
    finally:
        check_status(lib().pyalloc_set_current_pool(previous), "pyalloc_set_current_pool")


def hold_pool(pool_id: int, held: bool = True) -> None:
    """Holds (or lets go) a user pool: its memory stays where it is, in plain segments, and only
    :func:`empty_pool` releases its free memory (what a CUDA graph's private pool needs; Note
    [Held pools]). Hold a pool before its first allocation."""
    _c_args("pyalloc_pool_hold", pool_id=pool_id)
    check_status(lib().pyalloc_pool_hold(pool_id, int(held)), "pyalloc_pool_hold")


def empty_pool(pool_id: int) -> tuple[int, int]:
    """Releases the wholly free memory of user pool ``pool_id`` on every device, held or not;
    returns (bytes released, bytes the pool still reserves)."""
    _c_args("pyalloc_pool_empty_cache", pool_id=pool_id)
    released = ctypes.c_size_t(0)
    still = ctypes.c_size_t(0)
    check_status(lib().pyalloc_pool_empty_cache(pool_id, ctypes.byref(released), ctypes.byref(still)),
                 "pyalloc_pool_empty_cache")
    return int(released.value), int(still.value)


@contextlib.contextmanager
def capturing(device: int = 0) -> Iterator[None]:
    """Tells pyalloc that a CUDA stream capture is under way on ``device`` inside the block: it
    then serves from its cache and by growing only, and defers frees that would need the driver
    (Note [Capture]). For code that captures graphs itself (CuPy); under PyTorch the torch-facing
    layer does this."""
    _c_args("pyalloc_capture_begin", device=device)
    check_status(lib().pyalloc_capture_begin(device), "pyalloc_capture_begin")
    try:
        yield
    finally:
        check_status(lib().pyalloc_capture_end(device), "pyalloc_capture_end")


def ipc_export(ptr: int) -> tuple[bytes, int]:
    """A handle another process of this machine maps the live block at ``ptr`` with
    (:func:`ipc_import`), and the block's offset in what it maps (Note [Sharing blocks]). The
    block must stay allocated while the other process uses it."""
    _c_args("pyalloc_ipc_export", ptr=ptr)
    length = ctypes.c_size_t(0)
    offset = ctypes.c_size_t(0)
    size = 4096  # a handle is 40 bytes and a few per granule: one call, almost always
    while True:
        buf = ctypes.create_string_buffer(size)
        check_status(lib().pyalloc_ipc_export(ptr, buf, size, ctypes.byref(length), ctypes.byref(offset)),
                     "pyalloc_ipc_export")
        if length.value <= size:
            return buf.raw[:length.value], int(offset.value)
        size = length.value


def ipc_import(handle: bytes, device: int = 0) -> int:
    """Maps another process's block (a handle from :func:`ipc_export`) on ``device``; returns the
    base address (the block is at base + the exporter's offset) until :func:`ipc_close`."""
    _c_args("pyalloc_ipc_import", device=device)
    base = ctypes.c_void_p(0)
    check_status(lib().pyalloc_ipc_import(device, handle, len(handle), ctypes.byref(base)), "pyalloc_ipc_import")
    return int(base.value or 0)


def ipc_close(base: int, device: int = 0) -> None:
    _c_args("pyalloc_ipc_close", device=device, base=base)
    check_status(lib().pyalloc_ipc_close(device, base), "pyalloc_ipc_close")


_callbacks: dict[int, Any] = {}  # keeps ctypes thunks alive while registered


def register_pressure_callback(fn: Callable[[int, int], int]) -> int:
    """Registers ``fn(device, bytes_needed) -> bytes_freed`` for step 3 of the ladder.

    Returns a handle for :func:`unregister_pressure_callback`.
    """

    def thunk(device: int, needed: int, _user: Any) -> int:
        try:
            return max(0, int(fn(device, needed)))
        except Exception:  # never let an exception unwind into C
            return 0

    c_fn = PressureCallback(thunk)
    handle = ctypes.c_int(0)
    check_status(
        lib().pyalloc_register_pressure_callback(c_fn, None, ctypes.byref(handle)),
        "pyalloc_register_pressure_callback",
    )
    _callbacks[handle.value] = c_fn
    return int(handle.value)


def unregister_pressure_callback(handle: int) -> None:
    check_status(
        lib().pyalloc_unregister_pressure_callback(handle), "pyalloc_unregister_pressure_callback"
    )
    _callbacks.pop(handle, None)
