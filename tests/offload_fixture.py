"""Helpers shared by the offload tests: one training step, steps under a session, the saved-activation
peak, a profiled step, and a bit-for-bit comparison of gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pyalloc.offloading.plan import MadeInStep, Profile, is_activation
from pyalloc.offloading.regions import KeptSave, SavedBytes


def step(model: nn.Module, x: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """One step (the loss: the output's mean square); the gradients, cleared from the model."""
    torch.manual_seed(seed)  # each step its own dropout masks, the same in both runs
    model(x).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def session_steps(session: Any, model: nn.Module, x: torch.Tensor, steps: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` steps of ``model`` on ``x`` under ``session`` (seeds 0, 1, ...): each step's
    gradients, to compare bit for bit with those of :func:`step` without offload."""
    got = []
    for seed in range(steps):
        with session:
            got.append(step(model, x, seed))
    return got


def saved_bytes_peak(model: nn.Module, x: torch.Tensor) -> int:
    """The baseline's peak of saved-activation bytes, counted as the session counts them."""
    counter = SavedBytes()
    made = MadeInStep()  # a leaf the step made counts (Note [Step-made leaves] in plan.py)
    with made, torch.autograd.graph.saved_tensors_hooks(
            lambda t: KeptSave(counter, t) if is_activation(t, made.made) else t,
            lambda h: h.tensor if isinstance(h, KeptSave) else h):
        step(model, x, seed=0)
    return counter.peak


def profiled(model: nn.Module, x: torch.Tensor) -> Profile:
    """The profile of one step of ``model`` on ``x`` (seed 0)."""
    profile = Profile()
    profile.start()
    with profile.saving():
        step(model, x, 0)
    profile.stop()
    return profile


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs (max abs diff {(a[k].float() - b[k].float()).abs().max()})"
