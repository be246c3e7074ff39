"""``pyalloc run``: a command with pyalloc installed in every Python process it starts.

The child's environment puts :data:`BOOTSTRAP_DIR` first on ``PYTHONPATH``: its
``sitecustomize`` installs pyalloc as PyTorch's CUDA allocator right after
``import torch`` (and starts the offload session of ``--offload``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .._lib import PyallocError
from ..command import EXIT_NOT_FOUND, PYALLOC_EINVAL, Subparsers, UsageError, unwritable

STATS_ENV = "PYALLOC_OFFLOAD_STATS"
"""Where the offloaded program writes its session's stats (offloading/process.py reads it; not
imported from there, which imports torch)."""

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "_bootstrap"


_RUN_OFFLOAD_NOTES = """\
offload (--offload[=BUDGET]):
  Runs pyalloc's offload manager (pyalloc.offload) in the program with no code
  change: saved activations beyond BUDGET are dropped and recomputed in
  backward, with gradients bit for bit those of a run without.
  BUDGET: bytes, or a size such as 512MiB or 2GB, or auto (the default: no
  budget; evict only when pyalloc's allocator runs short, which needs CUDA).
  Write --offload=BUDGET, or put -- before the command. It works on CPU too,
  with a budget. Every Python process of CMD that imports torch gets a session.
  What to expect with a budget (tools/bench/offload_bench.py, CPU):
  - the first step is profiled under per-operator DTR (2-3x a step), the next
    few try plans and measure them; after that only planned modules are re-run
    or the operators they need replayed, and nothing is recorded per operator;
  - saved activations stay within BUDGET + 5% once the plan has settled; a
    BUDGET below the floor (what no module re-run can free) gets one warning
    naming the floor, and steps run at the floor;
  - a budget never reached: about 1% over the plain step here (the recording
    mode stays on the main thread; none with pyalloc.offload in the program:
    no hook runs once the plan has settled);
    at half the saved bytes (dropout noise and other leaves the step made
    counted) 1.15-1.26x the plain step with pyalloc.offload on transformer-like,
    ResNet-like and LSTM models (selective re-runs of the cheap operators, each
    step's region calls checked against the profiled ones; measured in the
    program, not under this command); at the bytes that torch.utils.checkpoint
    on every block reaches, less time than the checkpointing (1.11-1.53x
    against 1.33-1.66x on four models).
  Limits:
  - main thread only: activations saved by other threads are not managed;
  - a step ends when the outermost backward() or torch.autograd.grad() returns;
    several per iteration (gradient accumulation, GANs) are fine; a step that
    differs from the profiled one (another shape) keeps its saves from there on
    and has the next step profiled again;
  - only what is saved inside modules is recomputed, by re-running a module or
    replaying operators recorded inside one (not in a function called in
    forward, such as the loss); replays use the operators' constants from the
    profiled step, checked every 20th step;
  - what regions compiled with torch.compile save is kept (first step: swapped);
    what is saved under torch.utils.checkpoint is left to the checkpoint;
  - the program must not use pyalloc.offload() itself (it is an error);
  - the session's recording mode stays on the main thread and records only in
    profiled steps; otherwise each torch call passes through it (one Python
    call).
  --offload-stats PATH (or $PYALLOC_OFFLOAD_STATS) writes the session's stats
  as JSON at exit; {pid} in PATH becomes the process id.
"""


def register_cli(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a command with pyalloc installed in every Python process it starts",
        description=(
            "Runs CMD so that every Python interpreter it starts installs pyalloc as "
            "PyTorch's CUDA allocator at start-up, with no change to the program. "
            "Example: pyalloc run --conf max_cached=4GiB -- torchrun --nproc-per-node 8 "
            "train.py"
        ),
        epilog=_RUN_OFFLOAD_NOTES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--conf",
        metavar="CONF",
        help="PYALLOC_CONF settings (key=value,...), applied on top of $PYALLOC_CONF",
    )
    parser.add_argument(
        "--offload",
        nargs="?",
        const="auto",
        metavar="BUDGET",
        help="swap or recompute saved activations beyond BUDGET (see below)",
    )
    parser.add_argument(
        "--offload-stats",
        metavar="PATH",
        help="with --offload: write the offload stats as JSON to PATH at exit",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD ARGS...")
    parser.set_defaults(handler=_run)


def child_environment(
    base: dict[str, str],
    conf: str | None,
    offload: str | None = None,
    offload_stats: str | None = None,
) -> dict[str, str]:
    """The environment of ``pyalloc run``'s child: bootstrap first on PYTHONPATH."""
    env = dict(base)
    env.pop("PYALLOC_CLI", None)  # the command's programs report a bad $PYALLOC_CONF as programs do
    env["PYALLOC_AUTOINSTALL"] = "1"
    bootstrap = str(BOOTSTRAP_DIR)
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != bootstrap]
    env["PYTHONPATH"] = os.pathsep.join([bootstrap, *entries])
    if conf:
        # Later keys win, so --conf overrides what PYALLOC_CONF already says.
        inherited = env.get("PYALLOC_CONF", "").strip().strip(",")
        env["PYALLOC_CONF"] = f"{inherited},{conf}" if inherited else conf
    if offload is not None:
        env["PYALLOC_OFFLOAD"] = offload  # read by the bootstrap: pyalloc/offloading/process.py
    if offload_stats is not None:
        env[STATS_ENV] = offload_stats
    return env


def _validate_offload(args: argparse.Namespace) -> None:
    from ..core import parse_budget

    if args.offload is not None:
        try:
            parse_budget(args.offload)
        except PyallocError as exc:
            raise UsageError(f"--offload: {exc} (write --offload=BUDGET, or put -- before the command)") from None
    if args.offload_stats is not None and args.offload is None:
        raise UsageError("--offload-stats needs --offload")
    given, where = args.offload_stats, "--offload-stats"
    if given is None and args.offload is not None:  # (the program's environment names it instead)
        given, where = os.environ.get(STATS_ENV) or None, f"${STATS_ENV}"
    if given is not None:  # found at the program's exit, after the training, otherwise
        stats = Path(given.replace("{pid}", "0"))
        if not stats.name or stats.is_dir():
            raise UsageError(f"{where} {given}: names a folder, not a file")
        if not stats.parent.is_dir():
            raise UsageError(f"{where} {given}: {stats.parent} is not a folder")
        if (problem := unwritable(stats)) is not None:
            raise UsageError(f"{where} {given}: {problem}")


def validate_conf(conf: str | None) -> None:
    """Rejects a bad $PYALLOC_CONF or --conf here, in one line, before the command
    starts, rather than in every child (where it would only show at the first
    allocation).

    Only syntax errors count: a backend that cannot start on this machine
    (no driver for backend=cuda) is the child's business.
    """
    from ..core import configure, startup_error

    if conf is None and "PYALLOC_CONF" not in os.environ:
        return  # the defaults: nothing to check, and no reason to load the library in this process
    try:
        error = startup_error()  # loading the library read $PYALLOC_CONF
        if error is not None and error.startswith("PYALLOC_CONF"):
            raise UsageError(f"${error} (nothing was run)")
        if conf:
            configure(conf)
    except PyallocError as exc:
        if exc.code == PYALLOC_EINVAL:
            raise UsageError(f"--conf: {exc}") from None
    finally:
        # This process is about to exec the command, which skips exit
        # handlers: take down the registry record that loading the library
        # published, or gpumemd would see it outlive us under the same pid.
        try:
            configure("registry=0")
        except PyallocError:
            pass


def _run(args: argparse.Namespace) -> int:
    command: list[str] = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError(
            "run: missing command (usage: pyalloc run [--conf CONF] [--offload[=BUDGET]] [--] CMD ARGS...)"
        )
    _validate_offload(args)
    validate_conf(args.conf)
    env = child_environment(dict(os.environ), args.conf, args.offload, args.offload_stats)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        # exec: the command replaces this process, so its exit status and the
        # signals sent to it (Ctrl-C, SIGTERM from a scheduler) are its own.
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"pyalloc: error: run: command not found: {command[0]}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except OSError as exc:
        print(f"pyalloc: error: run: cannot execute {command[0]}: {exc.strerror}", file=sys.stderr)
        return 126
    return 0  # not reached
