"""The price of the CUDA driver's virtual-memory calls, per call and per byte, on the GPU at hand.

    python3 tools/bench/vmm_calls.py [--gib 8] [--json FILE]

An arena grows by creating physical memory (cuMemCreate), mapping it into reserved address space
(cuMemMap) and granting the device access to the range (cuMemSetAccess); it shrinks by unmapping
(cuMemUnmap) and releasing (cuMemRelease). Which of those a growth pays per granule decides how an
arena should hold physical memory, so this times each pattern over the same number of bytes:

- granule:     one 2 MiB handle per granule, each mapped, one cuMemSetAccess per 32 MiB range;
- chunk/each:  one handle per 32 MiB chunk, mapped granule by granule at offsets into it;
- chunk/whole: one handle per 32 MiB chunk, mapped in one call;
- page20:      one handle per 20 MiB page, each mapped (PyTorch's expandable_segments).

It also asks the driver two questions the design depends on: can one cuMemUnmap cover several
adjacent mappings, and can it unmap a part of one mapping. Needs only the driver (libcuda.so.1),
not PyTorch. Prints one line per pattern and, with --json, writes every figure.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from collections.abc import Callable
from typing import Any

MiB = 1 << 20


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class Driver:
    """The few driver calls this needs, each checked."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check(self.lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.prop = _Prop(type=1, requestedHandleTypes=0, location=_Location(type=1, id=dev.value))
        self.access = _Access(location=_Location(type=1, id=dev.value), flags=3)
        granule = ctypes.c_size_t()
        self._check(self.lib.cuMemGetAllocationGranularity(ctypes.byref(granule), ctypes.byref(self.prop), 0),
                    "cuMemGetAllocationGranularity")
        self.granule = granule.value
        u64, size = ctypes.c_uint64, ctypes.c_size_t
        self.lib.cuMemMap.argtypes = [u64, size, size, u64, u64]
        self.lib.cuMemUnmap.argtypes = [u64, size]
        self.lib.cuMemSetAccess.argtypes = [u64, size, ctypes.c_void_p, size]
        self.lib.cuMemAddressReserve.argtypes = [ctypes.c_void_p, size, size, u64, u64]
        self.lib.cuMemAddressFree.argtypes = [u64, size]
        self.lib.cuMemCreate.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint64]
        self.lib.cuMemRelease.argtypes = [ctypes.c_uint64]

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc}")

    def reserve(self, size: int) -> int:
        va = ctypes.c_uint64()
        self._check(self.lib.cuMemAddressReserve(ctypes.byref(va), size, 0, 0, 0), "cuMemAddressReserve")
        return va.value

    def free_va(self, va: int, size: int) -> None:
        self._check(self.lib.cuMemAddressFree(va, size), "cuMemAddressFree")

    def create(self, size: int) -> int:
        h = ctypes.c_uint64()
        self._check(self.lib.cuMemCreate(ctypes.byref(h), size, ctypes.byref(self.prop), 0), "cuMemCreate")
        return h.value

    def map(self, va: int, size: int, offset: int, handle: int) -> int:
        return int(self.lib.cuMemMap(va, size, offset, handle, 0))

    def set_access(self, va: int, size: int) -> None:
        self._check(self.lib.cuMemSetAccess(va, size, ctypes.byref(self.access), 1), "cuMemSetAccess")

    def unmap(self, va: int, size: int) -> int:
        return int(self.lib.cuMemUnmap(va, size))

    def release(self, handle: int) -> None:
        self._check(self.lib.cuMemRelease(handle), "cuMemRelease")

    def synchronize(self) -> None:
        self._check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")


class Clock:
    """Seconds spent per kind of call, and how many calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def __call__(self, kind: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = fn()
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start
        self.calls[kind] = self.calls.get(kind, 0) + 1
        return result


def pattern(d: Driver, total: int, handle_size: int, map_size: int, access_size: int) -> dict[str, Any]:
    """Grows `total` bytes in handles of `handle_size`, mapped `map_size` at a time, access granted
    `access_size` at a time; then unmaps map by map and releases. Returns the seconds of each kind."""
    va = d.reserve(total)
    clock = Clock()
    handles = [clock("create", lambda: d.create(handle_size)) for _ in range(total // handle_size)]
    start = time.perf_counter()
    for i, h in enumerate(handles):
        base = va + i * handle_size
        for off in range(0, handle_size, map_size):
            rc = clock("map", lambda: d.map(base + off, map_size, off, h))
            if rc != 0:
                raise RuntimeError(f"cuMemMap of {map_size} bytes at offset {off} failed with CUresult {rc}")
    for at in range(0, total, access_size):
        clock("set_access", lambda: d.set_access(va + at, access_size))
    grow = time.perf_counter() - start + clock.seconds["create"]
    d.synchronize()
    start = time.perf_counter()
    for at in range(0, total, map_size):
        rc = clock("unmap", lambda: d.unmap(va + at, map_size))
        if rc != 0:
            raise RuntimeError(f"cuMemUnmap failed with CUresult {rc}")
    for h in handles:
        clock("release", lambda: d.release(h))
    shrink = time.perf_counter() - start
    d.free_va(va, total)
    per_call = {k: round(clock.seconds[k] / clock.calls[k] * 1e6, 2) for k in clock.seconds}
    return {"grow_seconds": round(grow, 4), "shrink_seconds": round(shrink, 4), "calls": clock.calls,
            "microseconds_per_call": per_call}


def questions(d: Driver) -> dict[str, int]:
    """CUresults of the calls the design depends on (0: allowed): a map at an offset into a
    handle, one cuMemUnmap over two adjacent mappings, an unmap of part of one mapping."""
    g = d.granule
    va = d.reserve(4 * g)
    h = d.create(4 * g)
    answers = {"map_at_offset": d.map(va + g, g, g, h)}
    if answers["map_at_offset"] == 0:
        d.unmap(va + g, g)
    a, b = d.create(g), d.create(g)
    d.map(va, g, 0, a)
    d.map(va + g, g, 0, b)
    d.set_access(va, 2 * g)
    answers["unmap_across_two_mappings"] = d.unmap(va, 2 * g)
    if answers["unmap_across_two_mappings"] != 0:
        d.unmap(va, g)
        d.unmap(va + g, g)
    d.release(a)
    d.release(b)
    d.map(va, 4 * g, 0, h)  # one mapping of four granules
    d.set_access(va, 4 * g)
    answers["unmap_part_of_one_mapping"] = d.unmap(va + g, g)
    d.unmap(va, 4 * g)
    d.release(h)
    d.free_va(va, 4 * g)
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=8.0, help="bytes each pattern grows and shrinks (GiB)")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    try:
        d = Driver()
    except (OSError, RuntimeError) as e:
        print(f"vmm_calls: no CUDA driver to time: {e}", file=sys.stderr)
        return 2
    g = d.granule
    total = int(args.gib * (1 << 30)) // (160 * MiB) * (160 * MiB)  # whole 32 and 20 MiB units
    chunk = 16 * g
    report: dict[str, Any] = {"granule_bytes": g, "bytes": total, "questions": questions(d), "patterns": {}}
    plans = {
        "granule": (g, g, chunk),
        "chunk/each": (chunk, g, chunk),
        "chunk/whole": (chunk, chunk, chunk),
        "page20": (20 * MiB, 20 * MiB, 20 * MiB),
    }
    for name, (handle_size, map_size, access_size) in plans.items():
        if map_size < handle_size and report["questions"]["map_at_offset"] != 0:
            print(f"{name:12} not timed: the driver maps no handle at an offset")
            continue
        r = pattern(d, total, handle_size, map_size, access_size)
        report["patterns"][name] = r
        print(f"{name:12} grow {r['grow_seconds']:.3f} s  shrink {r['shrink_seconds']:.3f} s  "
              f"us/call {r['microseconds_per_call']}", flush=True)
    print(f"questions (CUresult, 0 = allowed): {report['questions']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
