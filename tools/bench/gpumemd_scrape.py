#!/usr/bin/env python3
"""The cost of /metrics: one scrape over many registered processes, and a burst of concurrent scrapes.

Publishes --procs real registry records (each of a live `sleep` process, counters on
--devices devices), starts ``gpumemd serve --no-nvml`` on them, and measures:

  render     the daemon's time to render the exposition of one snapshot (its own
             gpumemd_render_duration_seconds, best and median of --repeats snapshots);
  scrape     wall time of one GET /metrics over loopback once the snapshot is rendered;
  collect    the daemon's time for one collection of those records
             (gpumemd_collect_duration_seconds);
  burst      --concurrent scrapes started at once, each allowed 10 s: how many failed.

It also renders the same figures in-process from a snapshot built in memory, for
"256 processes, each on all 8 devices" (2048 rows) and "256 processes spread over
8 devices" (256 rows), without HTTP.

Targets (issue 21), printed as met or missed with the figure:
  render    one scrape over 256 processes on 8 devices under 20 ms of daemon time;
  burst     500 concurrent scrapes, none failing.

Usage: tools/bench/gpumemd_scrape.py [--procs 256] [--devices 8] [--concurrent 500] [--repeats 5] [--json FILE]
Exits 0 (targets missed are reported), or 1 with a one-line reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pyalloc.gpumemd import registry  # noqa: E402
from pyalloc.gpumemd.metrics import State  # noqa: E402
from pyalloc.gpumemd.model import AllocatorView, DeviceRow, ProcessRow, Snapshot  # noqa: E402

MiB = 1 << 20


def _value(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None  # no snapshot yet


def in_memory(procs: int, devices: int, spread: bool) -> dict[str, float]:
    """Render time of a snapshot built in memory: every process on every device, or spread."""
    now = time.time()
    devs = [DeviceRow(f"cuda:{i}", i, f"GPU-{i:08x}-0000-0000-0000-000000000000", "NVIDIA H100 80GB HBM3",
                      "nvml", 80 << 30, 40 << 30, 40 << 30, False, 1 << 30, 1 << 29) for i in range(devices)]
    rows = []
    for p in range(procs):
        for d in ([p % devices] if spread else range(devices)):
            a = AllocatorView(3 * MiB, 8 * MiB, 4 * MiB, 5 * MiB, 2 * MiB, 0, 9 * MiB, 0, 0, time.time_ns(), "cuda",
                              0.1, True)
            rows.append(ProcessRow(100000 + p, f"cuda:{d}", d, devs[d].uuid, "alice", 1000, "python train.py",
                                   12 * MiB, 50, 99.0, "running", 1, now, a, cpu_seconds=12.5))
    times, cpu = [], []
    for _ in range(9):
        state = State()
        state.set(Snapshot(now, True, None, devs, rows, [], []), 0.1)
        start, start_cpu = time.perf_counter(), time.thread_time()
        body = state.exposition()
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    cached = time.perf_counter()
    state.exposition()
    return {"rows": len(rows), "render_ms_best": min(times) * 1e3, "render_ms_median": statistics.median(times) * 1e3,
            "render_cpu_ms_median": statistics.median(cpu) * 1e3,
            "cached_scrape_ms": (time.perf_counter() - cached) * 1e3, "body_bytes": len(body)}


def publish(reg: Path, procs: int, devices: int) -> list[subprocess.Popen[bytes]]:
    sleepers = []
    for i in range(procs):
        s = subprocess.Popen(["sleep", "3600"])
        sleepers.append(s)
        w = registry.RecordWriter(registry.record_path(s.pid, directory=reg), pid=s.pid, backend="host")
        for d in range(devices):
            w.update(d, reserved_bytes=(8 + i % 7) * MiB, allocated_bytes=3 * MiB, active_bytes=4 * MiB,
                     cached_free_bytes=5 * MiB, largest_free_bytes=2 * MiB, peak_reserved_bytes=16 * MiB,
                     last_alloc_unix_ns=time.time_ns())
        w.close(unlink=False)
    return sleepers


def burst(port: int, n: int) -> dict[str, Any]:
    """``n`` scrapes started together (a barrier), each given 10 s."""
    gate = threading.Barrier(n)
    failures: list[str] = []
    latencies: list[float] = []
    lock = threading.Lock()

    def one() -> None:
        gate.wait()
        start = time.perf_counter()
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            ok = body.endswith(b"\n") and b"gpumemd_up 1" in body
            with lock:
                latencies.append(time.perf_counter() - start)
                if not ok:
                    failures.append("truncated or empty body")
        except Exception as e:  # noqa: BLE001 - every failure is counted, whatever it is
            with lock:
                failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"scrapes": n, "failed": len(failures), "failures": failures[:5],
            "latency_ms_median": statistics.median(latencies) * 1e3 if latencies else None,
            "latency_ms_max": max(latencies) * 1e3 if latencies else None}


def live(procs: int, devices: int, concurrent: int, repeats: int) -> dict[str, Any]:
    top = Path(tempfile.mkdtemp(prefix="gpumemd-scrape-"))
    reg = top / "registry"
    reg.mkdir()
    sleepers = publish(reg, procs, devices)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    daemon = subprocess.Popen([sys.executable, "-m", "pyalloc.gpumemd", "--registry-dir", str(reg), "--no-nvml",
                               "serve", "--listen", "127.0.0.1:0", "--interval", "1s", "--socket", "none"],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert daemon.stdout is not None
        port = int(json.loads(daemon.stdout.readline())["metrics"].rsplit(":", 1)[1].split("/")[0])
        url = f"http://127.0.0.1:{port}/metrics"
        renders, collects, scrapes = [], [], []
        last = None
        while len(renders) < repeats:
            text = urllib.request.urlopen(url, timeout=30).read().decode()
            stamp = _value(text, "gpumemd_last_collect_timestamp_seconds")
            rows = sum(1 for line in text.splitlines() if line.startswith("gpumemd_process_reserved_bytes{"))
            render, collect = _value(text, "gpumemd_render_duration_seconds"), \
                _value(text, "gpumemd_collect_duration_seconds")
            if stamp is not None and stamp != last and rows == procs * devices and render and collect:
                last = stamp
                renders.append(render)
                collects.append(collect)
                start = time.perf_counter()
                urllib.request.urlopen(url, timeout=30).read()  # the same snapshot: already rendered
                scrapes.append(time.perf_counter() - start)
            time.sleep(0.3)
        out: dict[str, Any] = {
            "rows": procs * devices, "render_ms_best": min(renders) * 1e3,
            "render_ms_median": statistics.median(renders) * 1e3,
            "collect_ms_median": statistics.median(collects) * 1e3,
            "scrape_ms_median": statistics.median(scrapes) * 1e3}
        out["burst"] = burst(port, concurrent)
        return out
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)
        for s in sleepers:
            s.kill()
            s.wait()
        shutil.rmtree(top, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=256, help="registered processes (default: 256)")
    p.add_argument("--devices", type=int, default=8, help="devices each process has counters on (default: 8)")
    p.add_argument("--concurrent", type=int, default=500, help="scrapes in the burst (default: 500)")
    p.add_argument("--repeats", type=int, default=5, help="snapshots whose render time is read (default: 5)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args()
    try:
        result = {"in_memory_all_devices": in_memory(args.procs, args.devices, spread=False),
                  "in_memory_spread": in_memory(args.procs, args.devices, spread=True),
                  "live": live(args.procs, args.devices, args.concurrent, args.repeats)}
    except (OSError, RuntimeError) as e:
        print(f"gpumemd_scrape: {e}", file=sys.stderr)
        return 1
    a, s, lv = result["in_memory_all_devices"], result["in_memory_spread"], result["live"]
    b = lv["burst"]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: wall times include waiting for a CPU, "
          f"CPU times do not")
    print(f"in memory, {a['rows']} rows ({args.procs} processes x {args.devices} devices): render "
          f"{a['render_ms_best']:.1f} ms best, {a['render_ms_median']:.1f} ms median wall, "
          f"{a['render_cpu_ms_median']:.1f} ms median CPU, {a['body_bytes']} bytes; "
          f"a scrape of the rendered snapshot {a['cached_scrape_ms']:.3f} ms")
    print(f"in memory, {s['rows']} rows ({args.procs} processes spread over {args.devices} devices): render "
          f"{s['render_ms_best']:.1f} ms best, {s['render_ms_median']:.1f} ms median wall, "
          f"{s['render_cpu_ms_median']:.1f} ms median CPU")
    print(f"live daemon, {lv['rows']} rows: render {lv['render_ms_best']:.1f} ms best, {lv['render_ms_median']:.1f} ms "
          f"median; collection {lv['collect_ms_median']:.0f} ms; scrape over loopback {lv['scrape_ms_median']:.1f} ms")
    cpu = a["render_cpu_ms_median"]
    print(f"target < 20 ms of daemon time for a scrape over {args.procs} processes on {args.devices} devices "
          f"(each on every device): {'met' if cpu < 20 else 'MISSED'} ({cpu:.1f} ms median CPU to render, once per "
          f"snapshot; {a['cached_scrape_ms']:.3f} ms for each further scrape of it)")
    print(f"burst: {b['scrapes']} concurrent scrapes, {b['failed']} failed, latency median "
          f"{b['latency_ms_median']:.0f} ms, max {b['latency_ms_max']:.0f} ms: "
          f"{'met' if b['failed'] == 0 else 'MISSED'} {b['failures'][:2] if b['failures'] else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
