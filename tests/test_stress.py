"""The native multithreaded stress test (tests/native/stress.cpp), built and run from pytest.

stress.cpp is compiled against the libpyalloc.so this package loads
(``pyalloc.library_path()``, so ``PYALLOC_LIBRARY`` selects a development
build) and run with a few seeds. It configures the host backend itself and
exits 0 only when every cookie verified, every pyalloc_check passed and the
final stats show nothing allocated or reserved.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import pyalloc

ROOT = Path(__file__).resolve().parent.parent
STRESS_SOURCE = ROOT / "tests" / "native" / "stress.cpp"
SUMMARY = re.compile(r"^stress: ok((?: \w+=\d+)+)$", re.MULTILINE)


def parse_summary(stdout: str) -> dict[str, int]:
    """The counters of the ``stress: ok key=value ...`` line."""
    match = SUMMARY.search(stdout)
    assert match, f"no summary line in:\n{stdout}"
    return {k: int(v) for k, v in (item.split("=") for item in match[1].split())}


@pytest.fixture(scope="module")
def stress_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        pytest.skip("no C++ compiler (g++ or $CXX) to build tests/native/stress.cpp")
    library = Path(pyalloc.library_path())
    out = tmp_path_factory.mktemp("stress") / "stress"
    cmd = [
        compiler, "-O2", "-std=c++17", "-pthread", "-Wall", "-Wextra",
        f"-I{ROOT / 'allocator' / 'include'}",
        str(STRESS_SOURCE), str(library),
        f"-Wl,-rpath,{library.parent}",
        "-o", str(out),
    ]  # fmt: skip
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, f"building stress.cpp failed:\n{' '.join(cmd)}\n{built.stderr}"
    return out


def run_stress(binary: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("PYALLOC_CONF", None)  # the binary configures the allocator itself
    return subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.parametrize(("seed", "vmm"), [(1, "all"), (20240611, "off"), (7, "on"), (11, "shared")])
def test_stress_keeps_every_block_intact_across_threads(stress_binary: Path, seed: int, vmm: str) -> None:
    threads, rounds, ops = 8, 4, 1500
    result = run_stress(
        stress_binary, "--threads", str(threads), "--rounds", str(rounds),
        "--ops", str(ops), "--seed", str(seed), "--vmm", vmm,
    )  # fmt: skip
    assert result.returncode == 0, f"stress failed (seed {seed}):\n{result.stdout}{result.stderr}"
    counts = parse_summary(result.stdout)
    assert counts["seed"] == seed
    assert (counts["threads"], counts["rounds"]) == (threads, rounds)
    # Every thread runs all its operations unless a failure stopped it early.
    assert counts["ops"] == threads * rounds * ops
    # At the end everything was freed, and nothing was freed twice.
    assert counts["allocs"] == counts["frees"] > 0
    # The run exercised what it is meant to: frees on another thread than the
    # malloc, cross-stream uses, bad calls, concurrent checks.
    for exercised in ("cross_thread_frees", "record_streams", "bad_calls", "empty_caches",
                      "pool_allocs", "cupy_allocs", "reconfigures", "refused_reconfigures",
                      "introspections"):
        assert counts[exercised] > 0, f"{exercised} never happened: {result.stdout}"
    assert counts["checks"] >= rounds
    # The near-full phase ran every round, its checker calling pyalloc_check
    # while the threads allocated, then its pass of one thread with move=1; with
    # arenas it made shared granules and moved slivers (Note [Moving slivers]).
    assert counts["near_full_ops"] == (16 + 1) * rounds * 2000
    assert (counts["near_full_shared"] > 0) == (vmm != "off"), result.stdout
    assert (counts["near_full_moved"] > 0) == (vmm != "off"), result.stdout


@pytest.mark.parametrize(("conf", "exercised"), [("plan=1", "plan_served"), ("lifetime=1", "lifetime_long")])
def test_stress_with_plans_or_lifetime_placement(stress_binary: Path, conf: str, exercised: str) -> None:
    """The main thread's training loop gets a plan (plan=1), or the learner predicts (lifetime=1)."""
    rounds = 3
    result = run_stress(
        stress_binary, "--threads", "4", "--rounds", str(rounds), "--ops", "800",
        "--seed", "5", "--vmm", "shared", "--conf", conf,
    )  # fmt: skip
    assert result.returncode == 0, f"stress failed ({conf}):\n{result.stdout}{result.stderr}"
    counts = parse_summary(result.stdout)
    assert counts["allocs"] == counts["frees"] > 0
    assert counts["loop_iterations"] == 6 * rounds
    assert counts[exercised] > 0, f"{exercised} is 0 with {conf}: {result.stdout}"
    if conf == "plan=1":
        assert counts["plans"] >= 1


def test_stress_refuses_a_bad_conf_key(stress_binary: Path) -> None:
    result = run_stress(stress_binary, "--rounds", "1", "--conf", "plan=sometimes")
    assert result.returncode == 1
    assert "pyalloc_configure" in result.stderr and "plan" in result.stderr


def test_stress_survives_out_of_memory_pressure(stress_binary: Path) -> None:
    # 48 MiB holds far less than the threads try to keep live: many mallocs
    # return NULL, and the pressure ladder runs concurrently with frees.
    result = run_stress(
        stress_binary, "--threads", "8", "--rounds", "3", "--ops", "1000",
        "--seed", "7", "--capacity", "48MiB",
    )  # fmt: skip
    assert result.returncode == 0, f"stress failed:\n{result.stdout}{result.stderr}"
    counts = parse_summary(result.stdout)
    assert counts["ooms"] > 0
    assert counts["allocs"] == counts["frees"]


def test_stress_rejects_a_bad_command_line(stress_binary: Path) -> None:
    result = run_stress(stress_binary, "--threads", "0")
    assert result.returncode != 0
    assert "--threads" in result.stderr


@pytest.mark.slow
def test_sanitizers_find_nothing_in_a_short_stress_run() -> None:
    if shutil.which("cmake") is None:
        pytest.skip("cmake is needed to build the sanitizer variants")
    result = subprocess.run(
        [str(ROOT / "tools" / "sanitize.sh"), "--short"],
        capture_output=True, text=True, timeout=1800, cwd=ROOT,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    verdicts = [line for line in result.stdout.splitlines() if line.startswith("sanitize: ")]
    for sanitizer in ("asan+ubsan", "tsan"):
        passed = [line for line in verdicts if line.startswith(f"sanitize: {sanitizer}: PASS")]
        assert len(passed) == 3, output  # the defaults, plan=1 and lifetime=1
        assert any("plan=1" in line for line in passed) and any("lifetime=1" in line for line in passed), output


@pytest.mark.parametrize("name", ["bit_index_test", "sliver_pairs_test"])
def test_header_only_structures_agree_with_a_reference(name: str) -> None:
    """Header-only pieces of allocator/src/blocks, built with AddressSanitizer and UBSan where the
    compiler has them, against a reference: the index of an arena's holes and roomy blocks
    (bit_index.hpp) against std::set; the pairing of slivers for a move (sliver_pairs.hpp) against
    an exhaustive search."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        pytest.skip(f"no C++ compiler (g++ or $CXX) to build tests/native/{name}.cpp")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / name
        base = [compiler, "-O1", "-g", "-std=c++17", "-Wall", "-Wextra", "-Werror",
                f"-I{ROOT / 'allocator' / 'src'}", str(ROOT / "tests" / "native" / f"{name}.cpp"), "-o", str(out)]
        built = subprocess.run([*base, "-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
                               capture_output=True, text=True)
        if built.returncode != 0:  # no sanitizer runtime here: the plain build still checks the answers
            built = subprocess.run(base, capture_output=True, text=True)
        assert built.returncode == 0, f"building {name}.cpp failed:\n{built.stderr}"
        done = subprocess.run([str(out)], capture_output=True, text=True, timeout=120)
        verdict = done.stdout.strip().splitlines()
        assert done.returncode == 0 and verdict and verdict[-1].startswith(name.replace("_test", ": ok")), \
            done.stdout + done.stderr
