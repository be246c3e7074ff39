"""The built library: its exported C ABI and its independence from CUDA at link time."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import pyalloc

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
