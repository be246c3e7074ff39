"""Iteration plans (Note [Iteration plans] in allocator/src/policy/plan.cpp).

A loop that repeats the same allocation sequence is learned over three
iterations, planned (offsets packed greedily by size within one region) and
then served from the plan while it matches; what does not match is served by
the cache at once. Every call is followed by ``pyalloc_check``, whose I10
checks the plan region, and on the host backend planned blocks hold real bytes.
"""

from __future__ import annotations

import ctypes
from typing import Iterator

import pytest

import pyalloc
from allocator_fixture import MECHANISM_VARIANTS, Allocator, mechanism_allocator

KiB = 1 << 10
MiB = 1 << 20

# One iteration: (op, slot, size). Allocations interleave with frees, so
# lifetimes overlap partly, as activations do; everything is freed by the end.
ITERATION = [
    ("alloc", 0, 3 * MiB), ("alloc", 1, 1 * MiB), ("alloc", 2, 4 * MiB), ("free", 0, 0),
    ("alloc", 3, 512 * KiB), ("alloc", 4, 2 * MiB), ("free", 2, 0), ("alloc", 5, 6 * MiB),
    ("free", 1, 0), ("alloc", 6, 1536 * KiB), ("alloc", 7, 3 * MiB), ("free", 4, 0),
    ("alloc", 8, 700 * KiB), ("free", 3, 0), ("alloc", 9, 5 * MiB), ("free", 5, 0),
    ("free", 6, 0), ("free", 7, 0), ("free", 8, 0), ("free", 9, 0),
]


def peak_live(iteration: list[tuple[str, int, int]]) -> int:
    """The most bytes live at once in one iteration."""
    live: dict[int, int] = {}
    peak = 0
    for op, slot, size in iteration:
        if op == "alloc":
            live[slot] = size
            peak = max(peak, sum(live.values()))
        else:
            del live[slot]
    return peak


@pytest.fixture(params=MECHANISM_VARIANTS)
def planner(request: pytest.FixtureRequest) -> Iterator[Allocator]:
    yield from mechanism_allocator(request.param, "plan=1")


def run_iteration(a: Allocator, iteration: list[tuple[str, int, int]] = ITERATION,
                  fill: bool = False) -> dict[int, int]:
    """Runs one iteration; returns slot -> address. With `fill`, every block
    is filled with its slot's byte and checked just before it is freed."""
    ptrs: dict[int, int] = {}
    sizes: dict[int, int] = {}
    addresses: dict[int, int] = {}
    for op, slot, size in iteration:
        if op == "alloc":
            ptrs[slot] = addresses[slot] = a.malloc(size)
            sizes[slot] = size
            assert ptrs[slot]
            if fill:
                ctypes.memset(ptrs[slot], 0x40 + slot, size)
        else:
            if fill:
                assert ctypes.string_at(ptrs[slot], sizes[slot]) == bytes([0x40 + slot]) * sizes[slot], \
                    f"slot {slot} was overwritten"
            a.free(ptrs.pop(slot))
    return addresses


def test_a_repeated_sequence_is_planned_and_served_from_the_plan(planner: Allocator) -> None:
    for _ in range(3):
        run_iteration(planner)
    assert planner.stats()["num_plans"] == 0  # three periods seen: planned, region not yet made
    seen = [run_iteration(planner) for _ in range(3)]
    s = planner.stats()
    assert s["num_plans"] == 1
    assert s["plan_misses"] == 0
    assert s["plan_served"] >= 2 * len([e for e in ITERATION if e[0] == "alloc"])
    assert s["pool.plan.segments"] == 1
    # Served from the plan, a slot gets the same place every iteration.
    assert seen[1] == seen[2]


def test_the_plan_packs_the_iteration_into_its_live_peak(planner: Allocator) -> None:
    for _ in range(6):
        run_iteration(planner)
    s = planner.stats()
    assert s["num_plans"] == 1
    region = s["pool.plan.reserved_bytes"]
    # Greedy by size reaches the live peak here; the region is rounded to 2 MiB.
    assert region == -(-peak_live(ITERATION) // (2 * MiB)) * (2 * MiB)
    assert region < sum(size for op, _, size in ITERATION if op == "alloc")


def test_planned_blocks_never_overlap_live_ones(planner: Allocator) -> None:
    if planner.backend != "host":
        pytest.skip("bytes are real on the host backend only")
    for _ in range(8):
        run_iteration(planner, fill=True)
    assert planner.stats()["plan_served"] > 0


def test_a_request_the_plan_does_not_expect_is_served_by_the_cache(planner: Allocator) -> None:
    for _ in range(5):
        run_iteration(planner)
    served = planner.stats()["plan_served"]
    changed = [e for e in ITERATION]
    changed.insert(5, ("alloc", 10, 9 * MiB))  # inserted: in no plan position
    changed.append(("free", 10, 0))
    changed[2] = ("alloc", 2, 4 * MiB + 512 * KiB)  # a different size for slot 2
    run_iteration(planner, changed, fill=planner.backend == "host")
    s = planner.stats()
    assert s["plan_misses"] == 2
    assert s["num_plan_drops"] == 0  # two misses in a period of ten: the plan holds
    assert s["plan_served"] == served + len([e for e in ITERATION if e[0] == "alloc"]) - 1
    run_iteration(planner)
    assert planner.stats()["plan_served"] == s["plan_served"] + len([e for e in ITERATION if e[0] == "alloc"])


def test_a_different_loop_drops_the_plan_and_is_learned_anew(planner: Allocator) -> None:
    for _ in range(5):
        run_iteration(planner)
    other = [(op, slot, size + 512 * KiB if op == "alloc" else 0) for op, slot, size in ITERATION]
    run_iteration(planner, other)
    s = planner.stats()
    assert s["num_plan_drops"] == 1
    assert s["pool.plan.segments"] == 0  # the region was wholly free: released
    for _ in range(5):
        run_iteration(planner, other)
    s = planner.stats()
    assert s["num_plans"] == 2 and s["num_plan_drops"] == 1


def test_empty_cache_drops_the_plan_and_gives_everything_back(planner: Allocator) -> None:
    for _ in range(5):
        run_iteration(planner)
    assert planner.stats()["pool.plan.segments"] == 1
    pyalloc.empty_cache()
    s = planner.stats()
    assert s["reserved_bytes.all.current"] == 0 and s["segment.all.current"] == 0
    assert s["num_plan_drops"] == 1


def test_a_region_with_live_blocks_outlives_its_plan(planner: Allocator) -> None:
    for _ in range(4):
        run_iteration(planner)
    keep = planner.malloc(3 * MiB)  # position 0 of the plan: placed in the region
    assert planner.stats()["pool.plan.allocations"] == 1
    pyalloc.empty_cache()  # drops the plan; the region holds a live block
    s = planner.stats()
    assert s["pool.plan.segments"] == 1 and s["num_plan_drops"] == 1
    planner.free(keep)
    pyalloc.empty_cache()
    assert planner.stats()["reserved_bytes.all.current"] == 0


def test_plan_off_keeps_every_request_on_the_cache(planner: Allocator) -> None:
    pyalloc.configure(planner.conf("plan=0"))
    for _ in range(6):
        run_iteration(planner)
    s = planner.stats()
    assert s["num_plans"] == 0 and s["plan_served"] == 0 and s["pool.plan.segments"] == 0


def test_short_or_tiny_loops_are_left_to_the_cache(planner: Allocator) -> None:
    tiny = [("alloc", i, 4 * KiB) for i in range(10)] + [("free", i, 0) for i in range(10)]
    for _ in range(8):
        run_iteration(planner, tiny)  # 40 KiB a period: not worth a region
    short = [("alloc", 0, 3 * MiB), ("free", 0, 0)] * 3  # a period of one allocation
    for _ in range(8):
        run_iteration(planner, short)
    assert planner.stats()["num_plans"] == 0


def test_the_plan_key_is_validated() -> None:
    with pytest.raises(pyalloc.PyallocError, match="plan"):
        pyalloc.configure("plan=sometimes")
