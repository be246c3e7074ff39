"""Prometheus exposition and the HTTP endpoints of `gpumemd serve`.

A custom collector renders the latest snapshot on each scrape, so a process's
series disappear as soon as it does (a Gauge with labels would keep them
until someone removed them). Labels `gpu` and `UUID` are spelled as
dcgm-exporter spells them, so `on(gpu, UUID)` joins the two exporters.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from .model import Snapshot, redact_command

PROCESS_LABELS = ["gpu", "UUID", "backend", "pid", "user"]
DEVICE_LABELS = ["gpu", "UUID", "backend"]

_ALLOCATOR_GAUGES = [
    ("allocated_bytes", "allocated_bytes", "Bytes handed out by the process's pyalloc allocator."),
    ("reserved_bytes", "reserved_bytes", "Bytes the allocator holds from the device (allocated + cached)."),
    ("active_bytes", "active_bytes", "Bytes in blocks in use, rounded to block sizes."),
    ("cached_bytes", "cached_bytes", "Free bytes cached by the allocator: reclaimable by a trim."),
    ("largest_free_bytes", "largest_free_bytes", "Largest free block in the allocator's cache."),
    ("swapped_out_bytes", "swapped_out_bytes", "Bytes swapped out to host memory by the offload manager."),
    ("peak_reserved_bytes", "peak_reserved_bytes", "Peak of reserved bytes."),
]


class SnapshotCollector(Collector):
    """Yields the families of whatever snapshot ``get`` returns at scrape time."""

    def __init__(self, get: Callable[[], Snapshot | None], stats: Callable[[], dict[str, float]]) -> None:
        self._get = get
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        start = time.perf_counter()
        snap = self._get()
        up = GaugeMetricFamily("gpumemd_up", "1 when the last collection succeeded.")
        up.add_metric([], 1.0 if snap is not None else 0.0)
        yield up
        stats = self._stats()
        yield GaugeMetricFamily("gpumemd_collect_duration_seconds",
                                "Seconds the last collection (NVML, registry, psutil) took.",
                                value=stats.get("collect_duration_s", 0.0))
        if snap is None:
            return
        nv = GaugeMetricFamily("gpumemd_nvml_up", "1 when NVML answered; 0 in registry-only mode.")
        nv.add_metric([], 1.0 if snap.nvml_available else 0.0)
        yield nv
        yield GaugeMetricFamily("gpumemd_registry_skipped_records",
                                "Registry files skipped as invalid or not ours.",
                                value=len(snap.skipped_records))
        yield GaugeMetricFamily("gpumemd_last_collect_timestamp_seconds",
                                "Unix time of the snapshot served.", value=snap.time)

        dev_fams = {n: GaugeMetricFamily(f"gpumemd_device_{n}", h, labels=DEVICE_LABELS) for n, h in [
            ("total_bytes", "Device memory (NVML)."), ("used_bytes", "Used device memory (NVML)."),
            ("free_bytes", "Free device memory (NVML)."),
            ("pyalloc_reserved_bytes", "Sum of reserved bytes of pyalloc processes on the device."),
            ("pyalloc_allocated_bytes", "Sum of allocated bytes of pyalloc processes on the device.")]}
        for d in snap.devices:
            labels = [str(d.gpu), d.uuid or "", d.device.split(":")[0]]
            for name, value in (("total_bytes", d.total_bytes), ("used_bytes", d.used_bytes),
                                ("free_bytes", d.free_bytes),
                                ("pyalloc_reserved_bytes", d.allocator_reserved_bytes),
                                ("pyalloc_allocated_bytes", d.allocator_allocated_bytes)):
                if value is not None:  # N/A is an absent series, never a zero
                    dev_fams[name].add_metric(labels, float(value))
        yield from dev_fams.values()

        used = GaugeMetricFamily("gpumemd_process_used_bytes",
                                 "Device memory the driver charges the process (NVML).", labels=PROCESS_LABELS)
        alloc = {key: GaugeMetricFamily(f"gpumemd_process_{name}", h, labels=PROCESS_LABELS)
                 for key, name, h in _ALLOCATOR_GAUGES}
        ooms = CounterMetricFamily("gpumemd_process_ooms", "Out-of-memory failures of the allocator.",
                                   labels=PROCESS_LABELS)
        hb = GaugeMetricFamily("gpumemd_process_heartbeat_age_seconds",
                               "Seconds since the process's registry heartbeat.", labels=PROCESS_LABELS)
        sm = GaugeMetricFamily("gpumemd_process_sm_utilization_ratio",
                               "SM utilization of the process, 0..1 (NVML).", labels=PROCESS_LABELS)
        cpu = GaugeMetricFamily("gpumemd_process_cpu_ratio",
                                "CPU use of the process in cores (psutil).", labels=PROCESS_LABELS)
        idle = GaugeMetricFamily("gpumemd_process_idle_seconds",
                                 "Seconds the process has been idle (no SM use, CPU under threshold).",
                                 labels=PROCESS_LABELS)
        flags = GaugeMetricFamily("gpumemd_process_flag", "1 when the process has the flag.",
                                  labels=PROCESS_LABELS + ["flag"])
        for p in snap.processes:
            labels = [str(p.gpu), p.uuid or "", p.device.split(":")[0], str(p.pid), p.user or ""]
            if p.used_bytes is not None:
                used.add_metric(labels, float(p.used_bytes))
            if p.sm_util is not None:
                sm.add_metric(labels, p.sm_util / 100.0)
            if p.cpu_percent is not None:
                cpu.add_metric(labels, p.cpu_percent / 100.0)
            if p.flags.idle_since is not None:
                idle.add_metric(labels, max(0.0, snap.time - p.flags.idle_since))
            for name in ("zombie", "orphan", "stale_heartbeat", "no_proc"):
                if getattr(p.flags, name):
                    flags.add_metric(labels + [name], 1.0)
            a = p.allocator
            if a is not None:
                for key, _name, _h in _ALLOCATOR_GAUGES:
                    alloc[key].add_metric(labels, float(getattr(a, key)))
                ooms.add_metric(labels, float(a.num_ooms))
                hb.add_metric(labels, a.heartbeat_age_s)
        yield used
        yield from alloc.values()
        yield from (ooms, hb, sm, cpu, idle, flags)
        yield GaugeMetricFamily("gpumemd_scrape_duration_seconds",
                                "Seconds this scrape took to render.", value=time.perf_counter() - start)


class State:
    """The latest snapshot, shared by the collecting loop and the HTTP threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.snapshot: Snapshot | None = None
        self.stats: dict[str, float] = {}
        self.reap: list[dict] = []

    def set(self, snap: Snapshot, duration_s: float, reap: list[dict] | None = None) -> None:
        with self._lock:
            self.snapshot = snap
            self.stats = {"collect_duration_s": duration_s}
            if reap is not None:
                self.reap = reap

    def get(self) -> Snapshot | None:
        with self._lock:
            return self.snapshot

    def get_stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self.stats)


def _redacted(decision: dict) -> dict:
    doc = json.loads(json.dumps(decision, default=str))
    evidence = doc.get("evidence") or {}
    if "command" in evidence:
        evidence["command"] = redact_command(evidence["command"])
    evidence.pop("records", None)
    return doc


def make_server(state: State, host: str, port: int, show_commands: bool = False) -> ThreadingHTTPServer:
    """/metrics and /v1/status on host:port. /v1/status shows programs' names, not their
    command lines, unless ``show_commands`` (gpumemd serve --show-commands)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(state.get, state.get_stats))

    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # a client that connects and says nothing is dropped

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, ctype = generate_latest(registry), CONTENT_TYPE_LATEST
            elif path == "/v1/status":
                snap = state.get()
                doc: dict[str, Any] = snap.to_json(full=show_commands) if snap else {"error": "no snapshot yet"}
                doc["reaper"] = state.reap if show_commands else [_redacted(d) for d in state.reap]
                body, ctype = json.dumps(doc).encode(), "application/json"
            elif path in ("/", "/healthz"):
                body, ctype = b"gpumemd: /metrics /v1/status\n", "text/plain"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: object) -> None:
            pass  # scrapes every few seconds would flood the journal

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
