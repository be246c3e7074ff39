"""`pyalloc selftest`: the shipped training traces through the real allocator, bytes verified.

Each recorded workload is replayed through the C ABI on the host backend
(real memory). Every block is filled with a byte derived from its trace id
when allocated and verified byte for byte when freed, so an allocator that
handed out overlapping memory would be caught; ``pyalloc_check`` runs
throughout. Prints one row per workload, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import core
from .._lib import PyallocError, lib
from .replay import refuse_a_bad_environment
from .trace import ALLOC, FREE, Trace, TraceError, load_any, workloads_dir

MiB = 1 << 20
CHECK_EVERY = 997  # ops between full invariant walks


@dataclass
class SelftestResult:
    workload: str
    ops: int
    peak_live_bytes: int
    peak_reserved_bytes: int
    reserved_over_live: float
    bytes_verified: int
    checks: int
    seconds: float


def _pattern(ident: int) -> int:
    return 1 + ident % 251


def replay_verified(trace: Trace, name: str) -> SelftestResult:
    """Replays ``trace`` on a fresh host-backend allocator, verifying every byte."""
    capacity = 2 * trace.peak_live_bytes() + 256 * MiB
    core.configure(f"backend=host,devices=1,capacity={capacity},oom_report=0")
    core.reset_peak_memory_stats(0)
    malloc, free = lib().pyalloc_malloc, lib().pyalloc_free
    live: dict[int, tuple[int, int]] = {}  # id -> (address, size)
    verified = checks = 0
    start = time.perf_counter()
    try:
        for n, (op, ident, size, stream) in enumerate(zip(trace.ops, trace.ids, trace.sizes, trace.streams)):
            if op == ALLOC:
                ptr = malloc(size, 0, stream)
                if not ptr:
                    raise PyallocError(f"{name}: allocation {ident} of {size} bytes failed: {core.last_error()}")
                ctypes.memset(ptr, _pattern(ident), size)
                live[ident] = (ptr, size)
            elif op == FREE:
                ptr, size = live.pop(ident)
                if ctypes.string_at(ptr, size).count(_pattern(ident)) != size:
                    raise PyallocError(f"{name}: allocation {ident} at {ptr:#x} was overwritten while live")
                verified += size
                free(ptr, size, 0, core.ANY_STREAM)  # a trace's free may name a consumer's stream
            if n % CHECK_EVERY == 0:
                core.check(0)
                checks += 1
        for ident, (ptr, size) in live.items():
            if ctypes.string_at(ptr, size).count(_pattern(ident)) != size:
                raise PyallocError(f"{name}: allocation {ident} at {ptr:#x} was overwritten while live")
            verified += size
            free(ptr, size, 0, core.ANY_STREAM)
        core.check(0)
        checks += 1
        stats = core.memory_stats(0)
        if stats["allocated_bytes.all.current"] != 0:
            raise PyallocError(f"{name}: {stats['allocated_bytes.all.current']} bytes still allocated after the replay")
    finally:
        core.empty_cache()
    seconds = time.perf_counter() - start
    peak_live = trace.peak_live_bytes()
    peak_reserved = int(stats["reserved_bytes.all.peak"])
    return SelftestResult(name, trace.num_ops, peak_live, peak_reserved, peak_reserved / max(1, peak_live),
                          verified, checks, seconds)


def fits_this_machine(trace: Trace) -> bool:
    """Whether the host backend can back the trace's capacity with half of the memory available now."""
    import psutil

    return 2 * trace.peak_live_bytes() + 256 * MiB <= psutil.virtual_memory().available // 2


def run(paths: list[Path], as_json: bool) -> int:
    refuse_a_bad_environment()
    named = bool(paths)
    if not paths:
        paths = sorted(workloads_dir().glob("*.jsonl.gz"))
    results = []
    name_w = max([len("workload")] + [len(p.name.split(".")[0]) for p in paths])  # rows print as they finish
    for path in paths:
        name = path.name.split(".")[0]
        try:
            trace = load_any(path)  # a JSON Lines trace or a PyTorch snapshot, as replay takes
        except TraceError as e:
            raise PyallocError(f"selftest: {e}") from None
        if not fits_this_machine(trace):
            need = (2 * trace.peak_live_bytes() + 256 * MiB) / (1 << 30)
            if named:  # asked for by name: say why it cannot run, rather than fail inside configure
                raise PyallocError(f"selftest: {path}: replaying it on the host backend needs {need:.1f} GiB of "
                                   f"real memory, more than half of what this machine has free")
            # The GPU-scale workloads (pyalloc record --meta) need tens of GiB of real memory here.
            print(f"{name}: skipped, its {trace.peak_live_bytes() / (1 << 30):.1f} GiB of live bytes do not fit "
                  "this machine's memory", file=sys.stderr)
            continue
        results.append(replay_verified(trace, name))
        if not as_json:
            r = results[-1]
            if len(results) == 1:
                print(f"{'workload':<{name_w}} {'ops':>7} {'peak live':>11} {'peak reserved':>14} "
                      f"{'reserved/live':>13} {'verified':>11} {'checks':>6} {'time':>7}")
            print(f"{r.workload:<{name_w}} {r.ops:>7} {r.peak_live_bytes / MiB:>7.1f} MiB {r.peak_reserved_bytes / MiB:>10.1f} MiB "
                  f"{r.reserved_over_live:>13.3f} {r.bytes_verified / MiB:>7.0f} MiB {r.checks:>6} {r.seconds:>6.2f}s")
    if as_json:
        json.dump({"backend": "host", "results": [asdict(r) for r in results]}, sys.stdout, indent=2)
        print()
    else:
        print(f"selftest passed: {sum(r.ops for r in results)} operations replayed, "
              f"{sum(r.bytes_verified for r in results) / MiB:.0f} MiB verified, pyalloc_check clean")
    return 0


def register_cli(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    parser = subparsers.add_parser(
        "selftest",
        help="replay the shipped training traces on the host backend, verifying every byte",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    parser.add_argument("traces", nargs="*", type=Path, help="traces (.jsonl, .jsonl.gz) or PyTorch snapshot pickles to replay (default: the shipped workloads)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=lambda args: run(list(args.traces), args.json))
