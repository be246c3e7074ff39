"""The `gpumemd status` / `top` table (its columns are explained in `gpumemd status --help`).

The table fits the width it is given: columns are dropped, least important
first, until the rest fits, and the command line takes what is left. With
``width=None`` every column is shown and nothing is cut.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .model import ProcessRow, Snapshot
from .units import format_bytes

MIN_COMMAND = 12  # a command narrower than this says nothing: drop another column first


def _flags(p: ProcessRow, now: float) -> str:
    out = []
    if p.flags.zombie:
        out.append("zombie")
    if p.flags.orphan:
        out.append("orphan")
    if p.flags.stale_heartbeat:
        out.append("stale")
    if p.flags.no_proc:
        out.append("no-proc")
    if p.flags.idle_since is not None:
        out.append(f"idle {int(now - p.flags.idle_since)}s")
    return ",".join(out) or "-"


@dataclass(frozen=True)
class Column:
    name: str
    width: int
    right: bool
    drop_order: int  # 0: never dropped; higher numbers go first when the table is too wide
    cell: Callable[[ProcessRow, float], str]


def _alloc(get: Callable[[ProcessRow], int | None]) -> Callable[[ProcessRow, float], str]:
    return lambda p, _now: format_bytes(get(p)) if p.allocator is not None else "-"


PROCESS_COLUMNS = [
    Column("DEVICE", 9, False, 0, lambda p, _n: p.device),
    Column("PID", 7, True, 0, lambda p, _n: str(p.pid)),
    Column("USER", 8, False, 3, lambda p, _n: (p.user or "?")[:8]),
    Column("USED", 9, True, 0, lambda p, _n: format_bytes(p.used_bytes)),
    Column("ALLOC", 9, True, 4, _alloc(lambda p: p.allocator.allocated_bytes if p.allocator else None)),
    Column("RESV", 9, True, 0, _alloc(lambda p: p.allocator.reserved_bytes if p.allocator else None)),
    Column("CACHED", 9, True, 5, _alloc(lambda p: p.allocator.cached_bytes if p.allocator else None)),
    Column("LFREE", 9, True, 8, _alloc(lambda p: p.allocator.largest_free_bytes if p.allocator else None)),
    Column("SWAP", 9, True, 9, _alloc(lambda p: p.allocator.swapped_out_bytes if p.allocator else None)),
    Column("OOM", 4, True, 7, lambda p, _n: str(p.allocator.num_ooms) if p.allocator else "-"),
    Column("SM%", 4, True, 6, lambda p, _n: "N/A" if p.sm_util is None else str(p.sm_util)),
    Column("CPU%", 5, True, 6, lambda p, _n: "?" if p.cpu_percent is None else f"{p.cpu_percent:.0f}"),
    Column("FLAGS", 14, False, 2, _flags),
]


def fit_columns(width: int | None) -> list[Column]:
    """The columns shown in ``width`` characters, leaving MIN_COMMAND for the command line."""
    shown = list(PROCESS_COLUMNS)
    if width is None:
        return shown
    while sum(c.width + 1 for c in shown) + MIN_COMMAND > width:
        droppable = [c for c in shown if c.drop_order]
        if not droppable:
            break
        shown.remove(max(droppable, key=lambda c: c.drop_order))
    return shown


def _row(cells: list[str], columns: list[Column]) -> str:
    return " ".join(f"{text:>{c.width}}" if c.right else f"{text:<{c.width}}" for text, c in zip(cells, columns))


def render(snap: Snapshot, width: int | None = 100) -> str:
    now = snap.time
    lines = []
    src = "NVML" if snap.nvml_available else f"registry only ({snap.nvml_error})"
    lines.append(f"gpumemd  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}  source: {src}")
    name_w = 22 if width is None or width >= 90 else 12
    lines.append(f"{'DEVICE':<9} {'NAME':<{name_w}} {'TOTAL':>9} {'USED':>9} {'FREE':>9} {'PYALLOC RESV':>12} "
                 f"{'PYALLOC ALLOC':>13}")
    for d in snap.devices:
        name = f"LOST: {d.error}" if d.error else (d.name or d.source)
        lines.append(f"{d.device:<9} {name[:name_w]:<{name_w}} {format_bytes(d.total_bytes):>9} "
                     f"{format_bytes(d.used_bytes):>9} {format_bytes(d.free_bytes):>9} "
                     f"{format_bytes(d.allocator_reserved_bytes):>12} {format_bytes(d.allocator_allocated_bytes):>13}")
    lines.append("")
    columns = fit_columns(width)
    lines.append(_row([c.name for c in columns], columns) + " COMMAND")
    for p in snap.processes:
        lines.append(_row([c.cell(p, now) for c in columns], columns) + " " + (p.command or "?"))
    if width is not None:
        lines = [line[:width] for line in lines]  # the notes below are not cut: they say what is wrong
    if not snap.processes:
        lines.append("(no GPU processes)")
    if snap.registry_problem:
        lines.append("")
        lines.append(f"warning: registry {snap.registry_problem}")
    if snap.skipped_records:
        lines.append("")
        for s in snap.skipped_records:
            lines.append(f"skipped {s.path}: {s.reason}")
    return "\n".join(lines)
