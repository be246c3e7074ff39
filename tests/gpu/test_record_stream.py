"""record_stream: memory used on a second stream is not reused until that stream is done.

A tensor is allocated on stream A and read on stream B after a long kernel
(``torch.cuda._sleep``). Its owner calls ``record_stream(B)`` and drops it
while B is still sleeping. New tensors of the same size allocated on A and
written at once must not overlap it: if one did, A's write would land before
B's read and B would read the wrong values. The same script runs under
PyTorch's native allocator, which shows the test itself is sound.

Every kernel launched between the sleep and the check that B is still busy
has run once before the sleep. With lazy loading (CUDA's default on Linux
since 12.2) a kernel is loaded at its first launch, and the CUDA programming
guide warns that loading a kernel may synchronize the context (Lazy Loading,
concurrent execution): a first ``x * 3.0`` launched behind the sleep would
hold the host until B's sleep ended, and B would be done before the new
tensors were even allocated: the likeliest reason why the first H200 run
failed under both allocators, PyTorch's included (its details were lost). The
child reports how long the host took, so a failure says whether something
waited.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

_SCRIPT = """
import time

import torch


def cycles_per_ms():
    torch.cuda._sleep(1000)  # warm up the kernel
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


SLEEP_MS = 500  # far longer than the Python below needs to run
N = 1 << 20  # float32 elements: 4 MiB

rate = cycles_per_ms()
cycles = int(SLEEP_MS * rate)

# The kernels launched behind the sleep (mul by a scalar, fill), loaded now: a first launch may
# wait for the whole context (module docstring).
warm = torch.full((N,), 7.0, device="cuda")
(warm * 3.0).fill_(-1.0)
del warm
torch.cuda.synchronize()

stream_a = torch.cuda.Stream()
stream_b = torch.cuda.Stream()
with torch.cuda.stream(stream_a):
    x = torch.full((N,), 7.0, device="cuda")
x_start = x.data_ptr()
x_end = x_start + x.numel() * x.element_size()

stream_b.wait_stream(stream_a)
with torch.cuda.stream(stream_b):
    torch.cuda._sleep(cycles)
    launched = time.perf_counter()
    out = x * 3.0  # reads x only after the sleep
    mul_launch_ms = (time.perf_counter() - launched) * 1000
x.record_stream(stream_b)
del x  # freed while stream B still needs it

overlapping = 0
kept = []
with torch.cuda.stream(stream_a):
    for _ in range(8):
        y = torch.empty(N, device="cuda")
        y.fill_(-1.0)  # would clobber x before B reads it, if y overlapped x
        start = y.data_ptr()
        end = start + y.numel() * y.element_size()
        overlapping += int(start < x_end and x_start < end)
        kept.append(y)
b_busy_during_reallocation = not stream_b.query()
query_ms = (time.perf_counter() - launched) * 1000

torch.cuda.synchronize()
result = {
    "b_busy": b_busy_during_reallocation,
    "sleep_ms": SLEEP_MS,
    "cycles_per_ms": rate,
    "mul_launch_ms": mul_launch_ms,
    "query_ms": query_ms,
    "overlapping": overlapping,
    "out_intact": bool((out == 21.0).all().item()),
}

# Once B is done, the memory is free again and the allocator stays consistent.
del kept, out
with torch.cuda.stream(stream_a):
    z = torch.empty(N, device="cuda")
    z.fill_(2.0)
torch.cuda.synchronize()
result["z_ok"] = bool((z == 2.0).all().item())
import pyalloc.pytorch.install
if pyalloc.pytorch.install.is_installed():
    pyalloc.check(0)
emit(result)
"""


@pytest.mark.parametrize("allocator", ["native", "pyalloc"])
def test_block_used_on_other_stream_is_not_reused_before_that_stream_finishes(
    gpu_python: Callable[..., Any], allocator: str
) -> None:
    r = gpu_python(_SCRIPT, allocator=allocator)
    assert r["b_busy"], (
        f"stream B finished before the reallocation, so the test proved nothing: its sleep was "
        f"{r['sleep_ms']} ms at {r['cycles_per_ms']:.0f} cycles/ms; the host launched x * 3.0 behind it in "
        f"{r['mul_launch_ms']:.1f} ms and queried B {r['query_ms']:.1f} ms after the sleep's launch "
        f"(near or past the sleep: something waited for B)")
    assert r["overlapping"] == 0, "a block still in use on stream B was handed out on stream A"
    assert r["out_intact"], "stream B read memory that stream A had overwritten"
    assert r["z_ok"]
