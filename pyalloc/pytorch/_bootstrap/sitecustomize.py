"""Installs pyalloc in every Python process started under ``pyalloc run``.

``pyalloc run`` puts this directory first on PYTHONPATH and sets
``PYALLOC_AUTOINSTALL=1``; Python's ``site`` module then imports this file at
interpreter start, in the command and in every Python process it starts
(torchrun workers, spawned DataLoader workers, ...), with no change to the
program.

Why it waits for ``import torch`` instead of installing at once: importing
torch takes seconds, and most Python processes a launcher starts (pip, compile
helpers, shell tools) never use it. A one-shot import hook installs pyalloc
right after torch's own import finishes, before the program's next line: CUDA
cannot have been initialized yet, which is what install() needs.

On a machine without CUDA it prints one warning and lets the program run with
PyTorch's own allocator. Any other failure to install (library missing,
configuration refused) prints one line and exits with status 1: the user asked
for pyalloc, and running silently without it would mislead.

``pyalloc run --offload[=BUDGET]`` also sets ``PYALLOC_OFFLOAD``: then, after
the install (or the warning: offload works on CPU too), the same hook starts
the process-wide offload session on the main thread
(``pyalloc/offloading/process.py``, Note [Process-wide session]).

``pyalloc doctor`` sets ``PYALLOC_DOCTOR`` (a report path) instead of, or besides,
``PYALLOC_AUTOINSTALL``: the same hook then starts the doctor on the thread that imported
torch (``pyalloc/diagnosis/process.py``), last, so that it sees the offload session's work as
the program's.

Then it chains to the ``sitecustomize`` this one shadows, if any, so a site's
or a virtual environment's own customization still runs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Sequence

AUTOINSTALL_ENV = "PYALLOC_AUTOINSTALL"
OFFLOAD_ENV = "PYALLOC_OFFLOAD"  # pyalloc.offloading.process.OFFLOAD_ENV
DOCTOR_ENV = "PYALLOC_DOCTOR"  # pyalloc.diagnosis.process.DOCTOR_ENV

_HERE = os.path.dirname(os.path.abspath(__file__))
# The folder holding the pyalloc package that this file belongs to
# (this file is pyalloc/pytorch/_bootstrap/sitecustomize.py).
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))


def _import_pyalloc() -> ModuleType:
    """The pyalloc package this bootstrap belongs to (not another one on sys.path)."""
    existing = sys.modules.get("pyalloc")
    if existing is not None:
        return existing
    package_dir = os.path.join(_PACKAGE_ROOT, "pyalloc")
    spec = importlib.util.spec_from_file_location(
        "pyalloc",
        os.path.join(package_dir, "__init__.py"),
        submodule_search_locations=[package_dir],
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"pyalloc: cannot load the package from {package_dir}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["pyalloc"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("pyalloc", None)
        raise
    return module


def _install_into_torch() -> None:
    """Runs right after ``import torch`` completes."""
    import torch

    if os.environ.get(AUTOINSTALL_ENV) == "1":
        _install_pyalloc(torch)
    if os.environ.get(OFFLOAD_ENV, "").strip():
        _start_offload()
    if os.environ.get(DOCTOR_ENV, "").strip():
        _start_doctor()


def _install_pyalloc(torch: ModuleType) -> None:
    try:
        pyalloc = _import_pyalloc()
        reason = importlib.import_module("pyalloc.pytorch.install").cuda_unavailable_reason(torch)
        if reason is not None:
            sys.stderr.write(
                f"pyalloc: warning: CUDA is not available ({reason}); "
                f"the program runs with PyTorch's own allocator\n"
            )
        else:
            pyalloc.install()
    except Exception as exc:  # PyallocError, or a broken installation
        sys.stderr.write(f"pyalloc: error: cannot install pyalloc: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None


def _start_offload() -> None:
    try:
        importlib.import_module("pyalloc.offloading.process").start_from_environment()
    except Exception as exc:  # a bad $PYALLOC_OFFLOAD (pyalloc run validates --offload)
        sys.stderr.write(f"pyalloc: error: cannot start the offload session: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None


def _start_doctor() -> None:
    try:
        _import_pyalloc()
        importlib.import_module("pyalloc.diagnosis.process").start_from_environment()
    except Exception as exc:
        sys.stderr.write(f"pyalloc: error: cannot start the doctor: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None


class _InstallAfterTorchImport(importlib.abc.MetaPathFinder):
    """One-shot finder: finds torch through the other finders, then wraps its loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: Any = None
    ) -> Any:
        if fullname != "torch":
            return None
        _remove_hook()
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_install(module: ModuleType) -> None:
            try:
                exec_module(module)
            finally:
                try:
                    del loader.exec_module  # back to the class's method
                except AttributeError:
                    pass
            _install_into_torch()

        loader.exec_module = exec_then_install
        return spec


_hook = _InstallAfterTorchImport()


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_hook)
    except ValueError:
        pass


def _arm_autoinstall() -> None:
    if os.environ.get(AUTOINSTALL_ENV) != "1" and not os.environ.get(DOCTOR_ENV, "").strip():
        return
    if "torch" in sys.modules:  # imported by an earlier startup hook (.pth file)
        _install_into_torch()
    else:
        sys.meta_path.insert(0, _hook)


def _same_dir(entry: str) -> bool:
    try:
        return os.path.realpath(entry or os.curdir) == os.path.realpath(_HERE)
    except (OSError, ValueError):
        return False


def _chain_next_sitecustomize() -> None:
    """Imports the sitecustomize module this one shadows, reporting errors as site.py does."""
    sys.path[:] = [entry for entry in sys.path if not _same_dir(entry)]
    this = sys.modules.pop("sitecustomize", None)
    try:
        try:
            importlib.import_module("sitecustomize")
        except ImportError as exc:
            if exc.name != "sitecustomize":
                raise
            if this is not None:  # there is none further along sys.path
                sys.modules["sitecustomize"] = this
    except Exception as err:
        if this is not None and "sitecustomize" not in sys.modules:
            sys.modules["sitecustomize"] = this
        if sys.flags.verbose:
            sys.excepthook(*sys.exc_info())
        else:
            sys.stderr.write(
                "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                f"{err.__class__.__name__}: {err}\n"
            )


_arm_autoinstall()
_chain_next_sitecustomize()
