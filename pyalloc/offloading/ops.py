"""Selective re-runs: the aten operators of a profiled step, and a region re-run that computes
only what its dropped saves need (issue 20).

Note [Selective re-runs]
    Re-running a whole module to refill the saves dropped inside it (``torch.utils.checkpoint``'s
    way) runs its matrix products again, though many of the bytes a transformer block saves are
    made by cheap operators (layer norm, GELU, the attention's scaling, softmax and dropout
    product). A *selective* region keeps some of the saves made inside the module (typically the
    outputs of the expensive operators) and drops the rest; in backward, the first use of a
    dropped save refills them all, computing only the operators they need.

    The operators are recorded once, in the profiled step (:class:`OpRecorder`, a
    ``TorchDispatchMode`` that is on in that step only): storages read and written (told apart
    as the profile tells them: Profile._key), in-place writes, outputs' geometry, time, and the
    arguments. :meth:`CallOps.recipe` turns a module call and a set of dropped storages into a
    recipe: walking back from the dropped storages, the operators that write what is needed,
    through storages that are neither kept by a save of the call (a *source*: the region holds
    it until its re-run) nor made outside it (the call's inputs, parameters, buffers). Random
    operators are computed up to the last one a dropped save needs, with the RNG state
    restored first, so they draw what the forward drew; a random operator that is skipped is
    never followed by a computed one. The estimate (its operators' profiled time) orders the
    planner's candidates; the plan search measures the real re-runs.

    Two ways to run a recipe, both exact:

    - the replay (Note [Operator replay]), the default: the needed operators alone;
    - :class:`SelectiveRerun`, the module's forward run again under a ``TorchDispatchMode`` that
      goes operator by operator: COMPUTE what is needed (and every view), take a SOURCE's storage
      from the forward instead of computing it (each output of the operator that made it: a save,
      or faked; the operator is not run, so an argument it writes, a batch norm's running
      statistics, is not written twice), FAKE the rest (an uninitialised tensor of the
      same geometry, never read by a computed operator), SKIP in-place operators on sources or
      on what nothing needs; it stops (an exception the region catches) once the last dropped
      save is captured. Every operator costs a trip through Python (~20 us on CPU), so this is
      the fallback (a recipe with no replay) and the check of replays (below). If the module's
      operators are not the recipe's, the region re-runs whole and the next step is profiled.

Note [Operator replay]
    The replay calls the recipe's operators directly (``func(*args)``, under ``no_grad``: only
    values are needed), with the arguments recorded in the profiled step: constants as they
    were, tensors found again by storage and viewed with the recorded geometry: a storage an
    earlier replayed operator made, a source (a save the region kept), the call's input at the
    same position (its geometry must be the profiled one, else the region falls back to the
    dispatch re-run), or a parameter or buffer of the module (found by storage when the recipe is
    made, by name when it runs). Module buffers an operator is given are put back afterwards
    (batch norm writes its running statistics with no write in its schema). No module code and
    no dispatch mode run: a GPT block's selective re-run costs about its operators' time.

    What the replay cannot see is a constant that changes from step to step while the shapes
    stay (a scalar annealed in Python, an ``eps`` set between steps): the saves still match the
    plan. Every step, the region's call is compared with the profiled one at the level of its
    top-level torch calls (Note [Call traces] in guard.py); a difference has the region refilled
    through :class:`SelectiveRerun` with ``verify`` and the next step profiled again. The first
    planned step of a search and every ``REPLAY_CHECK_EVERY`` (session.py) re-run selective
    regions that way regardless, comparing each computed operator's live arguments with the
    replay's (what a trace cannot see: state a torch function reads itself); a difference is
    exact in that step (it computed from the live arguments) and has the next step profiled
    again (``replays_stale_total``).

    An operator may leave an output out under ``no_grad`` that it makes with grad on: the CPU
    LSTM layer (``mkldnn_rnn_layer``) returns no workspace, which autograd saves and a region
    drops (Note [Step-made leaves] in plan.py). The replay then finds a dropped save missing,
    and the region's recipe refills through :class:`SelectiveRerun` (grad on, under the module's
    own forward) from then on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import clock

if TYPE_CHECKING:
    from .plan import ProfileKey

__all__ = ["COMPUTE", "FAKE", "SKIP", "SOURCE", "OpInfo", "OpRecorder", "Recipe", "RerunMismatch",
           "SelectiveRerun", "StopRerun", "CallOps", "View", "as_view", "geometry", "view_of"]

COMPUTE, SOURCE, FAKE, SKIP = 0, 1, 2, 3

REPLAY_SECONDS = 15e-6
"""Estimated cost of one replayed operator beyond its own compute (its arguments viewed again,
the call from Python)."""

DISPATCH_SECONDS = 20e-6
"""Estimated cost of one operator of a selective re-run beyond its own compute: the module's
Python around it and the trip through a Python ``TorchDispatchMode`` (measured on CPU: a GPT
block's forward of 76 operators takes 1.5 ms longer under a mode that only passes each
operator on). Re-runs are measured by the plan search afterwards; this orders candidates
before that."""

Geometry = tuple[tuple[int, ...], tuple[int, ...], int, torch.dtype, torch.device]


@dataclass
class TensorArg:
    """A tensor argument of a recorded operator: its storage and geometry."""

    key: "ProfileKey"
    geometry: "Geometry"


@dataclass
class OpInfo:
    """One aten operator of the profiled step's forward."""

    func: Any  # torch._ops.OpOverload
    reads: tuple["ProfileKey", ...]  # storages of its tensor arguments
    writes: tuple["ProfileKey", ...]  # storages it made (outputs that are no view) or mutated
    outputs: list[tuple["ProfileKey", Geometry] | None]  # per output leaf; None: not a tensor
    mutated: list[int]  # positions (in the flattened arguments) of the arguments it writes
    view: bool  # outputs alias inputs and nothing is written: metadata only
    random: bool
    seconds: float = 0.0
    spec: Any = None  # the pytree spec of (args, kwargs)
    leaves: list[Any] = field(default_factory=list)  # per leaf: a constant, or a TensorArg

    @property
    def opaque(self) -> bool:
        """It returns something other than tensors (a number, a bool): never faked."""
        return any(o is None for o in self.outputs)


def _same_storage(a: Any, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _written(argument: Any) -> bool:
    """Whether an operator's schema says it writes this argument (``Tensor(a!)``)."""
    return argument.alias_info is not None and argument.alias_info.is_write


def written_arguments(schema: Any) -> list[Any]:
    """The arguments an operator's schema says it writes."""
    return [a for a in schema.arguments if _written(a)]


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes, among its arguments."""
    out = []
    for idx, a in enumerate(func._schema.arguments):
        if not _written(a):
            continue
        value = args[idx] if idx < len(args) and not a.kwarg_only else kwargs.get(a.name)
        out += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)]
    return out


def _mutated_positions(func: Any, args: tuple, kwargs: dict) -> list[int]:
    """Positions, among the flattened ``(args, kwargs)`` leaves, of the tensors ``func`` writes."""
    written = {id(t) for t in _written_tensors(func, args, kwargs)}
    if not written:
        return []
    leaves, _ = tree_flatten((args, kwargs))
    return [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and id(x) in written]


def geometry(t: torch.Tensor) -> Geometry:
    """``t``'s view: shape, strides, storage offset, dtype, device."""
    return (tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype, t.device)


View = tuple[tuple[int, ...], tuple[int, ...], int]
"""A tensor's view of its storage: shape, strides, storage offset (elements)."""


def view_of(t: torch.Tensor) -> View:
    return (tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))


def as_view(base: torch.Tensor, view: View) -> torch.Tensor:
    """A dropped save taken again from ``base``, the tensor it viewed (regenerated): ``base``
    itself where it is laid out as the save was, else that view of its storage."""
    return base if view_of(base) == view else base.as_strided(*view)


class OpRecorder(TorchDispatchMode):
    """Records the aten operators run while ``active()`` says so (the profiled step's forward,
    inside a module call), keyed by ``key`` (Profile._key)."""

    def __init__(self, key: Callable[[torch.Tensor], "ProfileKey"], active: Callable[[], bool],
                 unrecorded: Callable[[], None] = lambda: None,
                 private_generator: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self._key = key
        self._active = active
        self._unrecorded = unrecorded  # told of each operator not recorded (it may be a module's, with grad off)
        # told of each recorded operator that draws from a generator it was given: a re-run would
        # draw again from where that generator stands then (Note [State a re-run reads] in plan.py)
        self._private_generator = private_generator
        self.ops: list[OpInfo] = []
        # the storages the recorded operators made (outputs that are none of their inputs): a
        # leaf save among them is an activation (Note [Step-made leaves] in plan.py)
        self.made: set[ProfileKey] = set()
        self.overhead_s = 0.0  # this mode's own time, not the model's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if not self._active():
            self._unrecorded()
            return func(*args, **kwargs)
        t0 = clock.now()
        leaves, spec = tree_flatten((args, kwargs))
        if any(isinstance(x, torch.Generator) for x in leaves):
            self._private_generator()
        recorded = [TensorArg(self._key(x), geometry(x)) if isinstance(x, torch.Tensor) else x for x in leaves]
        reads = tuple(x.key for x in recorded if isinstance(x, TensorArg))
        mutated = _mutated_positions(func, args, kwargs)
        t1 = clock.now()
        out = func(*args, **kwargs)
        t2 = clock.now()
        outs, _ = tree_flatten(out)
        if mutated and torch.Tag.inplace_view in func.tags \
                and all(isinstance(o, torch.Tensor) and self._key(o) in reads for o in outs):
            # ``unsqueeze_``, ``transpose_``, ``t_``: the schema writes the tensor, but only its
            # shape and strides change, not its storage or data. A view, then: a re-run runs it
            # (skipped, the module's code saw the tensor as it was: a shape error in backward, or
            # with square dimensions silently wrong gradients: a review, 2026-11-28) and a replay
            # leaves it out (what reads the tensor after it is given the recorded geometry)
            mutated = []
        writes = [recorded[i].key for i in mutated]  # mutated positions hold tensors
        outputs: list[tuple[ProfileKey, Geometry] | None] = []
        view = not mutated
        for o in outs:
            if not isinstance(o, torch.Tensor):
                outputs.append(None)
                continue
            k = self._key(o)
            outputs.append((k, geometry(o)))
            if k not in reads:
                view = False
                writes.append(k)
                self.made.add(k)
        if not outs:
            view = False
        self.ops.append(OpInfo(func, reads, tuple(dict.fromkeys(writes)), outputs, mutated,
                               view and all(o is not None for o in outputs),
                               torch.Tag.nondeterministic_seeded in func.tags, t2 - t1, spec, recorded))
        self.overhead_s += (t1 - t0) + (clock.now() - t2)
        return out


@dataclass
class Recipe:
    """How to re-run one module call selectively (Note [Selective re-runs])."""

    funcs: list[Any]  # the call's operators in order, to check the re-run against
    actions: list[int]  # per operator: COMPUTE, SOURCE, FAKE or SKIP
    geometry: list[list[Geometry | None]]  # per operator: its outputs' geometry (SOURCE, FAKE)
    mutated: list[list[int]]  # per operator: flattened argument positions it writes (SKIP)
    # operator -> per output, the save (index in the call) whose storage it made, or None (an
    # output no computed operator reads: faked)
    sources: dict[int, list[int | None]] = field(default_factory=dict)
    seconds: float = 0.0  # estimated re-run time
    op_seconds: float = 0.0  # of which the computed operators' own
    replay: "list[ReplayStep] | None" = None  # the computed operators alone (Note [Operator replay])
    drops: dict[int, tuple["ProfileKey", Geometry]] = field(default_factory=dict)  # dropped save -> storage, geometry
    source_keys: dict[int, "ProfileKey"] = field(default_factory=dict)  # saves (index in the call) the region holds until its re-run -> their storage
    input_geometry: list[Geometry] = field(default_factory=list)  # the call's tensor inputs, as profiled
    replay_index: dict[int, int] = field(default_factory=dict)  # operator -> its replay step
    transient: int = 0  # bytes the re-run makes: dropped saves and temporaries
    random: bool = True  # the replay computes a random operator (it runs with the forward's RNG state)


class _Ref:
    """A tensor argument of a replayed operator: ``kind`` "s" (a storage the replay made, or a
    source), "i" (the call's input at ``where``), "a" (the module's parameter or buffer named
    ``where``), and the geometry to view it with."""

    __slots__ = ("kind", "where", "geometry")

    def __init__(self, kind: str, where: Any, geometry: Geometry) -> None:
        self.kind, self.where, self.geometry = kind, where, geometry


@dataclass
class ReplayStep:
    """One operator of a replay: the function, its arguments (constants and _Refs), the storage
    each output makes, and the module buffers it writes (put back afterwards)."""

    func: Any
    spec: Any
    leaves: list[Any]
    outputs: list["ProfileKey | None"]
    restore: list[int]
    refs: list[tuple[int, "_Ref"]] = field(default_factory=list)  # the leaves that are tensors, by place
    # the call without unflattening the leaves, where every tensor is an argument of its own (not
    # in a list): the arguments and keywords with the constants in place, and the tensors' places
    # in each; None: unflatten the leaves
    flat: "_FlatCall | None" = None
    call: Any = None  # the operator's function itself (an OpOverload's _op: one Python frame less)

    def __post_init__(self) -> None:
        self.refs = [(i, x) for i, x in enumerate(self.leaves) if isinstance(x, _Ref)]
        self.call = getattr(self.func, "_op", self.func)
        args, kwargs = tree_unflatten(list(self.leaves), self.spec)
        flat = _FlatCall(list(args), dict(kwargs), [(i, x) for i, x in enumerate(args) if isinstance(x, _Ref)],
                         [(k, x) for k, x in kwargs.items() if isinstance(x, _Ref)])
        if len(flat.positions) + len(flat.keywords) == len(self.refs):
            self.flat = flat


@dataclass
class _FlatCall:
    """A replay step's arguments as a call takes them, tensors to be put in (ReplayStep.flat)."""

    args: list[Any]
    kwargs: dict[str, Any]
    positions: list[tuple[int, _Ref]]
    keywords: list[tuple[str, _Ref]]


class StopRerun(BaseException):
    """Raised inside a re-run once every dropped save is captured. A BaseException, as
    GeneratorExit is: a module whose forward falls back on ``except Exception`` must not catch
    the stop and run its fallback, whose side effects (a flag it sets) would last into later
    steps (a second reader's probe: steps 2 and 3 no longer bit-identical)."""


class RerunMismatch(Exception):
    """The re-run's operators are not the recipe's: re-run the module whole instead."""


class CallOps:
    """The operators of one module call, with the tables every recipe for it shares."""

    def __init__(self, ops: list[OpInfo], saves: list["ProfileKey"], created: Callable[["ProfileKey"], bool],
                 inputs: dict["ProfileKey", int] | None = None,
                 attrs: dict[tuple[int, str], str] | None = None, save_geometry: list[Geometry] | None = None,
                 input_geometry: list[Geometry] | None = None) -> None:
        """``saves``: the storages the call's saves hold, in order (each at its final version,
        as autograd requires); ``created(k)``: whether the call made storage ``k`` (else it
        comes from outside: an input, a parameter); ``inputs``: the call's tensor inputs by
        storage; ``attrs``: the module's parameters and buffers by storage; ``save_geometry``
        and ``input_geometry``: as profiled (without them, no replay)."""
        self.ops = ops
        self.saves = saves
        self.inputs = inputs or {}  # the call's tensor inputs: storage -> position
        self.attrs = attrs or {}  # storages (address, device) of the module's parameters and buffers -> name
        self.save_geometry = save_geometry
        self.input_geometry = input_geometry or []
        self.writers: dict[ProfileKey, list[int]] = {}
        for j, op in enumerate(ops):
            for k in op.writes:
                self.writers.setdefault(k, []).append(j)
        self.created = {k for k in self.writers if created(k)}
        early_read = {k for j, op in enumerate(ops) for k in op.reads
                      if k in self.created and j < self.writers[k][-1] and j not in self.writers[k]}
        self.saved_at: dict[ProfileKey, int] = {}
        for i, k in enumerate(saves):
            self.saved_at.setdefault(k, i)
        # storages a re-run can take from the forward: made here, saved here, read only once final
        self.keepable = {k for k in self.created if k in self.saved_at and k not in early_read}

    def recipe(self, drops: set["ProfileKey"]) -> Recipe | None:
        """The recipe that regenerates ``drops`` (storages saved in the call), or None when it
        cannot (a dropped storage no operator made) or would save nothing over a whole re-run."""
        ops, n = self.ops, len(self.ops)
        if any(k not in self.created for k in drops):
            return None
        forced: set[ProfileKey] = set()  # storages random operators write: computed, not taken
        for _ in range(8):
            available = self.keepable - drops - forced
            # forced storages are computed: their random operators draw in the forward's order
            # (until 2026-11-28 they were only kept from being taken, and a dropout's noise
            # dropped after one left out came out of the generator at the wrong place)
            need = set(drops) | forced
            needed: set[int] = set()
            for j in range(n - 1, -1, -1):
                op = ops[j]
                if op.view:
                    continue
                if op.opaque or any(k in need for k in op.writes):
                    needed.add(j)
                    for k in op.reads:
                        if k in self.created and k not in available:
                            need.add(k)
                    for k in op.writes:  # every writer of a needed storage runs
                        if k in self.created and k not in available:
                            need.add(k)
            last_random = max((j for j in needed if ops[j].random), default=-1)
            more = {k for j in range(last_random) if ops[j].random and j not in needed for k in ops[j].writes}
            if not more - forced:
                break
            forced |= more
        else:
            return None
        used_sources = {k for j in needed for k in ops[j].reads if k in available}
        last = max(needed, default=-1)
        actions = [FAKE] * n
        sources: dict[int, list[int | None]] = {}
        op_seconds = 0.0
        transient = 0
        for j, op in enumerate(ops):
            if op.view or j in needed:
                actions[j] = COMPUTE
                if not op.view:
                    op_seconds += op.seconds
                    transient += sum(_nbytes(o[1]) for o in op.outputs if o is not None and o[0] in op.writes)
            else:
                # the sources it made first: an operator with several outputs is one (a layer norm
                # with its statistics: each output a save, or faked), and so is one that also
                # writes an argument (a batch norm's running statistics: not written again)
                used = [o[0] if o is not None and o[0] in used_sources else None for o in op.outputs]
                made = [k if k is not None and self.writers[k][0] == j else None for k in used]
                if any(k is not None for k in made):
                    actions[j] = SOURCE
                    sources[j] = [self.saved_at[k] if k is not None else None for k in made]
                elif op.mutated:
                    actions[j] = SKIP  # in place over a source, or over what nothing needs
                elif any(k is not None for k in used):
                    return None  # a source it made that an earlier operator wrote: not one to fake
        if all(a == COMPUTE for a in actions[:last + 1]):
            return None  # every operator up to the last dropped save runs: a whole re-run does that
        replay = self._replay(sorted(needed), available)
        dispatched = last + 1
        seconds = op_seconds + (len(replay) * REPLAY_SECONDS if replay is not None else dispatched * DISPATCH_SECONDS)
        drop_saves = {i: (k, self.save_geometry[i]) for i, k in enumerate(self.saves)
                      if k in drops and self.save_geometry is not None}
        source_keys = {i: self.saves[i] for made in sources.values() for i in made if i is not None}
        source_keys.update({self.saved_at[k]: k for k in used_sources})
        return Recipe([op.func for op in ops], actions, [[o[1] if o is not None else None for o in op.outputs]
                                                         for op in ops],
                      [op.mutated for op in ops], sources, seconds=seconds,
                      op_seconds=op_seconds, transient=transient, replay=replay, drops=drop_saves,
                      source_keys=source_keys, input_geometry=self.input_geometry,
                      replay_index={j: i for i, j in enumerate(sorted(needed))} if replay is not None else {},
                      random=any(ops[j].random for j in needed))

    def _replay(self, needed: list[int], available: set["ProfileKey"]) -> "list[ReplayStep] | None":
        """The needed operators as replay steps, or None when one reads a tensor the replay
        cannot find again (neither made here, a source, an input of the call, nor a parameter
        or buffer of the module) or writes one it must not (a source, an input)."""
        if self.save_geometry is None:
            return None
        steps = []
        for j in needed:
            op = self.ops[j]
            if op.spec is None:
                return None
            leaves: list[Any] = []
            restore = []
            for pos, x in enumerate(op.leaves):
                if not isinstance(x, TensorArg):
                    leaves.append(x)
                    continue
                written = pos in op.mutated
                if x.key in self.created:
                    if x.key in available and written:
                        return None
                    leaves.append(_Ref("s", x.key, x.geometry))
                elif x.key in self.inputs and not written:
                    leaves.append(_Ref("i", self.inputs[x.key], x.geometry))
                else:  # a parameter or buffer (or a view of one, weight.t()): found by its storage,
                    # which lives as long as the module does
                    name = self.attrs.get((x.key[0], x.key[1]))
                    if name is None:
                        return None
                    leaves.append(_Ref("a", name, x.geometry))
                    if written or name.startswith("b:"):  # batch norm writes its running
                        restore.append(pos)  # statistics with no write in its schema
            steps.append(ReplayStep(op.func, op.spec, leaves,
                                    [o[0] if o is not None and o[0] in op.writes else None for o in op.outputs],
                                    restore))
        return steps


def _nbytes(g: Geometry) -> int:
    shape, stride, _, dtype, _ = g
    span = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
    return span * dtype.itemsize


def put_back(t: torch.Tensor, before: torch.Tensor) -> None:
    """Writes ``before`` back into ``t`` (a buffer a re-run or replay wrote: a batch norm's running
    statistics) with ``t``'s version counter as it is: a write back is no change of the buffer, and
    another planned call reading it would take a bumped version for one (Note [Buffers a re-run
    reads] in regions.py)."""
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t):
        t.copy_(before)


def run_replay(recipe: Recipe, sources: dict[int, torch.Tensor], inputs: list[torch.Tensor],
               attr: Callable[[str], torch.Tensor]) -> dict[int, torch.Tensor] | None:
    """Runs a recipe's replay (Note [Operator replay]); returns the dropped saves by index, or
    None when an operator left one of them out."""
    assert recipe.replay is not None
    # a storage, by the key of what made it, and the tensor it came as (a source, an output)
    tensors: dict[ProfileKey, torch.Tensor] = {}
    for i, t in sources.items():
        tensors[recipe.source_keys[i]] = t
    attrs: dict[str, torch.Tensor] = {}

    def resolve(x: _Ref) -> torch.Tensor:
        if x.kind == "s":
            t = tensors[x.where]
        elif x.kind == "i":
            t = inputs[x.where]
        elif (held := attrs.get(x.where)) is not None:
            t = held
        else:
            t = attrs[x.where] = attr(x.where)
        return _as(t, x.geometry)

    with torch.no_grad():
        for step in recipe.replay:
            saved: Any = ()
            flat = step.flat
            if flat is not None and not step.restore:
                args = flat.args.copy()
                for i, ref in flat.positions:
                    args[i] = resolve(ref)
                kwargs = flat.kwargs
                if flat.keywords:
                    kwargs = kwargs.copy()
                    for k, ref in flat.keywords:
                        kwargs[k] = resolve(ref)
                out = step.call(*args, **kwargs)
            else:
                leaves = list(step.leaves)
                for place, ref in step.refs:
                    leaves[place] = resolve(ref)
                saved = [(leaves[p], leaves[p].clone()) for p in step.restore]
                args, kwargs = tree_unflatten(leaves, step.spec)
                out = step.call(*args, **kwargs)
            for t, before in saved:
                put_back(t, before)
            if isinstance(out, torch.Tensor):
                outs: Any = (out,)
            elif type(out) is tuple and all(isinstance(o, torch.Tensor) for o in out):
                outs = out
            else:
                outs = tree_flatten(out)[0]
            for key, o in zip(step.outputs, outs):
                if key is not None and isinstance(o, torch.Tensor):
                    tensors[key] = o
        if any(key not in tensors for key, _ in recipe.drops.values()):
            return None  # an operator that left an output out with grad off (Note [Operator replay])
        return {i: _as(tensors[key], g) for i, (key, g) in recipe.drops.items()}


def _as(t: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """``t``'s storage viewed with ``geometry``: ``t`` itself when it is already that view (the
    usual case: an operator's output read by the next one), which saves making a tensor."""
    shape, stride, offset, dtype, _ = geometry
    if t.dtype is not dtype:
        return _view(t.untyped_storage(), geometry)
    if t.storage_offset() == offset and t.shape == shape and t.stride() == stride:
        return t
    return t.as_strided(shape, stride, offset)


def _same_arguments(step: ReplayStep, args: tuple, kwargs: dict) -> bool:
    """Whether an operator's live arguments are the ones its replay step would pass: the same
    constants, tensors of the same geometry."""
    leaves, _ = tree_flatten((args, kwargs))
    if len(leaves) != len(step.leaves):
        return False
    for live, recorded in zip(leaves, step.leaves):
        if isinstance(recorded, _Ref):
            if not isinstance(live, torch.Tensor) or geometry(live)[:4] != recorded.geometry[:4]:
                return False
        elif isinstance(live, torch.Tensor) or type(live) is not type(recorded) or live != recorded:
            return False
    return True


def _fake(geometry: Geometry) -> torch.Tensor:
    """An uninitialised tensor of ``geometry``: an output no computed operator reads."""
    shape, stride, _, dtype, device = geometry
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _view(storage: Any, geometry: Geometry) -> torch.Tensor:
    shape, stride, offset, dtype, device = geometry
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)


class SelectiveRerun(TorchDispatchMode):
    """Runs a module's forward again along a :class:`Recipe`; Note [Selective re-runs].
    ``sources``: save index in the call -> the tensor the forward saved."""

    def __init__(self, recipe: Recipe, sources: dict[int, torch.Tensor], verify: bool = False) -> None:
        super().__init__()
        self.recipe = recipe
        self.sources = sources
        self.verify = verify  # compare the computed operators' arguments with the replay's
        self.stale = False  # they differed: the replay would not compute what the module does
        self.index = 0
        self.done = False  # every dropped save is in: the next operator stops the re-run
        self.last: torch.Tensor | None = None  # the last dropped save, while its operator may fill it
        self.paused = False  # while the capture hook runs its own operators

    def saved_all(self, last: torch.Tensor) -> None:
        """Every dropped save is in, ``last`` the last: the next operator stops the re-run, but
        for one that writes ``last``. Autograd saves an operator's inputs before it runs the
        operator, and one may write them: RReLU's noise is an empty tensor its operator fills;
        stopped there, the refill handed back the empty one (gradients of 1e30 and NaN, a review,
        2026-11-29). That one runs, and the one after it stops."""
        self.done, self.last = True, last

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if self.done:
            last, self.last = self.last, None
            if last is None or not any(_same_storage(t, last) for t in _written_tensors(func, args, kwargs)):
                raise StopRerun()
        r = self.recipe
        j = self.index
        if j >= len(r.funcs) or r.funcs[j] is not func:
            raise RerunMismatch(f"operator {j} is {func}, the profile's was "
                                f"{r.funcs[j] if j < len(r.funcs) else 'none'}")
        self.index = j + 1
        action = r.actions[j]
        if action == COMPUTE:
            if self.verify and j in r.replay_index and r.replay is not None \
                    and not _same_arguments(r.replay[r.replay_index[j]], args, kwargs):
                self.stale = True
            return func(*args, **kwargs)
        if action == SKIP:
            leaves, _ = tree_flatten((args, kwargs))
            written = [leaves[i] for i in r.mutated[j]]
            return written[0] if len(written) == 1 else tuple(written)
        geometry = r.geometry[j]
        if action == SOURCE:  # the saves the forward kept; an output nothing computed reads, faked
            flat = [_view(self.sources[i].untyped_storage(), g) if i is not None else _fake(g)  # type: ignore[arg-type]
                    for i, g in zip(r.sources[j], geometry)]
        else:
            flat = [_fake(g) for g in geometry]  # type: ignore[arg-type]
        # the structure of the real result: one tensor, or a tuple/list of them
        schema_returns = func._schema.returns
        if len(schema_returns) == 1 and str(schema_returns[0].type) == "Tensor":
            return flat[0]
        if len(schema_returns) == 1:  # Tensor[]
            return flat
        return tuple(flat)
