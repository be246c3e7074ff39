"""gpumemd under load (issue 21): a thousand connections of one user, five hundred scrapers at
once, scrapers that hang up early; and the exposition that serves them, checked against
prometheus_client's own parser. No timing is asserted: the figures are in
tools/bench/gpumemd_scrape.py and docs/benchmarks/2026-11-25-gpumemd-soak.md."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pyalloc.gpumemd import pressure, registry
from pyalloc.gpumemd.metrics import State
from pyalloc.gpumemd.model import AllocatorView, DeviceRow, Flags, ProcessRow, Snapshot

from .conftest import Holders, env
from .test_daemon import eventually
from .test_pressure_socket import FLOOD_C, c_program, open_server  # noqa: F401 - the fixture

MiB = 1 << 20


def _snapshot() -> Snapshot:
    now = time.time()
    devs = [DeviceRow("cuda:0", 0, "GPU-0", "H100", "nvml", 80 << 30, None, 1 << 30, False, 5 * MiB, 3 * MiB),
            DeviceRow("cuda:1", 1, "GPU-1", "H100", "nvml", error="device 1: GPU is lost")]
    odd_user = 'a"b\\c\nd'
    rows = [ProcessRow(101, "cuda:0", 0, "GPU-0", odd_user, 1000, "python", 7 * MiB, 40, 150.0, "running", 1, now,
                       AllocatorView(3 * MiB, 5 * MiB, 3 * MiB, 2 * MiB, MiB, 0, 6 * MiB, 4, 0, 0, "cuda", 0.25, True),
                       Flags(zombie=True, idle_since=now - 30), cpu_seconds=12.34),
            ProcessRow(102, "cuda:1", 1, "GPU-1", "bob", 1001, None, None, None, None, None, None, None, None)]
    return Snapshot(now, True, None, devs, rows, [], [], "/dev/shm", None, 1 << 30)


def test_the_exposition_reads_back_through_prometheus_clients_parser() -> None:
    """Note [One rendering per snapshot]: the hand-written text must mean what it says to a
    Prometheus parser: names, types, escaped labels, values, and no series for what is N/A."""
    state = State()
    state.set(_snapshot(), 0.5)
    body = state.exposition()
    assert state.exposition() is body  # the second scrape of a snapshot is not rendered again
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    samples = {(s.name, s.labels.get("pid", ""), s.labels.get("gpu", ""), s.labels.get("flag", "")): s
               for f in fams.values() for s in f.samples}
    a = samples[("gpumemd_process_reserved_bytes", "101", "0", "")]
    assert a.value == 5 * MiB and a.labels["user"] == 'a"b\\c\nd' and a.labels["UUID"] == "GPU-0"
    assert samples[("gpumemd_process_ooms_total", "101", "0", "")].value == 4
    assert fams["gpumemd_process_ooms"].type == "counter"
    assert samples[("gpumemd_process_cpu_seconds_total", "101", "0", "")].value == 12.34
    assert fams["gpumemd_process_cpu_seconds"].type == "counter"
    assert samples[("gpumemd_process_sm_utilization_ratio", "101", "0", "")].value == 0.4
    assert samples[("gpumemd_process_flag", "101", "0", "zombie")].value == 1
    assert samples[("gpumemd_process_idle_seconds", "101", "0", "")].value >= 30
    assert samples[("gpumemd_device_up", "", "0", "")].value == 1
    assert samples[("gpumemd_device_up", "", "1", "")].value == 0  # lost: reported, not hidden
    assert ("gpumemd_device_used_bytes", "", "0", "") not in samples  # N/A: absent, never 0
    assert ("gpumemd_process_used_bytes", "102", "1", "") not in samples
    assert not any(k[0].startswith("gpumemd_process_") and k[1] == "102" for k in samples)  # no figures at all
    assert samples[("gpumemd_registry_up", "", "", "")].value == 1
    assert "gpumemd_process_cpu_ratio" not in fams  # renamed: it was in cores, not a ratio


def _serve(holders: Holders, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], int]:
    d = subprocess.Popen([sys.executable, "-m", "pyalloc.gpumemd", "--registry-dir", str(holders.reg_dir),
                          "--no-nvml", "serve", "--listen", "127.0.0.1:0", "--interval", "0.3s",
                          "--socket", str(tmp_path / "p.sock"), *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    assert d.stdout is not None
    first = json.loads(d.stdout.readline())
    assert first["event"] == "listening"
    return d, int(first["metrics"].rsplit(":", 1)[1].split("/")[0])


def test_five_hundred_concurrent_scrapes_all_answered(holders: Holders, tmp_path: Path) -> None:
    """Issue 21: 12 of 200 concurrent scrapes got no answer (an accept queue of 5)."""
    pids = [holders.start("--allocated", str((i + 1) * MiB)) for i in range(4)]
    d, port = _serve(holders, tmp_path)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        eventually(lambda: all(f'pid="{p}"' in urllib.request.urlopen(url, timeout=10).read().decode() for p in pids))
        gate = threading.Barrier(500)
        bodies: list[bytes] = []
        failures: list[str] = []
        lock = threading.Lock()

        def scrape() -> None:
            gate.wait()
            try:
                body = urllib.request.urlopen(url, timeout=60).read()
                with lock:
                    bodies.append(body)
            except Exception as e:  # noqa: BLE001 - each failure is what is counted
                with lock:
                    failures.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=scrape) for _ in range(500)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []
        assert len(bodies) == 500
        for body in bodies:  # each a whole exposition with every process
            text = body.decode()
            assert text.endswith("\n") and all(f'pid="{p}"' in text for p in pids)
    finally:
        d.terminate()
        _out, err = d.communicate(timeout=30)
    assert "Traceback" not in err


def test_scrapers_that_hang_up_early_cost_one_log_line_and_no_traceback(holders: Holders, tmp_path: Path) -> None:
    """Issue 21: a client that disconnected early left a BrokenPipeError traceback on stderr."""
    for i in range(20):  # a body large enough that it cannot all sit in the socket buffer
        holders.start("--allocated", str((i + 1) * MiB))
    d, port = _serve(holders, tmp_path)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        eventually(lambda: urllib.request.urlopen(url, timeout=10).read().count(b"gpumemd_process_reserved_bytes{") == 20)
        for _ in range(30):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # a reset, not a polite close: the daemon's write fails
        s = socket.create_connection(("127.0.0.1", port))  # and one that connects and says nothing
        time.sleep(0.5)
        s.close()
        assert urllib.request.urlopen(url, timeout=10).status == 200  # it lives on
    finally:
        d.terminate()
        out, err = d.communicate(timeout=30)
    assert "Traceback" not in err and err.strip() == ""
    events = [json.loads(line) for line in out.splitlines()]  # every line is one JSON object
    errors = [e for e in events if e["event"] == "http-client-error"]
    # One line per peer address per window however many hung up, each naming the peer and the error.
    assert 1 <= len(errors) <= 2, errors
    assert errors[0]["peer"].startswith("127.0.0.1:") and "Error" in errors[0]["error"]


FLOOD_UID, ASKER_UID = 65534, 65533

ASKER_C = r"""
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
/* Prints "ready", waits for a line on stdin, then connects to argv[1], asks for 4096 bytes
   on device 0 and prints the answer, then the milliseconds from connect() to the answer. */
int main(int argc, char** argv) {
  char line[16];
  puts("ready");
  fflush(stdout);
  if (!fgets(line, sizeof line, stdin)) return 4;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un a = {0};
  a.sun_family = AF_UNIX;
  strncpy(a.sun_path, argv[1], sizeof a.sun_path - 1);
  struct timeval tv = {20, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(fd, (struct sockaddr*)&a, sizeof a) != 0) { perror("connect"); return 2; }
  const char* req = "{\"device\": 0, \"bytes\": 4096}\n";
  (void)send(fd, req, strlen(req), MSG_NOSIGNAL);
  char buf[4096];
  ssize_t n = read(fd, buf, sizeof buf - 1);
  if (n <= 0) { perror("read"); return 3; }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  buf[n] = 0;
  fputs(buf, stdout);
  printf("%.1f\n", (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6);
  return 0;
}
"""


def _genuine_record(reg: Path, pid: int, uid: int) -> None:
    """The registry record of ``pid``, owned by ``uid`` as the library would write it."""
    w = registry.RecordWriter(registry.record_path(pid, uid=uid, directory=reg), pid=pid)
    w.rec.uid = uid
    w.update(0, reserved_bytes=1)
    w.close(unlink=False)
    os.chown(w.path, uid, uid)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as two other users")
def test_a_thousand_connections_of_one_user_leave_another_users_request_served(
        open_server: tuple[Path, pressure.PressureServer]) -> None:
    """Issue 21: 300 connections held open by one client made the next request fail. Here one
    uid (with a genuine record, so its connections are read) holds 1,000 open while a process
    of a second uid asks. The idle timeout is 60 s, longer than the asker waits (20 s): it is
    answered only if a slot was free for it while the flood was held, which is what is checked."""
    top, srv = open_server
    srv.stop()
    slow = pressure.PressureServer(srv.path, registry_dir=top / "registry", idle_timeout_s=60.0)
    slow.start()
    flood = subprocess.Popen([str(c_program(top, "flood", FLOOD_C)), slow.path, "1000"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, user=FLOOD_UID, group=FLOOD_UID)
    asker = subprocess.Popen([str(c_program(top, "asker", ASKER_C)), slow.path], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, user=ASKER_UID,
                             group=ASKER_UID)
    try:
        assert flood.stdin is not None and flood.stdout is not None
        assert asker.stdin is not None and asker.stdout is not None
        assert flood.stdout.readline().strip() == "ready" and asker.stdout.readline().strip() == "ready"
        _genuine_record(top / "registry", flood.pid, FLOOD_UID)
        _genuine_record(top / "registry", asker.pid, ASKER_UID)
        flood.stdin.write("go\n")
        flood.stdin.flush()
        assert flood.stdout.readline().strip() == "connected"
        eventually(lambda: slow.refused >= 1000 - pressure.MAX_PER_UID)
        asker.stdin.write("go\n")
        asker.stdin.flush()
        out, err = asker.communicate(timeout=60)
        assert asker.returncode == 0, err
        answer_line, millis = out.strip().splitlines()
        answer = json.loads(answer_line)
        assert answer["ok"] is True and answer["requester"] == asker.pid
        assert flood.poll() is None  # the 1,000 connections were still held when it was answered
        print(f"answered in {float(millis):.1f} ms with 1000 connections of uid {FLOOD_UID} held")
    finally:
        flood.kill()
        flood.wait()
        if asker.poll() is None:
            asker.kill()
            asker.wait()
        slow.stop()
