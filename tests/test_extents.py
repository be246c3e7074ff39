"""Extents: an arena's growth maps the granules a request lies over wholly in chunks of several
granules (Note [Extents] in allocator/src/device/chunks.cpp).

On a GPU each mapping costs about 100 us to make and undo whatever its size, so a growth creates
the largest power of two of granules that is at most a sixteenth of its request (up to
``extent``, 32 MiB by default) as one chunk; the request's partly used first and last granules
stay single. The counts below are the backend's: ``num_device_alloc`` is one per chunk created.
Run on the sim backend (counts at GPU scale) and the host backend (real memfd chunks, real bytes);
``pyalloc_check`` after each test verifies I16 (a chunk is mapped whole over the granules that
record it).
"""

from __future__ import annotations

from typing import Iterator

import pytest

import pyalloc
from allocator_fixture import Allocator, checked, fill, holds, rebuilt

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture(params=["host", "sim"])
def arenas(request: pytest.FixtureRequest) -> Iterator[Allocator]:
    yield from checked(rebuilt(request.param, "vmm=shared"))


def created(a: Allocator) -> int:
    return a.stats()["num_device_alloc"]


@pytest.mark.parametrize("size, extent, chunks", [
    (64 * MiB, "32MiB", 16),   # 4 MiB extents: a sixteenth of 64 MiB
    (64 * MiB, "2MiB", 32),    # every granule its own chunk
    (128 * MiB, "32MiB", 16),  # 8 MiB extents
    (32 * MiB, "32MiB", 16),   # a sixteenth is 2 MiB: single granules
    (200 * MiB, "8MiB", 25),   # 12.5 MiB would be allowed; the cap is 8 MiB
])
def test_a_growth_creates_one_chunk_per_extent(size: int, extent: str, chunks: int) -> None:
    a = rebuilt("sim", "vmm=shared", f"extent={extent}")
    p = a.malloc(size)  # the arena's first block: whole granules from its start
    assert created(a) == chunks
    assert a.stats()["reserved_bytes.all.current"] == size
    pyalloc.check(0)
    a.free(p)
    pyalloc.empty_cache()
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 0 and s["num_device_free"] == chunks  # every extent went back whole
    pyalloc.check(0)


def test_a_gpu_size_request_maps_in_32_mib_extents() -> None:
    a = rebuilt("sim", "vmm=shared", "capacity=80GiB")
    p = a.malloc(33 * GiB)  # GPT-2's logits at batch 172
    assert created(a) == 33 * GiB // (32 * MiB)  # 1,056 chunks where granules made 16,896
    a.free(p)
    pyalloc.empty_cache()
    pyalloc.check(0)


def test_partly_used_end_granules_stay_single(arenas: Allocator) -> None:
    arenas.malloc(MiB)  # the next block starts 1 MiB into a granule
    before = created(arenas)
    arenas.malloc(64 * MiB + 4096)  # [1 MiB, 65 MiB + 4 KiB): granules 0 and 32 partly, 1..31 wholly
    # Granule 0 already exists (the first block's); 31 whole granules in 4 MiB extents and
    # one left over, and the last granule single: 15 + 1 + 1 chunks.
    assert created(arenas) - before == 17


def test_a_small_block_in_a_freed_extent_keeps_that_extent_alone(arenas: Allocator) -> None:
    """The trade Note [Extents] makes: a later tenant of a freed block pins the extent it lands
    in (4 MiB of a 64 MiB block's extents), not the block; with extent=2MiB it pins a granule."""
    big = arenas.malloc(64 * MiB)
    arenas.free(big)
    small = arenas.malloc(MiB)
    assert small == big  # best fit: the front of the freed block
    pyalloc.empty_cache()
    assert arenas.stats()["reserved_bytes.all.current"] == 4 * MiB
    if arenas.backend == "host":
        fill(small, MiB, 0x3C)
        assert holds(small, MiB, 0x3C)


@pytest.mark.parametrize("reuse", ["1", "0"])
def test_stitching_gives_whole_extents_back_and_live_bytes_stay(arenas: Allocator, reuse: str) -> None:
    """Near a full device, memory moves by giving whole chunks back and creating the window's
    anew: the live blocks' bytes are untouched, and a request that no free block holds is served.
    By reuse before growing (Note [Reuse before growing]: near the limit too), or with reuse=0
    by the pressure ladder's stitching once the device is full."""
    a = rebuilt(arenas.backend, "vmm=shared", f"capacity=160MiB,reuse={reuse}")
    try:
        blocks = [a.malloc(32 * MiB + MiB) for _ in range(4)]  # 132 MiB over singles and 2 MiB pieces
        for i, p in enumerate(blocks):
            if a.backend == "host":
                fill(p, 32 * MiB + MiB, 0x10 + i)
        a.free(blocks[0])
        a.free(blocks[2])
        big = a.malloc(56 * MiB)  # no free block holds it, and only 28 MiB is unreserved
        s = a.stats()
        assert big != 0 and s["num_ooms"] == 0
        if reuse == "1":  # the window's 28 granules all come from the freed blocks: nothing new
            assert (s["num_reuses"], s["reused_bytes"], s["num_stitches"]) == (1, 56 * MiB, 0)
            assert s["reserved_bytes.all.current"] == 132 * MiB
        else:  # new granules to the limit, then the ladder stitches the 14 missing
            assert (s["num_reuses"], s["num_stitches"], s["stitched_bytes"]) == (0, 1, 28 * MiB)
            assert s["reserved_bytes.all.current"] == 160 * MiB
        if a.backend == "host":
            assert holds(blocks[1], 32 * MiB + MiB, 0x11) and holds(blocks[3], 32 * MiB + MiB, 0x13)
            fill(big, 56 * MiB, 0x77)
            assert holds(big, 56 * MiB, 0x77)
            assert holds(blocks[1], 32 * MiB + MiB, 0x11) and holds(blocks[3], 32 * MiB + MiB, 0x13)
        pyalloc.check(0)
    finally:
        a.free_all()
        pyalloc.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0


@pytest.mark.parametrize("value", ["3MiB", "6MiB", "1MiB", "2GiB", "0", "lots"])
def test_an_extent_that_is_not_a_power_of_two_from_2_mib_to_1_gib_is_refused_by_name(value: str) -> None:
    before = pyalloc.config()["extent"]
    with pytest.raises(pyalloc.PyallocError, match=r"extent.*a power of two from 2MiB to 1GiB"):
        pyalloc.configure(f"extent={value}")
    assert pyalloc.config()["extent"] == before


@pytest.mark.parametrize("extent, created_, released", [("2MiB", 16, 0), ("32MiB", 20, 16)])
def test_reuse_maps_single_granules_again_and_gives_extents_back(extent: str, created_: int, released: int) -> None:
    """A 128 MiB block freed, cold (the arena's only free block), and a 160 MiB request that no
    cached block holds: reuse before growing moves the freed block's memory into the window, so
    reserved memory stays at what is live. Single granules are mapped again: with extent=2MiB the
    64 granules move and only the 16 missing are created, none released, as before extents. By
    default the block's 16 extents of 8 MiB go back whole, and the window's memory is created
    anew, in 20 extents of 8 MiB."""
    a = rebuilt("sim", "vmm=shared", f"capacity=1GiB,extent={extent}")
    try:
        first = a.malloc(128 * MiB)
        a.malloc(128 * MiB)
        a.free(first)
        before = a.stats()
        a.malloc(160 * MiB)
        s = a.stats()
        assert s["num_reuses"] - before["num_reuses"] == 1 and s["reused_bytes"] - before["reused_bytes"] == 128 * MiB
        assert (s["num_device_alloc"] - before["num_device_alloc"],
                s["num_device_free"] - before["num_device_free"]) == (created_, released)
        assert s["reserved_bytes.all.current"] == 288 * MiB
        pyalloc.check(0)
    finally:
        a.free_all()
