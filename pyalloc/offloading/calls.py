"""The torch calls a session records, and their replay.

Note [Producers and replay]
    A ``TorchFunctionMode`` sees every top-level torch call made inside the session (``F.linear``,
    ``F.multi_head_attention_forward``, ``Tensor.relu``, ...; calls inside a composite are not
    seen, the mode is popped while it runs). Each call becomes a :class:`ProducerCall` that
    remembers the function, its arguments (tensors as references: a leaf is kept, a tensor made
    by an earlier call is referred to through that call), the RNG state before it, grad mode,
    and how long it took. A saved tensor is recomputable when it is an output of a call, or an
    intermediate that autograd packed while a composite call ran (identified by its index among
    that call's packs). Replay re-runs the call with the same grad mode, the same
    ``requires_grad`` flags and the RNG states restored (Note [Generator states] in rng.py),
    under a capturing hook, so the same kernels run on the same bytes and the results are equal
    bit for bit (dropout masks included). Calls that mutate an input (in-place ops, ``out=``, batch norm's running stats)
    are never replayed: their outputs are swap-only. Not recorded at all: calls made with grad
    disabled (an optimizer step, evaluation), attribute reads and writes other than the view
    properties (``p.grad``, ``x.dtype``, ``p.grad = None``), and the autograd entry points
    (replaying ``backward`` would run it again). What such a call makes is a leaf, which a later
    call keeps as it is.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from . import clock
from . import rng
from .args import TensorMap, flatten, unflatten
from .guard import entry
from .ops import written_arguments

if TYPE_CHECKING:
    from .saved import SavedActivation
    from .session import ActivationOffload


def _is_compiling() -> bool:
    """True while torch.compile traces: the mode then stays out of the graph (dynamo would trace
    the recording itself, and fails to guard on it); the compiled region's saved tensors are
    packed at run time with no recorded producer, so they are swapped, never recomputed."""
    return torch.compiler.is_compiling()


def autograd_entry_points() -> frozenset[Any]:
    """Calls that run backward: never recorded (replaying one would run backward again)."""
    return frozenset((torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad))


_HIDDEN_EFFECTS = ("batch_norm", "instance_norm", "group_norm_running")


def _has_hidden_effects(name: str) -> bool:
    """Calls that update state without bumping a version counter (batch norm's running stats),
    or in-place methods and operators (``add_``, ``__iadd__``): never replayed."""
    return any(k in name for k in _HIDDEN_EFFECTS) or (name.endswith("_") and not name.endswith("__")) \
        or name in _IN_PLACE_OPERATORS


def _writes_an_argument(name: str) -> bool:
    """Whether the aten operator of that name writes an argument other than an ``out=`` one:
    ``fused_moving_avg_obs_fake_quant`` (quantization-aware training) writes the observer's
    running min and max, scale and zero point, and bumps no version counter; a replay moved
    them again (a review, 2026-11-29)."""
    packet = getattr(torch.ops.aten, name, None) if name and not name.startswith("__") else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    for overload in packet.overloads():
        if "out" in overload:
            continue
        if written_arguments(getattr(packet, overload)._schema):
            return True
    return False


_IN_PLACE_OPERATORS = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv",
                                                        "mod", "pow", "and", "or", "xor", "lshift", "rshift"))


_VIEW_PROPERTIES = frozenset(("T", "mT", "H", "mH", "real", "imag"))
_RECORD, _PASS, _NO_REPLAY = 0, 1, 2
_call_kinds: dict[Any, int] = {}


def _call_kind(func: Any) -> int:
    """How the recording treats ``func`` (cached): attribute reads and writes (``x.grad``,
    ``x.dtype``, ``p.grad = None``) pass through unrecorded, but for the properties that make
    views (``x.T``); calls with hidden effects are recorded as never replayable."""
    try:
        kind = _call_kinds.get(func)
    except TypeError:  # unhashable
        kind = None
    if kind is not None:
        return kind
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        descriptor = getattr(func, "__self__", None)
        prop = getattr(descriptor, "__name__", None) or getattr(getattr(descriptor, "fget", None), "__name__", "")
        kind = _RECORD if name == "__get__" and prop in _VIEW_PROPERTIES else _PASS
    elif _has_hidden_effects(name) or _writes_an_argument(name):
        kind = _NO_REPLAY
    else:
        kind = _RECORD
    with contextlib.suppress(TypeError):
        _call_kinds[func] = kind
    return kind


@dataclass
class Kept:
    """A leaf argument (parameter, input batch): held as is; its version must not change."""

    tensor: torch.Tensor
    version: int
    requires_grad: bool


@dataclass
class Produced:
    """An argument made by an earlier call: regenerated through that call when gone."""

    call: "ProducerCall"
    index: int
    version: int
    requires_grad: bool


@dataclass(eq=False)
class ProducerCall:
    """One top-level torch call inside the session; see Note [Producers and replay]."""

    func: Callable[..., Any]
    spec: Any
    leaves: list[Any]
    rng_state: torch.Tensor | None
    cuda_rng: rng.CudaStates  # every device the call may draw on (Note [Generator states] in rng.py)
    grad_enabled: bool
    cost_s: float = 0.0
    replayable: bool = True
    autocast: tuple[tuple[str, torch.dtype], ...] = ()  # autocast on when it ran: device, dtype
    outputs: list[weakref.ref | None] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    pack_start: int = 0
    out_handles: dict[int, weakref.ref] = field(default_factory=dict)  # output index -> handle

    def out_handle(self, index: int) -> "SavedActivation | None":
        ref = self.out_handles.get(index)
        return ref() if ref is not None else None

    @property
    def name(self) -> str:
        return getattr(self.func, "__name__", repr(self.func))

    def live_output(self, index: int, version: int) -> torch.Tensor | None:
        ref = self.outputs[index] if index < len(self.outputs) else None
        t = ref() if ref is not None else None
        if t is not None and t._version == version:
            return t
        return None


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast in effect: (device type, dtype) for each device type it is on for."""
    if not torch._C._is_any_autocast_enabled():  # the usual case, in one call (this runs per planned call)
        return ()
    return tuple((dev, torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda") if torch.is_autocast_enabled(dev))


AUTOCAST_OFF: tuple[tuple[str, torch.dtype], ...] = ()
"""The autocast state of operators recorded at the dispatcher, below autocast (already cast), and
of refills, which are taken only for calls that ran without autocast."""


def autocast_as(state: tuple[tuple[str, torch.dtype], ...]) -> contextlib.AbstractContextManager[Any]:
    """Within: autocast as ``state`` (:func:`autocast_state`, read where the call first ran) says,
    on for its device types and dtypes, off for every other.

    Why off too: recompute runs in backward, and a program that wraps its whole step in
    ``torch.autocast`` runs backward inside it; an operator replayed there would be cast again
    (an ``aten.bmm`` on float32 operands returns bfloat16 under CPU autocast), and a call that ran
    without autocast would run with it: other values, and the gradients wrong with no error
    (a review, 2026-11-29). Inside an autocast already on for the device, the re-run's own has
    its cache off: the enclosing one's cache holds the forward's casts of the parameters, and a
    re-run that took them would not run the casts the profile saw (casts are exact either way)."""
    if not state and not torch._C._is_any_autocast_enabled():  # the usual case, in one call
        return contextlib.nullcontext()
    wanted = dict(state)
    modes = contextlib.ExitStack()
    for dev in ("cpu", "cuda"):
        on = torch.is_autocast_enabled(dev)
        if dev in wanted:
            modes.enter_context(torch.autocast(dev, dtype=wanted[dev], cache_enabled=not on))
        elif on:
            modes.enter_context(torch.autocast(dev, enabled=False))
    return modes


class CallTracker(TorchFunctionMode):
    """Records every top-level torch call as a ProducerCall; see Note [Producers and replay]."""

    def __init__(self, session: "ActivationOffload") -> None:
        super().__init__()
        self.session = session

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if _is_compiling():  # first: dynamo must not trace the session's state
            return func(*args, **kwargs)
        s = self.session
        if s._mode_stack is not None and (trace := s._trace_entries()) is not None:
            # the process-wide session traces selective regions here, not in a second mode
            # stacked on this one (Note [Call traces] in guard.py)
            trace.append(entry(func, args, kwargs))
        if not s._recording or s._replaying or s._inert or not s.recompute or func in s._passthrough:
            return func(*args, **kwargs)
        calls = s._calls
        t0 = clock.now()
        timed = calls.func_seconds
        profile = s._profile
        if profile is None:
            result = calls.record(func, args, kwargs, s._pack_seq, s._by_tensor.get)
        else:  # the recording's own operators are not the model's (Note [Selective re-runs])
            def run(*a: Any, **k: Any) -> Any:
                profile.busy = False
                try:
                    return func(*a, **k)
                finally:
                    profile.busy = True

            busy, profile.busy = profile.busy, True
            try:
                result = calls.record(func, args, kwargs, s._pack_seq, s._by_tensor.get, run)
            finally:
                profile.busy = busy
        if calls.func_seconds != timed:  # recorded: the rest of the time was the recording's
            s._overhead_s += clock.now() - t0 - (calls.func_seconds - timed)
        return result


class CallRecorder:
    """The calls of the current step, and which call made which tensor.

    Call records are per step (:meth:`new_step`): a record that outlived its step would chain
    every later step's inputs to it.
    """

    def __init__(self, cuda: bool) -> None:
        self._cuda = cuda
        self.func_seconds = 0.0  # time in recorded calls themselves, for the session's overhead
        self.new_step()

    def new_step(self) -> None:
        self.producers = TensorMap()  # tensor -> (call, index, version)
        self.current: list[tuple[ProducerCall, list[torch.Tensor]]] = []  # calls running now, innermost last
        self._last_rng: torch.Tensor | None = None
        self._last_rng_bytes = b""

    def _capture_rng(self) -> torch.Tensor:
        state = torch.get_rng_state()
        raw = state.numpy().tobytes()  # a bytes compare is ~3x cheaper than torch.equal
        if raw == self._last_rng_bytes and self._last_rng is not None:
            return self._last_rng  # share the snapshot: only random calls add memory
        self._last_rng, self._last_rng_bytes = state, raw
        return state

    def record(self, func: Callable[..., Any], args: tuple, kwargs: dict, pack_seq: int,
               handle_of: Callable[[torch.Tensor], "weakref.ref[SavedActivation] | None"],
               run: Callable[..., Any] | None = None) -> Any:
        """Runs ``func`` (through ``run`` if given) and records it as a ProducerCall;
        ``pack_seq`` is the session's count of packs so far, ``handle_of`` finds the handle a
        tensor was packed as."""
        run = run or func
        kind = _call_kind(func)
        if kind == _PASS or not torch.is_grad_enabled():
            # Outputs made with grad off are leaves: a later call holds them as Kept inputs.
            return run(*args, **kwargs)
        leaves, spec = flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not tensors and not getattr(func, "__name__", "").startswith(("rand", "normal", "bernoulli")):
            return run(*args, **kwargs)
        refs: list[Any] = []
        # a generator given to the call has moved on since: a re-run would draw other numbers; a
        # call with hidden effects (``x.add_(y)``) or told to write its input (``inplace=True``,
        # ``out=``) is never replayed, known before it runs, since DTR may drop what it saves
        # while it runs (an in-place SiLU saves a copy of its input, which the profiled step of
        # ``budget=1`` dropped at once and then could not regenerate: a review, 2026-11-28); a
        # call that writes an input without saying so is found when it returns (versions)
        replayable = kind != _NO_REPLAY and kwargs.get("inplace") is not True and kwargs.get("out") is None \
            and not any(isinstance(x, torch.Generator) for x in leaves)
        seen: dict[int, Any] = {}  # one ref per tensor object: `query is key` must hold on replay
        for x in leaves:
            if not isinstance(x, torch.Tensor):
                refs.append(x)
                continue
            if id(x) in seen:
                refs.append(seen[id(x)])
                continue
            prod = self.producers.get(x)
            if prod is not None and prod[2] == x._version:
                refs.append(Produced(prod[0], prod[1], prod[2], x.requires_grad))
            elif x.is_leaf:
                refs.append(Kept(x, x._version, x.requires_grad))
            else:
                refs.append(None)
                replayable = False
            seen[id(x)] = refs[-1]
        call = ProducerCall(func, spec, refs, self._capture_rng(), rng.cuda_states(tensors, self._cuda),
                            torch.is_grad_enabled(), replayable=replayable, autocast=autocast_state())
        versions = [t._version for t in tensors]
        call.pack_start = pack_seq
        self.current.append((call, tensors))
        t0 = time.perf_counter()
        c0 = clock.now()
        try:
            result = run(*args, **kwargs)
        finally:
            self.current.pop()
        call.cost_s = time.perf_counter() - t0
        self.func_seconds += clock.now() - c0
        if kind == _NO_REPLAY or any(t._version != v for t, v in zip(tensors, versions)):
            call.replayable = False  # it mutated state: replaying would mutate it again
        out_leaves, _ = flatten(result)
        input_ids = {id(t) for t in tensors}
        for i, o in enumerate(out_leaves):
            if isinstance(o, torch.Tensor) and id(o) not in input_ids:
                call.outputs.append(weakref.ref(o))
                call.output_versions.append(o._version)
                if call.replayable and o not in self.producers:
                    self.producers[o] = (call, i, o._version)
                    ref = handle_of(o)  # packed while the call ran (relu saves its result)
                    if ref is not None:
                        call.out_handles[i] = ref
            else:
                call.outputs.append(None)
                call.output_versions.append(-1)
        return result


def replay_call(call: ProducerCall, leaves: list[Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """Re-runs ``call`` on ``leaves`` (its arguments, resolved) bit for bit: the same grad mode,
    ``requires_grad`` flags and RNG state. Returns its outputs, flattened, and the tensors autograd
    packed while it ran."""
    args, kwargs = unflatten(leaves, call.spec)
    packs: list[torch.Tensor] = []

    def capture(t: torch.Tensor) -> None:
        # Store nothing in the replay's graph: it is never run backward, and a node that saves its
        # own output would otherwise keep itself (and its saves) alive through a reference cycle
        # in C++ that no collector breaks (about a step's activations leaked per step).
        packs.append(t.detach())

    with contextlib.ExitStack() as modes:
        modes.enter_context(rng.replayed(call.rng_state, call.cuda_rng))
        modes.enter_context(autocast_as(call.autocast))  # (backward, where replays run, usually has none)
        modes.enter_context(torch.autograd.graph.saved_tensors_hooks(capture, lambda x: x))
        modes.enter_context(torch.set_grad_enabled(call.grad_enabled))
        result = call.func(*args, **kwargs)
    outputs, _ = flatten(result)
    return outputs, packs
