#!/usr/bin/env python3
"""The gpumemd soak: many pyalloc processes churning while the daemon polls, serves and coordinates.

Starts ``gpumemd serve --no-nvml`` on a private registry folder, polling every
--interval (default 100 ms: 10 Hz), then --procs real pyalloc processes (the
library on the host backend, pressure opt-in) that allocate and free blocks
of 64 KiB to 4 MiB in bursts, and for --duration:

  - asks the pressure socket for bytes every --pressure-every (as this user);
  - every --respawn-every, SIGKILLs one churner (its record stays behind for the
    daemon to remove) and starts a new one, so pids and records turn over;
  - samples the daemon's resident memory (VmRSS) every 5 s and scrapes /metrics.

Then it ends the churners (half exit normally, half are SIGKILLed), waits for the
daemon's next passes and counts the records left in the folder.

Targets (issue 21), printed as met or missed with the figure:
  memory    the daemon's RSS at the end within 10% of its RSS once every churner
            had registered (first sample after --warmup);
  requests  no pressure request lost (every one answered with ok true);
  records   no record left in the registry folder after the churners are gone.

Usage: tools/bench/gpumemd_soak.py [--procs 64] [--duration 10m] [--interval 100ms]
           [--pressure-every 1s] [--respawn-every 5s] [--warmup 30s] [--lib PATH] [--json FILE]
The library is $PYALLOC_LIBRARY or --lib. Exits 0 (targets missed are reported), or 1 with a
one-line reason.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pyalloc.gpumemd import pressure  # noqa: E402
from pyalloc.gpumemd.units import parse_duration  # noqa: E402

CHURNER = r"""
import os, random, sys, threading, time
import pyalloc
pyalloc.configure("backend=host,capacity=64MiB,pressure_opt_in=1,oom_report=0")
rng = random.Random(os.getpid())
live = []
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("ready", flush=True)
while not stop.is_set():
    for _ in range(rng.randint(1, 16)):
        if live and (len(live) > 8 or rng.random() < 0.5):
            ptr, size = live.pop(rng.randrange(len(live)))
            pyalloc.free(ptr, size)
        else:
            size = rng.choice((64 << 10, 256 << 10, 1 << 20, 4 << 20))
            try:
                live.append((pyalloc.malloc(size), size))
            except pyalloc.PyallocError:
                pass
    stop.wait(rng.uniform(0.02, 0.1))
for ptr, size in live:
    pyalloc.free(ptr, size)
"""


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Churners:
    def __init__(self, reg: Path, env: dict[str, str]) -> None:
        self.reg, self.env = reg, env
        self.procs: list[subprocess.Popen[str]] = []
        self.killed = 0

    def start(self) -> None:
        p = subprocess.Popen([sys.executable, "-c", CHURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=self.env, preexec_fn=lambda: os.nice(5))
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a churner did not start (exit {p.wait()})")
        self.procs.append(p)

    def respawn_one(self, rng: random.Random) -> None:
        victim = self.procs.pop(rng.randrange(len(self.procs)))
        victim.kill()
        victim.wait()
        self.killed += 1
        self.start()

    def end(self) -> None:
        """Half leave normally (their library unlinks the record), half are SIGKILLed (the daemon must)."""
        for i, p in enumerate(self.procs):
            if i % 2:
                p.kill()
                self.killed += 1
            elif p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            p.wait(timeout=60)


def scrape(port: int) -> int:
    """The number of processes /metrics shows (series of gpumemd_process_reserved_bytes)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(1 for line in text.splitlines() if line.startswith("gpumemd_process_reserved_bytes{"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    lib = args.lib or os.environ.get("PYALLOC_LIBRARY")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if lib:
        env["PYALLOC_LIBRARY"] = lib
    top = Path(tempfile.mkdtemp(prefix="gpumemd-soak-"))
    reg = top / "registry"
    reg.mkdir()
    env["PYALLOC_REGISTRY_DIR"] = str(reg)
    sock = str(top / "run" / "gpumemd.sock")
    log_path = top / "gpumemd.log"
    daemon = subprocess.Popen([sys.executable, "-m", "pyalloc.gpumemd", "--registry-dir", str(reg), "--no-nvml",
                               "serve", "--listen", "127.0.0.1:0", "--interval", args.interval, "--socket", sock],
                              stdout=subprocess.PIPE, text=True, env=env)
    assert daemon.stdout is not None
    first = json.loads(daemon.stdout.readline())
    port = int(first["metrics"].rsplit(":", 1)[1].split("/")[0])
    log_file = open(log_path, "w")
    import threading
    threading.Thread(target=lambda: [log_file.write(line) for line in daemon.stdout], daemon=True).start()  # type: ignore[union-attr]
    churners = Churners(reg, env)
    rng = random.Random(21)
    result: dict[str, Any] = {"procs": args.procs, "duration_s": parse_duration(args.duration),
                              "interval": args.interval, "rss_samples": [], "log": str(log_path)}
    try:
        for _ in range(args.procs):
            churners.start()
        t0 = time.monotonic()
        end = t0 + parse_duration(args.duration)
        next_pressure = next_respawn = next_sample = t0
        asked = answered = 0
        errors: list[str] = []
        seen: list[int] = []
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_pressure:
                next_pressure += parse_duration(args.pressure_every)
                asked += 1
                try:
                    answer = pressure.request(sock, 0, 8 << 20, timeout=10.0)
                    if answer.get("ok"):
                        answered += 1
                    else:
                        errors.append(str(answer.get("error")))
                except (OSError, ValueError) as e:
                    errors.append(f"{type(e).__name__}: {e}")
            if now >= next_respawn and args.respawn_every != "0":
                next_respawn += parse_duration(args.respawn_every)
                if now > t0:
                    churners.respawn_one(rng)
            if now >= next_sample:
                next_sample += 5.0
                result["rss_samples"].append((round(now - t0, 1), rss_bytes(daemon.pid)))
                seen.append(scrape(port))
            time.sleep(0.05)
        churners.end()
        deadline = time.monotonic() + 30
        left = list(reg.glob("pyalloc.*"))
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = list(reg.glob("pyalloc.*"))
        time.sleep(1.0)  # the daemon's last lines
        log_file.flush()
        warm = [r for t, r in result["rss_samples"] if t >= parse_duration(args.warmup)] or \
            [r for _t, r in result["rss_samples"]]
        result.update(requests_asked=asked, requests_answered=answered, request_errors=errors[:10],
                      requests_lost=asked - answered, processes_killed=churners.killed,
                      processes_seen_min=min(seen) if seen else 0, processes_seen_max=max(seen) if seen else 0,
                      records_left=[p.name for p in left], rss_start_bytes=warm[0], rss_end_bytes=warm[-1],
                      rss_max_bytes=max(warm), daemon_alive=daemon.poll() is None,
                      log_lines=sum(1 for _ in open(log_path)), log_events=_events(log_path))
        result["rss_change"] = round(result["rss_end_bytes"] / result["rss_start_bytes"] - 1, 4)
        return result
    finally:
        for p in churners.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log_file.close()
        shutil.rmtree(reg, ignore_errors=True)  # the daemon's log stays, in result["log"]


def _events(path: Path) -> dict[str, int]:
    """How many lines of each event the daemon logged; a line that is not JSON counts as "not-json"."""
    counts: dict[str, int] = {}
    for line in open(path):
        try:
            kind = str(json.loads(line)["event"])
        except (ValueError, KeyError, TypeError):
            kind = "not-json"
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def report(r: dict[str, Any]) -> str:
    mib = 1 << 20
    flat = abs(r["rss_change"]) <= 0.10
    lines = [
        f"gpumemd soak: {r['procs']} churning processes, {r['duration_s']:.0f} s, polling every {r['interval']}, "
        f"{r['processes_killed']} processes SIGKILLed along the way",
        f"  memory    RSS {r['rss_start_bytes'] / mib:.1f} MiB after warm-up -> {r['rss_end_bytes'] / mib:.1f} MiB "
        f"at the end ({r['rss_change']:+.1%}; max {r['rss_max_bytes'] / mib:.1f} MiB): "
        f"{'met' if flat else 'MISSED'} (within 10%)",
        f"  requests  {r['requests_answered']} of {r['requests_asked']} pressure requests answered ok, "
        f"{r['requests_lost']} lost: {'met' if r['requests_lost'] == 0 else 'MISSED'}",
        f"  records   {len(r['records_left'])} left after the churners ended: "
        f"{'met' if not r['records_left'] else 'MISSED'}",
        f"  /metrics  showed {r['processes_seen_min']}..{r['processes_seen_max']} processes; daemon alive at the end: "
        f"{r['daemon_alive']}; {r['log_lines']} log lines {r['log_events']}",
    ]
    lines.append(f"  the daemon's log: {r['log']}")
    if r["request_errors"]:
        lines.append(f"  first request errors: {r['request_errors'][:3]}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=64, help="churning pyalloc processes (default: 64)")
    p.add_argument("--duration", default="10m", help="how long they churn (default: 10m)")
    p.add_argument("--interval", default="100ms", help="gpumemd serve --interval (default: 100ms, 10 Hz)")
    p.add_argument("--pressure-every", default="1s", help="time between pressure requests (default: 1s)")
    p.add_argument("--respawn-every", default="5s",
                   help="time between SIGKILL-and-replace of one churner; 0 for none (default: 5s)")
    p.add_argument("--warmup", default="30s", help="RSS is compared from the first sample after this (default: 30s)")
    p.add_argument("--lib", default=None, help="libpyalloc.so (default: $PYALLOC_LIBRARY)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args()
    try:
        r = run(args)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"gpumemd_soak: {e}", file=sys.stderr)
        return 1
    print(report(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
