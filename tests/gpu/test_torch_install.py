"""pyalloc under PyTorch on a real GPU: allocation routing, stats, empty_cache, snapshots.

Each test runs its workload in a fresh interpreter (see conftest.py). Figures
read straight from libpyalloc (``pyalloc.memory_stats``) prove that PyTorch's
allocations really went through pyalloc; the figures PyTorch's own API
returns after ``pyalloc.install()`` must agree with them.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

MiB = 1 << 20


def test_install_routes_torch_cuda_allocations_through_pyalloc(
    gpu_python: Callable[..., Any],
) -> None:
    result = gpu_python(
        """
        import torch

        before = pyalloc.memory_stats(0)["allocated_bytes.all.current"]
        x = torch.empty(1 << 20, dtype=torch.float32, device="cuda")  # 4 MiB
        x.fill_(1.5)
        total = x.sum().item()
        after = pyalloc.memory_stats(0)["allocated_bytes.all.current"]
        emit({
            "delta": after - before,
            "pointer": x.data_ptr(),
            "sum": total,
            "torch_allocated": torch.cuda.memory_allocated(),
            "torch_stats_allocated": torch.cuda.memory_stats()["allocated_bytes.all.current"],
            "pyalloc_allocated": pyalloc.memory_stats(0)["allocated_bytes.all.current"],
        })
        """,
        allocator="pyalloc",
    )
    # The 4 MiB tensor is pyalloc's: its own counters moved by exactly that.
    assert result["delta"] == 4 * MiB
    assert result["pointer"] % 512 == 0
    # The memory is real device memory that kernels write and read.
    assert result["sum"] == 1.5 * (1 << 20)
    # PyTorch's memory API reports pyalloc's figures.
    assert result["torch_allocated"] == result["pyalloc_allocated"]
    assert result["torch_stats_allocated"] == result["pyalloc_allocated"]


def test_install_after_cuda_init_is_refused(gpu_python: Callable[..., Any]) -> None:
    result = gpu_python(
        """
        import torch
        import pyalloc

        torch.empty(1, device="cuda")
        try:
            pyalloc.install()
        except pyalloc.PyallocError as exc:
            emit({"raised": True, "message": str(exc)})
        else:
            emit({"raised": False, "message": ""})
        """,
        allocator="none",
    )
    assert result["raised"], "install() after the first CUDA call must refuse, not half-work"
    assert "before the first CUDA call" in result["message"]


_STATS_SCRIPT = """
import ctypes

import torch

sizes = [512, 1000, 4096, 1 << 20, (1 << 20) + 1, 3 << 20, 25 << 20]
torch.cuda.synchronize()
base = pyalloc.memory_stats(0)
tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
del tensors[5]  # 3 MiB
del tensors[1]  # 1000 B
live = [t.numel() for t in tensors]
torch.cuda.synchronize()

direct = dict(pyalloc.memory_stats(0))
via_torch = dict(torch.cuda.memory_stats())
nested = torch.cuda.memory_stats_as_nested_dict()
figures = {
    "allocated": torch.cuda.memory_allocated(),
    "reserved": torch.cuda.memory_reserved(),
    "max_allocated": torch.cuda.max_memory_allocated(),
    "max_reserved": torch.cuda.max_memory_reserved(),
    "nested_allocated": nested["allocated_bytes"]["all"]["current"],
}
snapshot = torch.cuda.memory._snapshot()
segments = snapshot["segments"]


def segment_type(address):
    found = [s["segment_type"] for s in segments if s["address"] <= address < s["address"] + s["total_size"]]
    return found[0] if len(found) == 1 else f"{len(found)} segments"


# Whether the arena policy in force has a small pool depends on the device's virtual memory
# support (vmm=auto); the driver says.
cuda = ctypes.CDLL("libcuda.so.1")
device, supported = ctypes.c_int(-1), ctypes.c_int(-1)
rc = cuda.cuDeviceGet(ctypes.byref(device), 0)
if rc == 0:
    rc = cuda.cuDeviceGetAttribute(ctypes.byref(supported), 102, device)  # ..._VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
torch.cuda.reset_peak_memory_stats()
after_reset = {
    "allocated": torch.cuda.memory_allocated(),
    "max_allocated": torch.cuda.max_memory_allocated(),
}
pyalloc.check(0)
emit({
    "base": dict(base),
    "direct": direct,
    "via_torch": via_torch,
    "figures": figures,
    "after_reset": after_reset,
    "live": live,
    "tensor_segment_types": [segment_type(t.data_ptr()) for t in tensors],
    "vmm": pyalloc.config()["vmm"],
    "devices": pyalloc.device_count(),
    "vmm_supported": supported.value == 1 if rc == 0 else f"CUresult {rc}",
    "segment_total": sum(s["total_size"] for s in segments),
    "segment_allocated": sum(s["allocated_size"] for s in segments),
    "segment_devices": sorted({s["device"] for s in segments}),
})
"""


def _has_small_pool(vmm: str, devices: int, vmm_supported: bool) -> bool:
    """Whether requests of at most 1 MiB have a small pool of their own: under every arena policy
    but ``shared`` (README, *How it allocates*); ``auto`` on cuda is ``shared`` where the process
    sees one device with virtual memory, ``off`` otherwise (Config::resolve_vmm in
    allocator/src/ground/config.cpp)."""
    if vmm == "auto":
        vmm = "shared" if devices == 1 and vmm_supported else "off"
    return vmm != "shared"


def test_torch_memory_api_reports_pyalloc_stats_consistently(
    gpu_python: Callable[..., Any],
) -> None:
    r = gpu_python(_STATS_SCRIPT, allocator="pyalloc")
    direct, base, figures = r["direct"], r["base"], r["figures"]

    # torch.cuda.memory_stats() is pyalloc's, value for value, for every key PyTorch reports.
    # Through the torch-facing layer PyTorch builds the dict from C++ (getDeviceStats: its fixed
    # set of keys); pyalloc.memory_stats() has more of its own (pool.*, backend_*, num_stitches).
    via_torch = r["via_torch"]
    missing = sorted(k for k in via_torch if k not in direct)
    differ = {k: (v, direct[k]) for k, v in sorted(via_torch.items()) if k in direct and direct[k] != v}
    assert not missing, f"keys of torch.cuda.memory_stats() that pyalloc.memory_stats() lacks: {missing}"
    assert not differ, f"torch.cuda.memory_stats() against pyalloc.memory_stats(), (torch, pyalloc): {differ}"
    assert len(via_torch) >= 9 * 3 * 4, sorted(via_torch)  # PyTorch's 9 stat arrays at least: not vacuous
    assert figures["allocated"] == direct["allocated_bytes.all.current"], figures
    assert figures["reserved"] == direct["reserved_bytes.all.current"], figures
    assert figures["max_allocated"] == direct["allocated_bytes.all.peak"], figures
    assert figures["max_reserved"] == direct["reserved_bytes.all.peak"], figures
    assert figures["nested_allocated"] == figures["allocated"], figures

    # The counters describe exactly the live tensors.
    def delta(key: str) -> int:
        return int(direct[key]) - int(base[key])

    live = r["live"]
    assert delta("requested_bytes.all.current") == sum(live), (delta("requested_bytes.all.current"), live)
    assert delta("allocation.all.current") == len(live), (delta("allocation.all.current"), live)
    rounded = sum((n + 511) // 512 * 512 for n in live)
    assert delta("allocated_bytes.all.current") >= rounded, (delta("allocated_bytes.all.current"), rounded)
    assert direct["reserved_bytes.all.current"] >= direct["allocated_bytes.all.current"]
    for stat in ("allocated_bytes", "reserved_bytes", "allocation", "segment", "active_bytes"):
        parts = [direct[f"{stat}.{pool}.current"] for pool in ("small_pool", "large_pool", "all")]
        assert parts[0] + parts[1] == parts[2], (stat, "small, large, all:", parts)
    # Each tensor is in the pool the policy in force gives it: with a small pool, those of at
    # most 1 MiB there and larger ones in the large pool; with vmm=shared (the default on one
    # device with virtual memory) all in the large pool. The stats count them where they are.
    small_pool = _has_small_pool(r["vmm"], r["devices"], r["vmm_supported"] is True)
    expected = ["small" if small_pool and n <= MiB else "large" for n in live]
    placement = {"vmm": r["vmm"], "devices": r["devices"], "vmm_supported": r["vmm_supported"], "live": live}
    assert r["tensor_segment_types"] == expected, (r["tensor_segment_types"], placement)
    assert delta("allocation.small_pool.current") == expected.count("small"), (
        delta("allocation.small_pool.current"), placement)

    # The snapshot's segments add up to the same figures.
    assert r["segment_total"] == figures["reserved"], (r["segment_total"], figures)
    assert r["segment_allocated"] == figures["allocated"], (r["segment_allocated"], figures)
    assert r["segment_devices"] == [0]

    # reset_peak_memory_stats() brings the peak down to the current value.
    assert r["after_reset"]["max_allocated"] == r["after_reset"]["allocated"], r["after_reset"]


def test_memory_stats_has_every_key_of_the_native_allocator(
    gpu_python: Callable[..., Any],
) -> None:
    code = """
        import torch

        x = torch.empty(1 << 20, device="cuda")
        emit(sorted(torch.cuda.memory_stats().keys()))
        """
    native_keys = set(gpu_python(code, allocator="native"))
    pyalloc_keys = set(gpu_python(code, allocator="pyalloc"))
    missing = sorted(native_keys - pyalloc_keys)
    # Code that logs memory indexes these keys directly.
    assert not missing, f"keys of torch.cuda.memory_stats() that pyalloc lacks: {missing}"


def test_memory_summary_works_under_pyalloc(gpu_python: Callable[..., Any]) -> None:
    result = gpu_python(
        """
        import torch

        x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        emit(torch.cuda.memory_summary())
        """,
        allocator="pyalloc",
    )
    assert "Allocated memory" in result
    assert "Oversize allocations" in result


@pytest.mark.parametrize("allocator", ["native", "pyalloc"])
def test_empty_cache_returns_cached_memory_to_the_driver(
    gpu_python: Callable[..., Any], allocator: str
) -> None:
    size = 256 * MiB
    r = gpu_python(
        f"""
        import torch

        size = {size}
        torch.cuda.init()
        x = torch.empty(size, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
        reserved_live = torch.cuda.memory_reserved()
        del x
        torch.cuda.synchronize()
        reserved_cached = torch.cuda.memory_reserved()
        free_cached = torch.cuda.mem_get_info()[0]
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        reserved_after = torch.cuda.memory_reserved()
        free_after = torch.cuda.mem_get_info()[0]
        emit({{
            "reserved_live": reserved_live,
            "reserved_cached": reserved_cached,
            "reserved_after": reserved_after,
            "driver_freed": free_after - free_cached,
        }})
        """,
        allocator=allocator,
    )
    assert r["reserved_live"] >= size
    # Freeing a tensor keeps its memory cached...
    assert r["reserved_cached"] == r["reserved_live"]
    # ...and empty_cache() gives it back: reserved drops by the tensor...
    assert r["reserved_after"] <= r["reserved_cached"] - size
    # ...and the driver really has it again (half, to tolerate other processes).
    assert r["driver_freed"] >= size // 2
