"""A plan learned from one profiled step: which saved activations to keep, and which to drop and
recompute by re-running a module (issue 20).

Note [Planned recompute]
    Per-operator DTR records every torch call of every step in Python, which costs more than the
    recompute it enables. A training step repeats itself, so the session profiles one step
    (:class:`Profile`: every module call, its forward time, the tensors it takes and returns,
    and every tensor autograd saves, with the module calls open when it was saved), plans once
    (:func:`make_plan`), and afterwards only module hooks on the planned modules and one
    saved-tensor hook run. Two ways to free a saved tensor, both exact (RNG state replayed,
    module buffers such as batch-norm statistics put back after the re-run):

    - a *region*: a module call whose saves are all dropped but for its inputs, which the
      session keeps; the first use of a dropped save in backward re-runs the module on those
      inputs and captures what autograd saves, in order (what ``torch.utils.checkpoint`` does,
      chosen per call instead of by hand). The re-run stops at the last dropped save (the
      capture raises, as checkpoint's own recompute does): what the forward computes after it,
      such as a block's last linear layer, dropout and residual sum, is not needed. The planner
      costs a region at its forward time up to that save (its share of the profiled call), then
      at the measured re-run's;
    - an *output*: a module call whose output is saved by later calls (a GELU's output saved by
      the next linear layer), or by the call itself before it returned (a ReLU saves its
      result: the step holds that save until the call returns its storage); the session keeps
      the module's inputs (held anyway when something saves them, or regenerated the same way
      through the module that made them, up to ``MAX_CHAIN`` deep) and re-runs the module when
      the output is needed. A training-mode batch norm on the way is refilled from its saved
      statistics instead of re-run (Note [Batch-norm refills] in batchnorm.py), a dropout from
      its saved noise (Note [Dropout refills] in dropout.py), an elementwise activation by its
      functional form (Note [Activation refills] in activations.py).

    - a *dropout product*: a save that is a view of ``a * noise``, refilled from the softmax (or
      other) result ``a`` and the noise that autograd holds anyway (Note [Dropout products] in
      dropout.py): the attention matrix inside ``scaled_dot_product_attention``'s math path.

    - a *selective region*: a module call whose saves are partly kept, partly dropped; the
      dropped ones are refilled by replaying only the operators they need (Note [Selective
      re-runs] in ops.py): a transformer block's layer-norm, GELU, softmax and dropout outputs
      for a fraction of the block's re-run.

    - a *pack*: a kept CPU dropout noise held as a boolean mask and its scale, a quarter of its
      bytes, for a pack in forward and an unpack a reader in backward (Note [Packed noise] in
      dropout.py): no re-run, weighed at what the profiled step measured those to cost.

    Candidates are taken greedily: each round the cheapest move that brings the estimated peak
    under the target, else the move with the most bytes freed per second of re-runs (a region
    may replace chosen candidates inside it; an output whose kept input another candidate drops
    switches to regenerating that input). Each start is run twice, the second time taking only
    the densest moves (the one move that closes the gap is often a whole region where a few
    cheap pieces, such as dropout products, do for less). The greedy also starts from "every
    call of one repeated module type as a region" (what a user checkpoints by hand) and the
    cheapest plan that fits wins. A plan that fits then tries its dearest moves let go, each
    gap closed with cheaper candidates (the last densest move can be a whole layer where a few
    small pieces would do). The estimated peak is the larger of what is held at the end of forward and,
    for each re-run in backward, what was saved before the call (backward has freed the later
    saves by then) plus what the re-run saves. The floor is the estimate with every candidate
    the greedy can take. A call re-run for several candidates counts once (its output is cached
    while dropped saves still need it).

    The estimate is only an estimate: :class:`PlanSearch` measures planned steps and moves the
    target until the measured peak lands just under the budget, with measured re-run times
    replacing the profiled ones, then settles. Saves are identified across steps by their order
    in the step and checked by shape and dtype: a step that differs from the profile keeps what
    it saves from there on and has the next step profiled again.

Note [State a re-run reads]
    A re-run calls a module's forward again, later, on the same inputs; it sees the module as it
    is then. Parameters do not change inside a step, and the RNG states of the default generators
    are replayed (Note [Generator states] in rng.py), but a forward that changes other state reads
    it changed: an exponential moving average kept in a buffer and subtracted from the
    activations, a call counter in a Python attribute, a torch.Generator of the module's own that
    draws a mask. Its re-run computes other values than the first run, and the gradients come
    out wrong with no error (a review's three models, 2026-11-28: up to 6e-3 apart). The profiled
    step compares each call's module before and after it (:func:`module_state`: buffers'
    versions, plain attributes, private generators' states; a training batch norm's statistics
    excepted, which its forward does not read and a re-run puts back), looks for an operator
    inside the call whose schema writes one of its tree's buffers (a version does not always
    move: quantization-aware training's fused observer writes its min and max with none), and
    notes an operator given a generator of its own (the operator recorder); such a call, and
    every call around it, is never re-run (``CallInfo.mutates_state``), and DTR does not
    recompute a call given a generator, nor an operator that writes an argument. What is not seen: state kept outside the module (a global, another object's
    attribute) or in a container attribute; ``check=True`` compares re-runs with what they
    replace (Note [Recompute check] in check.py). A buffer that starts to change after the
    profiled step is put back for the re-run (Note [Buffers a re-run reads] in regions.py).

Note [State built on the first call]
    Much state changes once: a rotary embedding's cos/sin table built on the first call (and
    again for a longer sequence), a lazy module's parameters, a flag set on first use. The
    profiled step is a first call, and took every call around such a module for one that
    changes state in every step: never re-run, the floor up by those calls' saves (a review's
    Hugging-Face-style decoder: 2.3 MB against 1.15 MB with the table built before, the budget
    at a quarter out of reach). So a profile that saw a state change, after a profile that saw
    none (or first), is not planned from: the next step is profiled again, and its profile is
    the one planned from, whatever it sees (a module that changes its state every step keeps
    changing it there, and stays out of every plan). One profiled step more for such models.

Note [Inputs written after the call]
    A re-run needs the call's inputs as they were. A call that writes one (an in-place ReLU) is
    never re-run (``CallInfo.mutates_input``), and neither is one whose input the program writes
    in place after the call returned (``y = block(h); h.mul_(0.5)``: valid autograd when nothing
    saved ``h`` itself): the profile notes each returned call's inputs and their versions and
    looks again when backward first unpacks a save (the forward is over; the inputs are still
    alive while their saves are) and when it stops. An input that no save keeps alive may die
    unseen; a planned step whose re-run then finds its input changed raises OffloadError (that
    step's dropped values are gone), and the session profiles the next step again with that
    call (by module and ordinal) left out.

Note [Buffers written after the call]
    A buffer that one module reads and another writes later in the step (a scale every block
    registers and the last block updates; a table shared through ``register_buffer``) is, for
    each reader, written after its call: the module-state check (Note [State a re-run reads])
    sees only a call's own writes. The profile notes, as each call returns, the buffers of its
    module tree and their versions, and compares them when it stops. A buffer so written that a
    planned step's re-run can read as it was (a copy made when the call begins, up to
    ``SNAPSHOT_MAX_BYTES``: Note [Buffers a re-run reads] in regions.py) goes into the plan as
    expected to change, and the re-run swapping its copy in is no reason to profile again
    (each planned step did, every other step, when a shared 256-byte buffer changed); a larger
    one keeps the call from being re-run (every planned step raised OffloadError, naming it,
    and the next did the same).

Note [Step-made leaves]
    Autograd saves tensors without history too: a dropout's mask, a layer norm's mean and
    reciprocal deviation, the CPU LSTM's workspace (cuDNN's reserve space on a GPU), a fused
    attention's log-sum-exp, ``x * 0.5`` of an input that needs no grad. They are leaves (no
    grad_fn), as the parameters and the input batch are, but the step made them and backward
    frees them: they are activation memory. Until 2026-11-28 every leaf was left out
    (``is_activation`` said no): the budget did not see them, and a region kept them while
    ``torch.utils.checkpoint`` frees them. On the offload benchmark's models (CPU, batch 16) that
    was 62.7 MiB of LSTM workspaces and 4.1 MiB of masks beside the 13.1 MiB counted, 30.1 MiB
    beside the BERT-like encoder's 78.5 and 6.1 beside the GPT-like decoder's 49.0.

    Now a leaf without grad whose storage an operator of the step made is an activation: the
    profiled step's operator recorder notes the storages that each operator it records makes
    (``OpRecorder.made``: outputs that are none of its inputs), a save is noted as such a leaf
    (``PackInfo.leaf``), and it counts and is dropped like any other save. A planned step sees
    only the tensor, so the plan says which saves of the step those are (``Plan.leaves``, by
    place in the step). A parameter, a buffer, the input batch, a view of any of them or a
    tensor made before the step is none of these, nor is one that outlives the step: a table a
    module builds on its first call and keeps (rotary tables, a cached causal mask) is made in
    the profiled step, the first, and kept; at the step's end the profile takes back every such
    leaf whose storage is still alive (``Profile.drop_kept_leaves``). Not seen: a leaf made with grad off, or
    outside every module call (the recorder records neither), which stays out of the count as
    before. :class:`MadeInStep` notes the same storages for a step counted without a session
    (the benchmark's columns, the tests).

Note [Idle steps]
    A budget that the profiled step never reached gives a plan that drops nothing. A planned step
    would still count every save (a saved-tensor hook call each) to check the budget; an idle
    step instead installs no saved-tensor hook at all, only a pre-forward hook on the outermost
    modules the profile saw, which compares their inputs' shapes and dtypes with the profile's
    (one hook call a step; keyword arguments too, which the profile reads when the call returns:
    a global pre-hook is not given them). Steps run idle once the search has settled on the empty
    plan and the last counted step held at most the budget less ``BUDGET_SLACK``, or once it
    settled below the floor on the empty plan (no plan that drops held less: a model with nothing
    a re-run frees); every ``IDLE_CHECK_EVERY`` steps (session.py) one step is counted again.
    Another input shape ends idling: the next step is profiled again, as a planned step that
    diverges would have it; a counted step over the budget + 5% does the same, above the floor.
    The step that changed shape runs unplanned, as a diverging planned step keeps every save from
    where it differs.

Note [Moves that cannot help]
    The greedy tries tens of candidates a round and takes one, and a deep model has hundreds of
    candidates and rounds. Trying each by taking its move, estimating and taking it back made a
    plan's time grow towards the cube of the depth: on a GPT-like decoder at half its saved
    bytes, a session's first plan took 7.8 s at 24 layers and 38.5 s at 48, now 1.8 and 6.9 s
    (docs/benchmarks/2026-11-29-planner-time-cpu.md). A try now costs little but where it is
    needed:

    - what rules a candidate out is a chosen candidate, and depends on the two alone: it rules
      the candidate out while it stays chosen, and the next tries end at one lookup;
    - the chosen candidates a move meets come from indexes by call and by storage
      (:meth:`_Planner._overlapping`, ``_by_key``), not from a walk of every chosen one;
    - a move's effect is computed without making it (:meth:`_Planner._change`): the held bytes
      of the storages it touches, as running sums in the order of their saves;
    - in a round that must lower the estimate, a move is dropped as soon as one term of its
      estimate reaches the current one: a re-run it adds that alone saves as much, the end of
      forward, a chosen re-run at the peak that the move keeps with nothing saved before it made
      smaller, or a re-run it adds. Only the rest are estimated whole.

    What a try found (the move, its effect, the chosen re-run at the peak it left as it was) is
    kept per candidate until what it was read from changes: the counts of a storage it touched
    (``_readers``), or a re-run chosen or let go around its call (``_at``, :meth:`_Planner._near`).
    tests/test_offload_plan_tries.py checks every try against a reference move, found by walking
    every chosen candidate and taken on a replica planner.

    The plans are those of the slower greedy but for ties: taking a move and taking it back left
    what it replaced at the end of the chosen list, where later sorts break ties; on the
    benchmark's four models and a 12-layer decoder at 90%, 50%, 25% and 0% of their saved bytes,
    37 plans of 40 are the same and 3 are others of the same estimate and re-run time.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import clock
from .dropout import exact_product_seconds, noise_pack_seconds
from .hooks import StepHook, in_backward
from .refills import MIN_ELEMENTS, exact_refill_seconds, kind as refill_kind
from .calls import CallTracker, autocast_state
from .guard import CallTrace, push_at, remove
from .ops import CallOps, OpInfo, OpRecorder, Recipe, geometry

__all__ = ["BUDGET_SLACK", "KEEP", "OUTPUT", "PRODUCT", "REGION", "CallInfo", "MadeInStep", "PackInfo",
           "Plan", "PlanSearch", "Profile", "is_activation", "make_plan", "storage_key", "tensor_leaves"]

MAX_CHAIN = 3
"""How many module calls back an output's recompute may go to regenerate its inputs."""

PRUNE = 0.5
"""The greedy does not try a candidate that looks less than this fraction as good (bytes per
second) as the best move found in the same round."""

SWAPS = 3
"""Chosen candidates, costliest first, that a fitting plan tries to replace by smaller ones
(:meth:`_Planner._swap`): each try is a greedy of its own."""

TRIES_PER_ROUND = 40
"""Candidates the greedy tries per round and search (closing, densest) once it has one that
works: a try costs O(storages), and deep models have hundreds of candidates that look alike."""

MAX_SELECTIVE_OPS = 160
"""Module calls with more aten operators than this get no selective variants: a block of a
transformer runs about 75. A whole model's variant would refill all its dropped saves at once in
backward (a high peak), and a chosen region can only be replaced by a larger one, so the greedy
that took it could not refine it."""

MAX_VARIANTS = 12
"""Selective variants per region: prefixes of its storages in order of bytes per second."""

KEEP, REGION, OUTPUT, PRODUCT, PACK = 0, 1, 2, 3, 4
"""What a plan does with a save; PACK is a candidate's kind only (a kept noise held as a mask)."""

StorageKey = tuple[int, str]
ProfileKey = tuple[int, str, int]  # storage_key and a generation: the address used again


VALUE_READS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__complex__",
                         "__index__", "__array__"})
"""Torch calls that hand a tensor's values to Python (Note [Values read in Python])."""


def reads_values(ops: list[OpInfo], trace: list[tuple[Any, ...]]) -> bool:
    """Whether a module call's code read tensor values into Python: an aten operator that returned
    something other than tensors (``aten._local_scalar_dense``, ``aten.equal``), or a torch call
    that hands values over (``tolist``, ``numpy``, ``bool(t)``, ``int(t)``).

    Note [Values read in Python]
        A replay (Note [Operator replay] in ops.py) gives its operators the constants of the
        profiled step, and a dispatch re-run fakes what nothing it computes reads. Neither holds
        for a value the module's code read from a tensor: an index given as a 0-dim tensor
        (``h[:, i]``, ``torch.roll(h, k)``: torch reads it with ``_local_scalar_dense``) sets
        the offset of the view that is saved, which the replay takes as profiled (gradients off
        by 1e-2 from the second step on, with nothing stale: a review, 2026-11-28), and a value
        read with ``tolist`` or ``numpy`` reaches no operator at all, so the dispatch re-run fakes
        the tensor it came from and the module computes on garbage. Such a call gets no selective
        variants: it is re-run whole, through its own code, or not at all."""
    if any(op.opaque for op in ops):
        return True
    return any(getattr(e[0], "__name__", None) in VALUE_READS for e in trace)


def signature(tensors: list[torch.Tensor]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """Shape and dtype of each tensor: what a step must match of a call the profile saw."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def call_signature(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """A module call's positional and keyword tensors' shapes and dtypes, as a profile's
    ``CallInfo.input_signature`` and ``kwargs_signature`` hold them."""
    return signature(tensor_leaves(args)), signature(tensor_leaves(kwargs)) if kwargs else ()


def storage_key(t: torch.Tensor) -> StorageKey:
    """A tensor's storage, for counting each saved storage once however many views save it."""
    return (t.untyped_storage().data_ptr(), str(t.device))


def is_activation(t: torch.Tensor, made: "Container[StorageKey] | None" = None) -> bool:
    """A tensor the step made: one with history (not a parameter, a leaf or a view of one), or a
    leaf without grad whose storage is in ``made``, the storages the step's operators made (Note
    [Step-made leaves]). Only these count against the budget: the rest exists anyway."""
    if t.is_leaf:  # parameters are leaves: tested first, isinstance(t, Parameter) costs more
        return made is not None and not t.requires_grad and storage_key(t) in made
    base = t._base
    return not (base is not None and base.is_leaf)


class MadeInStep(TorchDispatchMode):
    """Notes the storages that operators make with grad on while it is entered (outputs that are
    none of their inputs): ``is_activation(t, mode.made)`` then counts a leaf save the step made
    (Note [Step-made leaves]). For counting a step without a session (the offload benchmark's
    columns, the tests); a profiled step reads its operator recorder's instead."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[StorageKey] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            inputs = {storage_key(x) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor) and (k := storage_key(o)) not in inputs:
                    self.made.add(k)
        return out


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors in a module call's arguments or result (tuples, lists and dicts, one level deep
    is what modules pass; deeper ones are walked too)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
    return out


@dataclass
class CallInfo:
    """One module call of the profiled step."""

    index: int
    module: "weakref.ref[torch.nn.Module]"
    ordinal: int  # how many calls of the same module came before it in the step
    parent: int
    name: str
    first_pack: int  # pack sequence numbers saved while the call was open: [first_pack, end_pack)
    end_pack: int = -1
    first_op: int = 0  # aten operators run while the call was open: [first_op, end_op)
    end_op: int = 0
    first_trace: int = 0  # entries of the profile's call trace made meanwhile: [first_trace, end_trace)
    end_trace: int = 0  # (Note [Call traces] in guard.py)
    last_desc: int = -1  # calls index..last_desc are this call and the calls it made
    seconds: float = 0.0
    start: float = 0.0  # the profile's clock when the call began and returned (PackInfo.at: when a
    end: float = 0.0  # save was made)
    region_seconds: float = -1.0  # a whole re-run as a region, measured (it stops after the last
    # dropped save: Note [Planned recompute]); -1: not measured yet
    input_keys: list[ProfileKey] = field(default_factory=list)
    input_activation: list[bool] = field(default_factory=list)
    input_nbytes: list[int] = field(default_factory=list)
    input_producers: list[int] = field(default_factory=list)  # call whose output it is, or -1
    input_signature: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()  # shape and dtype per input
    # the same of the tensors among its keyword arguments, which the profile sees only when the
    # call returns (an idle step compares both: Note [Idle steps])
    kwargs_signature: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()
    kwarg_keys: list[ProfileKey] = field(default_factory=list)  # their storages
    input_geometry: list[Any] = field(default_factory=list)  # shape, stride, offset, dtype, device per input
    mutates_input: bool = False
    # Changed state that a re-run would read changed (Note [State a re-run reads]): a buffer
    # (other than a training batch norm's statistics), a plain Python attribute, or a private
    # torch.Generator of the module or of a call inside it. Never re-run.
    mutates_state: bool = False
    compiled_inside: bool = False  # a torch.compile'd module ran inside it: no selective variant
    out_key: ProfileKey | None = None  # a single tensor output's storage
    out_nbytes: int = 0
    out_version: int = -1
    out_is_input: bool = False
    grad_off_ops: bool = False  # ran operators with grad off (not recorded): no selective variant
    varies: bool = False  # its trace changed in planned steps, time and again: no selective variant
    refill_seconds: float = -1.0  # refilled from what it saved (a batch norm's statistics, a
    # dropout's noise: refills.py): the refill's time; -1: re-run whole

    @property
    def key(self) -> tuple[int, int]:
        return (id(self.module()), self.ordinal)

    @property
    def rerun_seconds(self) -> float:
        """What regenerating the call's output costs: its refill, or its forward again."""
        return self.refill_seconds if self.refill_seconds >= 0 else self.seconds

    @property
    def signatures(self) -> tuple[Any, Any]:
        """Its positional and keyword tensors' shapes and dtypes, as :func:`call_signature` gives
        them for a call of the module in a later step."""
        return self.input_signature, self.kwargs_signature


@dataclass
class PackInfo:
    """One tensor autograd saved in the profiled step."""

    key: ProfileKey
    nbytes: int
    activation: bool
    inner: int  # innermost module call open when it was saved, or -1
    producer: int  # the module call whose output it is (a view of), or -1
    version: int
    signature: tuple[tuple[int, ...], torch.dtype]
    stride: tuple[int, ...] = ()
    offset: int = 0
    at: float = 0.0  # the profile's clock when it was saved
    product: "ProductInfo | None" = None  # a dropout product, refilled exact (Note [Dropout products])
    leaf: bool = False  # a leaf the step made (activation too: Note [Step-made leaves])
    packed: int = 0  # dropout noise a planned step may keep as a mask: the mask's bytes (Note [Packed noise])
    pack_seconds: float = 0.0  # what keeping it as a mask costs a step: a pack and an unpack, measured


@dataclass(frozen=True)
class ProductInfo:
    """A save that is a view of a dropout's product ``a * noise`` (Note [Dropout products] in
    dropout.py), found refilled bit for bit in the profiled step."""

    path: tuple[str, ...]  # the view nodes between the save and the product's node
    source: str  # the type of the node that saved ``a`` as its result
    seconds: float  # the refill's time
    source_key: ProfileKey  # ``a``'s storage, and its bytes
    source_nbytes: int


def _compiled(module: torch.nn.Module) -> bool:
    """Whether the module is torch.compile's wrapper. Asked of torch._dynamo only once something
    imported it (torch.compile does): importing it here would cost the first profiled step a
    second, and no compiled module exists without it."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def module_state(module: torch.nn.Module) -> tuple[Any, ...]:
    """What a re-run of ``module`` reads besides its inputs and parameters, as far as it can be
    seen cheaply (Note [State a re-run reads]): its buffers' versions (not a training batch norm's
    statistics, which its forward does not read, and which a re-run puts back: batchnorm.py), its
    plain Python attributes (numbers, strings, booleans, None) and its private generators'
    states. Only the module's own: a call inside it reports its own change, which marks this
    call too."""
    from torch.nn.modules.batchnorm import _BatchNorm

    skip_buffers = isinstance(module, _BatchNorm) and module.training
    versions = tuple((name, b._version) for name, b in module._buffers.items()
                     if b is not None and not skip_buffers)
    plain = tuple((k, v) for k, v in module.__dict__.items()
                  if k != "training" and (v is None or isinstance(v, (bool, int, float, str))))
    generators = tuple((k, v.get_state()) for k, v in module.__dict__.items() if isinstance(v, torch.Generator))
    return versions, plain, generators


def same_state(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    versions, plain, generators = before
    return versions == after[0] and plain == after[1] and len(generators) == len(after[2]) and \
        all(k == k2 and torch.equal(s, s2) for (k, s), (k2, s2) in zip(generators, after[2]))


def tree_buffers(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """Every (module, buffer name) of ``module``'s tree."""
    return [(m, name) for m in module.modules() for name in m._buffers]


def training_statistics(owner: torch.nn.Module, name: str) -> bool:
    """Whether buffer ``name`` of ``owner`` is a training batch norm's running statistics, which
    its forward writes and does not read (and a re-run puts back: batchnorm.py)."""
    return name in _BATCH_NORM_STATISTICS and owner.training and \
        isinstance(owner, torch.nn.modules.batchnorm._BatchNorm)


_BATCH_NORM_STATISTICS = frozenset({"running_mean", "running_var", "num_batches_tracked"})


def _kept(t: torch.Tensor) -> torch.Tensor:
    return t


class Profile:
    """Records one step: module calls (through global module hooks) and saves (fed by the
    session's pack hook). See Note [Planned recompute]."""

    def __init__(self, overhead: Callable[[], float] = lambda: 0.0,
                 peek: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
                 probe: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
                 written_after: "set[tuple[int, int]] | None" = None,
                 whole: "set[tuple[int, int]] | None" = None) -> None:
        """``written_after``: calls (by key) a planned step found with an input written after
        they returned, never re-run (Note [Inputs written after the call]); ``whole``: calls
        whose trace kept changing between steps, re-run whole only (Note [Call traces] in
        guard.py)."""
        self._overhead = overhead  # seconds the session spent on itself so far (DTR's recording)
        self._peek = peek  # while it is entered, reading saved tensors changes nothing in the session
        self._probe = probe  # the same, and reading one DTR evicted raises instead of regenerating it
        self.calls: list[CallInfo] = []
        self.packs: list[PackInfo] = []
        # call, start, inputs, their versions, the module's own state (module_state)
        self._open: list[tuple[CallInfo, float, list[torch.Tensor], list[int], tuple[Any, ...]]] = []
        self._ordinals: dict[int, int] = {}
        self._outputs: dict[ProfileKey, tuple[int, "weakref.ref[torch.Tensor]"]] = {}
        self._seen: dict[StorageKey, tuple[int, "weakref.ref[torch.UntypedStorage]"]] = {}
        self._handles: list[Any] = []
        self.paused = False  # while the session replays (DTR): not part of the step
        self.busy = False  # while the session's own hooks run (their operators are not the model's)
        self._thread = threading.get_ident()
        # the aten operators of the forward, inside module calls (Note [Selective re-runs])
        self.recorder = OpRecorder(self._key, self._recording, self._unrecorded, self._private_generator)
        self.ops = self.recorder.ops
        # the top-level torch calls of the forward, inside module calls (Note [Call traces]):
        # written by the session's CallTrace while this profile records
        self.trace: list[tuple[Any, ...]] = []
        self._suspended: torch.nn.Module | None = None  # a compiled module running without the recorder
        self._recorder_suspended = False  # the recorder was on the dispatch stack when it began
        self._modes_suspended: list[tuple[int, Any]] = []  # the session's torch-function modes taken off: (height, mode)
        # leaf saves the step made: (pack sequence number, its storage), until drop_kept_leaves
        self._leaves: list[tuple[int, "weakref.ref[torch.UntypedStorage]"]] = []
        self._checks_s = 0.0  # time spent checking refills (not the model's)
        self._checking = 0  # inside such a check (its operators run with grad off, not the model's)
        # measured re-run times of selective regions: (call index, dropped storages) -> seconds
        self.selective_seconds: dict[tuple[int, frozenset[ProfileKey]], float] = {}
        # calls returned, with their inputs and those inputs' versions when they returned, until
        # inputs_written_after() looks at them (Note [Inputs written after the call])
        self._returned: list[tuple[CallInfo, list[tuple["weakref.ref[torch.Tensor]", int]]]] = []
        self.written_after = written_after if written_after is not None else set()
        self.whole = whole if whole is not None else set()
        self.state_changed = False  # a module changed state it reads (Note [State built on the first call])
        # calls returned, with the buffers their module trees read and those buffers' versions
        # when they returned, until stop() looks at them (Note [Buffers written after the call]);
        # every (module, buffer name) of a module's tree, by the module's id
        self._read_buffers: list[tuple[CallInfo, list[tuple[torch.nn.Module, str, torch.Tensor, int]]]] = []
        self._tree_buffers: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        # (id of the module, buffer name): buffers a call read that the step wrote after it returned
        self.written_buffers: set[tuple[int, str]] = set()

    def _recording(self) -> bool:
        return bool(self._open) and not self.paused and not self.busy and torch.is_grad_enabled() \
            and not torch.compiler.is_compiling() and threading.get_ident() == self._thread

    def tracing(self) -> bool:
        """Whether the session's CallTrace writes to :attr:`trace` now (Note [Call traces] in
        guard.py): as the operator recorder records."""
        return self._recording()

    def _unrecorded(self) -> None:
        """An operator ran unrecorded: inside the model's code with grad off (a custom autograd
        Function's forward, a statistic under no_grad), the open calls' operators are not all
        recorded, and a selective re-run of them would not match (Note [Selective re-runs])."""
        if self._open and not self.paused and not self.busy and not self._checking \
                and not torch.is_grad_enabled() and threading.get_ident() == self._thread:
            for call, *_ in self._open:
                call.grad_off_ops = True

    def _private_generator(self) -> None:
        """An operator inside the open calls drew from a generator given to it (Note [State a
        re-run reads]): none of them is re-run."""
        for call, *_ in self._open:
            call.mutates_state = True

    @contextlib.contextmanager
    def _own_check(self, reading: Callable[[], contextlib.AbstractContextManager[None]]) -> Iterator[None]:
        """Around a check of the profile's own (a refill, a dropout product): its time is not the
        model's (``_clock``), nor are its operators, run with grad off (``_unrecorded``); under
        no_grad, which DTR and the operator recorder skip, and ``reading`` (peek or probe)."""
        t0 = clock.now()
        self._checking += 1
        try:
            with reading(), torch.no_grad():
                yield
        finally:
            self._checking -= 1
            self._checks_s += clock.now() - t0

    def _clock(self) -> float:
        """The step's clock (Note [Device time] in clock.py) less the session's and the operator
        recording's own time."""
        return clock.now() - self._overhead() - self.recorder.overhead_s - self._checks_s

    def start(self) -> None:
        """Installs the global module hooks for one step."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._thread = threading.get_ident()  # global hooks fire on every thread: only this one's
        self._handles = [register_module_forward_pre_hook(StepHook(self._pre, True)),
                         register_module_forward_hook(StepHook(self._post, False), with_kwargs=True, always_call=True)]

    def stop(self) -> None:
        """Removes the hooks; closes calls left open by an exception."""
        if self._suspended is not None:
            self._resume()
        for h in self._handles:
            h.remove()
        self._handles = []
        while self._open:
            self._close(self._open[-1][0], None)
        self.inputs_written_after()
        self._buffers_written_after()
        self._seen.clear()  # the plan keeps the calls and saves, not these lookups
        self._outputs.clear()

    def inputs_written_after(self) -> None:
        """Marks the returned calls whose inputs were written in place since (Note [Inputs
        written after the call]); the session asks at backward's first unpack, the end of the
        forward, while the inputs are alive, and the profile again when it stops."""
        returned, self._returned = self._returned, []
        for call, inputs in returned:
            for ref, version in inputs:
                t = ref()
                if t is not None and t._version != version:
                    call.mutates_input = True
                    break
        if self._handles:  # (still recording: stop() asks again at the end)
            return
        # an input that died meanwhile: the operators recorded inside module calls say what
        # wrote it after its call returned
        written: dict[ProfileKey, int] = {}  # storage -> the last operator that wrote it
        for i, op in enumerate(self.ops):
            for k in op.writes:
                written[k] = i
        if written:
            for call in self.calls:
                if not call.mutates_input and any(written.get(k, -1) >= call.end_op
                                                  for k in (*call.input_keys, *call.kwarg_keys)):
                    call.mutates_input = True

    def _buffers_written_after(self) -> None:
        """Note [Buffers written after the call]: a buffer that a returned call's module tree
        reads, written later in the step, is noted as expected to change (a planned step's re-run
        swaps in the copy it made when the call began); one too large to copy keeps the call from
        being re-run."""
        from . import regions  # (it imports this module; its size limit is read when asked)

        read, self._read_buffers, self._tree_buffers = self._read_buffers, [], {}
        for call, entries in read:
            for owner, name, b, version in entries:
                if b._version == version:
                    continue
                if b.untyped_storage().nbytes() > regions.SNAPSHOT_MAX_BYTES:
                    call.mutates_state = True
                else:
                    self.written_buffers.add((id(owner), name))

    def _owners(self, module: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
        owners = self._tree_buffers.get(id(module))
        if owners is None:
            owners = self._tree_buffers[id(module)] = tree_buffers(module)
        return owners

    def _wrote_buffers(self, call: CallInfo, module: torch.nn.Module) -> bool:
        """Whether an operator inside the call wrote a buffer of its module tree: what the
        buffers' versions do not always say. ``torch.fused_moving_avg_obs_fake_quant`` (the
        observer and fake-quantizer of quantization-aware training) writes its running min, max,
        scale and zero point in place and bumps no version: its re-runs moved them again, and
        the gradients came out wrong, or a selective re-run crashed in it (a review, 2026-11-29).
        Note [State a re-run reads]."""
        written = {k for op in self.ops[call.first_op:] for k in op.writes}
        if not written:
            return False
        # (running statistics by name, whatever the class: a batch norm written through
        # ``_native_batch_norm_legit``, whose schema says it writes them, does not read them)
        return any(self._key(b) in written for owner, name in self._owners(module)
                   if (b := owner._buffers.get(name)) is not None
                   and not (owner.training and name in _BATCH_NORM_STATISTICS))

    def _note_read_buffers(self, call: CallInfo, module: torch.nn.Module) -> None:
        """Notes the buffers ``module``'s tree reads and their versions as its call returns."""
        entries = [(owner, name, b, b._version) for owner, name in self._owners(module)
                   if (b := owner._buffers.get(name)) is not None and not training_statistics(owner, name)]
        if entries:
            self._read_buffers.append((call, entries))

    def drop_kept_leaves(self) -> None:
        """After the step: a leaf it made whose storage outlived it (a table a module builds on its
        first call and keeps, which the profiled step, the first, made) is no activation of the
        steps to come (Note [Step-made leaves])."""
        leaves, self._leaves = self._leaves, []
        for seq, storage in leaves:
            if storage() is not None:
                self.packs[seq].leaf = self.packs[seq].activation = False

    def _suspend(self, module: torch.nn.Module) -> None:
        """Takes the operator recorder off the dispatch stack, and the session's torch-function
        modes (DTR's recording, the call trace) off theirs, while a compiled module runs: its
        modules are not seen (nothing in it is planned), torch.compile must not trace the
        recorder, and a mode stack that differs from a plain step's fails dynamo's guard, so that
        each profiled step compiled the module again until dynamo gave up on it and ran it eagerly
        (with other dropout masks than the compiled graph draws)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode

        self._suspended = module
        self._recorder_suspended = _get_current_dispatch_mode() is self.recorder
        if self._recorder_suspended:
            _pop_mode()
        stack = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
        self._modes_suspended = [(i, m) for i, m in enumerate(stack) if isinstance(m, (CallTracker, CallTrace))]
        for _, mode in reversed(self._modes_suspended):
            remove(mode)

    def _resume(self) -> None:
        from torch.utils._python_dispatch import _push_mode

        self._suspended = None
        for height, mode in self._modes_suspended:  # lowest first: each goes back where it was
            push_at(mode, height)
        self._modes_suspended = []
        if self._recorder_suspended:
            _push_mode(self.recorder)

    def roots(self) -> list[CallInfo]:
        """The step's outermost module calls (the model itself, usually)."""
        return [c for c in self.calls if c.parent < 0]

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        # First: dynamo must not trace the profile; and what a compiled region saves is kept
        # (its modules are not seen, so nothing there is planned).
        if torch.compiler.is_compiling():
            return
        busy, self.busy = self.busy, True  # what the hook runs is not the module's (DTR records it)
        try:
            self._enter(module, args)
        finally:
            self.busy = busy

    def _post(self, module: torch.nn.Module, args: Any, *rest: Any) -> None:
        """``rest``: the call's keyword arguments and output; only its (partial) output when the
        forward raised (torch calls an ``always_call`` hook so, without the keyword arguments:
        a try/except fallback in a model, non-reentrant checkpoint's recompute stopping early)."""
        if torch.compiler.is_compiling():
            return
        kwargs, output = rest if len(rest) == 2 else (None, rest[-1])
        busy, self.busy = self.busy, True
        try:
            self._leave(module, output, kwargs)
        finally:
            self.busy = busy

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        compiled = _compiled(module)
        if self._suspended is None and compiled:
            self._suspend(module)
        if self.paused or not torch.is_grad_enabled() or threading.get_ident() != self._thread or in_backward():
            return
        if compiled:
            for open_call, *_ in self._open:
                open_call.compiled_inside = True
        ordinal = self._ordinals.get(id(module), 0)
        self._ordinals[id(module)] = ordinal + 1
        parent = self._open[-1][0].index if self._open else -1
        call = CallInfo(len(self.calls), weakref.ref(module), ordinal, parent, type(module).__name__,
                        first_pack=len(self.packs), first_op=len(self.ops), first_trace=len(self.trace))
        inputs = tensor_leaves(args)
        for t in inputs:
            key = self._key(t)
            call.input_keys.append(key)
            call.input_activation.append(self._made_leaf(t, key) or is_activation(t))
            call.input_nbytes.append(t.untyped_storage().nbytes())
            call.input_producers.append(self._producer(t, key))
        call.input_signature = signature(inputs)
        call.input_geometry = [geometry(t) for t in inputs]
        self.calls.append(call)
        call.compiled_inside = compiled
        state = module_state(module)
        call.start = self._clock()
        self._open.append((call, call.start, inputs, [t._version for t in inputs], state))

    def _leave(self, module: torch.nn.Module, output: Any, kwargs: dict[str, Any] | None = None) -> None:
        if self._suspended is module:
            self._resume()
        if self.paused or not self._open or threading.get_ident() != self._thread \
                or self._open[-1][0].module() is not module or in_backward():
            return
        self._close(self._open[-1][0], output, kwargs)

    def _close(self, call: CallInfo, output: Any, kwargs: dict[str, Any] | None = None) -> None:
        _, t0, inputs, versions, state = self._open.pop()
        keywords: list[torch.Tensor] = []
        if kwargs:  # (a global pre-hook is given no keyword arguments: their tensors, seen here)
            keywords = tensor_leaves(kwargs)
            call.kwargs_signature = signature(keywords)
            call.kwarg_keys = [self._key(t) for t in keywords]
        call.end = self._clock()
        module = call.module()
        changed = module is not None and (not same_state(state, module_state(module))
                                          or self._wrote_buffers(call, module))
        self.state_changed |= changed
        if call.mutates_state or changed:
            for open_call in [call, *(c for c, *_ in self._open)]:  # a re-run of any call around it runs it again
                open_call.mutates_state = True
        call.seconds = max(0.0, call.end - t0)
        call.end_pack = len(self.packs)
        call.end_op = len(self.ops)
        call.end_trace = len(self.trace)
        call.last_desc = len(self.calls) - 1
        call.mutates_input = any(t._version != v for t, v in zip(inputs, versions)) or call.key in self.written_after
        call.varies = call.key in self.whole
        if (inputs or keywords) and not call.mutates_input:  # (keywords' versions from their return)
            self._returned.append((call, [(weakref.ref(t), t._version) for t in (*inputs, *keywords)]))
        if module is not None and not call.mutates_state:
            self._note_read_buffers(call, module)
        outs = tensor_leaves(output) if output is not None else []
        if len(outs) == 1 and isinstance(output, torch.Tensor):
            out = outs[0]
            key = self._key(out)
            call.out_key = key
            call.out_nbytes = out.untyped_storage().nbytes()
            call.out_version = out._version
            call.out_is_input = key in call.input_keys
            if module is not None and inputs and refill_kind(module) is not None and not autocast_state():
                with self._own_check(self._peek):
                    seconds = exact_refill_seconds(module, inputs[0], out)
                call.refill_seconds = -1.0 if seconds is None else seconds
            inner = self._outputs.get(key)
            made_inside = inner is not None and inner[0] > call.index and inner[1]() is out
            if not call.out_is_input and not made_inside:  # the innermost call that made it
                self._outputs[key] = (call.index, weakref.ref(out))
                for p in self.packs[call.first_pack:]:
                    if p.key == key and p.producer < 0:
                        p.producer = call.index  # saved inside the call before it returned (a ReLU's result)

    def _key(self, t: torch.Tensor) -> ProfileKey:
        """``t``'s storage, told apart from an earlier storage at the same address.

        The address alone is not enough: a tensor evicted in the profiled step (DTR runs it) or a
        temporary frees its memory, and a later tensor may get the same address. A storage is
        taken as the same while the storage object seen first at that address lives (PyTorch
        keeps one Python object per storage, alive as long as the storage: views included)."""
        storage = t.untyped_storage()
        base = (storage.data_ptr(), str(t.device))
        seen = self._seen.get(base)
        if seen is not None and seen[1]() is storage:
            return (*base, seen[0])
        gen = seen[0] + 1 if seen is not None else 0
        self._seen[base] = (gen, weakref.ref(storage))
        return (*base, gen)

    def _made_leaf(self, t: torch.Tensor, key: ProfileKey) -> bool:
        """Whether ``t`` is a leaf the step made (Note [Step-made leaves]): an activation, though
        ``is_activation(t)`` alone cannot tell."""
        return t.is_leaf and not t.requires_grad and key in self.recorder.made

    def _producer(self, t: torch.Tensor, key: ProfileKey) -> int:
        """The call whose output ``t`` is (a view of), as it returned it, or -1.

        Note [Changed since made]
            An output written in place after its call returned (a residual block's
            ``out = bn2(conv2(h)); out += identity; relu(out)``) is not what re-running or
            refilling that call gives. Until 2026-11-28 the storage alone linked a call's input to
            its producer, and a plan regenerated the ReLU's input through the batch norm's refill,
            without the identity: gradients off by up to 0.03 on every planned step of a stack of
            torchvision-style basic blocks, nothing stale (a review). Such an input has no
            producer now: an output candidate keeps it (a pin), and a planned step links an input
            to the output call of its step only at the version it returned
            (``PlannedStep._links``)."""
        entry = self._outputs.get(key)
        if entry is None or entry[1]() is None:
            return -1
        if t._version != self.calls[entry[0]].out_version:
            return -1
        return entry[0]

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """The operator recorder and saved-tensor hooks that note each save and keep it: a profile
        run without a session (the session packs through its own hooks, which call
        :meth:`note_pack`)."""
        with self.recorder, torch.autograd.graph.saved_tensors_hooks(self._noted, _kept):
            yield

    def _noted(self, t: torch.Tensor) -> torch.Tensor:
        self.note_pack(t)
        return t

    def note_pack(self, t: torch.Tensor) -> None:
        """Called by the session for every save of the step (not for replays)."""
        if self.paused:
            return
        key = self._key(t)
        inner = self._open[-1][0].index if self._open else -1
        leaf = self._made_leaf(t, key)
        if leaf:
            self._leaves.append((len(self.packs), weakref.ref(t.untyped_storage())))
        activation = leaf or is_activation(t)
        packed, pack_seconds = 0, 0.0
        if leaf and not autocast_state():
            with self._own_check(self._peek):
                seconds = noise_pack_seconds(t)
            if seconds is not None:
                packed, pack_seconds = t.numel(), seconds  # a boolean a element
        self.packs.append(PackInfo(key, t.untyped_storage().nbytes(), activation, inner,
                                   self._producer(t, key), t._version, (tuple(t.shape), t.dtype),
                                   tuple(t.stride()), int(t.storage_offset()), self._clock(), leaf=leaf,
                                   packed=packed, pack_seconds=pack_seconds))
        if activation and inner >= 0 and t.grad_fn is not None and t.numel() >= MIN_ELEMENTS \
                and not autocast_state():
            with self._own_check(self._probe):
                found = exact_product_seconds(t)
                if found is not None:
                    path, source, seconds, a = found
                    self.packs[-1].product = ProductInfo(path, source, seconds, self._key(a),
                                                         a.untyped_storage().nbytes())


@dataclass
class Plan:
    """What to do with each save of a step like the profiled one."""

    actions: list[int]  # per pack sequence number: KEEP, REGION or OUTPUT
    owners: list[tuple[int, int] | None]  # per pack: the planned call's key (module id, ordinal)
    signatures: list[tuple[tuple[int, ...], torch.dtype]]
    regions: dict[tuple[int, int], CallInfo]  # key -> region call
    recipes: dict[tuple[int, int], tuple[Recipe, frozenset[ProfileKey]]]  # selective regions: key -> recipe, drops
    outputs: dict[tuple[int, int], CallInfo]  # key -> output call (chain members included)
    modules: list["weakref.ref[torch.nn.Module]"]  # every module that needs hooks
    baseline_bytes: int  # saved activation bytes of the profiled step, each storage once
    estimate_bytes: int  # the plan's estimated peak
    floor_bytes: int  # the estimate with every candidate taken
    recompute_seconds: float  # forward time the plan re-runs per step, and its packing (measured in the profile)
    products: dict[int, ProductInfo] = field(default_factory=dict)  # PRODUCT saves: pack seq -> what was found
    # selective regions: key -> the profiled call's trace, what a planned step's call must match
    # for its replay to be the profile's (Note [Call traces] in guard.py)
    traces: dict[tuple[int, int], list[tuple[Any, ...]]] = field(default_factory=dict)
    # the pack sequence numbers of leaves the step made, which a kept save counts too (Note
    # [Step-made leaves]): what a planned step cannot tell from the tensor it is given
    leaves: frozenset[int] = frozenset()
    # the pack sequence numbers of dropout noise a kept save holds packed (Note [Packed noise])
    noise: frozenset[int] = frozenset()
    # per planned module (by id): every (module, buffer name) in its tree, found on the first
    # planned call (Note [Buffers a re-run reads] in regions.py)
    buffer_owners: dict[int, list[tuple[torch.nn.Module, str]]] = field(default_factory=dict)
    # (id of the module, buffer name): buffers the profiled step wrote after a call that reads
    # them returned; a re-run finding one changed is no news (Note [Buffers written after the call])
    written_buffers: frozenset[tuple[int, str]] = frozenset()

    def same(self, other: "Plan") -> bool:
        """Whether the two plans do the same with every save (drop, keep, keep packed)."""
        return self.actions == other.actions and self.noise == other.noise

    @property
    def empty(self) -> bool:
        return not self.regions and not self.outputs and not self.products and not self.noise


@dataclass(eq=False)
class _Candidate:
    call: CallInfo
    kind: int
    drops: set[ProfileKey]
    pins: dict[ProfileKey, int]  # storages the re-run needs kept -> bytes
    chain: list[int]  # calls re-run (an output's: the ones regenerating its inputs first)
    seconds: float
    transient: int
    recipe: Recipe | None = None  # a selective region's (Note [Selective re-runs]); None: re-run whole
    packs: ProfileKey | None = None  # PACK: the noise held as masks (``call``: the call open at its first save)

    def contains(self, other: "_Candidate") -> bool:
        if PACK in (self.kind, other.kind):  # packing re-runs nothing: it is in no call's way
            return False
        return self.call.index <= other.call.index <= self.call.last_desc

    def overlaps(self, other: "_Candidate") -> bool:
        return self.contains(other) or other.contains(self)

    def storages(self) -> set[ProfileKey]:
        """The storages it drops, pins or packs."""
        return {*self.drops, *self.pins, *([self.packs] if self.packs is not None else [])}


Move = tuple[list[_Candidate], list[_Candidate]]
"""What a greedy move takes out of the chosen candidates, and what it puts in."""

Peaks = tuple[int, list[tuple[int, _Candidate]]]
"""A planner's estimate, and the chosen re-runs whose peak is that estimate, each with how many
storages are saved before it (``_Planner._peaks``)."""


class _PrefixSums:
    """Sums of a list's first ``i`` values, the values changing one at a time (a Fenwick tree):
    both in O(log n), where summing the storages held before each chosen re-run was O(n) per
    estimate, and the greedy makes tens of thousands of estimates on a transformer."""

    def __init__(self, values: list[int]) -> None:
        self.tree = [0] + values
        for i in range(1, len(self.tree)):
            j = i + (i & -i)
            if j < len(self.tree):
                self.tree[j] += self.tree[i]

    def add(self, index: int, delta: int) -> None:
        i = index + 1
        while i < len(self.tree):
            self.tree[i] += delta
            i += i & -i

    def prefix(self, count: int) -> int:
        total, i = 0, count
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total


class _Planner:
    """The greedy choice of Note [Planned recompute], over one profile.

    Candidates are fixed up front; the state is counts per storage (how many chosen candidates
    drop it, how many pin it), so trying a candidate costs its own storages. A region may take
    the place of chosen candidates inside it: the greedy can go from fine pieces to whole blocks
    as the budget tightens.
    """

    def __init__(self, profile: Profile, like: "_Planner | None" = None, selective: bool = True) -> None:
        self.calls = profile.calls
        self.packs = profile.packs
        self.dropped: dict[ProfileKey, int] = {}
        self.pinned: dict[ProfileKey, int] = {}
        self.packing: dict[ProfileKey, int] = {}  # chosen PACK candidates per storage (0 or 1)
        self.chosen: list[_Candidate] = []
        # indexes of ``chosen`` (_join, _part): each one's place (increasing along the list), the
        # re-runs (not packs) chosen at each call, those calls in order, and by storage the
        # chosen candidates that drop, pin or pack it
        self._place: dict[int, int] = {}
        self._places = 0
        self._at_call: dict[int, list[_Candidate]] = {}
        self._calls_at: list[int] = []
        self._by_key: dict[ProfileKey, list[_Candidate]] = {}
        # what tries found, per candidate, kept until what it was read from changes (Note [Moves
        # that cannot help]): the chosen candidate that last ruled it out; its move, the move's
        # change (_cuts) and a chosen re-run at the peak that the move left as it was, each
        # forgotten when the counts of a storage it read change or a re-run is chosen or let go
        # around its call (those who read each storage, and the candidates at each call)
        self._blocked: dict[int, _Candidate] = {}
        self._moves: dict[int, Move] = {}
        self._cut: dict[int, tuple[list[int], list[int], int]] = {}
        self._no_help: dict[int, _Candidate] = {}
        self._readers: dict[ProfileKey, set[int]] = {}
        self._at: dict[int, set[int]] = {}
        self.nbytes: dict[ProfileKey, int]  # whole
        self.packed_nbytes: dict[ProfileKey, int]  # noise that can be held as masks: the masks' bytes
        self.saves: dict[ProfileKey, list[int]]
        self.order: list[ProfileKey]
        self.first: list[int]
        self.rank: dict[ProfileKey, int]  # place in ``order``
        self.candidates: list[_Candidate]
        self.variants: dict[int, list[_Candidate]]  # call index -> its output candidates
        if like is not None:  # the same profile: share the tables and candidates, fresh state
            self.nbytes, self.saves, self.order, self.first = like.nbytes, like.saves, like.order, like.first
            self.packed_nbytes, self.rank = like.packed_nbytes, like.rank
            self.candidates, self.variants = like.candidates, like.variants
            self.total = sum(self.nbytes.values())
            self._held_bytes = _PrefixSums([self.nbytes[k] for k in self.order])
            return
        self.nbytes = {}
        self.saves = {}
        for seq, p in enumerate(self.packs):
            if p.activation:
                self.saves.setdefault(p.key, []).append(seq)
        self.packed_nbytes = {}
        for k, seqs in self.saves.items():
            self.nbytes[k] = self.packs[seqs[0]].nbytes
            if packed := packed_bytes(self.packs, seqs):
                self.packed_nbytes[k] = packed
        self.total = sum(self.nbytes.values())  # bytes held: saved and not dropped, or pinned
        self.order = sorted(self.nbytes, key=lambda k: self.saves[k][0])  # by first save
        self.first = [self.saves[k][0] for k in self.order]
        self.rank = {k: i for i, k in enumerate(self.order)}
        # the bytes each storage holds now, in that order: what estimate() sums up to a point
        self._held_bytes = _PrefixSums([self.nbytes[k] for k in self.order])
        self.candidates = [c for call in self.calls for c in (self._region(call), *self._outputs(call))
                           if c is not None and c.drops and not (c.drops & set(c.pins))]
        self.candidates += self._products()
        self.candidates += self._packs()
        self.first_touch: dict[ProfileKey, tuple[int, bool]] = {}  # storage -> first operator, made by it
        if selective:  # Note [Selective re-runs]: variants from the operators the profile recorded
            for j, op in enumerate(profile.ops):
                for k in op.reads:
                    self.first_touch.setdefault(k, (j, False))
                for k in op.writes:
                    self.first_touch.setdefault(k, (j, True))
            self.candidates += [v for c in list(self.candidates) if c.kind == REGION for v in self._selective(c, profile)]
        self.variants = {}
        for c in self.candidates:
            if c.kind == OUTPUT:
                self.variants.setdefault(c.call.index, []).append(c)

    # -- candidates ------------------------------------------------------------------------

    def _region(self, call: CallInfo) -> _Candidate | None:
        if call.mutates_input or call.mutates_state or call.end_pack <= call.first_pack:
            return None
        inputs = set(call.input_keys)
        drops: set[ProfileKey] = set()
        rebuild: dict[ProfileKey, int] = {}
        for seq in range(call.first_pack, call.end_pack):
            p = self.packs[seq]
            if not p.activation:
                continue
            rebuild[p.key] = p.nbytes
            if p.key not in inputs and all(call.first_pack <= s < call.end_pack for s in self.saves[p.key]):
                drops.add(p.key)
        pins = self._pins(call)
        return _Candidate(call, REGION, drops, pins, [call.index], self._region_seconds(call, drops),
                          sum(rebuild.values()))

    def _region_seconds(self, call: CallInfo, drops: set[ProfileKey]) -> float:
        """A region's re-run time: measured, or its forward time scaled by the share of the
        profiled call that came before its last dropped save (the re-run stops there: Note
        [Planned recompute])."""
        if call.region_seconds >= 0:
            return call.region_seconds
        last = max((seq for seq in range(call.first_pack, call.end_pack) if self.packs[seq].key in drops),
                   default=-1)
        span = call.end - call.start
        if last < 0 or span <= 0:
            return call.seconds
        return call.seconds * min(1.0, max(0.0, (self.packs[last].at - call.start) / span))

    def _selective(self, full: _Candidate, profile: Profile) -> list[_Candidate]:
        """Selective variants of a region (Note [Selective re-runs]): its droppable storages in
        order of bytes per second of the operators that remake each one alone, and prefixes of
        that order, each with the recipe that remakes it."""
        call = full.call
        ops = profile.ops[call.first_op:call.end_op]
        if not 2 <= len(ops) <= MAX_SELECTIVE_OPS or call.grad_off_ops or call.compiled_inside or call.varies \
                or reads_values(ops, profile.trace[call.first_trace:call.end_trace]):
            return []
        first_op = call.first_op

        def created(k: ProfileKey) -> bool:
            first = self.first_touch.get(k)
            return first is not None and first[1] and first_op <= first[0] < call.end_op

        module = call.module()
        attrs: dict[tuple[int, str], str] = {}
        if module is not None:
            attrs.update((storage_key(t), "b:" + name) for name, t in module.named_buffers())
            attrs.update((storage_key(t), "p:" + name) for name, t in module.named_parameters())
        packs = self.packs[call.first_pack:call.end_pack]
        inputs: dict[ProfileKey, int] = {}
        for i, k in enumerate(call.input_keys):
            inputs.setdefault(k, i)
        save_geometry = [(p.signature[0], p.stride, p.offset, p.signature[1], torch.device(p.key[1])) for p in packs]
        unpacked = {p.key: p.nbytes for p in packs}
        table = CallOps(ops, [p.key for p in packs], created, inputs, attrs, save_geometry, call.input_geometry)
        alone: dict[ProfileKey, float] = {}
        for k in full.drops:
            r = table.recipe({k})
            if r is not None:
                alone[k] = r.op_seconds
        order = sorted(alone, key=lambda k: -self.nbytes[k] / max(alone[k], 1e-7))
        lengths = sorted({max(1, round(len(order) * (i + 1) / MAX_VARIANTS)) for i in range(MAX_VARIANTS)}) \
            if order else []
        out = []
        for n in lengths:
            drops = set(order[:n])
            r = table.recipe(drops)
            if r is None:
                continue
            seconds = profile.selective_seconds.get((call.index, frozenset(drops)), r.seconds)
            # what the refill adds to the saved bytes: the dropped saves again, unpacked (its
            # temporaries are working memory, which no saved-bytes count holds, the baseline's
            # neither; a refilled noise is float again: Note [Packed noise] in dropout.py)
            refilled = sum(unpacked[k] for k in drops)
            out.append(_Candidate(call, REGION, drops, dict(full.pins), [call.index], seconds, refilled, r))
        return out

    def _products(self) -> list[_Candidate]:
        """Dropping a dropout product saved once (Note [Dropout products] in dropout.py): its
        operand ``a`` kept (it is saved anyway), refilled in backward by one product."""
        out = []
        for key, seqs in self.saves.items():
            p = self.packs[seqs[0]]
            if len(seqs) != 1 or p.product is None or p.inner < 0 or p.product.source_key == key:
                continue
            info = p.product
            pins = {info.source_key: info.source_nbytes} if info.source_key in self.nbytes else {}
            out.append(_Candidate(self.calls[p.inner], PRODUCT, {key}, pins, [], info.seconds, p.nbytes))
        return out

    def _packs(self) -> list[_Candidate]:
        """Holding a dropout noise as masks where it is kept (Note [Packed noise] in dropout.py):
        three quarters of its bytes freed for a pack and an unpack a save, weighed like a re-run
        (a budget a little below the step's saves is met by a cheap refill, not by packing all
        the noise: 1.08-1.19x the plain step on the BERT-like model at 95% when every kept noise
        was packed)."""
        if not self.calls:
            return []
        return [_Candidate(self.calls[max(self.packs[seqs[0]].inner, 0)], PACK, set(), {}, [],
                           sum(self.packs[seq].pack_seconds for seq in seqs), 0, packs=key)
                for key, seqs in ((k, self.saves[k]) for k in self.packed_nbytes)]

    def _pins(self, call: CallInfo) -> dict[ProfileKey, int]:
        return {k: n for k, n, act in zip(call.input_keys, call.input_nbytes, call.input_activation) if act}

    def _chain(self, call: CallInfo, depth: int, reach: int, chain: list[int], pins: dict[ProfileKey, int]) -> bool:
        """Whether ``call``'s inputs can be had: pinned (kept) when saved anyway and ``depth``
        is ``reach`` or more, else regenerated through the calls that made them (up to
        ``MAX_CHAIN`` deep). Fills ``chain`` (inputs' producers first) and ``pins``."""
        if depth > MAX_CHAIN or call.mutates_input or call.mutates_state or call.out_key is None or call.out_is_input:
            return False
        for key, n, act, prod in zip(call.input_keys, call.input_nbytes, call.input_activation,
                                     call.input_producers):
            if not act:
                continue
            if prod < 0 or (key in self.nbytes and depth >= reach):
                pins[key] = n
            elif not self._chain(self.calls[prod], depth + 1, reach, chain, pins):
                if key not in self.nbytes:
                    return False
                pins[key] = n
        if call.index not in chain:
            chain.append(call.index)
        return True

    def _outputs(self, call: CallInfo) -> list[_Candidate]:
        """Dropping ``call``'s output, its inputs kept, or regenerated through their producers
        (one candidate per reach: a chain lets the inputs be dropped by other candidates)."""
        key = call.out_key
        if key is None or call.out_is_input or key not in self.nbytes:
            return []
        if any(self.packs[s].producer != call.index or self.packs[s].version != call.out_version
               for s in self.saves[key]):
            return []
        out: list[_Candidate] = []
        seen: set[tuple[int, ...]] = set()
        for reach in range(MAX_CHAIN + 1):
            chain: list[int] = []
            pins: dict[ProfileKey, int] = {}
            if not self._chain(call, 0, reach, chain, pins) or tuple(chain) in seen:
                continue
            seen.add(tuple(chain))
            seconds = sum(self.calls[i].rerun_seconds for i in chain)
            # a chain's re-run holds a call's output and the next one's at once
            sizes = [self.calls[i].out_nbytes for i in chain]
            transient = max([call.out_nbytes] + [a + b for a, b in zip(sizes, sizes[1:])])
            out.append(_Candidate(call, OUTPUT, {key}, pins, chain, seconds, transient))
        return out

    # -- state -----------------------------------------------------------------------------

    def _value(self, key: ProfileKey) -> int:
        """What the saves of a storage (one of ``nbytes``) hold now (:meth:`_held`). (The greedy
        calls this hundreds of thousands of times.)"""
        return self._held(key, self.dropped.get(key, 0), self.pinned.get(key, 0), self.packing.get(key, 0))

    def _held(self, key: ProfileKey, dropped: int, pinned: int, packing: int) -> int:
        """What the saves of a storage hold with these counts of chosen candidates that drop,
        pin and pack it: nothing when one drops it and none pins it, its masks' bytes when one
        packs it, else its bytes; a pinned storage is held whole by the re-run that needs it,
        packed or not (its masks then come on top)."""
        if dropped > 0 and pinned <= 0:
            return 0
        if packing > 0:
            return self.packed_nbytes[key] + (self.nbytes[key] if pinned > 0 else 0)
        return self.nbytes[key]

    def _change(self, move: Move) -> tuple[dict[ProfileKey, int], int, list[ProfileKey]]:
        """What a move (``replaced`` out, ``added`` in) changes, without making it: the held
        bytes of each storage whose held bytes change, the bytes of pins no save holds, and the
        storages it touches."""
        counts: dict[ProfileKey, list[int]] = {}  # storage -> changes of [dropped, pinned, packing]
        outside: dict[ProfileKey, list[int]] = {}  # a pin no save holds -> [change, bytes]
        for sign, group in ((-1, move[0]), (1, move[1])):
            for c in group:
                if c.packs is not None:
                    counts.setdefault(c.packs, [0, 0, 0])[2] += sign
                    continue
                for k in c.drops:
                    counts.setdefault(k, [0, 0, 0])[0] += sign
                for k, n in c.pins.items():
                    if k in self.nbytes:
                        counts.setdefault(k, [0, 0, 0])[1] += sign
                    else:
                        outside.setdefault(k, [0, n])[0] += sign
        change = {}
        for k, (dropped, pinned, packing) in counts.items():
            delta = self._held(k, self.dropped.get(k, 0) + dropped, self.pinned.get(k, 0) + pinned,
                               self.packing.get(k, 0) + packing) - self._value(k)
            if delta:
                change[k] = delta
        extra = 0
        for k, (delta, n) in outside.items():
            was = self.pinned.get(k, 0)
            extra += ((was + delta > 0) - (was > 0)) * n
        return change, extra, [*counts, *outside]

    def _apply(self, c: _Candidate, sign: int) -> None:
        if c.packs is not None:
            self._count(c.packs, self.packing, sign)
            return
        for k in c.drops:
            self._count(k, self.dropped, sign)
        for k, n in c.pins.items():
            if k in self.nbytes:
                self._count(k, self.pinned, sign)
            else:  # a storage no save holds (a re-run's input): in the total only
                before = self.pinned.get(k, 0) > 0
                self.pinned[k] = self.pinned.get(k, 0) + sign
                self._forget(self._readers.pop(k, ()))
                self.total += ((self.pinned[k] > 0) - before) * n

    def _count(self, key: ProfileKey, counts: dict[ProfileKey, int], sign: int) -> None:
        before = self._value(key)
        counts[key] = counts.get(key, 0) + sign
        self._forget(self._readers.pop(key, ()))
        delta = self._value(key) - before
        if delta:
            self.total += delta
            self._held_bytes.add(self.rank[key], delta)

    def estimate(self) -> int:
        """The planned peak: the bytes held at the end of forward, or while a chosen call is re-run
        in backward: what was saved before it and is held (backward frees later saves first; a
        selective region's own kept saves too, which its re-run reads) plus what the re-run saves
        (a whole re-run saves all the call's saves again, kept ones included), whichever is
        more."""
        return max([self.total, *(term for term, _, _ in self._reruns())])

    def _reruns(self) -> list[tuple[int, int, _Candidate]]:
        """Each chosen re-run (not a pack) with what is held while it runs, and its ``_before``."""
        held = self._held_bytes
        extra = self.total - held.prefix(len(self.order))  # pins of storages no save holds
        return [(held.prefix(b) + extra + c.transient, b, c)
                for c in self.chosen if c.kind != PACK for b in (self._before(c),)]

    def _before(self, c: _Candidate) -> int:
        """How many storages (in ``order``) are saved before ``c``'s re-run: all of its call's
        saves for a selective region (its re-run reads its kept ones), none of them else."""
        return bisect.bisect_left(self.first, c.call.end_pack if c.recipe is not None else c.call.first_pack)

    def _peaks(self) -> Peaks:
        """The estimate, and the chosen re-runs whose peak is that estimate, each with its
        ``_before``: what :meth:`_try` needs to see that a move cannot lower the estimate."""
        terms = self._reruns()
        peak = max([self.total, *(t for t, _, _ in terms)])
        return peak, [(b, c) for t, b, c in terms if t == peak]

    def seconds(self, chosen: list[_Candidate] | None = None) -> float:
        """Re-run time per step (of ``chosen``, else of the chosen candidates): a call re-run
        for several chosen candidates counts once (a regenerated output is cached while dropped
        saves still need it); a selective region costs its recipe's time; an output regenerated
        by a refill, the refill's."""
        chosen = self.chosen if chosen is None else chosen
        whole = [c for c in chosen if c.kind == REGION and c.recipe is None]
        outputs = {i for c in chosen if c.kind == OUTPUT for i in c.chain} - {c.call.index for c in whole}
        return sum(c.seconds for c in whole) + sum(self.calls[i].rerun_seconds for i in outputs) \
            + sum(c.seconds for c in chosen if c.recipe is not None or c.kind in (PRODUCT, PACK))

    def _try(self, c: _Candidate, peaks: Peaks | None = None) -> tuple[int, float, list[_Candidate], list[_Candidate]] | None:
        """The estimate and recompute time with ``c`` taken, what it replaces and what comes
        with it, or None where a chosen candidate rules it out (:meth:`_move`). With ``peaks``
        (the state's :meth:`_peaks`), None too where the move cannot bring the estimate below
        them (Note [Moves that cannot help])."""
        move = self._move_of(c)
        if move is None:
            return None
        replaced, added = move
        if peaks is not None:  # Note [Moves that cannot help], before what the move changes
            if any(a.kind != PACK and a.transient >= peaks[0] for a in added):
                return None  # a re-run that alone saves as much as is held at the peak
            if (d := self._no_help.get(id(c))) is not None and any(d is h for _, h in peaks[1]):
                return None
        ranks, sums, extra_change = self._cuts(c, move)

        def changed_before(b: int) -> int:  # what the move changes in the first ``b`` storages
            return sums[bisect.bisect_left(ranks, b)]

        total = self.total + sums[-1] + extra_change
        held = self._held_bytes
        extra = self.total - held.prefix(len(self.order)) + extra_change
        if peaks is not None:  # Note [Moves that cannot help]
            now, holders = peaks
            if total >= now:
                return None
            for b, d in holders:
                if changed_before(b) + extra_change >= 0 and not any(d is r for r in replaced):
                    self._no_help[id(c)] = d
                    return None
            for a in added:
                if a.kind != PACK and (held.prefix(b := self._before(a)) + changed_before(b) + extra
                                       + a.transient >= now):
                    return None
        chosen = [d for d in self.chosen if not any(d is r for r in replaced)] + added
        peak = total
        for d in chosen:
            if d.kind != PACK:
                b = self._before(d)
                peak = max(peak, held.prefix(b) + changed_before(b) + extra + d.transient)
        return peak, self.seconds(chosen), replaced, added

    def _move_of(self, c: _Candidate) -> Move | None:
        """``c``'s move (:meth:`_move`), kept until a chosen candidate that it met or that could
        be in its way changes; None where ``c`` is chosen or a chosen candidate rules it out."""
        if id(c) in self._place:
            return None
        blocker = self._blocked.get(id(c))
        if blocker is not None and id(blocker) in self._place:
            return None
        move = self._moves.get(id(c))
        if move is None:
            found = self._move(c)
            if isinstance(found, _Candidate):
                self._blocked[id(c)] = found
                return None
            move = self._moves[id(c)] = found
            self._at.setdefault(c.call.index, set()).add(id(c))
            for k in c.drops:
                self._readers.setdefault(k, set()).add(id(c))
        return move

    def _cuts(self, c: _Candidate, move: Move) -> tuple[list[int], list[int], int]:
        """What ``c``'s move changes (:meth:`_change`) as the ranks of the storages it changes,
        the running sums of their changes (from 0), and the change of pins no save holds; kept
        until the counts of a storage it touches change (Note [Moves that cannot help])."""
        kept = self._cut.get(id(c))
        if kept is not None:
            return kept
        change, extra, keys = self._change(move)
        cuts = sorted((self.rank[k], delta) for k, delta in change.items())
        ranks = [rank for rank, _ in cuts]
        sums = list(itertools.accumulate((delta for _, delta in cuts), initial=0))
        for k in keys:
            self._readers.setdefault(k, set()).add(id(c))
        kept = self._cut[id(c)] = (ranks, sums, extra)
        return kept

    def _forget(self, candidates: Iterable[int]) -> None:
        """Drops what tries found for these candidates but the chosen one that ruled them out."""
        for i in candidates:
            self._moves.pop(i, None)
            self._cut.pop(i, None)
            self._no_help.pop(i, None)

    def _move(self, c: _Candidate) -> Move | _Candidate:
        """What taking ``c`` replaces and what comes with it, or the chosen candidate that rules
        it out. ``c`` replaces chosen candidates inside it (a region) or another way to drop the
        same output; a chosen output that keeps (pins) what ``c`` drops switches to its variant
        that regenerates it through ``c``'s call instead. Whether a chosen candidate rules ``c``
        out depends on the two alone, so it does for as long as it stays chosen: :meth:`_try`
        remembers it (a deep model's greedy tries the same ruled-out candidates round after
        round)."""
        place = self._place
        near = {id(d): d for k in c.drops for d in self._by_key.get(k, ())}
        touching = sorted(near.values(), key=lambda d: place[id(d)])  # in the order of ``chosen``
        if c.kind != REGION:
            for d in touching:
                if d.kind != REGION and d.kind != c.kind and d.drops & c.drops:
                    return d  # an output and a product, both dropping the same storage
        # a pack of what ``c`` drops packs nothing any more
        replaced = [d for d in touching if d.packs is not None and d.packs in c.drops]
        lo, hi = c.call.index, c.call.last_desc
        for d in self._overlapping(c):  # packing re-runs nothing: it is in no call's way
            inside = lo <= d.call.index <= hi  # c.contains(d)
            if PRODUCT in (c.kind, d.kind):  # a product is in the way of a region around it only
                if c.kind == REGION and inside:
                    replaced.append(d)
                elif d.kind == REGION and d.call.index <= lo <= d.call.last_desc:  # d.contains(c)
                    return d
                continue
            if d.call is c.call and d.kind != c.kind:
                return d
            if d.call is not c.call and (c.kind != REGION or not inside):
                return d
            replaced.append(d)
        added = [c]
        for d in touching:
            if d.kind == OUTPUT and d not in replaced and not c.drops.isdisjoint(d.pins):
                options = [v for v in self.variants.get(d.call.index, ())
                           if c.call.index in v.chain and c.drops.isdisjoint(v.pins)]
                if not options:
                    return d
                replaced.append(d)
                added.append(min(options, key=lambda v: v.seconds))
        return replaced, added

    def _enclosing(self, i: int) -> Iterator[int]:
        """Call ``i`` and the calls it was made in, innermost first."""
        while i >= 0:
            yield i
            i = self.calls[i].parent

    def _overlapping(self, c: _Candidate) -> list[_Candidate]:
        """The chosen re-runs (not packs) that ``c`` (not a pack) contains or is contained by
        (:meth:`_Candidate.overlaps`), in the order of ``chosen``: those at the calls around
        ``c``'s, at its own, and at the calls it made."""
        if c.kind == PACK:
            return []
        out = [d for i in self._enclosing(c.call.index) for d in self._at_call.get(i, ())]
        calls = self._calls_at
        for j in range(bisect.bisect_right(calls, c.call.index), bisect.bisect_right(calls, c.call.last_desc)):
            out += self._at_call[calls[j]]
        return sorted(out, key=lambda d: self._place[id(d)])

    def _near(self, c: _Candidate) -> None:
        """Forgets the moves of the candidates at the calls around ``c``'s, at its own and at
        the calls it made: a re-run chosen or let go there is in their way or inside them."""
        for i in [*self._enclosing(c.call.index), *range(c.call.index + 1, c.call.last_desc + 1)]:
            self._forget(self._at.pop(i, ()))

    def _join(self, c: _Candidate) -> None:
        """Appends ``c`` to ``chosen`` and its indexes."""
        self.chosen.append(c)
        self._place[id(c)] = self._places
        self._places += 1
        if c.kind != PACK:
            self._near(c)
            at = self._at_call.setdefault(c.call.index, [])
            if not at:
                bisect.insort(self._calls_at, c.call.index)
            at.append(c)
        for k in c.storages():
            self._by_key.setdefault(k, []).append(c)

    def _part(self, c: _Candidate) -> None:
        """Removes ``c`` from ``chosen`` and its indexes."""
        self.chosen.remove(c)
        del self._place[id(c)]
        if c.kind != PACK:
            self._near(c)
            at = self._at_call[c.call.index]
            at.remove(c)
            if not at:
                self._calls_at.remove(c.call.index)
        for k in c.storages():
            self._by_key[k].remove(c)

    def seed(self, regions: list[_Candidate]) -> None:
        """Starts from these regions (those that fit with each other)."""
        for c in regions:
            if not self._overlapping(c):
                self._apply(c, +1)
                self._join(c)

    def seeds(self) -> list[list[_Candidate]]:
        """Starting points besides nothing: every call of one module type as a region, for the
        types called several times whose regions would drop a tenth of the bytes or more (the
        blocks a user would checkpoint by hand). The greedy alone, adding the best piece at a
        time, can end up re-running more than such a uniform choice at tight budgets."""
        by_type: dict[str, list[_Candidate]] = {}
        for c in self.candidates:
            if c.kind == REGION and c.call.module() is not None:
                by_type.setdefault(f"{type(c.call.module()).__qualname__}", []).append(c)
        out = []
        for group in by_type.values():
            freed = sum(self.nbytes[k] for c in group for k in c.drops)
            if len(group) >= 2 and freed * 10 >= self.total:
                out.append(group)
        return out

    def run(self, budget: int, closing: bool = True) -> None:
        """Takes moves until the estimate fits ``budget`` or nothing helps.

        Each round takes the cheapest move that closes the gap, else the move with the most
        bytes per second; with ``closing`` False, always the latter (several cheap pieces can
        cost less than the one large region that closes the gap at once: make_plan tries both). A try that must be estimated costs O(storages) (Note [Moves that cannot help]), so both searches try few: the
        best-looking candidates first (bytes dropped per second of their own re-runs), stopping
        at those that look less than ``PRUNE`` as good as the best move found so far or after
        ``TRIES_PER_ROUND``; closers in order of their own re-run time, stopping at the first
        that closes or after ``TRIES_PER_ROUND``.
        """
        dropped = {id(c): self._frees(c) for c in self.candidates}
        density = {id(c): dropped[id(c)] / max(c.seconds, 1e-9) for c in self.candidates}
        by_density = sorted(self.candidates, key=lambda c: -density[id(c)])
        by_seconds = sorted(self.candidates, key=lambda c: c.seconds)
        while self.estimate() > budget:
            move = (self._closing(budget, by_seconds, dropped) if closing else None) \
                or self._densest(by_density, density)
            if move is None:
                return
            self._take(move)
        self._refine(budget, density)
        self._prune(budget)
        self._swap(budget, by_density, density)

    def _frees(self, c: _Candidate) -> int:
        """The bytes ``c`` frees alone, by the profile's sizes (what orders the greedy's tries)."""
        if c.packs is not None:
            return self.nbytes[c.packs] - self.packed_nbytes[c.packs]
        return sum(self.nbytes[k] for k in c.drops)

    def _take(self, move: Move) -> None:
        for d in move[0]:
            self._apply(d, -1)
            self._part(d)
        for a in move[1]:
            self._apply(a, +1)
            self._join(a)

    def _refine(self, budget: int, density: dict[int, float]) -> None:
        """Once the plan fits: each region re-run whole is tried as its largest selective variant
        instead, the gap that leaves closed with selective variants alone (densest first); kept
        when that plan fits and re-runs less. The closing move takes the cheapest single
        candidate that closes the gap, which can be a whole block where selective variants of
        several blocks would do for less."""
        selective = sorted((v for v in self.candidates if v.recipe is not None), key=lambda v: -density[id(v)])
        for c in [c for c in self.chosen if c.kind == REGION and c.recipe is None]:
            variants = [v for v in selective if v.call is c.call]
            if c not in self.chosen or not variants:
                continue
            before, spent = list(self.chosen), self.seconds()
            tried = self._try(max(variants, key=lambda v: len(v.drops)))
            if tried is not None:
                self._take((tried[2], tried[3]))
            self._close_or_undo(budget, selective, density, before, spent)

    def _prune(self, budget: int) -> None:
        """Once the plan fits: each chosen candidate, costliest first, is let go when the plan
        still fits without it (a later move, such as the region that closed the gap, can make an
        earlier one unneeded)."""
        for c in sorted(self.chosen, key=lambda c: -c.seconds):
            if c not in self.chosen:
                continue
            spent = self.seconds()
            self._take(([c], []))
            if self.estimate() > budget or self.seconds() >= spent:
                self._take(([], [c]))

    def _swap(self, budget: int, by_density: list[_Candidate], density: dict[int, float]) -> None:
        """Once the plan fits: each of the ``SWAPS`` costliest chosen candidates is tried let go
        and the gap it leaves closed with the densest of the candidates that re-run for less
        time than it; kept when that fits and re-runs less. The greedy takes the densest move
        while the plan is over, and the last such move can be a large one where a few small ones
        would do (the benchmark's GPT-like model with selective regions at 60% of its saved
        bytes: 11.2 ms of predicted re-runs a step without the swap, 9.0 with it)."""
        for c in sorted(self.chosen, key=lambda c: -c.seconds)[:SWAPS]:
            if c not in self.chosen:
                continue
            before, spent = list(self.chosen), self.seconds()
            self._take(([c], []))
            smaller = [o for o in by_density if o.seconds < c.seconds]
            self._close_or_undo(budget, smaller, density, before, spent)

    def _close_or_undo(self, budget: int, candidates: list[_Candidate], density: dict[int, float],
                       before: list[_Candidate], spent: float) -> None:
        """Takes the densest of ``candidates`` until the plan fits; goes back to ``before`` unless
        the plan then fits and re-runs for less than ``spent``."""
        while self.estimate() > budget:
            move = self._densest(candidates, density)
            if move is None:
                break
            self._take(move)
        if self.estimate() > budget or self.seconds() >= spent:
            self._take((list(self.chosen), before))

    def _closing(self, budget: int, by_seconds: list[_Candidate], dropped: dict[int, int]) -> Move | None:
        peaks = self._peaks()
        now = peaks[0]
        chosen = {id(c) for c in self.chosen}
        tries = 0
        for c in by_seconds:
            if id(c) in chosen or dropped[id(c)] < now - budget:
                continue
            tried = self._try(c, peaks)
            if tried is not None and tried[0] <= budget:
                return tried[2], tried[3]
            tries += 1
            if tries >= TRIES_PER_ROUND:
                break
        return None

    def _densest(self, by_density: list[_Candidate], density: dict[int, float]) -> Move | None:
        peaks, spent = self._peaks(), self.seconds()
        now = peaks[0]
        chosen = {id(c) for c in self.chosen}
        best: tuple[float, list[_Candidate], list[_Candidate]] | None = None
        tries = 0
        for c in by_density:
            if id(c) in chosen:
                continue
            if best is not None and (density[id(c)] < best[0] * PRUNE or tries >= TRIES_PER_ROUND):
                break
            tries += 1
            tried = self._try(c, peaks)
            if tried is None or tried[0] >= now:
                continue
            ratio = (now - tried[0]) / max(tried[1] - spent, 1e-9)
            if best is None or ratio > best[0]:
                best = (ratio, tried[2], tried[3])
        return (best[1], best[2]) if best is not None else None


def packed_bytes(packs: list[PackInfo], seqs: list[int]) -> int:
    """The bytes one storage's saves ``seqs`` hold packed, each its own mask (Note [Packed noise]
    in dropout.py); 0 where one of them cannot be packed (the storage is then held as it is) or
    packing would not hold less."""
    if not all(packs[seq].packed for seq in seqs):
        return 0
    total = sum(packs[seq].packed for seq in seqs)
    return total if total < packs[seqs[0]].nbytes else 0


def make_plan(profile: Profile, budget: int, floor_bytes: int | None = None, selective: bool = True) -> Plan:
    """Plans a step like ``profile`` to hold at most ``budget`` saved-activation bytes, or as few
    as it can when that is below the floor. See Note [Planned recompute]. ``floor_bytes``: the
    floor estimated before for this profile (planning to 0 from every start is the slow part).
    ``selective``: whether selective regions (Note [Selective re-runs]) are candidates."""
    base = _Planner(profile, selective=selective)
    starts: list[list[_Candidate]] = [[], *base.seeds()]
    if floor_bytes is None:
        floor_bytes = min(_planned(profile, base, seed, 0).estimate() for seed in starts)
    tried = [_planned(profile, base, seed, budget, closing) for seed in starts for closing in (True, False)]
    fitting = [p for p in tried if p.estimate() <= budget]
    planner = min(fitting, key=lambda p: p.seconds()) if fitting \
        else min(tried, key=lambda p: (p.estimate(), p.seconds()))
    return plan_of(profile, planner, min(floor_bytes, planner.estimate()), budget)


def plan_of(profile: Profile, planner: _Planner, floor_bytes: int, budget: int) -> Plan:
    """The plan of the candidates ``planner`` chose (tests choose their own) for ``budget``."""
    n = len(profile.packs)
    actions = [KEEP] * n
    owners: list[tuple[int, int] | None] = [None] * n
    regions: dict[tuple[int, int], CallInfo] = {}
    outputs: dict[tuple[int, int], CallInfo] = {}
    modules: dict[int, weakref.ref[torch.nn.Module]] = {}
    recipes: dict[tuple[int, int], tuple[Recipe, frozenset[ProfileKey]]] = {}
    products: dict[int, ProductInfo] = {}
    traces: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
    for c in planner.chosen:
        if c.kind == REGION:
            regions[c.call.key] = c.call
            if c.recipe is not None:
                recipes[c.call.key] = (c.recipe, frozenset(c.drops))
                traces[c.call.key] = profile.trace[c.call.first_trace:c.call.end_trace]
            for seq in range(c.call.first_pack, c.call.end_pack):
                if profile.packs[seq].key in c.drops:
                    actions[seq], owners[seq] = REGION, c.call.key
        elif c.kind == PRODUCT:
            for seq in planner.saves[next(iter(c.drops))]:
                actions[seq], owners[seq] = PRODUCT, c.call.key
                products[seq] = profile.packs[seq].product  # type: ignore[assignment]
        elif c.kind == OUTPUT:
            for i in c.chain:
                outputs[profile.calls[i].key] = profile.calls[i]
            for seq, p in enumerate(profile.packs):
                if p.activation and p.key in c.drops and p.producer == c.call.index:
                    actions[seq], owners[seq] = OUTPUT, c.call.key
        for i in c.chain:
            m = profile.calls[i].module
            modules[id(m())] = m
    baseline = sum({p.key: p.nbytes for p in profile.packs if p.activation}.values())
    # noise packed where the planner chose to and only where the profiled step held more than the
    # budget (else the plan is empty and its steps run idle: Note [Idle steps])
    noise = frozenset(seq for c in planner.chosen if c.packs is not None for seq in planner.saves[c.packs]
                      if actions[seq] == KEEP) if baseline > budget else frozenset()
    return Plan(actions, owners, [p.signature for p in profile.packs], regions, recipes, outputs,
                list(modules.values()), baseline, planner.estimate(), floor_bytes,
                planner.seconds(), products, traces, frozenset(seq for seq, p in enumerate(profile.packs) if p.leaf),
                noise, written_buffers=frozenset(profile.written_buffers))


def _planned(profile: Profile, base: _Planner, seed: list[_Candidate], budget: int,
             closing: bool = True) -> _Planner:
    planner = _Planner(profile, like=base)
    planner.seed(seed)
    planner.run(budget, closing)
    return planner



BUDGET_SLACK = 0.05
"""A planned step may hold this fraction over the budget (the promise of ``pyalloc.offload``)."""

MAX_TRIALS = 6
"""Planned steps measured, one plan each, before the search settles on the best of them."""

CLOSE_CALL = 0.25
"""Re-run times of the two families' plans this close (a fraction of the larger) are measured
once more each before the search chooses between them: one step's time moves by several
percent on a shared machine, and the choice holds for every later step."""


class PlanSearch:
    """The plans for one profile, tuned on measured steps.

    The plan's peak is an estimate (Note [Planned recompute]); the step's is measured. After each
    planned step the search moves the planner's target: scaled by how far the measurement was
    from the budget until one plan fitted and one overshot, then halfway between the largest
    target that fitted and the smallest that overshot, so that the plan lands just under the
    budget (a looser plan re-runs less). Each step also measures its re-runs, and the profile's
    forward times of the calls re-run are replaced by those (a re-run in backward can cost more
    than the forward did, and the profiled step's times are noisy), so the next plan weighs
    costs as measured. After ``MAX_TRIALS`` steps, or when a plan repeats, it settles on the
    plan whose step re-ran least among those that kept the budget (+5%), or failing that the
    one that held the least: then the budget is below the floor, and ``floor_bytes`` is that
    least.

    Note [Settling]
        The step at which the search settles ran a trial, and the plan it settles on may be
        another, earlier one: that step's peak (``step_saved_bytes_peak``) can then be over the
        budget while the plan in force kept it (gradient accumulation on an LSTM at half its
        saved bytes: the sixth trial held 690,176 bytes against a limit of 681,676, the plan
        chosen 536,576, and so did every step after it). ``settled_peak``
        (``plan_saved_bytes_peak`` in the session's stats) is the settled plan's own measured
        peak, which the promise of the budget is about.
    """

    def __init__(self, profile: Profile, budget: int, selective: bool = True) -> None:
        self.profile = profile
        self.budget = budget
        self.target = budget
        self.plan = make_plan(profile, budget, selective=False)
        # whether plans may hold selective regions: decided on the first two planned steps, one
        # plan without and one with them at the same target, by their measured re-run time
        self.selective: bool | None = None if selective else False
        self.family_targets: list[int] = [budget]  # the target of each trial while it is undecided
        self.trials: list[tuple[Plan, int]] = []
        self.rerun_seconds: list[float] = []  # per trial: the step's re-run time, measured (or two's mean)
        self.remeasure: list[int] = []  # trials to run once more before the families are compared
        self.remeasured = 0  # steps spent so (they count towards MAX_TRIALS)
        self.last_peak = -1  # the last planned step's measured peak
        self.fitted: int | None = None  # the largest target whose plan kept the budget
        self.overshot: int | None = None  # the smallest target whose plan did not
        self.settled = False
        # the settled plan's measured peak: its trial's, then each counted step's under it (-1
        # while searching; Note [Settling])
        self.settled_peak = -1

    @property
    def limit(self) -> int:
        return int(self.budget * (1 + BUDGET_SLACK))

    def measured(self, peak: int, reruns: dict[tuple[int, int], float] | None = None,
                 selective: dict[tuple[int, int], float] | None = None,
                 refills: dict[tuple[int, int], float] | None = None,
                 regions: dict[tuple[int, int], float] | None = None) -> bool:
        """Takes a planned step's measured peak and re-run seconds per call (by key: outputs'
        re-runs, selective regions, refills, whole regions' re-runs up to their last dropped
        save); returns whether the plan changed."""
        self.last_peak = peak
        if self.settled:
            self.settled_peak = peak
            return False
        reruns, refills, regions = reruns or {}, refills or {}, regions or {}
        seconds = sum(reruns.values()) + sum((selective or {}).values()) + sum(refills.values()) \
            + sum(regions.values())
        for call in self.profile.calls:
            if (measured := reruns.get(call.key)) is not None:
                call.seconds = measured
            if (measured := refills.get(call.key)) is not None:
                call.refill_seconds = measured
            if (measured := regions.get(call.key)) is not None:
                call.region_seconds = measured
        plan = self.plan
        for key, secs in (selective or {}).items():
            recipe = plan.recipes.get(key)
            if recipe is not None:
                self.profile.selective_seconds[(plan.regions[key].index, recipe[1])] = secs
        if self.remeasure:  # a close comparison of the families, measured once more
            i = self.remeasure.pop(0)
            self.remeasured += 1
            self.rerun_seconds[i] = (self.rerun_seconds[i] + seconds) / 2
            if self.remeasure:
                self.plan = self.trials[self.remeasure[0]][0]
                return True
            plan, peak = self._choose_family()
        else:
            self.trials.append((plan, peak))
            self.rerun_seconds.append(seconds)
        if self.selective is None:
            if len(self.trials) == 1 or (len(self.trials) == 2 and peak > self.limit):
                # the plan with selective regions next: at the same target, or (it overshot:
                # their re-runs hold what they take from the forward a while longer) scaled down
                target = self.target if len(self.trials) == 1 else \
                    int(self.target * self.budget / peak * (1 - BUDGET_SLACK / 2))
                alternative = make_plan(self.profile, target, plan.floor_bytes, selective=True) \
                    if not plan.empty else plan
                if alternative.recipes and not any(alternative.same(p) for p, _ in self.trials):
                    self.family_targets.append(target)
                    self.plan = alternative
                    return True
            close = self._close_call()
            if close:  # one more step of each before choosing: a step's re-run time is noisy
                self.remeasure = close
                self.plan = self.trials[close[0]][0]
                return True
            plan, peak = self._choose_family()
        if peak <= self.limit:
            self.fitted = max(self.fitted or 0, self.target)
            if plan.empty or peak >= self.budget * (1 - BUDGET_SLACK):
                return self._settle()  # close enough under the budget
        else:
            self.overshot = min(self.overshot or self.target, self.target)
        if len(self.trials) + self.remeasured >= MAX_TRIALS or peak <= 0:
            return self._settle()
        if self.fitted is not None and self.overshot is not None:
            target = (self.fitted + self.overshot) // 2
        else:
            target = int(self.target * self.budget / peak * (1 - BUDGET_SLACK / 2))
        candidate = make_plan(self.profile, target, self.trials[0][0].floor_bytes, selective=bool(self.selective))
        if any(candidate.same(p) for p, _ in self.trials):
            return self._settle()
        self.target, self.plan = target, candidate
        return True

    def _choose_family(self) -> tuple[Plan, int]:
        """Settles whether plans hold selective regions; the best trial of that family becomes
        the plan. Returns it and its measured peak."""
        self.selective = self._compare_families()
        best = self._best_of(selective=self.selective)
        plan, peak = self.trials[best]
        self.plan, self.target = plan, self.family_targets[best]
        return plan, peak

    def _close_call(self) -> list[int]:
        """The trials to measure once more before the families are compared (the first, and the
        best with selective regions): when both kept the budget and their re-run times are
        within ``CLOSE_CALL`` of each other (once: the comparison that follows decides)."""
        if len(self.trials) < 2:
            return []
        first, best = 0, self._best_of(selective=True)
        (_, peak0), (_, peak1) = self.trials[first], self.trials[best]
        a, b = self.rerun_seconds[first], self.rerun_seconds[best]
        if peak0 > self.limit or peak1 > self.limit:
            return []
        return [first, best] if abs(a - b) <= CLOSE_CALL * max(a, b) else []

    def _compare_families(self) -> bool:
        """After the first plan (no selective regions) and one or two with them: whether the
        best of those with them kept the budget (+5%) as well and re-ran for less time."""
        if len(self.trials) < 2:
            return False
        first, best = 0, self._best_of(selective=True)
        (_, peak0), (_, peak1) = self.trials[first], self.trials[best]
        fits0, fits1 = peak0 <= self.limit, peak1 <= self.limit
        if fits0 != fits1:
            return fits1
        if not fits0:
            return peak1 < peak0
        return self.rerun_seconds[best] < self.rerun_seconds[first]

    def _best_of(self, selective: bool) -> int:
        """The trial, among the family's (the first trial, or those after it while the family
        is undecided), that fitted and re-ran least, else the one that held least."""
        indices = list(range(1, len(self.trials))) if selective else [0]
        fitting = [i for i in indices if self.trials[i][1] <= self.limit]
        if fitting:
            return min(fitting, key=lambda i: self.rerun_seconds[i])
        return min(indices, key=lambda i: self.trials[i][1])

    def _settle(self) -> bool:
        self.settled = True
        fitting = [(self.rerun_seconds[i], i) for i, (p, peak) in enumerate(self.trials) if peak <= self.limit]
        best = min(fitting)[1] if fitting else min(range(len(self.trials)), key=lambda i: self.trials[i][1])
        changed = self.trials[best][0] is not self.plan
        self.plan, self.settled_peak = self.trials[best]
        return changed

    @property
    def idle(self) -> bool:
        """Settled on a plan that drops nothing, and the last counted step held at most the
        budget less ``BUDGET_SLACK``, or nothing a plan drops kept the budget (below the floor):
        steps may run idle (Note [Idle steps])."""
        return self.settled and self.plan.empty and (0 <= self.last_peak <= self.budget * (1 - BUDGET_SLACK)
                                                     or self.below_floor)

    @property
    def below_floor(self) -> bool:
        """Settled, and no plan kept the budget."""
        return self.settled and bool(self.trials) and all(peak > self.limit for _, peak in self.trials)

    @property
    def floor_bytes(self) -> int:
        """The least peak measured (while searching: the plan's estimate of its floor)."""
        measured = [peak for _, peak in self.trials]
        return min(measured) if self.below_floor else self.plan.floor_bytes
