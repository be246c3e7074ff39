"""Prometheus exposition and the HTTP endpoints of `gpumemd serve`.

The exposition is rendered from the latest snapshot, so a process's series
disappear as soon as it does (a Gauge with labels would keep them until
someone removed them). Labels `gpu` and `UUID` are spelled as dcgm-exporter
spells them, so `on(gpu, UUID)` joins the two exporters. Units follow
Prometheus's conventions: bytes, seconds, ratios 0..1, counters end in
`_total`. dcgm-exporter's frame-buffer figures (DCGM_FI_DEV_FB_USED, ...) are
MiB: multiply them by 1048576 before comparing with our `_bytes`.

Note [One rendering per snapshot]: a scrape over 256 processes on 8 devices
is tens of thousands of samples, too slow for prometheus_client's generic
path (0.2 s here) and wasteful when many scrapers ask for the same snapshot.
The text is rendered here directly, once per snapshot, by the first scrape
that asks for it (the collecting loop pays nothing when no one scrapes); the
other scrapes of that snapshot send the same bytes. tests/gpumemd checks the
text against prometheus_client's parser.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .events import EventLog, silent
from .model import DeviceRow, ProcessRow, Snapshot, redact_command

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LISTEN_BACKLOG = 1024  # connections the kernel queues for accept(): a burst of scrapers is not refused
HTTP_IDLE_TIMEOUT_S = 10.0  # a client that connects and says nothing is dropped

# (AllocatorView field, metric name after gpumemd_process_, help): one gauge each, in bytes.
_ALLOCATOR_GAUGES = [
    ("allocated_bytes", "allocated_bytes", "Bytes handed out by the process's pyalloc allocator."),
    ("reserved_bytes", "reserved_bytes", "Bytes the allocator holds from the device (allocated + cached)."),
    ("active_bytes", "active_bytes", "Bytes in blocks in use, rounded to block sizes."),
    ("cached_bytes", "cached_bytes", "Free bytes cached by the allocator: reclaimable by a trim."),
    ("largest_free_bytes", "largest_free_bytes", "Largest free block in the allocator's cache."),
    ("swapped_out_bytes", "swapped_out_bytes", "Bytes swapped out to host memory by the offload manager."),
    ("peak_reserved_bytes", "peak_reserved_bytes", "Peak of reserved bytes."),
]
_FLAGS = ("zombie", "orphan", "stale_heartbeat", "no_proc")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: list[tuple[str, str]]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _number(value: float | int) -> str:
    """The exposition's spelling of a value: integers as they are, floats by repr, +Inf/-Inf/NaN."""
    if isinstance(value, int):
        return str(int(value))  # int(): a bool would print True
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Family:
    """One metric family: its HELP and TYPE lines, then one line a sample (possibly none)."""

    def __init__(self, name: str, help_text: str, kind: str = "gauge") -> None:
        self.name, self.help, self.kind = name, help_text, kind
        self.lines: list[str] = []

    def add(self, labels: str, value: float | int) -> None:
        self.lines.append(f"{self.name}{labels} {_number(value)}")  # lines end in "<value>", no newline

    def text(self) -> str:
        head = f"# HELP {self.name} {self.help}\n# TYPE {self.name} {self.kind}\n"
        return head + "".join(("\n".join(self.lines), "\n")) if self.lines else head


def _scalar(name: str, help_text: str, value: float | int) -> _Family:
    f = _Family(name, help_text)
    f.add("", value)
    return f


def _device_families(devices: list[DeviceRow]) -> list[_Family]:
    fams = {n: _Family(f"gpumemd_device_{n}", h) for n, h in [
        ("up", "1 when NVML answered for the device in the last poll; 0 when it failed (lost, timed out)."),
        ("total_bytes", "Device memory (NVML)."), ("used_bytes", "Used device memory (NVML)."),
        ("free_bytes", "Free device memory (NVML)."),
        ("pyalloc_reserved_bytes", "Sum of reserved bytes of pyalloc processes on the device."),
        ("pyalloc_allocated_bytes", "Sum of allocated bytes of pyalloc processes on the device.")]}
    for d in devices:
        labels = _labels([("UUID", d.uuid or ""), ("backend", d.device.split(":")[0]), ("gpu", str(d.gpu))])
        if d.source == "nvml":
            fams["up"].add(labels, 0 if d.error else 1)
        for name, value in (("total_bytes", d.total_bytes), ("used_bytes", d.used_bytes),
                            ("free_bytes", d.free_bytes),
                            ("pyalloc_reserved_bytes", d.allocator_reserved_bytes),
                            ("pyalloc_allocated_bytes", d.allocator_allocated_bytes)):
            if value is not None:  # N/A is an absent series, never a zero
                fams[name].add(labels, value)
    return list(fams.values())


def _process_families(processes: list[ProcessRow], now: float) -> list[_Family]:
    """The per-process families: the hot loop of a scrape (tens of thousands of lines on a big
    node), so each row's label text is built once and lines are appended without calls."""
    used = _Family("gpumemd_process_used_bytes", "Device memory the driver charges the process (NVML).")
    alloc = [(key, _Family(f"gpumemd_process_{name}", h)) for key, name, h in _ALLOCATOR_GAUGES]
    ooms = _Family("gpumemd_process_ooms_total", "Out-of-memory failures of the allocator.", "counter")
    hb = _Family("gpumemd_process_heartbeat_age_seconds", "Seconds since the process's registry heartbeat.")
    sm = _Family("gpumemd_process_sm_utilization_ratio", "SM utilization of the process, 0..1 (NVML).")
    cpu = _Family("gpumemd_process_cpu_seconds_total",
                  "CPU time (user + system) the process used since it started, in seconds (psutil); "
                  "rate() of it is the CPU use in cores.", "counter")
    idle = _Family("gpumemd_process_idle_seconds",
                   "Seconds the process has been idle (no SM use, CPU under threshold).")
    flags = _Family("gpumemd_process_flag", "1 when the process has the flag.")
    alloc_out = [(key, f.name, f.lines.append) for key, f in alloc]
    for p in processes:
        uuid, backend, user = _escape(p.uuid or ""), _escape(p.device.split(":")[0]), _escape(p.user or "")
        head = f'UUID="{uuid}",backend="{backend}"'
        tail = f'gpu="{p.gpu}",pid="{p.pid}",user="{user}"'
        labels = "{" + head + "," + tail + "} "
        if p.used_bytes is not None:
            used.lines.append(f"{used.name}{labels}{p.used_bytes}")
        if p.sm_util is not None:
            sm.lines.append(f"{sm.name}{labels}{p.sm_util / 100.0!r}")
        if p.cpu_seconds is not None:
            cpu.lines.append(f"{cpu.name}{labels}{round(p.cpu_seconds, 2)!r}")
        if p.flags.idle_since is not None:
            idle.lines.append(f"{idle.name}{labels}{max(0.0, now - p.flags.idle_since)!r}")
        for name in _FLAGS:
            if getattr(p.flags, name):
                flags.lines.append(f'{flags.name}{{{head},flag="{name}",{tail}}} 1')
        a = p.allocator
        if a is not None:
            for key, name, append in alloc_out:
                append(f"{name}{labels}{getattr(a, key)}")
            ooms.lines.append(f"{ooms.name}{labels}{a.num_ooms}")
            hb.lines.append(f"{hb.name}{labels}{float(a.heartbeat_age_s)!r}")
    return [used, *(f for _k, f in alloc), ooms, hb, sm, cpu, idle, flags]


def render(snap: Snapshot | None, stats: dict[str, float]) -> bytes:
    """The whole exposition for ``snap`` (Note [One rendering per snapshot])."""
    fams = [_scalar("gpumemd_up", "1 when the last collection succeeded.", 1 if snap is not None else 0),
            _scalar("gpumemd_collect_duration_seconds", "Seconds the last collection (NVML, registry, psutil) took.",
                    float(stats.get("collect_duration_s", 0.0)))]
    if snap is not None:
        fams += [
            _scalar("gpumemd_nvml_up", "1 when NVML answered; 0 in registry-only mode.", 1 if snap.nvml_available else 0),
            _scalar("gpumemd_registry_skipped_records", "Registry files skipped as invalid or not ours.",
                    len(snap.skipped_records)),
            _scalar("gpumemd_registry_up", "1 when pyalloc processes can publish records in the registry folder; "
                    "0 when it is missing, read-only or full (gpumemd status says which).",
                    0 if snap.registry_problem else 1),
            _scalar("gpumemd_last_collect_timestamp_seconds", "Unix time of the snapshot served.", snap.time)]
        if snap.registry_free_bytes is not None:
            fams.append(_scalar("gpumemd_registry_free_bytes", "Space left in the registry folder's file system.",
                                snap.registry_free_bytes))
        fams += _device_families(snap.devices)
        fams += _process_families(snap.processes, snap.time)
    return "".join(f.text() for f in fams).encode()


class State:
    """The latest snapshot, shared by the collecting loop and the HTTP threads, and its
    exposition once rendered (Note [One rendering per snapshot])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()
        self.snapshot: Snapshot | None = None
        self.stats: dict[str, float] = {}
        self.reap: list[dict] = []
        self._generation = 0
        self._exposition: tuple[int, bytes] | None = None

    def set(self, snap: Snapshot, duration_s: float, reap: list[dict] | None = None) -> None:
        with self._lock:
            self.snapshot = snap
            self.stats = {"collect_duration_s": duration_s}
            if reap is not None:
                self.reap = reap
            self._generation += 1

    def get(self) -> Snapshot | None:
        with self._lock:
            return self.snapshot

    def get_stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self.stats)

    def exposition(self) -> bytes:
        """The /metrics body of the latest snapshot, rendered by the first caller that needs it."""
        with self._render_lock:
            with self._lock:
                generation, snap, stats = self._generation, self.snapshot, dict(self.stats)
            if self._exposition is not None and self._exposition[0] == generation:
                return self._exposition[1]
            start = time.perf_counter()
            body = render(snap, stats)
            took = time.perf_counter() - start
            body += _scalar("gpumemd_render_duration_seconds",
                            "Seconds the daemon took to render this exposition (once per snapshot; "
                            "every scrape of the snapshot is sent the same text).", took).text().encode()
            self._exposition = (generation, body)
            return body


def _redacted(decision: dict) -> dict:
    doc = json.loads(json.dumps(decision, default=str))
    evidence = doc.get("evidence") or {}
    if "command" in evidence:
        evidence["command"] = redact_command(evidence["command"])
    evidence.pop("records", None)
    return doc


class MetricsServer(ThreadingHTTPServer):
    """One thread a connection, a deep accept queue, and one log line (never a traceback) for a
    client that hangs up, stalls or resets: a scraper's behaviour is not the daemon's error."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    log: EventLog = silent()

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        err = sys.exc_info()[1]
        peer = f"{client_address[0]}:{client_address[1]}" if isinstance(client_address, tuple) else str(client_address)
        if isinstance(err, (OSError, TimeoutError)):
            self.log.limited("http-client-error", client_address[0] if isinstance(client_address, tuple) else peer,
                             peer=peer, error=f"{type(err).__name__}: {err}")
        else:  # our own bug: still one line, with where it happened
            tb = err.__traceback__ if err is not None else None
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"
            self.log("http-error", peer=peer, error=f"{type(err).__name__}: {err}", where=where)


def make_server(state: State, host: str, port: int, show_commands: bool = False,
                log: EventLog | None = None) -> MetricsServer:
    """/metrics and /v1/status on host:port. /v1/status shows programs' names, not their
    command lines, unless ``show_commands`` (gpumemd serve --show-commands)."""

    class Handler(BaseHTTPRequestHandler):
        timeout = HTTP_IDLE_TIMEOUT_S
        protocol_version = "HTTP/1.0"

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, ctype = state.exposition(), CONTENT_TYPE
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

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("Server", (MetricsServer,), {"address_family": family, "log": log or silent()})
    return server_class((host, port), Handler)
