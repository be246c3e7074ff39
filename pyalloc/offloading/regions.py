"""A planned step: drops the saves a :class:`~.plan.Plan` names and recomputes them by re-running
modules (Note [Planned recompute] in plan.py).

Per step this costs one saved-tensor hook call per save and, on the planned modules only, a pre-
and post-forward hook; nothing is recorded per operator. Every re-run restores the CPU (and CUDA)
RNG state of the original call (Note [Generator states] in rng.py), runs with grad enabled as the original did, detaches what it
captures, and puts the module's buffers back afterwards (a batch norm updates its running
statistics once per step, as without the session).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from .._finalizers import finalize
from . import clock, dropout, refills, rng
from .hooks import StepHook, in_backward
from . import check as recompute_check
from .check import Original, RecomputeCheck
from .calls import AUTOCAST_OFF, autocast_as, autocast_state
from . import guard
from .guard import same_trace
from .ops import Geometry, RerunMismatch, SelectiveRerun, StopRerun, as_view, geometry, put_back, run_replay, view_of
from .plan import (KEEP, OUTPUT, PRODUCT, REGION, Plan, StorageKey, call_signature, is_activation, storage_key,
                   tensor_leaves, training_statistics, tree_buffers)
from .saved import ABANDONED_MESSAGE

if TYPE_CHECKING:
    from .ops import Recipe
    from .plan import CallInfo

__all__ = ["IdleStep", "KeptSave", "PlannedStep", "SavedBytes"]

_grad_enabled = torch.is_grad_enabled  # (asked for every torch call a selective region makes)
_thread_id = threading.get_ident


class SavedBytes:
    """Saved-activation bytes held now and at the peak, each storage counted once however many
    saves (or views) hold it. The budget is checked against these figures."""

    def __init__(self) -> None:
        self._live: dict[StorageKey, list[int]] = {}
        self.current = 0
        self.peak = 0
        # False in a planned step that is not counted (PlannedStep.counted): nothing reads its
        # figures, and the handles skip finding the storage they would count
        self.on = True

    def hold(self, t: torch.Tensor) -> StorageKey | None:
        """Counts ``t``'s storage once more; returns its key, to release, or None when this
        counter is off (nothing is counted)."""
        if not self.on:
            return None
        key = storage_key(t)
        self.add(key, t.untyped_storage().nbytes())
        return key

    def add(self, key: StorageKey, nbytes: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [1, nbytes]
            self.current += nbytes
            if self.current > self.peak:
                self.peak = self.current
        else:
            entry[0] += 1

    def release(self, key: StorageKey) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self.current -= entry[1]


class _Counted:
    """Base of every handle that holds bytes: releases its storage's count when autograd frees it."""

    __slots__ = ("_bytes", "_key", "abandoned", "__weakref__")

    def __init__(self, counter: SavedBytes) -> None:
        self._bytes = counter
        self._key: StorageKey | None = None
        self.abandoned = False

    def abandon(self) -> None:
        """Its step was cut short (Note [Abandoned steps] in session.py): lets go of every tensor
        and record it holds, and of its count."""
        if self._key is not None:
            self._bytes.release(self._key)
            self._key = None
        for cls in type(self).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if name not in _Counted.__slots__:
                    setattr(self, name, None)
        self.abandoned = True

    def count(self, t: torch.Tensor) -> None:
        self._key = self._bytes.hold(t)

    def __del__(self) -> None:
        if self._key is not None:
            finalize(self._bytes.release, self._key)


class KeptSave(_Counted):
    """A save the plan keeps."""

    __slots__ = ("tensor",)

    def __init__(self, counter: SavedBytes, t: torch.Tensor) -> None:
        super().__init__(counter)
        self.tensor = t.detach()
        self.count(t)


class PackedNoise(_Counted):
    """Dropout noise a kept save holds as a boolean mask and its scale (Note [Packed noise] in
    dropout.py); counted at the mask's bytes."""

    __slots__ = ("mask", "scale")

    def __init__(self, counter: SavedBytes, mask: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__(counter)
        self.mask, self.scale = mask, scale
        self.count(mask)

    def get(self) -> torch.Tensor:
        return dropout.unpack_noise(self.mask, self.scale)


SNAPSHOT_MAX_BYTES = 64 << 10
"""A buffer up to this size is copied when a planned call begins (Note [Buffers a re-run reads]);
a larger one only has its version noted. Running statistics are a few KiB; a constant mask or a
table, which nothing writes, can be MiBs, and a copy of it a call would be memory the budget
does not count (a review, 2026-11-29: a GPT-2 block's 1 MiB causal mask)."""

class BufferState:
    """The buffers of a planned call's module tree as the call found them.

    Note [Buffers a re-run reads]
        The profiled step leaves out of every plan a call whose module tree changes a buffer
        (Note [State a re-run reads] in plan.py), but a program can start changing one later:
        a running mean that a training loop switches on after a warm-up, or any buffer written
        between the call and backward. A re-run in backward would then read the buffer
        changed, and the gradients would come out wrong with no error (a review, 2026-11-29).
        So each planned call notes, when it begins, every buffer of its module tree (a training
        batch norm's statistics excepted: its forward does not read them, and a re-run puts them
        back) with its version, and copies those up to ``SNAPSHOT_MAX_BYTES`` (one copy a step of
        a buffer that several calls read unchanged). A re-run puts its buffers back afterwards
        (:class:`_Kept`: a training batch norm's statistics and the buffers up to that size; a
        larger one that the re-run wrote raises OffloadError, since no copy of it was made)
        (:func:`~.ops.put_back`) without a write the version counter sees: a write back is a
        write, and another call reading the same buffer (a block called thrice, a mask every
        block registers) took it for a change (a review, 2026-11-29). A re-run whose
        buffers changed since runs on the buffers as they were (the copies swapped into the
        modules for the re-run; a buffer replaced by another object, the object it was), and
        the step is marked stale, so that the next step is profiled again and sees the change.
        A larger buffer written in place cannot be put back: the re-run raises
        :class:`OffloadError` naming it. Buffers only: a plain attribute or a generator that
        starts to change later is not seen (the profile sees those it changes then).
    """

    __slots__ = ("entries",)

    def __init__(self, owners: list[tuple[torch.nn.Module, str]],
                 copies: dict[tuple[int, int], torch.Tensor]) -> None:
        """``copies``: the step's copies by (buffer, version), shared by every call that reads
        one buffer unchanged (a module called several times, a mask every block registers)."""
        self.entries: list[tuple[torch.nn.Module, str, torch.Tensor, int, torch.Tensor | None]] = []
        for owner, name in owners:
            b = owner._buffers.get(name)
            if b is None or training_statistics(owner, name):
                continue
            copy = None
            if b.untyped_storage().nbytes() <= SNAPSHOT_MAX_BYTES:
                copy = copies.get((id(b), b._version))
                if copy is None:
                    copy = copies[(id(b), b._version)] = b.detach().clone()
            self.entries.append((owner, name, b, b._version, copy))

    @contextlib.contextmanager
    def as_found(self, step: "PlannedStep", rerun: "_Rerun") -> Iterator[None]:
        """Within: the buffers as the call found them (the module's own objects when unchanged)."""
        changed = [e for e in self.entries if e[0]._buffers.get(e[1]) is not e[2] or e[2]._version != e[3]]
        if not changed:
            yield
            return
        for owner, name, b, version, copy in changed:
            if b._version != version and copy is None:
                from .session import OffloadError

                step.written_after.add(rerun.key)  # left out of every plan: the next step is profiled again
                raise OffloadError(
                    f"buffer {name!r} of {type(owner).__name__} ({b.untyped_storage().nbytes():,} bytes) was "
                    f"written in place after {type(rerun.module).__name__} read it: its dropped activations "
                    "cannot be recomputed as they were (a buffer the profiled step saw unchanged; the "
                    "session profiles the next step again and does not re-run the call there)")
        if any((id(owner), name) not in step.plan.written_buffers for owner, name, *_ in changed):
            step.stale = True  # profile the next step again: it sees the change
        step.session._stats["rerun_buffers_changed_total"] += 1
        now = [(owner, name, owner._buffers.get(name)) for owner, name, *_ in changed]
        for owner, name, b, version, copy in changed:
            owner._buffers[name] = b if b._version == version else copy
        try:
            yield
        finally:
            for owner, name, current in now:
                owner._buffers[name] = current


class _Rerun:
    """What re-running one module call needs: the module, its arguments, RNG states, grad mode."""

    key: tuple[int, int]  # the planned call: (id of the module, how many calls of it came before)

    def __init__(self, step: "PlannedStep", module: torch.nn.Module, args: tuple, kwargs: dict,
                 received: list[torch.Tensor] | None = None, leaves: list[torch.Tensor] | None = None,
                 made: list[bool] | None = None) -> None:
        """``received``: the tensors the call was given, where ``args`` and ``kwargs`` hold
        placeholders for some (an output call's linked inputs); their devices say which CUDA
        generators to replay (Note [Generator states] in rng.py). ``leaves``: the tensors in
        ``args`` and ``kwargs``, when the caller has them already. ``made``: per tensor of
        ``args``, whether the profiled call's was an activation (a leaf the step made, which
        the tensor alone does not tell: Note [Step-made leaves] in plan.py)."""
        self.step = step
        self.module = module
        self.args = args
        self.kwargs = kwargs
        self.cpu_rng = torch.default_generator.get_state()  # (torch.get_rng_state, one call less)
        if leaves is None:  # once: this runs on every planned call of a step
            leaves = tensor_leaves((args, kwargs))
        received = leaves if received is None else received
        self.cuda_rng = rng.cuda_states(received, step.cuda)
        # with the check on: the inputs' layouts as received and as the re-run gets them, for its
        # reports (Note [Recompute check] in check.py)
        self.input_layouts = [recompute_check.geometry(t) for t in received] if step.check is not None else None
        self.rerun_layouts: list[dict[str, Any]] | None = None
        self.pins: list[StorageKey] = []
        for i, t in enumerate(leaves):
            counts = is_activation(t) or (made is not None and i < len(made) and made[i] and t.is_leaf
                                          and not t.requires_grad)
            if counts and (key := step.bytes.hold(t)) is not None:
                self.pins.append(key)
        self.versions = [(t, t._version) for t in leaves]
        # autocast as the call ran (backward, where the re-run happens, usually runs without it)
        self.autocast = autocast_state()
        self.buffers = BufferState(step.buffer_owners(module), step.buffer_copies)

    def release(self) -> None:
        pins, self.pins = self.pins, []
        for key in pins:
            self.step.bytes.release(key)

    def __del__(self) -> None:
        finalize(self.release)

    def check_inputs(self) -> None:
        """Raises OffloadError when an input was written in place since the call: a re-run would
        compute from other values. The call is remembered, and the session profiles the next
        step again with it left out of every plan (Note [Inputs written after the call] in
        plan.py)."""
        for t, v in self.versions:
            if t._version != v:
                from .session import OffloadError

                self.step.written_after.add(self.key)
                raise OffloadError(f"an input of {type(self.module).__name__} was modified in place after "
                                   "the call: its dropped activations cannot be recomputed (the session "
                                   "profiles the next step again and does not drop them there)")

    def note_inputs(self, inputs: list[torch.Tensor]) -> None:
        """With the check on: the layouts of the inputs the re-run (or refill) is given."""
        if self.input_layouts is not None:
            self.rerun_layouts = [recompute_check.geometry(t) for t in inputs]

    def run(self, args: tuple, kwargs: dict, capture: Callable[[torch.Tensor], Any] | None,
            mode: SelectiveRerun | None = None, times: dict[tuple[int, int], float] | None = None) -> Any:
        """Re-runs the call on ``args`` as it first ran; ``capture`` sees what autograd saves;
        ``mode``: a selective re-run's (Note [Selective re-runs] in ops.py); ``times``: where
        the re-run's time goes (by default the step's ``rerun_seconds``, or its
        ``selective_seconds`` with a mode)."""
        self.check_inputs()
        step = self.step
        self.note_inputs(tensor_leaves((args, kwargs)))
        t0 = step.now()
        kept = _Kept(step.buffer_owners(self.module))
        step.recomputing += 1
        try:
            # The step's own hook must not see the re-run's saves (they are not the step's), and the
            # re-run's graph must hold none of them: a node that saves its own output would keep
            # itself alive through it (a cycle through C++ that no collector breaks), and the
            # graph is never run backward. Hence the pack hook stores nothing.
            with contextlib.ExitStack() as modes:
                modes.enter_context(self.buffers.as_found(step, self))
                modes.enter_context(rng.replayed(self.cpu_rng, self.cuda_rng))
                # as the call ran, whatever backward runs in (a re-run with the forward's autocast
                # cache would cast none: every checked step of a selective region fell back to a
                # whole re-run, a review, 2026-11-28)
                modes.enter_context(autocast_as(self.autocast))
                modes.enter_context(torch.autograd.graph.saved_tensors_hooks(capture or _discard, _never_unpacked))
                modes.enter_context(torch.enable_grad())
                if mode is not None:
                    modes.enter_context(mode)
                out = self.module(*args, **kwargs)
        finally:
            step.recomputing -= 1
            kept.put_back()
            st = step.session._stats
            seconds = step.now() - t0
            st["replays_total"] += 1
            st["recompute_seconds_total"] += seconds
            if times is None:
                times = step.selective_seconds if mode is not None else step.rerun_seconds
            times[self.key] = times.get(self.key, 0.0) + seconds
        if (written := kept.written()) is not None:
            from .session import OffloadError

            step.written_after.add(self.key)  # left out of every plan: the next step is profiled again
            name, nbytes = written
            raise OffloadError(f"re-running {type(self.module).__name__} wrote its buffer {name} ({nbytes:,} "
                               "bytes) in place, which the profiled step saw no call write: the buffer "
                               "holds that second write (the session profiles the next step again and "
                               "does not re-run the call there)")
        return out


@contextlib.contextmanager
def _at_module_boundaries(hook: Callable[..., None]) -> Iterator[None]:
    """Within: ``hook`` runs as every module call begins and ends (global module hooks, the
    session's: Note [Session hooks] in hooks.py)."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    handles = [register_module_forward_pre_hook(StepHook(hook, True)),
               register_module_forward_hook(StepHook(hook, False))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _Kept:
    """A module tree's buffers before a re-run, to put back after it (Note [Buffers a re-run
    reads]): a copy of each that a re-run may write (a training batch norm's statistics) or that
    is small; of a larger one, its version only. A larger buffer is a mask or a table, which the
    profile saw no call write (or no plan would re-run the call): a copy would be memory that the
    budget does not count (a GPT-2 block's 1 MiB causal mask, once a re-run)."""

    __slots__ = ("copies", "versions")

    def __init__(self, owners: list[tuple[torch.nn.Module, str]]) -> None:
        """``owners``: every (module, buffer name) of the tree (PlannedStep.buffer_owners)."""
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.versions: list[tuple[str, torch.Tensor, int]] = []
        for owner, name in owners:
            b = owner._buffers.get(name)
            if b is None:
                continue
            if training_statistics(owner, name) or b.untyped_storage().nbytes() <= SNAPSHOT_MAX_BYTES:
                self.copies.append((b, b.clone()))
            else:
                self.versions.append((f"{type(owner).__name__}.{name}", b, b._version))

    def put_back(self) -> None:
        for b, saved in self.copies:
            put_back(b, saved)

    def written(self) -> tuple[str, int] | None:
        """A buffer not copied that the re-run wrote (its name and bytes), if any: it cannot be
        put back."""
        for name, b, version in self.versions:
            if b._version != version:
                return name, b.untyped_storage().nbytes()
        return None


def _discard(x: Any) -> None:
    return None


def _never_unpacked(x: Any) -> torch.Tensor:
    raise RuntimeError("pyalloc.offload: backward through a re-run's graph (it is discarded)")


class Region(_Rerun):
    """A planned region call: its dropped saves, refilled by one re-run in backward."""

    def __init__(self, step: "PlannedStep", key: tuple[int, int], module: torch.nn.Module, args: tuple,
                 kwargs: dict, recipe: "Recipe | None" = None) -> None:
        super().__init__(step, module, args, kwargs, made=step.plan.regions[key].input_activation)
        self.key = key
        self.first_seq = step.seq
        self.wanted: dict[int, weakref.ref[RegionSlot]] = {}
        self.done = False
        self.recipe = recipe  # a selective region's (Note [Selective re-runs] in ops.py)
        self.trace_start = -1  # where its call's entries begin in the step's trace, while it runs
        self.traced = False  # its call's trace was the profile's: the replay may run (Note [Call traces])
        self.sources: dict[int, Any] = {}  # save index in the call -> what the forward kept (KeptSave or tensor)

    def materialize(self) -> None:
        captured: list[torch.Tensor] = []
        mode: SelectiveRerun | None = None
        if self.recipe is not None:
            sources = {i: h.tensor if isinstance(h, KeptSave) else h.get() if isinstance(h, PackedNoise) else h
                       for i, h in self.sources.items()}
            if len(sources) == len(self.recipe.source_keys):
                verify = (self.step.verify or not self.traced) and self.recipe.replay is not None
                if not verify and self._replay(sources):
                    return
                mode = SelectiveRerun(self.recipe, sources, verify)
        last_wanted = max(self.wanted, default=-1)
        stops = [0]  # stops raised: one the module swallowed leaves the re-run returning normally
        saved_all = [False]  # every dropped save is in: the rest of the forward is not needed
        thread = threading.get_ident()

        def capture(t: torch.Tensor) -> None:
            if mode is None:
                captured.append(t.detach())
                if len(captured) > last_wanted:
                    saved_all[0] = True  # stopped at the next module boundary (SelectiveRerun.saved_all)
                return
            mode.paused = True  # detach is an operator: not the module's
            captured.append(t.detach())
            mode.paused = False
            if len(captured) > last_wanted:
                mode.saved_all(captured[-1])

        def boundary(*_: Any) -> None:
            """A module call begins or ends inside a whole re-run: the operator that made the last
            dropped save has run (an operator calls no module)."""
            if saved_all[0] and threading.get_ident() == thread:
                stops[0] += 1
                raise StopRerun()

        whole = self.step.region_seconds
        try:
            with _at_module_boundaries(boundary) if mode is None else contextlib.nullcontext():
                self.run(self.args, self.kwargs, capture, mode, None if mode is not None else whole)
            if stops[0] > 0:  # caught inside the forward (a bare except): what ran after may differ
                self.step.stale = True
        except StopRerun:
            pass
        except RerunMismatch:  # another code path than the profile's: re-run whole
            self.step.stale = True
            captured.clear()
            mode = None
            self.step.session._stats["selective_fallbacks_total"] += 1
            try:
                with _at_module_boundaries(boundary):
                    self.run(self.args, self.kwargs, capture, None, whole)
            except StopRerun:
                pass
        if mode is not None and mode.stale:
            self.step.stale = True
        self.sources = {}
        self.done = True
        for index, ref in self.wanted.items():
            slot = ref()
            if slot is None:
                continue
            if index >= len(captured):
                from .session import OffloadError

                raise OffloadError(f"re-running {type(self.module).__name__} saved fewer tensors than the "
                                   "first run: its forward is not deterministic in what it saves")
            slot.fill(captured[index])
            self.step.session._stats["recomputed_tensors_total"] += 1
        self.wanted = {}
        self.release()  # the inputs are no longer needed: let them go with their last use
        self.args, self.kwargs, self.versions = (), {}, []


    def _replay(self, sources: dict[int, torch.Tensor]) -> bool:
        """Refills the dropped saves by replaying the recipe's operators alone (Note [Operator
        replay] in ops.py); False when it cannot (no replay, inputs viewed otherwise)."""
        recipe = self.recipe
        assert recipe is not None
        inputs = tensor_leaves(self.args)
        if recipe.replay is None or [geometry(t) for t in inputs] != recipe.input_geometry:
            return False
        self.check_inputs()
        module = self.module

        def attr(name: str) -> torch.Tensor:
            return module.get_parameter(name[2:]) if name[0] == "p" else module.get_buffer(name[2:])

        step = self.step
        self.note_inputs(inputs)
        t0 = step.now()
        try:
            # (no random operator to replay: the generators' states do not matter, and setting
            # them costs two copies of each state)
            with self.buffers.as_found(step, self), \
                    rng.replayed(self.cpu_rng, self.cuda_rng) if recipe.random else contextlib.nullcontext(), \
                    autocast_as(AUTOCAST_OFF):  # operators recorded below autocast, cast already
                filled = run_replay(recipe, sources, inputs, attr)
        finally:
            seconds = step.now() - t0
            st = step.session._stats
            st["replays_total"] += 1
            st["recompute_seconds_total"] += seconds
            step.selective_seconds[self.key] = step.selective_seconds.get(self.key, 0.0) + seconds
        if filled is None:  # a save the replay cannot make: the selective re-run from now on
            recipe.replay = None
            return False
        for index, ref in self.wanted.items():
            slot = ref()
            if slot is not None:
                slot.fill(filled[index])
                step.session._stats["recomputed_tensors_total"] += 1
        self.wanted = {}
        self.sources = {}
        self.done = True
        self.release()
        self.args, self.kwargs, self.versions = (), {}, []
        return True


class RegionSlot(_Counted):
    """A save dropped inside a region."""

    __slots__ = ("region", "tensor", "signature", "original")

    def __init__(self, region: Region, index: int, t: torch.Tensor) -> None:
        super().__init__(region.step.bytes)
        self.region: Region | None = region
        self.tensor: torch.Tensor | None = None
        self.signature = (tuple(t.shape), t.dtype)
        # with the session's check on, the save as it was and where it is recomputed (check.py)
        check = region.step.check
        self.original = (check.original(t), region, region.first_seq + index) if check is not None else None
        region.wanted[index] = weakref.ref(self)

    def fill(self, t: torch.Tensor) -> None:
        if (tuple(t.shape), t.dtype) != self.signature:
            from .session import OffloadError

            raise OffloadError(f"re-running {type(self.region.module).__name__ if self.region else '?'} "
                               f"gave a {tuple(t.shape)} tensor where {self.signature[0]} was saved")
        self.tensor = t
        self.count(t)
        if self.original is not None:
            (original, region, seq), self.original = self.original, None
            region.step.compare(original, t, "region", region, seq)

    def get(self) -> torch.Tensor:
        if self.tensor is None:
            region, self.region = self.region, None
            assert region is not None and not region.done
            region.materialize()
        self.region = None
        assert self.tensor is not None
        return self.tensor


class ProductSlot(_Counted):
    """A dropout product's save, dropped (Note [Dropout products] in dropout.py): holds the
    product's node and its operand's, whose saves the refill reads in backward."""

    __slots__ = ("step", "nodes", "geometry", "tensor", "original", "seq")

    def __init__(self, step: "PlannedStep", product: Any, source: Any, t: torch.Tensor, seq: int) -> None:
        super().__init__(step.bytes)
        self.step: PlannedStep | None = step
        self.nodes: tuple[Any, Any] | None = (product, source)
        self.geometry = view_of(t)
        self.tensor: torch.Tensor | None = None
        check = step.check
        self.original = check.original(t) if check is not None else None
        self.seq = seq

    def get(self) -> torch.Tensor:
        if self.tensor is None:
            step, nodes = self.step, self.nodes
            assert step is not None and nodes is not None
            self.step = self.nodes = None
            t0 = step.now()
            with autocast_as(AUTOCAST_OFF):  # (planned only for a product made without autocast)
                self.tensor = dropout.product_refill(nodes[0], nodes[1], self.geometry)
            seconds = step.now() - t0
            self.count(self.tensor)
            st = step.session._stats
            st["dropout_refills_total"] += 1
            st["recomputed_tensors_total"] += 1
            st["recompute_seconds_total"] += seconds
            step.product_seconds += seconds
            if self.original is not None:
                original, self.original = self.original, None
                step.compare(original, self.tensor, "product", None, self.seq, module=type(nodes[1]).__name__)
        return self.tensor


class _Link:
    """An argument of an output call made by another planned output call: regenerated through it
    instead of being held."""

    __slots__ = ("record", "requires_grad")

    def __init__(self, record: "Output", requires_grad: bool) -> None:
        self.record = record
        self.requires_grad = requires_grad


def _substitute(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` (arguments: tuples, lists, dicts) with every leaf ``x`` replaced by ``fn(x)``."""
    if isinstance(obj, tuple):
        return tuple(_substitute(y, fn) for y in obj)
    if isinstance(obj, list):
        return [_substitute(y, fn) for y in obj]
    if isinstance(obj, dict):
        return {k: _substitute(v, fn) for k, v in obj.items()}
    return fn(obj)


class Output(_Rerun):
    """A planned output call: its output's saves are dropped and regenerated on use."""

    def __init__(self, step: "PlannedStep", key: tuple[int, int], module: torch.nn.Module, args: tuple,
                 kwargs: dict, links: dict[int, _Link], refill_geometry: Geometry | None = None,
                 received: list[torch.Tensor] | None = None) -> None:
        """``received``: the tensors in ``args`` and ``kwargs`` (found when not given)."""
        def link(x: Any) -> Any:
            return links.get(id(x), x) if isinstance(x, torch.Tensor) else x

        self.pending = 0  # dropped saves of the output not yet used
        self.linkers = 0  # later output calls that regenerate their input through this one
        self.cache: torch.Tensor | None = None
        self.key = key
        self.out_key: StorageKey | None = None
        self.out_ref: weakref.ref[torch.Tensor] | None = None
        # the RNG devices from the tensors received, not from the placeholders (rng.py)
        if received is None:
            received = tensor_leaves((args, kwargs))
        # (copies of the containers: a list the program changes after the call is not the re-run's)
        super().__init__(step, module, _substitute(args, link), _substitute(kwargs, link), received,
                         [t for t in received if id(t) not in links] if links else received)
        self.links = list(links.values())
        for lk in self.links:
            lk.record.linkers += 1
        # a call refilled from what its forward saved (a batch norm's statistics, a dropout's
        # noise: refills.py): its input's profiled geometry; the refill, taken when it returns
        self.refill_geometry = refill_geometry if not self.autocast else None
        self.refiller: tuple[str, refills.Refill] | None = None
        self.owned = False  # the last regenerate() refilled: a new tensor, or one written over
        self.inside: list[OutputSlot] | None = []  # saves of the output made before the call returned

    def returned(self, output: Any) -> None:
        """The call returned ``output``. Saves made inside the call that the plan drops (a
        ReLU saves its result) are let go if they are the output's storage, else kept; a call to
        refill takes what it saved (a batch norm's statistics, a dropout's noise)."""
        inside, self.inside = self.inside or [], None
        key = storage_key(output) if isinstance(output, torch.Tensor) else None
        for slot in inside:
            slot.confirm(key)
        if key is None:
            return
        self.out_key = key
        self.out_ref = weakref.ref(output)
        if self.refill_geometry is not None:
            self.refiller = self.step.peek(lambda: refills.refiller(self.module, output))

    def regenerate(self) -> torch.Tensor:
        """The output again, bit for bit (inputs made by linked calls regenerated first)."""
        owned = False  # an input regenerated for this use alone, by a refill: no one else holds it

        def resolve(x: Any) -> Any:
            nonlocal owned
            if isinstance(x, _Link):
                t = x.record.output()
                owned = x.record.pending <= 0 and x.record.owned  # (output() did not cache it)
                return t.detach().requires_grad_(True) if x.requires_grad else t
            return x

        args, kwargs = self.args, self.kwargs
        if self.links:
            args, kwargs = _substitute(args, resolve), _substitute(kwargs, resolve)
        out = self._refill(args, kwargs, owned and len(self.links) == 1)
        self.owned = out is not None
        if out is None:
            out = self.run(args, kwargs, None)
        if not isinstance(out, torch.Tensor):
            from .session import OffloadError

            raise OffloadError(f"re-running {type(self.module).__name__} did not return a tensor")
        return out.detach()

    def _refill(self, args: tuple, kwargs: dict, owned: bool) -> torch.Tensor | None:
        """The output from what the call saved (refills.py), or None: not a refill, or its input
        is not laid out as in the profiled step (where the refill was checked exact). ``owned``:
        no one else holds the input (an activation's refill writes over it)."""
        refiller = self.refiller
        inputs = tensor_leaves((args, kwargs))
        if refiller is None or len(inputs) != 1 or geometry(inputs[0]) != self.refill_geometry:
            return None
        for t, v in self.versions:
            if t._version != v:
                return None  # run() says why it cannot re-run
        self.note_inputs(inputs)
        t0 = self.step.now()
        kind, refill = refiller
        with autocast_as(AUTOCAST_OFF):  # (taken only for a call that ran without autocast)
            out = refill(inputs[0], owned)
        if out is None:  # what it reads is gone (refills.Refill): re-run
            return None
        seconds = self.step.now() - t0
        st = self.step.session._stats
        st[f"{kind}_refills_total"] += 1
        st["recompute_seconds_total"] += seconds
        self.step.refill_seconds[self.key] = self.step.refill_seconds.get(self.key, 0.0) + seconds
        return out

    def output(self) -> torch.Tensor:
        """The output for a later call's re-run: cached while dropped saves of it are pending
        (they will want it too), else regenerated for this use only."""
        if self.pending <= 0:
            return self.regenerate()
        if self.cache is None:
            self.cache = self.regenerate()
            self.step.session._stats["recomputed_tensors_total"] += 1
        return self.cache

    def finish(self) -> None:
        """No dropped save needs the output any more: let go of the inputs (and the linked
        calls', when no other output call needs them). Called too when a later call that
        regenerated its input through this one is done with it: while dropped saves of the
        output are pending, the cached output stays (they will want it; dropping it re-ran the
        call once more for them)."""
        if self.pending > 0:
            return
        self.cache = None
        if self.linkers > 0:
            return
        self.refiller = None
        self.release()
        self.args, self.kwargs, self.versions = (), {}, []
        links, self.links = self.links, []
        for lk in links:
            lk.record.linkers -= 1
            lk.record.finish()


class OutputSlot(_Counted):
    """A save of a planned output call's output (or a view of it), dropped. A save made inside
    the call, before it returned, holds its tensor (uncounted: the call's output is alive
    anyway) until the call returns and it is found to be the output's storage."""

    __slots__ = ("record", "tensor", "geometry", "original")

    def __init__(self, record: Output, t: torch.Tensor, seq: int = -1) -> None:
        """``seq``: the save's place in the step (for the check's reports)."""
        super().__init__(record.step.bytes)
        self.record: Output | None = record
        self.tensor: torch.Tensor | None = None
        self.geometry = view_of(t)
        check = record.step.check  # the save as it was, to compare (Note [Recompute check] in check.py)
        self.original = (check.original(t), seq) if check is not None else None
        record.pending += 1
        if record.inside is not None:
            self.tensor = t.detach()
            record.inside.append(self)

    def confirm(self, out_key: StorageKey | None) -> None:
        """The call returned (its output's storage: ``out_key``): drop the tensor if it is the
        output's, else keep it as a kept save would be."""
        record, t = self.record, self.tensor
        assert record is not None and t is not None
        if out_key is not None and storage_key(t) == out_key:
            self.tensor = None
            return
        self.record = None
        record.pending -= 1
        self.count(t)
        record.step._diverge()

    def get(self) -> torch.Tensor:
        record = self.record
        if self.tensor is None and record is not None:
            self.record = None
            self.tensor = as_view(record.output(), self.geometry)
            self.count(self.tensor)
            if self.original is not None:
                (original, seq), self.original = self.original, None
                record.step.compare(original, self.tensor, "output", record, seq)
            record.pending -= 1
            if record.pending <= 0:
                record.finish()
        assert self.tensor is not None
        return self.tensor


class PlannedStep:
    """One step run under a plan: the saved-tensor hooks and the module hooks."""

    def __init__(self, session: Any, plan: Plan, cuda: bool) -> None:
        self.session = session
        self.plan = plan
        self.cuda = cuda
        self.bytes = SavedBytes()
        self.seq = 0
        self.recomputing = 0
        self.diverged = False
        self.dropped = 0
        self.dropped_bytes = 0
        self.rerun_seconds: dict[tuple[int, int], float] = {}  # planned call key -> re-run time
        self.refill_seconds: dict[tuple[int, int], float] = {}  # the same, refills (refills.py)
        self.selective_seconds: dict[tuple[int, int], float] = {}  # the same, selective regions
        self.region_seconds: dict[tuple[int, int], float] = {}  # the same, whole regions (to their last dropped save)
        self.product_seconds = 0.0  # dropout products refilled (Note [Dropout products] in dropout.py)
        # the clock those times are read on, wherever backward runs them (on CUDA, autograd's
        # thread for the device): the device's while the plan search reads them, else thread
        # time (Note [Device time] in clock.py)
        self.now: Callable[[], float] = clock.reader(None)
        self.verify = False  # re-run selective regions through the module's code, checking the replays
        # planned calls found with an input written in place after they returned (check_inputs)
        self.written_after: set[tuple[int, int]] = set()
        self.traces_changed: set[tuple[int, int]] = set()  # selective regions whose trace was not the plan's
        # copies of buffers as planned calls found them, by (buffer, version) (BufferState)
        self.buffer_copies: dict[tuple[int, int], torch.Tensor] = {}
        # whether saved bytes are counted (SavedBytes): every step while the plan search runs, one
        # in COUNT_EVERY (session.py) once it settled; an uncounted step hands autograd the
        # tensors it keeps as they are, which is most of what a pack costs, and counts neither
        # the inputs its re-runs hold nor what they refill (install())
        self.counted = True
        self.check: RecomputeCheck | None = session._check  # Note [Recompute check] in check.py
        self.stale = False  # a replay's operators or arguments were not the module's: profile again
        # the selective regions' calls, traced by the session's CallTrace (Note [Call traces] in guard.py)
        self.trace: list[tuple[Any, ...]] | None = [] if plan.recipes else None
        # the session's trace mode, on the mode stack only while a selective region's call runs
        # (None under `pyalloc run --offload`, whose recording mode traces)
        self._mode = session._trace if session._mode_stack is None else None
        # whom the mode asks where to write when it is not on the stack for this step (the
        # session: its profiles trace through the same mode)
        self._asked = self._mode.entries if self._mode is not None else None
        self._traced_open = 0  # selective region calls running now
        self._height = 0  # the torch-function mode stack's height when the step began
        self._in_hook = False  # the module hooks' own torch calls are not the module's
        self._peeking = False  # a refill looking at what its call saved: a dropped save is not refilled for it
        self._ordinals: dict[int, int] = {}
        self._stack: contextlib.ExitStack | None = None  # install()'s: it takes the module hooks off
        self._hooked: set[int] = set()  # the modules hooked (ids)
        self._open: list[tuple[torch.nn.Module, Region | Output | None]] = []
        self._regions: list[Region] = []
        self._outputs: dict[tuple[int, int], Output] = {}
        # storage -> (the output, the call that made it, the output's version when it returned)
        self._made: dict[StorageKey, tuple[weakref.ref[torch.Tensor], Output, int]] = {}
        self._handed: list[weakref.ref[_Counted]] = []  # what pack gave autograd, for abandon()
        self._thread = threading.get_ident()  # module hooks fire on every thread: only this one's

    def buffer_owners(self, module: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
        """Every (module, buffer name) in ``module``'s tree, found once a plan (Note [Buffers a
        re-run reads])."""
        owners = self.plan.buffer_owners.get(id(module))
        if owners is None:
            owners = self.plan.buffer_owners[id(module)] = tree_buffers(module)
        return owners

    def compare(self, original: Original, got: torch.Tensor, kind: str, rerun: "_Rerun | None", seq: int,
                module: str = "") -> None:
        """Debug mode: a regenerated save (the ``seq``-th of the step) against the one dropped
        (Note [Recompute check] in check.py); a report names the re-run call, the CUDA
        generators it replayed, how many of its inputs were regenerated through other calls, and
        its inputs' layouts as received and as re-run. With no re-run (a dropout product, refilled
        from its nodes' saves) ``module`` names the operand's node, and there are no generators,
        links or inputs to report."""
        assert self.check is not None
        call, linked = 0, 0
        generators: list[int] = []
        received: list[dict[str, Any]] = []
        rerun_got: list[dict[str, Any]] | None = []
        if rerun is not None:
            module, call = type(rerun.module).__name__, rerun.key[1]
            generators = [d for d, _ in rerun.cuda_rng]
            linked = len(rerun.links) if isinstance(rerun, Output) else 0
            received, rerun_got = rerun.input_layouts or [], rerun.rerun_layouts
        self.check.compare(original, got, step=int(self.session._stats["steps_total"]), kind=kind,
                           module=module, call=call, save=seq, cuda_generators=generators, linked_inputs=linked,
                           input_layouts=received, rerun_input_layouts=rerun_got,
                           inputs_alike=rerun_got is not None and recompute_check.alike(received, rerun_got))

    def close(self) -> None:
        """At the step's end: forgets the records, so that no reference cycle (record -> step ->
        record) leaves them, and the tensors they hold, to the cyclic garbage collector."""
        self._open.clear()
        self._regions.clear()
        self._outputs.clear()
        self._made.clear()
        self.buffer_copies.clear()
        self._handed.clear()
        still_open, self._traced_open = self._traced_open, 0
        if still_open and self._mode is not None:  # a region's call that never returned
            self._trace_off()
        if self.trace is not None:
            self.trace.clear()

    def abandon(self) -> None:
        """The step was cut short by an exception: every handle pack gave autograd lets go of
        what it holds (Note [Abandoned steps] in session.py); the session closes the step after."""
        for ref in self._handed:
            h = ref()
            if h is not None:
                h.abandon()

    def install(self, stack: contextlib.ExitStack) -> None:
        """Puts the hooks in place for the step; ``stack`` takes them off."""
        self.bytes.on = self.counted
        self._stack = stack
        self._hook_modules()
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack))
        # where the trace goes around a selective region's call: above the session's modes,
        # under the program's (guard.push_at)
        self._height = torch._C._len_torch_function_stack()

    def _hook_modules(self) -> list[torch.nn.Module]:
        """Hooks the plan's modules not hooked yet; returns those it hooked."""
        assert self._stack is not None
        hooked = []
        for ref in self.plan.modules:
            m = ref()
            if m is None or id(m) in self._hooked:
                continue
            self._hooked.add(id(m))
            hooked.append(m)
            # first among the module's own hooks, as the profile's global hooks are: a trace
            # spans what the profiled call's did (Note [Call traces] in guard.py)
            self._stack.callback(m.register_forward_pre_hook(StepHook(self._pre, True), with_kwargs=True,
                                                             prepend=True).remove)
            self._stack.callback(m.register_forward_hook(StepHook(self._post, False), always_call=True,
                                                         prepend=True).remove)
        return hooked

    def retarget(self, plan: Plan, module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
        """Runs the step under ``plan`` instead, from the call of ``module`` (the step's first root
        call, whose pre-hooks run now) on; only before anything was saved or entered (Note
        [Plans per shape] in session.py). Whether it did."""
        if self.seq > 0 or self._open or self._ordinals:
            return False
        self.plan = plan
        self.trace = [] if plan.recipes else None
        if module in self._hook_modules():  # hooked too late for this call: its pre-hook by hand
            self._pre(module, args, kwargs)
        return True

    def tracing(self) -> bool:
        """Whether the session's CallTrace writes to :attr:`trace` now: a selective region's
        call runs with grad on, not the step's own hooks or a re-run; the profile writes its
        trace under the same conditions (Profile.tracing)."""
        return self._traced_open > 0 and self._entries() is not None

    def _entries(self) -> list[tuple[Any, ...]] | None:
        """Where the trace mode writes a call while a selective region's call is open:
        :meth:`tracing`'s conditions but the open call. The mode asks this directly for each of
        the region's torch calls, not through the session (two Python calls less each: ~0.7 ms
        of a GPT-like step's forward, measured)."""
        if self._in_hook or self.recomputing or not _grad_enabled() or _thread_id() != self._thread:
            return None
        return self.trace

    def _trace_on(self) -> None:
        """A selective region's call begins (``_traced_open`` counts it): the trace mode goes in
        where the session's modes end (guard.push_at) and, from the first such call open, asks
        this step where to write."""
        assert self._mode is not None
        guard.push_at(self._mode, self._height)
        if self._traced_open == 1:
            self._mode.entries = self._entries

    def _trace_off(self) -> None:
        """A selective region's call ended (returned, raised, or the step closed with it open;
        ``_traced_open`` no longer counts it): the mode comes off the stack and, once no such
        call is open, asks the session again (its profiles trace through the same mode)."""
        assert self._mode is not None
        guard.remove(self._mode)
        if self._traced_open == 0:
            self._mode.entries = self._asked

    # -- module hooks ----------------------------------------------------------------------

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.recomputing or not torch.is_grad_enabled() or torch.compiler.is_compiling() \
                or threading.get_ident() != self._thread or in_backward():
            return
        in_hook, self._in_hook = self._in_hook, True
        try:
            self._enter(module, args, kwargs)
        finally:
            self._in_hook = in_hook

    def _enter(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ordinal = self._ordinals.get(id(module), 0)
        self._ordinals[id(module)] = ordinal + 1
        key = (id(module), ordinal)
        record: Region | Output | None = None
        if not self.diverged:
            if key in self.plan.regions:
                recipe = self.plan.recipes.get(key)
                record = Region(self, key, module, args, kwargs, recipe[0] if recipe is not None else None)
                self._regions.append(record)
                if recipe is not None and self.trace is not None:
                    record.trace_start = len(self.trace)
                    self._traced_open += 1
                    if self._mode is not None:
                        self._trace_on()
            elif key in self.plan.outputs:
                received = tensor_leaves((args, kwargs))
                links = self._links(received)
                info = self.plan.outputs[key]
                geometry = info.input_geometry[0] if info.refill_seconds >= 0 and info.input_geometry else None
                record = Output(self, key, module, args, kwargs, links, geometry, received)
                self._outputs[key] = record
        self._open.append((module, record))

    def _links(self, tensors: list[torch.Tensor]) -> dict[int, _Link]:
        """Arguments made by planned output calls of this step: keyed by ``id``."""
        links = {}
        for t in tensors:
            entry = self._made.get(storage_key(t))
            # not when it was written in place since (``out += identity``): a re-run would give
            # it as it was before (Note [Changed since made] in plan.py)
            if entry is not None and entry[0]() is t and t._version == entry[2]:
                links[id(t)] = _Link(entry[1], t.requires_grad)
        return links

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.recomputing or not self._open or torch.compiler.is_compiling() \
                or threading.get_ident() != self._thread or self._open[-1][0] is not module or in_backward():
            return
        in_hook, self._in_hook = self._in_hook, True
        try:
            self._leave(output)
        finally:
            self._in_hook = in_hook

    def _leave(self, output: Any) -> None:
        _, record = self._open.pop()
        if isinstance(record, Region):
            self._regions.pop()
            if record.trace_start >= 0 and self.trace is not None:
                self._traced_open -= 1
                if self._mode is not None:
                    self._trace_off()
                entries = self.trace
                record.traced = same_trace(entries[record.trace_start:], self.plan.traces.get(record.key))
                if not record.traced:
                    self.stale = True  # refilled through the module's code this step, profiled next
                    self.traces_changed.add(record.key)
                if self._traced_open == 0:
                    entries.clear()
        elif isinstance(record, Output):
            record.returned(output)
            if isinstance(output, torch.Tensor):
                assert record.out_key is not None and record.out_ref is not None  # (returned() found them)
                self._made[record.out_key] = (record.out_ref, record, output._version)

    # -- saved-tensor hooks ----------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        if not self._traced_open:
            return self._pack(t)
        in_hook, self._in_hook = self._in_hook, True  # a custom Function's saves are packed
        try:  # outside any torch call: this hook's own calls are not the region's
            return self._pack(t)
        finally:
            self._in_hook = in_hook

    def _pack(self, t: torch.Tensor) -> Any:
        if self.session._inert or self.recomputing:
            return t
        seq = self.seq
        self.seq = seq + 1
        plan = self.plan
        action = KEEP
        if not self.diverged:  # (a torch.Size equals the tuple it holds; dtypes are singletons)
            if seq >= len(plan.actions) or (sig := plan.signatures[seq])[1] is not t.dtype or sig[0] != t.shape:
                self._diverge()
            else:
                action = plan.actions[seq]
        if action == KEEP:
            pass
        elif action == REGION:
            region = self._regions[-1] if self._regions else None
            if region is not None and region.key == plan.owners[seq]:
                self._count_drop(t)
                return self._hand(RegionSlot(region, seq - region.first_seq, t))
            self._diverge()
        elif action == OUTPUT:
            record = self._outputs.get(plan.owners[seq])  # type: ignore[arg-type]
            if record is not None and (record.inside is not None or record.out_ref is not None
                                       and record.out_ref() is not None and storage_key(t) == record.out_key):
                self._count_drop(t)
                return self._hand(OutputSlot(record, t, seq))
            self._diverge()
        elif action == PRODUCT:
            info = plan.products[seq]
            found = dropout.product_nodes(t)
            if found is not None and found[0] == info.path and type(found[2]).__name__ == info.source:
                self._count_drop(t)
                return self._hand(ProductSlot(self, found[1], found[2], t, seq))
            self._diverge()
        kept: Any
        packed = None
        if action == KEEP and not self.diverged and seq in plan.noise:  # Note [Packed noise] in dropout.py
            # on every step, counted or not: the plan holds this noise at its mask's bytes
            packed = dropout.pack_noise(t)
            if packed is None:  # not the two values the profile saw: the plan no longer holds
                self._diverge()
        if packed is not None:
            kept = self._hand(PackedNoise(self.bytes, *packed))
            self.session._stats["noise_packed_total"] += 1
        elif t.is_leaf:  # a parameter, an input; counted where the step made it (Note [Step-made leaves])
            made = self.counted and not self.diverged and seq in plan.leaves
            kept = self._hand(KeptSave(self.bytes, t)) if made else t
        elif self.counted:
            kept = self._hand(KeptSave(self.bytes, t)) if is_activation(t) else t
        else:  # a detached alias, as KeptSave holds: a node that saves its own output would
            kept = t.detach()  # otherwise keep itself alive through it (a cycle through C++)
        region = self._regions[-1] if self._regions else None
        if region is not None and region.recipe is not None and seq - region.first_seq in region.recipe.source_keys:
            region.sources[seq - region.first_seq] = kept  # the re-run takes it instead of computing it
        return kept

    def _hand(self, h: Any) -> Any:
        if isinstance(h, _Counted):
            self._handed.append(weakref.ref(h))
        return h

    def peek(self, look: Callable[[], Any]) -> Any:
        """``look()``, reading saves of the step's graph during forward (a refill taking the
        statistics or the noise its call saved), or None when one of them was dropped.

        A refill's call may run inside a region that drops what the call saved (a batch norm, a
        dropout inside a planned block, the block's output regenerated outside it): reading such
        a save refilled it at once, re-running the region in forward, which then held every save
        it had dropped, and a save the region made after it failed in backward (an
        AssertionError on every planned step: a review, 2026-11-28). Such a call is re-run
        instead of refilled."""
        peeking, self._peeking = self._peeking, True
        try:
            return look()
        except _DroppedSave:
            return None
        finally:
            self._peeking = peeking

    def unpack(self, h: Any) -> torch.Tensor:
        if not isinstance(h, _Counted):
            return h  # kept uncounted, or not an activation
        if h.abandoned:
            from .session import OffloadError  # session.py imports this module

            raise OffloadError(ABANDONED_MESSAGE)
        if isinstance(h, KeptSave):
            return h.tensor
        if isinstance(h, PackedNoise):
            # a look (a refill checking, when its call returns, that the call saved noise) sees
            # the mask, a leaf the step made as the noise is, and holds nothing: unpacking here
            # held a float copy until backward (refills.refiller)
            return h.mask if self._peeking else h.get()
        if isinstance(h, (RegionSlot, OutputSlot, ProductSlot)):
            if self._peeking:  # dropped: not refilled for a look (peek)
                raise _DroppedSave()
            return h.get()
        raise TypeError(f"pyalloc.offload: a save's handle of unknown kind {type(h).__name__}")

    def _count_drop(self, t: torch.Tensor) -> None:
        self.dropped += 1
        self.dropped_bytes += t.untyped_storage().nbytes()

    def _diverge(self) -> None:
        """The step no longer matches the profile: keep every save from here on."""
        self.diverged = True


class _DroppedSave(Exception):
    """A save read by :meth:`PlannedStep.peek` was dropped."""


class PlanChooser:
    """A step under one of the plans kept for several input shapes: a pre-forward hook on the
    roots of their profiles hands the step's first root call (the model's: its module and input
    shapes, as the key the plans are kept by, and the call) to ``choose``, which picks the plan
    for those inputs before anything is saved (Note [Plans per shape] in session.py)."""

    def __init__(self, roots: list[torch.nn.Module],
                 choose: Callable[[tuple[Any, ...], torch.nn.Module, tuple, dict], None]) -> None:
        self._roots = roots
        self._choose = choose
        self.done = False
        self._thread = threading.get_ident()

    def install(self, stack: contextlib.ExitStack) -> None:
        """Last: its hook is the first each root runs (the planned step's own come after)."""
        for m in self._roots:
            hook = m.register_forward_pre_hook(StepHook(self._pre, True), with_kwargs=True, prepend=True)
            stack.callback(hook.remove)

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self.done or not torch.is_grad_enabled() or torch.compiler.is_compiling() \
                or threading.get_ident() != self._thread or in_backward():
            return
        self.done = True
        self._choose((id(module), *call_signature(args, kwargs)), module, args, kwargs)


class IdleStep:
    """A step under a plan that drops nothing, once a counted step stayed well under the budget:
    no saved-tensor hook at all (nothing is recorded per operator or per save), only a
    pre-forward hook on the step's outermost modules that compares their inputs' shapes and
    dtypes with the profile's. Another shape (a new batch size) makes the step ``diverged``: the
    next step is profiled again. See Note [Idle steps] in plan.py."""

    def __init__(self, roots: "list[CallInfo]") -> None:
        self.diverged = False
        self._roots: dict[int, tuple[weakref.ref[torch.nn.Module], list[Any]]] = {}
        for call in roots:
            m = call.module()
            if m is not None:
                self._roots.setdefault(id(m), (call.module, []))[1].append(call.signatures)
        self._ordinals: dict[int, int] = {}
        self._thread = threading.get_ident()

    def install(self, stack: contextlib.ExitStack) -> None:
        for ref, _ in self._roots.values():
            m = ref()
            if m is not None:
                stack.callback(m.register_forward_pre_hook(StepHook(self._pre, True), with_kwargs=True).remove)

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling() or threading.get_ident() != self._thread \
                or in_backward():
            return
        ordinal = self._ordinals.get(id(module), 0)
        self._ordinals[id(module)] = ordinal + 1
        expected = self._roots[id(module)][1]
        if ordinal >= len(expected) or expected[ordinal] != call_signature(args, kwargs):
            self.diverged = True

    def close(self) -> None:
        self._ordinals.clear()
