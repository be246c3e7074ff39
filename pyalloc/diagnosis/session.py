"""The doctor of one process: ``with pyalloc.doctor(): ...`` and what ``pyalloc doctor`` starts.

Iterations are optimizer steps, seen through PyTorch's global optimizer step hooks
(``torch.optim.optimizer.register_optimizer_step_{pre,post}_hook``); the first optimizer that
steps defines them (a GAN's second optimizer steps inside the same iteration). A program that
never steps an optimizer has backward() calls as iterations (``torch.autograd.backward`` is
wrapped: ``Tensor.backward`` calls it). See Note [Doctor's storage tracking] for what is
measured, Note [Doctor's threads] for the program's other threads and Note [Doctor's growth
test] for what is called a leak.
"""

from __future__ import annotations

import os
import re
import sys
import time
import traceback
import weakref
from types import TracebackType
from typing import Any, Callable

import torch

from .advice import advise
from .growth import MIN_BOUNDARIES, Boundaries, boundary, find_leaks, reason_for
from .owners import Breakdown, breakdown
from .report import imbalance
from .sites import SiteTable
from .threads import ThreadWatch
from .tracker import StorageTracker

REPORT_VERSION = 1
MAX_REASONS = 10  # leaks whose reason is looked for, largest first


class DoctorStop(SystemExit):
    """Raised from the optimizer step (or backward) that completes the iterations asked for."""

    def __init__(self) -> None:
        super().__init__(0)


class Doctor:
    """Watches the tensors of the calling thread, and of the threads started while it runs, from
    start() (or ``with``) to stop().

    ``steps``: stop the program (raise DoctorStop, which ``with`` swallows and ``pyalloc doctor``
    turns into a normal exit) once that many iterations ran; None runs it to its end.
    ``print_report``: write the text report to stderr when the ``with`` block ends.
    """

    def __init__(self, steps: int | None = None, print_report: bool = True) -> None:
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be a positive integer or None, got {steps!r}")
        self.steps = steps
        self.print_report = print_report
        self.sites = SiteTable()
        self.tracker = StorageTracker(self.sites, self._new_peak)
        self.threads = ThreadWatch(self.tracker)
        self.peak: Breakdown | None = None
        self.phase = "forward"
        self.optimizer_steps = 0
        self.backward_calls = 0
        self._backward_depth = 0
        self._primary: "weakref.ref[torch.optim.Optimizer] | None" = None
        self._optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self.step_bounds = Boundaries()
        self.backward_bounds = Boundaries()
        self._graph_roots: dict[int, Any] = {}  # site -> weakref to its largest graph's root
        self.crash: dict[str, Any] | None = None
        self.internal_error: str | None = None  # the first error inside the doctor, if any
        self.oom: dict[str, Any] | None = None
        self.stopped = False
        self.report: dict[str, Any] | None = None
        self._handles: list[Any] = []
        self._saved_hooks: Any = None
        self._original_backward: Callable[..., Any] | None = None
        self._running = False
        self._started = 0.0
        self._seconds = 0.0

    # ---- start / stop ----------------------------------------------------------------------------

    def start(self) -> "Doctor":
        if self._running:
            raise RuntimeError("this doctor is already running")
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        self._started = time.perf_counter()
        self._handles = [
            nn_module.register_module_forward_pre_hook(self.tracker.module_pre),
            nn_module.register_module_forward_hook(self.tracker.module_post, always_call=True),
            optim_module.register_optimizer_step_pre_hook(self._step_pre),
            optim_module.register_optimizer_step_post_hook(self._step_post),
        ]
        self._original_backward = torch.autograd.backward
        torch.autograd.backward = self._backward  # type: ignore[assignment]
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self.tracker.pack, self.tracker.unpack)
        self._saved_hooks.__enter__()
        self.tracker.__enter__()
        self.threads.start()
        self._running = True
        return self

    def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        self._seconds = time.perf_counter() - self._started
        self.tracker.paused = True
        self.threads.stop()
        try:
            self.tracker.__exit__(None, None, None)
        finally:
            self._saved_hooks.__exit__(None, None, None)
            if torch.autograd.backward == self._backward:
                torch.autograd.backward = self._original_backward  # type: ignore[assignment]
            for handle in self._handles:
                handle.remove()
            self._handles = []

    def __enter__(self) -> "Doctor":
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if exc is not None:
            self.record_exception(exc)
        self.stop()
        self.report = self.build_report()
        if self.print_report:
            from .report import format_report

            sys.stderr.write(format_report(self.report))
            sys.stderr.flush()
        return isinstance(exc, DoctorStop)

    # ---- events ------------------------------------------------------------------------------------

    def _new_peak(self) -> None:
        try:
            self.peak = breakdown(self.tracker, list(self._optimizers), self.phase)
        except Exception as exc:
            self._internal_error(exc)

    def _step_pre(self, opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._optimizers.add(opt)
        self.phase = "optimizer step"

    def _step_post(self, opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self.phase = "forward"
        if self._primary is None or self._primary() is None:
            self._primary = weakref.ref(opt)
        if self._primary() is not opt:
            return
        self.optimizer_steps += 1
        self.tracker.iteration = self.optimizer_steps
        self._add_boundary(self.step_bounds, self.optimizer_steps)
        if self.steps is not None and self.optimizer_steps >= self.steps:
            self.stopped = True
            raise DoctorStop()

    def _backward(self, *args: Any, **kwargs: Any) -> Any:
        assert self._original_backward is not None
        self._backward_depth += 1
        self.phase = "backward"
        if self._backward_depth == 1:
            with self.tracker.lock:
                self.tracker.fallback_site = self.sites.current()
        try:
            result = self._original_backward(*args, **kwargs)
        finally:
            self._backward_depth -= 1
            if self._backward_depth == 0:
                self.phase = "forward"
                self.tracker.fallback_site = None
        if self._backward_depth == 0:
            self._after_backward()
        return result

    def _add_boundary(self, bounds: Boundaries, iteration: int) -> None:
        try:
            with self.tracker.lock:  # watched threads may be running operators
                b, self._graph_roots = boundary(self.tracker, iteration)
            bounds.add(b)
        except Exception as exc:  # the doctor must never break the program it watches
            self._internal_error(exc)

    def _internal_error(self, exc: BaseException) -> None:
        if self.internal_error is None:
            self.internal_error = f"{type(exc).__name__}: {exc}"

    def _after_backward(self) -> None:
        self.backward_calls += 1
        if self._primary is not None:
            return
        self.tracker.iteration = self.backward_calls
        self._add_boundary(self.backward_bounds, self.backward_calls)
        # With an optimizer its first step follows the first backward; one backward more
        # than asked for, with no step, says there is none.
        if self.steps is not None and self.backward_calls > self.steps:
            self.stopped = True
            raise DoctorStop()

    def record_exception(self, exc: BaseException) -> None:
        """A crash of the program (called with its traceback still holding its frames)."""
        if isinstance(exc, DoctorStop) or self.crash is not None:
            return
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            return
        self.crash = {
            "type": type(exc).__name__,
            "message": str(exc).strip().splitlines()[0] if str(exc).strip() else "",
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        }
        if isinstance(exc, torch.OutOfMemoryError):
            self.oom = self._at_oom(exc)

    def _at_oom(self, exc: BaseException) -> dict[str, Any]:
        paused, self.tracker.paused = self.tracker.paused, True
        try:
            with self.tracker.lock:
                b = breakdown(self.tracker, list(self._optimizers), self.phase)
            text = str(exc)
            device = parse_device(text)
            return {
                "request_bytes": parse_request(text),
                "device": device,
                "breakdown": b.to_json(),
                "other_processes": other_processes(),
                "allocator": allocator_state(),
                "pyalloc": pyalloc_at_oom(int(device.split(":")[1]) if device else 0),
                "advice": [a.to_json() for a in advise(b)],
            }
        finally:
            self.tracker.paused = paused

    # ---- the report ----------------------------------------------------------------------------------

    def build_report(self) -> dict[str, Any]:
        paused, self.tracker.paused = self.tracker.paused, True
        try:
            with self.tracker.lock:
                return self._build_report()
        finally:
            self.tracker.paused = paused

    def _build_report(self) -> dict[str, Any]:
        if self.optimizer_steps:
            kind: str | None = "optimizer step"
            bounds = self.step_bounds
        elif self.backward_calls:
            kind, bounds = "backward", self.backward_bounds
        else:
            kind, bounds = None, self.backward_bounds
        items = bounds.items
        growth, leaks = find_leaks(items)
        notes: list[str] = []
        if self.tracker.errors:
            self._internal_error(RuntimeError(f"{self.tracker.errors} operator outputs not recorded "
                                              f"({self.tracker.last_error})"))
        if self.internal_error:
            notes.append(f"the doctor hit an error of its own and may have missed something: {self.internal_error}")
        if kind is None:
            notes.append("no iterations were seen (no optimizer step and no backward()): "
                         "only the peak is reported")
        elif len(items) < MIN_BOUNDARIES:
            notes.append(f"only {bounds.count} iteration(s) ({kind}) were seen: growth is judged from "
                         f"{MIN_BOUNDARIES} (the first is warm-up)")
        since = items[1].iteration if len(items) > 1 else 0
        holders = [leak.site for leak in leaks if leak.graph_nodes_per_iteration]
        if any(leak.bytes_per_iteration > 0 for leak in leaks):
            # The graphs' holders are named in the reasons of the sites whose bytes they keep.
            leaks = [leak for leak in leaks if leak.bytes_per_iteration > 0]
        leak_rows = []
        for leak in leaks:
            leak.reason = reason_for(leak, self.tracker, self.sites, since, holders, self._graph_roots)
            site = self.sites[leak.site]
            leak_rows.append({
                "file": site.file, "line": site.line, "function": site.function,
                "called_from": f"{site.caller_file}:{site.caller_line}" if site.caller_file else None,
                "bytes_per_iteration": round(leak.bytes_per_iteration, 1),
                "graph_nodes_per_iteration": round(leak.graph_nodes_per_iteration, 1),
                "reason": leak.reason,
            })
        peak = self.peak or Breakdown()
        devices = {d: {"peak_bytes": n, "live_bytes": self.tracker.device_live.get(d, 0)}
                   for d, n in sorted(self.tracker.device_peak.items())}
        report: dict[str, Any] = {
            "version": REPORT_VERSION,
            "pid": os.getpid(),
            "argv": list(sys.argv),
            "iteration_kind": kind,
            "iterations": bounds.count,
            "optimizer_steps": self.optimizer_steps,
            "backward_calls": self.backward_calls,
            "growth_window": [items[1].iteration, items[-1].iteration] if len(items) >= MIN_BOUNDARIES else None,
            "growth_bytes_per_iteration": round(growth, 1),
            "leaks": leak_rows,
            "peak": peak.to_json(),
            "peak_bytes": self.tracker.peak_bytes,
            "devices": devices,
            "imbalance": imbalance({d: v["peak_bytes"] for d, v in devices.items()}),
            "allocator": allocator_state(),
            "gpu_processes": other_processes() if _cuda_in_use() else None,
            "advice": [a.to_json() for a in advise(peak)],
            "crash": self.crash,
            "oom": self.oom,
            "stopped_after_steps": self.steps if self.stopped else None,
            "storages_seen": self.tracker.storages_seen,
            "threads_watched": self.threads.threads_watched,
            "seconds": round(self._seconds or (time.perf_counter() - self._started), 3),
            "notes": notes,
        }
        return report


# ---- helpers ----------------------------------------------------------------------------------------

_UNITS = {"b": 1, "bytes": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_request(text: str) -> int | None:
    """The bytes of "Tried to allocate 2.00 GiB" in an OOM message, if it says."""
    m = re.search(r"[Tt]ried to allocate\s+([0-9.]+)\s*([A-Za-z]+)", text)
    if not m or m.group(2).lower() not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_device(text: str) -> str | None:
    m = re.search(r"GPU\s+(\d+)", text)
    return f"cuda:{m.group(1)}" if m else None


def _cuda_in_use() -> bool:
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    except Exception:
        return False


def allocator_state() -> dict[str, Any] | None:
    """Cached and fragmented bytes of each initialized CUDA device; None without CUDA."""
    try:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        from ..pytorch.install import is_installed

        pyalloc_installed = is_installed()
        out: dict[str, Any] = {"allocator": "pyalloc" if pyalloc_installed else "pytorch", "devices": {}}
        for d in range(torch.cuda.device_count()):
            stats = torch.cuda.memory_stats(d)
            reserved = int(stats.get("reserved_bytes.all.current", 0))
            allocated = int(stats.get("allocated_bytes.all.current", 0))
            out["devices"][f"cuda:{d}"] = {
                "reserved_bytes": reserved, "allocated_bytes": allocated,
                "cached_bytes": reserved - allocated,
                "fragmented_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
                "peak_reserved_bytes": int(stats.get("reserved_bytes.all.peak", 0)),
            }
        return out
    except Exception as exc:  # a driver problem must not cost the report
        return {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}


def pyalloc_at_oom(device: int) -> dict[str, int] | None:
    """pyalloc's own figures of its last OOM on `device` (request, reserved, allocated, cached free,
    largest free block), when pyalloc's library is loaded in this process; else None."""
    from .. import _lib

    if _lib._lib is None:
        return None
    try:
        from ..core import memory_stats

        stats = memory_stats(device)
    except Exception:
        return None
    if not stats.get("num_ooms"):
        return None
    out = {k.split(".", 1)[1]: int(v) for k, v in stats.items() if k.startswith("last_oom.")}
    out["num_ooms"] = int(stats["num_ooms"])
    out["fragmented_bytes"] = int(stats.get("inactive_split_bytes.all.current", 0))
    return out


def other_processes() -> dict[str, Any]:
    """The other processes on the GPUs, from NVML and gpumemd's registry; says why when it cannot."""
    try:
        from ..gpumemd.model import Collector

        snap = Collector(remove_dead=False).collect()
    except Exception as exc:
        return {"available": False, "error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                "processes": []}
    rows = []
    for p in snap.processes:
        if p.pid == os.getpid() or not p.device.startswith("cuda"):
            continue  # this process, or one on a host/sim backend (no GPU to share)
        rows.append({"pid": p.pid, "device": p.device, "used_bytes": p.used_bytes,
                     "pyalloc_reserved_bytes": p.allocator.reserved_bytes if p.allocator else None,
                     "command": p.command})
    return {"available": bool(snap.nvml_available or rows), "nvml": snap.nvml_available,
            "error": snap.nvml_error, "processes": rows}
