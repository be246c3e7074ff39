"""gpumemd's command line as an operator meets it (issues 21 and 23): every option explained with
its default, one-line errors that name the input, a warning for a registry no one can publish
in, and `top` without a terminal or in a narrow one. Run as a user would: a subprocess, a pty."""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import select
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from pyalloc.gpumemd.cli import build_parser

from .conftest import Holders, env, gpumemd

SUBCOMMANDS = ["status", "top", "serve", "reap", "trim"]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def test_every_option_of_every_subcommand_says_what_it_does_and_its_default() -> None:
    parser = build_parser()
    subs = _subparsers(parser)
    assert sorted(subs) == sorted(SUBCOMMANDS)
    for name, sub in [("gpumemd", parser), *subs.items()]:
        for action in sub._actions:
            if not action.option_strings or action.dest in ("help", "version"):
                continue
            what = f"{name} {action.option_strings[0]}"
            assert action.help and len(action.help) > 15, what
            if action.nargs != 0:  # an option with a value says its default (store_true ones are off)
                assert "(default:" in action.help, what
        # argparse formats each help for real here: a stray % would raise.
        out = subprocess.run([sys.executable, "-m", "pyalloc.gpumemd", *([] if name == "gpumemd" else [name]),
                              "--help"], capture_output=True, text=True, env=env(), timeout=60)
        assert out.returncode == 0 and "default" in out.stdout, (name, out.stderr)


def test_the_table_columns_are_explained_in_status_help() -> None:
    out = subprocess.run([sys.executable, "-m", "pyalloc.gpumemd", "status", "--help"], capture_output=True,
                         text=True, env=env(), timeout=60)
    for column in ("USED", "ALLOC", "RESV", "CACHED", "LFREE", "SWAP", "OOM", "SM%", "CPU%", "FLAGS"):
        assert f"\n  {column} " in out.stdout, column


def test_version() -> None:
    out = subprocess.run([sys.executable, "-m", "pyalloc.gpumemd", "--version"], capture_output=True, text=True,
                         env=env(), timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("gpumemd ")


@pytest.mark.parametrize("args, named", [
    (["serve", "--listen", "nonsense"], "'nonsense' is not HOST:PORT"),
    (["serve", "--listen", "127.0.0.1:99999"], "'127.0.0.1:99999' is not HOST:PORT"),
    (["serve", "--interval", "soon"], "'soon' is not a duration"),
    (["serve", "--max-per-uid", "0"], "'0' is not a whole number"),
    (["serve", "--interval", "0s"], "'0s' is too short"),
    (["top", "--interval", "5 fortnights"], "'5 fortnights' is not a duration"),
])
def test_a_bad_flag_value_is_one_line_naming_it(args: list[str], named: str, reg_dir: Path) -> None:
    out = gpumemd(*args, reg=reg_dir)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and named in out.stderr and "--help" in out.stderr, out.stderr


def test_a_busy_port_is_one_line_naming_the_address(reg_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = gpumemd("serve", "--listen", f"127.0.0.1:{port}", "--socket", str(tmp_path / "p.sock"), reg=reg_dir)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and f"127.0.0.1:{port}" in out.stderr and "in use" in out.stderr, out.stderr


def test_a_missing_registry_folder_is_a_warning_not_an_empty_success(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    out = gpumemd("status", reg=missing)
    assert out.returncode == 0
    assert f"warning: registry {missing}" in out.stderr and "No such file" in out.stderr
    json_out = gpumemd("status", "--json", reg=missing)
    import json
    assert json.loads(json_out.stdout)["registry"]["problem"].startswith(str(missing))


def test_top_without_a_terminal_is_one_line(reg_dir: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pyalloc.gpumemd", "--registry-dir", str(reg_dir), "--no-nvml",
                          "top"], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env(), timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "needs a terminal" in out.stderr and "Traceback" not in out.stderr


def _read_for(fd: int, seconds: float) -> bytes:
    out = b""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return out


def test_top_at_80_columns_keeps_flags_and_command(holders: Holders) -> None:
    """Issue 23: at 80 columns FLAGS and COMMAND disappeared. The least important columns go first."""
    holders.start("--allocated", str(3 << 20))
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    p = subprocess.Popen([sys.executable, "-m", "pyalloc.gpumemd", "--registry-dir", str(holders.reg_dir),
                          "--no-nvml", "top", "--interval", "0.2s"], stdin=child, stdout=child, stderr=child,
                         env={**env(), "TERM": "xterm"}, close_fds=True)
    os.close(child)
    try:
        screen = b""
        deadline = time.monotonic() + 60
        while b"COMMAND" not in screen and time.monotonic() < deadline:
            screen += _read_for(main, 0.5)
        os.write(main, b"q")
        screen += _read_for(main, 2.0)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(main)
    text = screen.decode(errors="replace")
    assert "FLAGS" in text and "COMMAND" in text and "Traceback" not in text
    assert "LFREE" not in text and "SWAP" not in text  # dropped first, to make room


def test_serve_listens_on_ipv6_loopback(reg_dir: Path, tmp_path: Path) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    import json
    import urllib.request

    d = subprocess.Popen([sys.executable, "-m", "pyalloc.gpumemd", "--registry-dir", str(reg_dir), "--no-nvml",
                          "serve", "--listen", "[::1]:0", "--socket", "none"], stdout=subprocess.PIPE, text=True,
                         env=env())
    try:
        assert d.stdout is not None
        url = json.loads(d.stdout.readline())["metrics"]
        assert url.startswith("http://[::1]:")
        assert b"gpumemd_up" in urllib.request.urlopen(url, timeout=30).read()
    finally:
        d.terminate()
        d.wait(timeout=30)


def test_serve_enforce_without_a_policy_is_refused(reg_dir: Path) -> None:
    # A review saw it start and enforce nothing: the reaper runs only with a policy.
    out = gpumemd("serve", "--enforce", reg=reg_dir)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "serve --enforce: the reaper runs only with --policy" in out.stderr


@pytest.mark.parametrize("command", ["serve", "reap"])
def test_an_audit_log_that_cannot_be_written_is_refused_before_anything_runs(command: str, reg_dir: Path,
                                                                              tmp_path: Path) -> None:
    """A review saw serve start, log one collect-error a pass, and serve gpumemd_up 0 for its
    whole life: the reaper's pass failed on the audit log before the snapshot was kept."""
    policy = tmp_path / "p.toml"
    policy.write_text("")
    (tmp_path / "a-file").write_text("")
    audit = tmp_path / "a-file" / "audit.jsonl"  # its folder is a file
    extra = ["--listen", "127.0.0.1:0", "--socket", str(tmp_path / "p.sock")] if command == "serve" else []
    out = gpumemd(command, "--policy", str(policy), "--audit-log", str(audit), *extra, reg=reg_dir)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and f"--audit-log {audit}: " in out.stderr, out.stderr


def test_a_policy_that_is_not_a_regular_file_is_refused(reg_dir: Path) -> None:
    out = gpumemd("reap", "--policy", "/dev/zero", reg=reg_dir)  # (it hung reading /dev/urandom)
    assert out.returncode == 1 and "policy /dev/zero: not a regular file" in out.stderr, out.stderr


def test_a_socket_path_that_cannot_be_made_is_one_line_naming_it(reg_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    path = tmp_path / "a-file" / "p.sock"
    out = gpumemd("serve", "--listen", "127.0.0.1:0", "--socket", str(path), reg=reg_dir)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and f"--socket {path}: " in out.stderr, out.stderr


@pytest.mark.parametrize("args", [["serve", "--interval", "1000000000d"], ["status", "--cpu-sample", "١s"],
                                  ["serve", "--idle-timeout", "1000000000d"]])
def test_a_duration_past_a_year_or_in_other_digits_is_refused_in_one_line(args: list[str]) -> None:
    """A billion days overflowed the clock in a traceback once serving, or printed Infinity into
    the JSON log; Arabic-Indic digits were read as a number (a review's findings)."""
    done = subprocess.run([sys.executable, "-m", "pyalloc.gpumemd", "--no-nvml", *args], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "is not a duration of at most a year" in done.stderr
