"""The `pyalloc` command line: `pyalloc run` bootstraps every child interpreter,
`pyalloc config` reports the configuration, errors are one line."""

from __future__ import annotations

import json
import re
import os
import signal
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pyalloc
from pyalloc import cli
from pyalloc.pytorch import run as run_command

PACKAGE_ROOT = str(Path(pyalloc.__file__).resolve().parent.parent)
NO_CUDA_WARNING = "pyalloc: warning: CUDA is not available"


def _on_default_path(folder: str) -> bool:
    site_dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return any(Path(d).resolve() == Path(folder) for d in site_dirs)


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment (PYALLOC_LIBRARY, PYTHONPATH) for a child,
    with the pyalloc under test importable and no PYALLOC_CONF of the caller's."""
    env = dict(os.environ)
    env.pop("PYALLOC_CONF", None)
    env.pop("PYALLOC_AUTOINSTALL", None)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    # A development checkout must be put on the path; an installed package is
    # found anyway (and site-packages on PYTHONPATH would precede the stdlib).
    if PACKAGE_ROOT not in paths and not _on_default_path(PACKAGE_ROOT):
        paths.append(PACKAGE_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(overrides)
    return env


def pyalloc_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pyalloc.cli", *args],
        env=env if env is not None else child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_python(code: str, *run_args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`pyalloc run [run_args] -- python -c code`."""
    return pyalloc_cli("run", *run_args, "--", sys.executable, "-c", textwrap.dedent(code), env=env)


def assert_one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pyalloc: error: ")
    return lines[0]


# ---- pyalloc run ----------------------------------------------------------------


def test_run_propagates_child_exit_code_and_output() -> None:
    result = run_python("import sys; print('child ran'); sys.exit(7)")
    assert result.returncode == 7
    assert result.stdout.strip() == "child ran"


def test_run_child_killed_by_signal_reports_that_signal() -> None:
    # pyalloc run execs the command: there is no wrapper process to swallow signals
    result = run_python("import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert result.returncode == -signal.SIGTERM


def test_run_passes_conf_to_child_environment() -> None:
    result = run_python(
        "import os; print(os.environ['PYALLOC_CONF']); print(os.environ['PYALLOC_AUTOINSTALL'])",
        "--conf",
        "backend=host,trace=7",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["backend=host,trace=7", "1"]


def test_run_conf_applies_on_top_of_inherited_pyalloc_conf() -> None:
    result = run_python(
        "import json, pyalloc; c = pyalloc.config(); print(json.dumps([c['backend'], c['trace']]))",
        "--conf",
        "trace=9",
        env=child_env(PYALLOC_CONF="backend=host,capacity=32MiB,trace=3"),
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["host", 9]


def test_run_without_cuda_warns_once_and_program_still_runs() -> None:
    result = run_python(
        """
        import torch, pyalloc
        print("ran", pyalloc.pytorch.install.is_installed(), torch.ones(3).sum().item())
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ran", "False", "3.0"]
    assert result.stderr.count(NO_CUDA_WARNING) == 1
    assert "Traceback" not in result.stderr


def test_run_does_not_import_torch_in_programs_that_never_do() -> None:
    result = run_python("import sys; print('torch' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    assert NO_CUDA_WARNING not in result.stderr


def test_run_bootstraps_grandchild_interpreters() -> None:
    result = run_python(
        """
        import subprocess, sys
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        import torch
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(NO_CUDA_WARNING) == 2


def test_run_chains_to_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nos.environ['SITE_CHAINED'] = 'yes'\n"
    )
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(tmp_path), env["PYTHONPATH"]] if p)
    result = run_python(
        """
        import os, sys, torch
        print(os.environ.get('SITE_CHAINED'), sys.modules['sitecustomize'].__file__)
        """,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    chained, module_file = result.stdout.split()
    assert chained == "yes"
    assert Path(module_file).parent == tmp_path
    assert result.stderr.count(NO_CUDA_WARNING) == 1  # our own hook still armed


def test_run_reports_a_failing_chained_sitecustomize_like_site_does(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("raise RuntimeError('broken site hook')\n")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(tmp_path), env["PYTHONPATH"]] if p)
    result = run_python("print('still ran')", env=env)
    assert result.returncode == 0
    assert result.stdout.strip() == "still ran"
    assert "Error in sitecustomize" in result.stderr
    assert "RuntimeError: broken site hook" in result.stderr


@pytest.mark.parametrize("args", [["run"], ["run", "--"], ["run", "--conf", "trace=1"]])
def test_run_without_command_is_one_line_usage_error(args: list[str]) -> None:
    result = pyalloc_cli(*args)
    assert result.returncode == 2
    assert "missing command" in assert_one_line_error(result)


def test_run_without_command_in_process_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_run_unknown_command_is_one_line_error_127() -> None:
    result = pyalloc_cli("run", "--", "no-such-command-pyalloc-test")
    assert result.returncode == 127
    assert "command not found: no-such-command-pyalloc-test" in assert_one_line_error(result)


def test_run_bad_conf_is_one_line_error_naming_the_key() -> None:
    result = pyalloc_cli("run", "--conf", "bogus_key=1", "--", sys.executable, "-c", "print('ran')")
    assert result.returncode == 2
    assert "bogus_key" in assert_one_line_error(result)
    assert "ran" not in result.stdout


def test_run_bad_conf_value_names_the_key_and_accepted_form() -> None:
    result = pyalloc_cli("run", "--conf", "trace=lots", "--", sys.executable, "-c", "pass")
    assert result.returncode == 2
    line = assert_one_line_error(result)
    assert "trace" in line and "lots" in line


def test_child_environment_puts_bootstrap_first_once() -> None:
    bootstrap = str(run_command.BOOTSTRAP_DIR)
    env = run_command.child_environment({"PYTHONPATH": os.pathsep.join(["/a", bootstrap])}, None)
    assert env["PYTHONPATH"].split(os.pathsep) == [bootstrap, "/a"]
    assert env["PYALLOC_AUTOINSTALL"] == "1"
    assert "PYALLOC_CONF" not in env
    assert (run_command.BOOTSTRAP_DIR / "sitecustomize.py").is_file()


# ---- pyalloc config --------------------------------------------------------------


def test_config_json_prints_configuration_in_force() -> None:
    result = pyalloc_cli("config", "--json", env=child_env(PYALLOC_CONF="backend=host,trace=11"))
    assert result.returncode == 0, result.stderr
    settings = json.loads(result.stdout)
    assert settings["backend"] == "host"
    assert settings["trace"] == 11


def test_a_key_named_twice_takes_the_later_value_as_in_pytorch_cuda_alloc_conf() -> None:
    result = pyalloc_cli("config", "--json", env=child_env(PYALLOC_CONF="backend=sim,trace=11,trace=12"))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert json.loads(result.stdout)["trace"] == 12


def test_config_text_lists_one_key_per_line() -> None:
    result = pyalloc_cli("config", env=child_env(PYALLOC_CONF="backend=sim"))
    assert result.returncode == 0, result.stderr
    rows = dict(line.split(None, 1) for line in result.stdout.strip().splitlines())
    assert rows["backend"] == "sim"
    assert set(rows) == set(json.loads(pyalloc_cli("config", "--json").stdout))


def test_config_bad_conf_is_one_line_error_naming_the_key() -> None:
    result = pyalloc_cli("config", "--conf", "capacity=big")
    assert result.returncode == 2
    assert "capacity" in assert_one_line_error(result)


def test_config_prints_sizes_in_binary_units_and_the_capacity_in_force() -> None:
    # Issue 23: raw bytes and "capacity 0" told a user nothing.
    result = pyalloc_cli("config", env=child_env(PYALLOC_CONF="backend=host,max_cached=1.5GiB"))
    assert result.returncode == 0, result.stderr
    rows = dict(line.split(None, 1) for line in result.stdout.strip().splitlines())
    assert rows["capacity"] == "4 GiB (4294967296 bytes: the backend's default)"
    assert rows["max_cached"] == "1.5 GiB (1610612736 bytes)"
    assert rows["large_segment"] == "20 MiB (20971520 bytes)"
    sim = pyalloc_cli("config", env=child_env(PYALLOC_CONF="backend=sim,capacity=2GB"))
    assert dict(line.split(None, 1) for line in sim.stdout.splitlines())["capacity"] == "1.86 GiB (2000000000 bytes)"


@pytest.mark.parametrize("conf", ["max_cache=8GiB", "vmm=maybe"])
def test_a_bad_pyalloc_conf_is_one_line_and_nothing_that_looks_like_success(conf: str) -> None:
    # Issue 23: `pyalloc config` printed the default table as if in force; `pyalloc run` ran the
    # program and exited 0; the library printed a second line of its own.
    config = pyalloc_cli("config", env=child_env(PYALLOC_CONF=conf))
    assert config.returncode == 1 and config.stdout == ""
    assert assert_one_line_error(config).startswith(f"pyalloc: error: $PYALLOC_CONF: ")
    ran = run_python("print('the program ran')", env=child_env(PYALLOC_CONF=conf))
    assert ran.returncode == 2 and "the program ran" not in ran.stdout
    line = assert_one_line_error(ran)
    assert conf.split("=")[0] in line and line.endswith("(nothing was run)")


def test_install_refuses_a_bad_pyalloc_conf_at_once() -> None:
    # Before: the error showed at the first allocation, as a traceback from inside torch.
    code = "import pyalloc\ntry:\n    pyalloc.install()\nexcept pyalloc.PyallocError as e:\n    print(e)\n"
    result = subprocess.run([sys.executable, "-c", code], env=child_env(PYALLOC_CONF="vmm=maybe"),
                            capture_output=True, text=True, timeout=300)
    assert result.stdout.startswith("PYALLOC_CONF: bad value 'maybe' for vmm"), result.stdout + result.stderr


def test_a_mistyped_flag_is_one_line_that_suggests_the_flag() -> None:
    # Issue 23: `pyalloc stress --quik` printed the top-level usage and no suggestion.
    result = pyalloc_cli("stress", "--quik")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "pyalloc stress: error: unrecognized argument: --quik (did you mean --quick?)"
    far = pyalloc_cli("config", "--zzzzzz")
    assert far.stderr.strip() == "pyalloc config: error: unrecognized argument: --zzzzzz; see pyalloc config --help"


def test_version_names_the_package_and_its_library() -> None:
    result = pyalloc_cli("--version")
    assert result.returncode == 0
    assert re.fullmatch(r"pyalloc \S+ \(library \S+\)\n", result.stdout), result.stdout


def test_a_command_that_needs_no_torch_does_not_import_it() -> None:
    """Building the parser imported torch to list the workloads: ~0.9 s for every command, and a
    Ctrl-C in that second was a traceback (a review's finding)."""
    code = ("import sys; from pyalloc.cli import main; status = main(['config', '--json']); "
            "print(status, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=child_env(PYALLOC_CONF="backend=host"))
    assert done.stdout.strip().splitlines()[-1] == "0 False", (done.stdout, done.stderr)
