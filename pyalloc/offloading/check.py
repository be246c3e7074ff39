"""A debug mode: every recomputed tensor compared with the one that was dropped.

Note [Recompute check]
    The promise is that a dropped save comes back bit for bit. Gradients that differ say only that
    something did not; this mode says which. With ``pyalloc.offload(check=True)`` or
    ``$PYALLOC_OFFLOAD_CHECK=1`` (read when a session is made, so it reaches ``pyalloc run
    --offload``), each save the session drops is copied to host memory first, and when it is
    regenerated (a region's re-run, an output call's re-run or refill, a DTR replay) the new tensor
    is compared with the copy: values bit for bit, and layout (shape, strides, storage offset,
    dtype). A report also gives both data pointers' alignment (the largest power of two up to 256
    bytes that divides it: the figure PyTorch gives cuBLASLt's heuristics, and vectorised kernels
    choose by it), but alignment alone is no mismatch: a fresh allocation's is the allocator's
    choice (on the CPU, 64 bytes or any multiple).
    A report on a module's re-run also gives the layouts of the call's inputs as the forward
    received them and as the re-run got them (``input_layouts``, ``rerun_input_layouts``), and
    ``inputs_alike``: every input with the same shape, strides, storage offset, dtype and
    alignment class up to ``VECTOR_ALIGNMENT`` bytes. Why the alignment: CUDA's dropout picks
    its kernel's width by its input's layout and pointer alignment, and another width draws
    another mask from the same generator state (Note [Generator states] in rng.py says how).
    ``session.recompute_mismatches()`` lists the first ``MAX_REPORTS``, each with the step, the
    module (or operator) re-run, the save's index and both geometries;
    ``recompute_checked_total`` and ``recompute_mismatches_total`` count them all.

    A one-dimensional byte tensor is compared by layout alone: autograd saves bytes only as an
    operator's opaque workspace (the CPU LSTM's oneDNN workspace, cuDNN's reserve space), made
    inside the operator and read by its backward, whose unused bytes are whatever the allocator
    left there (a DTR replay of a CPU LSTM layer gave workspaces that differ in 66 thousand to 10
    million of their 16 million bytes, and gradients bit for bit the same). Gradients that match
    say the bytes its backward reads came back.

    Costs: a host copy of every dropped save (on CUDA a synchronising device-to-host copy at each
    drop and each refill), so the memory a plan frees is spent on the host instead. Debugging only;
    the numbers the model computes are unchanged (the copies read, nothing else).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ALIGNMENT", "CHECK_ENV", "VECTOR_ALIGNMENT", "alignment", "alike", "geometry", "MAX_REPORTS", "Original",
           "RecomputeCheck", "enabled_by_environment"]

CHECK_ENV = "PYALLOC_OFFLOAD_CHECK"
MAX_REPORTS = 20
"""Mismatches described in full; the rest are only counted."""

ALIGNMENT = 256
"""The largest alignment class reported, in bytes (the largest PyTorch tells cuBLASLt)."""


VECTOR_ALIGNMENT = 16
"""The widest alignment a CUDA vectorised kernel chooses its width by (bytes): 16-byte loads."""


def enabled_by_environment() -> bool:
    return os.environ.get(CHECK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def alignment(address: int) -> int:
    """The largest power of two up to ``ALIGNMENT`` that divides ``address`` (bytes)."""
    return min(ALIGNMENT, address & -address) if address else ALIGNMENT


def geometry(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "stride": list(t.stride()), "storage_offset": t.storage_offset(),
            "dtype": str(t.dtype), "device": str(t.device), "alignment": alignment(t.data_ptr())}


def alike(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Geometries (``geometry``'s) with the same layout and alignment class up to
    ``VECTOR_ALIGNMENT``: what a kernel that picks its code by layout and alignment sees alike."""
    def key(g: dict[str, Any]) -> dict[str, Any]:
        return {**_layout(g), "alignment": min(g["alignment"], VECTOR_ALIGNMENT)}

    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b))


@dataclass
class Original:
    """A dropped save as it was: a host copy of its values and its geometry."""

    values: torch.Tensor
    geometry: dict[str, Any]


def _layout(g: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in g.items() if k != "alignment"}


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
    return torch.equal(a, b)


def _workspace(t: torch.Tensor) -> bool:
    """An operator's opaque workspace, whose values are not compared (Note [Recompute check])."""
    return t.dtype == torch.uint8 and t.dim() == 1


class RecomputeCheck:
    """The session's record of recomputed tensors compared; see Note [Recompute check]."""

    def __init__(self) -> None:
        self.checked = 0
        self.mismatched = 0
        self.mismatches: list[dict[str, Any]] = []

    @staticmethod
    def original(t: torch.Tensor) -> Original:
        t = t.detach()
        return Original(t.to("cpu", copy=True), geometry(t))

    def compare(self, original: Original | None, got: torch.Tensor, **where: Any) -> bool:
        """Compares ``got`` with ``original``; a mismatch is recorded with ``where`` (what was
        re-run: step, kind, module, index). True when equal in values and layout."""
        if original is None:
            return True
        self.checked += 1
        values = got.detach().to("cpu", copy=True)
        same_values = _workspace(original.values) or _same_values(original.values, values)
        now = geometry(got)
        if same_values and _layout(now) == _layout(original.geometry):
            return True
        self.mismatched += 1
        if len(self.mismatches) < MAX_REPORTS:
            report: dict[str, Any] = {**where, "original": original.geometry, "recomputed": now,
                                      "values_equal": same_values}
            if not same_values and values.shape == original.values.shape and not values.is_complex() \
                    and values.numel() > 0:
                a, b = original.values.double(), values.double()
                differ = (a != b) & ~(a.isnan() & b.isnan())
                report["elements_differing"] = int(differ.sum().item())
                report["max_abs_difference"] = float((a - b).abs().nan_to_num(0.0).max().item())
            self.mismatches.append(report)
        return False
