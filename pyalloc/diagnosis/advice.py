"""Advice ranked by the bytes each change would save, computed from a measured breakdown.

Each figure is an estimate from the owners measured at the peak (or at the failing request),
and says what it assumes:
  - bf16 autocast: float32 saved activations take half (the others are unchanged);
  - gradient accumulation over 4 micro-batches: activations scale with the batch, so a quarter
    batch keeps a quarter of them;
  - activation checkpointing per block (``torch.utils.checkpoint``), or ``pyalloc.offload`` with
    the largest block's activations as budget: only one block's activations are held at once
    (block inputs, which checkpointing keeps, are not subtracted);
  - ``zero_grad(set_to_none=True)``: gradients alive during the forward that made the peak are
    freed before it (only when the peak was in a forward and gradients were alive);
  - half the batch: half the activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .owners import Breakdown

ACCUMULATION_STEPS = 4


@dataclass
class Advice:
    change: str
    saves_bytes: int
    basis: str

    def to_json(self) -> dict[str, Any]:
        return {"change": self.change, "saves_bytes": self.saves_bytes, "basis": self.basis}


def advise(b: Breakdown) -> list[Advice]:
    acts = b.owners["activations"]
    out: list[Advice] = []
    if b.activations_fp32:
        out.append(Advice("bf16 autocast on the forward (torch.autocast(device_type, dtype=torch.bfloat16))",
                          b.activations_fp32 // 2,
                          f"{b.activations_fp32} bytes of the saved activations are float32; bf16 halves them"))
    if acts:
        k = ACCUMULATION_STEPS
        out.append(Advice(f"gradient accumulation: {k} micro-batches of 1/{k} of the batch per optimizer step",
                          acts - acts // k, f"activations ({acts} bytes) scale with the micro-batch"))
        blocks = {name: n for name, n in b.activations_by_block.items() if n > 0}
        if len(blocks) >= 2:
            largest_name, largest = max(blocks.items(), key=lambda kv: kv[1])
            out.append(Advice(
                f"activation checkpointing per block (torch.utils.checkpoint), or pyalloc.offload(budget={largest})",
                acts - largest,
                f"one block's activations held at a time; the largest is {largest_name} ({largest} bytes)"))
        else:
            budget = acts // 4
            out.append(Advice(f"pyalloc.offload(budget={budget}) (saved activations beyond the budget swapped to "
                              f"host memory or recomputed)", acts - budget,
                              "activations beyond a quarter of today's are offloaded"))
        out.append(Advice("half the batch size", acts // 2, "activations scale with the batch"))
    grads = b.owners["gradients"]
    if grads and b.phase == "forward":
        out.append(Advice("optimizer.zero_grad(set_to_none=True) before the forward", grads,
                          "gradients were alive during the forward that made the peak"))
    out = [a for a in out if a.saves_bytes > 0]
    out.sort(key=lambda a: -a.saves_bytes)
    return out
