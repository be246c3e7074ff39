"""Fixtures for the gpumemd tests: a private registry directory and holder processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOLDER = Path(__file__).with_name("holder.py")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    return e


@pytest.fixture
def reg_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gpumemd-reg-"))
    os.chmod(d, 0o755)  # readable by the unprivileged child in the other-user test
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Holders:
    def __init__(self, reg_dir: Path) -> None:
        self.reg_dir = reg_dir
        self.procs: list[subprocess.Popen[str]] = []
        self.pids: list[int] = []

    def start(self, *args: str) -> int:
        p = subprocess.Popen([sys.executable, str(HOLDER), "--dir", str(self.reg_dir), *args],
                             stdout=subprocess.PIPE, text=True, env=env())
        self.procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("pid "), line
        pid = int(line.split()[1])
        self.pids.append(pid)
        return pid

    def cleanup(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.kill()
            except ProcessLookupError:
                pass
            p.wait()


@pytest.fixture
def holders(reg_dir: Path) -> Iterator[Holders]:
    h = Holders(reg_dir)
    yield h
    h.cleanup()


def gpumemd(*args: str, reg: Path, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyalloc.gpumemd", "--registry-dir", str(reg), "--no-nvml",
                           *[a for a in args if a != "--no-nvml"]],
                          capture_output=True, text=True, env=env(), timeout=timeout)
