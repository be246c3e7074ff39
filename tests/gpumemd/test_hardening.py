"""Issue 24, items 5 and 6: a registry full of junk costs a bounded scan; /v1/status shows
program names, not command lines; the audit log never follows a symlink."""

from __future__ import annotations

import json
import os
import threading
import urllib.request
from pathlib import Path

import pytest

from pyalloc.gpumemd import metrics, model, reaper, registry


def test_junk_in_the_registry_is_counted_not_read(reg_dir: Path) -> None:
    w = registry.RecordWriter(registry.record_path(os.getpid(), directory=reg_dir), pid=os.getpid())
    w.update(0, reserved_bytes=1)
    for i in range(3000):
        (reg_dir / f"pyalloc.junk.{i}").touch()
    scan = registry.scan(reg_dir)
    assert [r.pid for r in scan.records] == [os.getpid()]
    assert [s.reason for s in scan.skipped] == ["3000 files named pyalloc.* that are not pyalloc.<uid>.<pid> ignored"]
    w.close()


def test_record_files_beyond_the_limit_are_not_read(reg_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "MAX_RECORDS", 10)
    for pid in range(1000, 1030):  # record-shaped names, garbage inside
        (reg_dir / f"pyalloc.0.{pid}").write_bytes(b"x")
    scan = registry.scan(reg_dir)
    assert len(scan.skipped) == 11  # 10 read and refused, one entry for the 20 left unread
    assert scan.skipped[0].reason == "20 more registry files not read (at most 10 per scan)"


def _snapshot_with(command: str) -> model.Snapshot:
    row = model.ProcessRow(pid=4321, device="host:0", gpu=0, uuid=None, user="alice", uid=1000, command=command,
                           used_bytes=None, sm_util=None, cpu_percent=0.0, status="sleeping", ppid=1,
                           start_time=0.0, allocator=None)
    return model.Snapshot(0.0, False, None, [], [row], [], [])


def test_status_over_http_shows_program_names_not_command_lines() -> None:
    state = metrics.State()
    state.set(_snapshot_with("/usr/bin/python3 train.py --hf-token=s3cret"), 0.0,
              reap=[{"pid": 4321, "evidence": {"command": "/usr/bin/python3 train.py --hf-token=s3cret",
                                               "records": [["/dev/shm/pyalloc.1000.4321", 1000]]}}])
    for show, expected in ((False, "python3 [arguments hidden]"), (True, "/usr/bin/python3 train.py --hf-token=s3cret")):
        server = metrics.make_server(state, "127.0.0.1", 0, show_commands=show)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/v1/status", timeout=10).read()
        finally:
            server.shutdown()
            server.server_close()
        doc = json.loads(body)
        assert doc["processes"][0]["command"] == expected
        assert doc["reaper"][0]["evidence"]["command"] == expected
        assert (b"s3cret" in body) == show


def test_the_audit_log_is_never_opened_through_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    planted = tmp_path / "audit.jsonl"
    planted.symlink_to(victim)
    decision = reaper.Decision(0.0, 1, "idle", "report", True, {}, None)
    with pytest.raises(OSError, match="symlink is refused"):
        reaper.audit([decision], planted)
    assert victim.read_text() == "untouched\n"


def test_a_record_the_library_is_still_creating_is_not_reported(reg_dir: Path) -> None:
    """The soak (issue 21) logged every starting process's pyalloc.<uid>.<pid>.new as junk."""
    (reg_dir / f"pyalloc.{os.getuid()}.{os.getpid()}.new").touch()
    (reg_dir / "pyalloc.junk").touch()
    scan = registry.scan(reg_dir)
    assert [s.reason for s in scan.skipped] == ["1 files named pyalloc.* that are not pyalloc.<uid>.<pid> ignored"]
    with pytest.raises(registry.RecordGone):  # a record removed between the listing and the open
        registry.read_record(reg_dir / f"pyalloc.{os.getuid()}.1")


def test_a_process_sampled_over_no_time_has_no_cpu_percent_rather_than_an_idle_one() -> None:
    # `gpumemd status --cpu-sample 0` (or cpu_sample = 0 in a policy) printed 0.0 for every
    # process seen for the first time: psutil reads 0.0 over a window of no time, and the reaper's
    # idle criterion would take a busy process for an idle one.
    import subprocess
    import sys
    import time

    from pyalloc.gpumemd.procinfo import ProcessSampler

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert ProcessSampler().sample([busy.pid], wait=0)[busy.pid].cpu_percent is None
        sampler = ProcessSampler()
        measured = sampler.sample([busy.pid], wait=0.3)[busy.pid].cpu_percent
        assert measured is not None and measured > 20, measured
        assert sampler.sample([busy.pid], wait=0)[busy.pid].cpu_percent is None  # read a moment ago
        time.sleep(0.3)
        again = sampler.sample([busy.pid], wait=0)[busy.pid].cpu_percent  # since the previous read
        assert again is not None and again > 20, again
    finally:
        busy.kill()
        busy.wait()
