"""Host swap and recompute of saved activations under memory pressure (issue 6).

``pyalloc.offload(budget=...)`` wraps a training step. Every tensor autograd saves for backward
becomes a :class:`SavedActivation` the session tracks. When the resident saved bytes go over the
budget, or the allocator's pressure ladder (step 3) asks for memory, the session evicts the
activation with the lowest DTR score and either copies it to a reusable host buffer (swap) or
drops it and regenerates it on use by replaying the call that produced it (recompute).

Note [Producers and replay]
    A ``TorchFunctionMode`` sees every top-level torch call made inside the session (``F.linear``,
    ``F.multi_head_attention_forward``, ``Tensor.relu``, ...; calls inside a composite are not
    seen, the mode is popped while it runs). Each call becomes a :class:`ProducerCall` that
    remembers the function, its arguments (tensors as references: a leaf is kept, a tensor made
    by an earlier call is referred to through that call), the RNG state before it, grad mode,
    and how long it took. A saved tensor is recomputable when it is an output of a call, or an
    intermediate that autograd packed while a composite call ran (identified by its index among
    that call's packs). Replay re-runs the call with the same grad mode, the same
    ``requires_grad`` flags and the RNG state restored, under a capturing hook, so the same
    kernels run on the same bytes and the results are equal bit for bit (dropout masks
    included). Calls that mutate an input (in-place ops, ``out=``, batch norm's running stats)
    are never replayed: their outputs are swap-only. Not recorded at all: calls made with grad
    disabled (an optimizer step, evaluation), attribute reads and writes other than the view
    properties (``p.grad``, ``x.dtype``, ``p.grad = None``), and the autograd entry points
    (replaying ``backward`` would run it again). What such a call makes is a leaf, which a later
    call keeps as it is.

Note [Free neighbours]
    DTR's score is ``cost / (size * staleness)``; MegEngine replaces ``size`` with the size of
    the free block the eviction would open: the tensor plus its free address neighbours, so that
    evictions favour opening contiguous space. When pyalloc is the CUDA allocator the session
    asks it (``pyalloc.free_neighbours``: the free blocks just below and above the tensor's
    allocation, one C call under the device lock). Elsewhere (CPU tensors, PyTorch's own
    allocator) there is no view of address adjacency, and the term is the tensor's own span.

Note [Copies on CUDA]
    Swap copies run on a side stream per device, so they overlap compute. A swap-out makes the
    side stream wait for the compute stream (the tensor must be written before it is read),
    copies into a pinned host buffer and records an event; the session keeps the device tensor
    until that event completes (:class:`_Copy`), so its memory is not reused under the copy.
    Completed copies are reaped on later packs and unpacks and at step ends; the allocator's
    pressure callback waits for them, because it must return memory that is really free. A
    swap-in allocates on the compute stream, makes the side stream wait for it (the block may
    still be read by queued kernels), copies and records an event; the compute stream waits
    for that event only when the tensor is handed to autograd (``_unpack``), so a prefetch
    overlaps the backward nodes before it. Host buffers a copy reads or writes go back to the
    pool only when the copy is done. A swap-in requested while the tensor's swap-out is still
    in flight takes the device tensor back: no copy. On CPU every copy is synchronous.

Limits: tensors smaller than ``min_evict_bytes``, parameters, leaves and non-strided tensors are
never evicted. Evicting a tensor that something else still references frees no real memory; the
budget counts the bytes the session itself keeps resident.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["ActivationOffload", "HostBufferPool", "OffloadError", "SavedActivation", "offload"]

MIN_EVICT_BYTES = 64 << 10
"""Tensors under 64 KiB are never evicted: bookkeeping would cost more than they free."""

SWAP_BYTES_PER_S = 8e9
"""Assumed host copy bandwidth (bytes/s) for the swap-cost estimate; PCIe gen4 x16 is ~25e9."""

FLOP_BYTES_PER_S = 2e10
"""Size-based cost estimate (bytes/s) for calls that were not timed."""

MAX_REPLAY_DEPTH = 4
"""How many producer calls back a recompute may reach for missing inputs before giving up."""

PREFETCH_WINDOW = 64
"""How many handles back (in pack order) a prefetch looks for swapped ones: backward will reach
the ones further back later, and a longer scan would cost each unpack time linear in the step."""

MAX_REPLAY_CHAIN = 400
"""Hard stop for a replay chain (the estimate above may be exceeded when ancestors are evicted later)."""

F = TypeVar("F", bound=Callable[..., Any])


class OffloadError(RuntimeError):
    """Misuse of the offload session (nesting), or a dropped tensor that can't be regenerated."""


_active = threading.local()
_latest: "weakref.ref[ActivationOffload] | None" = None  # the session last started, for memory_stats()


def latest_session_stats() -> dict[str, float] | None:
    """Stats of the session started last in this process, if it is still alive (for
    ``pyalloc.memory_stats()``, which reports them as ``offload.*``)."""
    session = _latest() if _latest is not None else None
    return session.stats() if session is not None else None


def _is_compiling() -> bool:
    """True while torch.compile traces: the mode then stays out of the graph (dynamo would trace
    the recording itself, and fails to guard on it); the compiled region's saved tensors are
    packed at run time with no recorded producer, so they are swapped, never recomputed."""
    return torch.compiler.is_compiling()


def _autograd_entry_points() -> frozenset[Any]:
    """Calls that run backward: never recorded (replaying one would run backward again)."""
    return frozenset((torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad))


_HIDDEN_EFFECTS = ("batch_norm", "instance_norm", "group_norm_running")


def _has_hidden_effects(name: str) -> bool:
    """Calls that update state without bumping a version counter (batch norm's running stats),
    or in-place methods (``add_``): never replayed."""
    return any(k in name for k in _HIDDEN_EFFECTS) or (name.endswith("_") and not name.endswith("__"))


def _neighbour_query(cuda: bool) -> "Callable[[int], tuple[int, int]] | None":
    """pyalloc.free_neighbours if pyalloc is installed as the CUDA allocator, else None."""
    if not cuda:
        return None
    from . import torch_compat
    from .core import free_neighbours

    return free_neighbours if torch_compat.is_installed() else None


def _span(t: torch.Tensor) -> int:
    """Elements from the first to the last one the tensor's strides reach (0 for empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


# ---------------------------------------------------------------------------------------------
# Call arguments and tensor identity (the recording's hot path: plain dicts, no pytree registry)


class _NotPlain(Exception):
    """An argument container the plain flattener does not take apart (namedtuple, OrderedDict)."""


def _flatten_plain(obj: Any, leaves: list[Any]) -> Any:
    kind = type(obj)
    if kind is tuple or kind is list:
        return (kind, [_flatten_plain(x, leaves) for x in obj])
    if kind is dict:
        return (dict, [(k, _flatten_plain(v, leaves)) for k, v in obj.items()])
    if isinstance(obj, (tuple, list, dict)) and kind is not torch.Size:
        raise _NotPlain
    leaves.append(obj)
    return None


def _flatten(obj: Any) -> tuple[list[Any], Any]:
    """``tree_flatten`` for call arguments and results: exact tuples, lists and dicts are taken
    apart here (a few microseconds); other containers go to pytree. The same object always takes
    the same path, so output indices agree between a call and its replay."""
    leaves: list[Any] = []
    try:
        return leaves, ("plain", _flatten_plain(obj, leaves))
    except _NotPlain:
        leaves, spec = tree_flatten(obj)
        return leaves, ("pytree", spec)


def _unflatten_plain(spec: Any, leaves: Iterator[Any]) -> Any:
    if spec is None:
        return next(leaves)
    kind, children = spec
    if kind is dict:
        return {k: _unflatten_plain(c, leaves) for k, c in children}
    return kind(_unflatten_plain(c, leaves) for c in children)


def _unflatten(leaves: list[Any], spec: tuple[str, Any]) -> Any:
    how, inner = spec
    if how == "plain":
        return _unflatten_plain(inner, iter(leaves))
    return tree_unflatten(leaves, inner)


class _TensorMap:
    """tensor -> value by identity, holding the tensor weakly: an entry goes when its tensor
    dies. A dict keyed by ``id`` with a weakref callback; ``WeakIdKeyDictionary`` does the same
    with a Python-level key object per lookup, which the recording can't afford."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, t: torch.Tensor) -> Any:
        entry = self._entries.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def __contains__(self, t: torch.Tensor) -> bool:
        return self.get(t) is not None

    def __setitem__(self, t: torch.Tensor, value: Any) -> None:
        key, entries = id(t), self._entries

        def gone(ref: weakref.ref, key: int = key, entries: dict = entries) -> None:
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(t, gone), value)

    def __len__(self) -> int:
        return len(self._entries)


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
    elif _has_hidden_effects(name):
        kind = _NO_REPLAY
    else:
        kind = _RECORD
    with contextlib.suppress(TypeError):
        _call_kinds[func] = kind
    return kind


# ---------------------------------------------------------------------------------------------
# Host buffers


class HostBufferPool:
    """Reusable host buffers by power-of-two size class.

    Why: allocating pinned memory per tensor costs milliseconds (cudaHostAlloc), so swap buffers
    are kept and reused. Pinned only when CUDA is available; plain host memory otherwise.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self.reserved_bytes = 0
        self.reuses = 0

    @staticmethod
    def _size_class(nbytes: int) -> int:
        return 1 << max(12, (nbytes - 1).bit_length())

    def acquire(self, nbytes: int) -> torch.Tensor:
        cls = self._size_class(nbytes)
        bucket = self._free.get(cls)
        if bucket:
            self.reuses += 1
            return bucket.pop()
        buf = torch.empty(cls, dtype=torch.uint8, pin_memory=self.pin)
        self.reserved_bytes += cls
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self._free.setdefault(buf.numel(), []).append(buf)

    def clear(self) -> None:
        self._free.clear()
        self.reserved_bytes = 0


# ---------------------------------------------------------------------------------------------
# Producer calls


@dataclass
class _Kept:
    """A leaf argument (parameter, input batch): held as is; its version must not change."""

    tensor: torch.Tensor
    version: int
    requires_grad: bool


@dataclass
class _Produced:
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
    cuda_rng: tuple[int, torch.Tensor] | None
    grad_enabled: bool
    cost_s: float = 0.0
    replayable: bool = True
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


# ---------------------------------------------------------------------------------------------
# Saved activations


@dataclass(eq=False)
class _Copy:
    """An asynchronous copy on a side stream, and what must outlive it; see Note [Copies on CUDA]."""

    event: Any  # torch.cuda.Event recorded on the side stream after the copy
    keep: torch.Tensor | None  # the device tensor the copy reads or writes; None once done
    bufs: list[torch.Tensor]  # host buffers to return to the pool once done
    nbytes: int


RESIDENT, SWAPPED, DROPPED = "resident", "swapped", "dropped"


class SavedActivation:
    """The handle autograd keeps instead of a saved tensor.

    States: resident (holds the tensor), swapped (bytes in a host buffer), dropped (regenerated
    by replaying ``producer``). ``nbytes`` is the span the strides reach, so a restored tensor has
    the same sizes, strides and bytes as the original.
    """

    __slots__ = ("session", "tensor", "state", "nbytes", "dtype", "device", "shape", "stride",
                 "span", "evictable", "producer", "last_use", "seq", "host", "pending", "ready",
                 "pos", "__weakref__")

    def __init__(self, session: "ActivationOffload", t: torch.Tensor, seq: int) -> None:
        self.session = session
        self.tensor: torch.Tensor | None = t
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
        self.pending: _Copy | None = None  # the swap-out copy, while it may be in flight (CUDA)
        self.ready: Any = None  # event the compute stream waits on before use (CUDA swap-in)
        self.evictable = (
            t.layout == torch.strided
            and type(t) in (torch.Tensor, torch.nn.Parameter)
            and not isinstance(t, torch.nn.Parameter)
            and not t.is_leaf
            and not (t._base is not None and t._base.is_leaf)  # a view of a parameter (weight.t())
            and t.device.type in ("cpu", "cuda")
            and self.nbytes >= session.min_evict_bytes
        )

    def __del__(self) -> None:  # autograd released it (its node ran): stop counting its bytes
        try:
            self.session._forget(self)
        except Exception:
            pass


def _tensor_key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    return (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype)


class _CallTracker(TorchFunctionMode):
    """Records every top-level torch call as a ProducerCall; see Note [Producers and replay]."""

    def __init__(self, session: "ActivationOffload") -> None:
        super().__init__()
        self.session = session

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if _is_compiling():  # first: dynamo must not trace the session's state
            return func(*args, **kwargs)
        s = self.session
        if s._replaying or s._inert or not s.recompute or func in s._passthrough:
            return func(*args, **kwargs)
        return s._record_call(func, args, kwargs)


class ActivationOffload:
    """A training-step session that swaps and recomputes saved activations to stay in budget.

    Use as ``with pyalloc.offload(budget="1GiB") as session:`` around forward and backward, or as
    a decorator. ``session.stats()`` gives the counters.
    """

    def __init__(self, budget: int | str | None = None, swap: bool = True, recompute: bool = True,
                 *, min_evict_bytes: int = MIN_EVICT_BYTES, prefetch: int = 2,
                 pressure_callback: bool = True) -> None:
        if isinstance(budget, str):
            from .core import parse_size

            budget = parse_size(budget)
        if budget is not None and budget < 0:
            raise ValueError(f"budget must be a non-negative number of bytes, got {budget}")
        self.budget = budget
        self.swap = swap
        self.recompute = recompute
        self.min_evict_bytes = min_evict_bytes
        self.prefetch = prefetch
        self.pressure_callback = pressure_callback
        self._cuda = torch.cuda.is_available()
        # pyalloc.free_neighbours when pyalloc is the CUDA allocator (Note [Free neighbours]).
        self._free_neighbours: Callable[[int], tuple[int, int]] | None = _neighbour_query(self._cuda)
        self.pool = HostBufferPool(pin=self._cuda)
        self._lock = threading.RLock()
        self._busy = threading.local()
        self._stack: contextlib.ExitStack | None = None
        self._replaying = False
        self._callback_handle: int | None = None
        self._side_streams: dict[int, Any] = {}  # device index -> torch.cuda.Stream
        self._inflight: collections.deque[_Copy] = collections.deque()  # in issue order
        weakref.finalize(self, _wait_for_copies, self._inflight)
        self._passthrough = _autograd_entry_points()
        self._process_wide = False  # started by `pyalloc run --offload` (pyalloc.offload_process)
        self._inert = False  # left behind in a forked child: packs and calls pass through
        self._clock = 0
        self._pack_seq = 0
        self.resident_bytes = 0
        self.unevictable_bytes = 0
        self.swapped_bytes = 0
        self._handles: "weakref.WeakValueDictionary[int, SavedActivation]" = weakref.WeakValueDictionary()
        self._new_step()
        self._stats: dict[str, float] = {k: 0 for k in (
            "saved_tensors_total", "swap_outs_total", "swap_ins_total", "drops_total", "recomputed_tensors_total",
            "replays_total", "prefetches_total", "swap_out_bytes_total", "swap_in_bytes_total", "dropped_bytes_total",
            "swap_seconds_total", "recompute_seconds_total", "resident_bytes_peak", "evictable_resident_bytes_peak",
            "pressure_calls_total", "pressure_freed_bytes_total", "steps_total",
            "swap_outs_reverted_total")}

    # -- per-step state --------------------------------------------------------------------

    def _new_step(self) -> None:
        """Starts a step's bookkeeping. Call records and the pack order are per step (a record
        that outlived its step would chain every later step's inputs to it); handles that
        outlive the step (a retained graph, a forward never backpropagated) carry over, still
        counted and evictable. The clock and the byte counters run on."""
        live = sorted(self._handles.values(), key=lambda h: h.seq)
        self._handles = weakref.WeakValueDictionary((id(h), h) for h in live)
        self._by_tensor = _TensorMap()  # tensor -> weakref(handle)
        self._producers = _TensorMap()  # tensor -> (call, index, version)
        self._order: list[weakref.ref] = []  # pack order, for prefetch
        self._reorder(live)
        self._current: list[tuple[ProducerCall, list[torch.Tensor]]] = []
        self._last_rng: torch.Tensor | None = None
        self._last_rng_bytes = b""

    def _reorder(self, handles: list[SavedActivation]) -> None:
        self._order = [weakref.ref(h) for h in handles]
        for i, h in enumerate(handles):
            h.pos = i
        self._order_prune_at = max(1024, 2 * len(self._order))

    def end_step(self) -> None:
        """A step boundary: reaps finished copies and starts the next step's bookkeeping.

        The ``with`` form does this on exit; the process-wide session of ``pyalloc run
        --offload`` after each outermost ``backward()`` or ``autograd.grad()``.
        """
        with self._lock:
            self._reap_copies(wait=False)
            self._new_step()
            self._stats["steps_total"] += 1

    # -- context manager / decorator -------------------------------------------------------

    def __enter__(self) -> "ActivationOffload":
        global _latest
        active = getattr(_active, "session", None)
        if active is not None and active._process_wide:
            raise OffloadError("`pyalloc run --offload` already runs an offload session in this "
                               "thread: remove --offload, or the pyalloc.offload() in the program")
        if active is not None:
            raise OffloadError("pyalloc.offload is already active in this thread: nested offload "
                               "sessions are not supported (use one session around the whole step)")
        with self._lock:
            self._new_step()
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
            if self.recompute:
                stack.enter_context(_CallTracker(self))
            if self.pressure_callback:
                self._register_pressure_callback(stack)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        _active.session = self
        _latest = weakref.ref(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._leave_thread()
        self.end_step()

    def _leave_thread(self) -> None:
        """Takes the hooks and the mode off this thread's stacks; touches no device."""
        _active.session = None
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def _register_pressure_callback(self, stack: contextlib.ExitStack) -> None:
        try:
            from .core import register_pressure_callback, unregister_pressure_callback

            handle = register_pressure_callback(self.on_pressure)
        except Exception:  # no library loaded: the budget alone drives eviction
            return
        self._callback_handle = handle

        def unregister() -> None:
            self._callback_handle = None
            with contextlib.suppress(Exception):
                unregister_pressure_callback(handle)

        stack.callback(unregister)

    # -- stats -----------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """The session's counters: ``*_total`` accumulate over steps since the session was made,
        ``*_peak`` are highs, the rest are current values.

        ``swapped_out_bytes`` is what sits in host buffers now; ``swap_out_bytes_total`` and
        ``swap_in_bytes_total`` are the copy traffic each way; ``recomputed_tensors_total``
        counts dropped tensors regenerated (``replays_total`` the calls re-run for them, inputs
        included); ``evictions_total`` = swap-outs + drops. ``swap_seconds_total`` and
        ``recompute_seconds_total`` are host time spent in copies and replays (with CUDA's
        asynchronous copies, the time spent issuing them). ``budget_bytes`` is -1 without a
        budget.
        """
        st = self._stats
        out = dict(st)
        out.update(budget_bytes=self.budget if self.budget is not None else -1,
                   resident_bytes=self.resident_bytes, swapped_out_bytes=self.swapped_bytes,
                   unevictable_bytes=self.unevictable_bytes,
                   evictions_total=st["swap_outs_total"] + st["drops_total"],
                   copies_in_flight=len(self._inflight),
                   host_pool_reserved_bytes=self.pool.reserved_bytes,
                   host_pool_reuses_total=self.pool.reuses)
        return dict(sorted(out.items()))

    def _note_peak(self) -> None:
        st = self._stats
        st["resident_bytes_peak"] = max(st["resident_bytes_peak"], self.resident_bytes)
        st["evictable_resident_bytes_peak"] = max(
            st["evictable_resident_bytes_peak"], self.resident_bytes - self.unevictable_bytes)

    # -- call tracking ---------------------------------------------------------------------

    def _capture_rng(self) -> torch.Tensor:
        state = torch.get_rng_state()
        raw = state.numpy().tobytes()  # a bytes compare is ~3x cheaper than torch.equal
        if raw == self._last_rng_bytes and self._last_rng is not None:
            return self._last_rng  # share the snapshot: only random calls add memory
        self._last_rng, self._last_rng_bytes = state, raw
        return state

    def _record_call(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        kind = _call_kind(func)
        if kind == _PASS or not torch.is_grad_enabled():
            # Outputs made with grad off are leaves: a later call holds them as _Kept inputs.
            return func(*args, **kwargs)
        leaves, spec = _flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not tensors and not getattr(func, "__name__", "").startswith(("rand", "normal", "bernoulli")):
            return func(*args, **kwargs)
        refs: list[Any] = []
        replayable = True
        seen: dict[int, Any] = {}  # one ref per tensor object: `query is key` must hold on replay
        for x in leaves:
            if not isinstance(x, torch.Tensor):
                refs.append(x)
                continue
            if id(x) in seen:
                refs.append(seen[id(x)])
                continue
            prod = self._producers.get(x)
            if prod is not None and prod[2] == x._version:
                refs.append(_Produced(prod[0], prod[1], prod[2], x.requires_grad))
            elif x.is_leaf:
                refs.append(_Kept(x, x._version, x.requires_grad))
            else:
                refs.append(None)
                replayable = False
            seen[id(x)] = refs[-1]
        cuda_rng = None
        if self._cuda and any(t.is_cuda for t in tensors):
            dev = next(t.device.index for t in tensors if t.is_cuda) or 0
            cuda_rng = (dev, torch.cuda.get_rng_state(dev))
        call = ProducerCall(func, spec, refs, self._capture_rng(), cuda_rng,
                            torch.is_grad_enabled(), replayable=replayable)
        versions = [t._version for t in tensors]
        call.pack_start = self._pack_seq
        self._current.append((call, tensors))
        t0 = time.perf_counter()
        try:
            result = func(*args, **kwargs)
        finally:
            self._current.pop()
        call.cost_s = time.perf_counter() - t0
        if kind == _NO_REPLAY or any(t._version != v for t, v in zip(tensors, versions)):
            call.replayable = False  # it mutated state: replaying would mutate it again
        out_leaves, _ = _flatten(result)
        input_ids = {id(t) for t in tensors}
        for i, o in enumerate(out_leaves):
            if isinstance(o, torch.Tensor) and id(o) not in input_ids:
                call.outputs.append(weakref.ref(o))
                call.output_versions.append(o._version)
                if call.replayable and o not in self._producers:
                    self._producers[o] = (call, i, o._version)
                    ref = self._by_tensor.get(o)  # packed while the call ran (relu saves its result)
                    if ref is not None:
                        call.out_handles[i] = ref
            else:
                call.outputs.append(None)
                call.output_versions.append(-1)
        return result

    # -- pack / unpack ---------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        if self._replaying or self._inert:
            return t
        with self._lock:
            if self._inflight:
                self._reap_copies(wait=False)
            self._pack_seq += 1
            self._clock += 1
            self._stats["saved_tensors_total"] += 1
            ref = self._by_tensor.get(t) if isinstance(t, torch.Tensor) else None
            h = ref() if ref is not None else None
            if h is not None and h.dtype == t.dtype and h.shape == tuple(t.shape) and h.stride == tuple(t.stride()):
                if h.state != RESIDENT:
                    self._make_resident(h, t)  # alive anyway: holding it costs nothing extra
                h.last_use = self._clock
                return h
            h = SavedActivation(self, t, self._clock)
            self._attribute(h, t)
            self._handles[id(h)] = h
            self._by_tensor[t] = weakref.ref(h)  # weak: the handle holds the key tensor
            h.pos = len(self._order)
            self._order.append(weakref.ref(h))
            if len(self._order) > self._order_prune_at:  # a step with no boundary (no backward)
                self._reorder([x for x in (r() for r in self._order) if x is not None])
            self.resident_bytes += h.nbytes
            if not h.evictable:
                self.unevictable_bytes += h.nbytes
            self._enforce_budget(exclude=None)
            self._note_peak()
            return h

    def _attribute(self, h: SavedActivation, t: torch.Tensor) -> None:
        """Finds how ``t`` could be regenerated: as a call's output, or a call's internal pack."""
        if not h.evictable:
            return
        prod = self._producers.get(t)
        if prod is not None and prod[2] == t._version:
            h.producer = (prod[0], "out", prod[1], prod[2])
            prod[0].out_handles[prod[1]] = weakref.ref(h)
            return
        if self._current:
            call, inputs = self._current[-1]
            ptr = t.untyped_storage().data_ptr()
            if any(x is t or x.untyped_storage().data_ptr() == ptr for x in inputs):
                return  # an alias of the call's own input: replay would need it first
            h.producer = (call, "pack", self._pack_seq - call.pack_start - 1, t._version)

    def _unpack(self, h: Any) -> torch.Tensor:
        if not isinstance(h, SavedActivation):
            return h
        with self._lock:
            if self._inflight:
                self._reap_copies(wait=False)
            self._clock += 1
            h.last_use = self._clock
            if h.state != RESIDENT:
                self._materialize(h, depth=0)
                self._enforce_budget(exclude=h)
            self._prefetch_before(h)
            self._note_peak()
            return self._use(h)

    @staticmethod
    def _use(h: SavedActivation) -> torch.Tensor:
        """``h``'s tensor, for use on the current stream (after its swap-in copy, on CUDA)."""
        t = h.tensor
        assert t is not None
        if h.ready is not None:
            torch.cuda.current_stream(t.device).wait_event(h.ready)
            h.ready = None
        return t

    def _forget(self, h: SavedActivation) -> None:
        with self._lock:
            if h.state == RESIDENT:
                self.resident_bytes -= h.nbytes
                if not h.evictable:
                    self.unevictable_bytes -= h.nbytes
            elif h.state == SWAPPED:
                self.swapped_bytes -= h.nbytes
            self._release_host(h)
            h.tensor = None
            h.ready = None

    # -- eviction --------------------------------------------------------------------------

    def _swap_cost(self, h: SavedActivation) -> float:
        return 2.0 * h.nbytes / SWAP_BYTES_PER_S

    def _recompute_cost(self, h: SavedActivation) -> float:
        """Seconds to regenerate ``h`` now, including producers of missing inputs (DTR's e*)."""
        if not self.recompute or h.producer is None:
            return float("inf")
        return self._call_cost(h.producer[0], 0)

    def _call_cost(self, call: ProducerCall, depth: int) -> float:
        if not call.replayable or depth > MAX_REPLAY_DEPTH:
            return float("inf")
        cost = call.cost_s
        for ref in call.leaves:
            if isinstance(ref, _Kept):
                if ref.tensor._version != ref.version:
                    return float("inf")
            elif isinstance(ref, _Produced):
                if ref.call.live_output(ref.index, ref.version) is not None:
                    continue
                h = ref.call.out_handle(ref.index)
                if h is not None and h.state == RESIDENT:
                    continue
                if h is not None and h.state == SWAPPED:
                    cost += h.nbytes / SWAP_BYTES_PER_S
                    continue
                cost += self._call_cost(ref.call, depth + 1)
        return cost

    def _score(self, h: SavedActivation) -> tuple[float, str]:
        """DTR's h = cost / (size x staleness), with MegEngine's free-neighbour term in the size,
        and the cheaper way to evict (see Note [Free neighbours])."""
        rc = self._recompute_cost(h)
        sc = self._swap_cost(h) if self.swap else float("inf")
        how = "drop" if rc <= sc else "swap"
        cost = min(rc, sc)
        staleness = self._clock - h.last_use + 1
        return cost / ((h.nbytes + self._free_neighbour_bytes(h)) * staleness), how

    def _free_neighbour_bytes(self, h: SavedActivation) -> int:
        t = h.tensor
        if self._free_neighbours is None or t is None or t.device.type != "cuda":
            return 0
        try:
            below, above = self._free_neighbours(t.untyped_storage().data_ptr())
        except Exception:  # not one of pyalloc's allocations (made before install, or foreign)
            return 0
        return below + above

    def _enforce_budget(self, exclude: SavedActivation | None) -> None:
        if self.budget is None:
            return
        while self.resident_bytes - self.unevictable_bytes > self.budget:
            if not self._evict_one(exclude):
                break

    def _evict_one(self, exclude: SavedActivation | None) -> int:
        best: tuple[float, SavedActivation, str] | None = None
        for h in list(self._handles.values()):
            if h is exclude or h.state != RESIDENT or not h.evictable:
                continue
            score, how = self._score(h)
            if score == float("inf") or (best is not None and score >= best[0]):
                continue
            best = (score, h, how)
        if best is None:
            return 0
        _, h, how = best
        if how == "drop":
            self._drop(h)
        else:
            self._swap_out(h)
        return h.nbytes

    def _leave_resident(self, h: SavedActivation) -> None:
        self.resident_bytes -= h.nbytes
        h.tensor = None
        h.ready = None  # a swap-in copy still in flight keeps its own reference (_Copy.keep)

    def _make_resident(self, h: SavedActivation, t: torch.Tensor) -> None:
        if h.state == SWAPPED:
            self.swapped_bytes -= h.nbytes
            self._release_host(h)
        h.tensor = t
        h.state = RESIDENT
        self.resident_bytes += h.nbytes

    def _release_host(self, h: SavedActivation) -> None:
        """Returns ``h``'s host buffer to the pool, or to its swap-out copy while that runs."""
        if h.host is None:
            return
        if h.pending is not None and h.pending.keep is not None:
            h.pending.bufs.append(h.host)
        else:
            self.pool.release(h.host)
        h.host = None
        h.pending = None

    def _reap_copies(self, wait: bool) -> None:
        """Releases what finished side-stream copies held; ``wait``: all of them, blocking.

        Stops at the first unfinished copy: copies on one stream finish in issue order.
        """
        while self._inflight:
            copy = self._inflight[0]
            if wait:
                copy.event.synchronize()
            elif not copy.event.query():
                return
            self._inflight.popleft()
            copy.keep = None
            bufs, copy.bufs = copy.bufs, []
            for buf in bufs:
                self.pool.release(buf)

    def _swap_out(self, h: SavedActivation) -> None:
        t = h.tensor
        assert t is not None
        t0 = time.perf_counter()
        buf = self.pool.acquire(h.nbytes)
        flat = torch.as_strided(t, (h.span,), (1,), t.storage_offset())
        dst = buf[: h.nbytes].view(h.dtype)
        if t.is_cuda:  # asynchronous; see Note [Copies on CUDA]
            event = self._copy_on_side_stream(dst, flat, t.device)
            h.pending = _Copy(event, t, [], h.nbytes)
            self._inflight.append(h.pending)
        else:
            dst.copy_(flat)
        h.host = buf
        h.state = SWAPPED
        self._leave_resident(h)
        self.swapped_bytes += h.nbytes
        st = self._stats
        st["swap_outs_total"] += 1
        st["swap_out_bytes_total"] += h.nbytes
        st["swap_seconds_total"] += time.perf_counter() - t0

    def _swap_in(self, h: SavedActivation) -> None:
        assert h.host is not None
        pending = h.pending
        if pending is not None and pending.keep is not None:
            # The swap-out copy may still run: the device tensor is intact, take it back.
            self._make_resident(h, pending.keep)
            self._stats["swap_outs_reverted_total"] += 1
            return
        t0 = time.perf_counter()
        src = h.host[: h.nbytes].view(h.dtype)
        flat = torch.empty(h.span, dtype=h.dtype, device=h.device)
        if h.device.type == "cuda":  # asynchronous; see Note [Copies on CUDA]
            event = self._copy_on_side_stream(flat, src, h.device)
            self._inflight.append(_Copy(event, flat, [h.host], h.nbytes))
            h.host = None  # back to the pool when the copy is done
            h.pending = None
        else:
            flat.copy_(src)
            event = None
        t = torch.as_strided(flat, h.shape, h.stride, 0)
        self._make_resident(h, t)
        h.ready = event
        st = self._stats
        st["swap_ins_total"] += 1
        st["swap_in_bytes_total"] += h.nbytes
        st["swap_seconds_total"] += time.perf_counter() - t0

    def _drop(self, h: SavedActivation) -> None:
        h.state = DROPPED
        self._leave_resident(h)
        self._stats["drops_total"] += 1
        self._stats["dropped_bytes_total"] += h.nbytes

    def _copy_on_side_stream(self, dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> Any:
        """Copies ``src`` into ``dst`` on the device's side stream, after the work already queued
        on the current stream; returns the event recorded after the copy."""
        side = self._stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return event

    def _stream(self, device: torch.device) -> Any:
        """The side stream for swap copies on ``device``."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._side_streams.get(index)
        if stream is None:
            stream = self._side_streams[index] = torch.cuda.Stream(device=index)
        return stream

    # -- materialize -----------------------------------------------------------------------

    def _materialize(self, h: SavedActivation, depth: int) -> None:
        if h.state == SWAPPED:
            self._swap_in(h)
        elif h.state == DROPPED:
            assert h.producer is not None
            call, kind, index, version = h.producer
            outputs, packs = self._replay(call, depth)
            t = outputs[index] if kind == "out" else packs[index]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != h.shape or tuple(t.stride()) != h.stride:
                raise OffloadError(f"replaying {call.name} did not regenerate the dropped tensor "
                                   f"(shape {h.shape}, stride {h.stride})")
            self._make_resident(h, t.detach())
            self._stats["recomputed_tensors_total"] += 1

    def _resolve(self, ref: Any, depth: int) -> Any:
        if isinstance(ref, _Kept):
            if ref.tensor._version != ref.version:
                raise OffloadError("a tensor a dropped activation depends on was modified in place")
            return ref.tensor
        if isinstance(ref, _Produced):
            t = ref.call.live_output(ref.index, ref.version)
            h = ref.call.out_handle(ref.index) if t is None else None
            if h is not None:
                if h.state != RESIDENT:
                    self._materialize(h, depth + 1)
                t = self._use(h)
            if t is None:
                outputs, _ = self._replay(ref.call, depth + 1)
                t = outputs[ref.index]
            t = t.detach()
            if ref.requires_grad:
                t.requires_grad_(True)
            return t
        return ref

    def _replay(self, call: ProducerCall, depth: int) -> tuple[list[Any], list[torch.Tensor]]:
        """Re-runs ``call`` bit for bit: same inputs, grad mode, requires_grad and RNG state."""
        if not call.replayable or depth > MAX_REPLAY_CHAIN:
            raise OffloadError(f"cannot replay {call.name} to regenerate a dropped activation")
        resolved: dict[int, Any] = {}
        leaves = []
        for r in call.leaves:
            if isinstance(r, (_Kept, _Produced)):
                if id(r) not in resolved:
                    resolved[id(r)] = self._resolve(r, depth)
                leaves.append(resolved[id(r)])
            else:
                leaves.append(r)
        args, kwargs = _unflatten(leaves, call.spec)
        packs: list[torch.Tensor] = []

        def capture(t: torch.Tensor) -> torch.Tensor:
            packs.append(t)
            return t

        t0 = time.perf_counter()
        cpu_rng = torch.get_rng_state()
        cuda_saved = torch.cuda.get_rng_state(call.cuda_rng[0]) if call.cuda_rng else None
        was_replaying, self._replaying = self._replaying, True
        try:
            if call.rng_state is not None:
                torch.set_rng_state(call.rng_state)
            if call.cuda_rng is not None:
                torch.cuda.set_rng_state(call.cuda_rng[1], call.cuda_rng[0])
            with torch.autograd.graph.saved_tensors_hooks(capture, lambda x: x), \
                    torch.set_grad_enabled(call.grad_enabled):
                result = call.func(*args, **kwargs)
        finally:
            self._replaying = was_replaying
            torch.set_rng_state(cpu_rng)
            if call.cuda_rng is not None and cuda_saved is not None:
                torch.cuda.set_rng_state(cuda_saved, call.cuda_rng[0])
        outputs, _ = _flatten(result)
        self._stats["replays_total"] += 1
        self._stats["recompute_seconds_total"] += time.perf_counter() - t0
        return outputs, packs

    def _prefetch_before(self, h: SavedActivation) -> None:
        """Backward runs in reverse pack order: swap in the next few handles ahead of their use.

        On CUDA the copy would overlap compute on the side stream; on CPU this is bookkeeping
        plus an early copy, done only while it fits the budget.
        """
        pos = h.pos
        if self.prefetch <= 0 or self.swapped_bytes == 0 or not 0 <= pos < len(self._order) \
                or self._order[pos]() is not h:
            return
        fetched = 0
        for i in range(pos - 1, max(-1, pos - 1 - PREFETCH_WINDOW), -1):
            if fetched >= self.prefetch:
                break
            other = self._order[i]()
            if other is None or other.state != SWAPPED:
                continue
            if self.budget is not None and \
                    self.resident_bytes - self.unevictable_bytes + other.nbytes > self.budget:
                break
            self._swap_in(other)
            other.last_use = self._clock
            self._stats["prefetches_total"] += 1
            fetched += 1

    # -- allocator pressure ----------------------------------------------------------------

    def on_pressure(self, device: int, bytes_needed: int) -> int:
        """The allocator's step-3 callback: evicts until ``bytes_needed`` are freed.

        Called outside the allocator lock. Never re-entrant: a call that arrives while this
        thread is already inside the session (e.g. a swap-in allocating) frees nothing.
        """
        if getattr(self._busy, "on", False):
            return 0
        if not self._lock.acquire(timeout=1.0):
            return 0
        self._busy.on = True
        try:
            self._stats["pressure_calls_total"] += 1
            freed = 0
            while freed < bytes_needed:
                n = self._evict_one(exclude=None)
                if n == 0:
                    break
                freed += n
            if self._inflight:  # the caller needs the memory now, not when the copies finish
                self._reap_copies(wait=True)
            self._stats["pressure_freed_bytes_total"] += freed
            return freed
        finally:
            self._busy.on = False
            self._lock.release()


def _wait_for_copies(inflight: "collections.deque[_Copy]") -> None:
    """At a session's collection: copies still in flight must finish before what they hold is
    freed (a swap-in writes into device memory the allocator would hand out again)."""
    for copy in inflight:
        with contextlib.suppress(Exception):
            copy.event.synchronize()
    inflight.clear()


def offload(budget: int | str | None = None, swap: bool = True, recompute: bool = True,
            **options: Any) -> ActivationOffload:
    """Swaps and recomputes saved activations to keep them within ``budget`` bytes.

    A context manager around a training step (forward and backward), or a decorator. With
    ``budget=None`` only the allocator's pressure callback triggers evictions.
    """
    return ActivationOffload(budget, swap, recompute, **options)
