"""The optional packages of the training side, and the one line that says how to install them.

The base install (``pip install pyalloc``, or ``pyalloc[gpumemd]``) is gpumemd, the ``pyalloc``
command and the allocator's bindings: no torch, matplotlib or tqdm, so that a monitoring node
does not get the training stack. The ``torch`` extra (``pip install "pyalloc[torch]"``) adds
them. A code path that needs one of them imports it through :func:`require` when it runs, never
at module level, and gets :class:`MissingDependency` when it is absent: an ``ImportError`` whose
message is one line naming the install. The ``pyalloc`` command prints that line and exits 1.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

EXTRA = "torch"
INSTALL = f'pip install "pyalloc[{EXTRA}]"'
# The packages of the extra, and what each is for.
OPTIONAL = {"torch": "PyTorch", "matplotlib": "the stress plot", "tqdm": "progress bars"}


class MissingDependency(ImportError):
    """A package of the ``torch`` extra that a feature needs is not installed."""


def missing_message(package: str, feature: str) -> str:
    return (f"{feature} needs {package}, which is not installed: {INSTALL} installs it "
            f"(or pip install {package})")


def require(module: str, feature: str) -> ModuleType:
    """``importlib.import_module(module)``, or MissingDependency naming the install when the
    package is absent. A package that is there but fails to import keeps its own error."""
    package = module.partition(".")[0]
    try:
        importlib.import_module(package)
    except ModuleNotFoundError as exc:
        if exc.name != package:  # something the package itself imports: a broken install
            raise
        raise MissingDependency(missing_message(package, feature), name=package) from None
    return importlib.import_module(module)


def available(package: str) -> bool:
    """Whether ``package`` can be imported, without importing it."""
    return importlib.util.find_spec(package) is not None


def missing_from(exc: BaseException) -> str | None:
    """The optional package whose absence raised ``exc`` (a ModuleNotFoundError), else None."""
    if isinstance(exc, ModuleNotFoundError) and exc.name in OPTIONAL:
        return exc.name
    return None
