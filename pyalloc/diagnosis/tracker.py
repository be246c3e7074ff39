"""The storage tracker: every storage an operator creates, who made it, and when it dies.

Note [Doctor's storage tracking]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
As in Note [Meta recordings] (pyalloc/traces/meta.py), a TorchDispatchMode sees the outputs
of every operator the thread runs, on any device: an output whose storage it has not seen is
a new storage, and a weak reference to the UntypedStorage, whose Python object lives exactly
as long as the storage, tells when it dies. Nothing samples process memory, so CPU and CUDA
tensors are measured alike, and per device by ``tensor.device``.

For each live storage it keeps a small record (``StorageRecord``): bytes, device, the site
that made it (the first frame of the user's own code, ``sites.SiteTable``), the iteration it
was made in, whether it holds float32, and a weak reference to the tensor that first showed
it (to tell later what keeps it). Its own memory is therefore proportional to the program's
live storages, plus a bounded table of sites and of iteration boundaries (``growth``).

Saved activations: a ``saved_tensors_hooks`` pair wraps every tensor autograd saves for
backward in a ``SavedRef``, which autograd holds instead of the tensor; the wrapper dies when
autograd releases the saved tensor (its node ran, or its graph died), so a storage is "saved"
exactly while one of its wrappers lives. The wrapper also records the top-level module (and
its direct child) running when the tensor was saved, through global module forward hooks,
and whether that module was in training mode.

Backward on CPU runs on the thread that called it, so the mode sees gradients and names the
``backward()`` line; CUDA backward runs on autograd's device threads, which inherit the mode
but have no user frame: what they make is attributed to the ``backward()`` line the session
recorded when backward began (``fallback_site``; not run here, there is no GPU).

Dispatch modes and saved-tensor hooks are per thread: the tracker is entered on the thread that
started it, and on every thread the program starts while it runs, through a ``ThreadMode`` of
that thread (Note [Doctor's threads] in ``threads.py``). All of them write to this one tracker,
so its books are kept under ``lock``; the module stack is the thread's own (``thread``), seeded
with the module stack of the thread that started it, so what a DataParallel replica saves on
its thread belongs to the model DataParallel wraps.

The death callback only keeps the books. It runs while a storage is being freed, possibly in
the middle of PyTorch's own code: breaking the peak down there (reading ``.grad`` while
``zero_grad`` is setting it to None) crashed the interpreter when tried. So a peak is broken down
when it is reached, in ``note``, after the operator that made it returned.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .._finalizers import finalize
from .sites import SiteTable

# A new peak is broken down in full (owners.breakdown) each time while the program has at most
# this many live storages; above it, only when the peak grew by PEAK_STEP_FRACTION since the
# last breakdown, which bounds the cost to a few dozen breakdowns per step.
EXACT_PEAK_STORAGES = 4096
PEAK_STEP_FRACTION = 1 / 64


class StorageRecord:
    __slots__ = ("size", "device", "site", "iteration", "fp32", "tensor", "ref")

    def __init__(self, size: int, device: str, site: int, iteration: int, fp32: bool,
                 tensor: "weakref.ref[torch.Tensor] | None") -> None:
        self.size = size
        self.device = device
        self.site = site
        self.iteration = iteration
        self.fp32 = fp32
        self.tensor = tensor
        self.ref: Any = None  # weak reference to the UntypedStorage, with the death callback


class SavedRef:
    """What autograd keeps instead of a saved tensor, while it keeps it."""

    __slots__ = ("tensor", "key", "tracker", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key: int, tracker: "StorageTracker") -> None:
        self.tensor = tensor
        self.key = key
        self.tracker = tracker

    def __del__(self) -> None:
        finalize(self.tracker._unsaved, self.key)


class SavedOwner:
    """Who saved a storage for backward: the top-level module, its direct child, training mode."""

    __slots__ = ("top", "child", "training", "iteration")

    def __init__(self, top: str, child: str, training: bool, iteration: int) -> None:
        self.top = top
        self.child = child
        self.training = training
        self.iteration = iteration


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DataParallel or DistributedDataParallel, which name it `module`, or inside
    torch.compile's OptimizedModule, which names it `_orig_mod`."""
    wrappers = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    inner = getattr(module, "module", None)
    if isinstance(module, wrappers) and isinstance(inner, torch.nn.Module):
        return inner
    if type(module).__name__ == "OptimizedModule":
        inner = getattr(module, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            return inner
    return module


class ThreadState(threading.local):
    """What the tracker keeps per thread: the modules whose forward runs on it, outermost first;
    for a watched thread, the site of the ``Thread.start()`` call (the site of what the thread
    makes with no user frame of its own) and the modules that were running where it was started
    (``inherited``), which count as running around its own while the starting thread is still
    inside them (``inherited_valid``): a pool's thread outlives the forward it was started in."""

    def __init__(self) -> None:
        self.module_stack: list[torch.nn.Module] = []
        self.start_site: int | None = None
        self.inherited: list[torch.nn.Module] = []
        self._parent_stack: list[torch.nn.Module] = []  # the starting thread's own module_stack
        self._parent_depth = 0  # its length when this thread started

    def inheritance(self) -> tuple[list[torch.nn.Module], list[torch.nn.Module], int]:
        """What a thread started from this one inherits (read on this thread)."""
        return list(self.modules()), self.module_stack, len(self.module_stack)

    def adopt(self, inherited: tuple[list[torch.nn.Module], list[torch.nn.Module], int],
              start_site: int | None) -> None:
        self.inherited, self._parent_stack, self._parent_depth = inherited
        self.start_site = start_site

    def inherited_valid(self) -> bool:
        if not self.inherited:
            return False
        depth = self._parent_depth
        if depth == 0:  # the starting thread had inherited them too: cannot tell, kept
            return True
        try:
            return len(self._parent_stack) >= depth and self._parent_stack[depth - 1] is self.inherited[-1]
        except IndexError:  # the starting thread left a module meanwhile
            return False

    def modules(self) -> list[torch.nn.Module]:
        """The running modules, outermost first, the inherited ones included while valid."""
        if self.inherited_valid():
            return self.inherited + self.module_stack
        return self.module_stack


def storage_key(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except Exception:  # sparse, nested, or a subclass without a storage
        return None


class StorageTracker(TorchDispatchMode):
    """Live storages by site and device; see Note [Doctor's storage tracking]."""

    def __init__(self, sites: SiteTable, on_new_peak: Callable[[], None]) -> None:
        super().__init__()
        self.sites = sites
        self.on_new_peak = on_new_peak
        self.live: dict[int, StorageRecord] = {}
        self.site_live: dict[int, int] = {}
        self.device_live: dict[str, int] = {}
        self.device_peak: dict[str, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.broken_down_at = 0  # live bytes at the last breakdown of a peak
        self.iteration = 0  # iterations completed (set by the session)
        self.storages_seen = 0
        # saved for backward (saved_tensors_hooks)
        self.saved_count: dict[int, int] = {}
        self.saved_owner: dict[int, SavedOwner] = {}
        # module context (global forward hooks), per thread
        self.thread = ThreadState()
        self.top_modules: dict[int, tuple["weakref.ref[torch.nn.Module]", str]] = {}
        self._child_names: dict[int, dict[int, str]] = {}
        self._class_counts: dict[str, int] = {}
        self.paused = False
        self.fallback_site: int | None = None  # the backward() line, while a backward runs
        self.errors = 0  # exceptions inside note(), swallowed
        self.last_error = ""
        # Held while the books change or are read whole: watched threads write here at once, and
        # a storage can die on any thread. Reentrant: a peak's breakdown runs inside note().
        self.lock = threading.RLock()

    # ---- storages ----------------------------------------------------------------------------

    def note(self, t: torch.Tensor, site: int | None = None) -> None:
        try:
            storage = t.untyped_storage()
        except Exception:
            return
        key = int(storage._cdata)
        if key in self.live:
            return
        with self.lock:
            self._note(t, storage, key, site)

    def _note(self, t: torch.Tensor, storage: Any, key: int, site: int | None) -> None:
        if key in self.live:  # another thread noted it first
            return
        size = int(storage.nbytes())
        device = str(t.device)
        if site is None:
            site = self.sites.current(skip=3)
            if site == self.sites.no_user_frame:
                start_site = self.thread.start_site
                if start_site is not None:
                    site = start_site
                elif self.fallback_site is not None:
                    site = self.fallback_site
        try:
            tref: "weakref.ref[torch.Tensor] | None" = weakref.ref(t)
        except TypeError:
            tref = None
        record = StorageRecord(size, device, site, self.iteration, t.dtype == torch.float32, tref)
        record.ref = weakref.ref(storage, functools.partial(self._died, key))
        self.live[key] = record
        self.storages_seen += 1
        self.site_live[site] = self.site_live.get(site, 0) + size
        live_here = self.device_live.get(device, 0) + size
        self.device_live[device] = live_here
        if live_here > self.device_peak.get(device, 0):
            self.device_peak[device] = live_here
        self.live_bytes += size
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            if (len(self.live) <= EXACT_PEAK_STORAGES
                    or self.live_bytes >= self.broken_down_at * (1 + PEAK_STEP_FRACTION)):
                self.broken_down_at = self.live_bytes
                self.on_new_peak()

    def _died(self, key: int, _ref: object) -> None:
        with self.lock:
            self._forget(key)

    def _forget(self, key: int) -> None:
        record = self.live.pop(key, None)
        if record is None:
            return
        self.live_bytes -= record.size
        self.device_live[record.device] -= record.size
        left = self.site_live.get(record.site, 0) - record.size
        if left:
            self.site_live[record.site] = left
        else:
            self.site_live.pop(record.site, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            self.note_outputs(out)
        return out

    def note_outputs(self, out: Any) -> None:
        """Notes the storages of an operator's outputs (the dispatch mode of every thread)."""
        try:
            if isinstance(out, torch.Tensor):
                self.note(out)
            elif isinstance(out, (tuple, list)):
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        self.note(t)
        except Exception as exc:  # never break the program's operator
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"

    # ---- saved for backward --------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        key = storage_key(t)
        if key is None or self.paused:
            return t
        top, child, training = self.current_module()
        with self.lock:
            self.saved_count[key] = self.saved_count.get(key, 0) + 1
            if key not in self.saved_owner:
                self.saved_owner[key] = SavedOwner(top, child, training, self.iteration)
        return SavedRef(t, key, self)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, SavedRef) else packed

    def _unsaved(self, key: int) -> None:
        with self.lock:
            left = self.saved_count.get(key, 0) - 1
            if left > 0:
                self.saved_count[key] = left
            else:
                self.saved_count.pop(key, None)
                self.saved_owner.pop(key, None)

    # ---- module context ------------------------------------------------------------------------

    def module_pre(self, module: torch.nn.Module, _args: Any) -> None:
        state = self.thread
        stack = state.module_stack
        if not stack and not state.inherited_valid():
            ident = id(module)
            entry = self.top_modules.get(ident)
            if entry is None or entry[0]() is not module:
                with self.lock:
                    self._add_top_module(module)
        stack.append(module)

    def _add_top_module(self, module: torch.nn.Module) -> None:
        inner = _unwrapped(module)
        name = type(inner).__name__
        count = self._class_counts.get(name, 0) + 1
        self._class_counts[name] = count
        label = name if count == 1 else f"{name}#{count}"
        self.top_modules[id(module)] = (weakref.ref(module), label)
        self._child_names[id(module)] = {id(c): n for n, c in inner.named_children()}

    def module_post(self, module: torch.nn.Module, _args: Any, _out: Any) -> None:
        stack = self.thread.module_stack
        while stack:
            if stack.pop() is module:
                break

    def current_module(self) -> tuple[str, str, bool]:
        """(top-level module, its direct child or "", training) of the running forward."""
        stack = self.thread.modules()
        if not stack:
            return "(no module)", "", True  # training or not cannot be told
        top = stack[0]
        entry = self.top_modules.get(id(top))
        label = entry[1] if entry is not None else type(_unwrapped(top)).__name__
        child = ""
        names = self._child_names.get(id(top), {})
        for module in stack[1:3]:  # under DataParallel / DDP the block is the wrapped module's child
            if id(module) in names:
                child = names[id(module)]
                break
        else:
            inner = _unwrapped(top)
            if inner is not top and len(stack) > 2 and type(stack[1]) is type(inner):
                # a replica of the wrapped model, run on its own thread (DataParallel makes new
                # replicas every forward): its child by name
                child = next((n for n, c in stack[1].named_children() if c is stack[2]), "")
        return label, child, bool(top.training)

    def modules(self) -> list[torch.nn.Module]:
        out = []
        for ref, _label in list(self.top_modules.values()):
            module = ref()
            if module is not None:
                out.append(module)
        return out
