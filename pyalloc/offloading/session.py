"""An offload session: swap and recompute of saved activations under memory pressure (issues 6, 20).

``pyalloc.offload(budget=...)`` wraps a training step. Two policies:

- ``plan`` (the default with a budget and recompute on): the first step is profiled (run under
  DTR, below, which keeps what it can evict within the budget too); later steps drop what a plan names and
  recompute it by re-running modules, with nothing recorded per operator (Note [Planned
  recompute] in :mod:`.plan`; :mod:`.regions` runs it). Recompute only: on CPU a swap to host
  memory frees nothing, and on CUDA ``policy="dtr"`` swaps.
- ``dtr`` (without a budget, swap-only sessions, or asked for): every tensor autograd saves for
  backward becomes a :class:`SavedActivation` the session tracks. When the resident saved bytes
  go over the budget, or the allocator's pressure ladder (step 3) asks for memory, the session
  evicts the activation with the lowest DTR score (:mod:`.cost`) and either copies it to a
  reusable host buffer (swap, :mod:`.swap`) or drops it and regenerates it on use by replaying
  the call that produced it (recompute, :mod:`.calls`).

Limits: tensors smaller than ``min_evict_bytes``, parameters, non-strided tensors and leaves the
step did not make are never evicted (Note [Leaves DTR evicts]). Evicting a tensor that something
else still references frees no real memory; the budget counts the bytes the session itself keeps
resident, the ones it cannot evict included (over the budget by themselves, they are DTR's floor:
said once, with an :class:`OffloadFloorWarning`).

Note [Leaves DTR evicts]
    Tensors without history (leaves) are much of what a step saves on some models: a CPU
    dropout's noise, an LSTM's oneDNN workspaces (Note [Step-made leaves] in plan.py). DTR used to
    keep every leaf, as if all were parameters or the input batch, so its steps held the budget
    in what it could evict and those leaves on top: at half the saved bytes, everything it held
    (parameters and batch included) peaked at 0.67, 0.82, 0.51 and 1.11 of the plain step's saved
    bytes on the benchmark's GPT-like, BERT-like, ResNet-like and LSTM models (2026-11-29). A leaf
    that does not require grad is evicted like any save when a recorded call made it: as that
    call's output (``torch.rand_like(h)``, ``x > 0``) or saved while the call ran,
    not an alias of its inputs (the noise ``dropout`` draws and saves inside ``native_dropout``);
    the call's replay regenerates it, the generator's state replayed. Other leaves (the batch,
    buffers, a table built before the step, what the program made with grad off or with a
    constructor, ``torch.zeros(n)``, that nothing records) stay and are not counted: nothing
    could regenerate them, and most are held by something else anyway. A workspace's unused
    bytes are whatever the allocator left there, so the recompute check compares byte tensors by
    layout only (Note [Recompute check] in check.py). At half the saved bytes the four models'
    DTR steps now peak at 0.49-0.50 of the plain step's saved bytes in what counts
    (``counted_resident_bytes_peak``), 0.51-0.61 with parameters and batch.

Note [Plans per shape]
    A plan is for one profile: its saves, by shape, in order. A loader that takes turns among a
    few sequence lengths (buckets) made every step after the first differ from the profile, keep
    every save, and have the next step profiled: alternating lengths 8 and 12, the steps took
    turns, a profile and a planned step that kept everything, and after three the session fell
    back to DTR. Now the session keeps the plan searches of the last ``MAX_PLANS`` profiles, by
    the module and input shapes of their first root call (the model's). A step's first root
    call picks the plan kept for its inputs (:class:`~.regions.PlanChooser`, a pre-forward hook
    that runs before anything is saved; ``PlannedStep.retarget`` takes the other plan, hooking
    its modules) and the plan search goes on for that shape only (``plan_switches_total``). A
    shape with no plan kept runs as before (it keeps every save from where it differs, and the
    next step is profiled) and is wanted: a profiled step whose shapes already have a plan is let
    go at its first root call while another shape is wanted (``profiles_let_go_total``): its
    profile stops, and it runs on under DTR, which keeps the budget. After ``MAX_PLANS`` such
    steps in a row, or when nothing is wanted, the next step runs under the plans kept. Such
    steps do not count as unsettled while there is room for the new shape's plan; once
    ``MAX_PLANS`` plans are kept, three steps of shapes past them send the session to DTR (Note
    [Unsettled steps]). Lengths 8 and 12 taking turns: a profile of each, a planned step that
    differed and one let go, and every step after under its own shape's plan
    (tests/test_offload_state.py). What is not seen: a shape that only a later root call or a
    keyword tensor of another call has (a step differs there, as before).

Note [Unsettled steps]
    A planned step that differs from its profile (a mixture of experts that routes otherwise,
    or input shapes past the plans kept: Note [Plans per shape]) keeps every save from where it
    differs, and the next step is profiled again. Steps that keep differing (a loader with
    dynamic padding, more shapes taking turns than plans are kept) used to alternate forever: a
    profiled step, under DTR with every operator recorded, then a planned step that differed
    and kept every save, the budget broken on every other step (on a GPU, the out-of-memory
    error the budget was there to prevent). After
    ``UNSETTLED_WARN_AFTER`` such steps in a row the session runs the next
    ``UNSETTLED_DTR_STEPS`` steps under per-operator DTR alone (no profile, nothing recorded
    for a plan): the saves stay within the budget on any graph, above DTR's floor (Note [Leaves
    DTR evicts]), at DTR's cost on every operator. Then a step is
    profiled again; the planned step after it either matches (the workload settled, and plans
    apply again) or differs once more, and DTR takes the next steps at once. The session says
    so once (:class:`OffloadUnsettledWarning`); ``unsettled_dtr_steps_total`` counts the steps.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import numbers
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterator, TypeVar

import torch

from ..core import add_stats_source
from ..sizes import parse_size
from . import clock, cost, refills
from .args import TensorMap
from .check import RecomputeCheck, enabled_by_environment as check_env
from .calls import CallRecorder, CallTracker, Kept, ProducerCall, Produced, autograd_entry_points, replay_call
from .plan import OUTPUT, CallInfo, Plan, PlanSearch, Profile
from .guard import CallTrace
from .regions import IdleStep, PlanChooser, PlannedStep
from .saved import ABANDONED, ABANDONED_MESSAGE, DROPPED, RESIDENT, SWAPPED, SavedActivation
from .swap import Copy, HostSwap

__all__ = ["ActivationOffload", "OffloadError", "OffloadFloorWarning", "POLICIES", "latest_session_stats", "offload"]

MIN_EVICT_BYTES = 64 << 10
"""Tensors under 64 KiB are never evicted: bookkeeping would cost more than they free."""

PREFETCH_WINDOW = 64
"""How many handles back (in pack order) a prefetch looks for swapped ones: backward will reach
the ones further back later, and a longer scan would cost each unpack time linear in the step."""

MAX_REPLAY_CHAIN = 400
"""Hard stop for a replay chain (cost.MAX_REPLAY_DEPTH, the estimate's limit, may be exceeded when
ancestors are evicted later)."""

REPLAY_CHECK_EVERY = 20
"""Planned steps between two whose selective regions re-run through the module's own code,
checking the replays' operators and arguments (Note [Operator replay] in ops.py)."""

COUNT_EVERY = 20
"""Once the plan search settled, planned steps between two whose kept saves are counted (the
first settled step is): the count gives ``step_saved_bytes_peak``; a step like the last counted
one under the same plan holds the same bytes, and the count is most of what a save costs."""

IDLE_CHECK_EVERY = 50
"""Idle steps (Note [Idle steps] in plan.py) between two steps whose saves are counted again."""

POLICIES = ("plan", "dtr")
"""``plan``: profile the first step, then drop and recompute by module along a plan (Note
[Planned recompute] in plan.py); ``dtr``: per-operator DTR with swap, every step."""

F = TypeVar("F", bound=Callable[..., Any])


class OffloadFloorWarning(UserWarning):
    """The budget is below the bytes the plan cannot drop: the step runs at that floor."""


class OffloadUnsettledWarning(UserWarning):
    """Steps keep differing from the profiled one, so the plan never applies: the session runs
    them under DTR (Note [Unsettled steps])."""


TRACE_CHANGES = 2
"""Planned steps whose selective region found its trace changed (a constant set anew each step:
a dropout probability annealed in Python) after which the region's call is re-run whole in every
later plan, rather than each such step having the next one profiled again (Note [Call traces] in
guard.py)."""

UNSETTLED_WARN_AFTER = 3
"""Planned steps in a row that differ from the profile (each one profiled again after) before the
session says so once, and runs ``UNSETTLED_DTR_STEPS`` steps under per-operator DTR."""

MAX_PLANS = 8
"""Plans kept for other input shapes (Note [Plans per shape])."""

ShapeKey = tuple[int, tuple[Any, ...], tuple[Any, ...]]
"""A step's first root call: its module (``id``), and its positional and keyword tensors' shapes
and dtypes."""

UNSETTLED_DTR_STEPS = 50
"""Steps run under per-operator DTR, once planned steps keep differing from the profile, before a
step is profiled again (Note [Unsettled steps])."""


class OffloadError(RuntimeError):
    """Misuse of the offload session (nesting), or a dropped tensor that can't be regenerated."""


_active = threading.local()
_latest: "weakref.ref[ActivationOffload] | None" = None  # the session last started, for memory_stats()


def latest_session_stats() -> dict[str, float] | None:
    """Stats of the session started last in this process, if it is still alive (for
    ``pyalloc.memory_stats()``, which reports them as ``offload.*``)."""
    session = _latest() if _latest is not None else None
    return session.stats() if session is not None else None


add_stats_source("offload", latest_session_stats)


class ActivationOffload:
    """A training-step session that swaps and recomputes saved activations to stay in budget.

    Use as ``with pyalloc.offload(budget="1GiB") as session:`` around forward and backward, or as
    a decorator. ``session.stats()`` gives the counters.
    """

    def __init__(self, budget: int | str | None = None, swap: bool = True, recompute: bool = True,
                 *, min_evict_bytes: int = MIN_EVICT_BYTES, prefetch: int = 2,
                 pressure_callback: bool = True, policy: str = "plan", selective: bool = True,
                 check: bool | None = None) -> None:
        if isinstance(budget, str):
            budget = parse_size(budget)  # (ValueError naming it)
        if isinstance(budget, float) and budget.is_integer():
            budget = int(budget)  # (a whole float: 2e9)
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, numbers.Integral)):
            raise ValueError(f"budget must be a whole number of bytes or a size such as '2GiB', got {budget!r}")
        if budget is not None and budget < 0:
            raise ValueError(f"budget must be a non-negative number of bytes, got {budget}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        # The plan needs a budget to plan for and recompute to plan with; otherwise DTR does it
        # all (pressure-driven eviction, swap-only sessions).
        self.policy = "plan" if policy == "plan" and budget is not None and recompute else "dtr"
        self.budget = budget
        self.swap = swap
        self.recompute = recompute
        self.min_evict_bytes = min_evict_bytes
        self.prefetch = prefetch
        self.pressure_callback = pressure_callback
        self.selective = selective  # plans may hold selective regions (Note [Selective re-runs] in ops.py)
        self._cuda = torch.cuda.is_available()
        # debug: compare every recomputed tensor with the one dropped (Note [Recompute check])
        self._check = RecomputeCheck() if (check_env() if check is None else check) else None
        # pyalloc.free_neighbours when pyalloc is the CUDA allocator (Note [Free neighbours]).
        self._free_neighbours: cost.NeighbourQuery | None = cost.neighbour_query(self._cuda)
        self._host = HostSwap(pin=self._cuda)
        self.pool = self._host.pool
        self._lock = threading.RLock()
        self._busy = threading.local()
        self._stack: contextlib.ExitStack | None = None  # this step's hooks
        # pyalloc run --offload: the call-recording mode, entered once for the program, since a
        # step ends inside backward, where the mode is off the stack (it dispatches the call)
        self._mode_stack: contextlib.ExitStack | None = None
        self._recording = False  # whether the recording mode records (DTR steps)
        self._replaying = False
        # calls replayed while one dropped tensor is regenerated, by id, with what they returned
        # (Note [One replay a call]); None outside a regeneration
        self._replayed: dict[int, tuple[list[Any], list[torch.Tensor]]] | None = None
        self._callback_handle: int | None = None
        self._calls = CallRecorder(self._cuda)
        self._trace = CallTrace(self._trace_entries)  # Note [Call traces] in guard.py
        self._passthrough = autograd_entry_points()
        self._process_wide = False  # started by `pyalloc run --offload` (pyalloc.offloading.process)
        self._inside: int | None = None  # the thread whose step runs under the session now
        self._diverged_in_a_row = 0  # planned steps that differed from the profile (_note_diverged)
        self._dtr_left = 0  # steps still to run under DTR alone (Note [Unsettled steps])
        self._dtr_step = False  # whether the step running is one of them
        self._unsettled_warned = False
        self._inert = False  # left behind in a forked child: packs and calls pass through
        self._peeking = False  # unpacks change nothing (the profile reads batch-norm statistics)
        self._probing = False  # and an unpack of what DTR evicted raises (the profile's product checks)
        self._clock = 0
        self._pack_seq = 0
        self.resident_bytes = 0
        self.unevictable_bytes = 0
        self.uncounted_bytes = 0  # resident and not counted against the budget: parameters, the batch, buffers
        self.swapped_bytes = 0
        self._handles: "weakref.WeakValueDictionary[int, SavedActivation]" = weakref.WeakValueDictionary()
        self._profile: Profile | None = None  # the step being profiled (policy "plan")
        # planned calls (by key) whose input was written after they returned, found by a planned
        # step: left out of every profile's candidates (Note [Inputs written after the call] in plan.py)
        self._written_after: set[tuple[int, int]] = set()
        # selective regions (by key) whose trace changed from their profile's, and how often; from
        # TRACE_CHANGES on, re-run whole (Note [Call traces] in guard.py)
        self._trace_changes: dict[tuple[int, int], int] = {}
        self._search: PlanSearch | None = None  # the plans for the step's inputs (the last profile's)
        # the plans of the last MAX_PLANS profiles, by their first root call's module and input
        # shapes, least recently used first (Note [Plans per shape])
        self._searches: collections.OrderedDict[ShapeKey, PlanSearch] = collections.OrderedDict()
        self._shape_new = False  # the step's first root call matched no plan kept (a shape not profiled)
        self._wanted: set[ShapeKey] = set()  # shapes whose profile is wanted (Note [Plans per shape])
        self._let_go_in_a_row = 0  # profiled steps let go in a row, of shapes whose plan is kept
        self._shapes_past_kept = 0  # planned steps of shapes not kept while MAX_PLANS plans are (_note_diverged)
        # whether the last profile saw a module change state it reads (Note [State built on the
        # first call] in plan.py)
        self._state_changed_last = False
        self._planned: PlannedStep | IdleStep | None = None  # the step running under the plan
        self._idle_run = 0  # idle steps since the last counted one
        self._replay_checks = 0  # planned steps since the search began (every REPLAY_CHECK_EVERY-th checks)
        self._settled_run = 0  # planned steps since the search settled (every COUNT_EVERY-th is counted)
        self._floor_warned = False
        self._overhead_s = 0.0  # time in the session's own bookkeeping (DTR), not the model's
        self._new_step()
        self._stats: dict[str, float] = {k: 0 for k in (
            "saved_tensors_total", "swap_outs_total", "swap_ins_total", "drops_total", "recomputed_tensors_total",
            "replays_total", "prefetches_total", "swap_out_bytes_total", "swap_in_bytes_total", "dropped_bytes_total",
            "swap_seconds_total", "recompute_seconds_total", "resident_bytes_peak", "evictable_resident_bytes_peak",
            "counted_resident_bytes_peak",
            "pressure_calls_total", "pressure_freed_bytes_total", "steps_total",
            "swap_outs_reverted_total", "profile_steps_total", "planned_steps_total", "replans_total",
            "planning_seconds_total", "unsettled_dtr_steps_total", "plan_switches_total",
            "profiles_let_go_total",
            "step_saved_bytes_peak", "idle_steps_total", "selective_fallbacks_total", "replays_stale_total",
            "rerun_buffers_changed_total",
            "recompute_checked_total", "recompute_mismatches_total", "noise_packed_total",
            *(f"{kind}_refills_total" for kind in refills.KINDS))}

    # -- per-step state --------------------------------------------------------------------

    def _new_step(self) -> None:
        """Starts a step's bookkeeping. Call records and the pack order are per step (a record
        that outlived its step would chain every later step's inputs to it); handles that
        outlive the step (a retained graph, a forward never backpropagated) carry over, still
        counted and evictable. The clock and the byte counters run on."""
        live = sorted(self._handles.values(), key=lambda h: h.seq)
        self._handles = weakref.WeakValueDictionary((id(h), h) for h in live)
        self._step_clock = self._clock  # the handles made after it are this step's (_abandon_step)
        self._by_tensor = TensorMap()  # tensor -> weakref(handle)
        self._order: list[weakref.ref] = []  # pack order, for prefetch
        self._reorder(live)
        self._calls.new_step()

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
            self._host.reap(wait=False)
            reinstall = self._process_wide and self._stack is not None
            if reinstall:
                self._stack.close()  # type: ignore[union-attr]
            if self.policy == "plan":
                self._finish_plan_step()
            self._new_step()
            self._stats["steps_total"] += 1
            if reinstall:
                self._stack = self._install()

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
            if self._inside is not None and not self._process_wide:
                raise OffloadError(f"this pyalloc.offload session runs a step on another thread (ident "
                                   f"{self._inside}) now: a session runs one step at a time; give each "
                                   "thread that trains at the same time a session of its own")
            self._new_step()
            self._inside = threading.get_ident()
        if self._process_wide and self.recompute:
            self._mode_stack = contextlib.ExitStack()
            self._mode_stack.enter_context(CallTracker(self))  # it traces too (Note [Call traces])
        try:
            self._stack = self._install()
        except BaseException:
            self._leave_thread()
            raise
        _active.session = self
        _latest = weakref.ref(self)
        return self

    def _install(self) -> contextlib.ExitStack:
        """The hooks for the coming step: the plan's (Note [Planned recompute] in plan.py), or
        DTR's with the call-recording mode (and, for policy ``plan``, the step's profile)."""
        stack = contextlib.ExitStack()
        try:
            self._recording = False
            self._shape_new = False
            planned = self.policy == "plan" and self._plan is not None
            idle = planned and len(self._searches) <= 1 and self._idle()
            settled = self._search is not None and self._search.settled
            self._dtr_step = self.policy == "plan" and not planned and self._dtr_left > 0
            profiled = self.policy == "plan" and not planned and not self._dtr_step
            if profiled:
                # the profiled step's times make the plan: on the device's clock (Note [Device
                # time] in clock.py); first in, last out (the profile's stop reads it)
                stack.enter_context(clock.device_time(self._device_wait()))
            if planned:
                if idle:
                    assert self._search is not None
                    self._planned = IdleStep(self._search.profile.roots())
                else:
                    assert self._plan is not None
                    self._planned = PlannedStep(self, self._plan, self._cuda)
                    self._planned.verify = self._replay_checks % REPLAY_CHECK_EVERY == 0
                    self._replay_checks += 1
                    self._planned.counted = not settled or self._settled_run % COUNT_EVERY == 0
                    if not settled:  # its re-runs' times judge the plan, read wherever backward runs them
                        self._planned.now = clock.reader(self._device_wait())
                    self._settled_run = self._settled_run + 1 if settled else 0
                self._planned.install(stack)
                if self._searches:  # last: its hook runs first (Note [Plans per shape])
                    PlanChooser(self._kept_roots(), self._choose).install(stack)
            else:
                if profiled:
                    whole = {key for key, n in self._trace_changes.items() if n >= TRACE_CHANGES}
                    self._profile = Profile(lambda: self._overhead_s, self._peek, self._probe, self._written_after,
                                            whole)
                    self._profile.start()
                    stack.callback(self._profile.stop)
                    if self._searches:  # a profile of shapes whose plan is kept is let go (Note [Plans per shape])
                        PlanChooser(self._kept_roots(), self._choose_profiled).install(stack)
                    # the operators: what selective regions replay, which calls draw from a
                    # generator of their own, which leaf saves the step made (plan.py's Notes
                    # [Selective re-runs], [State a re-run reads], [Step-made leaves])
                    stack.enter_context(self._profile.recorder)
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
                self._recording = self.recompute
                if self.recompute and self._mode_stack is None:
                    stack.enter_context(CallTracker(self))
            if self._profile is not None and self.selective and self._mode_stack is None:
                # last: above the recording mode, under the modes the program enters in the step
                # (where a planned step puts it around its selective regions' calls: guard.push_at)
                stack.enter_context(self._trace)
            if self.pressure_callback:
                self._register_pressure_callback(stack)
        except BaseException:
            stack.close()
            raise
        return stack

    def _kept_roots(self) -> list[torch.nn.Module]:
        """The modules of the kept plans' first root calls (the model, usually), each once."""
        roots = {id(first[0]): first[0] for first in map(_first_root, self._searches.values()) if first is not None}
        return list(roots.values())

    def _choose(self, key: ShapeKey, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """The step's first root call (Note [Plans per shape]): the step runs under the plan kept
        for its inputs' shapes; with none kept, it is a shape not profiled yet, wanted."""
        search = self._searches.get(key)
        if search is None:
            self._shape_new = True
            if len(self._wanted) < MAX_PLANS:
                self._wanted.add(key)
            return
        self._searches.move_to_end(key)
        run = self._planned
        if search is self._search or not isinstance(run, PlannedStep):
            return
        if run.retarget(search.plan, module, args, kwargs):
            self._search = search
            run.counted = run.bytes.on = True  # (a step of another plan: counted, as a first one is)
            if not search.settled:  # its re-runs' times judge the plan (as in _install)
                run.now = clock.reader(self._device_wait())
            self._stats["plan_switches_total"] += 1

    def _choose_profiled(self, key: ShapeKey, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """A profiled step's first root call (Note [Plans per shape]): of shapes whose plan is
        kept and that no other wanted profile is waiting for, the step is let go as a profile and
        runs on under DTR; the next step runs under the plans kept once nothing is wanted, or
        once ``MAX_PLANS`` such steps in a row passed without the shapes wanted."""
        search = self._searches.get(key)
        profile = self._profile
        if search is None or key in self._wanted or profile is None:
            return
        self._profile = None
        profile.stop()
        clock.stop_waiting()
        self._stats["profiles_let_go_total"] += 1
        self._let_go_in_a_row += 1
        if not self._wanted or self._let_go_in_a_row >= MAX_PLANS:
            self._wanted.clear()
            self._let_go_in_a_row = 0
            self._search = search  # the next step runs under the plans kept

    def _keep(self, search: PlanSearch) -> None:
        """Keeps ``search`` for the shapes of its profile's first root call, the least recently
        used one let go past ``MAX_PLANS``."""
        first = _first_root(search)
        if first is None:
            return
        m, call = first
        key: ShapeKey = (id(m), *call.signatures)
        self._wanted.discard(key)
        self._let_go_in_a_row = 0
        self._searches[key] = search
        self._searches.move_to_end(key)
        while len(self._searches) > MAX_PLANS:
            self._searches.popitem(last=False)

    def _profile_again(self) -> None:
        """After a step that differed from its plan: the next step is profiled again. Of a shape
        not profiled yet (its first root call matched no plan kept), the plan stays kept for its
        own shapes; else it no longer holds for them, and is dropped."""
        if self._shape_new:
            self._search = None
        else:
            self._drop_search()

    def _drop_search(self) -> None:
        """The plan no longer holds for its own shapes: the next step is profiled again, and
        their profile is wanted."""
        for key, search in list(self._searches.items()):
            if search is self._search:
                del self._searches[key]
                self._wanted.add(key)
        self._search = None

    def _device_wait(self) -> Callable[[], None] | None:
        """What the clock of a step that makes or judges the plan waits for (Note [Device time]
        in clock.py): the current CUDA device's queued work, once this process uses CUDA; None
        (thread time) before, as on a machine without CUDA: a CPU model on a CUDA machine is
        timed as on any CPU, unless the process has started CUDA for something else."""
        return _cuda_synchronize if self._cuda and torch.cuda.is_initialized() else None

    def _finish_plan_step(self) -> None:
        """After a step under policy ``plan``: plan from a profiled step, or measure a planned
        step for the plan search (:class:`~.plan.PlanSearch`); a step that did not match the
        profile has the next one profiled again."""
        assert self.budget is not None
        st = self._stats
        if self._dtr_step:  # Note [Unsettled steps]
            self._dtr_step = False
            self._dtr_left -= 1
            st["unsettled_dtr_steps_total"] += 1
            return
        profile, self._profile = self._profile, None
        if profile is not None:
            profile.stop()
            profile.drop_kept_leaves()
            st["profile_steps_total"] += 1
            once_more = profile.state_changed and not self._state_changed_last
            self._state_changed_last = profile.state_changed
            if profile.packs and not once_more:  # (Note [State built on the first call] in plan.py)
                with self._planning():
                    self._search = PlanSearch(profile, self.budget, self.selective)
                self._keep(self._search)
                self._replay_checks = 0
            return
        run, self._planned = self._planned, None
        search = self._search
        if run is None or search is None:
            return
        if self._forget_plan_if_written_after(run):  # (the program caught the error in the step)
            return
        run.close()
        if isinstance(run, PlannedStep) and run.seq == 0 and not run.diverged:
            return  # it saved nothing (an evaluation under no_grad inside the session): nothing to judge
        st["planned_steps_total"] += 1
        if isinstance(run, IdleStep):
            st["idle_steps_total"] += 1
            self._note_diverged(run.diverged)
            if run.diverged:
                self._profile_again()
            return
        st["saved_tensors_total"] += run.seq
        st["drops_total"] += run.dropped
        st["dropped_bytes_total"] += run.dropped_bytes
        peak = run.bytes.peak
        if run.counted:
            st["step_saved_bytes_peak"] = peak
            st["resident_bytes_peak"] = max(st["resident_bytes_peak"], peak)
            st["evictable_resident_bytes_peak"] = max(st["evictable_resident_bytes_peak"], peak)
            st["counted_resident_bytes_peak"] = max(st["counted_resident_bytes_peak"], peak)
        if run.stale:
            st["replays_stale_total"] += 1
            for key in run.traces_changed:
                self._trace_changes[key] = self._trace_changes.get(key, 0) + 1
        self._note_diverged(run.diverged)
        if run.diverged or run.stale:
            self._profile_again()
            return
        if not run.counted:  # a settled plan's step between two counted ones (COUNT_EVERY)
            return
        with self._planning():
            replanned = search.measured(peak, run.rerun_seconds, run.selective_seconds, run.refill_seconds,
                                        run.region_seconds)
        if replanned:
            st["replans_total"] += 1
        if search.settled and search.plan.empty and peak > search.limit and not search.below_floor:
            self._drop_search()  # an empty plan no longer fits (Note [Idle steps]): profile again
            return
        if search.below_floor and not self._floor_warned:
            self._floor_warned = True
            warnings.warn(f"pyalloc.offload: the budget of {self.budget} bytes is below the floor of "
                          f"{search.floor_bytes} bytes of saved activations (what no module re-run can "
                          f"free: inputs kept for recompute, saves outside recomputable modules, one "
                          f"re-run's saves); steps run at the floor", OffloadFloorWarning, stacklevel=4)

    @contextlib.contextmanager
    def _planning(self) -> Iterator[None]:
        """Adds the time of the block (making or tuning a plan) to ``planning_seconds_total``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._stats["planning_seconds_total"] += time.perf_counter() - t0

    def _note_diverged(self, diverged: bool) -> None:
        """Counts planned steps that differed from their profile in a row, and those of shapes
        not profiled once ``MAX_PLANS`` plans are kept; when either keeps happening (a loader
        whose batches change shape, a mixture of experts routing otherwise each step), runs the
        next steps under DTR and says so once (Notes [Unsettled steps], [Plans per shape])."""
        if diverged and self._shape_new:
            if len(self._searches) < MAX_PLANS:
                return  # a shape not profiled yet, with room to keep its plan
            self._shapes_past_kept += 1
            count = self._shapes_past_kept
            told = f"{count} steps had shapes past the {MAX_PLANS} whose plans are kept"
        else:
            self._diverged_in_a_row = self._diverged_in_a_row + 1 if diverged else 0
            count = self._diverged_in_a_row
            told = f"{count} steps in a row differed from the profiled step"
        if count < UNSETTLED_WARN_AFTER:
            return
        self._dtr_left = UNSETTLED_DTR_STEPS
        if not self._unsettled_warned:
            self._unsettled_warned = True
            warnings.warn(f"pyalloc.offload: {told} (other input shapes, another graph): such a step keeps "
                          f"every save from where it differs, so the next {UNSETTLED_DTR_STEPS} steps run under "
                          "per-operator DTR, which keeps the budget at a cost on every operator, before one is "
                          "profiled again; give the steps the same shapes, or a few (pad or bucket the "
                          "sequence lengths), for plans to apply", OffloadUnsettledWarning, stacklevel=4)

    def _trace_entries(self) -> list[tuple[Any, ...]] | None:
        """Where the session's CallTrace writes the call it sees (None: nowhere): the profile's
        trace while it records, a planned step's while one of its selective regions runs."""
        profile, planned = self._profile, self._planned
        if profile is not None:
            return profile.trace if self.selective and profile.tracing() else None
        if isinstance(planned, PlannedStep) and planned.tracing():  # (it has a trace while it traces)
            return planned.trace
        return None

    def _idle(self) -> bool:
        """Whether the coming step may run with no saved-tensor hook (Note [Idle steps])."""
        search = self._search
        if search is None or not search.idle or self._idle_run >= IDLE_CHECK_EVERY:
            self._idle_run = 0
            return False
        self._idle_run += 1
        return True

    @property
    def _plan(self) -> Plan | None:
        return self._search.plan if self._search is not None else None

    def __exit__(self, *exc: Any) -> None:
        self._leave_thread()
        if exc[0] is not None:  # a step cut short: neither a profile nor a measurement
            self._abandon_step()
            self._discard_plan_step()
        self.end_step()

    def _abandon_step(self) -> None:
        """Note [Abandoned steps]. Autograd keeps what a pack hook returns: our handle. A handle
        that held the saved tensor itself made a cycle whenever a node saves its own output
        (relu, tanh, softmax): node -> handle -> tensor -> grad_fn -> node, through C++, which
        Python's garbage collector does not see. Backward breaks it (each node releases its saves
        as it runs); a forward that never reaches backward (an OOM in forward, the error a
        batch-size search waits for; a forward with grad on whose loss is only logged) kept every
        such save on the device for the life of the process: on an H200 the offload check's
        pyalloc column, after a search's failed attempt, ran out of memory at a batch the plain
        step trains. So every handle holds a detached alias of its tensor (same storage, strides
        and version counter, no grad_fn: autograd re-attaches the node when it unpacks, double
        backward included), and when an exception leaves the session the handles its step made
        let go of their tensors and how to regenerate them at once: autograd reading one later
        (a backward of that graph after the exception) gets an OffloadError that says why.
        Handles of earlier steps (a retained graph) are untouched."""
        with self._lock:
            for h in list(self._handles.values()):
                if h.seq > self._step_clock and h.state != ABANDONED:
                    self._forget(h)
                    h.state, h.producer, h.original = ABANDONED, None, None
            if isinstance(self._planned, PlannedStep):  # a step under the plan: its own handles
                self._planned.abandon()

    def _discard_plan_step(self) -> None:
        profile, self._profile = self._profile, None
        if profile is not None:
            profile.stop()
        run, self._planned = self._planned, None
        if run is not None:
            run.close()
            self._forget_plan_if_written_after(run)

    def _forget_plan_if_written_after(self, run: Any) -> bool:
        """A planned step whose re-run found an input written after its call (it raised
        OffloadError): that call is left out from now on, and the next step is profiled again;
        whether it was such a step."""
        if not (isinstance(run, PlannedStep) and run.written_after):
            return False
        self._written_after |= run.written_after
        self._searches.clear()  # every plan kept may re-run that call
        self._wanted.clear()
        self._search = None
        return True

    def _leave_thread(self) -> None:
        """Takes the hooks and the mode off this thread's stacks; touches no device."""
        _active.session = None
        if self._inside == threading.get_ident():
            self._inside = None
        self._recording = False
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        modes, self._mode_stack = self._mode_stack, None
        if modes is not None:
            modes.close()

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def _register_pressure_callback(self, stack: contextlib.ExitStack) -> None:
        try:
            from ..core import register_pressure_callback, unregister_pressure_callback

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
        asynchronous copies, the time spent issuing them; a CUDA session's replays in the steps
        of its plan search, the time after waiting for the device: Note [Device time] in
        clock.py). ``plan_recompute_seconds`` is what the plan expects its re-runs, refills and
        packs to cost a step, on that clock. ``planning_seconds_total`` is the time spent making
        plans (wall time, between steps, on the step's thread). ``budget_bytes`` is -1 without a
        budget.
        """
        st = self._stats
        if self._check is not None:
            st["recompute_checked_total"] = self._check.checked
            st["recompute_mismatches_total"] = self._check.mismatched
        out = dict(st)
        plan = self._plan
        search = self._search
        out.update(policy_plan=1 if self.policy == "plan" else 0,
                   baseline_saved_bytes=plan.baseline_bytes if plan else -1,
                   plan_estimate_bytes=plan.estimate_bytes if plan else -1,
                   plan_floor_bytes=search.floor_bytes if search else -1,
                   plan_settled=1 if search is not None and search.settled else 0,
                   plan_saved_bytes_peak=search.settled_peak if search is not None else -1,
                   plan_regions=len(plan.regions) if plan else 0, plans_kept=len(self._searches),
                   plan_selective_regions=len(plan.recipes) if plan else 0,
                   plan_outputs=len({o for o, a in zip(plan.owners, plan.actions) if a == OUTPUT}) if plan else 0,
                   plan_recompute_seconds=plan.recompute_seconds if plan else 0.0)
        out.update(budget_bytes=self.budget if self.budget is not None else -1,
                   resident_bytes=self.resident_bytes, swapped_out_bytes=self.swapped_bytes,
                   unevictable_bytes=self.unevictable_bytes, uncounted_bytes=self.uncounted_bytes,
                   evictions_total=st["swap_outs_total"] + st["drops_total"],
                   copies_in_flight=len(self._host),
                   host_pool_reserved_bytes=self.pool.reserved_bytes,
                   host_pool_reuses_total=self.pool.reuses)
        return dict(sorted(out.items()))

    def recompute_mismatches(self) -> list[dict[str, Any]]:
        """With ``check=True`` (or ``$PYALLOC_OFFLOAD_CHECK=1``): the first recomputed tensors that
        were not the dropped ones bit for bit, or not laid out as they were (Note [Recompute
        check] in check.py). Empty when the check is off."""
        return list(self._check.mismatches) if self._check is not None else []

    def _note_peak(self) -> None:
        st = self._stats
        st["resident_bytes_peak"] = max(st["resident_bytes_peak"], self.resident_bytes)
        st["evictable_resident_bytes_peak"] = max(
            st["evictable_resident_bytes_peak"], self.resident_bytes - self.unevictable_bytes)
        st["counted_resident_bytes_peak"] = max(
            st["counted_resident_bytes_peak"], self.resident_bytes - self.uncounted_bytes)

    # -- pack / unpack ---------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        if self._replaying or self._inert:
            return t
        if self._profile is None:
            return self._pack_tracked(t)
        t0 = clock.now()
        profile = self._profile
        profile.busy = True  # the session's operators (swap copies) are not the model's
        try:
            profile.note_pack(t)
            return self._pack_tracked(t)
        finally:  # evictions included: the profile's module times must not count them
            profile.busy = False
            self._overhead_s += clock.now() - t0

    def _pack_tracked(self, t: torch.Tensor) -> Any:
        with self._lock:
            if self._host:
                self._host.reap(wait=False)
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
            if not h.counted:
                self.uncounted_bytes += h.nbytes
            self._enforce_budget(exclude=None)
            self._note_peak()
            return h

    def _attribute(self, h: SavedActivation, t: torch.Tensor) -> None:
        """Finds how ``t`` could be regenerated: as a call's output, or a call's internal pack. A
        leaf without history is evictable only so (Note [Leaves DTR evicts])."""
        # perhaps made by the step (not a frozen parameter, nor a view of the batch: ids[:, 1:]):
        # counted if a recorded call made it
        made = t.is_leaf and not t.requires_grad and t._base is None and not isinstance(t, torch.nn.Parameter)
        if not h.evictable and not made:
            return
        prod = self._calls.producers.get(t)
        producer: tuple[ProducerCall, str, int, int] | None = None
        if prod is not None and prod[2] == t._version:
            producer = (prod[0], "out", prod[1], prod[2])
        elif self._calls.current:
            call, inputs = self._calls.current[-1]
            ptr = t.untyped_storage().data_ptr()
            # not an alias of the call's own input: replay would need that first
            if not any(x is t or x.untyped_storage().data_ptr() == ptr for x in inputs):
                producer = (call, "pack", self._pack_seq - call.pack_start - 1, t._version)
        if made:
            # the program's input, a buffer, or made where nothing recorded it: neither counted nor evicted
            h.counted = producer is not None
            h.evictable = h.evictable and h.counted
        if h.evictable and producer is not None:
            h.producer = producer
            if producer[1] == "out":
                producer[0].out_handles[producer[2]] = weakref.ref(h)

    @contextlib.contextmanager
    def _peek(self) -> Iterator[None]:
        """Unpacks of resident handles change nothing meanwhile (no clock tick, use or prefetch):
        the profiled step reads saved tensors without changing what DTR evicts."""
        peeking, self._peeking = self._peeking, True
        try:
            yield
        finally:
            self._peeking = peeking

    @contextlib.contextmanager
    def _probe(self) -> Iterator[None]:
        """As :meth:`_peek`, and an unpack of a handle that is not resident raises ``LookupError``
        instead of bringing it back: a check that may do without it (Note [Dropout products])."""
        probing, self._probing = self._probing, True
        try:
            with self._peek():
                yield
        finally:
            self._probing = probing

    def _unpack(self, h: Any) -> torch.Tensor:
        if not isinstance(h, SavedActivation):
            return h
        if self._peeking and h.state == RESIDENT:
            return self._use(h)
        if self._profile is not None:
            self._profile.inputs_written_after()  # the forward is over (Note [Inputs written after the call])
        if self._probing:
            raise LookupError("pyalloc.offload: a probe read a saved tensor that is not resident")
        if h.state == ABANDONED:
            raise OffloadError(ABANDONED_MESSAGE)
        with self._lock:
            if self._host:
                self._host.reap(wait=False)
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
                if not h.counted:
                    self.uncounted_bytes -= h.nbytes
            elif h.state == SWAPPED:
                self.swapped_bytes -= h.nbytes
            self._host.release_host(h)
            h.tensor = None
            h.ready = None

    # -- eviction --------------------------------------------------------------------------

    def _enforce_budget(self, exclude: SavedActivation | None) -> None:
        if self.budget is None:
            return
        while self.resident_bytes - self.uncounted_bytes > self.budget:
            if not self._evict_one(exclude):
                self._below_dtr_floor()
                break

    def _below_dtr_floor(self) -> None:
        """Over the budget with nothing left to evict: said once, when what DTR cannot evict alone
        is over it (a tensor being unpacked, held for its use, is not a floor). Not in a profiled
        step: the plan's floor is the one its steps run at, and the plan search says it."""
        floor = self.unevictable_bytes - self.uncounted_bytes
        if self._floor_warned or self.budget is None or floor <= self.budget or self._profile is not None:
            return
        self._floor_warned = True
        warnings.warn(f"pyalloc.offload: the budget of {self.budget} bytes is below the floor of {floor} "
                      f"bytes of saved activations that per-operator DTR cannot evict (saves under "
                      f"min_evict_bytes, aliases of a call's inputs, what no recorded call made); steps "
                      f"keep those and evict the rest", OffloadFloorWarning, stacklevel=5)

    def _evict_one(self, exclude: SavedActivation | None) -> int:
        best: tuple[float, SavedActivation, str] | None = None
        for h in list(self._handles.values()):
            if h is exclude or h.state != RESIDENT or not h.evictable:
                continue
            score, how = cost.score(h, self._clock, self.swap, self.recompute, self._free_neighbours,
                                    best[0] if best is not None else float("inf"))
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
        h.ready = None  # a swap-in copy still in flight keeps its own reference (Copy.keep)

    def _make_resident(self, h: SavedActivation, t: torch.Tensor) -> None:
        if h.state == SWAPPED:
            self.swapped_bytes -= h.nbytes
            self._host.release_host(h)
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
        if t.is_cuda:  # asynchronous; see Note [Copies on CUDA] in swap.py
            event = self._host.copy(dst, flat, t.device)
            h.pending = Copy(event, t, [], h.nbytes)
            self._host.track(h.pending)
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
        if h.device.type == "cuda":  # asynchronous; see Note [Copies on CUDA] in swap.py
            event = self._host.copy(flat, src, h.device)
            self._host.track(Copy(event, flat, [h.host], h.nbytes))
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
        if self._check is not None and h.tensor is not None:
            h.original = self._check.original(h.tensor)
        h.state = DROPPED
        self._leave_resident(h)
        self._stats["drops_total"] += 1
        self._stats["dropped_bytes_total"] += h.nbytes

    # -- materialize -----------------------------------------------------------------------

    def _materialize(self, h: SavedActivation, depth: int) -> None:
        if h.state == SWAPPED:
            self._swap_in(h)
        elif h.state == DROPPED:
            assert h.producer is not None
            call, kind, index, version = h.producer
            outer = self._replayed is None
            if outer:
                self._replayed = {}
            try:
                outputs, packs = self._replay(call, depth)
            finally:
                if outer:
                    self._replayed = None
            t = outputs[index] if kind == "out" else packs[index]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != h.shape or tuple(t.stride()) != h.stride:
                raise OffloadError(f"replaying {call.name} did not regenerate the dropped tensor "
                                   f"(shape {h.shape}, stride {h.stride})")
            self._make_resident(h, t.detach())
            self._stats["recomputed_tensors_total"] += 1
            if self._check is not None:
                original, h.original = h.original, None
                self._check.compare(original, t, step=int(self._stats["steps_total"]), kind="dtr",
                                    module=call.name, call=-1, save=h.seq)

    def _resolve(self, ref: Any, depth: int) -> Any:
        if isinstance(ref, Kept):
            if ref.tensor._version != ref.version:
                raise OffloadError("a tensor a dropped activation depends on was modified in place")
            return ref.tensor
        if isinstance(ref, Produced):
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
        """Re-runs ``call`` bit for bit: same inputs, grad mode, requires_grad and RNG state.

        Note [One replay a call]
            Regenerating a dropped tensor replays the calls that made its inputs where those
            are gone too, and theirs, back to what is still held. In a residual network the
            calls form a DAG, not a chain: ``x + f(x)`` reaches ``x`` by two paths, and each
            path replayed it anew, 2^depth replays for a tensor ``depth`` blocks deep (a
            review's decoder: 4,408 replays for one dropped tensor, a profiled step at 106x
            the plain step). So while one tensor is regenerated each call is replayed once,
            its outputs kept for the other paths until the tensor is back (a replay is bit for
            bit, so a second one would return the same). """
        replayed = self._replayed
        if replayed is not None and (done := replayed.get(id(call))) is not None:
            return done
        if not call.replayable or depth > MAX_REPLAY_CHAIN:
            raise OffloadError(f"cannot replay {call.name} to regenerate a dropped activation")
        resolved: dict[int, Any] = {}
        leaves = []
        for r in call.leaves:
            if isinstance(r, (Kept, Produced)):
                if id(r) not in resolved:
                    resolved[id(r)] = self._resolve(r, depth)
                leaves.append(resolved[id(r)])
            else:
                leaves.append(r)
        t0 = time.perf_counter()
        was_replaying, self._replaying = self._replaying, True
        try:
            outputs, packs = replay_call(call, leaves)
        finally:
            self._replaying = was_replaying
        self._stats["replays_total"] += 1
        self._stats["recompute_seconds_total"] += time.perf_counter() - t0
        if replayed is not None:
            replayed[id(call)] = (outputs, packs)
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
                    self.resident_bytes - self.uncounted_bytes + other.nbytes > self.budget:
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
            if self._host:  # the caller needs the memory now, not when the copies finish
                self._host.reap(wait=True)
            self._stats["pressure_freed_bytes_total"] += freed
            return freed
        finally:
            self._busy.on = False
            self._lock.release()


def _first_root(search: PlanSearch) -> tuple[torch.nn.Module, CallInfo] | None:
    """The module of the first root call of ``search``'s profile (the model), and the call."""
    roots = search.profile.roots()
    m = roots[0].module() if roots else None
    return None if m is None else (m, roots[0])


def _cuda_synchronize() -> None:
    """The current CUDA device's queued work done; nothing while this thread's stream captures a
    CUDA graph (waiting is not allowed then; the capture's kernels do not run until it is
    replayed)."""
    if not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()


def offload(budget: int | str | None = None, swap: bool = True, recompute: bool = True,
            **options: Any) -> ActivationOffload:
    """Swaps and recomputes saved activations to keep them within ``budget`` bytes.

    A context manager around a training step (forward and backward), or a decorator. With
    ``budget=None`` only the allocator's pressure callback triggers evictions. ``policy="plan"``
    (the default) profiles the first step and re-runs modules along a plan after it;
    ``policy="dtr"`` runs per-operator DTR with swap every step. ``selective`` (the default) lets
    plans replay the operators of part of a module call instead of re-running the whole module,
    where a measured step says that re-runs less; each step compares the call's top-level torch
    calls with the profiled step's first (Note [Call traces] in guard.py); ``selective=False``
    re-runs whole modules through their own code only. Other options: ``min_evict_bytes``,
    ``prefetch``, ``pressure_callback`` (DTR).
    """
    return ActivationOffload(budget, swap, recompute, **options)
