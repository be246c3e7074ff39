"""`pyalloc replay`: a trace through an allocator policy, at GPU scale, timed in C++.

Python reads and validates the trace, turns it into flat arrays, and hands
them to ``pyalloc_replay`` in the library, whose loop runs in C++: the
``ns_per_op`` it reports is the allocator's time, not Python's.

Policies:
  pyalloc        this allocator with its defaults, through the same C ABI
                 PyTorch calls: requests of every size share the large
                 pool's virtual-memory arena, with stitching under pressure
                 (vmm=auto, which is vmm=shared on sim and host)
  pyalloc-small-pool
                 arenas for the large pool, requests up to 1 MiB in a small
                 pool of 2 MiB plain segments (vmm=on): the default before
                 the shared arena
  pyalloc-plain  this allocator with plain segments only (vmm=off): its
                 policy before arenas, PyTorch's placement
  pyalloc-plan   the defaults plus iteration plans (plan=1): a repeated
                 allocation sequence is learned and served from a plan
  pyalloc-lifetime
                 the defaults plus lifetime-aware placement (lifetime=1):
                 requests predicted long-lived go to a pool of their own
  pyalloc-plain-lifetime
                 lifetime-aware placement with plain segments (vmm=off)
  native         a MODEL of PyTorch's default CUDACachingAllocator policy
                 (allocator/src/replay/native_model.hpp says what it models)
  native-expandable
                 a MODEL of PyTorch's policy with expandable_segments:True
                 (allocator/src/replay/expandable_model.hpp says what it models)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import core
from ..command import UsageError
from .._lib import PyallocError, check_status, lib
from .trace import ALLOC, FREE, Trace, TraceError, load_any

MiB = 1 << 20
CAPACITY_STEP = 2 * MiB
DEFAULT_CAPACITY = 80 << 30
MAX_CAPACITY = 1 << 40
"""The largest device the sim and host backends model (PYALLOC_CONF ``capacity``'s limit)."""
MIN_CAPACITY = CAPACITY_STEP  # one granule: the library refuses less (every allocation would fail)

POLICIES = {
    "pyalloc": "the pyalloc allocator, its defaults (one arena for every size, stitching, shared granules, moving slivers; vmm=auto)",
    "pyalloc-small-pool": "the pyalloc allocator with a small pool of plain segments beside the arenas (vmm=on)",
    "pyalloc-plain": "the pyalloc allocator with plain segments only (vmm=off)",
    "pyalloc-plan": "the pyalloc allocator with iteration plans (plan=1)",
    "pyalloc-lifetime": "the pyalloc allocator with lifetime-aware placement (lifetime=1)",
    "pyalloc-plain-lifetime": "lifetime-aware placement with plain segments only (vmm=off,lifetime=1)",
    "native": "a model of PyTorch's default caching allocator (a model, not PyTorch)",
    "native-expandable": "a model of PyTorch's caching allocator with expandable_segments:True (a model, not PyTorch)",
}
# The PYALLOC_CONF keys each pyalloc policy adds (a --conf given by the user
# comes after them, so it wins); the native models are not the allocator at all.
POLICY_CONF = {"pyalloc": "", "pyalloc-small-pool": "vmm=on", "pyalloc-plain": "vmm=off", "pyalloc-plan": "plan=1",
               "pyalloc-lifetime": "lifetime=1", "pyalloc-plain-lifetime": "vmm=off,lifetime=1"}


class ReplayResultC(ctypes.Structure):
    _fields_ = [
        ("ops", ctypes.c_uint64),
        ("peak_live_bytes", ctypes.c_uint64),
        ("peak_reserved_bytes", ctypes.c_uint64),
        ("largest_free_at_peak_bytes", ctypes.c_uint64),
        ("ooms", ctypes.c_uint64),
        ("ns_per_op", ctypes.c_double),
    ]


@dataclass
class ReplayResult:
    trace: str
    policy: str
    backend: str
    capacity_bytes: int
    ops: int
    peak_live_bytes: int
    peak_reserved_bytes: int
    reserved_over_live: float
    largest_free_at_peak_bytes: int
    ooms: int
    ns_per_op: float
    curve_live: list[int]
    curve_reserved: list[int]

    def report(self) -> dict[str, Any]:
        """The keys ``pyalloc replay --json`` prints."""
        keys = ("ops", "peak_live_bytes", "peak_reserved_bytes", "reserved_over_live",
                "largest_free_at_peak_bytes", "ooms", "ns_per_op", "policy", "backend", "trace")
        d = asdict(self)
        return {k: d[k] for k in keys}


@dataclass
class FlatTrace:
    """A trace as the arrays ``pyalloc_replay`` takes."""

    name: str
    ops: bytes
    slots: array
    sizes: array
    streams: array
    n_slots: int
    peak_live_bytes: int
    device_capacity: int | None


def flatten(trace: Trace, name: str) -> FlatTrace:
    """Remaps trace ids to dense slots and gives every free its allocation's size."""
    slots = array("I")
    sizes = array("Q")
    streams = array("Q")
    slot_of: dict[int, int] = {}
    n_slots = 0
    for op, ident, size, stream in zip(trace.ops, trace.ids, trace.sizes, trace.streams):
        if op == ALLOC:
            slot_of[ident] = n_slots
            slots.append(n_slots)
            sizes.append(size)
            n_slots += 1
        elif op == FREE:
            slot = slot_of.pop(ident)
            slots.append(slot)
            sizes.append(0)  # filled below from the allocation
        else:
            slots.append(0)
            sizes.append(0)
        streams.append(stream & 0xFFFFFFFFFFFFFFFF)
    size_of_slot = array("Q", bytes(8 * max(1, n_slots)))
    for i, op in enumerate(trace.ops):
        if op == ALLOC:
            size_of_slot[slots[i]] = sizes[i]
        elif op == FREE:
            sizes[i] = size_of_slot[slots[i]]
    capacity = trace.header.get("device_capacity")
    return FlatTrace(name, bytes(trace.ops), slots, sizes, streams, n_slots, trace.peak_live_bytes(),
                     int(capacity) if isinstance(capacity, int) and capacity > 0 else None)


def _pointer(arr: array, ctype: Any) -> Any:
    if len(arr) == 0:
        return None
    address, _ = arr.buffer_info()
    return ctypes.cast(address, ctypes.POINTER(ctype))


def refuse_a_bad_environment() -> None:
    """UsageError for a $PYALLOC_CONF the library refused: a replay sets every key itself, but a
    typo there is refused by every command alike, as `pyalloc config` and `pyalloc run` do
    (replay, stress and selftest ran as if it were fine: a review's finding)."""
    error = core.startup_error()
    if error is not None and error.startswith("PYALLOC_CONF"):
        raise UsageError(f"${error} (a replay sets its own configuration, but fix or unset this)")


def configure_for_replay(backend: str, capacity: int, conf: str = "") -> None:
    """A fresh single-device allocator of ``capacity`` bytes on ``backend``."""
    # configure() applies keys on top of the current configuration: name every
    # key that changes where blocks go, at its default, so that neither one
    # replay's policy nor the program's own configuration (a test's
    # memory_fraction, say) leaks into the next.
    settings = (f"backend={backend},devices=1,capacity={capacity},oom_report=0,event_delay=0,trace=0,"
                "memory_fraction=1,max_cached=unlimited,small_segment=2MiB,large_segment=20MiB,round_power2=0,"
                "vmm=auto,plan=0,lifetime=0,share=1,move=1,reuse=1,extent=32MiB")
    core.configure(settings + ("," + conf if conf else ""))


# Keys a replay sets from its own options: given in --conf, they would run something other than
# what the report says (a capacity under the peak of live bytes, another backend).
REPLAY_KEYS = {"backend": "--backend", "capacity": "--capacity", "devices": "a replay's one device"}


def check_conf(policy: str, conf: str) -> None:
    """PyallocError when ``conf`` (extra PYALLOC_CONF keys) cannot apply to a replay of ``policy``:
    a key the replay sets itself, a key the policy is defined by (``vmm`` for pyalloc-plain), or
    any key for a model of PyTorch's allocator (not this allocator at all)."""
    if not conf:
        return
    if policy not in POLICY_CONF:
        raise PyallocError(f"--conf applies to the pyalloc policies only; {policy} is a model of PyTorch's allocator")
    defined_by = {item.split("=", 1)[0].strip().lower() for item in POLICY_CONF[policy].split(",") if item}
    for item in conf.split(","):
        key = item.split("=", 1)[0].strip().lower()
        if key in REPLAY_KEYS:
            raise PyallocError(f"--conf {item.strip()}: the replay sets {key} itself (use {REPLAY_KEYS[key]})")
        if key in defined_by:
            raise PyallocError(f"--conf {item.strip()}: policy {policy} is defined by {POLICY_CONF[policy]} "
                               "(choose the policy that has the setting you want)")


def replay(flat: FlatTrace, policy: str = "pyalloc", backend: str = "sim", capacity: int | None = None,
           conf: str = "", curve_points: int = 0) -> ReplayResult:
    if policy not in POLICIES:
        raise PyallocError(f"unknown policy {policy!r} (expected one of {', '.join(POLICIES)})")
    if backend not in ("sim", "host"):
        raise PyallocError(f"replay backend must be sim or host, not {backend!r}")
    check_conf(policy, conf)
    cap = capacity or flat.device_capacity or DEFAULT_CAPACITY
    where = "capacity" if capacity else "the header's device_capacity"
    if cap > MAX_CAPACITY:
        raise PyallocError(f"{flat.name}: {where} of {cap:,} bytes is more than the largest device the backends "
                           "model (1 TiB): give a capacity (--capacity)")
    if cap < MIN_CAPACITY:  # (the pyalloc policies failed inside configure, the models replayed nothing)
        raise PyallocError(f"{flat.name}: {where} of {cap:,} bytes is less than one 2 MiB granule: give a "
                           "capacity (--capacity)")
    is_pyalloc = policy in POLICY_CONF
    if is_pyalloc:
        configure_for_replay(backend, cap, ",".join(c for c in (POLICY_CONF[policy], conf) if c))
    result, live, reserved = run_replay(flat, "pyalloc" if is_pyalloc else policy, cap, curve_points)
    # the trace's: the replay's own is lower where allocations failed, and a report mixed the two
    # (reserved over the one, the minimum capacity over the other; a review, 2026-11-29)
    peak_live = flat.peak_live_bytes
    return ReplayResult(
        trace=flat.name, policy=policy, backend=backend if is_pyalloc else "model",
        capacity_bytes=cap, ops=int(result.ops), peak_live_bytes=peak_live,
        peak_reserved_bytes=int(result.peak_reserved_bytes),
        reserved_over_live=result.peak_reserved_bytes / peak_live if peak_live else 0.0,
        largest_free_at_peak_bytes=int(result.largest_free_at_peak_bytes), ooms=int(result.ooms),
        ns_per_op=float(result.ns_per_op), curve_live=live, curve_reserved=reserved)


def run_replay(flat: FlatTrace, policy: str, capacity: int,
               curve_points: int = 0) -> tuple[ReplayResultC, list[int], list[int]]:
    """One ``pyalloc_replay`` call on the allocator as it is configured now.

    Returns the raw result and the sampled live and reserved curves. The
    pyalloc policy uses whatever backend the caller configured (``replay``
    configures sim or host; the stress suite's real-device run, cuda).
    """
    result = ReplayResultC()
    live = array("Q", bytes(8 * curve_points))
    reserved = array("Q", bytes(8 * curve_points))
    status = lib().pyalloc_replay(
        policy.encode(), capacity, flat.ops, _pointer(flat.slots, ctypes.c_uint32),
        _pointer(flat.sizes, ctypes.c_uint64), _pointer(flat.streams, ctypes.c_uint64), len(flat.ops),
        max(1, flat.n_slots), _pointer(live, ctypes.c_uint64), _pointer(reserved, ctypes.c_uint64),
        curve_points, ctypes.byref(result))
    check_status(status, "pyalloc_replay")
    return result, list(live), list(reserved)


def replays_cleanly(flat: FlatTrace, policy: str, backend: str, capacity: int, conf: str = "") -> bool:
    return replay(flat, policy, backend, capacity, conf).ooms == 0


SCAN_STEPS = 64
"""Capacity steps below the bisection's answer that :func:`find_min_capacity` tries one by one."""


def find_min_capacity(flat: FlatTrace, policy: str = "pyalloc", backend: str = "sim", conf: str = "") -> int:
    """The smallest capacity, in 2 MiB steps, at which the trace replays with no failed allocation.

    Bisection between the peak of live bytes (no policy can do with less) and a capacity that
    works (doubled until one does). A caching allocator's success is not monotonic in capacity:
    a capacity can fail where a smaller one works, and the bisection lands above such a one. So
    every step from its answer down to ``SCAN_STEPS`` steps below it (128 MiB), or to the peak of
    live bytes, is tried too, and the smallest that works is the answer. Until 2026-11-29 the
    search stepped down only while the next step worked, and overshot by up to 88 MiB (a review:
    size_sweep under the default policy's model, 1,198 MiB reported where 1,110 works).
    """
    step = CAPACITY_STEP
    if flat.peak_live_bytes > MAX_CAPACITY:
        raise PyallocError(f"{flat.name}: {flat.peak_live_bytes:,} bytes live at once, more than the largest "
                           "device the backends model (1 TiB): no capacity to search for")
    lo = max(step, flat.peak_live_bytes // step * step)  # may fail
    hi = min(MAX_CAPACITY, max(lo + step, -(-flat.peak_live_bytes * 2 // step) * step))
    while not replays_cleanly(flat, policy, backend, hi, conf):
        if hi >= MAX_CAPACITY:
            raise PyallocError(f"{flat.name}: no capacity up to 1 TiB (the largest device the backends model) "
                               "replays without a failed allocation")
        lo, hi = hi, min(hi * 2, MAX_CAPACITY)
    if replays_cleanly(flat, policy, backend, lo, conf):
        return lo
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if replays_cleanly(flat, policy, backend, mid, conf):
            hi = mid
        else:
            lo = mid
    least = -(-flat.peak_live_bytes // step) * step  # (no capacity below the live bytes works)
    for capacity in range(hi - step, max(least, step, hi - SCAN_STEPS * step) - 1, -step):
        if replays_cleanly(flat, policy, backend, capacity, conf):
            hi = capacity
    return hi


def _trace_name(path: Path) -> str:
    return path.name.split(".")[0]


def run(args: argparse.Namespace) -> int:
    refuse_a_bad_environment()
    try:
        trace = load_any(args.trace, args.snapshot_device)
    except TraceError as e:
        print(f"pyalloc replay: {e}", file=sys.stderr)
        return 1
    flat = flatten(trace, _trace_name(args.trace))
    capacity = None
    if args.capacity is not None:  # 0 or an empty value ran at the default (a review's finding)
        try:
            capacity = core.parse_size(args.capacity)
        except PyallocError as e:
            raise UsageError(f"--capacity: {e}") from None
        if capacity < MIN_CAPACITY:
            raise UsageError(f"--capacity {args.capacity}: at least one 2 MiB granule, for every policy "
                             "(leave it out for the trace's own capacity)")
        if capacity > MAX_CAPACITY:
            raise UsageError(f"--capacity {args.capacity}: at most 1 TiB, the largest device the backends model")
    conf = args.conf or ""
    check_conf(args.policy, conf)
    result = replay(flat, args.policy, args.backend, capacity, conf)
    report = result.report()
    if conf:
        report["conf"] = conf
    if args.find_min_capacity:
        minimum = find_min_capacity(flat, args.policy, args.backend, conf)
        report["min_capacity_bytes"] = minimum
        report["min_capacity_over_live"] = minimum / flat.peak_live_bytes if flat.peak_live_bytes else 0.0
    if args.json:
        print(json.dumps(report))
        return 0
    label = POLICIES[args.policy]
    print(f"{flat.name}: {label}, {report['backend']} backend" + (f", with --conf {conf}" if conf else ""))
    for key, value in report.items():
        if key in ("policy", "backend", "trace", "conf"):
            continue
        if key.endswith("_bytes"):
            print(f"  {key:<28} {value:>16,}  ({value / MiB:,.1f} MiB)")
        elif isinstance(value, float):
            print(f"  {key:<28} {value:>16.3f}")
        else:
            print(f"  {key:<28} {value:>16,}")
    return 0


def _device_index(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a device index (0, 1, ...)")
    return int(text)


def register_cli(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    parser = subparsers.add_parser(
        "replay", help="replay an allocation trace through a policy and report fragmentation",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="trace (.jsonl, .jsonl.gz) or PyTorch snapshot pickle")
    parser.add_argument("--backend", choices=["sim", "host"], default="sim")
    parser.add_argument("--capacity", metavar="SIZE",
                        help="device size, e.g. 80GiB (default: the trace's device_capacity, else 80GiB)")
    parser.add_argument("--snapshot-device", type=_device_index, default=0, metavar="I",
                        help="a snapshot pickle: which device's trace to replay (default 0)")
    parser.add_argument("--find-min-capacity", action="store_true",
                        help="also find the smallest capacity (2 MiB steps) with no failed allocation")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="pyalloc")
    parser.add_argument("--conf", metavar="CONF", help="extra PYALLOC_CONF keys for the pyalloc policies")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)
