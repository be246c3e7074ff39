"""Activation refills: an elementwise activation module's output again, by its functional form
alone, without re-running the module (issue 20).

Note [Activation refills]
    A plan drops a ReLU's output (the ReLU saves it, and so does the convolution after it) and
    regenerates it in backward from the ReLU's input, itself regenerated from a batch norm's
    saved statistics (Note [Batch-norm refills] in batchnorm.py). Re-running the ReLU module
    replays the RNG state, saves and restores its buffers, opens the saved-tensor hooks and grad
    mode, and builds an autograd node nobody reads: ~0.1 ms of Python a call on the development
    machine, as much as the 1 MiB pass itself, and the pass writes a new tensor while the batch
    norm's fresh output, used by nobody else, is thrown away.

    A stock ``nn.ReLU``, ``nn.GELU``, ``nn.SiLU``, ``nn.Tanh`` or ``nn.Sigmoid`` (the class's own
    forward, not in place) computes one functional of its input and its
    constructor's arguments, and draws no random number. Its output is refilled by that
    functional with grad off: the same operator on the same operand. When the input is a tensor
    regenerated for this use alone (a refill's fresh output, not cached for other uses), the
    in-place form writes over it (``relu_``, ``silu(..., inplace=True)``, ``tanh_``,
    ``sigmoid_``; GELU has none in the public API; a floating-point input only) and no new tensor
    is made.

    Both forms are checked bit for bit in the profiled step, on the device and layout the call
    ran on, against the forward's output (``refills.exact_refill_seconds``: the in-place one on a
    copy of the input), as the other refills are; a call that fails either is re-run whole.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["refill", "refillable"]

Form = Callable[[nn.Module, torch.Tensor], torch.Tensor]
"""``(module, x)`` -> the module's output for ``x``."""

_FORMS: dict[type, tuple[Form, Form | None]] = {
    nn.ReLU: (lambda m, x: torch.relu(x), lambda m, x: torch.relu_(x)),
    nn.GELU: (lambda m, x: F.gelu(x, approximate=str(m.approximate)), None),
    nn.SiLU: (lambda m, x: F.silu(x), lambda m, x: F.silu(x, inplace=True)),
    nn.Tanh: (lambda m, x: torch.tanh(x), lambda m, x: torch.tanh_(x)),
    nn.Sigmoid: (lambda m, x: torch.sigmoid(x), lambda m, x: torch.sigmoid_(x)),
}
"""Each stock activation's forward as a functional of its input, and that functional in place
(written over ``x``) where the public API has one: the operator the forward runs either way."""

IN_PLACE = frozenset(cls for cls, (_, in_place) in _FORMS.items() if in_place is not None)
"""The activations whose refill may write over an input regenerated for it alone."""


def refillable(module: nn.Module) -> bool:
    """A stock activation of ``_FORMS`` (its class's forward), not in place (a module with hooks
    of the program's is never refilled: Note [Session hooks] in hooks.py)."""
    return type(module) in _FORMS and "forward" not in vars(module) and not getattr(module, "inplace", False)


def refill(module: nn.Module, x: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``module``'s output for ``x`` (Note [Activation refills]); ``in_place``: written over ``x``,
    which the caller owns alone, where the output has ``x``'s dtype (an integer input's sigmoid
    is a float tensor). Exact only where ``refills.exact_refill_seconds`` said so."""
    out_of_place, over = _FORMS[type(module)]
    form = over if in_place and over is not None and x.is_floating_point() else out_of_place
    with torch.no_grad():
        return form(module, x)
