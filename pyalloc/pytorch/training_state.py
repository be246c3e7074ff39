"""Moving a model's long-lived tensors into an in-place update pool.

Parameters, gradients and optimizer state live for the whole run and are updated in place every
step. Allocated among the step's transient activations, they pin segments that the activations
then fragment around. :func:`relocate_training_state` copies them into a pool of their own
(``pyalloc.pool``), so the default pools hold only what comes and goes.

Call it once the state exists: after the first ``optimizer.step()`` for optimizers that create
their state lazily (Adam, AdamW, SGD with momentum). Then keep gradients in place with
``optimizer.zero_grad(set_to_none=False)``: a gradient set to ``None`` is allocated again by the
next backward, on autograd's device thread, outside the pool.

Identity is kept: each parameter stays the same ``torch.nn.Parameter`` object (its ``.data`` is
replaced), so the optimizer's parameter groups, hooks and any references stay valid. Values are
copied exactly. On a machine where pyalloc is not the allocator (CPU tensors, or PyTorch's own
allocator) the copies are made all the same and the pool has no effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from ..core import pool

__all__ = ["RelocatedState", "relocate_training_state"]


@dataclass(frozen=True)
class RelocatedState:
    """What :func:`relocate_training_state` moved."""

    pool_id: int
    parameters: int
    gradients: int
    optimizer_tensors: int
    bytes: int


def _clone_into_place(t: torch.Tensor) -> torch.Tensor:
    # clone() keeps dtype, device, strides of a dense tensor, and copies exactly.
    return t.detach().clone(memory_format=torch.preserve_format)


def relocate_training_state(model: torch.nn.Module | Iterable[torch.nn.Parameter],
                            optimizer: torch.optim.Optimizer | None = None,
                            pool_name: str = "params", *, gradients: bool = True) -> RelocatedState:
    """Copies parameters, gradients (created as zeros where missing, if ``gradients``) and the
    optimizer's tensor state into the pool ``pool_name``; returns what it moved."""
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
    if optimizer is not None:
        # The optimizer may hold parameters the model does not (or only those).
        seen = {id(p) for p in params}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
    moved_params = moved_grads = moved_state = moved_bytes = 0
    with pool(pool_name) as pool_id, torch.no_grad():
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"relocate_training_state: expected tensors, got {type(p).__name__}")
            p.data = _clone_into_place(p.data)
            moved_params += 1
            moved_bytes += p.numel() * p.element_size()
            if gradients and p.requires_grad:
                p.grad = torch.zeros_like(p) if p.grad is None else _clone_into_place(p.grad)
                moved_grads += 1
                moved_bytes += p.grad.numel() * p.grad.element_size()
        if optimizer is not None:
            for state in optimizer.state.values():
                for key, value in list(state.items()):
                    if isinstance(value, torch.Tensor):
                        state[key] = _clone_into_place(value)
                        moved_state += 1
                        moved_bytes += value.numel() * value.element_size()
    return RelocatedState(pool_id, moved_params, moved_grads, moved_state, moved_bytes)
