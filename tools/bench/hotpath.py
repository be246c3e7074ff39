#!/usr/bin/env python3
"""The hot-path benchmark: instructions and nanoseconds per malloc+free pair.

Builds tools/bench/hotpath.cpp against libpyalloc.so, then for each mode
(hit: exact cache reuse; split: split and merge; replay: a recorded trace;
hit-shared and replay-shared: the same with vmm=shared, one arena for every
size, where the others have plain segments):

  - runs it twice under ``valgrind --tool=callgrind`` with a small and a large
    number of pairs and reports (instructions(N2) - instructions(N1)) /
    (pairs(N2) - pairs(N1)): start-up (loading the library, configuring,
    reading the trace) cancels out, leaving the cost of one pair;
  - runs it without valgrind, a few times, and reports the best ns per pair
    (and per operation: half of it).

The library runs on the sim backend (fake addresses: no memory is touched).
The target for the cache-hit path is at most 300 instructions per pair.

Usage: tools/bench/hotpath.py [--lib PATH] [--trace PATH] [--modes hit,split,replay,hit-shared,replay-shared]
                              [--build-dir DIR] [--no-valgrind] [--json]
The library is $PYALLOC_LIBRARY or --lib; without either it is built with
CMake into build-bench/. Exits 0, or 1 with a one-line reason.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tools" / "bench" / "hotpath.cpp"
DEFAULT_TRACE = ROOT / "pyalloc" / "traces" / "workloads" / "seq2seq.jsonl.gz"
CACHE_HIT_TARGET = 300  # instructions per malloc+free pair on the cache-hit path

# mode -> (N1, N2) under callgrind, N for the timed run. For replay, N counts
# repetitions of the whole trace.
COUNTS = {
    "hit": ((20_000, 120_000), 2_000_000),
    "split": ((20_000, 120_000), 2_000_000),
    "replay": ((1, 3), 20),
    "hit-shared": ((20_000, 120_000), 2_000_000),
    "replay-shared": ((1, 3), 20),
}
TIMED_RUNS = 5
DESCRIPTIONS = {
    "hit": "cache hit: exact reuse, no split, no merge",
    "split": "split + merge: carve 4 MiB from an 18 MiB free block",
    "replay": "replay of a recorded trace",
    "hit-shared": "cache hit, one arena for every size (vmm=shared)",
    "replay-shared": "replay, one arena for every size (vmm=shared)",
}
MODES = ",".join(COUNTS)
LINE = re.compile(r"hotpath: mode=([\w-]+) pairs=(\d+) ns_per_pair=([0-9.]+)")


class BenchError(Exception):
    """A failure reported in one line."""


@dataclass
class ModeResult:
    mode: str
    description: str
    instructions_per_pair: float | None
    ns_per_pair: float
    ns_per_op: float
    callgrind_pairs: tuple[int, int] | None
    callgrind_instructions: tuple[int, int] | None
    timed_pairs: int


def run(cmd: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BenchError(f"{' '.join(cmd[:4])} ... exited {done.returncode}: {tail}")
    return done.stdout


def find_library(lib: str | None, build_dir: Path) -> Path:
    chosen = lib or os.environ.get("PYALLOC_LIBRARY")
    if chosen:
        path = Path(chosen).resolve()
        if not path.is_file():
            raise BenchError(f"no library at {path}")
        return path
    if shutil.which("cmake") is None:
        raise BenchError("cmake not found: build libpyalloc.so yourself and pass --lib or PYALLOC_LIBRARY")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    run(["cmake", "-S", str(ROOT), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", *generator])
    run(["cmake", "--build", str(build_dir), "--target", "pyalloc"])
    return build_dir / "libpyalloc.so"


def build_binary(library: Path, out: Path) -> Path:
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        raise BenchError("no C++ compiler (c++, g++ or $CXX)")
    out.parent.mkdir(parents=True, exist_ok=True)
    run([compiler, "-O2", "-std=c++17", "-Wall", "-Wextra", f"-I{ROOT / 'allocator' / 'include'}",
         str(SOURCE), str(library), f"-Wl,-rpath,{library.parent}", "-o", str(out)])
    return out


def write_trace_text(trace_path: Path, out: Path) -> None:
    """The trace in hotpath.cpp's text format: validated by pyalloc.traces.trace, ids made dense slots."""
    sys.path.insert(0, str(ROOT))
    from pyalloc.traces.replay import flatten  # noqa: E402  (the package in this checkout)
    from pyalloc.traces.trace import ALLOC, FREE, load_any  # noqa: E402

    flat = flatten(load_any(trace_path), trace_path.name.split(".")[0])
    lines = []
    for op, slot, size, stream in zip(flat.ops, flat.slots, flat.sizes, flat.streams):
        if op == ALLOC:
            lines.append(f"a {slot} {size} {stream}")
        elif op == FREE:
            lines.append(f"f {slot} {size} {stream}")
    out.write_text(f"pyalloc-hotpath-trace 1\n{len(lines)} {max(1, flat.n_slots)}\n" + "\n".join(lines) + "\n")


def parse_output(stdout: str) -> tuple[int, float]:
    match = LINE.search(stdout)
    if not match:
        raise BenchError(f"no result line in hotpath's output: {stdout.strip()[:200]!r}")
    return int(match[2]), float(match[3])


def callgrind_instructions(binary: Path, args: list[str], workdir: Path) -> tuple[int, int]:
    """(instructions, pairs) of one run under callgrind."""
    out_file = workdir / f"callgrind.{args[0]}.{args[1]}.out"
    stdout = run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}", str(binary), *args])
    pairs, _ = parse_output(stdout)
    for line in out_file.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1]), pairs
    raise BenchError(f"no totals in {out_file}")


def measure(binary: Path, mode: str, trace_file: Path, workdir: Path, valgrind: bool) -> ModeResult:
    (n1, n2), n_timed = COUNTS[mode]
    extra = [str(trace_file)] if mode.startswith("replay") else []
    per_pair: float | None = None
    cg_pairs = cg_instr = None
    if valgrind:
        i1, p1 = callgrind_instructions(binary, [mode, str(n1), *extra], workdir)
        i2, p2 = callgrind_instructions(binary, [mode, str(n2), *extra], workdir)
        per_pair = (i2 - i1) / (p2 - p1)
        cg_pairs, cg_instr = (p1, p2), (i1, i2)
    best = float("inf")
    pairs = 0
    for _ in range(TIMED_RUNS):
        pairs, ns = parse_output(run([str(binary), mode, str(n_timed), *extra]))
        best = min(best, ns)
    return ModeResult(mode, DESCRIPTIONS[mode], per_pair, best, best / 2, cg_pairs, cg_instr, pairs)


def format_table(results: list[ModeResult], trace_name: str) -> str:
    lines = [f"{'mode':<13} {'instr/pair':>10} {'ns/pair':>8} {'ns/op':>7}  what",
             "-" * 84]
    for r in results:
        instr = "-" if r.instructions_per_pair is None else f"{r.instructions_per_pair:,.0f}"
        what = r.description + (f" ({trace_name})" if r.mode.startswith("replay") else "")
        lines.append(f"{r.mode:<13} {instr:>10} {r.ns_per_pair:>8.1f} {r.ns_per_op:>7.1f}  {what}")
    lines.append(f"instr/pair: callgrind, (I(N2) - I(N1)) / (N2 - N1); ns: best of {TIMED_RUNS} timed runs; "
                 f"sim backend. Target on the cache-hit path: <= {CACHE_HIT_TARGET} instr/pair.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hotpath.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", help="libpyalloc.so to measure (default: $PYALLOC_LIBRARY, else build one)")
    parser.add_argument("--build-dir", type=Path, default=ROOT / "build-bench",
                        help="where to build the library (if needed) and the benchmark")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace for the replay mode")
    parser.add_argument("--modes", default=MODES, help=f"comma-separated, of {MODES}")
    parser.add_argument("--no-valgrind", action="store_true", help="timed runs only")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    try:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        for m in modes:
            if m not in COUNTS:
                raise BenchError(f"--modes: unknown mode {m!r} (expected some of {MODES})")
        valgrind = not args.no_valgrind
        if valgrind and shutil.which("valgrind") is None:
            raise BenchError("valgrind not found (install it, or pass --no-valgrind for timings only)")
        library = find_library(args.lib, args.build_dir)
        binary = build_binary(library, args.build_dir / "hotpath")
        with tempfile.TemporaryDirectory(prefix="hotpath-") as tmp:
            workdir = Path(tmp)
            trace_file = workdir / "trace.txt"
            if any(m.startswith("replay") for m in modes):
                write_trace_text(args.trace, trace_file)
            results = [measure(binary, m, trace_file, workdir, valgrind) for m in modes]
    except (BenchError, OSError, ValueError) as e:
        print(f"hotpath: error: {e}", file=sys.stderr)
        return 1
    trace_name = args.trace.name.split(".")[0]
    if args.json:
        report: dict[str, Any] = {
            "library": str(library),
            "backend": "sim",
            "trace": str(args.trace),
            "cache_hit_target_instructions_per_pair": CACHE_HIT_TARGET,
            "modes": {r.mode: asdict(r) for r in results},
        }
        print(json.dumps(report, indent=1))
    else:
        print(format_table(results, trace_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
