"""`pyalloc stress`: the fragmentation stress suite.

Runs every workload, the recorded ones shipped in pyalloc/traces/workloads/ and the
generated adversarial patterns of pyalloc.traces.generators, through each policy
on the sim backend (fake addresses at GPU scale: 80 GiB unless a trace says
otherwise), and reports for each: peak live bytes, peak reserved bytes, the
smallest capacity with no failed allocation (min capacity, 2 MiB steps, and
its ratio to peak live), and the allocator's ns per operation.

Policies:
  pyalloc        this allocator with its defaults, through the same C ABI
                 PyTorch calls (one virtual-memory arena for requests of
                 every size, stitching, shared granules and moving slivers)
  pyalloc-small-pool
                 the previous defaults: arenas for the large pool, a small
                 pool of 2 MiB plain segments for requests up to 1 MiB (vmm=on)
  pyalloc-plain  this allocator with plain segments only (vmm=off)
  pyalloc-plan   the defaults plus iteration plans (plan=1; not run unless named)
  pyalloc-lifetime, pyalloc-plain-lifetime
                 lifetime-aware placement (lifetime=1), with arenas and with
                 plain segments (not run unless named)
  native         a MODEL of PyTorch's default caching allocator, not PyTorch
                 itself (allocator/src/replay/native_model.hpp says what it models);
                 labelled "native (model)" in the table and the plot
  native-expandable
                 a MODEL of PyTorch's caching allocator with
                 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, what a user
                 fighting fragmentation sets (allocator/src/replay/expandable_model.hpp);
                 labelled "expandable (model)"

Outputs: a table on stdout, a JSON report (every figure, per workload and
policy, with the date, the pyalloc version and the machine) and a PNG of
memory over time (live vs reserved per policy, one panel per workload).
On a machine where torch.cuda.is_available(), the pyalloc policy is also
replayed on the real device (backend=cuda).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .. import core
from .._deps import MissingDependency, available, missing_message, require
from . import generators
from .._lib import PyallocError
from ..command import unwritable
from .replay import (
    DEFAULT_CAPACITY,
    POLICIES,
    FlatTrace,
    ReplayResult,
    ReplayResultC,
    find_min_capacity,
    flatten,
    refuse_a_bad_environment,
    replay,
    run_replay,
)
from .trace import Trace, TraceError, load, workloads_dir

MiB = 1 << 20
GiB = 1 << 30
CURVE_POINTS = 400
QUICK_CURVE_POINTS = 100
DEFAULT_POLICIES = ("pyalloc", "pyalloc-small-pool", "pyalloc-plain", "native", "native-expandable")
TIMED_REPEATS = 3  # replays per workload and policy; ns/op is the best of them
DEFAULT_OUT = Path("stress-report")
REPORT_NAME = "stress-report.json"
PLOT_NAME = "stress-memory.png"


def policy_label(policy: str) -> str:
    """How a policy is named in every output: the native policies are models, and say so."""
    return {"native": "native (model)", "native-expandable": "expandable (model)"}.get(policy, policy)


class StressError(Exception):
    """A failure reported in one line (exit status 1)."""


# ---- workloads ------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    kind: str  # "recorded" or "generated"
    source: str
    flat: FlatTrace
    events: int
    iterations: int


def recorded_workloads() -> dict[str, Path]:
    """Every ``*.jsonl.gz`` shipped in pyalloc/traces/workloads/, by name (file name up to the first dot)."""
    return {p.name.split(".")[0]: p for p in sorted(workloads_dir().glob("*.jsonl.gz"))}


def available_workloads() -> list[str]:
    """Recorded workloads first (sorted), then generated ones."""
    recorded = list(recorded_workloads())
    return recorded + [name for name in generators.GENERATORS if name not in recorded]


def select_workloads(spec: str | None) -> list[str]:
    """The names in ``spec`` (comma-separated), in the order given; all when None."""
    known = available_workloads()
    if spec is None:
        return known
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise StressError("--workloads: no workload named")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise StressError(f"--workloads: unknown workload {unknown[0]!r} (known: {', '.join(known)})")
    return list(dict.fromkeys(names))


def select_policies(spec: str) -> list[str]:
    names = list(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    if not names:
        raise StressError("--policies: no policy named")
    for n in names:
        if n not in POLICIES:
            raise StressError(f"--policies: unknown policy {n!r} (expected {', '.join(POLICIES)})")
    return names


def load_workload(name: str, seed: int, quick: bool) -> Workload:
    recorded = recorded_workloads()
    trace: Trace
    if name in recorded:
        trace, kind = load(recorded[name]), "recorded"
    else:
        trace, kind = generators.generate(name, seed=seed, quick=quick), "generated"
    iterations = sum(1 for _, mark in trace.marks if mark == "iteration")
    return Workload(name, kind, trace.source, flatten(trace, name), len(trace), iterations)


# ---- running ----------------------------------------------------------------------


@dataclass
class PolicyRun:
    policy: str
    result: ReplayResult
    min_capacity_bytes: int | None
    seconds: float

    def report(self, peak_live: int) -> dict[str, Any]:
        r = self.result
        out: dict[str, Any] = {
            "label": policy_label(self.policy),
            "description": POLICIES.get(self.policy, ""),
            "backend": r.backend,
            "capacity_bytes": r.capacity_bytes,
            "ops": r.ops,
            "peak_reserved_bytes": r.peak_reserved_bytes,
            "reserved_over_live": r.reserved_over_live,
            "largest_free_at_peak_bytes": r.largest_free_at_peak_bytes,
            "ooms": r.ooms,
            "ns_per_op": r.ns_per_op,
            "min_capacity_bytes": self.min_capacity_bytes,
            "min_capacity_over_live": (self.min_capacity_bytes / peak_live
                                       if self.min_capacity_bytes is not None and peak_live else None),
            "seconds": self.seconds,
            "curve_live_bytes": r.curve_live,
            "curve_reserved_bytes": r.curve_reserved,
        }
        return out


@dataclass
class WorkloadRun:
    workload: Workload
    runs: dict[str, PolicyRun] = field(default_factory=dict)
    device: dict[str, Any] | None = None  # the real-device replay, when there is one


def run_policy(workload: Workload, policy: str, min_capacity: bool, curve_points: int) -> PolicyRun:
    """One workload through one policy: a replay (best ns/op of a few) and the min-capacity search.

    Memory figures are deterministic; the timing of one pass over a short
    trace is not (a preemption or a cold cache shows up as several times the
    usual ns/op), so the replay is repeated and the fastest pass reported.
    """
    start = time.perf_counter()
    result = replay(workload.flat, policy, "sim", None, "", curve_points)
    for _ in range(TIMED_REPEATS - 1):
        again = replay(workload.flat, policy, "sim", None, "", 0)
        result.ns_per_op = min(result.ns_per_op, again.ns_per_op)
    minimum = find_min_capacity(workload.flat, policy, "sim") if min_capacity else None
    return PolicyRun(policy, result, minimum, time.perf_counter() - start)


def replay_configured(flat: FlatTrace, curve_points: int) -> tuple[ReplayResultC, list[int], list[int]]:
    """The pyalloc policy through ``pyalloc_replay`` on the allocator as configured now.

    ``replay.replay`` configures sim or host itself and refuses any other
    backend; this is the same call for a backend configured by the caller
    (cuda, for the real-device run). Returns the result and the sampled
    live and reserved curves.
    """
    return run_replay(flat, "pyalloc", 0, curve_points)


def cuda_device() -> Any | None:
    """torch, when it is installed and sees a CUDA device; else None."""
    try:
        import torch
    except ImportError:
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:  # a broken driver install is "no device" here
        return None


def device_runs(runs: list[WorkloadRun], curve_points: int, torch: Any) -> dict[str, Any]:
    """Replays each workload with the pyalloc policy on the real GPU (backend=cuda).

    Trace streams are names; on cuda a stream is a CUstream, so each trace
    stream other than 0 is mapped to a real ``torch.cuda.Stream`` (0 stays the
    legacy default stream).
    """
    streams: dict[int, Any] = {}
    core.configure("backend=cuda,oom_report=0,trace=0")
    info: dict[str, Any] = {"backend": "cuda", "device_name": torch.cuda.get_device_name(0),
                            "workloads": {}}
    for run in runs:
        flat = run.workload.flat
        handles = array("Q")
        for s in flat.streams:
            if s != 0 and s not in streams:
                streams[s] = torch.cuda.Stream()
            handles.append(0 if s == 0 else int(streams[s].cuda_stream))
        start = time.perf_counter()
        result, live_curve, reserved_curve = replay_configured(dataclasses.replace(flat, streams=handles),
                                                              curve_points)
        peak_live = int(result.peak_live_bytes)
        run.device = {
            "peak_live_bytes": peak_live,
            "peak_reserved_bytes": int(result.peak_reserved_bytes),
            "reserved_over_live": result.peak_reserved_bytes / peak_live if peak_live else 0.0,
            "ooms": int(result.ooms),
            "ns_per_op": float(result.ns_per_op),
            "seconds": time.perf_counter() - start,
            "curve_live_bytes": live_curve,
            "curve_reserved_bytes": reserved_curve,
        }
        info["workloads"][run.workload.name] = run.device
    core.configure("backend=sim")
    return info


# ---- outputs ------------------------------------------------------------------------


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:,.0f}"


def _two_lines(label: str) -> tuple[str, str]:
    """A column header on two lines, split after its first space or hyphen."""
    for sep in (" ", "-"):
        if sep in label:
            head, tail = label.split(sep, 1)
            return (head + sep).rstrip(), tail
    return "", label


def format_table(runs: list[WorkloadRun], policies: list[str], wide: bool = False) -> str:
    """The table. Narrow (the default, under 100 columns for the default policies): workload,
    peak live, then per policy min cap / peak live. Wide: per policy reserved, min cap, min/live,
    ns/op."""
    if not wide:
        return _format_narrow_table(runs, policies)
    per_policy = ["reserved", "min cap", "min/live", "ns/op"]
    widths = [10, 10, 8, 7]
    head_w = max([len("workload")] + [len(r.workload.name) for r in runs])
    group_w = sum(widths) + len(widths) - 1
    lines = []
    top = f"{'':<{head_w}}  {'':>10}"
    sub = f"{'workload':<{head_w}}  {'peak live':>10}"
    for p in policies:
        top += " | " + policy_label(p).center(group_w)
        sub += " | " + " ".join(f"{c:>{w}}" for c, w in zip(per_policy, widths))
    lines += [top.rstrip(), sub, "-" * len(sub)]
    for run in runs:
        live = run.workload.flat.peak_live_bytes
        row = f"{run.workload.name:<{head_w}}  {_mib(live):>10}"
        for p in policies:
            pr = run.runs[p]
            cells = [_mib(pr.result.peak_reserved_bytes), _mib(pr.min_capacity_bytes), _ratio(pr, live),
                     f"{pr.result.ns_per_op:.0f}"]
            row += " | " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths))
        lines.append(row)
    lines.append("sizes in MiB; min cap: smallest capacity (2 MiB steps) with no failed allocation; "
                 "ns/op: allocator time per malloc or free, sim backend, best of " + str(TIMED_REPEATS) + " replays")
    lines += _model_notes(policies)
    return "\n".join(lines)


def _ratio(pr: PolicyRun, live: int) -> str:
    return "-" if pr.min_capacity_bytes is None or not live else f"{pr.min_capacity_bytes / live:.2f}"


def _reserved_ratio(pr: PolicyRun, live: int) -> str:
    return "-" if not live else f"{pr.result.peak_reserved_bytes / live:.2f}"


def _format_narrow_table(runs: list[WorkloadRun], policies: list[str]) -> str:
    searched = any(r.runs[p].min_capacity_bytes is not None for r in runs for p in policies)
    heads = [_two_lines(policy_label(p)) for p in policies]
    widths = [max(5, len(a), len(b)) for a, b in heads]
    head_w = max([len("workload")] + [len(r.workload.name) for r in runs])
    top = f"{'':<{head_w}}  {'peak live':>9}" + "".join(f"  {a:>{w}}" for (a, _), w in zip(heads, widths))
    sub = f"{'workload':<{head_w}}  {'MiB':>9}" + "".join(f"  {b:>{w}}" for (_, b), w in zip(heads, widths))
    lines = [top.rstrip(), sub, "-" * len(sub)]
    for run in runs:
        live = run.workload.flat.peak_live_bytes
        row = f"{run.workload.name:<{head_w}}  {_mib(live):>9}"
        cells = [_ratio(run.runs[p], live) if searched else _reserved_ratio(run.runs[p], live) for p in policies]
        row += "".join(f"  {c:>{w}}" for c, w in zip(cells, widths))
        lines.append(row)
    if searched:
        lines.append("each policy: min cap / peak live, where min cap is the smallest capacity (2 MiB steps) with")
        lines.append("no failed allocation (lower is better); --wide adds reserved, min cap in MiB and ns/op")
    else:  # --no-min-capacity: what was measured, not a column of dashes
        lines.append("each policy: peak reserved / peak live with no capacity limit (lower is better; no min")
        lines.append("capacity search: --no-min-capacity); --wide adds reserved in MiB and ns/op")
    lines += _model_notes(policies)
    return "\n".join(lines)


def _model_notes(policies: list[str]) -> list[str]:
    notes = []
    if "native" in policies:
        notes.append("native (model): a model of PyTorch's default caching allocator policy, not PyTorch itself")
    if "native-expandable" in policies:
        notes.append("expandable (model): a model of PyTorch's policy with expandable_segments:True, not PyTorch itself")
    return notes


def format_device_table(runs: list[WorkloadRun], device_name: str) -> str:
    head_w = max([len("workload")] + [len(r.workload.name) for r in runs])
    lines = [f"pyalloc on the real device ({device_name}, backend=cuda):",
             f"{'workload':<{head_w}}  {'peak live':>10} {'reserved':>10} {'res/live':>8} {'ns/op':>8}"]
    for run in runs:
        d = run.device or {}
        lines.append(f"{run.workload.name:<{head_w}}  {_mib(d.get('peak_live_bytes')):>10} "
                     f"{_mib(d.get('peak_reserved_bytes')):>10} {d.get('reserved_over_live', 0.0):>8.2f} "
                     f"{d.get('ns_per_op', 0.0):>8.0f}")
    return "\n".join(lines)


def package_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("pyalloc")
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover
        pass
    return core.version()


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    torch = sys.modules.get("torch")  # only when the device check imported it: no 4 s import for this
    if torch is not None:
        info["torch"] = str(getattr(torch, "__version__", "?"))
    return info


def build_report(runs: list[WorkloadRun], policies: list[str], args: argparse.Namespace,
                 curve_points: int, device: dict[str, Any] | None, seconds: float) -> dict[str, Any]:
    workloads: dict[str, Any] = {}
    for run in runs:
        w = run.workload
        entry: dict[str, Any] = {
            "kind": w.kind,
            "source": w.source,
            "events": w.events,
            "iterations": w.iterations,
            "peak_live_bytes": w.flat.peak_live_bytes,
            "curve_event_index": [k * w.events // curve_points for k in range(curve_points)],
            "policies": {p: run.runs[p].report(w.flat.peak_live_bytes) for p in policies},
        }
        if run.device is not None:
            entry["device"] = run.device
        workloads[w.name] = entry
    device_summary = None
    if device is not None:
        device_summary = {k: v for k, v in device.items() if k != "workloads"}
    return {
        "tool": "pyalloc stress",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pyalloc_version": package_version(),
        "library_version": core.version(),
        "machine": machine_info(),
        "backend": "sim",
        "default_capacity_bytes": DEFAULT_CAPACITY,
        "quick": bool(args.quick),
        "seed": args.seed,
        "min_capacity": not args.no_min_capacity,
        "curve_points": curve_points,
        "seconds": seconds,
        "policies": {p: {"label": policy_label(p), "description": POLICIES[p]} for p in policies},
        "workloads": workloads,
        "device_run": device_summary,
    }


def plot(runs: list[WorkloadRun], policies: list[str], curve_points: int, path: Path) -> None:
    """Memory over time, one panel per workload: live bytes and reserved bytes per policy."""
    matplotlib = require("matplotlib", "the stress plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs)
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows), squeeze=False)
    # pyalloc-plain places as PyTorch does, so its curve often lies exactly on native's: it is
    # drawn wide and light under the others, native thin and dashed over it, both visible.
    styles: dict[str, dict[str, Any]] = {
        "pyalloc": {"color": "tab:blue", "linestyle": "-"},
        "pyalloc-small-pool": {"color": "tab:cyan", "linestyle": "-"},
        "pyalloc-plain": {"color": "tab:purple", "linestyle": "-", "linewidth": 4.0, "alpha": 0.35},
        "pyalloc-plan": {"color": "tab:green", "linestyle": ":"},
        "pyalloc-lifetime": {"color": "tab:red", "linestyle": ":"},
        "pyalloc-plain-lifetime": {"color": "tab:brown", "linestyle": ":"},
        "native": {"color": "tab:orange", "linestyle": "--"},
        "native-expandable": {"color": "tab:olive", "linestyle": "--"},
    }
    for ax, run in zip(axes.flat, runs):
        w = run.workload
        x = [k * w.events // curve_points for k in range(curve_points)]
        curves = [run.runs[p].result.curve_reserved for p in policies]
        if run.device is not None:
            curves.append(run.device["curve_reserved_bytes"])
        top = max([w.flat.peak_live_bytes] + [max(c, default=0) for c in curves])
        unit, scale = ("GiB", GiB) if top >= 2 * GiB else ("MiB", MiB)
        live = run.runs[policies[0]].result.curve_live
        ax.plot(x, [v / scale for v in live], color="black", linewidth=1.2, label="live")
        for p in policies:
            style = {"linewidth": 1.2, **styles.get(p, {})}
            ax.plot(x, [v / scale for v in run.runs[p].result.curve_reserved],
                    label=f"{policy_label(p)} reserved", **style)
        if run.device is not None:
            ax.plot(x, [v / scale for v in run.device["curve_reserved_bytes"]], color="tab:green",
                    linestyle=":", linewidth=1.2, label="pyalloc reserved (real device)")
        ax.set_title(f"{w.name} ({w.kind})", fontsize=10)
        ax.set_xlabel("event index")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle("pyalloc stress: memory over time (sim backend; native, expandable = models of PyTorch's allocator)",
                 fontsize=11)
    # One legend for the figure, below the panels, not one over each panel's data.
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.9 / (3.4 * nrows), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- command line --------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    refuse_a_bad_environment()
    try:
        return _run(args)
    except BrokenPipeError:
        raise  # the reader went away: pyalloc's main stops quietly
    except (StressError, PyallocError, TraceError, KeyError, OSError) as e:
        message = str(e).strip("'\"") if isinstance(e, KeyError) else str(e)
        print(f"pyalloc stress: error: {message}", file=sys.stderr)
        return 1


class _NoBar:
    """What the stress run uses of a tqdm bar, when tqdm is not installed."""

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *_: Any) -> None:
        return None

    def set_postfix_str(self, _text: str) -> None:
        return None

    def update(self, _n: int = 1) -> None:
        return None


def _progress_bar(total: int, disable: bool) -> Any:
    """tqdm's bar on stderr; without tqdm (the base install), no bar and one line saying so."""
    if disable:
        return _NoBar()
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ModuleNotFoundError:
        print(f"pyalloc stress: note: no progress bar: {missing_message('tqdm', 'the progress bar')}",
              file=sys.stderr)
        return _NoBar()
    return tqdm(total=total, desc="pyalloc stress", unit="step", file=sys.stderr)


# The file formats matplotlib writes without extra packages (savefig picks one by the name's suffix).
PLOT_FORMATS = {"png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp"}


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    names = select_workloads(args.workloads)
    policies = select_policies(args.policies)
    curve_points = QUICK_CURVE_POINTS if args.quick else CURVE_POINTS
    out_dir = Path(args.out)
    json_path = Path(args.json) if args.json else out_dir / REPORT_NAME
    plot_path: Path | None = Path(args.plot) if args.plot else out_dir / PLOT_NAME
    if args.plot and plot_path is not None and plot_path.suffix.lower().lstrip(".") not in PLOT_FORMATS:
        # refused before the run, not by matplotlib after it
        raise StressError(f"--plot {args.plot}: not an image file name (one ending in "
                          f"{', '.join('.' + f for f in sorted(PLOT_FORMATS))})")
    for flag, path in (("--out", out_dir / REPORT_NAME), ("--json", None if args.json == "-" else json_path),
                       ("--plot", plot_path)):
        if path is not None and (problem := unwritable(path)) is not None:  # not after the run
            raise StressError(f"{flag} {path}: {problem}")
    if not available("matplotlib"):
        if args.plot:  # asked for by name: refused before the run, not after it
            raise MissingDependency(missing_message("matplotlib", "pyalloc stress --plot"))
        print(f"pyalloc stress: note: no plot: {missing_message('matplotlib', 'the plot')}", file=sys.stderr)
        plot_path = None

    torch = None if args.no_device else cuda_device()
    runs: list[WorkloadRun] = []
    steps = len(names) * (1 + len(policies)) + (len(names) if torch is not None else 0)
    with _progress_bar(steps, args.no_progress) as bar:
        for name in names:
            bar.set_postfix_str(f"{name}: load")
            run_ = WorkloadRun(load_workload(name, args.seed, args.quick))
            bar.update()
            for policy in policies:
                bar.set_postfix_str(f"{name}: {policy_label(policy)}")
                run_.runs[policy] = run_policy(run_.workload, policy, not args.no_min_capacity, curve_points)
                bar.update()
            runs.append(run_)
        device: dict[str, Any] | None = None
        device_error: str | None = None
        if torch is not None:
            bar.set_postfix_str("real device")
            try:
                device = device_runs(runs, curve_points, torch)
            except (PyallocError, RuntimeError) as e:  # RuntimeError: torch's CUDA errors
                device_error = f"the real-device run (backend=cuda) failed: {e}"
                device = {"backend": "cuda", "error": device_error}
            bar.update(len(names))

    report = build_report(runs, policies, args, curve_points, device, time.perf_counter() - started)
    table = format_table(runs, policies, wide=args.wide)
    if device is not None and device_error is None:
        table += "\n\n" + format_device_table(runs, device["device_name"])
    if args.json == "-":
        print(json.dumps(report, indent=1))
    else:
        print(table)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            json_path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        except OSError as e:
            raise StressError(f"cannot write the report to {json_path}: {e.strerror or e}") from None
    if plot_path is not None:
        plot(runs, policies, curve_points, plot_path)
    if args.json != "-":
        print(f"report: {json_path}\nplot:   {plot_path or '(none: matplotlib is not installed)'}\n"
              f"({len(runs)} workloads, {report['seconds']:.1f} s)")
    if device_error is not None:
        print(f"pyalloc stress: error: {device_error}", file=sys.stderr)
        return 1
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", metavar="NAME,...",
                        help="workloads to run (default: all recorded and generated: "
                             "see pyalloc/traces/workloads/ and pyalloc.traces.generators)")
    parser.add_argument("--policies", metavar="NAME,...", default=",".join(DEFAULT_POLICIES),
                        help=f"policies to compare (default: {','.join(DEFAULT_POLICIES)}; "
                             "pyalloc-small-pool is the previous defaults (vmm=on), pyalloc-plain pyalloc "
                             "without arenas, native a model of PyTorch's default, native-expandable of PyTorch "
                             "with expandable_segments:True)")
    parser.add_argument("--no-min-capacity", action="store_true",
                        help="skip the search for the smallest capacity that works (a bisection of replays)")
    parser.add_argument("--json", metavar="PATH",
                        help="where to write the JSON report (default: OUT/stress-report.json; '-' prints "
                             "it to stdout instead of the table)")
    parser.add_argument("--plot", metavar="PATH", help="where to write the PNG (default: OUT/stress-memory.png)")
    parser.add_argument("--out", metavar="DIR", default=str(DEFAULT_OUT),
                        help="directory for the report and the plot (default: stress-report/)")
    parser.add_argument("--quick", action="store_true",
                        help="smaller generated workloads and fewer curve points: a smoke run for tests")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated workloads (default 0)")
    parser.add_argument("--no-device", action="store_true",
                        help="skip the real-GPU run even where torch.cuda.is_available()")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--wide", action="store_true",
                        help="every column: per policy reserved, min cap (MiB), min/live and ns/op "
                             "(default: min cap / peak live alone, under 100 columns)")


def register_cli(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    parser = subparsers.add_parser(
        "stress", help="run the fragmentation stress suite: every workload through every policy",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(handler=run)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pyalloc.traces.stress ...``: the same command without the ``pyalloc`` front end."""
    parser = argparse.ArgumentParser(prog="pyalloc stress", description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(list(argv) if argv is not None else None))


if __name__ == "__main__":
    sys.exit(main())
