"""The merged model: devices and processes from NVML, the registry and psutil.

One :class:`ProcessRow` per (process, device). NVML says how many bytes the
driver charges the process; the registry says what its allocator does with
them; psutil says who it is and whether it is alive. Unknown stays None.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import registry
from . import nvml as nvml_collector
from .procinfo import DEFAULT_SUBREAPERS, ProcessSampler, ProcInfo

STALE_HEARTBEAT_S = 5.0  # the library refreshes a few times a second; 5 s means stuck or stopped
IDLE_CPU_PERCENT = 1.0


@dataclass
class AllocatorView:
    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int
    cached_bytes: int
    largest_free_bytes: int
    swapped_out_bytes: int
    peak_reserved_bytes: int
    num_ooms: int
    num_alloc_retries: int
    last_alloc_unix_ns: int
    backend: str
    heartbeat_age_s: float
    pressure_opt_in: bool
    record_path: str = ""  # the registry file these figures come from
    record_uid: int = -1   # its owner, the uid the kernel says runs the process (Note [Record identity])


@dataclass
class DeviceRow:
    device: str  # "cuda:0" (NVML index) or "<backend>:<i>" in registry-only mode
    gpu: int
    uuid: str | None
    name: str | None
    source: str  # "nvml" or "registry"
    total_bytes: int | None = None
    used_bytes: int | None = None
    free_bytes: int | None = None
    mig_enabled: bool | None = None
    allocator_reserved_bytes: int = 0  # sum over pyalloc processes on it
    allocator_allocated_bytes: int = 0
    error: str | None = None  # NVML failed on this device in the last poll (lost, timed out): its figures are N/A


@dataclass
class Flags:
    zombie: bool = False
    orphan: bool = False
    orphan_evidence: str = ""
    stale_heartbeat: bool = False
    idle_since: float | None = None  # unix seconds; None: not idle (or unknown)
    no_proc: bool = False  # NVML lists it but /proc has no such pid (other PID namespace or gone)


@dataclass
class ProcessRow:
    pid: int
    device: str
    gpu: int
    uuid: str | None
    user: str | None
    uid: int | None
    command: str | None
    used_bytes: int | None  # NVML; None: N/A or no NVML
    sm_util: int | None
    cpu_percent: float | None
    status: str | None
    ppid: int | None
    start_time: float | None
    allocator: AllocatorView | None
    flags: Flags = field(default_factory=Flags)
    cpu_seconds: float | None = None  # user + system CPU time since the process started (psutil)


@dataclass
class Snapshot:
    time: float
    nvml_available: bool
    nvml_error: str | None
    devices: list[DeviceRow]
    processes: list[ProcessRow]
    skipped_records: list[registry.Skipped]
    removed_records: list[registry.Skipped]
    registry_dir: str = ""
    registry_problem: str | None = None  # why processes may be unable to publish there (missing, full, ...)
    registry_free_bytes: int | None = None

    def to_json(self, full: bool = True) -> dict[str, Any]:
        """The snapshot as JSON. ``full`` False (what /v1/status serves to any local client) keeps
        each command's program name only: arguments may carry secrets, and the registry files
        behind the figures are their owners' (mode 0600)."""
        processes = [asdict(p) for p in self.processes]
        if not full:
            for p in processes:
                p["command"] = redact_command(p["command"])
                if p.get("allocator"):
                    p["allocator"]["record_path"] = ""
        return {
            "time": self.time,
            "nvml": {"available": self.nvml_available, "error": self.nvml_error},
            "devices": [asdict(d) for d in self.devices],
            "processes": processes,
            "skipped_records": [asdict(s) for s in self.skipped_records],
            "removed_records": [asdict(s) for s in self.removed_records],
            "registry": {"dir": self.registry_dir, "problem": self.registry_problem,
                         "free_bytes": self.registry_free_bytes},
        }


def redact_command(command: str | None) -> str | None:
    """The program's name alone ("python", not "python train.py --token=..."), or None."""
    if not command:
        return command
    parts = command.split()
    program = parts[0].rsplit("/", 1)[-1] if parts else ""
    return program + (" [arguments hidden]" if len(parts) > 1 else "")


def _visible_devices(pid: int) -> list[str] | None:
    """The process's CUDA_VISIBLE_DEVICES: maps its CUDA ordinals to NVML indices or UUIDs."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"CUDA_VISIBLE_DEVICES="):
            return [v.strip() for v in item.split(b"=", 1)[1].decode(errors="replace").split(",")]
    return None


class Collector:
    """Builds snapshots; keeps state between them (CPU counters, idle-since, first parents)."""

    def __init__(self, registry_dir: Path | str | None = None, use_nvml: bool = True,
                 stale_heartbeat_s: float = STALE_HEARTBEAT_S, idle_cpu_percent: float = IDLE_CPU_PERCENT,
                 subreapers: tuple[str, ...] = DEFAULT_SUBREAPERS, remove_dead: bool = True,
                 nvml_module: Any = None) -> None:
        self.registry_dir = registry_dir
        self.use_nvml = use_nvml
        self.stale_heartbeat_s = stale_heartbeat_s
        self.idle_cpu_percent = idle_cpu_percent
        self.subreapers = subreapers
        self.remove_dead = remove_dead
        self.nvml_module = nvml_module
        self.sampler = ProcessSampler()
        self._idle_since: dict[tuple[int, str], float] = {}
        self._known_devices: dict[int, tuple[str, str]] = {}  # NVML index -> (name, UUID) last seen

    def collect(self, cpu_sample_s: float = 0.0) -> Snapshot:
        now = time.time()
        removed = registry.remove_dead(self.registry_dir) if self.remove_dead else []
        scan = registry.scan(self.registry_dir)
        nv = nvml_collector.collect(self.nvml_module) if self.use_nvml else \
            nvml_collector.NvmlState(False, "disabled")
        pids = sorted({r.pid for r in scan.records}
                      | {p.pid for d in nv.devices for p in d.processes})
        infos = self.sampler.sample(pids, wait=cpu_sample_s)

        devices: dict[str, DeviceRow] = {}
        for d in nv.devices:
            name, uuid = d.name, d.uuid
            if d.error is None or uuid:
                self._known_devices[d.index] = (name, uuid)
            else:  # a lost device keeps the name and UUID it last answered with, for the labels
                name, uuid = self._known_devices.get(d.index, (name, uuid))
            devices[f"cuda:{d.index}"] = DeviceRow(
                f"cuda:{d.index}", d.index, uuid or None, name, "nvml", d.total_bytes, d.used_bytes,
                d.free_bytes, d.mig_enabled, error=d.error)
        rows: dict[tuple[int, str], ProcessRow] = {}
        for d in nv.devices:
            key = f"cuda:{d.index}"
            for p in d.processes:
                row = self._row(p.pid, devices[key], infos.get(p.pid))
                row.used_bytes = p.used_bytes
                row.sm_util = p.sm_util
                row.flags.no_proc = not p.in_our_pid_namespace
                rows[(p.pid, key)] = row
        for rec in scan.records:
            for dc in rec.devices:
                if dc.reserved_bytes == 0 and dc.last_alloc_unix_ns == 0:
                    continue  # device never used by this process
                dev = self._device_for(rec, dc.index, devices, nv)
                existing = rows.get((rec.pid, dev.device))
                if existing is None:
                    row = rows[(rec.pid, dev.device)] = self._row(rec.pid, dev, infos.get(rec.pid))
                    if row.command is None:
                        row.command = rec.command
                else:
                    row = existing
                row.allocator = AllocatorView(
                    dc.allocated_bytes, dc.reserved_bytes, dc.active_bytes, dc.cached_free_bytes,
                    dc.largest_free_bytes, dc.swapped_out_bytes, dc.peak_reserved_bytes,
                    dc.num_ooms, dc.num_alloc_retries, dc.last_alloc_unix_ns, rec.backend,
                    round(rec.heartbeat_age_s(), 3), rec.pressure_opt_in, rec.path, rec.uid)
                row.flags.stale_heartbeat = rec.heartbeat_age_s() > self.stale_heartbeat_s
                dev.allocator_reserved_bytes += dc.reserved_bytes
                dev.allocator_allocated_bytes += dc.allocated_bytes
        for row in rows.values():
            self._flag_idle(row, now)
        live_keys = set(rows)
        for idle_key in list(self._idle_since):
            if idle_key not in live_keys:
                del self._idle_since[idle_key]
        where = str(self.registry_dir or registry.registry_dir())
        health = registry.dir_health(where)
        return Snapshot(now, nv.available, nv.error,
                        sorted(devices.values(), key=lambda d: d.device),
                        sorted(rows.values(), key=lambda r: (r.device, r.pid)),
                        scan.skipped, removed, where, health.problem, health.free_bytes)

    def _device_for(self, rec: registry.Record, index: int, devices: dict[str, DeviceRow],
                    nv: nvml_collector.NvmlState) -> DeviceRow:
        if rec.backend == "cuda" and nv.available:
            visible = _visible_devices(rec.pid)
            target: str | None = str(index)
            if visible is not None:
                target = visible[index] if index < len(visible) else None
            for d in nv.devices:
                if target is not None and (target == str(d.index) or d.uuid.startswith(target)):
                    return devices[f"cuda:{d.index}"]
        key = f"{rec.backend}:{index}"
        if key not in devices:
            devices[key] = DeviceRow(key, index, None, None, "registry")
        return devices[key]

    def _row(self, pid: int, dev: DeviceRow, info: ProcInfo | None) -> ProcessRow:
        info = info or ProcInfo(pid, exists=False)
        row = ProcessRow(pid, dev.device, dev.gpu, dev.uuid, info.user, info.uid, info.command,
                         None, None, info.cpu_percent, info.status, info.ppid, info.create_time,
                         None, cpu_seconds=info.cpu_seconds)
        row.flags.zombie = info.zombie
        row.flags.orphan, row.flags.orphan_evidence = info.orphan(self.subreapers)
        row.flags.no_proc = not info.exists
        return row

    def _flag_idle(self, row: ProcessRow, now: float) -> None:
        """Idle: no SM activity (NVML says 0, or without NVML no allocation) and CPU under the threshold.

        The first time a row is seen idle, idle-since is backdated to the
        process's last allocation when the registry knows it, so a one-shot
        `gpumemd reap` can judge a window without history.
        """
        key = (row.pid, row.device)
        cpu_idle = row.cpu_percent is not None and row.cpu_percent < self.idle_cpu_percent
        if row.sm_util is not None:
            gpu_idle = row.sm_util == 0
        else:
            gpu_idle = row.allocator is not None  # judged by the last allocation below
        if not (cpu_idle and gpu_idle) or row.flags.zombie:
            self._idle_since.pop(key, None)
            return
        since = self._idle_since.get(key)
        if since is None:
            since = now
            if row.allocator is not None:
                last = row.allocator.last_alloc_unix_ns / 1e9
                since = min(now, max(last, row.start_time or 0.0)) if last else (row.start_time or now)
            self._idle_since[key] = since
        elif row.allocator is not None and row.allocator.last_alloc_unix_ns / 1e9 > since:
            since = self._idle_since[key] = row.allocator.last_alloc_unix_ns / 1e9  # it allocated
        row.flags.idle_since = since
