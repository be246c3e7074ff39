"""`pyalloc record --meta` (pyalloc/traces/meta.py, Note [Meta recordings]).

The storage tracker is checked against PyTorch's own profiler: the same
training steps recorded on the CPU (every call to the CPU allocator) and on
the meta device (every storage an operator creates) give the same
allocations of 1 KiB and more, size for size, and the same peak of live
bytes. The CPU recording has a few scalars more (4 and 8 B): loss and
learning-rate values a CPU kernel keeps where a meta run has none.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest
import torch

from pyalloc.traces.generators import TraceBuilder
from pyalloc.traces.meta import CudaExtras, StorageRecorder, record_meta
from pyalloc.traces.record import record_cpu
from pyalloc.traces.trace import ALLOC, FREE, MARK, Trace, load_any

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def mlp_setup() -> Callable[[], object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(64, 256)

    def step() -> object:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def sizes_of(trace: Trace, at_least: int) -> Counter[int]:
    return Counter(s for op, s in zip(trace.ops, trace.sizes) if op == ALLOC and s >= at_least)


def test_the_meta_tracker_sees_what_the_cpu_profiler_sees() -> None:
    cpu = record_cpu(mlp_setup, 3, progress=False)
    builder = TraceBuilder("meta")
    recorder = StorageRecorder(builder, CudaExtras(cublas_workspace=0, cudnn_workspace_cap=0,
                                                   flash_backward_scratch=False))
    with recorder, torch.device("meta"):
        step = mlp_setup()
        for _ in range(3):
            step()
            builder.mark()
    recorder.close()
    meta = builder.build("meta")
    assert sizes_of(meta, 1024) == sizes_of(cpu, 1024)
    assert sum(sizes_of(meta, 1024).values()) == 51  # parameters, activations, gradients, momenta
    assert meta.peak_live_bytes() == cpu.peak_live_bytes()


def live_after_each_mark(trace: Trace) -> list[int]:
    live: dict[int, int] = {}
    out = []
    for op, ident, size in zip(trace.ops, trace.ids, trace.sizes):
        if op == ALLOC:
            live[ident] = size
        elif op == FREE:
            live.pop(ident)
        elif op == MARK:
            out.append(sum(live.values()))
    return out


def test_a_tiny_decoder_keeps_params_and_optimizer_state_from_the_first_step_on() -> None:
    rec = record_meta("llama-tiny", steps=3, batch=2, seq=64)
    trace = rec.trace
    assert [name for _, name in trace.marks] == ["iteration"] * 3
    after = live_after_each_mark(trace)
    assert after[0] == after[1] == after[2]  # nothing grows after the first step
    # What stays live to the end was all allocated by the end of step 1: each
    # bf16 parameter and AdamW's two moments of its size, and the cuBLAS
    # workspace (32 MiB, once).
    first_mark = trace.marks[0][0]
    live: dict[int, tuple[int, int]] = {}
    for i, (op, ident, size) in enumerate(zip(trace.ops, trace.ids, trace.sizes)):
        if op == ALLOC:
            live[ident] = (i, size)
        elif op == FREE:
            live.pop(ident)
    assert all(index < first_mark for index, _ in live.values())
    kept = Counter(size for _, size in live.values())
    params = Counter(p.numel() * 2 for p in _tiny_params())
    for size, n in params.items():
        assert kept[size] >= 3 * n, (size, kept[size], n)
    assert kept[32 * MiB] == 1
    # AdamW's step counters live on the CPU: no device allocation (one per parameter was, 4 bytes)
    assert sum(params.values()) * 3 + 1 == sum(kept.values()), kept
    assert "cuBLAS workspace" in rec.source and "meta device" in rec.source


def _tiny_params() -> list[torch.nn.Parameter]:
    from pyalloc.traces.meta_models import DECODERS, Decoder

    with torch.device("meta"):
        return list(Decoder(DECODERS["llama-tiny"], False).parameters())


def test_activation_checkpointing_lowers_the_peak() -> None:
    plain = record_meta("llama-tiny", steps=1, batch=8, seq=512, extras=CudaExtras(0, 0, False))
    ckpt = record_meta("llama-tiny", steps=1, batch=8, seq=512, use_checkpoint=True, extras=CudaExtras(0, 0, False))
    assert ckpt.trace.peak_live_bytes() < plain.trace.peak_live_bytes()


def run_record(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyalloc.cli", "record", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_the_cli_writes_a_trace_that_validates(tmp_path: Path) -> None:
    out = tmp_path / "tiny.jsonl.gz"
    done = run_record("--meta", "llama-tiny", "--steps", "2", "--seq", "32", "-o", str(out), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["marks"] == 2 and report["allocs"] > 0 and report["peak_live_bytes"] > 0
    trace = load_any(out)
    assert trace.header["device_capacity"] == 80 << 30
    assert trace.peak_live_bytes() == report["peak_live_bytes"]


@pytest.mark.parametrize("args, message", [
    (["--meta", "gpt5"], "unknown model 'gpt5'"),
    (["--meta", "llama-tiny", "--device", "cuda"], "--device goes with MODEL, not --meta"),
    (["--meta"], "name a MODEL"),
    (["--meta", "llama-tiny", "--batch", "0"], "at least 1"),
    (["mlp", "--batch", "4"], "--batch goes with --meta, not MODEL"),
    # options the way of recording does not read are refused, not ignored (a review's finding)
    (["--from-snapshot", "x.pickle", "--steps", "3"], "--steps goes with --meta and MODEL, not --from-snapshot"),
    (["--from-snapshot", "x.pickle", "--seed", "0"], "--seed goes with --meta and MODEL, not --from-snapshot"),
    (["--from-snapshot", "x.pickle", "--device", "cuda"], "--device goes with MODEL, not --from-snapshot"),
    (["mlp", "--snapshot-device", "1"], "--snapshot-device goes with --from-snapshot, not MODEL"),
    (["mlp", "--allocator", "pyalloc"], "--allocator goes with --device cuda"),
    (["--meta", "llama-tiny", "--max-entries", "10"], "--max-entries goes with MODEL, not --meta"),
])
def test_bad_input_gets_one_clear_line(args: list[str], message: str, tmp_path: Path) -> None:
    done = run_record(*args, "-o", str(tmp_path / "never.jsonl.gz"))
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert not (tmp_path / "never.jsonl.gz").exists()
