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
    are never replayed: their outputs are swap-only.

Note [Free neighbours]
    DTR's score is ``cost / (size * staleness)``; MegEngine replaces ``size`` with the size of
    the free block the eviction would open (the tensor plus free neighbours). The session has no
    cheap view of address adjacency on CPU, so it uses the tensor's own span. On CUDA the same
    term could be read from ``pyalloc.snapshot()``; not done yet.

Limits: tensors smaller than ``min_evict_bytes``, parameters, leaves and non-strided tensors are
never evicted. Evicting a tensor that something else still references frees no real memory; the
budget counts the bytes the session itself keeps resident.
"""

from __future__ import annotations

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
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ActivationOffload", "HostBufferPool", "OffloadError", "SavedActivation", "offload"]

MIN_EVICT_BYTES = 64 << 10
"""Tensors under 64 KiB are never evicted: bookkeeping would cost more than they free."""

SWAP_BYTES_PER_S = 8e9
"""Assumed host copy bandwidth (bytes/s) for the swap-cost estimate; PCIe gen4 x16 is ~25e9."""

FLOP_BYTES_PER_S = 2e10
"""Size-based cost estimate (bytes/s) for calls that were not timed."""

MAX_REPLAY_DEPTH = 4
"""How many producer calls back a recompute may reach for missing inputs before giving up."""

MAX_REPLAY_CHAIN = 400
"""Hard stop for a replay chain (the estimate above may be exceeded when ancestors are evicted later)."""

F = TypeVar("F", bound=Callable[..., Any])


class OffloadError(RuntimeError):
    """Misuse of the offload session (nesting), or a dropped tensor that can't be regenerated."""


_active = threading.local()


_HIDDEN_EFFECTS = ("batch_norm", "instance_norm", "group_norm_running")


def _has_hidden_effects(name: str) -> bool:
    """Calls that update state without bumping a version counter (batch norm's running stats),
    or in-place methods (``add_``): never replayed."""
    return any(k in name for k in _HIDDEN_EFFECTS) or (name.endswith("_") and not name.endswith("__"))


def _span(t: torch.Tensor) -> int:
    """Elements from the first to the last one the tensor's strides reach (0 for empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


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


RESIDENT, SWAPPED, DROPPED = "resident", "swapped", "dropped"


class SavedActivation:
    """The handle autograd keeps instead of a saved tensor.

    States: resident (holds the tensor), swapped (bytes in a host buffer), dropped (regenerated
    by replaying ``producer``). ``nbytes`` is the span the strides reach, so a restored tensor has
    the same sizes, strides and bytes as the original.
    """

    __slots__ = ("session", "tensor", "state", "nbytes", "dtype", "device", "shape", "stride",
                 "span", "evictable", "producer", "last_use", "seq", "host", "__weakref__")

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
        self.host: torch.Tensor | None = None
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
        s = self.session
        if s._replaying or not s.recompute:
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
        self.pool = HostBufferPool(pin=torch.cuda.is_available())
        self._lock = threading.RLock()
        self._busy = threading.local()
        self._stack: contextlib.ExitStack | None = None
        self._replaying = False
        self._callback_handle: int | None = None
        self._side_stream: Any = None
        self._reset_step()
        self._stats: dict[str, float] = {k: 0 for k in (
            "num_packed", "num_swapped_out", "num_swapped_in", "num_dropped", "num_recomputed",
            "num_replays", "num_prefetched", "swap_out_bytes", "swap_in_bytes", "dropped_bytes",
            "swap_time_s", "recompute_time_s", "peak_resident_bytes", "peak_evictable_resident_bytes",
            "pressure_calls", "pressure_freed_bytes")}

    # -- per-step state --------------------------------------------------------------------

    def _reset_step(self) -> None:
        self._handles: "weakref.WeakValueDictionary[int, SavedActivation]" = weakref.WeakValueDictionary()
        self._by_tensor: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> weakref(handle)
        self._producers: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> (call, index, version)
        self._order: list[weakref.ref] = []  # handles in pack order, for prefetch
        self._clock = 0
        self._pack_seq = 0
        self._current: list[tuple[ProducerCall, list[torch.Tensor]]] = []
        self._last_rng: torch.Tensor | None = None
        self.resident_bytes = 0
        self.unevictable_bytes = 0
        self.swapped_bytes = 0

    # -- context manager / decorator -------------------------------------------------------

    def __enter__(self) -> "ActivationOffload":
        if getattr(_active, "session", None) is not None:
            raise OffloadError("pyalloc.offload is already active in this thread: nested offload "
                               "sessions are not supported (use one session around the whole step)")
        self._reset_step()
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
        return self

    def __exit__(self, *exc: Any) -> None:
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
        """Counters since the session was made (they accumulate over steps) plus current bytes."""
        out = dict(self._stats)
        out.update(budget=self.budget if self.budget is not None else -1,
                   resident_bytes=self.resident_bytes, swapped_bytes=self.swapped_bytes,
                   unevictable_bytes=self.unevictable_bytes,
                   host_pool_reserved_bytes=self.pool.reserved_bytes, host_pool_reuses=self.pool.reuses)
        return out

    def _note_peak(self) -> None:
        st = self._stats
        st["peak_resident_bytes"] = max(st["peak_resident_bytes"], self.resident_bytes)
        st["peak_evictable_resident_bytes"] = max(
            st["peak_evictable_resident_bytes"], self.resident_bytes - self.unevictable_bytes)

    # -- call tracking ---------------------------------------------------------------------

    def _capture_rng(self) -> torch.Tensor:
        state = torch.get_rng_state()
        last = self._last_rng
        if last is not None and torch.equal(last, state):
            return last  # share the snapshot: only random calls add memory
        self._last_rng = state
        return state

    def _record_call(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
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
        if torch.cuda.is_available() and any(t.is_cuda for t in tensors):
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
        if any(t._version != v for t, v in zip(tensors, versions)) or _has_hidden_effects(call.name):
            call.replayable = False  # it mutated state: replaying would mutate it again
        out_leaves, _ = tree_flatten(result)
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
        if self._replaying:
            return t
        with self._lock:
            self._pack_seq += 1
            self._clock += 1
            self._stats["num_packed"] += 1
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
            self._order.append(weakref.ref(h))
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
            self._clock += 1
            h.last_use = self._clock
            if h.state != RESIDENT:
                self._materialize(h, depth=0)
                self._enforce_budget(exclude=h)
            self._prefetch_before(h)
            self._note_peak()
            assert h.tensor is not None
            return h.tensor

    def _forget(self, h: SavedActivation) -> None:
        with self._lock:
            if h.state == RESIDENT:
                self.resident_bytes -= h.nbytes
                if not h.evictable:
                    self.unevictable_bytes -= h.nbytes
            elif h.state == SWAPPED:
                self.swapped_bytes -= h.nbytes
            if h.host is not None:
                self.pool.release(h.host)
                h.host = None
            h.tensor = None

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
        """DTR's h = cost / (size x staleness), and the cheaper way to evict (see Note [Free neighbours])."""
        rc = self._recompute_cost(h)
        sc = self._swap_cost(h) if self.swap else float("inf")
        how = "drop" if rc <= sc else "swap"
        cost = min(rc, sc)
        staleness = self._clock - h.last_use + 1
        return cost / (h.nbytes * staleness), how

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

    def _make_resident(self, h: SavedActivation, t: torch.Tensor) -> None:
        if h.state == SWAPPED:
            self.swapped_bytes -= h.nbytes
            if h.host is not None:
                self.pool.release(h.host)
                h.host = None
        h.tensor = t
        h.state = RESIDENT
        self.resident_bytes += h.nbytes

    def _swap_out(self, h: SavedActivation) -> None:
        t = h.tensor
        assert t is not None
        t0 = time.perf_counter()
        buf = self.pool.acquire(h.nbytes)
        flat = torch.as_strided(t, (h.span,), (1,), t.storage_offset())
        dst = buf[: h.nbytes].view(h.dtype)
        if t.is_cuda:
            stream = self._stream()
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                dst.copy_(flat, non_blocking=True)
                t.record_stream(stream)
            stream.synchronize()  # TODO: an event per handle would let the copy overlap compute
        else:
            dst.copy_(flat)
        h.host = buf
        h.state = SWAPPED
        self._leave_resident(h)
        self.swapped_bytes += h.nbytes
        st = self._stats
        st["num_swapped_out"] += 1
        st["swap_out_bytes"] += h.nbytes
        st["swap_time_s"] += time.perf_counter() - t0

    def _swap_in(self, h: SavedActivation) -> None:
        assert h.host is not None
        t0 = time.perf_counter()
        src = h.host[: h.nbytes].view(h.dtype)
        flat = torch.empty(h.span, dtype=h.dtype, device=h.device)
        if h.device.type == "cuda":
            stream = self._stream()
            with torch.cuda.stream(stream):
                flat.copy_(src, non_blocking=True)
            torch.cuda.current_stream(h.device).wait_stream(stream)
        else:
            flat.copy_(src)
        t = torch.as_strided(flat, h.shape, h.stride, 0)
        self._make_resident(h, t)
        st = self._stats
        st["num_swapped_in"] += 1
        st["swap_in_bytes"] += h.nbytes
        st["swap_time_s"] += time.perf_counter() - t0

    def _drop(self, h: SavedActivation) -> None:
        h.state = DROPPED
        self._leave_resident(h)
        self._stats["num_dropped"] += 1
        self._stats["dropped_bytes"] += h.nbytes

    def _stream(self) -> Any:
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        return self._side_stream

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
            self._stats["num_recomputed"] += 1

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
                t = h.tensor
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
        args, kwargs = tree_unflatten(leaves, call.spec)
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
        outputs, _ = tree_flatten(result)
        self._stats["num_replays"] += 1
        self._stats["recompute_time_s"] += time.perf_counter() - t0
        return outputs, packs

    def _prefetch_before(self, h: SavedActivation) -> None:
        """Backward runs in reverse pack order: swap in the next few handles ahead of their use.

        On CUDA the copy would overlap compute on the side stream; on CPU this is bookkeeping
        plus an early copy, done only while it fits the budget.
        """
        if self.prefetch <= 0:
            return
        try:
            pos = next(i for i in range(len(self._order) - 1, -1, -1) if self._order[i]() is h)
        except StopIteration:
            return
        fetched = 0
        for i in range(pos - 1, -1, -1):
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
            self._stats["num_prefetched"] += 1
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
            self._stats["pressure_calls"] += 1
            freed = 0
            while freed < bytes_needed:
                n = self._evict_one(exclude=None)
                if n == 0:
                    break
                freed += n
            self._stats["pressure_freed_bytes"] += freed
            return freed
        finally:
            self._busy.on = False
            self._lock.release()


def offload(budget: int | str | None = None, swap: bool = True, recompute: bool = True,
            **options: Any) -> ActivationOffload:
    """Swaps and recomputes saved activations to keep them within ``budget`` bytes.

    A context manager around a training step (forward and backward), or a decorator. With
    ``budget=None`` only the allocator's pressure callback triggers evictions.
    """
    return ActivationOffload(budget, swap, recompute, **options)
