"""`pyalloc record`: allocation traces of real training steps (TRACE_FORMAT.md, version 1).

Sources of a trace, each identifying an allocation by its address (an alloc at
address A pairs with the next free at A):

  cpu               PyTorch's profiler with profile_memory=True, on the CPU: every call
                    to the CPU allocator, with its address and signed size. No GPU needed.
  cuda, native      torch.cuda.memory._record_memory_history + _snapshot() under
                    PyTorch's own caching allocator; its device trace is converted
                    with pyalloc.traces.trace.from_snapshot.
  cuda, pyalloc     pyalloc installed as PyTorch's allocator, recording into its own
                    trace ring; pyalloc.snapshot() has the same device_traces format.
  --from-snapshot   a snapshot pickle someone recorded elsewhere.

Every source marks the end of each training step with {"op": "mark", "name": "iteration"}
(a snapshot from elsewhere has no steps to mark). Frees of memory allocated
before recording started are skipped; allocations still live at the end stay live.

Note [CPU recordings]
~~~~~~~~~~~~~~~~~~~~~
The profiler's ``[memory]`` rows of ``prof.events()`` in torch 2.x are not a
usable source: the EventList folds them into per-op ``cpu_memory_usage`` sums
and the Kineto copies carry no address. The event tree
(``kineto_results.experimental_event_tree()``) keeps each allocator call as its
own node with ``ptr``, ``alloc_size`` (negative for a free) and a timestamp, in
the order they happened; ``torch.profiler._memory_profiler`` builds its memory
timeline from the same nodes, but merges them into tensor lifetimes by category,
so the raw nodes are the faithful source. They are sorted by time (allocator calls
of different threads interleave) and put in snapshot form, so that one pairing
rule, ``from_snapshot``'s, serves every source. The profiler reports no free of
a block allocated before it started (it warns "Memory block of unknown size was
allocated before the profiling started"), so a CPU trace never needs to skip one.

A CPU recording is the program's sequence of tensor allocations as the CPU
kernels make it: shapes, lifetimes and order are the model's, but a CPU
kernel's scratch memory differs from its CUDA counterpart's (the LSTM allocates
per time step where cuDNN takes one workspace), and there is no stream.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from .._deps import require
from .._lib import PyallocError
from .trace import ALLOC, FREE, MARK, Trace, TraceError, _check_file, _SnapshotUnpickler, from_snapshot

ITERATION_MARK = "iteration"
# The record_function range each CPU step runs in; its end is the step's boundary.
ITERATION_RANGE = "pyalloc_iteration"
# PyTorch's history ring grows as needed up to max_entries (pyalloc's is allocated
# up front, clamped to its own maximum): room for a few hundred steps of a large model.
DEFAULT_MAX_ENTRIES = 1_000_000
# Sleep on each side of a GPU step boundary's timestamp, so that the small
# disagreement between our clock and the allocator's cannot put an event on the
# wrong side of a mark.
BOUNDARY_GAP_S = 0.002
MiB = 1 << 20

Step = Callable[[], object]


@dataclass
class RecordedTrace(Trace):
    """A :class:`Trace` with a timestamp per event (marks included).

    ``times`` are microseconds from the recording's first event (the unit of
    PyTorch's snapshots; finer would only cost bytes: the allocator calls of a
    CPU run are microseconds apart). Empty when the source had no times.
    """

    times: list[int] = field(default_factory=list)
    skipped_frees: int = 0  # frees of memory allocated before recording started


# ---- conversion: snapshot-form entries -> trace ---------------------------------------


def _emitted_times(entries: Sequence[dict[str, Any]], time_key: str) -> list[int | None]:
    """The timestamp of each event ``from_snapshot`` keeps, in its order.

    It keeps every ``alloc`` and the ``free_completed`` of an address it saw
    allocated; this walks the entries by the same rule.
    """
    live: set[Any] = set()
    times: list[int | None] = []
    for entry in entries:
        action, addr = entry.get("action"), entry.get("addr")
        if action == "alloc":
            live.add(addr)
        elif action == "free_completed" and addr in live:
            live.remove(addr)
        else:
            continue
        t = entry.get(time_key)
        times.append(t if isinstance(t, int) and not isinstance(t, bool) else None)
    return times


def snapshot_to_trace(snapshot: Any, name: str, device: int = 0, boundaries: Sequence[int] = (),
                      time_key: str = "time_us", source: str | None = None) -> RecordedTrace:
    """A snapshot's device trace as a trace, with an iteration mark after each boundary.

    ``boundaries`` are times (in the entries' ``time_key`` unit) at which a step
    ended: events at or before a boundary come before its mark. Entries with no
    time cannot be placed; then no mark is written and a warning says so.
    """
    base = from_snapshot(snapshot, name, device)
    entries: list[dict[str, Any]] = snapshot["device_traces"][device]
    raw_times = _emitted_times(entries, time_key)
    if len(raw_times) != len(base.ops):  # from_snapshot's rule changed under us
        raise PyallocError(f"{name}: converted {len(base.ops)} events but timed {len(raw_times)}")
    timed = all(t is not None for t in raw_times)
    times: list[int] = [t for t in raw_times if t is not None] if timed else []
    if boundaries and not timed:
        warnings.warn(f"{name}: the snapshot's events carry no {time_key!r}: iteration marks omitted",
                      stacklevel=2)
        boundaries = ()
    frees_seen = sum(1 for e in entries if e.get("action") == "free_completed")
    frees_kept = sum(1 for op in base.ops if op == FREE)

    src = source if source is not None else base.source
    out = RecordedTrace(source=src, header={"version": 1, "source": src}, skipped_frees=frees_seen - frees_kept)
    origin = min([*times[:1], *boundaries[:1]], default=0)
    pending = iter(sorted(boundaries))
    next_boundary = next(pending, None)

    def add(op: int, ident: int, size: int, stream: int, t: int | None) -> None:
        if op == MARK:
            out.marks.append((len(out.ops), ITERATION_MARK))
        out.ops.append(op)
        out.ids.append(ident)
        out.sizes.append(size)
        out.streams.append(stream)
        if t is not None:
            out.times.append(t - origin)

    for i, (op, ident, size, stream) in enumerate(zip(base.ops, base.ids, base.sizes, base.streams)):
        t = times[i] if times else None
        while next_boundary is not None and t is not None and t > next_boundary:
            add(MARK, -1, 0, 0, next_boundary)
            next_boundary = next(pending, None)
        add(op, ident, size, stream, t)
    while next_boundary is not None:  # steps after the last event still end
        add(MARK, -1, 0, 0, next_boundary)
        next_boundary = next(pending, None)
    return out


# ---- CPU: the profiler's allocation events ----------------------------------------------


# Lines the profiler's C++ half (kineto) writes to stderr when it starts and stops, whatever
# KINETO_LOG_LEVEL says: "USDT:... profiler_start", "STAGE:... Completed Stage: Warm Up".
_PROFILER_CHATTER = ("USDT:", "STAGE:")


@contextlib.contextmanager
def _without_profiler_chatter() -> Iterator[None]:
    """Runs the block with file descriptor 2 in a temporary file, then writes back to stderr
    every line of it except the profiler's own chatter (a stray line in the output of
    ``pyalloc record``, issue 23)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(_PROFILER_CHATTER)]
            sys.stderr.write("".join(kept))


def _profiler_allocations(prof: Any) -> tuple[list[dict[str, Any]], list[int]]:
    """CPU allocator calls as snapshot-form entries (``time_ns``), and the steps' end times.

    See Note [CPU recordings].
    """
    try:
        roots = prof.profiler.kineto_results.experimental_event_tree()
    except AttributeError as e:
        raise PyallocError(f"this PyTorch's profiler exposes no allocation events ({e}); "
                           f"record on a GPU (--device cuda) instead") from None
    calls: list[tuple[int, int, int]] = []  # (time ns, address, signed size)
    boundaries: list[int] = []
    stack = list(reversed(roots))
    while stack:  # pre-order: each thread's calls come out in the order they were made
        node = stack.pop()
        stack.extend(reversed(node.children))
        extra = node.extra_fields
        if type(extra).__name__ == "_ExtraFields_Allocation":
            if extra.device.type == "cpu" and extra.ptr and extra.alloc_size:
                calls.append((node.start_time_ns, extra.ptr, extra.alloc_size))
        elif node.name == ITERATION_RANGE:
            boundaries.append(node.end_time_ns)
    # A stable sort: it interleaves the threads and keeps each one's order.
    calls.sort(key=lambda c: c[0])
    entries = [{"action": "alloc" if size > 0 else "free_completed", "addr": addr, "size": abs(size),
                "stream": 0, "time_ns": t} for t, addr, size in calls]
    return entries, sorted(boundaries)


def _progress(steps: int, desc: str, progress: bool | None) -> Iterator[int]:
    """``range(steps)`` with a tqdm bar on stderr (``progress=None``: only on a terminal)."""
    if progress is False:
        return iter(range(steps))
    try:
        from tqdm import tqdm
    except ImportError:
        return iter(range(steps))
    return iter(tqdm(range(steps), desc=desc, unit="step", file=sys.stderr, disable=None if progress is None else False,
                     leave=False))


def record_cpu(setup: Callable[[], Step], steps: int, *, desc: str = "record",
               progress: bool | None = None) -> RecordedTrace:
    """Runs ``setup()`` and then ``steps`` calls of the step it returns, recording the CPU allocations.

    ``setup`` runs under the profiler too, so the model's parameters are
    allocations of the trace (live to its end), as ``model.to("cuda")``'s are
    in a GPU trace. Each step runs in a ``pyalloc_iteration`` range whose end
    becomes an iteration mark.
    """
    if steps < 1:
        raise PyallocError(f"steps must be at least 1, got {steps}")
    from torch.profiler import ProfilerActivity, profile, record_function

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
    with _without_profiler_chatter():
        prof.start()
    try:
        step = setup()
        for _ in _progress(steps, desc, progress):
            with record_function(ITERATION_RANGE):
                step()
    finally:
        with _without_profiler_chatter():
            prof.stop()
    entries, boundaries = _profiler_allocations(prof)
    # Marks are placed with the nanosecond times; only the written times are coarser.
    import torch

    trace = snapshot_to_trace({"device_traces": [entries]}, "cpu profiler", 0, boundaries, time_key="time_ns",
                              source=f"CPU recording, torch {torch.__version__} profiler memory events")
    trace.times = [t // 1000 for t in trace.times]
    return trace


# ---- CUDA: PyTorch's snapshot, or pyalloc's trace ring -------------------------------------


def record_cuda(setup: Callable[[], Step], steps: int, *, allocator: str = "native", device: int = 0,
                max_entries: int = DEFAULT_MAX_ENTRIES, desc: str = "record",
                progress: bool | None = None) -> RecordedTrace:
    """Runs ``setup()`` and ``steps`` steps on a GPU, recording the allocator's device trace.

    ``allocator="native"``: PyTorch's caching allocator, through
    ``_record_memory_history`` (no stack traces: they cost time and are not
    part of a trace) and ``_snapshot()``. ``allocator="pyalloc"``: pyalloc is
    installed first (it must be, before CUDA starts) and records into its
    trace ring. Step boundaries are timestamps taken between steps, on the
    clock the allocator stamps its events with.
    """
    import torch

    if steps < 1:
        raise PyallocError(f"steps must be at least 1, got {steps}")
    if not torch.cuda.is_available():
        raise PyallocError("--device cuda needs a GPU and a CUDA build of PyTorch; this process has neither "
                           "(record on the CPU instead: --device cpu)")
    from .. import core

    if allocator == "pyalloc":
        from ..pytorch.install import install
        from ..pytorch.memory_api import MAX_HISTORY_ENTRIES

        install()  # before anything starts CUDA
        entries = min(max_entries, MAX_HISTORY_ENTRIES)
        core.configure(f"trace={entries}")
        clock_us: Callable[[], int] = lambda: time.monotonic_ns() // 1000  # noqa: E731  (steady_clock)
    elif allocator == "native":
        entries = max_entries
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=entries)
        clock_us = lambda: time.time_ns() // 1000  # noqa: E731  (PyTorch stamps Unix time)
    else:
        raise PyallocError(f"unknown allocator {allocator!r} (expected native or pyalloc)")
    boundaries: list[int] = []
    try:
        torch.cuda.set_device(device)
        step = setup()
        for _ in _progress(steps, desc, progress):
            step()
            torch.cuda.synchronize(device)
            time.sleep(BOUNDARY_GAP_S)
            boundaries.append(clock_us())
            time.sleep(BOUNDARY_GAP_S)
        snapshot = core.snapshot() if allocator == "pyalloc" else torch.cuda.memory._snapshot()
    finally:
        if allocator == "pyalloc":
            core.configure("trace=0")
        else:
            torch.cuda.memory._record_memory_history(None)
    recorded = snapshot.get("device_traces", [])
    if device < len(recorded) and len(recorded[device]) >= entries:
        warnings.warn(f"the allocator's history ring ({entries} entries) filled up: the trace lacks the "
                      f"start of the run; raise --max-entries", stacklevel=2)
    how = "pyalloc trace ring" if allocator == "pyalloc" else "native allocator snapshot"
    trace = snapshot_to_trace(snapshot, f"{allocator} snapshot", device, boundaries,
                              source=f"GPU recording ({torch.cuda.get_device_name(device)}), torch "
                                     f"{torch.__version__}, {how}")
    trace.header["device_capacity"] = int(torch.cuda.get_device_properties(device).total_memory)
    return trace


# ---- the built-in workloads ------------------------------------------------------------------


def record_workload(name: str, steps: int = 8, seed: int = 0, device: str = "cpu", *, tiny: bool = False,
                    allocator: str = "native", max_entries: int = DEFAULT_MAX_ENTRIES,
                    progress: bool | None = None) -> RecordedTrace:
    """Records ``steps`` training steps of a built-in workload (pyalloc.traces.models) on ``device``.

    The trace's ``source`` says what the model and its shape dynamics are,
    and how it was recorded; a GPU recording also carries ``device_capacity``.
    """
    from . import models

    workload = models.workload(name)  # KeyError names the workloads
    runs: list[models.TrainingRun] = []

    def setup() -> Step:
        run = models.build(workload.name, seed, "cuda" if device == "cuda" else "cpu", tiny)
        runs.append(run)
        return run.step

    desc = f"record {workload.name}"
    if device == "cpu":
        trace = record_cpu(setup, steps, desc=desc, progress=progress)
    elif device == "cuda":
        trace = record_cuda(setup, steps, allocator=allocator, max_entries=max_entries, desc=desc,
                            progress=progress)
    else:
        raise PyallocError(f"unknown device {device!r} (expected cpu or cuda)")
    size = "tiny configuration, " if tiny else ""
    source = f"{runs[0].source}; {trace.source}, {size}{steps} steps, seed {seed}"
    trace.source = source
    trace.header["source"] = source
    return trace


# ---- writing ----------------------------------------------------------------------------------


def _lines(trace: Trace, header: dict[str, Any]) -> Iterable[str]:
    times: Sequence[int] = getattr(trace, "times", None) or []
    if len(times) != len(trace.ops):
        times = []
    mark_names = dict(trace.marks)
    yield json.dumps(header)
    for i, (op, ident, size, stream) in enumerate(zip(trace.ops, trace.ids, trace.sizes, trace.streams)):
        if op == ALLOC:
            event: dict[str, Any] = {"op": "alloc", "id": ident, "size": size, "stream": stream}
        elif op == FREE:
            event = {"op": "free", "id": ident, "stream": stream}
        else:
            event = {"op": "mark", "name": mark_names.get(i, ITERATION_MARK)}
        if times:
            event["t"] = times[i]
        yield json.dumps(event)


def _write_lines(write: Callable[[bytes], object], trace: Trace, header: dict[str, Any]) -> None:
    for line in _lines(trace, header):
        write(line.encode("utf-8") + b"\n")


def write_trace(trace: Trace, path: str | Path, source: str, device_capacity: int | None = None) -> Path:
    """Writes ``trace`` as JSON Lines (gzip when ``path`` ends in ``.gz``); returns the path.

    Writes a temporary file beside ``path`` and renames it, so a reader never
    sees half a trace. gzip output carries no name or mtime, so recording the
    same thing twice gives the same bytes.
    """
    p = Path(path)  # a symbolic link at the path is replaced, never followed (another user's link
    # in /tmp would have had root's write land where it points)
    header: dict[str, Any] = {"version": 1, "source": source}
    if device_capacity is not None:
        if device_capacity <= 0:
            raise PyallocError(f"device_capacity must be positive, got {device_capacity}")
        header["device_capacity"] = int(device_capacity)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as raw:
            if p.name.endswith(".gz"):
                with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as compressed:
                    _write_lines(compressed.write, trace, header)
            else:
                _write_lines(raw.write, trace, header)
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


# ---- CLI ----------------------------------------------------------------------------------------


def _summary(trace: Trace, path: Path) -> dict[str, Any]:
    return {
        "path": str(path),
        "source": trace.source,
        "allocs": sum(1 for op in trace.ops if op == ALLOC),
        "frees": sum(1 for op in trace.ops if op == FREE),
        "marks": len(trace.marks),
        "peak_live_bytes": trace.peak_live_bytes(),
        "skipped_frees": getattr(trace, "skipped_frees", 0),
    }


def output_problem(output: Path) -> str | None:
    """Why a trace cannot be written to ``output``, checked before recording: ``-`` (a trace
    goes to a file), a folder, or something that is not a regular file (a FIFO, a device: the
    write replaces what is at the path, which would turn ``/dev/null`` into a file). A symbolic
    link to a regular file is replaced by the trace, not followed."""
    if str(output) == "-":
        return "cannot write -: a trace goes to a file, not to standard output"
    if not output.name or output.is_dir():
        return f"cannot write {str(output) or repr(str(output))}: -o names a folder, not a file"
    if output.exists() and not output.is_file():
        return f"cannot write {output}: it exists and is not a regular file (not replaced)"
    return None


def _fail(message: str) -> int:
    print(f"pyalloc record: {message}", file=sys.stderr)
    return 1


# Each way of recording and the options it reads; an option given to a way that does not read it
# is refused rather than silently ignored. Defaults are filled in after that check.
_OPTIONS = {"steps": 8, "seed": 0, "device": "cpu", "allocator": "native", "max_entries": DEFAULT_MAX_ENTRIES,
            "snapshot_device": 0, "tiny": False, "batch": None, "seq": None, "checkpoint": False}
_READS = {"--meta": {"steps", "seed", "batch", "seq", "checkpoint"},
          "--from-snapshot": {"snapshot_device"},
          "MODEL": {"steps", "seed", "device", "allocator", "max_entries", "tiny"}}
_CUDA_ONLY = ("allocator", "max_entries")


def _check_options(args: argparse.Namespace) -> None:
    from ..command import UsageError

    way = "--meta" if args.meta else "--from-snapshot" if args.from_snapshot is not None else "MODEL"
    given = [name for name in _OPTIONS if getattr(args, name) is not None and getattr(args, name) is not False]
    for name in given:
        flag = "--" + name.replace("_", "-")
        if name not in _READS[way]:
            readers = " and ".join(w for w, names in _READS.items() if name in names)
            raise UsageError(f"record: {flag} goes with {readers}, not {way}")
        if way == "MODEL" and name in _CUDA_ONLY and args.device != "cuda":
            raise UsageError(f"record: {flag} goes with --device cuda (a CPU run records no allocator history)")
    for name, default in _OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def run(args: argparse.Namespace) -> int:
    from ..command import UsageError

    _check_options(args)
    if args.meta:
        require("torch", "pyalloc record --meta")
        from . import meta

        return meta.run(args)
    if (args.model is None) == (args.from_snapshot is None):
        raise UsageError("record: give a MODEL to record or --from-snapshot PICKLE to convert (one of them)")
    if args.from_snapshot is not None:
        if args.output is None:
            raise UsageError("record --from-snapshot needs -o PATH")
        path = Path(args.from_snapshot)
        try:
            _check_file(path)  # missing, a folder, a FIFO or a device: said as such
            snapshot = _SnapshotUnpickler.load(path)
            trace = snapshot_to_trace(snapshot, str(path), args.snapshot_device,
                                      source=f"PyTorch memory snapshot {path.name}, device {args.snapshot_device}")
        except TraceError as e:
            return _fail(str(e))
        except Exception as e:  # a pickle that is not a snapshot fails in many ways
            return _fail(f"{path}: cannot read the snapshot pickle ({type(e).__name__}: {e})")
        capacity = None
        output = Path(args.output)
    else:
        if args.output is not None and (problem := output_problem(Path(args.output))) is not None:
            return _fail(problem)  # before the recording, not after it
        require("torch", "pyalloc record MODEL")  # the built-in workloads are PyTorch models
        from . import models

        try:
            workload = models.workload(args.model)
        except KeyError as e:
            raise UsageError(f"record: {e.args[0]}") from None
        if args.steps < 1:
            raise UsageError(f"record: --steps must be at least 1, got {args.steps}")
        trace = record_workload(workload.name, args.steps, args.seed, args.device, tiny=args.tiny,
                                allocator=args.allocator, max_entries=args.max_entries)
        capacity = trace.header.get("device_capacity")
        output = Path(args.output) if args.output else Path(f"{workload.stem}.jsonl.gz")
    if (problem := output_problem(output)) is not None:
        return _fail(problem)
    try:
        written = write_trace(trace, output, trace.source, capacity)
    except OSError as e:
        return _fail(f"cannot write {output}: {e.strerror or e}")
    report = _summary(trace, written)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{written}: {report['allocs']:,} allocs, {report['frees']:,} frees, {report['marks']} iteration "
              f"marks, peak live {report['peak_live_bytes'] / MiB:,.1f} MiB"
              + (f" ({report['skipped_frees']:,} frees of earlier memory skipped)" if report["skipped_frees"] else ""))
    return 0


WORKLOAD_NAMES = ("transformer_lm", "encoder_padding", "cnn_multiscale", "lstm_varlen", "seq2seq", "mlp")
"""models.names(), written out: the help names them without importing torch (~0.9 s that every
pyalloc command paid, `pyalloc config` included; tests/test_record.py keeps the two equal)."""


def register_cli(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    workloads = ", ".join(WORKLOAD_NAMES)

    parser = subparsers.add_parser(
        "record", help="record a built-in workload's allocation trace, or convert a PyTorch snapshot",
        description=__doc__.split("\n\n", 1)[1].split("Note [", 1)[0].rstrip() if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help=f"workload to record: {workloads}; with --meta: "
                             "llama1b, llama7b, vit_l, resnet50")
    parser.add_argument("--from-snapshot", metavar="PICKLE",
                        help="convert a torch.cuda.memory._snapshot() pickle instead (needs -o)")
    parser.add_argument("--snapshot-device", type=int, metavar="I",
                        help="which device's trace of the snapshot to convert (default 0)")
    parser.add_argument("-o", "--output", metavar="PATH",
                        help="trace to write; .gz compresses (default: ./<workload>.jsonl.gz)")
    parser.add_argument("--steps", type=int, help="training steps to record (default 8)")
    parser.add_argument("--seed", type=int, help="seed of weights, data and shapes (default 0)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="where MODEL trains (default cpu)")
    parser.add_argument("--allocator", choices=["native", "pyalloc"],
                        help="with --device cuda: the allocator whose trace is recorded (default native)")
    parser.add_argument("--max-entries", type=int, metavar="N",
                        help=f"with --device cuda: history ring size (default {DEFAULT_MAX_ENTRIES:,})")
    parser.add_argument("--tiny", action="store_true", help="the workload's tiny test configuration")
    parser.add_argument("--meta", action="store_true",
                        help="record a GPU-scale model on PyTorch's meta device, with no memory: "
                             "llama1b, llama7b, vit_l, resnet50 (pyalloc.traces.meta)")
    parser.add_argument("--batch", type=int, metavar="N", help="with --meta: batch size (default: the model's)")
    parser.add_argument("--seq", type=int, metavar="N",
                        help="with --meta: sequence length (decoders) or image side (vision models)")
    parser.add_argument("--checkpoint", action="store_true",
                        help="with --meta: activation checkpointing per layer (torch.utils.checkpoint)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)
