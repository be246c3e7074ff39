"""The built library: its exported C ABI and its independence from CUDA at link time."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pyalloc
from allocator_fixture import fresh_conf

# The names fixed by the architecture (allocator/include/pyalloc/pyalloc.h).
ARCHITECTURE_ABI = [
    "pyalloc_malloc",
    "pyalloc_free",
    "pyalloc_record_stream",
    "pyalloc_empty_cache",
    "pyalloc_set_memory_fraction",
    "pyalloc_cupy_malloc",
    "pyalloc_cupy_free",
    "pyalloc_configure",
    "pyalloc_last_error",
    "pyalloc_stats_json",
    "pyalloc_snapshot_json",
    "pyalloc_check",
]

HEADER = Path(__file__).resolve().parents[1] / "allocator" / "include" / "pyalloc" / "pyalloc.h"


def exported_functions() -> set[str]:
    if shutil.which("nm") is None:
        pytest.skip("nm is not installed")
    out = subprocess.run(["nm", "-D", "--defined-only", pyalloc.library_path()], check=True,
                         capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if " T " in line}


def test_nm_lists_every_abi_name_of_the_architecture() -> None:
    missing = set(ARCHITECTURE_ABI) - exported_functions()
    assert not missing


def test_every_function_of_the_header_is_exported_and_nothing_else() -> None:
    declared = set(re.findall(r"PYALLOC_API\s+[^;(]*?\b(pyalloc_\w+)\s*\(", HEADER.read_text()))
    assert set(ARCHITECTURE_ABI) <= declared
    assert exported_functions() == declared


def test_the_library_does_not_link_against_cuda() -> None:
    if shutil.which("readelf") is None:
        pytest.skip("readelf is not installed")
    out = subprocess.run(["readelf", "-d", pyalloc.library_path()], check=True, capture_output=True,
                         text=True).stdout
    needed = re.findall(r"\(NEEDED\).*\[(.+)\]", out)
    assert needed, out
    assert not [lib for lib in needed if "cuda" in lib or "nvidia" in lib]


def test_library_path_is_absolute_and_exists() -> None:
    path = Path(pyalloc.library_path())
    assert path.is_absolute() and path.is_file() and path.name == "libpyalloc.so"


@pytest.mark.parametrize("backend", ["host", "sim"])
def test_backend_calls_are_counted_and_timed_where_the_memory_is_real(backend: str) -> None:
    """Note [Backend time]: every call that creates, maps, unmaps or releases memory is counted;
    on the host backend (real memory, as cuda) its time is added too, on sim (fake addresses) not.
    reset_accumulated_memory_stats() zeroes both."""
    pyalloc.configure(fresh_conf(backend))
    pyalloc.reset_accumulated_memory_stats()
    blocks = [pyalloc.malloc(8 << 20) for _ in range(4)]  # 32 MiB: 16 granules in the arena
    for p in blocks:
        pyalloc.free(p, 8 << 20)
    pyalloc.empty_cache()
    s = pyalloc.memory_stats()
    assert s["backend_memory_calls"] >= 16 + 16  # a create and a release per granule, at least
    assert (s["backend_memory_ns"] > 0) == (backend == "host"), s["backend_memory_ns"]
    pyalloc.reset_accumulated_memory_stats()
    s = pyalloc.memory_stats()
    assert (s["backend_memory_calls"], s["backend_memory_ns"], s["backend_waits"], s["backend_wait_ns"]) == (0, 0, 0, 0)


_FORK_WHILE_ALLOCATING = """
import os, sys, threading, time
import pyalloc
from pyalloc._lib import lib
pyalloc.configure("backend=sim,capacity=1GiB,registry=0")
L = lib()
stop = False
def churn():
    while not stop:
        p = L.pyalloc_malloc(100000, 0, None)
        L.pyalloc_free(p, 100000, 0, None)
thread = threading.Thread(target=churn)
thread.start()
hung = failed = 0
for _ in range(150):
    pid = os.fork()
    if pid == 0:  # the child: one allocation and the checker
        q = L.pyalloc_malloc(4096, 0, None)
        L.pyalloc_free(q, 4096, 0, None)
        os._exit(0 if q and L.pyalloc_check(0) == 0 else 4)
    deadline = time.monotonic() + 10
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.002)
    if done[0] == 0:
        hung += 1
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    elif done[1] != 0:
        failed += 1
stop = True
thread.join()
print(hung, failed)
"""


def test_a_child_forked_while_another_thread_allocates_can_allocate() -> None:
    # Note [Fork] in allocator/src/abi/runtime.cpp: a device lock held by the other thread at the
    # fork stayed held in the child, whose first allocation waited forever (1 fork in ~50)
    done = subprocess.run([sys.executable, "-c", _FORK_WHILE_ALLOCATING], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0"], done.stdout
