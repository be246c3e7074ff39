"""Tests that need a real NVIDIA GPU: the cuda backend under PyTorch and alone.

Every test here is skipped unless ``torch.cuda.is_available()``. Each one runs
its workload in a fresh interpreter (:func:`run_gpu_python`), because
``pyalloc.install()`` must come before the process's first CUDA call and can
happen only once, and because comparing pyalloc with PyTorch's native
allocator needs one process per allocator.

The child finds the same ``pyalloc`` package and ``libpyalloc.so`` as this
process (PYTHONPATH and PYALLOC_LIBRARY are set for it), so a source checkout
with ``PYALLOC_LIBRARY=build/libpyalloc.so`` and an installed wheel both work.

With ``$PYALLOC_GPU_TEST_LOG`` naming a file, each test's outcome, and a
failure's whole report, is appended to it as the test finishes
(:func:`pytest_runtest_logreport`): ``pyalloc gpu-check`` stops pytest when its
time is up, before pytest prints why tests failed, and the log keeps that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest

_GPU_DIR = Path(__file__).resolve().parent

# The child prints its result on a line of its own after this marker, so
# that anything else a library prints cannot be mistaken for it.
RESULT_MARKER = "PYALLOC_GPU_TEST_RESULT "

# cuBLAS picks a nondeterministic reduction unless given a fixed workspace;
# set for both allocators so that their runs differ only in the allocator.
_CUBLAS_WORKSPACE_CONFIG = ":4096:8"

_PRELUDE = f"""
import json as _json


def emit(value):
    print({RESULT_MARKER!r} + _json.dumps(value), flush=True)

"""

# pyalloc.install() comes first, before anything touches CUDA.
_INSTALL = """
import pyalloc
pyalloc.install()
"""


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError as exc:
        return f"torch cannot be imported ({exc})"
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU: torch.cuda.is_available() is False"
    return None


_SKIP_REASON = _skip_reason()

TEST_LOG_ENV = "PYALLOC_GPU_TEST_LOG"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Appends ``OUTCOME nodeid seconds`` to ``$PYALLOC_GPU_TEST_LOG`` as each test finishes.

    One line for each test's call phase (``PASSED``, ``FAILED``, ``SKIPPED``) and for a setup or
    teardown that failed (``ERROR``, pytest's word for it); a failure's report
    (``str(report.longrepr)``) follows its line. The file is opened and closed for each report,
    so what is written is in the file even if pytest is killed right after.
    """
    path = os.environ.get(TEST_LOG_ENV)
    if not path or (report.when != "call" and not report.failed):
        return
    outcome = report.outcome.upper() if report.when == "call" else "ERROR"
    entry = f"{outcome} {report.nodeid} {report.duration:.2f}\n"
    if report.failed:
        entry += str(report.longrepr).rstrip("\n") + "\n\n"
    with open(path, "a", encoding="utf-8", errors="replace") as log:
        log.write(entry)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees every collected item of the session, not only this
    # folder's: mark ours alone.
    if _SKIP_REASON is None:
        return
    marker = pytest.mark.skip(reason=_SKIP_REASON)
    for item in items:
        if _GPU_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(marker)


def _child_environment(allocator: str) -> dict[str, str]:
    import pyalloc

    try:
        library = pyalloc.library_path()
    except pyalloc.PyallocError as exc:
        pytest.fail(f"libpyalloc.so is not built, so no GPU test can run: {exc}")

    env = dict(os.environ)
    package_root = str(Path(pyalloc.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["PYALLOC_LIBRARY"] = library
    # Each run gets its allocator's defaults: no leftover tuning from the
    # environment that launched pytest.
    env.pop("PYALLOC_CONF", None)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYALLOC_PATCH_TORCH", None)
    if allocator == "pyalloc":
        env["PYALLOC_CONF"] = "backend=cuda"
    env["CUBLAS_WORKSPACE_CONFIG"] = _CUBLAS_WORKSPACE_CONFIG
    return env


def run_gpu_python(code: str, allocator: str, timeout: float = 600.0) -> Any:
    """Runs ``code`` in a fresh interpreter and returns the value it ``emit()``s.

    ``allocator`` is ``"pyalloc"`` (``pyalloc.install()`` runs first),
    ``"native"`` (PyTorch's own caching allocator) or ``"none"`` (nothing is
    installed; for tests of pyalloc without torch). The code can call
    ``emit(value)`` with any JSON-serializable value; the last one is returned.
    A child that fails or emits nothing fails the test with its output.
    """
    if allocator not in ("pyalloc", "native", "none"):
        raise ValueError(f"allocator must be pyalloc, native or none, not {allocator!r}")
    script = _PRELUDE + (_INSTALL if allocator == "pyalloc" else "") + textwrap.dedent(code)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_child_environment(allocator),
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the {allocator} child did not finish within {timeout:.0f} s: {exc}")
    results = [
        line[len(RESULT_MARKER) :]
        for line in proc.stdout.splitlines()
        if line.startswith(RESULT_MARKER)
    ]
    if proc.returncode != 0 or not results:
        pytest.fail(
            f"the {allocator} child failed (exit status {proc.returncode}, "
            f"{len(results)} results)\n--- stdout ---\n{proc.stdout[-6000:]}\n"
            f"--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return json.loads(results[-1])


@pytest.fixture
def gpu_python() -> Callable[..., Any]:
    """:func:`run_gpu_python`, as a fixture."""
    return run_gpu_python
