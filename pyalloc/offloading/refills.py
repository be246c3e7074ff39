"""Refills: a planned output call's result computed again from what its forward saved for
backward, instead of re-running the call (issue 20). Three kinds: a training-mode batch norm's
output from its saved mean and inverse std (Note [Batch-norm refills] in batchnorm.py), a
dropout's output from its saved noise (Note [Dropout refills] in dropout.py), and an elementwise
activation's from its functional form, in place over an input regenerated for it alone (Note
[Activation refills] in activations.py). Each is checked bit for bit in the profiled step
(:func:`exact_refill_seconds`) before a plan relies on it."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import activations, batchnorm, clock, dropout
from .hooks import foreign_hooks, saves_are_ours

__all__ = ["KINDS", "MIN_ELEMENTS", "exact_refill_seconds", "kind", "refiller"]

MIN_ELEMENTS = 4096
"""Calls on fewer elements are re-run whole: a few elements could agree by chance, and a small
output is not worth dropping."""

KINDS = ("batchnorm", "dropout", "activation")
"""The kinds of refill: each has a counter ``<kind>_refills_total`` in the session's stats."""


def kind(module: nn.Module) -> str | None:
    """The kind of refill ``module``'s output could have, or None: re-run whole (so is a module
    with a hook of the program's: Note [Session hooks] in hooks.py)."""
    if foreign_hooks(module):
        return None
    if batchnorm.refillable(module):
        return "batchnorm"
    if dropout.refillable(module):
        return "dropout"
    if activations.refillable(module):
        return "activation"
    return None


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, with the same dtype, shape and strides."""
    return got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride() \
        and torch.equal(got, want)


def exact_refill_seconds(module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> float | None:
    """The time the refill takes to give ``output`` (``module``'s forward output for ``x``) again,
    on the step's clock (Note [Device time] in clock.py), or None when it does not give it bit for
    bit, with the same geometry, on this device and layout (a batch norm's also with other parameters: Note [Batch-norm refills]). Timed on a
    second run: the first one's output often lands in memory never touched before (seen: 3 ms
    instead of 0.45 ms for 4 MiB, in the profiled step), and a refill costed that high would never
    be planned, so never measured. An activation's in-place form is checked too, on a copy."""
    found = refiller(module, output)
    if found is None or x.numel() < MIN_ELEMENTS:
        return None
    k, refill = found
    x = x.detach()
    try:
        refill(x, False)
    except RuntimeError:  # not the input's (a dropout's noise that does not broadcast to it)
        return None
    t0 = clock.now()
    got = refill(x, False)
    seconds = clock.now() - t0
    if got is None or not _same(got, output):
        return None
    if k == "batchnorm":
        pair = batchnorm.with_other_parameters(module, x)
        if pair is None or not _same(*pair):
            return None
    if k == "activation":
        try:
            again = refill(x.clone(), True)
            if again is None or not _same(again, output):
                return None
        except RuntimeError:
            return None
    return seconds


Refill = Callable[[torch.Tensor, bool], "torch.Tensor | None"]
"""``(x, owned)`` -> the call's output for input ``x``, or None when what it needs is gone (the call
is then re-run whole); ``owned``: no one else holds ``x``, which an activation's refill then
writes over (the others ignore it)."""


def refiller(module: nn.Module, output: torch.Tensor) -> tuple[str, Refill] | None:
    """Taken when the call returns ``output``: the refill's kind and the function that gives
    the output again from the call's input, holding what the forward saved (a dropout's: its
    node, whose noise it reads when it refills, so that a noise the step keeps packed is not held
    whole meanwhile: Note [Packed noise] in dropout.py); None when that is not
    found (the call is then re-run whole), or when what it saved is not the session's to read
    (Note [Session hooks] in hooks.py)."""
    k = kind(module)
    if k in ("batchnorm", "dropout") and not saves_are_ours():
        return None
    if k == "batchnorm":
        stats = batchnorm.saved_statistics(output)
        if stats is None:
            return None
        mean, invstd = stats
        return k, lambda x, owned: batchnorm.refill(module, x, mean, invstd)
    if k == "dropout":
        if dropout.saved_noise(output) is None:  # (a look: a packed noise shows its mask)
            return None
        node = output.grad_fn
        return k, lambda x, owned: dropout.refill_from(node, x)
    if k == "activation":
        return k, lambda x, owned: activations.refill(module, x, owned)
    return None
