"""Fault injection (issue 21), each case for real: processes killed with SIGKILL, a registry
folder that is read-only or full (a real tmpfs), a daemon killed and restarted, NVML failing in
the middle of polls (a stand-in libnvidia-ml.so.1 loaded by nvidia-ml-py), pids reused by
unrelated processes, and the reaper signalling under a policy with processes of three uids."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from pyalloc.gpumemd import registry, reaper
from pyalloc.gpumemd.model import Collector

from .conftest import Holders, env, gpumemd
from .test_daemon import eventually

MiB = 1 << 20
HERE = Path(__file__).parent
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts, other uids, ns_last_pid)")


# --- a process killed in the middle of a registry update --------------------------------------

TORN_WRITER = r"""
import os, sys, time
from pyalloc.gpumemd import registry
w = registry.RecordWriter(registry.record_path(os.getpid(), directory=sys.argv[1]), command="torn-writer")
for i in range(1, 400):
    w.update(0, reserved_bytes=i << 12, allocated_bytes=i << 12, active_bytes=i << 12)  # all three equal
    time.sleep(0.001)
w.rec.seq += 1                   # an update begins: the sequence number is odd ...
w.rec.devices[0].reserved_bytes = 1 << 40
print("mid", flush=True)         # ... and the process dies before it ends
time.sleep(3600)
"""


def test_a_process_killed_mid_update_is_never_read_torn_and_its_record_is_removed(reg_dir: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", TORN_WRITER, str(reg_dir)], stdout=subprocess.PIPE, text=True,
                             env=env())
    path = registry.record_path(child.pid, directory=reg_dir)
    seen: list[tuple[int, int, int]] = []
    stop = threading.Event()

    def read() -> None:  # a reader racing the writer the whole time
        while not stop.is_set():
            try:
                devices = registry.read_record(path).devices
            except registry.RecordError:
                continue
            if devices:  # none before the writer's first update (seen on Python 3.13 in CI's smoke run)
                seen.append((devices[0].reserved_bytes, devices[0].allocated_bytes, devices[0].active_bytes))

    reader = threading.Thread(target=read)
    reader.start()
    assert child.stdout is not None and child.stdout.readline().strip() == "mid"
    child.send_signal(signal.SIGKILL)
    child.wait()
    stop.set()
    reader.join()
    assert seen, "the reader never read the record while it was written"
    assert all(r == a == act for r, a, act in seen), "a torn record was read"
    assert all(r != 1 << 40 for r, _a, _act in seen)
    with pytest.raises(registry.RecordError, match="torn"):  # left mid-update: never believed
        registry.read_record(path)
    snap = Collector(registry_dir=reg_dir, use_nvml=False).collect()
    assert [(r.path, r.reason) for r in snap.removed_records] == [(str(path), "process gone")]
    assert not path.exists() and snap.processes == []


CHURNER = r"""
import pyalloc, random
pyalloc.configure("backend=host,capacity=64MiB")
live = []
print("ready", flush=True)
while True:
    if live and random.random() < 0.5:
        pyalloc.free(*live.pop())
    else:
        size = random.choice((4096, 1 << 16, 1 << 20))
        live.append((pyalloc.malloc(size), size))
    if len(live) > 64:
        pyalloc.free(*live.pop(0))
"""


def test_real_pyalloc_processes_killed_at_random_leave_no_record_and_no_error(reg_dir: Path) -> None:
    """The library's own publisher, killed at random moments while gpumemd scans: every scan
    reads the live records cleanly, and every dead one is removed."""
    rng = random.Random(21)
    collector = Collector(registry_dir=reg_dir, use_nvml=False)
    for _ in range(8):
        p = subprocess.Popen([sys.executable, "-c", CHURNER], stdout=subprocess.PIPE, text=True,
                             env={**env(), "PYALLOC_REGISTRY_DIR": str(reg_dir)})
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        eventually(lambda: registry.record_path(p.pid, directory=reg_dir).exists())
        end = time.monotonic() + rng.uniform(0.05, 0.5)
        while time.monotonic() < end:
            scan = registry.scan(reg_dir)  # the live record, and those of the killed ones not yet removed
            assert scan.skipped == [] and p.pid in [r.pid for r in scan.records]
        p.kill()
        p.wait()
    snap = collector.collect()
    assert len(snap.removed_records) == 8 and {r.reason for r in snap.removed_records} == {"process gone"}
    assert list(reg_dir.iterdir()) == [] and snap.skipped_records == []


# --- a registry folder that is read-only or full ----------------------------------------------

@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="gpumemd-tmpfs-"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k,mode=1777", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        os.rmdir(where)
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        os.rmdir(where)


ALLOCATOR = r"""
import pyalloc
pyalloc.configure("backend=host,capacity=64MiB")
for i in range(300):
    size = (i % 16 + 1) << 16
    pyalloc.free(pyalloc.malloc(size), size)
print("allocated 300 times", flush=True)
"""


def _allocate_in(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", ALLOCATOR], capture_output=True, text=True, timeout=120,
                          env={**env(), "PYALLOC_REGISTRY_DIR": str(folder)})


@as_root
def test_a_full_registry_folder_costs_the_record_not_the_allocations(small_tmpfs: Path) -> None:
    """Issue 21. Before Note [Registry folder unusable] the process died of SIGBUS here."""
    fd = os.open(small_tmpfs / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass  # ENOSPC: the folder is full
    finally:
        os.close(fd)
    out = _allocate_in(small_tmpfs)
    assert out.returncode == 0 and out.stdout.strip() == "allocated 300 times", out.stderr
    said = [line for line in out.stderr.splitlines() if "no registry record in" in line]
    assert len(said) == 1 and "No space left on device" in said[0]  # once, with the reason
    status = gpumemd("status", reg=small_tmpfs)
    assert "warning: registry" in status.stderr and "full" in status.stderr
    doc = json.loads(gpumemd("status", "--json", reg=small_tmpfs).stdout)
    assert "full" in doc["registry"]["problem"] and doc["registry"]["free_bytes"] < registry.RECORD_SIZE


@as_root
def test_a_read_only_registry_folder_costs_the_record_not_the_allocations(small_tmpfs: Path) -> None:
    assert subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)]).returncode == 0
    out = _allocate_in(small_tmpfs)
    assert out.returncode == 0 and out.stdout.strip() == "allocated 300 times", out.stderr
    said = [line for line in out.stderr.splitlines() if "no registry record in" in line]
    assert len(said) == 1 and "Read-only file system" in said[0]
    status = gpumemd("status", reg=small_tmpfs)
    assert "read-only file system" in status.stderr


# --- gpumemd restarted while processes run ----------------------------------------------------

def _serve(reg: Path, tmp_path: Path, *extra: str, extra_env: dict[str, str] | None = None
           ) -> tuple[subprocess.Popen[str], int]:
    d = subprocess.Popen([sys.executable, "-m", "pyalloc.gpumemd", "--registry-dir", str(reg), *extra, "serve",
                          "--listen", "127.0.0.1:0", "--interval", "0.2s", "--socket", str(tmp_path / "p.sock")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env(), **(extra_env or {})})
    assert d.stdout is not None
    return d, int(json.loads(d.stdout.readline())["metrics"].rsplit(":", 1)[1].split("/")[0])


def _status(port: int) -> dict:
    doc = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=10).read())
    return {"processes": [], "devices": [], **doc}  # before the first snapshot: nothing yet


def test_a_restarted_daemon_picks_every_record_up_again(holders: Holders, tmp_path: Path) -> None:
    pids = {holders.start("--allocated", str((i + 1) * MiB), "--cached", str(MiB)): (i + 1) * MiB for i in range(3)}
    d, port = _serve(holders.reg_dir, tmp_path, "--no-nvml")
    eventually(lambda: {p["pid"] for p in _status(port)["processes"]} == set(pids))
    d.send_signal(signal.SIGKILL)  # a crash, not a clean stop
    d.wait()
    later = holders.start("--allocated", str(9 * MiB))  # one that started while no daemon ran
    pids[later] = 9 * MiB
    d, port = _serve(holders.reg_dir, tmp_path, "--no-nvml")
    try:
        eventually(lambda: {p["pid"] for p in _status(port)["processes"]} == set(pids))
        procs = {p["pid"]: p for p in _status(port)["processes"]}
        assert {pid: procs[pid]["allocator"]["allocated_bytes"] for pid in pids} == pids
        assert all(registry.record_path(pid, directory=holders.reg_dir).exists() for pid in pids)
    finally:
        d.terminate()
        d.wait(timeout=30)


# --- NVML failing in the middle of polls ------------------------------------------------------

@pytest.fixture
def fake_nvml(tmp_path: Path) -> Path:
    lib = tmp_path / "nvml"
    lib.mkdir()
    out = subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib / "libnvidia-ml.so.1"), str(HERE / "fake_nvml.c")],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"no C compiler: {out.stderr[:200]}")
    return lib


def _device_up(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("gpumemd_device_up{") or line.startswith("gpumemd_device_total_bytes{"):
            gpu = line.split('gpu="')[1].split('"')[0]
            out[line.split("{")[0].removeprefix("gpumemd_device_") + gpu] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("call, code, why", [("handle", 15, "GPU is lost"), ("memory", 10, "Timeout"),
                                             ("processes", 999, "Unknown Error")])
def test_a_device_failing_mid_poll_is_reported_lost_and_the_rest_served(
        holders: Holders, tmp_path: Path, fake_nvml: Path, call: str, code: int, why: str) -> None:
    holder = holders.start("--allocated", str(2 * MiB))
    faults = tmp_path / "faults"
    faults.write_text("")
    d, port = _serve(holders.reg_dir, tmp_path, extra_env={
        "LD_LIBRARY_PATH": str(fake_nvml), "FAKE_NVML_FAULTS": str(faults), "FAKE_NVML_DEVICES": "2",
        "FAKE_NVML_PIDS": f"{holder}:0:{5 * MiB}"})
    try:
        eventually(lambda: _device_up(port).get("up1") == 1 and _device_up(port).get("up0") == 1)
        faults.write_text(f"1 {call} {code}\n")  # device 1 fails from the next poll on
        eventually(lambda: _device_up(port).get("up1") == 0)
        up = _device_up(port)
        assert up["up0"] == 1 and up["total_bytes0"] == 80 << 30 and "total_bytes1" not in up
        procs = {(p["pid"], p["device"]): p for p in _status(port)["processes"]}
        assert procs[(holder, "cuda:0")]["used_bytes"] == 5 * MiB  # device 0's process still served
        devices = {x["device"]: x for x in _status(port)["devices"]}
        assert why in devices["cuda:1"]["error"] and devices["cuda:1"]["uuid"].startswith("GPU-fake")
        faults.write_text("")  # it answers again
        eventually(lambda: _device_up(port).get("up1") == 1)
    finally:
        d.terminate()
        out, err = d.communicate(timeout=30)
    events = [json.loads(line) for line in out.splitlines()]
    lost = [e for e in events if e["event"] == "device-lost"]
    assert len(lost) == 1 and lost[0]["device"] == "cuda:1" and why in lost[0]["error"]
    assert [e["device"] for e in events if e["event"] == "device-back"] == ["cuda:1"]
    assert "Traceback" not in err


def test_a_value_nvml_does_not_support_is_na_and_the_device_stays_up(
        holders: Holders, tmp_path: Path, fake_nvml: Path) -> None:
    faults = tmp_path / "faults"
    faults.write_text("0 memory 3\n")  # NOT_SUPPORTED: an N/A, not a lost device
    d, port = _serve(holders.reg_dir, tmp_path, extra_env={
        "LD_LIBRARY_PATH": str(fake_nvml), "FAKE_NVML_FAULTS": str(faults)})
    try:
        eventually(lambda: "up0" in _device_up(port))
        up = _device_up(port)
        assert up["up0"] == 1 and "total_bytes0" not in up and up["total_bytes1"] == 80 << 30
    finally:
        d.terminate()
        d.wait(timeout=30)


# --- pid reuse --------------------------------------------------------------------------------

def _spawn_at(pid: int, argv: list[str]) -> subprocess.Popen[bytes]:
    """An unrelated process that gets ``pid``, through ns_last_pid (root); skips if the machine's
    other processes keep taking it first."""
    for _ in range(300):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError:
            pytest.skip("ns_last_pid is not writable here")
        p = subprocess.Popen(argv)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    pytest.skip(f"could not get pid {pid} back")


@as_root
def test_the_reaper_never_signals_a_process_that_reused_a_judged_pid(holders: Holders, tmp_path: Path) -> None:
    # Judged on its heartbeat (it serves no mailbox, so its heartbeat stops): nothing here depends
    # on how much CPU a loaded machine gives it.
    policy = reaper.Policy.from_dict({"stale_heartbeat": {"enabled": True, "window": "1s", "action": "kill"},
                                      "protect": {"min_uid": 0}})
    victim = holders.start("--allocated", str(4 * MiB), "--no-serve")
    time.sleep(1.5)
    snap = Collector(registry_dir=holders.reg_dir, use_nvml=False).collect()
    decisions = reaper.decide(snap, policy, dry_run=False)
    assert [(d.pid, d.criterion, d.action) for d in decisions] == [(victim, "stale_heartbeat", "kill")]
    holders.procs[0].kill()  # the judged process ends between the decision and the signal ...
    holders.procs[0].wait()
    newcomer = _spawn_at(victim, ["sleep", "60"])  # ... and an unrelated one gets its pid
    try:
        reaper.enforce(decisions, grace_s=0.5, log=reaper.AuditLog(tmp_path / "audit.jsonl"))
        assert decisions[0].result == "pid reused before signalling (start time differs)"
        assert newcomer.poll() is None  # untouched
        assert not (tmp_path / "audit.jsonl").read_text()  # no signal announced: none sent
    finally:
        newcomer.kill()
        newcomer.wait()


@as_root
def test_the_reaper_checks_the_uid_too_before_signalling(tmp_path: Path) -> None:
    """Identity is pid + start time + uid: a process whose uid is not the judged one is refused,
    even with the judged start time."""
    import psutil

    target = subprocess.Popen(["sleep", "60"])
    try:
        me = psutil.Process(target.pid)
        d = reaper.Decision(time.time(), target.pid, "idle", "kill", False,
                            {"start_time": me.create_time(), "uid": 4242})
        reaper.enforce([d], grace_s=0.5)
        assert d.result is not None and d.result.startswith("pid reused before signalling (uid 0")
        assert target.poll() is None
    finally:
        target.kill()
        target.wait()


@as_root
def test_trim_never_writes_into_the_record_of_a_pid_now_someone_elses(holders: Holders) -> None:
    owner = holders.start("--allocated", str(MiB), "--cached", str(8 * MiB))
    path = registry.record_path(owner, directory=holders.reg_dir)
    before = path.read_bytes()
    holders.procs[0].kill()  # SIGKILL: its record stays behind
    holders.procs[0].wait()
    newcomer = _spawn_at(owner, ["sleep", "60"])
    try:
        out = gpumemd("trim", str(owner), reg=holders.reg_dir)
        assert out.returncode == 1 and "the record is not this process's" in out.stderr and out.stderr.count("\n") == 1
        assert path.read_bytes() == before  # no request written into the mailbox
        assert newcomer.poll() is None
    finally:
        newcomer.kill()
        newcomer.wait()


# --- the reaper enforcing: other uids, protected and system processes, audit before signal -----

NAMED_UID, OTHER_UID, SYSTEM_UID = 4242, 4343, 999


def _with_record(reg: Path, uid: int, argv: list[str]) -> subprocess.Popen[bytes]:
    """``argv`` run as ``uid``, holding 4 MiB it last allocated an hour ago, with its genuine record."""
    p = subprocess.Popen(argv, user=uid, group=uid)
    eventually(lambda: (registry._proc_uids(p.pid) or (None,))[0] == uid)
    w = registry.RecordWriter(registry.record_path(p.pid, uid=uid, directory=reg), pid=p.pid, command=argv[0])
    w.rec.uid = uid
    w.update(0, reserved_bytes=4 * MiB, allocated_bytes=4 * MiB, last_alloc_unix_ns=time.time_ns() - 3600 * 10**9)
    w.close(unlink=False)
    os.chown(w.path, uid, uid)
    return p


@as_root
def test_enforce_signals_only_named_users_never_protected_or_system_and_audits_first(
        holders: Holders, tmp_path: Path) -> None:
    os.chmod(holders.reg_dir, 0o1777)
    shared = Path(tempfile.mkdtemp(prefix="gpumemd-audit-"))
    os.chmod(shared, 0o777)
    audit, report = shared / "audit.jsonl", shared / "audit-at-sigterm.jsonl"
    audit.touch(mode=0o644)  # readable by the named user's process, to see what it held at SIGTERM
    # The named user's process copies the audit log when SIGTERM reaches it, then exits.
    trap = ["/bin/sh", "-c", f"trap 'cat {audit} > {report}; exit 0' TERM; while :; do sleep 0.1; done"]
    named = _with_record(holders.reg_dir, NAMED_UID, trap)
    other = _with_record(holders.reg_dir, OTHER_UID, ["sleep", "600"])
    system = _with_record(holders.reg_dir, SYSTEM_UID, ["sleep", "600"])
    mine = holders.start("--allocated", str(4 * MiB), "--last-alloc-ago", "3600")  # root's: uid 0
    listed = _with_record(holders.reg_dir, NAMED_UID, ["sleep", "600"])
    policy = tmp_path / "policy.toml"
    policy.write_text(f"""
grace_period = "5s"
cpu_sample = "0.5s"
[orphan]
enabled = false
[idle]
enabled = true
window = "1s"
cpu_percent = 50.0
min_bytes = "1MiB"
[protect]
min_uid = 1000
pids = [{listed.pid}]
allow_other_users = ["{NAMED_UID}", "{SYSTEM_UID}"]
""")
    time.sleep(1.5)  # every process is older than the idle window
    try:
        out = gpumemd("reap", "--policy", str(policy), "--enforce", "--json", "--audit-log", str(audit),
                      reg=holders.reg_dir)
        assert out.returncode == 0, out.stderr
        decisions = {d["pid"]: d for d in json.loads(out.stdout)}
        assert decisions[named.pid]["action"] == "kill"
        assert decisions[other.pid]["action"] == "protected"
        assert "not named" in decisions[other.pid]["protected_reason"]
        assert decisions[system.pid]["action"] == "protected"  # named, but a system uid all the same
        assert "system uid 999" in decisions[system.pid]["protected_reason"]
        assert decisions[mine]["action"] == "protected" and "system uid 0" in decisions[mine]["protected_reason"]
        assert "protect.pids" in decisions[listed.pid]["protected_reason"]
        assert named.wait(timeout=30) == 0  # it ran its trap: SIGTERM, not SIGKILL
        assert other.poll() is None and system.poll() is None and listed.poll() is None
        os.kill(mine, 0)
        # What the log held when SIGTERM reached the process: the line announcing that very signal.
        at_signal = [json.loads(line) for line in report.read_text().splitlines()]
        assert [(x["pid"], x["phase"], x["signal"]) for x in at_signal] == [(named.pid, "signalling", "SIGTERM")]
        lines = [json.loads(line) for line in audit.read_text().splitlines()]
        assert [x["pid"] for x in lines if x["phase"] == "signalling"] == [named.pid]  # no one else, ever
        assert sorted(x["pid"] for x in lines if x["phase"] == "done") == sorted(decisions)
    finally:
        for p in (named, other, system, listed):
            if p.poll() is None:
                p.kill()
            p.wait()
        import shutil
        shutil.rmtree(shared, ignore_errors=True)
