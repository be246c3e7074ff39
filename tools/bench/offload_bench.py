"""Offload benchmark: saved-activation bytes, swaps, recomputes and step time under a budget.

CPU mode (default without CUDA): a scaled-down GPT-2-like and ResNet-like model; the budget is a
fraction of the baseline peak of saved activations (measured with the session itself at no
budget). GPU mode (``--gpu``, untested here): doubles the batch until the native allocator runs
out of memory, then until the offload session does, and reports the ratio and time per sample.

    python tools/bench/offload_bench.py [--json] [--steps N] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable

import torch
from torch import nn

from pyalloc.offloading.session import offload


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPTSmallish(nn.Module):
    """GPT-2 small's shape (pre-LN blocks, 4x MLP), scaled down: 4 layers, d=128, seq 64."""

    def __init__(self, vocab: int = 1024, d: int = 128, layers: int = 4, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[_Block(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.blocks(self.tok(idx) + self.pos(pos)))


class _Bottleneck(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c // 4, 1, bias=False), nn.BatchNorm2d(c // 4), nn.ReLU(),
                                  nn.Conv2d(c // 4, c // 4, 3, padding=1, bias=False), nn.BatchNorm2d(c // 4),
                                  nn.ReLU(), nn.Conv2d(c // 4, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class ResNetish(nn.Module):
    """ResNet-50's bottleneck blocks, scaled down: 2 stages of 2 blocks, 32x32 inputs."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.stage1 = nn.Sequential(_Bottleneck(64), _Bottleneck(64))
        self.down = nn.Sequential(nn.Conv2d(64, 128, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU())
        self.stage2 = nn.Sequential(_Bottleneck(128), _Bottleneck(128))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stage2(self.down(self.stage1(self.stem(x)))))


def _workloads(batch: int, device: str) -> dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]]:
    return {
        "gpt2-small-like": (lambda: GPTSmallish().to(device),
                            lambda: torch.randint(0, 1024, (batch, 64), device=device)),
        "resnet-like": (lambda: ResNetish().to(device), lambda: torch.randn(batch, 3, 32, 32, device=device)),
    }


def _step(model: nn.Module, x: torch.Tensor) -> None:
    torch.manual_seed(0)
    model(x).float().square().mean().backward()
    model.zero_grad(set_to_none=True)


def _timed(fn: Callable[[], None], steps: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def run_cpu(steps: int, batch: int) -> list[dict[str, float | str]]:
    rows: list[dict[str, float | str]] = []
    for name, (make_model, make_input) in _workloads(batch, "cpu").items():
        torch.manual_seed(0)
        model, x = make_model(), make_input()
        base_t = _timed(lambda: _step(model, x), steps)
        probe = offload(budget=None, pressure_callback=False)
        with probe:
            _step(model, x)
        peak = int(probe.stats()["resident_bytes_peak"])
        rows.append({"model": name, "budget": "none", "budget_bytes": peak, "peak_saved_bytes": peak,
                     "bytes_evicted": 0, "swaps": 0, "recomputes": 0, "step_s": base_t, "time_ratio": 1.0})
        for frac in (0.5, 0.25):
            session = offload(budget=int(peak * frac), pressure_callback=False)

            def step() -> None:
                with session:
                    _step(model, x)

            t = _timed(step, steps)
            st = session.stats()
            n = steps + 1
            rows.append({"model": name, "budget": f"{int(frac * 100)}%", "budget_bytes": int(peak * frac),
                         "peak_saved_bytes": int(st["resident_bytes_peak"]),
                         "bytes_evicted": int((st["swap_out_bytes_total"] + st["dropped_bytes_total"]) / n),
                         "swaps": st["swap_outs_total"] / n, "recomputes": st["recomputed_tensors_total"] / n,
                         "step_s": t, "time_ratio": t / base_t})
    return rows


def run_gpu(steps: int) -> list[dict[str, float | str]]:  # pragma: no cover - needs CUDA
    """Largest batch (doubling) that trains natively vs. with offload at a budget of half the free memory."""
    rows: list[dict[str, float | str]] = []
    for name in ("gpt2-small-like", "resnet-like"):
        results = {}
        for mode in ("native", "offload"):
            batch, best, best_t = 8, 0, 0.0
            while batch <= 1 << 16:
                make_model, make_input = _workloads(batch, "cuda")[name]
                try:
                    model, x = make_model(), make_input()
                    if mode == "native":
                        t = _timed(lambda: _step(model, x), steps)
                    else:
                        free, _ = torch.cuda.mem_get_info()
                        session = offload(budget=free // 2)

                        def step() -> None:
                            with session:
                                _step(model, x)

                        t = _timed(step, steps)
                    best, best_t = batch, t / batch
                    batch *= 2
                except torch.cuda.OutOfMemoryError:
                    break
                finally:
                    torch.cuda.empty_cache()
            results[mode] = (best, best_t)
        rows.append({"model": name, "native_batch": results["native"][0], "offload_batch": results["offload"][0],
                     "batch_ratio": results["offload"][0] / max(1, results["native"][0]),
                     "time_per_sample_ratio": results["offload"][1] / max(1e-12, results["native"][1])})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--gpu", action="store_true", help="largest-batch mode on CUDA")
    args = ap.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        print("offload_bench: --gpu needs CUDA", file=sys.stderr)
        return 1
    rows = run_gpu(args.steps) if args.gpu else run_cpu(args.steps, args.batch)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = list(rows[0])
    print("  ".join(f"{c:>16}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>16.3f}" if isinstance(r[c], float) else f"{r[c]!s:>16}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
