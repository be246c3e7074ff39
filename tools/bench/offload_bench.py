"""Offload benchmark: step time and saved-activation bytes of pyalloc.offload beside the baseline and
``torch.utils.checkpoint`` on every block (issue 20).

CPU mode (the default): four models (a GPT-like decoder, a BERT-like encoder, a ResNet-like CNN
and a stacked LSTM), each run as

- ``baseline``: plain training steps;
- ``checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) around every block;
- ``pyalloc@50%`` / ``@25%``: ``pyalloc.offload`` with a budget of that fraction of the
  baseline's saved bytes;
- ``pyalloc@ckpt``: with checkpoint's bytes as the budget;
- ``pyalloc@never``: a budget ten times the baseline's (never reached).

Saved bytes are the activations autograd holds (parameters and leaves excluded), each storage
counted once, at the step's peak. The baseline's and checkpoint's are measured by a counting
saved-tensor hook; checkpoint's add the block inputs it keeps, and are a lower bound of its peak
(its re-run's saves in backward are not visible to an outer hook). pyalloc's are the session's
own count, which includes its re-runs' saves. Step times are medians of interleaved repetitions
(baseline, checkpoint, pyalloc, ..., then the same turned by one column, ...), as ratios to the
baseline's median in the same run; one CPU thread. ``exact`` says whether every gradient equals the baseline's bit for bit.
On CPU there is nothing to gain from swapping to host memory (it is the same memory), so the
sessions here only drop and recompute.

GPU mode (``--gpu``, untested here): doubles the batch until the native allocator runs out of
memory, then until the offload session does, and reports the ratio and time per sample.

    python tools/bench/offload_bench.py [--json] [--reps N] [--models gpt,bert,resnet,lstm] [--gpu]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pyalloc.offloading.plan import is_activation, storage_key, tensor_leaves
from pyalloc.offloading.regions import KeptSave, SavedBytes
from pyalloc.offloading.session import ActivationOffload, OffloadFloorWarning, offload


# ---- models: each has ``blocks`` (what checkpointing wraps) and a ``checkpoint`` flag ----------


class _Probe:
    """The saved-bytes count of the step running now (None outside a measured step)."""

    counter: SavedBytes | None = None
    pins: list[KeptSave] = []


def _run_block(model: nn.Module, block: nn.Module, *args: Any) -> Any:
    if not getattr(model, "checkpoint", False):
        return block(*args)
    counter = _Probe.counter
    if counter is not None:  # checkpoint keeps the block's inputs until its backward
        _Probe.pins += [KeptSave(counter, t) for t in tensor_leaves(args) if is_activation(t)]
    return checkpoint(block, *args, use_reentrant=False)


class _GPTBlock(nn.Module):
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
        self.checkpoint = False
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([_GPTBlock(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = _run_block(self, block, x)
        return self.head(self.ln_f(x))


class BERTish(nn.Module):
    """BERT's encoder (post-LN layers, GELU, 4x FFN), scaled down: 6 layers, d=128, seq 128."""

    def __init__(self, vocab: int = 1024, d: int = 128, layers: int = 6, heads: int = 4) -> None:
        super().__init__()
        self.checkpoint = False
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, activation=nn.GELU(), batch_first=True)
            for _ in range(layers)])
        self.head = nn.Linear(d, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = _run_block(self, block, x)
        return self.head(x[:, 0])


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
        self.checkpoint = False
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.stage1 = nn.ModuleList([_Bottleneck(64), _Bottleneck(64)])
        self.down = nn.Sequential(nn.Conv2d(64, 128, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU())
        self.stage2 = nn.ModuleList([_Bottleneck(128), _Bottleneck(128)])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes))
        self.blocks = nn.ModuleList([*self.stage1, *self.stage2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.stage1:
            x = _run_block(self, block, x)
        x = self.down(x)
        for block in self.stage2:
            x = _run_block(self, block, x)
        return self.head(x)


class _LSTMBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lstm(x)[0])


class LSTMish(nn.Module):
    """A stacked LSTM language model: 4 one-layer LSTMs (hidden 256) with dropout, seq 64."""

    def __init__(self, vocab: int = 1024, d: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.checkpoint = False
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([_LSTMBlock(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = _run_block(self, block, x)
        return self.head(x)


def _workloads(batch: int, device: str) -> dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]]:
    return {
        "gpt": (lambda: GPTSmallish().to(device), lambda: torch.randint(0, 1024, (batch, 64), device=device)),
        "bert": (lambda: BERTish().to(device), lambda: torch.randint(0, 1024, (batch // 2, 128), device=device)),
        "resnet": (lambda: ResNetish().to(device), lambda: torch.randn(batch, 3, 32, 32, device=device)),
        "lstm": (lambda: LSTMish().to(device), lambda: torch.randint(0, 1024, (batch, 64), device=device)),
    }


# ---- measurement ---------------------------------------------------------------------------


def _step(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # the same dropout masks every step
    model(x).float().square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _probed(model: nn.Module, x: torch.Tensor) -> tuple[int, list[int], list[int]]:
    """One step without a session, its saves counted: the peak of saved-activation bytes, and per
    block (in forward order, first call only) the bytes held when it started and the bytes it
    saved (each storage once)."""
    counter = SavedBytes()
    blocks = list(model.blocks)  # type: ignore[arg-type]
    at_start = [-1] * len(blocks)
    saved: list[dict[Any, int]] = [{} for _ in blocks]
    open_blocks: list[int] = []

    def pack(t: torch.Tensor) -> Any:
        if not is_activation(t):
            return t
        for i in open_blocks:
            saved[i][storage_key(t)] = t.untyped_storage().nbytes()
        return KeptSave(counter, t)

    def unpack(h: Any) -> torch.Tensor:
        return h.tensor if isinstance(h, KeptSave) else h

    def pre(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if at_start[i] < 0 and torch.is_grad_enabled():
                at_start[i] = counter.current
                open_blocks.append(i)
        return hook

    def post(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if i in open_blocks:
                open_blocks.remove(i)
        return hook

    handles = [h for i, b in enumerate(blocks)
               for h in (b.register_forward_pre_hook(pre(i)), b.register_forward_hook(post(i)))]
    _Probe.counter, _Probe.pins = counter, []
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            _step(model, x)
    finally:
        _Probe.counter, _Probe.pins = None, []
        for h in handles:
            h.remove()
    return counter.peak, at_start, [sum(d.values()) for d in saved]


def _checkpoint_peak(base_model: nn.Module, ckpt_model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Checkpoint's saved bytes at the end of forward (what an outer hook sees, with the block
    inputs it keeps), and its peak: when a block is re-run in backward, what was held when the
    block started in forward (later saves are freed by then) plus everything the block saves
    (measured in the baseline), the largest over blocks."""
    end_of_forward, at_start, _ = _probed(ckpt_model, x)
    _, _, block_saves = _probed(base_model, x)
    return end_of_forward, max([end_of_forward] + [a + s for a, s in zip(at_start, block_saves)])


class _Config:
    """One column: how to run a step, and what it measured."""

    def __init__(self, name: str, model: nn.Module, x: torch.Tensor, session: ActivationOffload | None) -> None:
        self.name, self.model, self.x, self.session = name, model, x, session
        self.times: list[float] = []
        self.peak = 0

    def step(self) -> dict[str, torch.Tensor]:
        if self.session is None:
            return _step(self.model, self.x)
        with self.session:
            grads = _step(self.model, self.x)
        self.peak = max(self.peak, int(self.session.stats()["step_saved_bytes_peak"]))
        return grads

    def timed(self) -> None:
        # CPU time of this thread (torch runs on one): the machine is shared, and wall time
        # counts the other processes' turns on the cores.
        t0 = time.thread_time()
        self.step()
        self.times.append(time.thread_time() - t0)


def _settle(config: _Config) -> None:
    """Runs a session's profiled step and its plan search: the timed steps are steady-state steps."""
    assert config.session is not None
    for _ in range(12):
        config.step()
        if config.session.stats()["plan_settled"]:
            return


def bench_model(name: str, make_model: Callable[[], nn.Module], make_input: Callable[[], torch.Tensor],
                reps: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    base_model, x = make_model(), make_input()
    expected = {k: v.clone() for k, v in _step(base_model, x).items()}
    base_bytes = _probed(base_model, x)[0]
    ckpt_model = copy.deepcopy(base_model)
    ckpt_model.checkpoint = True  # type: ignore[assignment]
    ckpt_eof, ckpt_bytes = _checkpoint_peak(base_model, ckpt_model, x)
    configs = [_Config("baseline", base_model, x, None), _Config("checkpoint", ckpt_model, x, None)]
    budgets = {"pyalloc@50%": base_bytes // 2, "pyalloc@ckpt": ckpt_bytes, "pyalloc@25%": base_bytes // 4,
               "pyalloc@never": base_bytes * 10}
    floor_warned: dict[str, bool] = {}
    for label, budget in budgets.items():
        choice = {} if _SELECTIVE is None else {"selective": _SELECTIVE}
        session = offload(budget=budget, pressure_callback=False, **choice)
        config = _Config(label, copy.deepcopy(base_model), x, session)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _settle(config)
        floor_warned[label] = any(issubclass(w.category, OffloadFloorWarning) for w in caught)
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
    base_t = statistics.median(configs[0].times)
    rows = []
    for c in configs:
        t = statistics.median(c.times)
        budget = budgets.get(c.name)
        peak = c.peak if c.session is not None else (base_bytes if c.name == "baseline" else ckpt_bytes)
        st = c.session.stats() if c.session is not None else {}
        rows.append({
            "model": name, "config": c.name, "step_ms": round(t * 1e3, 2), "time_ratio": round(t / base_t, 3),
            "saved_MiB": round(peak / 2**20, 2),
            "saved_end_of_forward_MiB": round(ckpt_eof / 2**20, 2) if c.name == "checkpoint" else None, "saved_vs_baseline": round(peak / base_bytes, 3),
            "budget_MiB": round(budget / 2**20, 2) if budget is not None else None,
            "peak_vs_budget": round(peak / budget, 3) if budget else None,
            "floor_MiB": round(st["plan_floor_bytes"] / 2**20, 2) if st else None,
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
    for name, (make_model, make_input) in _workloads(batch, "cpu").items():
        if name in models:
            rows += bench_model(name, make_model, make_input, reps)
    return rows


def run_gpu(steps: int) -> list[dict[str, float | str]]:  # pragma: no cover - needs CUDA
    """Largest batch (doubling) that trains natively vs. with offload at a budget of half the free memory."""
    rows: list[dict[str, float | str]] = []
    for name in ("gpt", "resnet"):
        results = {}
        for mode in ("native", "offload"):
            batch, best, best_t = 8, 0, 0.0
            while batch <= 1 << 16:
                make_model, make_input = _workloads(batch, "cuda")[name]
                try:
                    model, x = make_model(), make_input()
                    session = offload(budget=torch.cuda.mem_get_info()[0] // 2) if mode == "offload" else None
                    t0 = time.perf_counter()
                    for _ in range(steps + 1):
                        if session is None:
                            _step(model, x)
                        else:
                            with session:
                                _step(model, x)
                    torch.cuda.synchronize()
                    best, best_t = batch, (time.perf_counter() - t0) / (steps + 1) / batch
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


_SELECTIVE: bool | None = None  # --selective: None leaves pyalloc.offload's default


def main(argv: list[str] | None = None) -> int:
    global _SELECTIVE
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--reps", type=int, default=7, help="timed steps per column (interleaved)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--models", default="gpt,bert,resnet,lstm", help="comma-separated: gpt,bert,resnet,lstm")
    ap.add_argument("--gpu", action="store_true", help="largest-batch mode on CUDA")
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
    if args.gpu and not torch.cuda.is_available():
        print("offload_bench: --gpu needs CUDA", file=sys.stderr)
        return 1
    rows: list[dict[str, Any]] = run_gpu(args.reps) if args.gpu else run_cpu(args.reps, args.batch, models)  # type: ignore[assignment]
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
