"""The daemon's log (issue 21): one JSON line per event, each event once, no flood a peer can
cause, and nothing but JSON lines on stdout."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from pyalloc.gpumemd.events import EventLog

from .conftest import Holders, env
from .test_daemon import eventually

MiB = 1 << 20


def test_a_repeated_event_is_written_once_a_window_with_the_count_held_back() -> None:
    now = [1000.0]
    out = io.StringIO()
    log = EventLog(out, clock=lambda: now[0])
    for _ in range(50):
        log.limited("pressure-refused", 65534, peer_uid=65534)
    log.limited("pressure-refused", 1001, peer_uid=1001)  # another peer is not held back by the first
    now[0] += 11
    log.limited("pressure-refused", 65534, peer_uid=65534)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(x["peer_uid"], x.get("suppressed")) for x in lines] == [(65534, None), (1001, None), (65534, 49)]
    assert all(x["event"] == "pressure-refused" and x["time"] >= 1000 for x in lines)


def test_serve_logs_each_event_once_as_one_json_line(holders: Holders, tmp_path: Path) -> None:
    idle = holders.start("--allocated", str(4 * MiB), "--last-alloc-ago", "3600")
    doomed = holders.start("--allocated", str(MiB))
    policy = tmp_path / "policy.toml"
    policy.write_text('[idle]\nenabled = true\nwindow = "1s"\ncpu_percent = 50.0\nmin_bytes = "1MiB"\n'
                      '[protect]\nmin_uid = 0\n')
    sock = tmp_path / "p.sock"
    d = subprocess.Popen([sys.executable, "-m", "pyalloc.gpumemd", "--registry-dir", str(holders.reg_dir),
                          "--no-nvml", "serve", "--listen", "127.0.0.1:0", "--interval", "0.2s", "--socket",
                          str(sock), "--policy", str(policy), "--audit-log", str(tmp_path / "audit.jsonl")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        assert d.stdout is not None and json.loads(d.stdout.readline())["event"] == "listening"
        eventually(lambda: (tmp_path / "audit.jsonl").exists()
                   and f'"pid": {idle}' in (tmp_path / "audit.jsonl").read_text())
        holders.procs[1].kill()
        holders.procs[1].wait()
        for _ in range(3):  # a malformed request, three times
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(sock))
                s.sendall(b"{not json\n")
                s.recv(4096)
        time.sleep(2.0)  # ten passes or so
    finally:
        d.terminate()
        out, err = d.communicate(timeout=30)
    assert err == ""
    events = [json.loads(line) for line in out.splitlines()]  # nothing on stdout but JSON lines
    decisions = [e for e in events if e["event"] == "reaper-decision"]
    assert [(e["pid"], e["criterion"], e["action"], e["dry_run"]) for e in decisions] == [(idle, "idle", "kill", True)]
    removed = [e for e in events if e["event"] == "record-removed"]
    assert [(e["path"].rsplit(".", 1)[1], e["reason"]) for e in removed] == [(str(doomed), "process gone")]
    errors = [e for e in events if e["event"] == "pressure-client-error"]
    assert len(errors) == 1 and "one JSON line" in errors[0]["error"] and errors[0]["peer_pid"] > 0
    assert events[-1]["event"] == "stopped"
