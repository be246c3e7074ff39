"""What a selective region's module call asked of torch, compared step by step with the profile.

Note [Call traces]
    A replay (Note [Operator replay] in ops.py) runs the aten operators the profiled step ran,
    with the constants that step gave them. It is exact while the module's call would run those
    operators with those constants again. Those are decided by what the call asks of torch: the
    top-level torch calls its code makes (``F.layer_norm``, ``F.multi_head_attention_forward``,
    ``Tensor.__mul__``, ...), their Python arguments (an ``eps``, a ``dropout_p``, the
    ``training`` flag, a scalar a module computed in Python) and the dtype, shape and strides of
    their tensor arguments. A composite call is one entry: what it runs inside is a function of
    its arguments (the mode is popped while it runs, so its inner calls are not seen). A tensor
    property read (``x.dtype``) is the property alone: what it returns reaches torch only through
    later calls (an argument of one, or which calls are made), whose entries hold it.

    :class:`CallTrace` is a ``TorchFunctionMode`` that writes one entry per top-level call while
    its owner says so: in the profiled step, whenever the profile records (module calls open, grad
    on, not in the session's own hooks); in a planned step with selective regions, while such a
    region's call runs under the same conditions. It sits where the session's modes end and the
    program's begin in both steps (:func:`push_at`), so a mode the program enters during a step
    passes calls on to it alike. A function argument enters an entry as its code and what its
    closure holds (a hook's lambda is made anew each step), never as itself: a plan keeps its
    profile's trace, and with it no captured tensor. Each module call of the profile keeps the span of entries it made
    (``CallInfo.first_trace``/``end_trace``); the plan keeps that span for each selective region
    (``Plan.traces``). At the end of the region's call in a planned step, its entries are compared
    with the plan's: equal, and the region is *traced*: its replay is the profile's, computed from
    what this step holds. Different (a constant changed between steps while every shape stayed,
    such as an ``eps`` set between steps or a scalar annealed in Python), and the region refills
    through the module's own code under the checking mode (exact, Note [Selective re-runs]), and
    the next step is profiled again (``replays_stale_total``).

    What no trace shows: state a composite torch function reads itself rather than from its
    arguments (global flags such as ``torch.backends`` settings; a changed kernel choice that
    changes what is saved is seen by the plan's signature check instead) and data-dependent
    control flow inside aten operators. The periodic checked re-run (``REPLAY_CHECK_EVERY`` in
    session.py) stays for those. A trace costs one trip through Python per top-level call, only
    inside selective regions. Measured on the development machine (2026-11-27), a GPT-like
    block's 32 calls, 14 of them tensor property reads inside ``nn.MultiheadAttention``: ~0.33 ms
    traced against ~7.5-7.9 ms for its forward alone in a loop; inside a training step of four
    blocks, where the caches are cold, ~2.3 ms (1.1 ms of PyTorch handing calls to a mode, 1.2 ms
    of entries) before property reads became bare entries and the mode asked the planned step
    directly (regions.py, PlannedStep._entries); after both, the planned forward read 39.4 ms
    against the plain one's 38.1 ms. (An earlier version of this note said 20 us a block: not a
    measurement that holds.)
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CallTrace", "entry", "push_at", "remove", "same_trace"]

_Tensor = torch.Tensor
_MethodWrapper = types.MethodWrapperType  # (a property's bound __get__ is one)
_AS_IS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
"""Argument types that enter an entry as they are (what :func:`_meta` ends with for them)."""


def _meta(a: Any) -> Any:
    """What a call's argument contributes to its entry: a tensor's dtype, shape and strides (its
    values are data the replay reads live), containers element by element (a named tuple with
    its type), a function by its code (a closure made anew each step, such as a gradient hook's
    lambda, is the same code; its captured values are not kept), anything else as is."""
    kind = type(a)
    if kind in _AS_IS:  # most arguments: a number, a flag, a dtype (the checks below, skipped)
        return a
    if isinstance(a, _Tensor):
        return (a.dtype, a.shape, a.stride())
    if kind is tuple or kind is list:
        return tuple(map(_meta, a))
    if kind is dict:
        return tuple((k, _meta(v)) for k, v in a.items())
    if isinstance(a, tuple):
        return (kind, tuple(map(_meta, a)))
    if kind is types.FunctionType:
        return _function(a)
    if kind is types.MethodType and type(a.__func__) is types.FunctionType:
        return (kind, _function(a.__func__), _meta(a.__self__))
    if kind is functools.partial:
        return (kind, _meta(a.func), tuple(map(_meta, a.args)), _meta(a.keywords))
    return a


def _function(f: types.FunctionType) -> tuple[Any, ...]:
    """A function by its code and what its closure holds now (functions there by their code
    alone: a function that refers to itself must not recurse)."""
    cells = []
    for cell in f.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not filled yet
            value = None
        cells.append(value.__code__ if type(value) is types.FunctionType else _meta(value))
    return (types.FunctionType, f.__code__, tuple(cells))


class CallTrace(TorchFunctionMode):
    """Appends an entry ``(func, args[, kwargs])`` for each top-level torch call to the list
    ``entries()`` gives (Note [Call traces]); None: the call is not traced. Above the session's
    other modes (their own calls are not the program's), under the modes the program enters
    during a step (:func:`push_at`)."""

    def __init__(self, entries: Callable[[], list[tuple[Any, ...]] | None]) -> None:
        super().__init__()
        self.entries = entries

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = None if torch.compiler.is_compiling() else self.entries()  # first: dynamo must not trace the trace
        if out is not None:
            out.append(entry(func, args, kwargs))
        return func(*args, **(kwargs or {}))


def entry(func: Any, args: tuple, kwargs: dict | None) -> tuple[Any, ...]:
    """One call's entry in a trace (Note [Call traces]). A tensor property read (``x.dtype``,
    ``x.is_nested``: ``func`` is the property's ``__get__``) is the property alone: what it
    returns reaches torch only through later calls, whose entries hold it (an argument, or
    which calls follow); nearly half a transformer block's calls are such reads."""
    if type(func) is _MethodWrapper and func.__name__ == "__get__":
        return (func,)
    if kwargs:
        return (func, tuple(map(_meta, args)), _meta(kwargs))
    return (func, tuple(map(_meta, args)))


def push_at(mode: TorchFunctionMode, height: int) -> None:
    """Puts ``mode`` into the torch-function mode stack with ``height`` modes under it (the
    modes above stay, in order). A step's trace goes where the session's modes end and the
    program's begin, as the profiled step's did (entered with the step's hooks): modes the
    program enters during the step (a ``torch.device`` context adds ``device=`` to factory
    calls) pass each call on to it in both."""
    above = _pop_above(height)
    torch._C._push_on_torch_function_stack(mode)
    _push_back(above)


def remove(mode: TorchFunctionMode) -> None:
    """Takes ``mode`` off the torch-function mode stack wherever it is; modes pushed above it and
    not popped yet (a program's own, left entered) stay, in their order. Nothing if it is not
    there."""
    n = torch._C._len_torch_function_stack()
    at = next((i for i in range(n) if torch._C._get_function_stack_at(i) is mode), None)
    if at is None:
        return
    above = _pop_above(at + 1)
    torch._C._pop_torch_function_stack()
    _push_back(above)


def _pop_above(height: int) -> list[Any]:
    """Pops the modes above the first ``height``; returns them, top first."""
    above: list[Any] = []
    while torch._C._len_torch_function_stack() > height:
        above.append(torch._C._pop_torch_function_stack())
    return above


def _push_back(above: list[Any]) -> None:
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


def same_trace(got: list[tuple[Any, ...]], expected: list[tuple[Any, ...]] | None) -> bool:
    """Whether a region call's entries are the profile's; an argument whose comparison fails (an
    object whose ``==`` raises or is not a truth value) counts as different."""
    if expected is None or len(got) != len(expected):
        return False
    try:
        return bool(got == expected)
    except Exception:
        return False
