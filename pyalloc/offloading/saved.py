"""The handle autograd keeps instead of a saved tensor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .._finalizers import finalize

if TYPE_CHECKING:
    from .calls import ProducerCall
    from .session import ActivationOffload
    from .swap import Copy


def _span(t: torch.Tensor) -> int:
    """Elements from the first to the last one the tensor's strides reach (0 for empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


RESIDENT, SWAPPED, DROPPED = "resident", "swapped", "dropped"
ABANDONED = "abandoned"  # its step was cut short by an exception: released (Note [Abandoned steps] in session.py)
ABANDONED_MESSAGE = ("pyalloc.offload: this saved tensor belongs to a step that an exception cut short, and was "
                     "released when the exception left the offload session (Note [Abandoned steps]); run the "
                     "forward again under the session before calling backward")


class SavedActivation:
    """The handle autograd keeps instead of a saved tensor.

    States: resident (holds the tensor), swapped (bytes in a host buffer), dropped (regenerated
    by replaying ``producer``). ``nbytes`` is the span the strides reach, so a restored tensor has
    the same sizes, strides and bytes as the original.
    """

    __slots__ = ("session", "tensor", "state", "nbytes", "dtype", "device", "shape", "stride",
                 "span", "evictable", "counted", "producer", "last_use", "seq", "host", "pending", "ready",
                 "pos", "original", "__weakref__")

    def __init__(self, session: "ActivationOffload", t: torch.Tensor, seq: int) -> None:
        self.session = session
        self.tensor: torch.Tensor | None = t.detach()
        self.state = RESIDENT
        self.dtype = t.dtype
        self.device = t.device
        self.shape = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.span = _span(t)
        self.nbytes = self.span * t.element_size()
        self.producer: tuple[ProducerCall, str, int, int] | None = None  # call, "out"/"pack", index, version
        self.last_use = seq
        self.seq = seq
        self.pos = -1  # index in the session's pack order (ActivationOffload._order)
        self.host: torch.Tensor | None = None
        self.pending: Copy | None = None  # the swap-out copy, while it may be in flight (CUDA)
        self.ready: Any = None  # event the compute stream waits on before use (CUDA swap-in)
        self.original: Any = None  # check.Original while dropped, with the session's check on
        leaf_view = t._base is not None and t._base.is_leaf  # a view of a parameter (weight.t())
        # against the budget: a save with history, or a leaf the step made (the session's
        # _attribute says which), not a parameter, a view of one or the batch
        self.counted = not t.is_leaf and not leaf_view
        self.evictable = (
            t.layout == torch.strided
            and type(t) in (torch.Tensor, torch.nn.Parameter)
            and not isinstance(t, torch.nn.Parameter)
            and not (t.is_leaf and t.requires_grad)  # a leaf without history: only if the step made it (_attribute)
            and not leaf_view
            and t.device.type in ("cpu", "cuda")
            and self.nbytes >= session.min_evict_bytes
        )

    def __del__(self) -> None:  # autograd released it (its node ran): stop counting its bytes
        finalize(self.session._forget, self)
