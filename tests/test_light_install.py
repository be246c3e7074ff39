"""The light install (issue 23): gpumemd and the pyalloc command without torch, matplotlib or tqdm.

The fast tests run the commands as a user runs them, in a subprocess in which the three packages
cannot be imported (``sys.modules[name] = None``, what Python does for a package that is not
there); each command that needs one says in one line what to install and exits 1, with no
traceback, and the commands that need none work. The slow test is the real thing: a fresh venv,
the wheel and its declared dependencies, no torch (tools/light_install_smoke.sh, also a step of
.ci/run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL = 'pip install "pyalloc[torch]"'

# Runs `pyalloc ARGS` (or `gpumemd ARGS` with -g) where torch, matplotlib and tqdm are absent.
WITHOUT = """
import sys
sys.modules.update(torch=None, matplotlib=None, tqdm=None)
if sys.argv[1] == "-g":
    from pyalloc.gpumemd.cli import main
    del sys.argv[1]
else:
    from pyalloc.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _without_torch(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-c", WITHOUT, *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=cwd)


@pytest.mark.parametrize("args, needs", [
    (["record", "mlp", "--tiny"], "pyalloc record MODEL needs torch"),
    (["record", "--meta", "llama1b"], "pyalloc record --meta needs torch"),
    (["doctor", "--", sys.executable, "-c", "pass"], "pyalloc doctor needs torch"),
    (["stress", "--quick", "--workloads", "mlp", "--plot", "stress.png"], "pyalloc stress --plot needs matplotlib"),
])
def test_a_command_that_needs_the_torch_extra_says_in_one_line_what_to_install(
        args: list[str], needs: str, tmp_path: Path) -> None:
    done = _without_torch(*args, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"pyalloc: error: {needs}, which is not installed: {INSTALL}"), done.stderr
    assert not (tmp_path / "stress.png").exists()


def test_stress_without_matplotlib_and_tqdm_runs_with_no_plot_and_says_why(tmp_path: Path) -> None:
    done = _without_torch("stress", "--quick", "--workloads", "mlp", "--out", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if line.startswith("pyalloc stress: note:")]
    assert len(notes) == 2 and all(INSTALL in n for n in notes), done.stderr
    assert "matplotlib" in notes[0] and "tqdm" in notes[1]
    assert "plot:   (none: matplotlib is not installed)" in done.stdout
    assert (tmp_path / "stress-report.json").exists() and not list(tmp_path.glob("*.png"))


def test_gpumemd_and_the_pyalloc_command_work_without_torch(tmp_path: Path) -> None:
    for args in (["-g", "--version"], ["-g", "--no-nvml", "--registry-dir", str(tmp_path), "status", "--json"],
                 ["--version"], ["stress", "--help"], ["record", "--help"]):
        done = _without_torch(*args, cwd=tmp_path)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr)


def test_the_python_api_that_needs_torch_raises_an_import_error_naming_the_install() -> None:
    code = """
import sys
sys.modules.update(torch=None)
import pyalloc
for call in (lambda: pyalloc.doctor, lambda: pyalloc.offload, pyalloc.install, pyalloc.patch_torch_memory_api):
    try:
        call()
    except pyalloc.MissingDependency as exc:
        assert isinstance(exc, ImportError) and exc.name == "torch"
        print(exc)
"""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(" needs ")[0] for line in lines] == [
        "pyalloc.doctor", "pyalloc.offload", "pyalloc.install()", "pyalloc's PyTorch memory API"]
    assert all(line.endswith(f"which is not installed: {INSTALL} installs it (or pip install torch)")
               for line in lines)


@pytest.mark.slow
def test_the_wheel_installs_and_runs_in_a_fresh_venv_without_torch() -> None:
    done = subprocess.run([str(ROOT / "tools" / "light_install_smoke.sh")], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "light-install: passed" in done.stdout
