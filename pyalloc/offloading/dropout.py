"""Dropout refills: a training-mode dropout's output again, from the noise its forward saved,
without drawing it again (issue 20).

Note [Dropout refills]
    On CPU a dropout computes ``input * noise``, ``noise`` holding 0 and ``1 / (1 - p)`` drawn
    from the generator (ATen's ``_dropout_impl``), and the product's autograd node
    (``MulBackward0``) saves ``noise`` for backward: a tensor without history that the step made,
    counted against the budget (Note [Step-made leaves] in plan.py) and held for backward
    anyway. Re-running the dropout to regenerate its
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

Note [Dropout products]
    A dropout inside an operator's own decomposition is no module call, so no module re-run can
    regenerate it alone: CPU attention with dropout (``scaled_dot_product_attention``'s math
    path, what ``nn.MultiheadAttention`` runs in training) computes ``softmax(q k^T) * noise``
    and the next matrix product saves that product, the attention matrix (2 MiB a layer of the
    benchmark's BERT-like model, 1 MiB a GPT-like block). The softmax saves its own result
    and the product's node saves the noise, so the product is ``a * noise`` with both operands
    held for backward anyway: a *dropout product* save is dropped and refilled in backward
    from those two, one elementwise product, where a region re-running the attention (its
    three matrix products) took ~7 ms on the BERT-like model. It is found from the saved
    tensor's own autograd graph, not from recorded operators: the save is a view (up to
    ``MAX_VIEW_STEPS`` view nodes) of a ``MulBackward0`` whose ``other`` is saved without history
    (the noise) and whose ``self`` comes from a node that saved its result (``_saved_result``).
    The profiled step checks the refill bit for bit with the save's strides
    (:func:`exact_product_seconds`); a planned step checks the node types again on every such
    save (another graph: the step diverges and keeps its saves), and reads both operands from
    the nodes in backward. The refill runs before either node's backward (the save's reader
    comes later in forward, so earlier in backward), while both still hold their saves.

Note [Packed noise]
    Since the noise counts against the budget (Note [Step-made leaves] in plan.py) it is most of
    what a plan keeps on CPU: 28 of the 54 MiB the BERT-like model of the offload benchmark held
    at half its saved bytes, every element a float32 that is +0.0 or the scale ``1 / (1 - p)``.
    Drawing it again in backward (a region's re-run) costs a Bernoulli draw, ~6 ms for 2 MiB on
    the development machine. A planned step can keep such a save as a boolean mask and the scale
    instead (:func:`pack_noise`; a quarter of the bytes of float32) and give autograd
    ``mask * scale`` when it asks (:func:`unpack_noise`): the same bits. Packing is proved every
    time, by counting (:func:`_pack_counted`): the scale is the largest bit pattern, the mask the
    elements that have it, and as many elements have bits other than zero as the mask holds, so
    every element is the scale or ``+0.0``; else the save is not packed (the step diverges: the
    plan no longer holds). A first version that unpacked and compared (b6f7ccf, reverted, then
    3d17d3a with cheaper operations) read and wrote the noise five times a pack; counting reads
    it three times and makes no copy: for 2 MiB, 0.42 ms against 0.51-0.57 with the caches warm, 1.2
    against 1.5 cold (``tools/bench/noise_pack_ops.py``).

    Packing is not free, and a step pays it on every kept noise: measured inside planned steps
    of the BERT-like model (24 noises, 30 MiB), 14-22 ms of packing and 13-23 ms of unpacking a
    step (an unpack per reader: the product's node, a refill, a selective region's sources), as
    much as 8% of the step. So it is a candidate of the planner like a re-run (``PACK`` in
    plan.py): it frees three quarters of the noise's bytes for what the profiled step measured
    one pack and one unpack of it to cost (:func:`noise_pack_seconds`), and the greedy takes it
    where it frees bytes for less than a re-run or refill would. Packing every kept noise made
    the BERT-like model 1.08-1.19x the plain step at 95% of its saved bytes, where a refill or
    two does (~1.0x now). The profiled step notes which saves are such noise: a leaf the step
    made, floating point, all of its storage (dense, in any order of dimensions: the noise takes
    its input's, a transposed one after an LSTM), unpacked with its strides,
    ``refills.MIN_ELEMENTS`` or more elements, no ``-0.0`` (which the mask would turn into
    ``+0.0``). CUDA's fused dropout saves a boolean mask already: nothing to pack there.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from . import clock
from .ops import View, as_view, view_of

try:  # (matplotlib, of the torch extra, brings it; torch does not need it)
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = ["MAX_VIEW_STEPS", "exact_product_seconds", "noise_pack_seconds", "pack_noise", "packable_noise",
           "product_nodes", "product_refill", "refill", "refill_from", "refillable", "saved_noise", "unpack_noise"]

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
    return _node_noise(node)


def _node_noise(node: Any) -> torch.Tensor | None:
    """The ``other`` a product's node saved, when it is a tensor without history (noise)."""
    noise = node._saved_other
    return noise if isinstance(noise, torch.Tensor) and noise.grad_fn is None else None


def refill_from(node: Any, x: torch.Tensor) -> torch.Tensor | None:
    """:func:`refill` with the noise ``node`` (the output's ``MulBackward0``) saved, read now: a
    packed noise is unpacked for this refill alone, where reading it when the call returned held
    a float copy beside the mask until backward (a review, 2026-11-29: 1.25 times the noise's
    bytes where the plan counted 0.25). None when the node no longer holds it (its backward ran)
    or it is not noise: the call is then re-run."""
    try:
        noise = _node_noise(node)
    except RuntimeError:  # freed: the node's backward ran
        return None
    return None if noise is None else refill(x, noise)


def refill(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The dropout's output for input ``x``, from the saved ``noise`` (Note [Dropout refills]);
    exact only where ``refills.exact_refill_seconds`` said so."""
    with torch.no_grad():
        return torch.mul(x, noise)



# ---- noise kept as a mask ------------------------------------------------------------------


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SCALES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""The dtypes a noise packs in (float8 has no ``isfinite`` or ``mul`` on CPU)."""


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one floating dtype and shape hold the same bits (``+0.0`` is not
    ``-0.0``). On CPU through NumPy: ``torch.equal`` took 0.58 ms for 2 MiB, NumPy's comparison of
    the same memory 0.11 (one thread, the development machine)."""
    bits = _SAME_SIZE_INTS[a.element_size()]
    a, b = a.view(bits), b.view(bits)
    if a.device.type == "cpu" and np is not None:
        return bool(np.array_equal(a.numpy(), b.numpy()))
    return torch.equal(a, b)


def pack_noise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``t`` as a boolean mask and its scale, when the mask times the scale gives ``t`` again bit
    for bit (Note [Packed noise]); None otherwise. Without torch-function modes: a planned step's
    call trace (Note [Call traces] in guard.py) stays on the mode stack through the step, and
    each of the operations here would go through Python to it."""
    if t.dtype not in _SCALES:
        return None
    with torch.no_grad(), torch._C.DisableTorchFunction():
        if t.device.type == "cpu" and np is not None and t.is_contiguous() and t.dim() > 0:
            return _pack_counted(t)
        scale = t.amax()
        mask = t.bool()
        if not _same_bits(unpack_noise(mask, scale), t):
            return None
    return mask, scale


def _pack_counted(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`pack_noise` of a contiguous CPU tensor, proved by counting, in NumPy, over the
    elements' bits: ``top`` the largest bit pattern (read as signed integers, a positive float's
    are positive and order as its values), the mask the elements whose bits are ``top``; when as
    many elements have bits other than zero as the mask holds, every element is ``+0.0`` or
    ``top``'s value, which must be a positive finite number. Then mask times scale is ``t`` bit
    for bit (``1 * s`` is ``s``, ``0 * s`` is ``+0.0``), with no unpacked copy made to compare:
    three reads of ``t`` and one of the mask, where unpacking and comparing read and wrote it
    five times (Note [Packed noise])."""
    ints = _SAME_SIZE_INTS[t.element_size()]
    bits = t.view(ints).numpy()
    if bits.size == 0:
        return None
    top = bits.max()
    scale = torch.tensor(int(top), dtype=ints).view(t.dtype)
    if not 0.0 < float(scale) < math.inf:  # (NaN compares false)
        return None
    mask = bits == top
    if np.count_nonzero(mask) != np.count_nonzero(bits):
        return None
    return torch.from_numpy(mask), scale


def unpack_noise(mask: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The noise :func:`pack_noise` packed, bit for bit, with its strides (Note [Packed noise]):
    the mask's bytes as the scale's dtype, times the scale (``torch.mul`` of the boolean mask by
    the scale took 1.04 ms for 2 MiB, this 0.13)."""
    with torch.no_grad(), torch._C.DisableTorchFunction():
        return mask.view(torch.uint8).to(scale.dtype).mul_(scale)


def packable_noise(t: torch.Tensor) -> bool:
    """In the profiled step, for a leaf save the step made: whether it is noise a planned step may
    keep packed (Note [Packed noise])."""
    return noise_pack_seconds(t) is not None


def noise_pack_seconds(t: torch.Tensor) -> float | None:
    """:func:`packable_noise`, and if so what keeping it packed costs a step, measured on ``t``:
    one pack and one unpack (autograd's, in backward); None when it is not such noise. The
    planner weighs that against dropping (Note [Packed noise])."""
    from .refills import MIN_ELEMENTS  # (refills imports this module)

    if t.dtype not in _SCALES or t.numel() < MIN_ELEMENTS \
            or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return None
    with torch.no_grad():
        if bool(torch.signbit(t).any()):
            return None
        start = clock.now()  # as re-runs are measured (Note [Device time] in clock.py)
        packed = pack_noise(t)
        if packed is None:
            return None
        back = unpack_noise(*packed)
        seconds = clock.now() - start
        return seconds if back.stride() == t.stride() else None


# ---- a dropout inside an operator: its product, saved by a later operator ------------------

_VIEW_NODES = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "ExpandBackward0", "TransposeBackward0",
    "TBackward0", "PermuteBackward0", "SqueezeBackward0", "SqueezeBackward1", "UnsqueezeBackward0",
    "AliasBackward0", "AsStridedBackward0"})
"""Autograd nodes of operators that return a view of their one differentiable input (same storage)."""

MAX_VIEW_STEPS = 4
"""How many view operators may lie between a dropout's product and the save of it."""


def product_nodes(t: torch.Tensor) -> tuple[tuple[str, ...], Any, Any] | None:
    """Whether ``t`` is a view of a dropout's product ``a * noise`` whose operand ``a`` is the
    saved result of the operator that made it (Note [Dropout products]): the names of the view
    nodes walked, the product's node (``MulBackward0``, which saved ``noise``) and ``a``'s node
    (which saved ``a`` as ``_saved_result``); None otherwise. Reads node types only."""
    node: Any = t.grad_fn
    path: list[str] = []
    while node is not None and type(node).__name__ in _VIEW_NODES and len(path) < MAX_VIEW_STEPS:
        path.append(type(node).__name__)
        node = node.next_functions[0][0]
    if node is None or type(node).__name__ != "MulBackward0":
        return None
    source = node.next_functions[0][0]
    if source is None or not hasattr(type(source), "_saved_result"):
        return None
    return tuple(path), node, source


def product_refill(product: Any, source: Any, view: View) -> torch.Tensor:
    """The saved view of ``a * noise`` again, from ``a`` (``source``'s saved result) and the
    noise the product's node saved; exact only where :func:`exact_product_seconds` said so."""
    with torch.no_grad():
        return as_view(torch.mul(source._saved_result, product._saved_other), view)


def exact_product_seconds(t: torch.Tensor) -> tuple[tuple[str, ...], str, float, torch.Tensor] | None:
    """In the profiled step, for a save ``t``: when it is a dropout's product (or a view of one)
    that :func:`product_refill` gives again bit for bit, with its strides, on this device and
    layout, the view path, the type of ``a``'s node, the refill's time (timed on a
    second run, as ``refills.exact_refill_seconds`` does) and ``a``; else None. Reading the saved
    operands may raise (one not resident in the profiled step's DTR): then None."""
    found = product_nodes(t)
    if found is None:
        return None
    path, product, source = found
    try:
        noise = product._saved_other
        a = source._saved_result
    except Exception:
        return None
    if not isinstance(noise, torch.Tensor) or noise.grad_fn is not None or noise.requires_grad \
            or not isinstance(a, torch.Tensor) or a.dtype != t.dtype:
        return None
    try:
        with torch.no_grad():
            first = torch.mul(a, noise)
            if first.untyped_storage().nbytes() != t.untyped_storage().nbytes():
                return None
            t0 = clock.now()
            got = product_refill(product, source, view_of(t))
            seconds = clock.now() - t0
    except Exception:
        return None
    if got.dtype != t.dtype or got.shape != t.shape or got.stride() != t.stride() or not torch.equal(got, t):
        return None
    return path, type(source).__name__, seconds, a
