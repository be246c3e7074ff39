"""ctypes binding of libpyalloc.so (allocator/include/pyalloc/pyalloc.h).

Every C entry point is declared here once, with its argument and return
types. Failures become :class:`PyallocError` carrying the library's own
message from ``pyalloc_last_error``.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any, Callable

_LIB_NAME = "libpyalloc.so"

PressureCallback = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p)


class PyallocError(RuntimeError):
    """A call into libpyalloc failed; the message is the library's own."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


def library_path() -> str:
    """Absolute path of the libpyalloc.so this package loads.

    ``PYALLOC_LIBRARY`` overrides it (used by sanitizer and development builds).
    """
    override = os.environ.get("PYALLOC_LIBRARY")
    if override:
        path = Path(override).resolve()
        if not path.is_file():
            raise PyallocError(f"PYALLOC_LIBRARY={override!r}: no such file")
        return str(path)
    path = Path(__file__).resolve().parent / _LIB_NAME
    if path.is_file():
        return str(path)
    # Imported from a source checkout (python -m from the repository root):
    # use the library of the installed distribution, if there is one.
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        installed = Path(str(distribution("pyalloc").locate_file(f"pyalloc/{_LIB_NAME}"))).resolve()
        if installed.is_file():
            return str(installed)
    except PackageNotFoundError:
        pass
    raise PyallocError(
        f"{path} is missing: the package was not built; install it with `pip install .`"
    )


_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "pyalloc_malloc": (ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
    "pyalloc_free": (None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
    "pyalloc_record_stream": (None, [ctypes.c_void_p, ctypes.c_void_p]),
    "pyalloc_free_neighbours": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                               ctypes.POINTER(ctypes.c_size_t)]),
    "pyalloc_empty_cache": (None, []),
    "pyalloc_memory_info": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]),
    "pyalloc_set_memory_fraction": (None, [ctypes.c_double, ctypes.c_int]),
    "pyalloc_cupy_malloc": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
    "pyalloc_cupy_free": (None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]),
    "pyalloc_cupy_set_stream": (None, [ctypes.c_void_p]),
    "pyalloc_configure": (ctypes.c_int, [ctypes.c_char_p]),
    "pyalloc_last_error": (ctypes.c_char_p, []),
    "pyalloc_stats_json": (ctypes.c_size_t, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]),
    "pyalloc_snapshot_json": (ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]),
    "pyalloc_check": (ctypes.c_int, [ctypes.c_int]),
    "pyalloc_version": (ctypes.c_char_p, []),
    "pyalloc_clear_last_error": (None, []),
    "pyalloc_device_count": (ctypes.c_int, []),
    "pyalloc_config_json": (ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]),
    "pyalloc_reset_peak_stats": (ctypes.c_int, [ctypes.c_int]),
    "pyalloc_reset_accumulated_stats": (ctypes.c_int, [ctypes.c_int]),
    "pyalloc_release_cached": (
        ctypes.c_int,
        [ctypes.c_int, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "pyalloc_pool_create": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]),
    "pyalloc_set_current_pool": (ctypes.c_int, [ctypes.c_int]),
    "pyalloc_current_pool": (ctypes.c_int, []),
    "pyalloc_pool_hold": (ctypes.c_int, [ctypes.c_int, ctypes.c_int]),
    "pyalloc_pool_empty_cache": (
        ctypes.c_int,
        [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)],
    ),
    "pyalloc_capture_begin": (ctypes.c_int, [ctypes.c_int]),
    "pyalloc_pool_take_cached": (ctypes.c_void_p, [ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
    "pyalloc_ipc_export": (
        ctypes.c_int,
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
         ctypes.POINTER(ctypes.c_size_t)],
    ),
    "pyalloc_ipc_import": (
        ctypes.c_int,
        [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)],
    ),
    "pyalloc_ipc_close": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]),
    "pyalloc_capture_end": (ctypes.c_int, [ctypes.c_int]),
    "pyalloc_register_pressure_callback": (
        ctypes.c_int,
        [PressureCallback, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)],
    ),
    "pyalloc_unregister_pressure_callback": (ctypes.c_int, [ctypes.c_int]),
    "pyalloc_replay": (
        ctypes.c_int,
        [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32),
         ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
         ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
         ctypes.c_size_t, ctypes.c_void_p],
    ),
}

_lib: ctypes.CDLL | None = None


def lib() -> ctypes.CDLL:
    """The loaded library, with every entry point typed."""
    global _lib
    if _lib is None:
        path = library_path()
        try:
            loaded = ctypes.CDLL(path)
        except OSError as e:
            raise PyallocError(f"cannot load {path}: {e}") from None
        for name, (restype, argtypes) in _SIGNATURES.items():
            try:
                fn = getattr(loaded, name)
            except AttributeError:
                raise PyallocError(
                    f"{path} has no {name}: the library is older than this package; rebuild it"
                ) from None
            fn.restype = restype
            fn.argtypes = argtypes
        _lib = loaded
    return _lib


def last_error() -> str:
    raw = lib().pyalloc_last_error()
    return raw.decode("utf-8", "replace") if raw else ""


def check_status(status: int, what: str) -> None:
    """Raises PyallocError with the library's message when status != 0."""
    if status != 0:
        raise PyallocError(last_error() or f"{what} failed with status {status}", status)


def read_text(fn: Callable[..., int], *args: Any) -> str:
    """Calls an snprintf-style entry point: size it, then fill it."""
    needed = fn(*args, None, 0)
    while True:
        buf = ctypes.create_string_buffer(needed + 1)
        got = fn(*args, buf, needed + 1)
        if got <= needed:
            return buf.raw[:got].decode("utf-8")
        needed = got  # grew between the two calls


def read_json(fn: Callable[..., int], *args: Any) -> Any:
    return json.loads(read_text(fn, *args))
