"""The offload check of ``pyalloc gpu-check`` (issue 20): ``pyalloc.offload`` against the plain
step, hand-written checkpointing and swap through pinned host memory, on one model, every figure
from one process (so that the columns' times compare).

Columns, each a way to run the same training step on the same model (forward and backward, no
optimizer, float32; the models of :mod:`pyalloc.offloading.bench_models`, at their GPU sizes on
CUDA and their CPU sizes on the CPU):

- ``baseline``: the plain step;
- ``checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) around every block;
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the step: every
  saved tensor goes to pinned host memory in forward and comes back in backward;
- ``pyalloc``: ``pyalloc.offload(budget=B, swap=False)``, the planned policy (it re-runs modules);
  B is :data:`BUDGET_FRACTION` of the baseline's saved-activation bytes at the common batch.
  ``swap=False`` only changes the profiled first step (DTR drops instead of swapping), so that no
  host memory enters pyalloc's figures: save_on_cpu is the swap column. A plan is made for one
  input shape, so each batch gets a fresh session, run until its plan settled.

Measured, in this order:

1. The baseline's largest batch: the largest that runs :data:`SEARCH_STEPS` steps without
   ``torch.OutOfMemoryError``, by doubling from ``start_batch`` up to ``max_batch``, then
   bisection (:mod:`.batch_search`). Between attempts the inputs, gradients and session go and
   the cache is emptied.
2. The common batch, :data:`COMMON_FRACTION` of the baseline's largest. There: the baseline's
   saved-activation bytes (a counting saved-tensor hook; parameters and leaves excluded), which
   set pyalloc's budget and save_on_cpu's host-memory cap.
3. The other columns' largest batches, the same way (pyalloc's after its plan settled).
   save_on_cpu's search also stops (``stop: "host memory"``) where its saved bytes, the
   baseline's per sample times the batch, would pass :data:`HOST_FRACTION` of the host's
   available memory: pinning more could get the process killed. Each column's search has a
   quarter of ``seconds``; ``stop`` says why its doubling ended.
4. At the common batch, on one input with the same seeds: every column's gradients against the
   baseline's, bit for bit (``exact``; those steps run with cuDNN's deterministic algorithms and
   ``torch.use_deterministic_algorithms(True, warn_only=True)``, and ``baseline_repeatable`` says
   whether two plain steps agreed, without which ``exact`` means nothing); then each column's
   step time, the median of ``steps`` interleaved repetitions (the column order turning each
   time), and its ratio to the baseline's (``time_ratio``).
5. At each column's own largest batch: the median of ``steps`` step times, per sample
   (``seconds_per_sample``).

Exactness is asked of checkpoint and pyalloc (the targets in :mod:`.run`), not of save_on_cpu:
with ``pin_memory=True`` it packs each saved tensor into a new contiguous one, so a saved
transposed weight loses its strides and the matrix product in backward may round differently (on
the CPU, the ResNet-like model's gradients then differ from the plain step's in the last bits;
the GPT-like model's are equal). The process runs under the allocator its config names
(``pyalloc gpu-check`` asks for PyTorch's own, so that the columns differ only in what happens to
saved activations).

On the CPU (the tests of this command) nothing runs out of memory: every search stops at
``max_batch``, and the figures show that the columns run, agree and are timed, not what a GPU
would measure; torch runs one thread there, so that every step reduces in one order. Only the child process imports this module (it imports torch).
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
import warnings
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from ..offloading.bench_models import Workload, gpu_workloads, probed, settle, train_step, workloads
from ..offloading.session import ActivationOffload, offload
from .batch_search import BatchSearch, largest_batch

COLUMNS = ("baseline", "checkpoint", "save_on_cpu", "pyalloc")
BUDGET_FRACTION = 0.5  # pyalloc's budget, of the baseline's saved-activation bytes at the common batch
COMMON_FRACTION = 0.9  # the common batch, of the baseline's largest
SEARCH_STEPS = 3  # steps a batch must run to count as training
HOST_FRACTION = 0.5  # of the host's available memory, the most save_on_cpu's search may pin

Grads = dict[str, torch.Tensor]


class NothingTrains(Exception):
    """The plain step did not train at the first batch: there is nothing to compare against."""


@contextlib.contextmanager
def _checkpointing(model: nn.Module) -> Iterator[None]:
    model.checkpoint = True  # type: ignore[assignment]
    try:
        yield
    finally:
        model.checkpoint = False  # type: ignore[assignment]


class Column:
    """One way to run the training step on the model."""

    def __init__(self, name: str, model: nn.Module, budget: int) -> None:
        self.name, self.model, self.budget = name, model, budget
        self.session: ActivationOffload | None = None
        self.floor_warned = False

    def _around(self) -> ContextManager[Any]:
        if self.name == "checkpoint":
            return _checkpointing(self.model)
        if self.name == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        if self.name == "pyalloc":
            assert self.session is not None, "start() comes first"
            return self.session
        return contextlib.nullcontext()

    def start(self, x: torch.Tensor) -> None:
        """pyalloc: a fresh session for this input's shape, run until its plan settled."""
        if self.name != "pyalloc":
            return
        self.session = offload(budget=self.budget, swap=False)
        self.floor_warned = settle(self.session, lambda: self.step(x))

    def step(self, x: torch.Tensor) -> Grads:
        with self._around():
            return train_step(self.model, x)

    def stop(self) -> None:
        self.session = None
        self.model.zero_grad(set_to_none=True)


class Bench:
    """The model under test, its inputs and its device: running, timing and searching columns."""

    def __init__(self, workload: Workload, device: str) -> None:
        self.device = device
        torch.manual_seed(0)
        self.model = workload.make_model()
        self.make_input = workload.make_input

    def input(self, batch: int) -> torch.Tensor:
        torch.manual_seed(batch)
        return self.make_input(batch)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def release(self) -> None:
        """What a finished or failed attempt left: cycles collected, the device cache emptied."""
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def timed(self, column: Column, x: torch.Tensor) -> float:
        self.sync()
        start = time.perf_counter()
        column.step(x)
        self.sync()
        return time.perf_counter() - start

    def _attempt(self, column: Column, batch: int) -> None:
        x = self.input(batch)
        column.start(x)
        for _ in range(SEARCH_STEPS):
            column.step(x)
        self.sync()

    def trains(self, column: Column, batch: int) -> bool:
        try:
            self._attempt(column, batch)  # its frame, and the tensors in it, go with the exception
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        column.stop()
        self.release()
        return ok

    def search(self, column: Column, start: int, cap: int, seconds: float) -> BatchSearch:
        return largest_batch(lambda batch: self.trains(column, batch), start, cap, time.monotonic() + seconds)

    def _step_times(self, column: Column, batch: int, steps: int) -> list[float]:
        x = self.input(batch)
        column.start(x)
        column.step(x)
        return [self.timed(column, x) for _ in range(steps)]

    def per_sample(self, column: Column, batch: int, steps: int) -> float | None:
        """The median step time at this batch, per sample; None when no batch trained, or when it
        ran out of memory this time."""
        if batch < 1:
            return None
        try:
            per_sample: float | None = statistics.median(self._step_times(column, batch, steps)) / batch
        except torch.OutOfMemoryError:
            per_sample = None
        column.stop()
        self.release()
        return per_sample


def _host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the free pages."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """Deterministic kernels where PyTorch has them (warnings where it does not), so that two runs
    of the same step can agree bit for bit; restored after."""
    was_algorithms, was_warn = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    was_cudnn = torch.backends.cudnn.deterministic
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        torch.use_deterministic_algorithms(was_algorithms, warn_only=was_warn)
        torch.backends.cudnn.deterministic = was_cudnn


def _difference(grads: Grads, expected: Grads) -> tuple[bool, float | None]:
    """Whether the gradients equal the expected ones bit for bit, and the largest difference (None
    when they are not gradients of the same parameters)."""
    if grads.keys() != expected.keys():
        return False, None
    exact = all(torch.equal(grads[k], expected[k]) for k in grads)
    worst = max((float((grads[k] - expected[k]).abs().max()) for k in grads), default=0.0)
    return exact, worst


def _at_common_batch(bench: Bench, columns: list[Column], batch: int,
                     steps: int) -> tuple[bool, dict[str, dict[str, Any]]]:
    """Whether two plain steps agree, and per column: exactness against the baseline, then the
    interleaved step times, all at one batch on one input."""
    x = bench.input(batch)
    for column in columns:
        column.start(x)
    with _deterministic():
        expected = {k: v.clone() for k, v in columns[0].step(x).items()}
        diffs = {c.name: _difference(c.step(x), expected) for c in columns}  # the baseline: a second plain step
    repeatable = diffs["baseline"][0]
    times: dict[str, list[float]] = {c.name: [] for c in columns}
    for rep in range(steps):  # the order turns, so that no column always runs after the same one
        for column in columns[rep % len(columns):] + columns[:rep % len(columns)]:
            times[column.name].append(bench.timed(column, x))
    base = statistics.median(times["baseline"])
    rows = {}
    for column in columns:
        median = statistics.median(times[column.name])
        exact, worst = diffs[column.name]
        rows[column.name] = {"step_seconds": median, "time_ratio": round(median / base, 3), "exact": exact,
                             "max_abs_diff": worst}
        if column.session is not None:
            stats = column.session.stats()
            rows[column.name].update(saved_peak_bytes=int(stats["step_saved_bytes_peak"]),
                                     floor_bytes=int(stats["plan_floor_bytes"]), regions=int(stats["plan_regions"]),
                                     outputs=int(stats["plan_outputs"]), below_floor_warned=column.floor_warned)
        column.stop()
    return repeatable, rows


def compare(cfg: dict[str, Any]) -> dict[str, Any]:
    """The measurement of the module docstring. CONFIG keys: ``model`` ("gpt" or "resnet"),
    ``device``, ``start_batch``, ``max_batch``, ``steps``, ``seconds``."""
    device = cfg.get("device", "cuda")
    if device == "cpu":
        torch.set_num_threads(1)  # one reduction order: several threads may split a product differently
    sizes: Callable[[str], dict[str, Workload]] = gpu_workloads if device == "cuda" else workloads
    bench = Bench(sizes(device)[cfg["model"]], device)
    start, cap, steps = cfg.get("start_batch", 1), cfg.get("max_batch", 1 << 16), cfg.get("steps", 10)
    quarter = cfg.get("seconds", 120) / 4

    baseline = Column("baseline", bench.model, 0)
    searches = {"baseline": bench.search(baseline, start, cap, quarter)}
    if searches["baseline"].largest == 0:
        raise NothingTrains(f"the plain step did not train at batch {min(start, cap)}")
    common = max(1, int(COMMON_FRACTION * searches["baseline"].largest))
    saved = probed(bench.model, bench.input(common))[0]
    bench.release()
    budget = int(BUDGET_FRACTION * saved)
    columns = [baseline] + [Column(name, bench.model, budget) for name in COLUMNS[1:]]

    host_cap = int(HOST_FRACTION * _host_available_bytes() * common / max(1, saved))
    for column in columns[1:]:
        column_cap = min(cap, host_cap) if column.name == "save_on_cpu" else cap
        found = bench.search(column, start, column_cap, quarter)
        if found.stop == "max_batch" and column_cap < cap:
            found = BatchSearch(found.largest, found.first_failing, "host memory")
        searches[column.name] = found

    repeatable, at_common = _at_common_batch(bench, columns, common, steps)
    bench.release()
    figures: dict[str, Any] = {
        "model": f"{cfg['model']}-like", "sizes": "gpu" if device == "cuda" else "cpu", "common_batch": common,
        "baseline_saved_bytes": saved, "budget_bytes": budget,
        "budget": f"{BUDGET_FRACTION:.0%} of the baseline's saved-activation bytes at the common batch",
        "baseline_repeatable": repeatable, "columns": {}}
    for column in columns:
        found = searches[column.name]
        row = {"largest_batch": found.largest, "first_failing_batch": found.first_failing, "stop": found.stop,
               "seconds_per_sample": bench.per_sample(column, found.largest, steps)}
        row.update(at_common[column.name])
        figures["columns"][column.name] = row
    return figures
