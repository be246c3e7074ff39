"""Balanced slivers (Note [Balanced slivers] in allocator/src/blocks/arena.hpp).

Near a full device, while an arena's slivers are indexed and it has more free granule ends
than free starts (by over two), a request that is not a whole number of granules, placed in
a free block that starts on a granule boundary, ends on the boundary of the last granule it
spans: its first granule's start stays free, a free start for moves and shared windows to
pair with a free end. Elsewhere placement is as before: the front of the free block. Every
call is followed by ``pyalloc_check``, which compares each kind's count with the blocks (I14).
"""

from __future__ import annotations

from typing import Iterator

import pytest

import pyalloc
from allocator_fixture import Allocator, rebuilt
from pyalloc.traces import replay, stress

MiB = 1 << 20
KiB = 1 << 10


@pytest.fixture(params=["host", "sim"])
def indexed(request: pytest.FixtureRequest) -> Iterator[tuple[Allocator, list[int]]]:
    """A 16 MiB device (eight granules) full of 1 MiB blocks; a 4 MiB request fails, which
    builds the arena's sliver index (the last rung, moving, reads it). Reserved memory stays
    at the limit, so the index stays on."""
    a = rebuilt(request.param, "vmm=shared", "capacity=16MiB")
    blocks = [a.malloc(MiB) for _ in range(16)]
    try:
        assert [p - blocks[0] for p in blocks] == [i * MiB for i in range(16)]
        with pytest.raises(pyalloc.PyallocError, match="out of memory"):
            a.malloc(4 * MiB)
        s = a.stats()
        assert s["num_sliver_indexes"] == 1 and s["num_ooms"] == 1
        yield a, blocks
    finally:
        a.free_all()
        pyalloc.check(0)
        pyalloc.empty_cache()
        assert a.stats()["reserved_bytes.all.current"] == 0


def free_slivers_and_a_block_on_a_boundary(a: Allocator, blocks: list[int], ends: int, starts: int = 0,
                                           last: int = 4) -> int:
    """Frees the second MiB of the first `ends` granules (each a free end: live up to 1 MiB,
    free after), the first MiB of granules 4 and 5 for `starts` of 0 to 2 (each a free start:
    free up to 1 MiB, live after), and the `last` blocks from the 12th MiB on (a free block on a
    granule boundary); returns where that block starts."""
    assert ends <= 3 or starts == 0  # the fourth free end, [7, 8), would merge with a start at 8
    for i in range(ends):
        a.free(blocks[2 * i + 1])
    for i in range(starts):
        a.free(blocks[8 + 2 * i])
    for p in blocks[12:12 + last]:
        a.free(p)
    return blocks[0] + 12 * MiB


def spanned(size: int) -> int:
    return -(-size // (2 * MiB)) * 2 * MiB


@pytest.mark.parametrize("size", [1536 * KiB, 3 * MiB])
def test_with_more_free_ends_a_request_ends_on_a_granule_boundary(indexed: tuple[Allocator, list[int]],
                                                                   size: int) -> None:
    a, blocks = indexed
    at = free_slivers_and_a_block_on_a_boundary(a, blocks, 4)  # four free ends, no free start
    ptr = a.malloc(size)
    assert ptr == at + spanned(size) - size  # its first granule's start is free: a free start
    assert a.stats()["num_sliver_indexes"] == 1  # the index was on throughout


@pytest.mark.parametrize("ends, starts, balanced", [(3, 0, True), (3, 2, False), (2, 0, False)])
def test_free_ends_must_outnumber_free_starts_by_more_than_two(indexed: tuple[Allocator, list[int]], ends: int,
                                                               starts: int, balanced: bool) -> None:
    a, blocks = indexed
    at = free_slivers_and_a_block_on_a_boundary(a, blocks, ends, starts)
    size = 1536 * KiB
    assert a.malloc(size) == (at + spanned(size) - size if balanced else at)


def test_the_next_request_in_a_free_block_that_starts_inside_a_granule_takes_its_front(
        indexed: tuple[Allocator, list[int]]) -> None:
    a, blocks = indexed
    at = free_slivers_and_a_block_on_a_boundary(a, blocks, 2)
    assert a.malloc(1536 * KiB) == at
    assert a.malloc(1536 * KiB) == at + 1536 * KiB  # in [13.5, 16): at its front


def test_a_free_block_short_of_the_granules_spanned_is_taken_from_its_front(
        indexed: tuple[Allocator, list[int]]) -> None:
    a, blocks = indexed
    at = free_slivers_and_a_block_on_a_boundary(a, blocks, 4, last=3)  # [12, 15): 3 MiB, not the 4 that 2.5 span
    assert a.malloc(5 * MiB // 2) == at


def test_a_request_of_whole_granules_still_starts_on_a_boundary(indexed: tuple[Allocator, list[int]]) -> None:
    a, blocks = indexed
    at = free_slivers_and_a_block_on_a_boundary(a, blocks, 4)
    assert a.malloc(2 * MiB) == at


def test_a_request_grown_into_extents_keeps_its_partly_used_granule_last() -> None:
    """A window grown for a request of 64 MiB or more maps the granules the request covers
    wholly from its start as extents, and the last, partly used one as a granule of its own
    (Note [Extents]); a free start in an extent could be neither shared nor moved, so the
    request takes the window's front, and its free end lies in that single granule."""
    a = rebuilt("sim", "vmm=shared", "capacity=1024MiB")
    try:
        blocks = [a.malloc(MiB) for _ in range(16)]
        a.malloc(910 * MiB)
        with pytest.raises(pyalloc.PyallocError, match="out of memory"):
            a.malloc(200 * MiB)  # builds the index
        for i in range(4):
            a.free(blocks[2 * i + 1])  # four free ends
        assert a.malloc(66 * MiB + 512 * KiB) == blocks[0] + 926 * MiB  # the window's front
        assert a.stats()["num_sliver_indexes"] == 1
    finally:
        a.free_all()
        pyalloc.check(0)


def test_far_from_a_full_device_a_request_takes_the_front() -> None:
    """The same layout on a device with room to spare: no index, front placement."""
    a = rebuilt("sim", "vmm=shared", "capacity=256MiB")
    try:
        blocks = [a.malloc(MiB) for _ in range(16)]
        at = free_slivers_and_a_block_on_a_boundary(a, blocks, 4)
        assert a.malloc(1536 * KiB) == at
        assert a.stats()["num_sliver_indexes"] == 0
    finally:
        a.free_all()
        pyalloc.check(0)


def test_interleaved_lifetimes_fits_606_mib() -> None:
    """Random sizes living long among short-lived ones: 614 MiB with front placement alone
    (peak live 589.0 MiB), 606 with free starts made while free ends outnumber them."""
    flat = stress.load_workload("interleaved_lifetimes", 0, False).flat
    assert replay.replays_cleanly(flat, "pyalloc", "sim", 606 * MiB)
