"""``pyalloc doctor``: runs a command with the doctor in its Python processes, then reports.

The child gets ``pyalloc run``'s environment (the bootstrap first on PYTHONPATH), without
installing pyalloc unless ``--pyalloc`` asks, plus ``$PYALLOC_DOCTOR``: a report path in a
private temporary folder, one file per process (``{pid}``). The command runs to its end (or
until ``--steps`` iterations), its own output and traceback appear as usual, and then the
report is printed: as text, or with ``--json`` as one JSON object on stdout (the program's own
stdout then goes to stderr, so stdout stays machine-readable). The exit status is the
command's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .._deps import MissingDependency, available, missing_message
from ..command import EXIT_NOT_FOUND, Subparsers, UsageError

DOCTOR_ENV = "PYALLOC_DOCTOR"  # process.DOCTOR_ENV (not imported: it needs torch)
STEPS_ENV = "PYALLOC_DOCTOR_STEPS"

_USAGE = "pyalloc doctor [--json] [--steps N] [--pyalloc] -- CMD ARGS..."


def register_cli(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="run a training script and report why memory grows, who holds it, and what to change",
        description=(
            "Runs CMD (e.g. python train.py) unchanged and reports: allocation sites whose live "
            "tensors grow from one iteration (optimizer step) to the next, with the reason; who "
            "holds memory at the peak (parameters, gradients, optimizer state, activations by "
            "module, other); per-device peaks; on an out-of-memory error, the breakdown at the "
            "failing request and advice ranked by the bytes each change saves. "
            f"Usage: {_USAGE}"
        ),
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--steps", metavar="N", help="stop the program after N iterations")
    parser.add_argument("--pyalloc", action="store_true",
                        help="install pyalloc as PyTorch's CUDA allocator too (as pyalloc run does)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD ARGS...")
    parser.set_defaults(handler=_doctor)


def _parse_steps(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        steps = int(text)
    except ValueError:
        raise UsageError(f"doctor: --steps must be a positive integer, got {text!r}") from None
    if steps < 1:
        raise UsageError(f"doctor: --steps must be a positive integer, got {text!r}")
    return steps


def _doctor(args: argparse.Namespace) -> int:
    from ..pytorch.run import child_environment, validate_conf

    command: list[str] = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError(f"doctor: missing command (usage: {_USAGE})")
    steps = _parse_steps(args.steps)
    if not available("torch"):  # the doctor runs inside the program's torch: none here, none there
        raise MissingDependency(missing_message("torch", "pyalloc doctor"))
    if args.pyalloc:  # the program's allocator is pyalloc, configured by $PYALLOC_CONF: as pyalloc run
        validate_conf(None)
    folder = Path(tempfile.mkdtemp(prefix="pyalloc-doctor-"))
    try:
        env = child_environment(dict(os.environ), None)
        if not args.pyalloc:
            env.pop("PYALLOC_AUTOINSTALL", None)
        env[DOCTOR_ENV] = str(folder / "report.{pid}.json")
        if steps is not None:
            env[STEPS_ENV] = str(steps)
        else:
            env.pop(STEPS_ENV, None)
        sys.stdout.flush()
        try:
            child = subprocess.Popen(command, env=env, stdout=sys.stderr if args.json else None)
        except FileNotFoundError:
            print(f"pyalloc: error: doctor: command not found: {command[0]}", file=sys.stderr)
            return EXIT_NOT_FOUND
        except OSError as exc:
            print(f"pyalloc: error: doctor: cannot execute {command[0]}: {exc.strerror}", file=sys.stderr)
            return 126
        try:
            status = child.wait()
        except KeyboardInterrupt:  # the child got the same Ctrl-C; let it write its report
            status = child.wait()
        reports = _read_reports(folder, child.pid)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if status < 0:
        status = 128 - status
    if not reports:
        print(f"pyalloc: error: doctor: no report: {' '.join(command)} exited with status {status} "
              "without a Python process importing torch", file=sys.stderr)
        return status or 1
    from .report import format_report, merge

    report = merge(reports)
    report["command"] = command
    report["exit_status"] = status
    sys.stderr.flush()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report), end="")
    return status


def _read_reports(folder: Path, child_pid: int) -> list[dict[str, Any]]:
    """The reports of the command's processes: its own, and any other that saw iterations
    (torchrun's workers), not helper processes that merely imported torch."""
    reports = []
    for path in sorted(folder.glob("report.*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if report.get("pid") == child_pid or report.get("iterations") or report.get("crash"):
            reports.append(report)
    reports.sort(key=lambda r: (r.get("pid") != child_pid, r.get("pid", 0)))
    return reports
