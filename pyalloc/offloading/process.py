"""The process-wide offload session that ``pyalloc run --offload`` starts (issue 6).

Note [Process-wide session]
    ``pyalloc run --offload[=BUDGET]`` sets ``$PYALLOC_OFFLOAD`` (``auto`` or a size); the
    bootstrap (``pyalloc/pytorch/_bootstrap/sitecustomize.py``) calls :func:`start_from_environment`
    right after ``import torch`` completes. That enters an :class:`ActivationOffload` session
    on the main thread and never leaves it: its saved-tensor hooks and its call-recording
    ``TorchFunctionMode`` stay on the main thread's stacks for the life of the program.

    Step boundaries: ``torch.autograd.backward`` (which ``Tensor.backward`` calls) and
    ``torch.autograd.grad`` are wrapped; when the outermost such call returns on the main
    thread, the session ends the step as the ``with`` form's exit does
    (:meth:`ActivationOffload.end_step`): call records are dropped, so a tensor carried from one
    step into the next (an RNN state, a running loss) does not chain every step's inputs to it.

    DataLoader workers inherit the session (fork) or start their own (spawn, the bootstrap runs
    there too); they never run backward, so the wrapped worker loop ends the session first.

    ``$PYALLOC_OFFLOAD_STATS=PATH`` writes the session's stats as JSON at exit (``{pid}`` in
    PATH becomes the process id, for launchers that start several processes).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import threading
from typing import Any, Callable, Mapping

import torch

from ..core import parse_budget
from .session import ActivationOffload

__all__ = ["OFFLOAD_ENV", "STATS_ENV", "session", "start", "start_from_environment", "stop"]

OFFLOAD_ENV = "PYALLOC_OFFLOAD"
STATS_ENV = "PYALLOC_OFFLOAD_STATS"

_session: ActivationOffload | None = None
_owner: int | None = None  # threading.get_ident() of the thread the session lives on
_pid: int | None = None  # the process that started it (a forked child inherits _session)
_stats_path: str | None = None
_originals: dict[tuple[Any, str], Any] = {}  # (owner object, attribute) -> the wrapped original
_depth = threading.local()  # nesting of backward/grad calls, per thread


def session() -> ActivationOffload | None:
    """The process-wide session, if this process started one."""
    return _session if _pid == os.getpid() else None


def start(budget: int | str | None, *, stats_path: str | None = None, **options: Any) -> ActivationOffload:
    """Enters a session on the calling thread for the rest of the program; see
    Note [Process-wide session]. ``stats_path``: write the stats there as JSON at exit.
    ``options`` go to :class:`ActivationOffload`."""
    global _session, _owner, _pid, _stats_path
    if session() is not None:
        raise RuntimeError("the process-wide offload session is already running")
    s = ActivationOffload(budget, **options)
    s._process_wide = True
    s.__enter__()
    _session, _owner, _pid, _stats_path = s, threading.get_ident(), os.getpid(), stats_path
    _wrap(torch.autograd, "backward", _step_boundary)
    _wrap(torch.autograd, "grad", _step_boundary)
    try:
        from torch.utils.data._utils import worker
    except ImportError:  # pragma: no cover - a torch without the DataLoader's worker module
        pass
    else:
        _wrap(worker, "_worker_loop", _leave_in_worker)
    s._passthrough = s._passthrough | {torch.autograd.backward, torch.autograd.grad}  # the wrappers
    if stats_path:
        atexit.register(_write_stats)
    return s


def stop() -> None:
    """Ends the process-wide session: leaves it (on its thread) and unwraps what it wrapped;
    no stats are written at exit.

    Touches no device: a forked DataLoader worker calls it, where CUDA must not be used.
    """
    global _session, _owner, _pid, _stats_path
    s, owner = _session, _owner
    _session = _owner = _pid = _stats_path = None
    atexit.unregister(_write_stats)
    for (obj, name), original in _originals.items():
        setattr(obj, name, original)
    _originals.clear()
    if s is None:
        return
    s._inert = True
    if owner == threading.get_ident():  # else: a child forked from another thread, not on its stacks
        s._leave_thread()


def start_from_environment(environ: Mapping[str, str] | None = None) -> ActivationOffload | None:
    """What the bootstrap calls after ``import torch``: starts the session ``$PYALLOC_OFFLOAD``
    asks for, on the main thread. Raises PyallocError for a bad value."""
    env = os.environ if environ is None else environ
    text = env.get(OFFLOAD_ENV, "").strip()
    if not text:
        return None
    budget = parse_budget(text)
    if threading.current_thread() is not threading.main_thread():
        sys.stderr.write("pyalloc: warning: torch was first imported outside the main thread; "
                         "--offload applies to the main thread only and is off\n")
        return None
    from ..pytorch.install import is_installed

    installed = is_installed()
    if budget is None and not installed:
        sys.stderr.write("pyalloc: warning: --offload without a budget evicts only when pyalloc's "
                         "allocator runs short, which needs CUDA: give a budget (--offload=512MiB)\n")
    return start(budget, stats_path=env.get(STATS_ENV) or None, pressure_callback=installed)


# ---- wrappers ------------------------------------------------------------------------------


def _wrap(obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(obj, name)
    _originals[(obj, name)] = original
    setattr(obj, name, make(original))


def _step_boundary(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.autograd.backward``/``grad``: the outermost call on the session's thread ends
    the step. Nested calls (``Tensor.backward`` goes through ``torch.autograd.backward``, the
    session's mode dispatches it once more, reentrant checkpointing runs backward inside
    backward) don't."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.n = depth
            s = _session
            if depth == 0 and s is not None and _owner == threading.get_ident() and _pid == os.getpid() \
                    and not _tracing():
                s.end_step()

    return wrapper


def _tracing() -> bool:
    """torch.compile traces backward with ``autograd.grad`` (AOTAutograd): not a step's end."""
    context = getattr(getattr(torch, "_guards", None), "TracingContext", None)
    return context is not None and context.try_get() is not None


def _leave_in_worker(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The DataLoader's worker loop: ends the session first. ``functools.wraps`` keeps the
    loop's module and name, so a spawned worker unpickles it by reference as before."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stop()
        return fn(*args, **kwargs)

    return wrapper


def _write_stats() -> None:
    s, path = session(), _stats_path
    if s is None or not path:
        return
    path = path.replace("{pid}", str(os.getpid()))
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        stats: dict[str, Any] = dict(s.stats())
        if s._check is not None:  # $PYALLOC_OFFLOAD_CHECK (Note [Recompute check] in check.py)
            stats["recompute_mismatches"] = s.recompute_mismatches()
        with open(tmp, "w") as f:
            json.dump(stats, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        sys.stderr.write(f"pyalloc: warning: cannot write the offload stats to {path}: {exc}\n")
        try:
            os.unlink(tmp)  # what a failed replace left (a folder at the path)
        except OSError:
            pass
