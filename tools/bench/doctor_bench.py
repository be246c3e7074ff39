"""What `pyalloc doctor` costs: a training step's time under the doctor against the same step
without it, on CPU, for a small CNN and a small transformer; and the doctor's own memory after
few and after many iterations of a small MLP (it must level off, not grow with the run).

    python3 tools/bench/doctor_bench.py [--steps 30] [--repeats 3] [--json]

Runs are interleaved (plain, doctor, plain, doctor, ...) with one torch thread, and the median
of the per-step medians is reported, because the machine may be shared. The doctor is the same
`pyalloc.doctor()` that `pyalloc doctor -- python train.py` starts in the program.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import pyalloc  # noqa: E402


def cnn() -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(128, 10))
    return model, lambda: (torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens))).flatten(0, 1)


def transformer() -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    return Transformer(), lambda: (torch.randint(0, 1000, (16, 64)), torch.randint(0, 1000, (16 * 64,)))


MODELS = {"cnn": cnn, "transformer": transformer}


def step_times(model: nn.Module, opt: torch.optim.Optimizer, batch: Callable[[], Any], steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        x, y = batch()
        start = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def measure(name: str, steps: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    step_times(model, opt, batch, 3)  # warm-up: optimizer state, lazy init
    plain, doctored = [], []
    report: dict[str, Any] = {}
    for _ in range(repeats):
        plain.append(statistics.median(step_times(model, opt, batch, steps)))
        with pyalloc.doctor(print_report=False) as d:
            doctored.append(statistics.median(step_times(model, opt, batch, steps)))
        report = d.report or {}
    p, q = statistics.median(plain), statistics.median(doctored)
    return {"model": name, "params": sum(t.numel() for t in model.parameters()), "steps": steps,
            "repeats": repeats, "plain_step_ms": round(p * 1e3, 2), "doctor_step_ms": round(q * 1e3, 2),
            "ratio": round(q / p, 2), "leaks": len(report.get("leaks", [])),
            "growth_bytes_per_iteration": report.get("growth_bytes_per_iteration"),
            "storages_seen": report.get("storages_seen")}


def mlp() -> tuple[nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, lambda: (torch.randn(16, 32), torch.randint(0, 10, (16,)))


def own_memory(counts: tuple[int, ...]) -> dict[str, Any]:
    """Python heap the doctor holds after clean runs of a small MLP of `counts` steps
    (tracemalloc, in bytes): it must level off (at MAX_BOUNDARIES boundaries), not grow with the run."""
    out = {}
    for steps in counts:
        torch.manual_seed(0)
        model, batch = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        step_times(model, opt, batch, 2)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        with pyalloc.doctor(print_report=False) as d:
            step_times(model, opt, batch, steps)
            held = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        out[steps] = {"held_bytes": held, "boundaries_kept": len(d.step_bounds.items),
                      "sites": len(d.sites.sites)}
    return {"after_steps": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [measure(name, args.steps, args.repeats) for name in MODELS]
    memory = own_memory((20, 300, 2000))
    if args.json:
        print(json.dumps({"torch": torch.__version__, "results": results, "memory": memory}, indent=2))
        return 0
    print(f"torch {torch.__version__}, CPU, 1 thread; median step time of {args.steps} steps, "
          f"median of {args.repeats} interleaved runs")
    for r in results:
        print(f"  {r['model']:<12} {r['params']:>9,} params  plain {r['plain_step_ms']:8.2f} ms  "
              f"doctor {r['doctor_step_ms']:8.2f} ms  ratio {r['ratio']:.2f}x  "
              f"(leaks found: {r['leaks']}, storages seen: {r['storages_seen']})")
    for steps, m in memory["after_steps"].items():
        print(f"  doctor's own Python heap after {steps:>4} clean MLP steps: {m['held_bytes']:>9,} bytes "
              f"({m['boundaries_kept']} boundaries kept, {m['sites']} sites)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
