"""Offload benchmark: step time and saved-activation bytes of pyalloc.offload beside the baseline and
``torch.utils.checkpoint`` on every block (issue 20).

CPU mode (the default): four models (a GPT-like decoder, a BERT-like encoder, a ResNet-like CNN
and a stacked LSTM), each run as

- ``baseline``: plain training steps;
- ``checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) around every block;
- ``pyalloc@90%`` / ``@50%`` / ``@25%``: ``pyalloc.offload`` with a budget of that fraction of
  the baseline's saved bytes (90%: a budget a little below the step, what should cost little);
- ``pyalloc@ckpt``: with checkpoint's bytes as the budget;
- ``pyalloc@never``: a budget ten times the baseline's (never reached).

Saved bytes are the activations autograd holds (parameters and leaves excluded), each storage
counted once, at the step's peak. The baseline's and checkpoint's are measured by a counting
saved-tensor hook; checkpoint's add the block inputs it keeps, and are a lower bound of its peak
(its re-run's saves in backward are not visible to an outer hook). pyalloc's are the session's
own count, which includes its re-runs' saves. Step times are medians of interleaved repetitions
(baseline, checkpoint, pyalloc, ..., then the same turned by one column, ...), as ratios to the
baseline's median in the same run; one CPU thread. ``predicted_ratio`` is what the session's plan
expects: 1 + the forward time of what it re-runs and packs per step (as its profiled step and the
plan search's steps measured them) over the baseline's median step. ``time_ratio_min`` is the same ratio of the
fastest repetitions: a shared machine's interference only adds time, so the fastest step is the
column's own cost with the least of it (the plain step itself, run as ``pyalloc@never``, read
0.95-1.12 by medians and 0.99-1.03 by minima on one afternoon's 2-core machine). ``exact`` says whether every gradient equals the baseline's bit for bit.
On CPU there is nothing to gain from swapping to host memory (it is the same memory), so the
sessions here only drop and recompute.

The models and their step are :mod:`pyalloc.offloading.bench_models`. The GPU mode of this
benchmark (the largest batch that trains, time per sample against the baseline, checkpointing
and ``save_on_cpu``) is the offload check of ``pyalloc gpu-check --only offload``
(:mod:`pyalloc.gpucheck.offload`).

    python tools/bench/offload_bench.py [--json] [--reps N] [--models gpt,bert,resnet,lstm]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Any

from pathlib import Path

import torch
from torch import nn

# the checkout's pyalloc, not one installed in site-packages (run as a script, this folder is
# on the path, the checkout's root is not)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pyalloc.offloading.bench_models import Workload, probed, settle, train_step, workloads
from pyalloc.offloading.session import ActivationOffload, offload  # noqa: E402


# ---- measurement ---------------------------------------------------------------------------


def _checkpoint_peak(base_model: nn.Module, ckpt_model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Checkpoint's saved bytes at the end of forward (what an outer hook sees, with the block
    inputs it keeps), and its peak: when a block is re-run in backward, what was held when the
    block started in forward (later saves are freed by then) plus everything the block saves
    (measured in the baseline), the largest over blocks."""
    end_of_forward, at_start, _ = probed(ckpt_model, x)
    _, _, block_saves = probed(base_model, x)
    return end_of_forward, max([end_of_forward] + [a + s for a, s in zip(at_start, block_saves)])


class _Config:
    """One column: how to run a step, and what it measured."""

    def __init__(self, name: str, model: nn.Module, x: torch.Tensor, session: ActivationOffload | None) -> None:
        self.name, self.model, self.x, self.session = name, model, x, session
        self.times: list[float] = []
        self.peak = 0

    def step(self) -> dict[str, torch.Tensor]:
        if self.session is None:
            return train_step(self.model, self.x)
        with self.session:
            grads = train_step(self.model, self.x)
        self.peak = max(self.peak, int(self.session.stats()["step_saved_bytes_peak"]))
        return grads

    def timed(self) -> None:
        # CPU time of this thread (torch runs on one): the machine is shared, and wall time
        # counts the other processes' turns on the cores.
        t0 = time.thread_time()
        self.step()
        self.times.append(time.thread_time() - t0)


def bench_model(name: str, workload: Workload, batch: int, reps: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    base_model, x = workload.make_model(), workload.make_input(batch)
    expected = {k: v.clone() for k, v in train_step(base_model, x).items()}
    base_bytes = probed(base_model, x)[0]
    ckpt_model = copy.deepcopy(base_model)
    ckpt_model.checkpoint = True  # type: ignore[assignment]
    ckpt_eof, ckpt_bytes = _checkpoint_peak(base_model, ckpt_model, x)
    configs = [_Config("baseline", base_model, x, None), _Config("checkpoint", ckpt_model, x, None)]
    budgets = {"pyalloc@90%": base_bytes * 9 // 10, "pyalloc@50%": base_bytes // 2, "pyalloc@ckpt": ckpt_bytes,
               "pyalloc@25%": base_bytes // 4, "pyalloc@never": base_bytes * 10}
    floor_warned: dict[str, bool] = {}
    for label, limit in budgets.items():
        choice = {} if _SELECTIVE is None else {"selective": _SELECTIVE}
        session = offload(budget=limit, pressure_callback=False, **choice)
        config = _Config(label, copy.deepcopy(base_model), x, session)
        floor_warned[label] = settle(session, config.step)
        configs.append(config)
    exact = {}
    for c in configs:
        grads = c.step()
        exact[c.name] = grads.keys() == expected.keys() and all(torch.equal(grads[k], expected[k]) for k in grads)
        c.peak = 0 if c.session is not None else c.peak
    for rep in range(reps):  # interleaved: the machine's load hits every column alike; the order
        # turns each repetition, so that no column always runs after the same one (a step after
        # one that holds less memory pays for the difference: ~4% seen on the ResNet-like model)
        for c in configs[rep % len(configs):] + configs[:rep % len(configs)]:
            c.timed()
    base_t, base_min = statistics.median(configs[0].times), min(configs[0].times)
    rows = []
    for c in configs:
        t = statistics.median(c.times)
        budget = budgets.get(c.name)
        peak = c.peak if c.session is not None else (base_bytes if c.name == "baseline" else ckpt_bytes)
        st = c.session.stats() if c.session is not None else {}
        rows.append({
            "model": name, "config": c.name, "step_ms": round(t * 1e3, 2), "time_ratio": round(t / base_t, 3),
            "time_ratio_min": round(min(c.times) / base_min, 3),
            # what the plan itself expects to cost: the re-runs (and packs) it chose, as the
            # profile and the plan search measured them, over the baseline's step; the rest of time_ratio is
            # the mechanism (hooks, refills' Python) and the machine
            "predicted_ratio": round(1 + st["plan_recompute_seconds"] / base_t, 3) if st else None,
            "saved_MiB": round(peak / 2**20, 2),
            "saved_end_of_forward_MiB": round(ckpt_eof / 2**20, 2) if c.name == "checkpoint" else None, "saved_vs_baseline": round(peak / base_bytes, 3),
            "budget_MiB": round(budget / 2**20, 2) if budget is not None else None,
            "peak_vs_budget": round(peak / budget, 3) if budget else None,
            "floor_MiB": round(st["plan_floor_bytes"] / 2**20, 2) if st else None,
            # time spent making plans over the whole run (the profiled step's own cost is not in it)
            "planning_s": round(st["planning_seconds_total"], 2) if st else None,
            "below_floor_warned": floor_warned.get(c.name),
            "regions": st.get("plan_regions"), "outputs": st.get("plan_outputs"),
            "exact": exact[c.name],
        })
    return rows


def _keep_freed_memory() -> None:
    """Asks glibc's malloc to keep freed memory instead of returning it to the OS.

    Why: with the defaults, a step that frees more than 128 KiB at the top of the heap gives it
    back, and the next step page-faults it in again (seen: ~15,000 faults, +20% time, in the
    step after a pyalloc step that holds less). Interleaved columns would then charge one
    column's allocation pattern to the next. A caching allocator (PyTorch's on CUDA, pyalloc)
    keeps freed memory too. Best effort: nothing happens without glibc.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_max = -1, -4
    libc.mallopt(m_trim_threshold, 1 << 30)
    libc.mallopt(m_mmap_max, 0)  # every allocation from the heap, which is never trimmed


def run_cpu(reps: int, batch: int, models: list[str]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)  # a loaded 2-core machine: one thread keeps the noise down
    _keep_freed_memory()
    rows: list[dict[str, Any]] = []
    for name, workload in workloads("cpu").items():
        if name in models:
            rows += bench_model(name, workload, batch, reps)
    return rows


_SELECTIVE: bool | None = None  # --selective: None leaves pyalloc.offload's default


def main(argv: list[str] | None = None) -> int:
    global _SELECTIVE
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--reps", type=int, default=7, help="timed steps per column (interleaved)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--models", default="gpt,bert,resnet,lstm", help="comma-separated: gpt,bert,resnet,lstm")
    ap.add_argument("--selective", choices=("on", "off"), default=None,
                    help="plans with selective regions or whole-module re-runs only (default: offload's default)")
    args = ap.parse_args(argv)
    if args.selective is not None:
        _SELECTIVE = args.selective == "on"
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - {"gpt", "bert", "resnet", "lstm"})
    if unknown or not models:
        print(f"offload_bench: --models: unknown model {', '.join(unknown) or '(none)'} "
              "(choose from gpt,bert,resnet,lstm)", file=sys.stderr)
        return 2
    if args.reps < 1:
        print(f"offload_bench: --reps must be at least 1, got {args.reps}", file=sys.stderr)
        return 2
    rows = run_cpu(args.reps, args.batch, models)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = list(rows[0])
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]!s:>14}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
