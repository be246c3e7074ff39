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
