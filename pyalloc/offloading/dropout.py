"""Dropout refills: a training-mode dropout's output again, from the noise its forward saved,
without drawing it again (issue 20).

Note [Dropout refills]
    On CPU a dropout computes ``input * noise``, ``noise`` holding 0 and ``1 / (1 - p)`` drawn
    from the generator (ATen's ``_dropout_impl``), and the product's autograd node
    (``MulBackward0``) saves ``noise`` for backward: a tensor without history, so not counted
    against the budget (it is held for backward anyway). Re-running the dropout to regenerate its
    output, which the next linear layer saves (a BERT feed-forward's ``linear2(dropout(gelu(...)))``),
    draws the noise again: one Bernoulli draw per element, ~3.5 ms for 2 MiB on the development
    machine, against ~0.3 ms for the product alone. So a dropout's output is refilled as
    ``input * noise`` with the saved noise: the forward's operator on the forward's operands.

    That is checked, not assumed, in the profiled step, on the device and layout the call ran
    on: the refill gives the forward's output bit for bit, with its strides
    (``refills.exact_refill_seconds``). A GPU's dropout is one fused operator whose node saves a
    boolean mask (``NativeDropoutBackward0``): no noise is found, and the call is re-run whole, as
    is any call whose check failed, any call under autocast, any call on fewer than
    ``refills.MIN_ELEMENTS`` elements, and any module that is not a stock ``nn.Dropout`` (or its 1d, 2d,
    3d forms, whose noise broadcasts over a channel) in training mode, not in place, with
    ``0 < p < 1``. The planner weighs a refilled dropout at the refill's measured time, as it does
    a refilled batch norm (Note [Batch-norm refills] in batchnorm.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["refill", "refillable", "saved_noise"]

_FORWARDS = (nn.Dropout.forward, nn.Dropout1d.forward, nn.Dropout2d.forward, nn.Dropout3d.forward)
"""The stock forwards: each is ``F.dropout`` (or a feature form of it) with the module's ``p``."""


def refillable(module: nn.Module) -> bool:
    """A stock dropout that draws noise: training mode, not in place, ``0 < p < 1``."""
    if not isinstance(module, nn.modules.dropout._DropoutNd) or type(module).forward not in _FORWARDS:
        return False
    return module.training and not module.inplace and 0.0 < module.p < 1.0


def saved_noise(output: torch.Tensor) -> torch.Tensor | None:
    """The noise the forward saved for ``output``'s backward (the ``other`` of the product that
    made it), or None when ``output`` is not such a product."""
    node: Any = output.grad_fn
    if node is None or type(node).__name__ != "MulBackward0":
        return None
    noise = node._saved_other
    return noise if isinstance(noise, torch.Tensor) and noise.grad_fn is None else None


def refill(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The dropout's output for input ``x``, from the saved ``noise`` (Note [Dropout refills]);
    exact only where ``refills.exact_refill_seconds`` said so."""
    with torch.no_grad():
        return torch.mul(x, noise)

