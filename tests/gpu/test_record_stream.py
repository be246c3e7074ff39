"""record_stream: memory used on a second stream is not reused until that stream is done.

A tensor is allocated on stream A and read on stream B after a long kernel
(``torch.cuda._sleep``). Its owner calls ``record_stream(B)`` and drops it
while B is still sleeping. New tensors of the same size allocated on A and
written at once must not overlap it: if one did, A's write would land before
B's read and B would read the wrong values. The same script runs under
PyTorch's native allocator, which shows the test itself is sound.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

_SCRIPT = """
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
cycles = int(SLEEP_MS * cycles_per_ms())

stream_a = torch.cuda.Stream()
stream_b = torch.cuda.Stream()
with torch.cuda.stream(stream_a):
    x = torch.full((N,), 7.0, device="cuda")
x_start = x.data_ptr()
x_end = x_start + x.numel() * x.element_size()

stream_b.wait_stream(stream_a)
with torch.cuda.stream(stream_b):
    torch.cuda._sleep(cycles)
    out = x * 3.0  # reads x only after the sleep
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

torch.cuda.synchronize()
result = {
    "b_busy": b_busy_during_reallocation,
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
    assert r["b_busy"], "stream B finished before the reallocation: the test proved nothing"
    assert r["overlapping"] == 0, "a block still in use on stream B was handed out on stream A"
    assert r["out_intact"], "stream B read memory that stream A had overwritten"
    assert r["z_ok"]
