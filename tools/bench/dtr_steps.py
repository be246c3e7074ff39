"""What a step under per-operator DTR costs and holds (issue 20): ``policy="dtr"`` steps, and the
profiled first step of ``policy="plan"`` (which runs under DTR), beside the plain step, on the four
CPU models of :mod:`pyalloc.offloading.bench_models` at 90%, 50% and 25% of the plain step's
saved bytes.

For each model and fraction: the ratio of the fastest DTR step (after the first) to the fastest
plain step, run alternately, in thread time on one CPU thread; the same for a profiled step (a
new session each time, so each step is a first one); and what the DTR steps held at their peak,
as fractions of the plain step's saved bytes (each storage once, the leaves the step made
included): ``counted`` (``counted_resident_bytes_peak``: what the budget holds) and ``resident``
(parameters and the batch included). Note [Leaves DTR evicts] in pyalloc/offloading/session.py.

    python3 tools/bench/dtr_steps.py [--models gpt,bert] [--fractions 0.5] [--reps 4] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from typing import Any, Callable

import torch

from pyalloc.offloading import bench_models as bm
from pyalloc.offloading.session import offload


def _thread_seconds(step: Callable[[], object]) -> float:
    t0 = time.thread_time()
    step()
    return time.thread_time() - t0


def measure(name: str, fraction: float, reps: int, batch: int) -> dict[str, Any]:
    workload = bm.workloads("cpu")[name]
    torch.manual_seed(0)
    model, x = workload.make_model(), workload.make_input(batch)
    saved, _, _ = bm.probed(copy.deepcopy(model), x)
    budget = int(saved * fraction)
    dtr = offload(budget=budget, policy="dtr", pressure_callback=False)
    plain: list[float] = []
    dtr_steps: list[float] = []
    profiled: list[float] = []

    def under(session: Any, m: torch.nn.Module) -> Callable[[], object]:
        def step() -> object:
            with session:
                return bm.train_step(m, x)
        return step

    for _ in range(reps):  # each step on a fresh copy of the model (made outside the timing)
        m = copy.deepcopy(model)
        plain.append(_thread_seconds(lambda: bm.train_step(m, x)))
        dtr_steps.append(_thread_seconds(under(dtr, copy.deepcopy(model))))
        profiled.append(_thread_seconds(under(offload(budget=budget, pressure_callback=False), copy.deepcopy(model))))
    st = dtr.stats()
    base = min(plain)
    return {"model": name, "fraction": fraction, "saved_MiB": round(saved / 2**20, 2),
            "dtr_ratio": round(min(dtr_steps[1:] or dtr_steps) / base, 3),
            "profiled_ratio": round(min(profiled) / base, 3),
            "counted": round(st["counted_resident_bytes_peak"] / saved, 3),
            "resident": round(st["resident_bytes_peak"] / saved, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt,bert,resnet,lstm")
    parser.add_argument("--fractions", default="0.9,0.5,0.25")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    known = bm.workloads("cpu")
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in known]
    if unknown or args.reps < 2:
        print(f"dtr_steps: unknown model {unknown} (known: {','.join(known)})" if unknown
              else "dtr_steps: --reps must be at least 2", file=sys.stderr)
        return 2
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a floor or an unsettled workload is in the figures
        for fraction in (float(f) for f in args.fractions.split(",")):
            for name in models:
                rows.append(measure(name, fraction, args.reps, args.batch))
                if not args.json:
                    r = rows[-1]
                    print(f"{r['model']:7s} @{fraction:.0%}: DTR step {r['dtr_ratio']:.2f}x, profiled step "
                          f"{r['profiled_ratio']:.2f}x; held {r['counted']:.3f} counted, {r['resident']:.3f} "
                          f"with parameters and batch (of {r['saved_MiB']} MiB)", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
