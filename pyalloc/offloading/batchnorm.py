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

    That holds for the kernel's contiguous and channels-last paths; a strided input takes
    another path (``((x - mean) * invstd) * weight + bias``), and a GPU kernel may form the
    output otherwise. So nothing is assumed: the profiled step computes each batch norm's refill
    on the device and layout it ran on and compares it with the forward's output bit for bit
    (:func:`exact_refill_seconds`); only a call that matched is refilled, and only while its
    input has the profiled geometry and no autocast is on. Any other batch-norm call is re-run
    whole, as before. The planner weighs a refilled call at the refill's measured time, so
    that ReLU outputs after batch norms (one cheap pass each) are dropped first.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

__all__ = ["exact_refill_seconds", "refill", "refillable", "saved_statistics"]

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
    (Note [Batch-norm refills]); exact only where :func:`exact_refill_seconds` said so."""
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    with torch.no_grad():
        alpha = invstd * weight if weight is not None else invstd
        return torch.native_batch_norm(x, alpha, bias, mean, torch.ones_like(mean), False, 0.0, 0.0)[0]


def exact_refill_seconds(module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> float | None:
    """The thread time :func:`refill` takes to give ``output`` (the module's forward output for
    ``x``) again, or None when it does not give it bit for bit, with the same geometry, on this
    device and layout. Timed on a second run: the first one's output often lands in memory
    never touched before (seen: 3 ms instead of 0.45 ms for 4 MiB, in the profiled step), and
    a refill costed that high would never be planned, so never measured."""
    stats = saved_statistics(output)
    if stats is None:
        return None
    refill(module, x.detach(), *stats)
    t0 = time.thread_time()
    got = refill(module, x.detach(), *stats)
    seconds = time.thread_time() - t0
    same = got.dtype == output.dtype and got.stride() == output.stride() and torch.equal(got, output)
    return seconds if same else None
