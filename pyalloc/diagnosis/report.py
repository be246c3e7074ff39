"""The doctor's report as text, and the merge of the reports of several processes."""

from __future__ import annotations

import os
from typing import Any

OWNER_LABELS = (("parameters", "parameters"), ("gradients", "gradients"),
                ("optimizer_state", "optimizer state"), ("activations", "activations"), ("other", "other"))


def size(n: float | int | None) -> str:
    if n is None:
        return "?"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n:.0f} B"


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def _iterations(n: int) -> str:
    return f"{n} iteration" if n == 1 else f"{n} iterations"


def _breakdown_lines(b: dict[str, Any], indent: str = "  ") -> list[str]:
    lines = []
    for key, label in OWNER_LABELS:
        extra = ""
        if key == "activations" and b.get("activations_by_module"):
            extra = "  (" + ", ".join(f"{m} {size(n)}" for m, n in list(b["activations_by_module"].items())[:4]) + ")"
        lines.append(f"{indent}{label:<16} {size(b.get(key, 0)):>11}{extra}")
    devices = b.get("devices") or {}
    if len(devices) > 1:
        for d, owners in devices.items():
            lines.append(f"{indent}on {d}: {size(sum(owners.values()))}")
    return lines


def _advice_lines(advice: list[dict[str, Any]]) -> list[str]:
    if not advice:
        return ["  (nothing to suggest: no saved activations or live gradients to act on)"]
    return [f"  {i}. {a['change']}: saves {size(a['saves_bytes'])} ({a['basis']})"
            for i, a in enumerate(advice, 1)]


def format_report(r: dict[str, Any]) -> str:
    out: list[str] = []
    who = " ".join(r.get("argv") or []) or f"pid {r.get('pid')}"
    kind = r.get("iteration_kind")
    seen = f"{r['iterations']} iterations ({kind}s)" if kind else "no iterations"
    out.append(f"pyalloc doctor: {who}: {seen}")
    for note in r.get("notes") or []:
        out.append(f"  note: {note}")
    if r.get("stopped_after_steps"):
        out.append(f"  stopped after {r['stopped_after_steps']} iterations, as asked")
    crash = r.get("crash")
    if crash:
        message = crash["message"] if len(crash["message"]) <= 160 else crash["message"][:157] + "..."
        out.append(f"  the program failed: {crash['type']}: {message} (traceback above); "
                   "this report covers what ran until then")
    window = r.get("growth_window")
    if kind and window:
        out.append("")
        g = r["growth_bytes_per_iteration"]
        out.append(f"Growth: {'+' if g > 0 else ''}{size(g)} of live tensors per iteration "
                   f"(iterations {window[0]} to {window[1]}; the first is warm-up)")
        if not r["leaks"]:
            out.append("  no allocation site grows")
        for leak in r["leaks"]:
            nodes = (f", +{leak['graph_nodes_per_iteration']:.0f} graph nodes"
                     if leak.get("graph_nodes_per_iteration") else "")
            caller = leak.get("called_from")
            called = f", called from {_short(caller.rpartition(':')[0])}:{caller.rpartition(':')[2]}" if caller else ""
            out.append(f"  {_short(leak['file'])}:{leak['line']} ({leak['function']}{called}): "
                       f"+{size(leak['bytes_per_iteration'])}/iteration{nodes}")
            if leak["reason"]:
                out.append(f"      {leak['reason']}")
    peak = r["peak"]
    out.append("")
    phase = f", in the {peak['phase']}" if peak.get("phase") else ""
    out.append(f"Peak: {size(r.get('peak_bytes', peak.get('total')))} of live tensors "
               f"(after {_iterations(peak.get('iteration', 0))}{phase}); by owner:")
    out += _breakdown_lines(peak)
    devices = r.get("devices") or {}
    if len(devices) > 1:
        out.append("Devices (peak of each): " + ", ".join(f"{d} {size(v['peak_bytes'])}" for d, v in devices.items()))
        imb = r.get("imbalance")
        if imb:
            ratio = f", {imb['ratio']}x" if imb.get("ratio") else ""
            out.append(f"  imbalance: {imb['largest']} holds {size(imb['difference_bytes'])} more than "
                       f"{imb['smallest']}{ratio}")
    alloc = r.get("allocator")
    if alloc and "devices" in alloc:
        for d, s in alloc["devices"].items():
            out.append(f"Allocator ({alloc['allocator']}) {d}: reserved {size(s['reserved_bytes'])}, "
                       f"cached {size(s['cached_bytes'])}, fragmented {size(s['fragmented_bytes'])}")
    oom = r.get("oom")
    if oom:
        out.append("")
        where = f" on {oom['device']}" if oom.get("device") else ""
        out.append(f"Out of memory{where}: the failing request was {size(oom.get('request_bytes'))}; "
                   f"at that moment, by owner:")
        out += _breakdown_lines(oom["breakdown"])
        mine = oom.get("pyalloc")
        if mine:
            out.append(f"  pyalloc's allocator at the failure: reserved {size(mine.get('reserved_bytes'))}, "
                       f"allocated {size(mine.get('allocated_bytes'))}, cached free "
                       f"{size(mine.get('cached_free_bytes'))}, largest free block "
                       f"{size(mine.get('largest_free_bytes'))}, limit {size(mine.get('limit_bytes'))}")
        others = oom.get("other_processes") or {}
        if others.get("processes"):
            out.append("  other processes on the GPUs:")
            for p in others["processes"]:
                out.append(f"    pid {p['pid']} {p['device']}: {size(p['used_bytes'])} {p.get('command') or ''}")
        elif others.get("available"):
            out.append("  no other process uses the GPUs")
        else:
            out.append(f"  other processes on the GPUs: unknown ({others.get('error') or 'no NVML and no gpumemd registry'})")
        out.append("Advice, by the bytes each would save at the failing request:")
        out += _advice_lines(oom["advice"])
    elif r.get("advice"):
        out.append("If the peak is too high, by the bytes each would save at the peak:")
        out += _advice_lines(r["advice"])
    return "\n".join(out) + "\n"


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report for several processes (torchrun, DDP): the main fields are those of the process
    with the highest peak, with the leaks of all, devices at their highest, and every report
    under ``processes``."""
    if len(reports) == 1:
        return reports[0]
    main: dict[str, Any] = dict(max(reports, key=lambda r: int(r["peak_bytes"])))
    leaks = [dict(leak, pid=r["pid"]) for r in reports for leak in r["leaks"]]
    leaks.sort(key=lambda k: -k["bytes_per_iteration"])
    main["leaks"] = leaks
    main["growth_bytes_per_iteration"] = sum(r["growth_bytes_per_iteration"] for r in reports)
    devices: dict[str, dict[str, int]] = {}
    for r in reports:
        for d, v in r["devices"].items():
            key = d if d != "cpu" else f"cpu (pid {r['pid']})"
            cur = devices.setdefault(key, {"peak_bytes": 0, "live_bytes": 0})
            cur["peak_bytes"] = max(cur["peak_bytes"], v["peak_bytes"])
            cur["live_bytes"] = max(cur["live_bytes"], v["live_bytes"])
    main["devices"] = devices
    main["imbalance"] = imbalance({d: v["peak_bytes"] for d, v in devices.items()})
    main["processes"] = reports
    main["crash"] = next((r["crash"] for r in reports if r.get("crash")), None)
    main["oom"] = next((r["oom"] for r in reports if r.get("oom")), None)
    return main


def imbalance(peaks: dict[str, int]) -> dict[str, Any] | None:
    """Spread of the per-device peaks: over CUDA devices when there are any, else all devices."""
    cuda = {d: n for d, n in peaks.items() if d.startswith("cuda")}
    pool = cuda or peaks
    if len(pool) < 2:
        return None
    high = max(pool, key=lambda d: pool[d])
    low = min(pool, key=lambda d: pool[d])
    return {"devices": sorted(pool), "largest": high, "smallest": low,
            "difference_bytes": pool[high] - pool[low],
            "ratio": round(pool[high] / pool[low], 3) if pool[low] else None}
