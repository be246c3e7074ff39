"""The session's module hooks, told apart from the program's (issue 20).

Note [Session hooks]
    A profiled step hangs global module hooks for its duration, a planned step hooks on the
    planned modules; both are :class:`StepHook` objects, so that what a refill must not skip
    (refills.py) can be told from them: a hook of the program's own that changes a module's input
    or output. A refill computes the output from the input the step recorded, which is before
    the module's own pre-hooks (the step's come first) and after nothing of the module's forward
    hooks; a module with a hook of the program's is re-run whole, which runs its hooks again,
    as the forward did.

    A module copied inside a planned step (``copy.deepcopy(model)`` for an EMA or a snapshot)
    would copy the step's hooks on it, and with them the step and its lock: "cannot pickle
    '_thread.RLock' object" (a review's finding). A deep copy gets a :class:`DetachedHook`
    instead, which does nothing and takes itself off the copy at the copy's first eager call;
    a pickle (``torch.save(model)``) gets ``None.__init__``, a builtin that takes any arguments
    and returns None: the checkpoint names nothing of pyalloc, and loads where pyalloc is not
    installed.

    The same holds for saved-tensor hooks: a refill reads what an autograd node saved (a batch
    norm's statistics, a dropout's noise) only where the hooks in force are the session's
    (:func:`saves_are_ours`); inside the program's own (``torch.utils.checkpoint``,
    ``save_on_cpu``) a read goes through their unpack, which may re-run a forward.

    Module calls made while backward runs (a reentrant ``torch.utils.checkpoint`` re-running
    its block, a custom Function's backward calling a module) are not the step's forward: the
    hooks pass them by (:func:`in_backward`). On a GPU backward runs on the engine's device
    threads, which the hooks passed by already; on the CPU it runs on the caller's, and a
    profile took a reentrant checkpoint's re-run for calls of the forward: every planned step
    found them otherwise and the session profiled again every third step (a review, 2026-11-29).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["DetachedHook", "StepHook", "foreign_hooks", "in_backward", "saves_are_ours"]

_PICKLED_AS = (getattr, (None, "__init__"))
"""What either hook pickles as: ``None.__init__``, a builtin that takes any arguments and returns
None (Note [Session hooks])."""


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread now."""
    return torch._C._current_graph_task_id() != -1


class StepHook:
    """One of the session's module hooks (``fn``: the step's bound method; ``pre``: a forward
    pre-hook, else a forward hook)."""

    __slots__ = ("fn", "pre")

    def __init__(self, fn: Callable[..., Any], pre: bool) -> None:
        self.fn, self.pre = fn, pre

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> "DetachedHook":
        return DetachedHook(self.pre)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[None, str]]:
        return _PICKLED_AS


class DetachedHook:
    """What a deep copy of a module holds where the original held a :class:`StepHook`. The
    pre-hook one (pre-hooks run first, from a copy of the module's list) removes every detached
    hook from the module, the forward hooks among them before their list is walked; a forward
    hook one does nothing (a module is not changed while its forward hooks are walked), and
    neither changes anything while torch.compile traces."""

    __slots__ = ("pre",)

    def __init__(self, pre: bool) -> None:
        self.pre = pre

    def __call__(self, module: torch.nn.Module, *rest: Any) -> None:
        if not self.pre or torch.compiler.is_compiling():
            return
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for hook_id in [k for k, h in hooks.items() if isinstance(h, DetachedHook)]:
                del hooks[hook_id]
                for extra in (module._forward_pre_hooks_with_kwargs, module._forward_hooks_with_kwargs,
                              module._forward_hooks_always_called):
                    extra.pop(hook_id, None)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[None, str]]:
        return _PICKLED_AS


def foreign_hooks(module: torch.nn.Module) -> bool:
    """Whether a hook of the program's may change ``module``'s input or output: a forward
    pre-hook or forward hook of the module's, or a global forward hook, that is not the
    session's (global pre-hooks run before the step's, which records what they give)."""
    from torch.nn.modules.module import _global_forward_hooks

    ours = (StepHook, DetachedHook)
    return any(not isinstance(h, ours) for hooks in (module._forward_pre_hooks, module._forward_hooks,
                                                     _global_forward_hooks) for h in hooks.values())


def saves_are_ours() -> bool:
    """Whether the saved-tensor hooks in force are the session's (or none are), so that reading a tensor an
    autograd node saved (a batch norm's statistics, a dropout's noise) only reads it. Under the
    program's own hooks the read goes through their unpack: inside ``torch.utils.checkpoint``
    (non-reentrant) it re-ran the checkpointed forward, twice for a batch norm's two statistics,
    and its running statistics moved twice more than the plain step's (a review's finding).
    Without the (private) way to ask, the answer is no: nothing is refilled."""
    try:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError):
        return False
    return top is None or getattr(top[0], "__module__", "").startswith("pyalloc.offloading.")
