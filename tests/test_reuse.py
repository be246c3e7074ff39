"""Reuse before growing (Note [Reuse before growing] in allocator/src/device/arena.cpp).

An arena that finds no cached block for a request takes the whole granules
inside its other free blocks before it maps new ones, however near the limit
reserved memory is (there looking at 16 free blocks at most). On the host backend the granules are real memfd chunks,
so the live blocks' bytes are checked after the move. Every call is followed
by ``pyalloc_check``.
"""

from __future__ import annotations

from typing import Iterator

import pytest

import pyalloc
from allocator_fixture import Allocator, checked, fill, holds, rebuilt

MiB = 1 << 20


@pytest.fixture(params=["host", "sim"])
def arenas(request: pytest.FixtureRequest) -> Iterator[Allocator]:
    yield from checked(rebuilt(request.param, "vmm=shared"))


def _hole_between_live_blocks(a: Allocator) -> tuple[int, int]:
    """8 MiB live, 8 MiB free, 8 MiB live: 12 granules mapped, 4 of them free."""
    first = a.malloc(8 * MiB)
    middle = a.malloc(8 * MiB)
    last = a.malloc(8 * MiB)
    if a.backend == "host":
        fill(first, 8 * MiB, 0x11)
        fill(last, 8 * MiB, 0x33)
    a.free(middle)
    assert a.stats()["reserved_bytes.all.current"] == 24 * MiB
    return first, last


def test_a_miss_takes_the_cached_granules_before_new_ones(arenas: Allocator) -> None:
    first, last = _hole_between_live_blocks(arenas)
    big = arenas.malloc(12 * MiB)  # fits no cached block: 6 granules, 4 of them cached
    s = arenas.stats()
    assert s["num_reuses"] == 1
    assert s["reused_bytes"] == 8 * MiB
    assert s["reserved_bytes.all.current"] == 28 * MiB  # 2 new granules, not 6
    assert s["num_stitches"] == 0  # not the pressure ladder
    if arenas.backend == "host":
        fill(big, 12 * MiB, 0x7E)  # every byte of the window is backed and writable
        assert holds(big, 12 * MiB, 0x7E)
        assert holds(first, 8 * MiB, 0x11) and holds(last, 8 * MiB, 0x33)  # live bytes did not move


def test_a_cache_hit_moves_nothing(arenas: Allocator) -> None:
    _hole_between_live_blocks(arenas)
    again = arenas.malloc(8 * MiB)  # the free block fits as it is
    s = arenas.stats()
    assert again != 0
    assert s["num_reuses"] == 0 and s["reused_bytes"] == 0
    assert s["reserved_bytes.all.current"] == 24 * MiB


def test_a_block_freed_moments_ago_gives_no_granules_until_others_are_freed(arenas: Allocator) -> None:
    """Note [Cold donors]: a free block donates once a quarter as many blocks as are live were
    freed after it; the next requests of its size would find it before that."""
    smalls = [arenas.malloc(MiB) for _ in range(8)]
    first, middle, last = (arenas.malloc(8 * MiB) for _ in range(3))
    arenas.free(middle)  # young: 10 live blocks, so cold after 2 more frees
    arenas.malloc(12 * MiB)
    s = arenas.stats()
    assert s["num_reuses"] == 0 and s["reserved_bytes.all.current"] == (8 + 24 + 12) * MiB
    arenas.free(smalls[0])
    arenas.free(smalls[2])  # 2 frees after middle's: cold (9 live)
    arenas.malloc(12 * MiB)
    s = arenas.stats()
    assert s["num_reuses"] == 1 and s["reused_bytes"] == 8 * MiB  # middle's 4 granules; the smalls are young
    assert s["reserved_bytes.all.current"] == (8 + 24 + 12 + 4) * MiB
    del first, last


def test_what_a_split_leaves_is_cold_at_once(arenas: Allocator) -> None:
    """The rest of a free block that a smaller request split is no block a request freed: it
    donates even while the program has freed almost nothing (a first forward pass)."""
    for _ in range(8):
        arenas.malloc(512)
    x = arenas.malloc(16 * MiB)
    arenas.malloc(4 * MiB)
    arenas.free(x)
    arenas.malloc(3 * MiB)  # takes the front of x's free block; at least 6 whole granules stay free
    arenas.malloc(20 * MiB)
    s = arenas.stats()
    assert s["num_reuses"] == 1 and s["reused_bytes"] >= 12 * MiB


def test_reuse_off_maps_new_granules_as_before() -> None:
    a = rebuilt("sim", "vmm=shared", "reuse=0")
    assert pyalloc.config()["reuse"] is False
    try:
        _hole_between_live_blocks(a)
        a.malloc(12 * MiB)
        s = a.stats()
        assert s["num_reuses"] == 0
        assert s["reserved_bytes.all.current"] == 36 * MiB  # 6 new granules beside the 4 cached ones
    finally:
        a.free_all()
        pyalloc.check(0)


def test_near_the_limit_a_miss_reuses_as_it_does_with_no_limit() -> None:
    """A limit does not change what a growth below it does: 24 + 12 MiB would pass 95% of a
    30 MiB device (28.5 MiB), and the miss still takes the 4 cached granules first and maps 2,
    as with no limit. Until 2026-11-29 it mapped 6 new granules there and the pressure ladder
    stitched once the device was full: a device that held the run with no limit's peak reserved
    could fail under it (resnet50_b256_s224: 10,988 MiB reserved with no limit, 11,026 needed)."""
    a = rebuilt("sim", "vmm=shared", "capacity=30MiB")
    try:
        _hole_between_live_blocks(a)
        big = a.malloc(12 * MiB)
        s = a.stats()
        assert big != 0
        assert s["num_reuses"] == 1 and s["reused_bytes"] == 8 * MiB
        assert s["reserved_bytes.all.current"] == 28 * MiB
        assert s["num_stitches"] == 0 and s["num_ooms"] == 0
    finally:
        a.free_all()
        pyalloc.check(0)


def test_with_reuse_off_near_the_limit_the_pressure_ladder_stitches() -> None:
    """reuse=0: a miss maps new granules until the device is full, then ladder step 2 stitches."""
    a = rebuilt("sim", "vmm=shared", "capacity=30MiB,reuse=0")
    try:
        _hole_between_live_blocks(a)
        big = a.malloc(12 * MiB)  # 6 MiB left to grow: 3 new granules, then the cached ones
        s = a.stats()
        assert big != 0
        assert s["num_reuses"] == 0
        assert s["num_stitches"] == 1
        assert s["num_ooms"] == 0
    finally:
        a.free_all()
        pyalloc.check(0)


@pytest.mark.parametrize("share", ["1", "0"])
@pytest.mark.parametrize("capacity, reuses", [("112MiB", 0), ("1GiB", 1)])
def test_near_the_limit_the_walk_for_donors_stops_after_16_blocks(capacity: str, reuses: int, share: str) -> None:
    """Near the limit a growth looks at the 16 smallest free blocks of a granule or more for
    donors, not at all of them (Note [Reuse before growing]: on a random churn near its peak they
    are mostly pieces of extents that cannot donate). 17 warm one-granule free blocks come before
    the one cold donor here: on a 112 MiB device (the request takes reserved memory past 95% of
    it) the growth maps new granules; far from the limit it walks on and reuses the donor's."""
    a = rebuilt("sim", "vmm=shared", f"capacity={capacity},extent=2MiB,share={share}")  # with sharing or without
    try:
        for _ in range(400):
            a.malloc(512)  # many live blocks: a block freed below is warm for 100 frees
        x = a.malloc(16 * MiB)
        a.malloc(4 * MiB)
        smalls = []
        for _ in range(17):
            a.malloc(2 * MiB)
            smalls.append(a.malloc(2 * MiB))
        a.free(x)
        a.malloc(3 * MiB)  # the front of x's free block: the rest is what a split leaves, cold
        for p in smalls:
            a.free(p)  # 17 free granules between live ones, freed moments ago: warm
        before = a.stats()
        a.malloc(20 * MiB)
        s = a.stats()
        assert s["num_reuses"] - before["num_reuses"] == reuses
        assert s["num_ooms"] == 0 and s["num_stitches"] == 0
    finally:
        a.free_all()
        pyalloc.check(0)


def test_near_the_limit_a_reuse_that_leaves_its_window_short_is_not_counted() -> None:
    """Near the limit, granules moved that, with what may still be reserved, do not fill the
    window go back (the single ones released) and the pressure ladder's stitching serves the
    request: such a move served nothing, and num_reuses and reused_bytes leave it out (a
    review's reproducer: a 4 MiB cold hole on the request's stream, 8 MiB freed on another
    stream, 6 MiB left to reserve). Moving only when the window would be filled cost memory and
    instructions elsewhere (Note [Reuse before growing])."""
    a = rebuilt("sim", "vmm=shared", "capacity=30MiB,extent=2MiB")
    try:
        a.malloc(8 * MiB, 0)
        hole = a.malloc(4 * MiB, 0)
        a.malloc(8 * MiB, 0)
        other = a.malloc(8 * MiB, 1)
        a.free(hole)
        a.free(other)
        before = a.stats()
        big = a.malloc(10 * MiB, 0)  # 5 granules: 1 may still be reserved, 2 in the hole
        s = a.stats()
        assert big != 0 and s["num_ooms"] == 0
        assert s["num_reuses"] == before["num_reuses"] and s["reused_bytes"] == before["reused_bytes"]
        assert s["num_stitches"] - before["num_stitches"] == 1
        assert s["reserved_bytes.all.current"] == 30 * MiB
    finally:
        a.free_all()
        pyalloc.check(0)
