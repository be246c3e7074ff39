"""The fast path and the general path place every request the same way (Note [Fast path]).

A request leaves the fast path when the device lock is contended (the registry publisher reads
the counters under it), or while a trace is being recorded, or a planner watches. Where it then
goes must not change: otherwise figures would depend on timing, and on whether anyone looks.
With a trace being recorded every call takes the general path, so each workload of the stress
suite is replayed both ways near the capacity where it starts to fail (six 2 MiB steps from its
peak of live bytes), where the placement choices of a full device (shared granules, stitching)
are made; the failures, peaks and reserved curves must be the same.
"""

from __future__ import annotations

import pytest

from pyalloc.traces import replay, stress

MiB = 1 << 20
STEP = 2 * MiB
CAPACITIES = 6  # per workload, in STEPs from its peak of live bytes


@pytest.fixture(scope="module")
def workloads() -> dict[str, replay.FlatTrace]:
    return {name: stress.load_workload(name, 0, False).flat for name in stress.available_workloads()}


def outcome(flat: replay.FlatTrace, capacity: int, conf: str) -> tuple[int, int, int, list[int]]:
    r = replay.replay(flat, "pyalloc", "sim", capacity, conf, curve_points=64)
    return r.ooms, r.peak_reserved_bytes, r.largest_free_at_peak_bytes, r.curve_reserved


@pytest.mark.parametrize("vmm", ["vmm=shared", "vmm=on"])
def test_recording_a_trace_does_not_change_where_requests_go(workloads: dict[str, replay.FlatTrace],
                                                            vmm: str) -> None:
    differences = []
    failing_capacities = 0
    for name, flat in sorted(workloads.items()):
        first = -(-flat.peak_live_bytes // STEP) * STEP
        for capacity in range(first, first + CAPACITIES * STEP, STEP):
            fast = outcome(flat, capacity, vmm)
            general = outcome(flat, capacity, vmm + ",trace=100")
            failing_capacities += fast[0] > 0
            if fast != general:
                differences.append(f"{name} at {capacity // MiB} MiB: ooms, peak reserved, largest free "
                                   f"{fast[:3]} on the fast path, {general[:3]} on the general path")
    assert not differences, "\n".join(differences)
    assert failing_capacities > 0, "no capacity near the limit: the comparison never reached a full device"


def _random_near_full(seed: int, vmm: str, extra: str) -> tuple[list[object], dict[str, int]]:
    """A seeded random churn kept near a 32 MiB device's limit, on two streams, with the memory
    fraction moving and the cache emptied now and then; ``pyalloc.check`` after every call (it
    compares the whole-granule count and the arenas' hole lists with a walk). What each call
    returned, and the counters at the end."""
    import random

    import pyalloc
    from allocator_fixture import fresh_conf

    capacity = 32 * MiB
    pyalloc.configure(fresh_conf("host"))  # a new sim backend after it: addresses from the start
    pyalloc.configure(fresh_conf("sim", f"{vmm},capacity=32MiB" + extra))
    rng = random.Random(seed)
    live: dict[int, tuple[int, int]] = {}
    calls: list[object] = []
    fraction = 1.0
    for _ in range(1500):
        r = rng.random()
        if r < 0.02:
            fraction = rng.choice([0.6, 0.75, 0.9, 1.0])
            pyalloc.set_memory_fraction(fraction)
            calls.append(("fraction", fraction))
        elif r < 0.025:
            pyalloc.empty_cache()
            calls.append("empty_cache")
        elif live and (r < 0.5 or sum(s for s, _ in live.values()) > capacity * fraction * 0.97):
            ptr = rng.choice(sorted(live))
            size, stream = live.pop(ptr)
            pyalloc.free(ptr, size, 0, stream)
            calls.append(("free", ptr))
        else:
            size = rng.choice([rng.randrange(512, 1 * MiB, 512), rng.randrange(1 * MiB, 6 * MiB, 512)])
            stream = 0 if rng.random() < 0.85 else 1
            try:
                ptr = pyalloc.malloc(size, 0, stream)
            except pyalloc.PyallocError:
                ptr = 0
            calls.append(("malloc", size, ptr))
            if ptr:
                live[ptr] = (size, stream)
        pyalloc.check(0)
    stats = dict(pyalloc.memory_stats(0))
    for ptr, (size, stream) in live.items():
        pyalloc.free(ptr, size, 0, stream)
    pyalloc.check(0)
    pyalloc.set_memory_fraction(1.0)
    return calls, stats


@pytest.mark.parametrize("vmm", ["vmm=shared", "vmm=on"])
def test_a_random_churn_near_a_full_device_goes_the_same_way_on_both_paths(vmm: str) -> None:
    """Near a full device the fast path serves a split in an arena when the counted whole free
    granules cover it (Note [Whole-granule count] in share.cpp), and hits in a counted arena
    count out of line: with a trace recorded (every call on the general path) the same seeded
    churn gets the same address for every request, and the device did share granules, build
    sliver indexes, stitch and refuse requests on the way."""
    for seed in range(3):
        fast, stats = _random_near_full(seed, vmm, "")
        general, _ = _random_near_full(seed, vmm, ",trace=100")
        first = next((i for i, (a, b) in enumerate(zip(fast, general)) if a != b), None)
        assert first is None, f"seed {seed}: call {first}: {fast[first]} on the fast path, {general[first]} on the general path"
        assert stats["num_shared_granules"] > 0 and stats["num_ooms"] > 0 and stats["num_stitches"] > 0, stats
