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

On CUDA, PyTorch's allocator may hold at most :data:`MEMORY_CAP_BYTES` (4 GiB; the config's
``memory_cap_bytes`` may say otherwise): ``torch.cuda.set_per_process_memory_fraction`` makes it
raise ``torch.OutOfMemoryError`` there, as at the end of a device that small. Every largest batch
is then that of a 4 GiB device, and the batches, the steps and so the check's time are the same on
an 80 GiB H100 as on a 140 GiB H200 (without the cap, the first run, on an H200, timed out on
both models and gave no figure). The figures give the cap
(``memory_cap_bytes``, ``memory_cap``) and the allocator's peak (``peak_reserved_bytes``, which
shows that the cap held; the CUDA context is outside both).

Measured, in this order:

1. The baseline's largest batch: the largest that runs :data:`SEARCH_STEPS` steps without
   ``torch.OutOfMemoryError``, by doubling from ``start_batch`` up to ``max_batch``, then
   bisection (:mod:`.batch_search`). Between attempts the inputs, gradients and session go and
   the cache is emptied.
2. The common batch, :data:`COMMON_FRACTION` of the baseline's largest. There: the baseline's
   saved-activation bytes (a counting saved-tensor hook; parameters and leaves excluded), which
   set pyalloc's budget and save_on_cpu's host-memory cap.
3. The other columns' largest batches, the same way (pyalloc's first, after its plan settled),
   each search starting at the batch they are to pass, the baseline's first that failed (or the
   one after its largest; doubling from ``start_batch`` again spent pyalloc's share of the time
   on batches below it, and starting at the baseline's largest spent it on a batch that shows
   nothing) and
   stopping at :data:`SEARCH_RATIO` times the baseline's largest (``stop: "3x the plain
   step's"``): enough to show which column trains the larger batch, and it bounds the
   batches that this search and item 5 run. save_on_cpu's search also stops (``stop: "host memory"``)
   where its saved bytes, the baseline's per sample times the batch, would pass
   :data:`HOST_FRACTION` of the host's available memory: pinning more could get the process
   killed. ``stop`` says why a search's doubling ended.
4. At the common batch, on one input with the same seeds: every column's gradients against the
   baseline's (kept in host memory, which the cap does not leave room for), bit for bit
   (``exact``; those steps run with cuDNN's deterministic algorithms and
   ``torch.use_deterministic_algorithms(True)``: ``determinism`` "strict", or "warn_only (strict:
   ...)" where the model has an operation without a deterministic kernel or the plain step ran
   out of memory under strict kernels; ``baseline_repeatable`` says
   whether two plain steps agreed, without which ``exact`` means nothing); then each column's
   step time, the median of up to ``steps`` interleaved repetitions (the column order turning
   each time; ``common_steps`` says how many ran), and its ratio to the baseline's
   (``time_ratio``).
5. At each column's own largest batch: the median of up to ``steps`` step times, per sample
   (``seconds_per_sample``; ``steps_at_largest`` says how many, 0 with None when no time was
   left).

Time. The parent kills this process ``time_limit`` seconds after starting it (the config's
``time_limit``, else ``seconds`` / :data:`SEARCH_SHARE`: ``pyalloc gpu-check`` gives the
searches that share of the check's time); so that the figures come out instead, every step
watches one end, that limit less :data:`MARGIN_FRACTION` of it and :data:`MARGIN_SECONDS`,
counted from the process's start. The searches get ``seconds`` (at most :data:`SEARCH_SHARE` of
what is left when they begin), split among the columns in :data:`SEARCH_ORDER` by
:data:`SEARCH_WEIGHTS`, what one leaves over going to the next; the common batch gets half of
what is left after them, the timings at the largest batches the rest, split evenly in the same
order. An attempt or a timing that would pass its share (predicted from the column's latest time
per sample: :class:`Bench`) is not started:
a search then stops (``stop: "time"`` while it was still doubling), a median is of fewer steps,
a time per sample may be missing. The common batch's steps always run, one repetition at least:
its figures are the targets'.

What that comes to on a GPU, estimated from the models (nothing here was measured on one):

- GPT-like (GPU sizes): 98.0 M parameters, 0.37 GiB, and as much again in gradients. Saved
  activations: 0.77 GiB a sample counted on the CPU (``bench_models.probed``), where attention
  takes PyTorch's math path and saves its 12x512x512 scores and probabilities, and its dropout
  noise as floats (a leaf the step made, which counts: Note [Step-made leaves]); on CUDA (float32,
  a float mask, dropout) ``scaled_dot_product_attention`` should take the memory-efficient
  kernel, which saves neither: by count about 25 MiB a block (and under 1 MiB of boolean dropout
  masks), 0.31 GiB a sample with the logits. With
  about 50 MiB a sample more at the loss, the plain step's largest batch under 4 GiB is about
  (4 - 0.4) / 0.36, 10 (5 if attention saved its matrices), the common batch 9. A sample-step
  (one sample, forward and backward) is about 0.3 TFLOP: 6 x 85 M weights x 512 tokens, and
  attention.
- ResNet-like at 224x224: 0.12 M parameters; 147 MiB saved a sample (convolutions save the same
  on CUDA); largest batch about 4 GiB / 0.18 GiB, 22, the common batch 19. A sample-step is
  about 11 GFLOP, and of the order of 1 GB of memory traffic (the stem and stage 1 run at
  224x224).
- Steps, for a plain largest batch L and pyalloc's about 2L (``start_batch`` 4, ``steps`` 10;
  a failing attempt counted as one step): the plain search tries 6 batches for the GPT-like
  model (3 fail) and 8 for the ResNet-like one (3 fail); pyalloc's 8 and 10 (4 fail), of 5 steps
  with its settling; checkpoint's and save_on_cpu's 4 and 6, of 3 steps, up to 3L; then 47 steps
  at the common batch and 4 x 11 at the largest batches (L, 2L, 3L, 3L). In all about 160 steps
  and 230 L sample-steps (2,300, about 0.7 PFLOP and the recomputation of checkpoint and pyalloc)
  for the GPT-like model, about 180 steps and 250 L (5,500) for the ResNet-like one. save_on_cpu
  also moves its saved bytes to pinned host memory and back at every step: about 0.4 TiB over
  PCIe for each model, with at most 3L samples' saves pinned at once (about 9 GiB of host memory
  for either). Its timing at its largest batch comes last, and is what the time limit trims
  first.

On the CPU (the tests of this command) nothing runs out of memory and there is no cap: every
search stops at ``max_batch``, and the figures show that the columns run, agree and are timed,
not what a GPU would measure; torch runs one thread there, so that every step reduces in one
order. Exactness is asked of checkpoint and pyalloc (the targets in :mod:`.run`), not of
save_on_cpu: with ``pin_memory=True`` it packs each saved tensor into a new contiguous one, so a
saved transposed weight loses its strides and the matrix product in backward may round
differently (on the CPU, the ResNet-like model's gradients then differ from the plain step's in
the last bits; the GPT-like model's are equal). The process runs under the allocator its config
names (``pyalloc gpu-check`` asks for PyTorch's own, so that the columns differ only in what
happens to saved activations, and so that the cap applies). Only the child process imports this
module (it imports torch).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import statistics
import time
import warnings
from dataclasses import replace
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from ..offloading.bench_models import Workload, gpu_workloads, probed, settle, train_step, workloads
from ..offloading.session import ActivationOffload, offload
from .batch_search import BatchSearch, largest_batch

COLUMNS = ("baseline", "checkpoint", "save_on_cpu", "pyalloc")
SEARCH_ORDER = ("baseline", "pyalloc", "checkpoint", "save_on_cpu")  # the targets' columns first: time runs out last
SEARCH_WEIGHTS = {"baseline": 2, "pyalloc": 3, "checkpoint": 1, "save_on_cpu": 1}
"""Each column's part of the searches' time: the targets' columns get more, pyalloc most (each of
its attempts starts a session, whose first steps profile and plan: seconds, where a plain attempt
at the same batch takes a fraction of one on a GPU)."""
BUDGET_FRACTION = 0.5  # pyalloc's budget, of the baseline's saved-activation bytes at the common batch
COMMON_FRACTION = 0.9  # the common batch, of the baseline's largest
SEARCH_STEPS = 3  # steps a batch must run to count as training
HOST_FRACTION = 0.5  # of the host's available memory, the most save_on_cpu's search may pin
MEMORY_CAP_BYTES = 4 << 30  # on CUDA, the most PyTorch's allocator may hold: the check's size on any device
SEARCH_RATIO = 3  # the other columns' searches stop at this multiple of the baseline's largest batch
SEARCH_SHARE = 0.5  # of the process's time limit, what run.py gives the searches (OFFLOAD_SEARCH_SHARE there)
MARGIN_FRACTION = 0.05  # of the time limit, kept for the figures to come out and the process to exit
MARGIN_SECONDS = 3.0  # and this, on top

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
    """The model under test, its inputs and its device: running, timing and searching columns.

    ``rate`` holds, per column, the seconds per sample of its latest attempt that trained (its
    start and :data:`SEARCH_STEPS` steps), from which the time of a later attempt or timing at
    another batch is predicted, so that none starts that would end after its deadline. The latest,
    not the slowest: a process's first attempt also pays the device's warm-up (the CUDA context,
    cuBLAS and cuDNN handles), and on an H200 the slowest rate, that of batch 4, said that batch 32
    of the ResNet-like model would take seconds where it took a tenth of one, and stopped the
    plain step's search at 16 (docs/benchmarks/2026-11-28-gpu-check-h200-run6.md). ``attempts``
    holds every attempt, per column: (batch, trained, seconds)."""

    def __init__(self, workload: Workload, device: str) -> None:
        self.device = device
        torch.manual_seed(0)
        self.model = workload.make_model()
        self.make_input = workload.make_input
        self.rate: dict[str, float] = {}
        self.attempts: dict[str, list[tuple[int, bool, float]]] = {}

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

    def fits(self, column: Column, batch: int, deadline: float) -> bool:
        """Whether an attempt at this batch would end by the deadline, as far as the column's rate
        says (it does when nothing trained yet)."""
        return time.monotonic() + self.rate.get(column.name, 0.0) * batch <= deadline

    def _attempt(self, column: Column, batch: int) -> None:
        x = self.input(batch)
        column.start(x)
        for _ in range(SEARCH_STEPS):
            column.step(x)
        self.sync()

    def trains(self, column: Column, batch: int) -> bool:
        began = time.monotonic()
        try:
            self._attempt(column, batch)  # its frame, and the tensors in it, go with the exception
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        column.stop()
        self.release()
        seconds = time.monotonic() - began
        self.attempts.setdefault(column.name, []).append((batch, ok, round(seconds, 3)))
        if ok:
            self.rate[column.name] = seconds / batch
        return ok

    def search(self, column: Column, start: int, cap: int, deadline: float) -> BatchSearch:
        """:func:`.largest_batch`, no attempt of which starts that the column's rate says would end
        after the deadline (the search then says what it found so far)."""
        return largest_batch(lambda batch: self.trains(column, batch), start, cap, deadline,
                             affordable=lambda batch: self.fits(column, batch, deadline))

    def _step_times(self, column: Column, batch: int, steps: int, deadline: float) -> list[float]:
        x = self.input(batch)
        column.start(x)
        column.step(x)
        times = [self.timed(column, x)]
        while len(times) < steps and time.monotonic() + max(times) <= deadline:
            times.append(self.timed(column, x))
        return times

    def per_sample(self, column: Column, batch: int, steps: int, deadline: float) -> tuple[float | None, int]:
        """The median of up to ``steps`` step times at this batch, per sample, and how many steps
        that is; (None, 0) when no batch trained, when the time left is too short, or when it ran
        out of memory this time."""
        if batch < 1 or not self.fits(column, batch, deadline):
            return None, 0
        try:
            times = self._step_times(column, batch, steps, deadline)
        except torch.OutOfMemoryError:
            times = []
        column.stop()
        self.release()
        return (statistics.median(times) / batch if times else None), len(times)


def _host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the free pages."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _process_age() -> float:
    """Seconds since this process started (Linux: /proc), else 0."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, in clock ticks since boot
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    return 0.0


def _time_limit(cfg: dict[str, Any]) -> tuple[float, float]:
    """The process's time limit in seconds, and the ``time.monotonic()`` by which the figures must
    be out (the module docstring's "Time")."""
    limit = float(cfg.get("time_limit") or cfg.get("seconds", 120) / SEARCH_SHARE)
    return limit, time.monotonic() - _process_age() + limit * (1 - MARGIN_FRACTION) - MARGIN_SECONDS


def _share(end: float, parts: float, weight: float = 1.0) -> float:
    """The deadline of a share of ``weight`` parts of ``parts`` (even parts) of the time until ``end``."""
    now = time.monotonic()
    return now + max(0.0, end - now) * weight / parts


def _cap_memory(device: str, cap: int) -> tuple[int | None, str]:
    """On CUDA, caps what PyTorch's allocator may hold from now on at ``cap`` bytes (or the
    device's whole memory, when smaller); the cap in bytes (None: no cap) and in words."""
    if device != "cuda":
        return None, "none (on the CPU, max_batch ends the searches)"
    total = torch.cuda.mem_get_info()[1]
    fraction = min(1.0, cap / total)
    try:
        torch.cuda.set_per_process_memory_fraction(fraction)
    except (RuntimeError, NotImplementedError) as e:  # an allocator that has no fraction
        return None, f"none: set_per_process_memory_fraction failed ({e})"
    capped = int(fraction * total)
    return capped, (f"{capped / (1 << 30):.1f} GiB of the device's {total / (1 << 30):.1f} GiB "
                    f"(set_per_process_memory_fraction({fraction:.4f}))")


@contextlib.contextmanager
def _deterministic(strict: bool) -> Iterator[None]:
    """Deterministic kernels where PyTorch has them, so that two runs of the same step can agree bit
    for bit; restored after. ``strict`` is ``warn_only=False``: an operation that has no
    deterministic kernel then raises, and without it the fused attention kernels (memory-efficient
    and flash) take their non-deterministic backward, which PyTorch chooses when warn_only is set
    (the GPT-like model's plain steps differed on an H200 so); not strict, such an operation only
    warns."""
    was_algorithms, was_warn = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    was_cudnn = torch.backends.cudnn.deterministic
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    torch.backends.cudnn.deterministic = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        torch.use_deterministic_algorithms(was_algorithms, warn_only=was_warn)
        torch.backends.cudnn.deterministic = was_cudnn


def _exactness(bench: Bench, columns: list[Column], x: torch.Tensor,
               guarded: Callable[[Column, Callable[[], Any]], Any]) -> tuple[str, dict[str, tuple[bool, float | None]]]:
    """Each column's gradients against a plain step's (the baseline's own row: a second plain
    step), under strict determinism: "strict"; or, where strict determinism refused an
    operation (no deterministic kernel) or the plain step ran out of memory under it (the
    deterministic backward of fused attention may need more), under warn_only: "warn_only
    (strict: why)". ``guarded(column, fn)`` runs ``fn`` for a column other than the baseline and
    gives None when it ran out of memory (its row then says it is not exact)."""
    refused = ""
    for strict in (True, False):
        try:
            with _deterministic(strict=strict):
                expected = _on_host(columns[0].step(x))
                diffs = {c.name: _inexact if (grads := guarded(c, functools.partial(c.step, x))) is None
                         else _difference(grads, expected) for c in columns}
                return ("strict" if strict else f"warn_only (strict: {refused})"), diffs
        except RuntimeError as e:
            if not strict:
                raise
            if isinstance(e, torch.OutOfMemoryError):
                refused = "out of memory"
            elif "deterministic" in str(e):  # PyTorch's alert: "does not have a deterministic implementation"
                refused = "an operation without a deterministic kernel"
            else:
                raise
        for column in columns:  # what the refused step left, a session stopped mid-step included
            column.stop()
        bench.release()
        for column in columns:
            guarded(column, functools.partial(column.start, x))
    raise AssertionError("unreachable: the warn_only pass returns or raises")


_inexact: tuple[bool, float | None] = (False, None)


def _on_host(grads: Grads) -> Grads:
    """A copy in host memory (under the cap there is no room for a second set on the device)."""
    return {k: v.to("cpu", copy=True) for k, v in grads.items()}


def _difference(grads: Grads, expected: Grads) -> tuple[bool, float | None]:
    """Whether the gradients equal the expected ones (in host memory) bit for bit, and the largest
    difference (None when they are not gradients of the same parameters)."""
    if grads.keys() != expected.keys():
        return False, None
    grads = {k: v.cpu() for k, v in grads.items()}
    exact = all(torch.equal(grads[k], expected[k]) for k in grads)
    worst = max((float((grads[k] - expected[k]).abs().max()) for k in grads), default=0.0)
    return exact, worst


def _at_common_batch(bench: Bench, columns: list[Column], batch: int, steps: int,
                     deadline: float) -> tuple[bool, str, int, dict[str, dict[str, Any]]]:
    """Whether two plain steps agree and under which determinism (:func:`_exactness`), how many
    repetitions were timed, and per column: exactness against the baseline, then the interleaved
    step times, all at one batch on one input. The repetitions stop at ``steps`` or where the next
    would end after the deadline (one at least). A column other than the baseline that runs out of
    memory at this batch (which the baseline trains) is left out from then on, its row saying so
    (``out_of_memory``) instead of the check losing every figure."""
    x = bench.input(batch)
    out_of_memory: set[str] = set()

    def guarded(column: Column, run: Callable[[], Any]) -> Any:
        if column.name in out_of_memory:
            return None
        try:
            return run()
        except torch.OutOfMemoryError:
            if column.name == "baseline":
                raise
        out_of_memory.add(column.name)
        column.stop()
        bench.release()
        return None

    for column in columns:
        guarded(column, lambda: column.start(x))
    determinism, diffs = _exactness(bench, columns, x, guarded)
    repeatable = diffs["baseline"][0]
    times: dict[str, list[float]] = {c.name: [] for c in columns}
    repetition = 0.0
    for rep in range(steps):  # the order turns, so that no column always runs after the same one
        if rep and time.monotonic() + repetition > deadline:
            break
        began = time.monotonic()
        for column in columns[rep % len(columns):] + columns[:rep % len(columns)]:
            seconds = guarded(column, lambda: bench.timed(column, x))
            if seconds is not None:
                times[column.name].append(seconds)
        repetition = max(repetition, time.monotonic() - began)
    base = statistics.median(times["baseline"])
    rows = {}
    for column in columns:
        median = statistics.median(times[column.name]) if column.name not in out_of_memory else None
        exact, worst = diffs[column.name]
        rows[column.name] = {"step_seconds": median, "time_ratio": None if median is None else round(median / base, 3),
                             "exact": exact, "max_abs_diff": worst, "out_of_memory": column.name in out_of_memory}
        if column.session is not None:
            stats = column.session.stats()
            predicted = float(stats["plan_recompute_seconds"])
            rows[column.name].update(saved_peak_bytes=int(stats["step_saved_bytes_peak"]),
                                     floor_bytes=int(stats["plan_floor_bytes"]), regions=int(stats["plan_regions"]),
                                     outputs=int(stats["plan_outputs"]), below_floor_warned=column.floor_warned,
                                     # what the plan expected its re-runs and packs to cost, on the
                                     # device's clock (Note [Device time] in offloading/clock.py)
                                     plan_recompute_seconds=predicted, predicted_ratio=round(1 + predicted / base, 3),
                                     planning_seconds=round(float(stats["planning_seconds_total"]), 3))
        column.stop()
    return repeatable, determinism, len(times["baseline"]), rows


def compare(cfg: dict[str, Any]) -> dict[str, Any]:
    """The measurement of the module docstring. CONFIG keys: ``model`` ("gpt" or "resnet"),
    ``device``, ``start_batch``, ``max_batch``, ``steps``, ``seconds`` (for the searches),
    ``time_limit`` (the process's, from its start; default ``seconds`` / :data:`SEARCH_SHARE`),
    ``memory_cap_bytes`` (CUDA; default :data:`MEMORY_CAP_BYTES`)."""
    limit, end = _time_limit(cfg)
    device = cfg.get("device", "cuda")
    # Strict determinism refuses every cuBLAS product unless cuBLAS has a fixed workspace, set before
    # its first handle (PyTorch's words: "you must set an environment variable"); a user's own wins.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if device == "cpu":
        torch.set_num_threads(1)  # one reduction order: several threads may split a product differently
    cap_bytes, cap_words = _cap_memory(device, int(cfg.get("memory_cap_bytes", MEMORY_CAP_BYTES)))
    sizes: Callable[[str], dict[str, Workload]] = gpu_workloads if device == "cuda" else workloads
    bench = Bench(sizes(device)[cfg["model"]], device)
    start, cap, steps = cfg.get("start_batch", 1), cfg.get("max_batch", 1 << 16), cfg.get("steps", 10)
    now = time.monotonic()
    searches_end = now + min(float(cfg.get("seconds", 120)), SEARCH_SHARE * max(0.0, end - now))

    baseline = Column("baseline", bench.model, 0)
    parts = sum(SEARCH_WEIGHTS.values())
    searches = {"baseline": bench.search(baseline, start, cap, _share(searches_end, parts, SEARCH_WEIGHTS["baseline"]))}
    if searches["baseline"].largest == 0:
        raise NothingTrains(f"the plain step did not train at batch {min(start, cap)}"
                            if searches["baseline"].stop != "time" else "no time was left to run the plain step")
    common = max(1, int(COMMON_FRACTION * searches["baseline"].largest))
    saved = probed(bench.model, bench.input(common))[0]
    bench.release()
    budget = int(BUDGET_FRACTION * saved)
    columns = {name: baseline if name == "baseline" else Column(name, bench.model, budget) for name in COLUMNS}

    host_cap = int(HOST_FRACTION * _host_available_bytes() * common / max(1, saved))
    ratio_cap = SEARCH_RATIO * searches["baseline"].largest
    # The others start at the batch they are to pass: the plain step's first that failed (or the
    # one after its largest, when its search stopped on time or at the cap).
    beyond = searches["baseline"].first_failing or searches["baseline"].largest + 1
    parts -= SEARCH_WEIGHTS["baseline"]
    for name in SEARCH_ORDER[1:]:
        limits = [(cap, "max_batch"), (ratio_cap, f"{SEARCH_RATIO}x the plain step's")]
        if name == "save_on_cpu":
            limits.append((host_cap, "host memory"))
        column_cap, why = min(limits, key=lambda pair: pair[0])  # on a tie, max_batch
        begin = min(column_cap, max(start, beyond))
        found = bench.search(columns[name], begin, column_cap, _share(searches_end, parts, SEARCH_WEIGHTS[name]))
        parts -= SEARCH_WEIGHTS[name]
        searches[name] = replace(found, stop=why) if found.stop == "max_batch" else found

    ordered = [columns[name] for name in COLUMNS]
    bench.release()
    allocated_before_common = torch.cuda.memory_allocated() if device == "cuda" else None  # what the searches left
    repeatable, determinism, common_steps, at_common = _at_common_batch(bench, ordered, common, steps, _share(end, 2))
    bench.release()
    at_largest = {}
    for done, name in enumerate(SEARCH_ORDER):
        at_largest[name] = bench.per_sample(columns[name], searches[name].largest, steps,
                                            _share(end, len(SEARCH_ORDER) - done))
    figures: dict[str, Any] = {
        "model": f"{cfg['model']}-like", "sizes": "gpu" if device == "cuda" else "cpu",
        "memory_cap_bytes": cap_bytes, "memory_cap": cap_words, "common_batch": common,
        "baseline_saved_bytes": saved, "budget_bytes": budget,
        "budget": f"{BUDGET_FRACTION:.0%} of the baseline's saved-activation bytes at the common batch",
        "baseline_repeatable": repeatable, "determinism": determinism,
        "allocated_before_common_bytes": allocated_before_common, "common_steps": common_steps,
        "time_limit_seconds": round(limit, 1),
        "columns": {}}
    if device == "cuda":
        figures["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    for name in COLUMNS:
        found = searches[name]
        per_sample, timed = at_largest[name]
        row = {"largest_batch": found.largest, "first_failing_batch": found.first_failing, "stop": found.stop,
               "seconds_per_sample": per_sample, "steps_at_largest": timed,
               "attempts": [list(a) for a in bench.attempts.get(name, [])]}
        row.update(at_common[name])
        figures["columns"][name] = row
    return figures
