"""Arenas and stitching on a real GPU (vmm=on with backend=cuda; vmm=auto keeps cuda off until this passes)."""

from __future__ import annotations

from typing import Any, Callable

_SCRIPT = """
import torch
import pyalloc

pyalloc.configure("vmm=on")
MiB = 1 << 20
blocks = [torch.full((3 * MiB // 4,), float(i), device="cuda") for i in range(12)]  # 3 MiB each
live = blocks[1::2]
for i in range(0, 12, 2):
    blocks[i] = None  # 3 MiB free slivers between live blocks
torch.cuda.synchronize()
stats = pyalloc.memory_stats(0)
reserved = stats["reserved_bytes.all.current"]
total = torch.cuda.get_device_properties(0).total_memory
# Room for 4 MiB more at most: an 8 MiB tensor needs granules from the slivers.
pyalloc.set_memory_fraction((reserved + 4 * MiB) / total, 0)
big = torch.arange(2 * MiB, device="cuda", dtype=torch.float32)  # 8 MiB
big.mul_(3)
torch.cuda.synchronize()
stats = pyalloc.memory_stats(0)
emit({
    "stitches": stats["num_stitches"],
    "stitched": stats["stitched_bytes"],
    "ooms": stats["num_ooms"],
    "reserved": stats["reserved_bytes.all.current"],
    "limit": reserved + 4 * MiB,
    # Compared on the CPU: the device has no room left for the comparisons.
    "big_ok": bool(torch.equal(big.cpu(), torch.arange(2 * MiB, dtype=torch.float32) * 3)),
    "live_ok": all(bool((t.cpu() == float(2 * k + 1)).all()) for k, t in enumerate(live)),
})
pyalloc.check(0)
"""


def test_stitching_serves_a_request_from_free_slivers_on_a_gpu(gpu_python: Callable[..., Any]) -> None:
    result = gpu_python(_SCRIPT, "pyalloc")
    assert result["ooms"] == 0
    assert result["stitches"] >= 1 and result["stitched"] >= 4 << 20
    assert result["reserved"] <= result["limit"]
    assert result["big_ok"] and result["live_ok"]
