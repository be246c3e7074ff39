"""Refills: a planned output call's result computed again from what its forward saved for
backward, instead of re-running the call (issue 20). Two kinds: a training-mode batch norm's
output from its saved mean and inverse std (Note [Batch-norm refills] in batchnorm.py), and a
dropout's output from its saved noise (Note [Dropout refills] in dropout.py). Each is checked bit
for bit in the profiled step (:func:`exact_refill_seconds`) before a plan relies on it."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import batchnorm, dropout

__all__ = ["KINDS", "exact_refill_seconds", "kind", "refiller"]

KINDS = ("batchnorm", "dropout")
"""The kinds of refill: each has a counter ``<kind>_refills_total`` in the session's stats."""


def kind(module: nn.Module) -> str | None:
    """The kind of refill ``module``'s output could have, or None: re-run whole."""
    if batchnorm.refillable(module):
        return "batchnorm"
    if dropout.refillable(module):
        return "dropout"
    return None


def exact_refill_seconds(module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> float | None:
    """The refill's time where it gives ``output`` (``module``'s forward output for ``x``) bit for
    bit, else None."""
    k = kind(module)
    if k == "batchnorm":
        return batchnorm.exact_refill_seconds(module, x, output)
    if k == "dropout":
        return dropout.exact_refill_seconds(x, output)
    return None


def refiller(module: nn.Module, output: torch.Tensor) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None:
    """Taken when the call returns ``output``: the refill's kind and the function that gives
    the output again from the call's input, holding what the forward saved; None when that is not
    found (the call is then re-run whole)."""
    k = kind(module)
    if k == "batchnorm":
        stats = batchnorm.saved_statistics(output)
        if stats is None:
            return None
        mean, invstd = stats
        return k, lambda x: batchnorm.refill(module, x, mean, invstd)
    if k == "dropout":
        noise = dropout.saved_noise(output)
        if noise is None:
            return None
        return k, lambda x: dropout.refill(x, noise)
    return None
