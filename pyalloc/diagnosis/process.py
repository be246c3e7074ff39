"""The doctor that ``pyalloc doctor`` starts in every Python process of the command.

``pyalloc doctor`` sets ``$PYALLOC_DOCTOR`` to a report path (``{pid}`` in it becomes the
process id) and puts pyalloc's bootstrap first on PYTHONPATH (``pyalloc/pytorch/run.py``); the
bootstrap calls :func:`start_from_environment` right after ``import torch`` completes, on the
thread that imported it. From then on a :class:`~.session.Doctor` watches that thread and the
threads started after it (Note [Doctor's threads]); an uncaught exception is recorded through
``sys.excepthook`` (before Python prints its traceback, while its frames still hold the
program's tensors: an OOM's breakdown is taken there), and at exit the report is written as
JSON for the command to print.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from types import TracebackType
from typing import Any, Mapping

from .session import Doctor

DOCTOR_ENV = "PYALLOC_DOCTOR"  # the report path; {pid} becomes the process id
STEPS_ENV = "PYALLOC_DOCTOR_STEPS"

_doctor: Doctor | None = None
_path: str | None = None
_pid: int | None = None


def start_from_environment(environ: Mapping[str, str] | None = None) -> Doctor | None:
    global _doctor, _path, _pid
    env = os.environ if environ is None else environ
    path = env.get(DOCTOR_ENV, "").strip()
    if not path or (_doctor is not None and _pid == os.getpid()):
        return None
    steps_text = env.get(STEPS_ENV, "").strip()
    steps = int(steps_text) if steps_text else None
    if threading.current_thread() is not threading.main_thread():
        sys.stderr.write("pyalloc: warning: torch was first imported outside the main thread; "
                         "the doctor watches the main thread only and is off\n")
        return None
    _doctor = Doctor(steps=steps, print_report=False).start()
    _path, _pid = path.replace("{pid}", str(os.getpid())), os.getpid()
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if _doctor is not None and _pid == os.getpid():
            try:
                _doctor.record_exception(exc)
            except Exception:
                pass
        previous(kind, exc, tb)

    sys.excepthook = excepthook
    atexit.register(_write_report)
    return _doctor


def _write_report() -> None:
    doctor, path = _doctor, _path
    if doctor is None or path is None or _pid != os.getpid():
        return
    try:
        doctor.stop()
        report: dict[str, Any] = doctor.build_report()
        report["parent_pid"] = os.getppid()
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, path)
    except Exception as exc:  # never turn a program's exit into a traceback of ours
        sys.stderr.write(f"pyalloc: error: doctor: cannot write the report: {exc}\n")
