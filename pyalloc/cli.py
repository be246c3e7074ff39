"""The ``pyalloc`` command line.

Subcommands are registered, not hard-wired: each is a function that adds its
parser to the subparsers and sets ``handler`` (``Namespace -> exit code``) on
it (the contract is :mod:`pyalloc.command`). Commands defined here are in :data:`BUILTIN_COMMANDS`; a command that lives
in a subpackage (``run``, ``replay``, ``stress``, ...) is added by naming its
module in :data:`COMMAND_MODULES`: it must define
``register_cli(subparsers) -> None``. Modules are imported only when the CLI
runs, so a heavy command costs nothing to the others.

Errors are one line on stderr (``pyalloc: error: ...``) and a non-zero exit,
never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import importlib
import json
import os
import sys
from typing import Any, Sequence

from ._deps import MissingDependency, missing_from, missing_message
from ._lib import PyallocError
from .command import EXIT_USAGE, PYALLOC_EINVAL, Handler, Register, Subparsers, UsageError

# Modules defining `register_cli(subparsers)`; add one here to add commands.
COMMAND_MODULES: list[str] = [
    "pyalloc.pytorch.run",
    "pyalloc.traces.stress",
    "pyalloc.traces.replay",
    "pyalloc.traces.record",
    "pyalloc.traces.selftest",
    "pyalloc.gpucheck.run",
    "pyalloc.diagnosis.run",
]

# ---- pyalloc config -----------------------------------------------------------


def _register_config(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "config",
        help="print the configuration in force",
        description="Prints the configuration in force: defaults, then $PYALLOC_CONF, then --conf.",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--conf", metavar="CONF", help="settings to apply first (key=value,...)")
    parser.set_defaults(handler=_config)


# Keys whose values are sizes: printed in binary units, with the bytes.
SIZE_KEYS = frozenset({"capacity", "small_segment", "large_segment", "max_cached", "extent"})


def _config(args: argparse.Namespace) -> int:
    from .core import config, configure, startup_error

    error = startup_error()
    if error is not None and error.startswith("PYALLOC_CONF"):
        # Nothing of $PYALLOC_CONF is in force: a table of defaults would look like success.
        print(f"pyalloc: error: ${error}", file=sys.stderr)
        return 1
    if args.conf:
        try:
            configure(args.conf)
        except PyallocError as exc:
            if exc.code == PYALLOC_EINVAL:
                raise UsageError(f"--conf: {exc}") from None
            raise
    settings = config()
    error = startup_error()
    if args.json:
        print(json.dumps(settings, indent=2, sort_keys=True))
    else:
        width = max((len(k) for k in settings), default=0)
        for key, value in settings.items():
            print(f"{key:<{width}}  {_format_value(key, value, running=error is None)}")
    if error:
        # A backend that cannot start here (no GPU driver) is a fact about this machine: say so.
        print(f"pyalloc: the allocator is not running: {error}", file=sys.stderr)
    return 0


def _format_value(key: str, value: Any, running: bool) -> str:
    from .core import memory_info
    from .sizes import format_size

    if isinstance(value, bool):
        return "1" if value else "0"
    if key == "capacity" and value == 0:
        if not running:
            return "0 (the backend's default: the device's memory)"
        total = memory_info(0)["device_total"]
        return f"{format_size(total)} ({total} bytes: the backend's default)"
    if key in SIZE_KEYS and isinstance(value, int):
        return format_size(value) if value < 1024 else f"{format_size(value)} ({value} bytes)"
    return str(value)


# ---- main ---------------------------------------------------------------------

BUILTIN_COMMANDS: list[Register] = [_register_config]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyalloc",
        description="pyalloc: a caching, stream-ordered GPU memory allocator for PyTorch",
    )
    parser.add_argument("--version", action=_Version, help="print the version of the package and its library")
    subparsers = parser.add_subparsers(dest="command_name", metavar="COMMAND")
    subparsers.required = True
    for register in BUILTIN_COMMANDS:
        register(subparsers)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register_cli(subparsers)
    return parser


class _Version(argparse.Action):
    """--version: the package's and the loaded library's (they differ only in a broken install)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from importlib.metadata import PackageNotFoundError, version

        from .core import version as library_version

        try:
            package = version("pyalloc")
        except PackageNotFoundError:
            package = "(not installed)"
        try:
            library = library_version()
        except (OSError, PyallocError) as exc:
            library = f"not loaded: {exc}"
        print(f"pyalloc {package} (library {library})")
        parser.exit(0)


def _unrecognized(parser: argparse.ArgumentParser, command: str | None, unknown: list[str]) -> str:
    """One line for arguments no parser took, with the closest option of the command's own."""
    where = parser
    if command is not None:
        for action in parser._actions:  # argparse keeps the subparsers here and nowhere public
            if isinstance(action, argparse._SubParsersAction) and command in action.choices:
                where = action.choices[command]
    options = [o for a in where._actions for o in a.option_strings]
    first = unknown[0].split("=", 1)[0]
    close = difflib.get_close_matches(first, options, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else f"; see pyalloc {command or ''} --help".replace("  ", " ")
    return f"{where.prog}: error: unrecognized argument{'s' if len(unknown) > 1 else ''}: {' '.join(unknown)}{hint}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pyalloc`` console script; returns the exit status."""
    # The commands report a bad $PYALLOC_CONF themselves, in one line: the library stays quiet.
    os.environ["PYALLOC_CLI"] = "1"
    try:
        parser = build_parser()
        args, unknown = parser.parse_known_args(list(argv) if argv is not None else None)
    except KeyboardInterrupt:
        return 130
    if unknown:
        print(_unrecognized(parser, getattr(args, "command_name", None), unknown), file=sys.stderr)
        return EXIT_USAGE
    handler: Handler = args.handler
    try:
        status = int(handler(args))
        sys.stdout.flush()  # a full disk under `> file` shows here, not at exit
        return status
    except UsageError as exc:
        print(f"pyalloc: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PyallocError as exc:
        print(f"pyalloc: error: {exc}", file=sys.stderr)
        return 1
    except MissingDependency as exc:  # a package of the torch extra (pyalloc/_deps.py)
        print(f"pyalloc: error: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        package = missing_from(exc)
        if package is None:
            raise
        # a path that imported it without require(): the same one line
        print(f"pyalloc: error: {missing_message(package, f'pyalloc {args.command_name}')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`pyalloc config | head -1`): stop quietly, as a shell tool does,
        # and keep Python from complaining again when it flushes stdout at exit.
        _drop_stdout()
        return 141  # 128 + SIGPIPE
    except OSError as exc:
        # What no command caught: writing its output failed (`> /dev/full`: no space left), or a
        # file it did not expect to be unable to read. One line, as for any other error.
        if exc.filename is None and exc.errno in (errno.ENOSPC, errno.EIO, errno.EFBIG, errno.EDQUOT):
            _drop_stdout()  # (the output is what has no file name here)
            print(f"pyalloc: error: cannot write the output: {exc.strerror}", file=sys.stderr)
        else:
            where = f"{exc.filename}: " if exc.filename else ""
            print(f"pyalloc: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1


def _drop_stdout() -> None:
    """Points stdout at /dev/null, so that Python's flush at exit does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
