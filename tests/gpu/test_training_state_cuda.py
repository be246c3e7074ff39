"""relocate_training_state on a GPU: parameters, gradients and optimizer state land in the pool."""

from __future__ import annotations

from typing import Any, Callable

_SCRIPT = """
import torch
import pyalloc

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)).cuda()
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(64, 1024, device="cuda")


def step():
    opt.zero_grad(set_to_none=False)
    model(x).square().mean().backward()
    opt.step()


step()
moved = pyalloc.relocate_training_state(model, opt, "params")
torch.cuda.synchronize()
for _ in range(3):
    step()
torch.cuda.synchronize()
stats = pyalloc.memory_stats(0)
emit({"bytes": moved.bytes, "pool_allocated": stats["pool.params.allocated_bytes"],
      "segments": [s["pool"] for s in pyalloc.snapshot()["segments"]]})
"""


def test_training_state_lands_in_its_pool(gpu_python: Callable[..., Any]) -> None:
    result = gpu_python(_SCRIPT, "pyalloc")
    # Parameters, gradients, exp_avg and exp_avg_sq of AdamW: four copies of the weights
    # (the step counters are CPU tensors), each rounded up to 512 B at most.
    assert result["pool_allocated"] >= result["bytes"] - 8 * 4 * 8
    assert "params" in result["segments"]
