"""tests/gpu's log of finished tests (``$PYALLOC_GPU_TEST_LOG``, tests/gpu/conftest.py).

pytest runs in a child on a throwaway test file whose conftest takes the hook from
tests/gpu/conftest.py itself; the last test kills that pytest, as ``pyalloc gpu-check`` does when
its time is up, and the log must still hold every test that finished before it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

GPU_CONFTEST = Path(__file__).resolve().parent / "gpu" / "conftest.py"

# Loaded from its file, not as tests.gpu.conftest: an installed package named `tests` would
# shadow this checkout's (tests/ has no __init__.py).
_CONFTEST = f"""
import importlib.util

_spec = importlib.util.spec_from_file_location("gpu_conftest_under_test", {str(GPU_CONFTEST)!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
pytest_runtest_logreport = _module.pytest_runtest_logreport
"""

_TESTS = """
import os
import signal

import pytest


@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")


def test_passes():
    pass


def test_fails():
    reserved = 2
    assert reserved == 3, "reserved bytes were off"


def test_setup_fails(broken):
    pass


def test_skips():
    pytest.skip("not here")


def test_is_killed():
    os.kill(os.getpid(), signal.SIGKILL)


def test_never_runs():
    pass
"""

_LINE = re.compile(r"^(PASSED|FAILED|SKIPPED|ERROR) (\S+) (\d+\.\d\d)$", re.MULTILINE)


def test_each_finished_test_is_logged_at_once_and_a_killed_run_keeps_them(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_sample.py").write_text(_TESTS)
    log = tmp_path / "gpu-tests.log"
    env = dict(os.environ, PYALLOC_GPU_TEST_LOG=str(log))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sample.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, f"pytest was not killed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"

    text = log.read_text()
    lines = [(m.group(1), m.group(2)) for m in _LINE.finditer(text)]
    assert lines == [("PASSED", "test_sample.py::test_passes"), ("FAILED", "test_sample.py::test_fails"),
                     ("ERROR", "test_sample.py::test_setup_fails"), ("SKIPPED", "test_sample.py::test_skips")], text
    # A failure's whole report follows its line: the assertion, its message and the figures.
    failed = text.split("FAILED test_sample.py::test_fails", 1)[1].split("ERROR test_sample.py::", 1)[0]
    assert "reserved bytes were off" in failed and "assert 2 == 3" in failed, text
    errored = text.split("ERROR test_sample.py::test_setup_fails", 1)[1].split("SKIPPED ", 1)[0]
    assert "RuntimeError: the fixture broke" in errored, text
    # A passed or skipped test gets its line alone.
    rows = text.splitlines()
    assert rows[1].startswith("FAILED ") and rows[-1].startswith("SKIPPED "), text


def test_without_the_variable_nothing_is_written(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_sample.py").write_text("def test_fails():\n    assert 1 == 2\n")
    env = {k: v for k, v in os.environ.items() if k != "PYALLOC_GPU_TEST_LOG"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sample.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["conftest.py", "test_sample.py"]
