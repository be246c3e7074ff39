"""pyalloc.offload on steps whose input shapes take turns (bucketed sequence lengths): the
GPT-like model of :mod:`pyalloc.offloading.bench_models`, a budget of half the saved bytes of its
longest shape, beside the plain step (Note [Plans per shape] in pyalloc/offloading/session.py).

Prints the session's steps against the plain steps in thread time (all steps, and the second
half, once every shape has its plan), how many steps held more than the budget + 5% and the most
any held, and what each step was: P profiled, p planned, L a profile let go (it ran under DTR),
D under DTR (Note [Unsettled steps]). Every planned step counts its saves here (COUNT_EVERY=1).

    python3 tools/bench/offload_shapes.py [--lengths 48,64] [--steps 40] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from typing import Any

import torch

from pyalloc.offloading import bench_models as bm
from pyalloc.offloading import session as session_module
from pyalloc.offloading.session import offload


def run(lengths: list[int], steps: int, batch: int) -> dict[str, Any]:
    session_module.COUNT_EVERY = 1  # every planned step counts its saves: each one's peak is known
    torch.manual_seed(0)
    model = bm.GPTSmallish()
    inputs = {n: torch.randint(0, 1024, (batch, n)) for n in lengths}
    saved = max(bm.probed(copy.deepcopy(model), inputs[n])[0] for n in lengths)
    budget = saved // 2
    plain = copy.deepcopy(model)
    session = offload(budget=budget, pressure_callback=False)
    peaks: list[int] = []
    note_peak = session._note_peak

    def noted() -> None:  # what a DTR step holds that counts against the budget
        note_peak()
        peaks[-1] = max(peaks[-1], session.resident_bytes - session.uncounted_bytes)

    session._note_peak = noted  # type: ignore[method-assign]
    plain_s: list[float] = []
    session_s: list[float] = []
    kinds = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unsettled workload is in the figures
        for i in range(steps):
            x = inputs[lengths[i % len(lengths)]]
            t0 = time.thread_time()
            bm.train_step(plain, x)
            plain_s.append(time.thread_time() - t0)
            before = session.stats()
            peaks.append(0)
            t0 = time.thread_time()
            with session:
                bm.train_step(model, x)
            session_s.append(time.thread_time() - t0)
            after = session.stats()
            grew = {k for k in after if k.endswith("_total") and after[k] > before[k]}
            kind = "P" if "profile_steps_total" in grew else "D" if "unsettled_dtr_steps_total" in grew \
                else "L" if "profiles_let_go_total" in grew else "p"
            if kind == "p":
                peaks[-1] = int(after["step_saved_bytes_peak"])
            kinds.append(kind)
    half = steps // 2
    return {"lengths": lengths, "steps": steps, "budget_bytes": budget,
            "time_ratio": round(sum(session_s) / sum(plain_s), 3),
            "time_ratio_second_half": round(sum(session_s[half:]) / sum(plain_s[half:]), 3),
            "steps_over_budget": sum(1 for p in peaks if p > budget * 1.05),
            "max_vs_budget": round(max(peaks) / budget, 3), "kinds": "".join(kinds),
            "plans_kept": int(session.stats()["plans_kept"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="48,64", help="sequence lengths taking turns (at most 64)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        lengths = [int(v) for v in args.lengths.split(",") if v]
    except ValueError:
        lengths = []
    if not lengths or any(not 1 <= n <= 64 for n in lengths) or args.steps < 2:
        print("offload_shapes: --lengths takes sequence lengths from 1 to 64, comma-separated, and --steps "
              "at least 2", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    r = run(lengths, args.steps, args.batch)
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        print(f"lengths {r['lengths']}, {r['steps']} steps: {r['time_ratio']:.2f}x the plain steps, "
              f"{r['time_ratio_second_half']:.2f}x in the second half; {r['steps_over_budget']} steps over the "
              f"budget + 5% (at most {r['max_vs_budget']:.2f}x it); {r['plans_kept']} plans kept; {r['kinds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
