"""NVML collector (nvidia-ml-py): device memory, per-process used bytes and SM utilization.

Missing values stay None ("N/A"), never 0: a zero would tell the reaper a
process holds nothing or does nothing. Without a driver, :func:`collect`
returns ``available=False`` and the daemon runs on the registry alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

NVML_VALUE_NOT_AVAILABLE = (1 << 64) - 1  # what NVML puts in usedGpuMemory when it can't say


@dataclass
class NvmlProcess:
    pid: int
    used_bytes: int | None  # None: N/A (e.g. under MIG without permissions, or Windows WDDM)
    sm_util: int | None = None  # percent over the last sample window; None: no sample
    in_our_pid_namespace: bool = True


@dataclass
class NvmlDevice:
    index: int
    name: str
    uuid: str
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None
    mig_enabled: bool | None
    processes: list[NvmlProcess] = field(default_factory=list)
    error: str | None = None  # why the device did not answer this poll (lost, timed out); None: it did


@dataclass
class NvmlState:
    available: bool
    error: str | None = None
    driver_version: str | None = None
    devices: list[NvmlDevice] = field(default_factory=list)


_initialized = False
_last_util_timestamp: dict[int, int] = {}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _running_processes(nvml: Any, handle: Any) -> list[Any]:
    """Compute then graphics processes, from the newest list API the driver has (v3, v2, v1)."""
    out: list[Any] = []
    for kind in ("Compute", "Graphics"):
        for suffix in ("_v3", "_v2", ""):
            fn = getattr(nvml, f"nvmlDeviceGet{kind}RunningProcesses{suffix}", None)
            if fn is None:
                continue
            try:
                out.extend(fn(handle))
                break
            except nvml.NVMLError_FunctionNotFound:
                continue
            except nvml.NVMLError as e:
                if _unanswered(nvml, e):
                    raise  # the device stopped answering: _device reports it
                break
    return out


def _sm_utilization(nvml: Any, handle: Any, index: int) -> dict[int, int] | None:
    """pid -> SM % from the samples since our last call.

    NotFound means no process ran a kernel in the window: every pid is at 0.
    Any other error (NotSupported, NoPermission) means unknown: None.
    """
    try:
        samples = nvml.nvmlDeviceGetProcessUtilization(handle, _last_util_timestamp.get(index, 0))
    except nvml.NVMLError_NotFound:
        return {}
    except nvml.NVMLError:
        return None
    util: dict[int, int] = {}
    for s in samples:
        util[int(s.pid)] = max(util.get(int(s.pid), 0), int(s.smUtil))
        _last_util_timestamp[index] = max(_last_util_timestamp.get(index, 0), int(s.timeStamp))
    return util


def _unanswered(nvml: Any, e: Exception) -> bool:
    """Whether an NVML error means the device did not answer (lost, timed out, unknown) rather than
    "this value is not available here" (not supported, no permission), which is only an N/A."""
    return not isinstance(e, (nvml.NVMLError_NotSupported, nvml.NVMLError_NoPermission))


def _device(nvml: Any, i: int) -> NvmlDevice:
    """Device ``i``, with ``error`` set when it failed in the middle of the poll: a device that
    is lost (Xid 79) or times out is reported as such, and must not hide the others."""
    dev = NvmlDevice(i, "?", "", None, None, None, None)
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        dev.name = _text(nvml.nvmlDeviceGetName(handle))
        dev.uuid = _text(nvml.nvmlDeviceGetUUID(handle))
    except nvml.NVMLError as e:
        dev.error = f"device {i}: {e}"
        return dev
    try:
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        dev.total_bytes, dev.used_bytes, dev.free_bytes = int(mem.total), int(mem.used), int(mem.free)
    except nvml.NVMLError as e:
        if _unanswered(nvml, e):
            dev.error = f"memory info: {e}"
            return dev
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        dev.mig_enabled = bool(current)
    except nvml.NVMLError:
        dev.mig_enabled = None  # not supported: not a MIG-capable device
    util = _sm_utilization(nvml, handle, i)
    try:
        procs = _running_processes(nvml, handle)
    except nvml.NVMLError as e:
        dev.error = f"running processes: {e}"
        dev.total_bytes = dev.used_bytes = dev.free_bytes = None  # a device that failed mid-poll: N/A
        return dev
    for p in procs:
        used = getattr(p, "usedGpuMemory", None)
        if used is None or used == NVML_VALUE_NOT_AVAILABLE:
            used = None
        pid = int(p.pid)
        sm = None if util is None else util.get(pid, 0)
        dev.processes.append(NvmlProcess(pid, used, sm, os.path.exists(f"/proc/{pid}")))
    return dev


def collect(nvml: Any = None) -> NvmlState:
    """One NVML sample; ``nvml`` may be a stand-in module (tests)."""
    global _initialized
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[no-redef]
        except ImportError as e:
            return NvmlState(False, f"nvidia-ml-py not installed: {e}")
    if not _initialized:
        try:
            nvml.nvmlInit()
            _initialized = True
        except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
            return NvmlState(False, f"NVML unavailable: {e}")
    state = NvmlState(True)
    try:
        state.driver_version = _text(nvml.nvmlSystemGetDriverVersion())
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as e:
        return NvmlState(False, f"NVML error: {e}")
    for i in range(count):
        state.devices.append(_device(nvml, i))
    return state
