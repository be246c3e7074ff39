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


_SHARED_SCRIPT = """
import torch
import pyalloc

pyalloc.configure("vmm=shared")
MiB = 1 << 20
big = torch.full((3 * MiB // 4,), 7.0, device="cuda")  # 3 MiB: two granules, 1 MiB of the second free
small = [torch.full((64 * 1024,), float(k), device="cuda") for k in range(4)]  # 256 KiB each
torch.cuda.synchronize()
stats = pyalloc.memory_stats(0)
emit({
    "offsets": [t.data_ptr() - big.data_ptr() for t in small],
    "reserved": stats["reserved_bytes.all.current"],
    "small_segments": stats["segment.small_pool.current"],
    "values_ok": bool((big == 7.0).all()) and all(bool((t == float(k)).all()) for k, t in enumerate(small)),
})
pyalloc.check(0)
"""


def test_vmm_shared_puts_small_tensors_in_a_large_blocks_last_granule_on_a_gpu(
    gpu_python: Callable[..., Any]
) -> None:
    result = gpu_python(_SHARED_SCRIPT, "pyalloc")
    assert result["offsets"] == [3 * (1 << 20) + k * (256 << 10) for k in range(4)]
    assert result["reserved"] == 4 << 20 and result["small_segments"] == 0
    assert result["values_ok"]


_SHARED_GRANULES_SCRIPT = """
import torch
import pyalloc

pyalloc.configure("vmm=shared,share=1")
MiB = 1 << 20
def tensor(mib, value):
    return torch.full((mib * MiB // 4,), float(value), device="cuda")
a, x, c, y, b = tensor(1, 1), tensor(1, 0), tensor(2, 3), tensor(1, 0), tensor(1, 5)
offsets = [t.data_ptr() - a.data_ptr() for t in (x, c, y, b)]
x = y = None  # a free MiB at the end of a's granule and at the start of b's
torch.cuda.synchronize()
stats = pyalloc.memory_stats(0)
reserved = stats["reserved_bytes.all.current"]
total = torch.cuda.get_device_properties(0).total_memory
pyalloc.set_memory_fraction(reserved / total, 0)  # no granule to spare: only the two slivers
n = torch.arange(MiB // 2, device="cuda", dtype=torch.float32)  # 2 MiB
n.mul_(3)
torch.cuda.synchronize()
stats = pyalloc.memory_stats(0)
emit({
    "offsets": offsets,
    "shared": stats["num_shared_granules"],
    "ooms": stats["num_ooms"],
    "reserved_before": reserved,
    "reserved": stats["reserved_bytes.all.current"],
    "n_ok": bool(torch.equal(n.cpu(), torch.arange(MiB // 2, dtype=torch.float32) * 3)),
    # Compared on the CPU: the device has no room left for the comparisons.
    "live_ok": bool((a.cpu() == 1.0).all()) and bool((c.cpu() == 3.0).all()) and bool((b.cpu() == 5.0).all()),
})
pyalloc.check(0)
n = None
pyalloc.set_memory_fraction(1.0, 0)
torch.cuda.empty_cache()
pyalloc.check(0)
"""


def test_shared_granules_serve_a_request_from_two_slivers_on_a_gpu(gpu_python: Callable[..., Any]) -> None:
    """Note [Shared granules]: cuMemMap of a granule a second time, on a real device."""
    result = gpu_python(_SHARED_GRANULES_SCRIPT, "pyalloc")
    assert result["offsets"] == [1 << 20, 2 << 20, 4 << 20, 5 << 20]
    assert result["ooms"] == 0 and result["shared"] == 2
    assert result["reserved"] == result["reserved_before"]
    assert result["n_ok"] and result["live_ok"]


def test_moving_slivers_serves_a_request_by_moving_a_live_end_on_a_gpu(gpu_python: Callable[..., Any]) -> None:
    """Note [Moving slivers]: cuMemcpyDtoDAsync into a partner granule, then cuMemUnmap and cuMemMap of
    the partner's granule under the moved block's address, on a real device."""
    result = gpu_python(_moving_script([("a", 2, 1), ("x", 6, 0), ("c", 8, 3), ("y", 6, 0), ("b", 2, 5)], "b"),
                        "pyalloc")
    assert result["offsets"] == [512 << 10, 2 << 20, 4 << 20, (5 << 20) + (512 << 10)]
    assert result["ooms"] == 0 and result["moved"] == 1 and result["moved_bytes"] == 512 << 10
    assert result["reserved"] == result["reserved_before"]
    assert result["n_ok"] and result["live_ok"]


def test_moving_slivers_serves_a_request_by_nesting_a_live_middle_on_a_gpu(gpu_python: Callable[..., Any]) -> None:
    """Note [Moving slivers], nested pairs: granule 2, live only in its middle, is copied into granule 0's
    free middle (cuMemcpyDtoDAsync) and mapped onto granule 0's memory; granule 2 lends its start and its
    end, granule 0 its middle (I13), on a real device."""
    # granule 0: h0 | free middle | h1; granule 1: c; granule 2: free | u | free
    result = gpu_python(_moving_script([("h0", 1, 1), ("hf", 6, 0), ("h1", 1, 2), ("c", 8, 3), ("uf0", 3, 0), ("u", 1, 5),
                                        ("uf1", 4, 0)], "u"), "pyalloc")
    unit = 256 << 10
    assert result["offsets"] == [unit * k for k in (1, 7, 8, 16, 19, 20)]
    assert result["ooms"] == 0 and result["moved"] == 1 and result["moved_bytes"] == unit
    assert result["reserved"] == result["reserved_before"]
    assert result["n_ok"] and result["live_ok"]


def _moving_script(layout: list[tuple[str, int, int]], moved: str) -> str:
    """A GPU script for ladder step 4b: tensors laid out in order, (name, size in units of 256 KiB,
    value), those of value 0 freed; the device then limited to what is reserved, sharing off, so
    that a 2 MiB request is served only by moving `moved`, on which a kernel then runs (adding 1).
    Emits the offsets from the first tensor, the move counters, and whether every tensor holds
    its value (compared on the CPU: the device has no room left for the comparisons)."""
    names = [name for name, _, _ in layout]
    freed = [name for name, _, value in layout if value == 0]
    live = [(name, value + (name == moved)) for name, _, value in layout if value != 0]
    return f"""
import torch
import pyalloc

pyalloc.configure("vmm=shared,share=0,move=1")
KiB, MiB = 1 << 10, 1 << 20
def tensor(units, value):
    return torch.full((units * 256 * KiB // 4,), float(value), device="cuda")
{", ".join(names)} = {", ".join(f"tensor({units}, {value})" for _, units, value in layout)}
offsets = [t.data_ptr() - {names[0]}.data_ptr() for t in ({", ".join(names[1:])},)]
{" = ".join(freed)} = None
torch.cuda.synchronize()
stats = pyalloc.memory_stats(0)
reserved = stats["reserved_bytes.all.current"]
total = torch.cuda.get_device_properties(0).total_memory
pyalloc.set_memory_fraction(reserved / total, 0)  # no granule to spare, sharing off: only a move helps
n = torch.arange(MiB // 2, device="cuda", dtype=torch.float32)  # 2 MiB
n.mul_(3)
{moved}.add_(1)  # a kernel on the moved block, through its own address
torch.cuda.synchronize()
stats = pyalloc.memory_stats(0)
emit({{
    "offsets": offsets,
    "moved": stats["num_moved_granules"],
    "moved_bytes": stats["moved_bytes"],
    "ooms": stats["num_ooms"],
    "reserved_before": reserved,
    "reserved": stats["reserved_bytes.all.current"],
    "n_ok": bool(torch.equal(n.cpu(), torch.arange(MiB // 2, dtype=torch.float32) * 3)),
    "live_ok": {" and ".join(f"bool(({name}.cpu() == {float(value)}).all())" for name, value in live)},
}})
pyalloc.check(0)
n = {moved} = None
pyalloc.set_memory_fraction(1.0, 0)
torch.cuda.empty_cache()
pyalloc.check(0)
"""
