"""Note [Record identity]: a registry record is believed only where the kernel agrees.

The attack of issue 24, for real, with two uids: user A (a throwaway uid) writes
``pyalloc.<A>.<pid of B's process>`` into a world-writable registry directory,
claiming 8 GiB reserved, a fresh heartbeat and an allocation an hour ago; a root
gpumemd with ``allow_other_users = true`` must not reap, trim, or report B's
process on the strength of it, and removes the file, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from pyalloc.gpumemd import registry

from .conftest import gpumemd
from .test_daemon import POLICY as DAEMON_POLICY

FORGER_UID = 4242  # user A: only numbers, no account needed
VICTIM_UID = 4343  # user B
GiB = 1 << 30

# The reaper's policy of test_daemon, for a root daemon that reaps every user's processes.
POLICY = DAEMON_POLICY.replace('commands = ["--protect-me"]', "allow_other_users = true")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run processes as two other users")


@pytest.fixture
def world_writable_registry() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gpumemd-forge-"))
    os.chmod(d, 0o1777)  # like /dev/shm
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


@pytest.fixture
def victim() -> Iterator[int]:
    """User B's process: runs no pyalloc, uses no CPU."""
    p = subprocess.Popen(["sleep", "300"], user=VICTIM_UID, group=VICTIM_UID)
    yield p.pid
    p.kill()
    p.wait()


def _forge(directory: Path, victim: int) -> Path:
    """What user A can write: a record of A's uid naming B's pid, with B's start time (anyone may read
    /proc/<pid>/stat), in a file A owns. Written here and given to A (the interpreter under /root is
    not A's to run); the daemon sees exactly what A's own write would leave."""
    path = registry.record_path(victim, uid=FORGER_UID, directory=directory)
    w = registry.RecordWriter(path, pid=victim)
    w.rec.uid = FORGER_UID
    assert w.rec.start_time_ticks == registry.proc_start_ticks(victim) != 0
    w.update(0, reserved_bytes=8 * GiB, allocated_bytes=8 * GiB, last_alloc_unix_ns=time.time_ns() - 3600 * 10**9)
    w.close(unlink=False)
    os.chown(path, FORGER_UID, FORGER_UID)
    return path


def test_a_record_naming_another_users_process_is_not_believed(world_writable_registry: Path, victim: int) -> None:
    forged = _forge(world_writable_registry, victim)
    scan = registry.scan(world_writable_registry)
    assert scan.records == []
    [skipped] = scan.skipped
    assert f"pid {victim} belongs to uid {VICTIM_UID}, not to the record's uid {FORGER_UID}" in skipped.reason
    with pytest.raises(registry.RecordError, match="forged"):
        registry.read_record(forged)


def test_root_reaps_trims_and_reports_nothing_on_a_forged_record(world_writable_registry: Path, victim: int,
                                                                  tmp_path: Path) -> None:
    forged = _forge(world_writable_registry, victim)
    # trim: the mailbox of a forged record is never written or believed
    out = gpumemd("trim", str(victim), reg=world_writable_registry)
    assert out.returncode != 0 and "forged" in out.stderr
    # status: B's process is not shown with A's figures
    out = gpumemd("status", "--json", reg=world_writable_registry)
    assert out.returncode == 0, out.stderr
    assert victim not in [p["pid"] for p in json.loads(out.stdout)["processes"]]
    # reap --enforce: nothing to do, B's process lives; the file is removed, with the reason
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    audit = tmp_path / "audit.jsonl"
    out = gpumemd("reap", "--policy", str(policy), "--json", "--enforce", "--audit-log", str(audit),
                  reg=world_writable_registry)
    assert out.returncode == 0, out.stderr
    assert [d for d in json.loads(out.stdout) if d["pid"] == victim] == []
    os.kill(victim, 0)  # alive
    assert not forged.exists()
