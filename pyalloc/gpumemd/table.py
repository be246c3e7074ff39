"""The `gpumemd status` / `top` table."""

from __future__ import annotations

import time

from .model import Snapshot
from .units import format_bytes


def _flags(p, now: float) -> str:  # type: ignore[no-untyped-def]
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


def render(snap: Snapshot, width: int = 200) -> str:
    now = snap.time
    lines = []
    src = "NVML" if snap.nvml_available else f"registry only ({snap.nvml_error})"
    lines.append(f"gpumemd  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}  source: {src}")
    lines.append(f"{'DEVICE':<9} {'NAME':<22} {'TOTAL':>9} {'USED':>9} {'FREE':>9} {'PYALLOC RESV':>12} {'PYALLOC ALLOC':>13}")
    for d in snap.devices:
        lines.append(f"{d.device:<9} {(d.name or d.source)[:22]:<22} {format_bytes(d.total_bytes):>9} "
                     f"{format_bytes(d.used_bytes):>9} {format_bytes(d.free_bytes):>9} "
                     f"{format_bytes(d.allocator_reserved_bytes):>12} {format_bytes(d.allocator_allocated_bytes):>13}")
    lines.append("")
    head = (f"{'DEVICE':<9} {'PID':>7} {'USER':<8} {'USED':>9} {'ALLOC':>9} {'RESV':>9} {'CACHED':>9} "
            f"{'LFREE':>9} {'SWAP':>9} {'OOM':>4} {'SM%':>4} {'CPU%':>5} {'FLAGS':<14} COMMAND")
    lines.append(head)
    for p in snap.processes:
        a = p.allocator
        def v(x):  # type: ignore[no-untyped-def]
            return format_bytes(x) if a is not None else "-"
        lines.append(
            f"{p.device:<9} {p.pid:>7} {(p.user or '?')[:8]:<8} {format_bytes(p.used_bytes):>9} "
            f"{v(a and a.allocated_bytes):>9} {v(a and a.reserved_bytes):>9} {v(a and a.cached_bytes):>9} "
            f"{v(a and a.largest_free_bytes):>9} {v(a and a.swapped_out_bytes):>9} "
            f"{(str(a.num_ooms) if a else '-'):>4} {('N/A' if p.sm_util is None else str(p.sm_util)):>4} "
            f"{('?' if p.cpu_percent is None else f'{p.cpu_percent:.0f}'):>5} {_flags(p, now):<14} "
            f"{(p.command or '?')}"[:width])
    if not snap.processes:
        lines.append("(no GPU processes)")
    if snap.skipped_records:
        lines.append("")
        for s in snap.skipped_records:
            lines.append(f"skipped {s.path}: {s.reason}")
    return "\n".join(lines)
