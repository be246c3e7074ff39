"""status --json, /metrics over loopback, and the reaper on real child processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

from pyalloc.gpumemd import pressure

from .conftest import Holders, env, gpumemd

MiB = 1 << 20


def test_status_json_reports_each_process_allocator_bytes(holders: Holders) -> None:
    a = holders.start("--allocated", str(3 * MiB), "--cached", str(5 * MiB))
    b = holders.start("--allocated", str(7 * MiB))
    out = gpumemd("status", "--json", "--no-nvml", reg=holders.reg_dir)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    procs = {p["pid"]: p for p in doc["processes"]}
    assert procs[a]["allocator"]["allocated_bytes"] == 3 * MiB
    assert procs[a]["allocator"]["reserved_bytes"] == 8 * MiB
    assert procs[a]["allocator"]["cached_bytes"] == 5 * MiB
    assert procs[b]["allocator"]["reserved_bytes"] == 7 * MiB
    assert procs[a]["device"] == "host:0" and procs[a]["used_bytes"] is None  # N/A, not 0
    assert [d["device"] for d in doc["devices"]] == ["host:0"]


def eventually(condition: Callable[[], bool], deadline_s: float = 60.0, poll_s: float = 0.05) -> None:
    """Waits until ``condition()`` holds. The deadline only stops a hang: the
    assertion is about the state reached, never about how fast (the machine
    may be loaded)."""
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, "the condition never held"
        time.sleep(poll_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, s.labels.get("pid", ""))] = s.value
    return out


def test_metrics_carry_values_and_a_dead_process_series_vanish(holders: Holders, tmp_path: Path) -> None:
    a = holders.start("--allocated", str(3 * MiB), "--cached", str(MiB))
    b = holders.start("--allocated", str(2 * MiB))
    port = _free_port()
    sock = str(tmp_path / "p.sock")
    d = subprocess.Popen([sys.executable, "-m", "pyalloc.gpumemd", "--registry-dir", str(holders.reg_dir),
                          "--no-nvml", "serve", "--listen", f"127.0.0.1:{port}", "--interval", "0.3s",
                          "--socket", sock], stdout=subprocess.PIPE, text=True, env=env())
    try:
        assert "listening" in (d.stdout.readline() if d.stdout else "")
        eventually(lambda: ("gpumemd_process_allocated_bytes", str(b)) in _scrape(port))
        m = _scrape(port)
        assert m[("gpumemd_up", "")] == 1.0
        assert m[("gpumemd_process_allocated_bytes", str(a))] == 3 * MiB
        assert m[("gpumemd_process_reserved_bytes", str(a))] == 4 * MiB
        assert m[("gpumemd_process_cached_bytes", str(a))] == MiB
        assert m[("gpumemd_process_allocated_bytes", str(b))] == 2 * MiB
        assert ("gpumemd_process_used_bytes", str(a)) not in m  # no NVML: absent, never 0
        holders.procs[1].kill()
        holders.procs[1].wait()  # reaped by its parent, as a shell would
        eventually(lambda: not any(pid == str(b) for _name, pid in _scrape(port)))
        assert not (holders.reg_dir / f"pyalloc.{os.getuid()}.{b}").exists()
        status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=5).read())
        assert {p["pid"] for p in status["processes"]} == {a}
        # pressure: a root peer asks for bytes; the opted-out holder is not asked.
        ans = pressure.request(sock, 0, MiB)
        assert ans["ok"] and ans["freed_bytes"] == 0 and ans["asked"] == []
    finally:
        d.terminate()
        d.wait(timeout=10)


# The CPU threshold leaves room for a loaded CI machine: an idle holder's
# trim thread wakes 50 times a second, and /proc counts CPU in 10 ms ticks, so
# a 1 s sample of it reads 0 to a few percent; the busy holder reads 50 to 100.
POLICY = """
grace_period = "2s"
cpu_sample = "1s"
[zombie]
enabled = true
[orphan]
enabled = true
[idle]
enabled = true
window = "2s"
cpu_percent = 20.0
min_bytes = "1MiB"
[stale_heartbeat]
enabled = false
[protect]
min_uid = 0
commands = ["--protect-me"]
"""


def test_reaper_dry_run_names_exactly_the_stale_ones_and_enforce_kills_only_them(
        holders: Holders, tmp_path: Path) -> None:
    big = str(4 * MiB)
    zombie = holders.start("--mode", "zombie", "--allocated", big, "--no-serve")
    orphan = holders.start("--mode", "orphan", "--allocated", big)
    idle = holders.start("--allocated", big, "--last-alloc-ago", "3600")
    busy = holders.start("--allocated", big, "--last-alloc-ago", "3600", "--busy")
    recent = holders.start("--allocated", big, "--allocating")  # little CPU, but allocating
    protected = holders.start("--allocated", big, "--last-alloc-ago", "3600", "--opt-in")
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY.replace("--protect-me", "holder.py.*--opt-in"))
    audit = tmp_path / "audit.jsonl"
    time.sleep(2.2)  # every holder is now older than the idle window
    out = gpumemd("reap", "--policy", str(policy), "--json", "--audit-log", str(audit), "--no-nvml",
                  reg=holders.reg_dir)
    assert out.returncode == 0, out.stderr
    decisions = {d["pid"]: d for d in json.loads(out.stdout)}
    assert set(decisions) == {zombie, orphan, idle, protected}
    assert (decisions[zombie]["criterion"], decisions[zombie]["action"]) == ("zombie", "report")
    assert (decisions[orphan]["criterion"], decisions[orphan]["action"]) == ("orphan", "kill")
    assert (decisions[idle]["criterion"], decisions[idle]["action"]) == ("idle", "kill")
    assert decisions[idle]["evidence"]["idle_s"] >= 2
    assert decisions[protected]["action"] == "protected"
    assert all(d["dry_run"] for d in decisions.values())
    assert len(audit.read_text().splitlines()) == 4
    for pid in (orphan, idle, busy, recent, protected):
        os.kill(pid, 0)  # the dry run killed nothing

    out = gpumemd("reap", "--policy", str(policy), "--json", "--enforce", "--audit-log", str(audit),
                  "--no-nvml", reg=holders.reg_dir)
    assert out.returncode == 0, out.stderr

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(")")[-1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    eventually(lambda: not alive(orphan) and not alive(idle))
    assert alive(busy) and alive(recent) and alive(protected)
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    assert all("evidence" in x for x in lines)
    assert [x["phase"] for x in lines].count("done") == 8
    # Each signal was announced in the log before it was sent: one line per killed process.
    announced = [(x["pid"], x["signal"]) for x in lines if x["phase"] == "signalling"]
    assert sorted(announced) == sorted([(orphan, "SIGTERM"), (idle, "SIGTERM")])
