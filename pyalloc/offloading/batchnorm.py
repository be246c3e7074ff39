"""Batch-norm refills: a training-mode batch norm's output again, from the statistics its forward
saved, without computing them again (issue 20).

Note [Batch-norm refills]
    Re-running a training-mode batch norm to regenerate its output (for the ReLU after it, whose
    output a plan drops) computes the batch statistics again: two passes over the input, then
    the normalisation. On CPU that is ~2 ms for a 4 MiB output, more than the convolution that
    made the input. The forward's mean and inverse std are saved for backward anyway (the
    autograd node's ``result1`` and ``result2``), and with them the output is one elementwise
    pass: ~0.17 ms.

    The pass must give the forward's bits. ATen's CPU kernel forms the output, in training and
    in eval mode alike, as ``x * alpha[c] + beta[c]`` with ``alpha = invstd * weight`` and
    ``beta = bias - mean * alpha``; in training ``invstd`` is the saved one, in eval it is
    ``1 / sqrt(running_var + eps)``. So an eval-mode ``native_batch_norm`` with weight
    ``invstd * weight`` (one float product, rounded as the kernel rounds it), the saved mean as
    running mean, running variance 1 and eps 0 (its ``invstd`` is exactly 1, so its ``alpha`` is
    that weight) computes the same ``alpha`` and ``beta`` and then the same pass. (A running
    variance chosen so that the kernel's ``invstd`` equals the saved one does not work: some
    float ``invstd`` values are no float variance's.) The eval call writes no running statistic.

    That holds for the kernel's contiguous and channels-last paths, whatever the parameters; a
    strided input takes another path (``((x - mean) * invstd) * weight + bias``), and a GPU kernel
    may form the output otherwise. So nothing is assumed, and two things are checked in the
    profiled step, on the device and layout the call ran on: the refill gives the forward's
    output bit for bit, and it gives bit for bit the output of a training-mode call on the same
    input with parameters drawn away from 1 and 0 (``refills.exact_refill_seconds``). The second
    check is what tells the paths apart: at weight 1 and bias 0, the default initialisation,
    the strided path and the refill agree, and after the first optimizer step they do not (a
    second reader found that: a transposed ``BatchNorm2d`` at its initial weights passed the
    first check alone, and every planned step's gradients then differed). Calls on fewer than
    ``refills.MIN_ELEMENTS`` elements are not refilled: a few elements could agree by chance, and a
    small output is not worth dropping. Only a call that passed both is refilled, and only while
    its input has the profiled geometry and no autocast is on; any other batch-norm call is
    re-run whole, as before. The planner weighs a refilled call at the refill's measured time, so
    that ReLU outputs after batch norms (one cheap pass each) are dropped first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["refill", "refillable", "saved_statistics", "with_other_parameters"]

_NODES = ("NativeBatchNormBackward0",)
"""Autograd nodes of a batch norm whose ``result1`` and ``result2`` are the batch's mean and
inverse std (a CUDA build's cuDNN node saves its own form: it is re-run whole)."""


def refillable(module: nn.Module) -> bool:
    """A batch norm (the stock forward) that normalises with the batch's statistics."""
    if not isinstance(module, nn.modules.batchnorm._BatchNorm) or isinstance(module, nn.SyncBatchNorm):
        return False
    if type(module).forward is not nn.modules.batchnorm._BatchNorm.forward:
        return False
    return module.training or module.running_mean is None


def saved_statistics(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch mean and inverse std the forward saved for ``output``'s backward, or None when
    ``output`` is not a training-mode batch norm's direct result."""
    node: Any = output.grad_fn
    if node is None or type(node).__name__ not in _NODES or not node._saved_training:
        return None
    return node._saved_result1, node._saved_result2


def refill(module: nn.Module, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    """``module``'s training-mode output for input ``x``, from the saved ``mean`` and ``invstd``
    (Note [Batch-norm refills]); exact only where ``refills.exact_refill_seconds`` said so."""
    return _refill(x, getattr(module, "weight", None), getattr(module, "bias", None), mean, invstd)


def _refill(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
            invstd: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        alpha = invstd * weight if weight is not None else invstd
        return torch.native_batch_norm(x, alpha, bias, mean, torch.ones_like(mean), False, 0.0, 0.0)[0]


def with_other_parameters(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The refill and a training-mode call's output on ``x``, both with the module's parameters
    replaced by values away from 1 and 0 (from a fixed seed, so that every profile draws the
    same): a kernel that forms its output otherwise than the refill agrees with it at weight 1
    and bias 0, not here (Note [Batch-norm refills]). None for an input without channels. No
    running statistic is read or written."""
    if x.dim() < 2:
        return None
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    draw = torch.Generator().manual_seed(0x5EED)
    channels = x.shape[1]

    def drawn(like: torch.Tensor | None, low: float, high: float) -> torch.Tensor | None:
        if like is None:
            return None
        values = torch.empty(channels, dtype=torch.float64).uniform_(low, high, generator=draw)
        return values.to(device=like.device, dtype=like.dtype)

    w, b = drawn(weight, 0.5, 2.0), drawn(bias, -2.0, 2.0)
    with torch.no_grad():
        out, mean, invstd = torch.native_batch_norm(x, w, b, None, None, True, 0.0, float(getattr(module, "eps")))
        return _refill(x, w, b, mean, invstd), out
