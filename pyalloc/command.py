"""The contract between the ``pyalloc`` command (:mod:`pyalloc.cli`) and the modules that add
subcommands to it.

A module named in ``pyalloc.cli.COMMAND_MODULES`` defines ``register_cli(subparsers)``, which
adds its parser and sets ``handler`` (``Namespace -> exit code``) on it. A handler raises
:class:`UsageError` for a mistake in the command line (one line on stderr, exit status 2) or
``PyallocError`` for a failure (one line, exit status 1).

A module of its own, so that ``python -m pyalloc.cli`` (which runs the CLI as ``__main__``) and
the command modules see one and the same :class:`UsageError`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

Handler = Callable[[argparse.Namespace], int]
Subparsers = Any  # argparse._SubParsersAction[argparse.ArgumentParser]
Register = Callable[[Subparsers], None]

EXIT_USAGE = 2
EXIT_NOT_FOUND = 127  # as shells report a command that does not exist

PYALLOC_EINVAL = 1  # enum pyalloc_status in pyalloc.h


class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit status 2."""


def unwritable(path: Path, makes_folder: bool = False) -> str | None:
    """Why nothing could be written at ``path`` (a file, or with ``makes_folder`` a folder the
    command will make), or None: checked before a long run, whose output would otherwise be lost
    at its end. An existing file is opened for appending (nothing written); otherwise a file is
    made and removed where the first missing part of the path would go (``os.access`` says yes to
    root in ``/proc``)."""
    if not makes_folder and path.is_dir():  # (`stress --json /tmp` ran the whole suite, then failed)
        return "is a folder, not a file"
    if path.is_file():  # written in place by some (write_text): may this user write it?
        try:
            open(path, "ab").close()  # appends nothing, truncates nothing
        except OSError as e:
            return f"cannot write {path} ({e.strerror or e})"
        return None
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing != path and not existing.is_dir():
        return f"{existing} is not a folder"
    folder = existing if existing.is_dir() else existing.parent
    try:
        fd, probe = tempfile.mkstemp(prefix=".pyalloc-write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot write in {folder} ({e.strerror or e})"
    return None
