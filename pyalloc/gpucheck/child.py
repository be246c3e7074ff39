"""One check of ``pyalloc gpu-check``, in a process of its own.

``python -m pyalloc.gpucheck.child CHECK CONFIG_JSON`` runs CHECK and prints one line,
:data:`RESULT_MARKER` followed by a JSON object: ``{"status": "pass" | "fail", "figures": {...},
"detail": "..."}``. An exception is a failed check with its message; a crash (the reason these
run apart) shows as a child that printed no result.

CONFIG keys: ``allocator`` ("pyalloc", "default" or "expandable"; the parent sets
PYTORCH_CUDA_ALLOC_CONF for "expandable"), ``device`` ("cuda"; "cpu" only for the tests of this
command, where the checks that need CUDA fail at once), and each check's own.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

from .batch_search import largest_batch

RESULT_MARKER = "PYALLOC_GPU_CHECK_RESULT "

Figures = dict[str, Any]


class CheckFailed(Exception):
    """The check ran and found what it looks for missing; the message says what."""


def _torch() -> Any:
    import torch

    return torch


def _setup(cfg: dict[str, Any]) -> str:
    """Installs the allocator the config names; returns what PyTorch allocates with."""
    if cfg.get("allocator") != "pyalloc":
        return "pytorch"
    from pyalloc.pytorch import install as torch_install

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_install.install()
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, torch_install.PyallocWarning)]
    return "pyalloc (plain pluggable: " + fallbacks[0] + ")" if fallbacks else "pyalloc (torch-facing layer)"


def _require_cuda(cfg: dict[str, Any]) -> None:
    if cfg.get("device", "cuda") != "cuda" or not _torch().cuda.is_available():
        raise CheckFailed("needs a CUDA device")


# ---- checks ------------------------------------------------------------------------------


def check_environment(cfg: dict[str, Any]) -> Figures:
    torch = _torch()
    _require_cuda(cfg)
    allocator = _setup(cfg)
    props = torch.cuda.get_device_properties(0)
    from pyalloc.core import version

    return {"device": props.name, "total_memory_bytes": props.total_memory, "torch": torch.__version__,
            "cuda": torch.version.cuda, "pyalloc": version(), "allocator": allocator,
            "device_count": torch.cuda.device_count()}


def check_oom(cfg: dict[str, Any]) -> Figures:
    """A request larger than the device raises torch.OutOfMemoryError with PyTorch's message, and
    a batch-size finder (halve on OOM, as HF accelerate's and Lightning's do) converges."""
    torch = _torch()
    _require_cuda(cfg)
    allocator = _setup(cfg)
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        raise CheckFailed("allocating twice the device's memory did not fail")
    except torch.OutOfMemoryError as e:
        message = str(e)
    if not message.startswith("CUDA out of memory. Tried to allocate"):
        raise CheckFailed(f"the OOM message does not start as PyTorch's: {message[:200]!r}")
    baseline = torch.cuda.memory_allocated()

    model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(4)]).to("cuda", torch.bfloat16)
    batch, tries = 1 << 22, 0
    while batch >= 1:
        tries += 1
        try:
            x = torch.randn(batch, 8192, device="cuda", dtype=torch.bfloat16)
            model(x).float().sum().backward()
            torch.cuda.synchronize()
            break
        except torch.OutOfMemoryError:
            batch //= 2
        finally:
            x = None  # the failed step's tensors go before the retry
            model.zero_grad(set_to_none=True)
    if batch < 1:
        raise CheckFailed("the batch-size finder did not find a batch that fits")
    del model
    return {"allocator": allocator, "message": message[:300], "batch_found": batch, "tries": tries,
            "allocated_after_bytes": torch.cuda.memory_allocated() - baseline}


def check_cudnn_benchmark(cfg: dict[str, Any]) -> Figures:
    """A ResNet-50 training step with cudnn.benchmark on (cuDNN asks the allocator's cacheInfo)."""
    torch = _torch()
    _require_cuda(cfg)
    allocator = _setup(cfg)
    from pyalloc.traces.meta_models import ResNet50

    torch.backends.cudnn.benchmark = True
    model = ResNet50(False).to("cuda", torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images = torch.randn(32, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, 1000, (32,), device="cuda")
    for _ in range(2):
        model(images, labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return {"allocator": allocator}


def check_graphs(cfg: dict[str, Any]) -> Figures:
    """CUDA graph capture and replay, and torch.compile(mode="reduce-overhead") (graph pools)."""
    torch = _torch()
    _require_cuda(cfg)
    allocator = _setup(cfg)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    static = torch.randn(64, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = model(static)
    figures: Figures = {"allocator": allocator}
    worst = 0.0
    for _ in range(3):
        static.copy_(torch.randn(64, 1024, device="cuda"))
        graph.replay()
        with torch.no_grad():
            worst = max(worst, (out - model(static)).abs().max().item())
    figures["graph_max_error"] = worst
    if worst > 1e-3:
        raise CheckFailed(f"a replayed graph's output differs from eager by {worst}")
    # The graph's private pool stays through empty_cache while the graph lives (it replays into
    # its memory) and goes with it; a MemPool's use count and snapshot, as PyTorch reports them.
    torch.cuda.empty_cache()
    figures["reserved_with_graph"] = torch.cuda.memory_reserved()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        pooled = torch.randn(1 << 20, device="cuda")
    figures["mempool_use_count"] = pool.use_count()
    figures["mempool_segments"] = len(pool.snapshot())
    del pooled, pool, graph, out
    torch.cuda.empty_cache()
    figures["reserved_after_graph"] = torch.cuda.memory_reserved()
    if figures["reserved_after_graph"] >= figures["reserved_with_graph"]:
        raise CheckFailed(f"the graph's pool was not released with it: {figures['reserved_with_graph']} bytes "
                          f"reserved with the graph, {figures['reserved_after_graph']} after it and empty_cache")

    compiled = torch.compile(lambda x: model(x).relu().sum(dim=1), mode="reduce-overhead")
    worst = 0.0
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(64, 1024, device="cuda")
            worst = max(worst, (compiled(x) - model(x).relu().sum(dim=1)).abs().max().item())
    figures["compile_max_error"] = worst
    if worst > 1e-2:
        raise CheckFailed(f"torch.compile(reduce-overhead) output differs from eager by {worst}")
    return figures


def _ipc_reader(cfg: dict[str, Any], queue: Any, results: Any) -> None:
    _setup(cfg)  # the reader's allocator: the same as the sender's, or PyTorch's own
    try:
        for _ in range(2):
            tensor = queue.get()
            results.put(float(tensor.sum().item()))
            del tensor
    except Exception as e:  # noqa: BLE001 - reported to the sender, which fails the check with it
        results.put(f"{type(e).__name__}: {e}")


def _pass_to_a_reader(cfg: dict[str, Any], tensors: list[Any]) -> list[Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    reader = ctx.Process(target=_ipc_reader, args=(cfg, queue, results))
    reader.start()
    got = []
    for tensor in tensors:
        queue.put(tensor)
        got.append(results.get(timeout=120))
        if isinstance(got[-1], str):
            break
    reader.join(timeout=60)
    return got


def check_ipc(cfg: dict[str, Any]) -> Figures:
    """CUDA tensors passed to another process (torch.multiprocessing, as DataLoader workers do): a
    1 MiB one and a 64 MiB one, to a reader under the same allocator; under pyalloc also to a reader
    whose allocator is PyTorch's own, recorded as a figure, not a failure (Note [Sharing under
    PyTorch]: a plain segment's handle travels in PyTorch's form and opens there; an arena block's
    cannot)."""
    torch = _torch()
    _require_cuda(cfg)
    allocator = _setup(cfg)
    small = torch.full((1 << 18,), 2.0, device="cuda")
    large = torch.full((16 << 20,), 1.0, device="cuda")
    want = [2.0 * (1 << 18), 1.0 * (16 << 20)]
    got = _pass_to_a_reader(cfg, [small, large])
    if got != want:
        raise CheckFailed(f"the other process read {got}, not {want}")
    figures: Figures = {"allocator": allocator, "sums": got}
    if cfg.get("allocator") == "pyalloc":
        figures["to_pytorch_allocator"] = _pass_to_a_reader({**cfg, "allocator": "pytorch"}, [small, large])
    return figures


def _allocate_in_a_named_function(torch: Any) -> list[Any]:
    return [torch.empty(size, device="cuda") for size in (1 << 18, 1 << 20, 3 << 20)]


def check_snapshot(cfg: dict[str, Any]) -> Figures:
    """_record_memory_history, then _dump_snapshot: a file memory_viz reads, with Python frames."""
    torch = _torch()
    _require_cuda(cfg)
    allocator = _setup(cfg)
    torch.cuda.memory._record_memory_history(max_entries=10000)
    kept = _allocate_in_a_named_function(torch)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        import pickle

        snapshot = pickle.loads(path.read_bytes())
        from torch.cuda import _memory_viz

        html = _memory_viz.trace_plot(snapshot)
    frames = [frame.get("name", "") for seg in snapshot.get("segments", []) for block in seg.get("blocks", [])
              for frame in block.get("frames", [])]
    frames += [frame.get("name", "") for trace in snapshot.get("device_traces", []) for entry in trace
               for frame in entry.get("frames", [])]
    del kept
    found = "_allocate_in_a_named_function" in frames
    if not found:
        raise CheckFailed(f"no frame names the allocating function ({len(frames)} frames in the snapshot)")
    return {"allocator": allocator, "frames": len(frames), "viz_html_bytes": len(html)}


# ---- training loops: the A/B/C ------------------------------------------------------------


def _gpt2(torch: Any, tiny: bool) -> tuple[Any, Callable[[int, int], Any], int]:
    """A GPT-2-size decoder (124M: 12 layers, hidden 768, 12 heads, vocabulary 50257)."""
    nn, F = torch.nn, torch.nn.functional
    hidden, layers, heads, vocab = (64, 2, 4, 512) if tiny else (768, 12, 12, 50257)

    Module: Any = nn.Module  # a base class mypy can take (torch is imported at run time)

    class Block(Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT2(Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(1024, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(hidden)

        def forward(self, ids: Any) -> Any:
            x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x)
            logits = self.ln(x) @ self.embed.weight.t()
            return F.cross_entropy(logits.float().view(-1, vocab), ids.view(-1))

    model = GPT2()
    lengths = (48, 32, 64) if tiny else (768, 256, 1024, 512)  # a cycle: every step of it, in this order

    def batch(size: int, step: int) -> Any:
        return (torch.randint(0, vocab, (size, lengths[step % len(lengths)])),)

    return model, batch, len(lengths)


def _resnet50(torch: Any, tiny: bool) -> tuple[Any, Callable[[int, int], Any], int]:
    from pyalloc.traces.meta_models import ResNet50

    model = ResNet50(False)
    sides = (96, 64) if tiny else (224, 160, 256, 192)  # a cycle, as the GPT-2 model's lengths

    def batch(size: int, step: int) -> Any:
        side = sides[step % len(sides)]
        return torch.randn(size, 3, side, side), torch.randint(0, 1000, (size,))

    return model, batch, len(sides)


MODELS = {"gpt2": _gpt2, "resnet50": _resnet50}


def check_train(cfg: dict[str, Any]) -> Figures:
    """A training loop with variable shapes under one allocator: each model's shapes come in a
    fixed cycle (sequence lengths, image sides), one a step. mode "max-batch": the largest batch
    that trains one whole cycle (doubling, then bisecting, in this process, as a batch-size finder
    does), so that every shape the timed loop meets was tried (the first GPU run searched three
    steps that missed the longest sequence, and the timed loop then ran out of memory at 90% of the
    batch found); mode "time": after one cycle, the median step time at cfg["batch"] over
    cfg["steps"] steps, rounded up to whole cycles. Under pyalloc the figures add its own counters
    (:func:`_pyalloc_figures`): where its time went."""
    torch = _torch()
    device = cfg.get("device", "cuda")
    if device == "cuda":
        _require_cuda(cfg)
    allocator = _setup(cfg)
    tiny = device != "cuda"
    torch.manual_seed(cfg.get("seed", 0))
    with torch.device(device):
        model, make_batch, cycle = MODELS[cfg["model"]](torch, tiny)
    model = model.to(device, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if cfg["model"] == "gpt2" else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    oom = torch.OutOfMemoryError

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def step(size: int, number: int) -> None:
        with torch.device(device):
            inputs = make_batch(size, number)
        inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs)
        model(*inputs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def trains(size: int) -> bool:
        try:
            for number in range(cycle):
                step(size, number)
            sync()
            return True
        except oom:
            opt.zero_grad(set_to_none=True)
            return False

    figures: Figures = {"allocator": allocator, "model": cfg["model"]}
    started = time.monotonic()
    if cfg["mode"] == "max-batch":
        found = largest_batch(trains, cfg.get("start_batch", 1), cfg.get("max_batch", 1 << 16),
                              time.monotonic() + cfg.get("seconds", 120))
        if found.largest == 0:
            raise CheckFailed(f"no batch from {cfg.get('start_batch', 1)} up trained "
                              f"(first failing: {found.first_failing})")
        figures.update(largest_batch=found.largest, first_failing_batch=found.first_failing, stop=found.stop)
    else:
        size = cfg["batch"]
        steps = -(-cfg.get("steps", 10) // cycle) * cycle  # whole cycles
        for number in range(cycle):
            step(size, number)
        sync()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for number in range(cycle, cycle + steps):
            start = time.perf_counter()
            step(size, number)
            sync()
            times.append(time.perf_counter() - start)
        figures.update(batch=size, median_step_seconds=statistics.median(times), steps=steps)
    if device == "cuda":
        figures["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    figures["seconds"] = round(time.monotonic() - started, 2)
    figures.update(_pyalloc_figures(cfg))
    return figures


def _pyalloc_figures(cfg: dict[str, Any]) -> Figures:
    """pyalloc's own counters since the process began, where it is the allocator: how often its
    slow path ran and what it did (retries, stitches, reuses, OOMs), and the time it spent in the
    backend's memory calls and waiting for streams (Note [Backend time]), in seconds."""
    if cfg.get("allocator") != "pyalloc":
        return {}
    from .. import core

    s = core.memory_stats(0)
    keys = ("num_alloc_retries", "num_ooms", "num_stitches", "num_reuses", "num_device_alloc",
            "num_device_free", "backend_memory_calls", "backend_waits")
    figures: Figures = {f"pyalloc.{k}": s[k] for k in keys}
    figures["pyalloc.backend_memory_seconds"] = round(s["backend_memory_ns"] / 1e9, 3)
    figures["pyalloc.backend_wait_seconds"] = round(s["backend_wait_ns"] / 1e9, 3)
    return figures


def check_growth(cfg: dict[str, Any]) -> Figures:
    """What growing costs under one allocator: tensors of mixed sizes (2 MiB to 1 GiB, the same
    seeded sequence under every allocator) allocated until cfg["fraction"] of the device's free
    memory is live, timed (``fill_seconds``: every byte new to the allocator); all freed and the
    same sequence allocated again (``refill_seconds``: served from the cache); all freed and
    ``empty_cache()`` (``release_seconds``). Under pyalloc its counters say how much of it was the
    driver's memory calls (Note [Backend time])."""
    torch = _torch()
    _require_cuda(cfg)
    allocator = _setup(cfg)
    free, _ = torch.cuda.mem_get_info()
    target = int(cfg.get("fraction", 0.6) * free)
    rng = random.Random(cfg.get("seed", 0))
    sizes: list[int] = []
    total = 0
    while total < target:
        sizes.append(min(rng.choice((2, 6, 20, 64, 200, 512, 1024)) << 20, target - total))
        total += sizes[-1]

    def fill() -> tuple[list[Any], float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        held = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
        torch.cuda.synchronize()
        return held, time.perf_counter() - start

    held, fill_seconds = fill()
    del held
    held, refill_seconds = fill()
    del held
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    release_seconds = time.perf_counter() - start
    figures: Figures = {"allocator": allocator, "bytes": total, "tensors": len(sizes),
                        "fill_seconds": round(fill_seconds, 4), "refill_seconds": round(refill_seconds, 4),
                        "release_seconds": round(release_seconds, 4),
                        "reserved_after_bytes": torch.cuda.memory_reserved()}
    figures.update(_pyalloc_figures(cfg))
    return figures


def check_offload(cfg: dict[str, Any]) -> Figures:
    """Activation offload against the plain step, checkpointing and save_on_cpu on one model
    (issue 20): the largest batch of each, time per sample, exactness (:mod:`.offload`)."""
    if cfg.get("device", "cuda") == "cuda":
        _require_cuda(cfg)
    allocator = _setup(cfg)
    from .offload import NothingTrains, compare

    try:
        return {"allocator": allocator, **compare(cfg)}
    except NothingTrains as e:
        raise CheckFailed(str(e)) from None


CHECKS: dict[str, Callable[[dict[str, Any]], Figures]] = {
    "environment": check_environment,
    "oom": check_oom,
    "cudnn-benchmark": check_cudnn_benchmark,
    "graphs": check_graphs,
    "ipc": check_ipc,
    "snapshot": check_snapshot,
    "train": check_train,
    "growth": check_growth,
    "offload": check_offload,
}


def _traceback(e: BaseException) -> str:
    """Where the check failed, short enough for the report: every frame of pyalloc's own as one
    line (file, line, function: the path from the check to the failure, which the tail of a deep
    torch traceback cut off on the H200), then the full traceback's last 3,000 characters."""
    ours = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)
            if f"{os.sep}pyalloc{os.sep}" in f.filename]
    full = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return "pyalloc frames, outermost first: " + " > ".join(ours) + "\n" + full[-3000:]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in CHECKS:
        print(f"usage: python -m pyalloc.gpucheck.child {{{','.join(CHECKS)}}} CONFIG_JSON", file=sys.stderr)
        return 2
    cfg = json.loads(argv[1])
    try:
        result = {"status": "pass", "figures": CHECKS[argv[0]](cfg), "detail": ""}
    except CheckFailed as e:
        result = {"status": "fail", "figures": {}, "detail": str(e)}
    except Exception as e:  # noqa: BLE001  (any failure of the check is its result)
        result = {"status": "fail", "figures": {}, "detail": f"{type(e).__name__}: {e}"[:2000],
                  "traceback": _traceback(e)}
    print(RESULT_MARKER + json.dumps(result, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o)),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
