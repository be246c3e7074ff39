"""Who holds memory: live storages by owner, at the peak or at a failing request.

Owners, first match wins: parameters (of the top-level modules the program ran and of its
optimizers), gradients (their ``.grad``), optimizer state (tensors in ``optimizer.state``),
activations (storages autograd holds for backward, by the top-level module that saved them),
other (every other live storage the tracker saw). A parameter saved for backward (a Linear's
weight) stays a parameter. Parameters, gradients and optimizer state are counted even when the
tracker did not see them made (a model built before ``pyalloc.doctor()`` was entered).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from .tracker import StorageTracker, storage_key

OWNERS = ("parameters", "gradients", "optimizer_state", "activations", "other")


@dataclass
class Breakdown:
    """Bytes by owner at one moment."""

    total: int = 0
    owners: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OWNERS, 0))
    activations_by_module: dict[str, int] = field(default_factory=dict)
    activations_by_block: dict[str, int] = field(default_factory=dict)  # "Top.child"
    activations_fp32: int = 0
    devices: dict[str, dict[str, int]] = field(default_factory=dict)
    phase: str = ""
    iteration: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.owners)
        out["total"] = self.total
        out["activations_by_module"] = dict(sorted(self.activations_by_module.items(), key=lambda kv: -kv[1]))
        out["activations_by_block"] = dict(sorted(self.activations_by_block.items(), key=lambda kv: -kv[1]))
        out["activations_float32"] = self.activations_fp32
        out["devices"] = {d: dict(v) for d, v in sorted(self.devices.items())}
        out["phase"] = self.phase
        out["iteration"] = self.iteration
        return out


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            yield from _tensors(v.values())
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def breakdown(tracker: StorageTracker, optimizers: Iterable[torch.optim.Optimizer], phase: str) -> Breakdown:
    known: dict[int, tuple[str, int, str]] = {}  # storage key -> (owner, bytes, device)

    def claim(t: torch.Tensor, owner: str) -> None:
        key = storage_key(t)
        if key is None or key in known:
            return
        record = tracker.live.get(key)
        if record is not None:
            known[key] = (owner, record.size, record.device)
        else:
            known[key] = (owner, int(t.untyped_storage().nbytes()), str(t.device))

    params: dict[int, torch.Tensor] = {}
    for module in tracker.modules():
        for p in module.parameters():
            params[id(p)] = p
    optimizers = list(optimizers)
    for opt in optimizers:
        for group in opt.param_groups:
            for q in group["params"]:
                params[id(q)] = q
    for t in params.values():
        claim(t, "parameters")
    for t in params.values():
        if t.grad is not None:
            claim(t.grad, "gradients")
    for opt in optimizers:
        for t in _tensors(opt.state.values()):
            claim(t, "optimizer_state")

    out = Breakdown(phase=phase, iteration=tracker.iteration)
    for key, (owner, size, device) in known.items():
        _add(out, owner, size, device)
    saved = tracker.saved_owner
    for key, record in list(tracker.live.items()):
        if key in known:
            continue
        saver = saved.get(key)
        if saver is None:
            _add(out, "other", record.size, record.device)
            continue
        _add(out, "activations", record.size, record.device)
        out.activations_by_module[saver.top] = out.activations_by_module.get(saver.top, 0) + record.size
        block = f"{saver.top}.{saver.child}" if saver.child else saver.top
        out.activations_by_block[block] = out.activations_by_block.get(block, 0) + record.size
        if record.fp32:
            out.activations_fp32 += record.size
    return out


def _add(out: Breakdown, owner: str, size: int, device: str) -> None:
    out.owners[owner] += size
    out.total += size
    per = out.devices.setdefault(device, dict.fromkeys(OWNERS, 0))
    per[owner] += size
