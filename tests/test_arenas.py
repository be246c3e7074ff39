"""Virtual-memory arenas and stitching (Note [Arenas] in allocator/src/device/arena.cpp).

Run on the host backend, whose granules are real memfd chunks mapped into a
real reservation, so bytes written through one mapping are read back, and on
the sim backend. Every call is followed by ``pyalloc_check``, which verifies
I9 (holes granule-aligned and apart; a granule mapped exactly under the
blocks that need it; reserved == mapped).
"""

from __future__ import annotations

from typing import Iterator

import pytest

import pyalloc
from allocator_fixture import Allocator, checked, fill, fresh_conf, holds, rebuilt

MiB = 1 << 20
GRANULE = 2 * MiB


@pytest.fixture(params=["host", "sim"])
def arenas(request: pytest.FixtureRequest) -> Iterator[Allocator]:
    yield from checked(rebuilt(request.param, "vmm=on"))


def pending_bytes(a: Allocator) -> int:
    s = a.stats()
    return s["active_bytes.all.current"] - s["allocated_bytes.all.current"]


def test_growth_maps_only_the_granules_a_request_needs(arenas: Allocator) -> None:
    a = arenas.malloc(3 * MiB)
    s = arenas.stats()
    assert s["reserved_bytes.large_pool.current"] == 4 * MiB  # two granules, not a 20 MiB segment
    b = arenas.malloc(3 * MiB)
    assert b == a + 3 * MiB  # contiguous: the second granule's free MiB is used
    s = arenas.stats()
    assert s["reserved_bytes.large_pool.current"] == 6 * MiB
    assert s["segment.large_pool.current"] == 1  # one arena
    assert s["pool.large.segments"] == 1


def test_free_memory_on_both_sides_of_a_hole_joins_into_one_block(arenas: Allocator) -> None:
    a = arenas.malloc(3 * MiB)
    b = arenas.malloc(7 * MiB // 2)  # [3, 6.5) MiB: granule [4, 6) lies wholly inside
    c = arenas.malloc(3 * MiB)
    arenas.free(b)
    released = pyalloc.release_cached(0, 0)
    assert released == GRANULE  # only the whole granule inside b could go
    assert arenas.stats()["reserved_bytes.large_pool.current"] == 8 * MiB
    # 3.5 MiB fits again only across the hole: the allocator maps it back and
    # the free memory on each side joins the new granule.
    again = arenas.malloc(7 * MiB // 2)
    assert again == b
    assert arenas.stats()["reserved_bytes.large_pool.current"] == 10 * MiB
    del a, c


@pytest.mark.parametrize("reuse", ["1", "0"])
def test_stitching_moves_free_granules_to_where_a_request_fits(arenas: Allocator, reuse: str) -> None:
    """PyTorch's placement fails here (see the plain OOM-report test); moving the free slivers'
    granules serves it: reuse before growing does (Note [Reuse before growing], near the limit
    too), and with reuse=0 the pressure ladder's stitching."""
    pyalloc.configure(fresh_conf(arenas.backend, f"vmm=on,reuse={reuse}").replace("capacity=256MiB", "capacity=40MiB"))
    blocks = [arenas.malloc(3 * MiB) for _ in range(12)]  # 36 MiB of 3 MiB blocks: 18 granules
    live = blocks[1::2]
    if arenas.backend == "host":
        for i, p in enumerate(live):
            fill(p, 3 * MiB, 0x40 + i)
    for p in blocks[::2]:
        arenas.free(p)  # 3 MiB free slivers, no two together
    s = arenas.stats()
    assert s["reserved_bytes.all.current"] == 36 * MiB
    assert s["num_stitches"] == 0

    big = arenas.malloc(8 * MiB)  # 4 MiB of the device is left: needs granules from the slivers
    s = arenas.stats()
    assert big != 0
    count, moved = ("num_reuses", "reused_bytes") if reuse == "1" else ("num_stitches", "stitched_bytes")
    assert s[count] == 1
    assert s[moved] >= 4 * MiB
    assert s["reserved_bytes.all.current"] <= 40 * MiB
    assert s["num_ooms"] == 0
    if arenas.backend == "host":
        fill(big, 8 * MiB, 0x7E)  # every byte of the stitched range is backed and writable
        assert holds(big, 8 * MiB, 0x7E)
        for i, p in enumerate(live):  # the live blocks' bytes did not move
            assert holds(p, 3 * MiB, 0x40 + i)


def test_stitching_never_takes_a_granule_from_a_pending_block(arenas: Allocator) -> None:
    pyalloc.configure(
        fresh_conf(arenas.backend, "vmm=on,event_delay=1000").replace("capacity=256MiB", "capacity=24MiB")
    )
    pending = arenas.malloc(8 * MiB)
    pyalloc.record_stream(pending, 7)
    size, _ = arenas.live.pop(pending)
    pyalloc.free(pending, size)  # waits on stream 7's event: not free yet
    assert pending_bytes(arenas) == 8 * MiB
    keeper = arenas.malloc(14 * MiB)
    # Only 2 MiB of the device is left and the pending block's granules are not
    # free: a 4 MiB request can only be served once the pending free completes
    # (step 1 synchronizes pending frees, then the granules are free).
    extra = arenas.malloc(4 * MiB)
    s = arenas.stats()
    assert pending_bytes(arenas) == 0
    assert s["reserved_bytes.all.current"] <= 24 * MiB
    del keeper, extra


def test_empty_cache_gives_back_every_granule_and_reservation(arenas: Allocator) -> None:
    ptrs = [arenas.malloc(s * MiB) for s in (3, 5, 7, 11)]
    for p in ptrs:
        arenas.free(p)
    pyalloc.empty_cache()
    s = arenas.stats()
    assert s["reserved_bytes.all.current"] == 0
    assert s["segment.all.current"] == 0
    assert s["num_device_alloc"] == s["num_device_free"] > 0
    p = arenas.malloc(3 * MiB)  # a new arena
    assert arenas.stats()["reserved_bytes.large_pool.current"] == 4 * MiB
    del p


def test_max_cached_unmaps_free_granules(arenas: Allocator) -> None:
    pyalloc.configure(fresh_conf(arenas.backend, "vmm=on,max_cached=4MiB"))
    keep = arenas.malloc(2 * MiB)
    big = arenas.malloc(16 * MiB)
    arenas.free(big)
    s = arenas.stats()
    assert s["inactive_split_bytes.all.current"] <= 4 * MiB
    assert s["reserved_bytes.all.current"] <= 2 * MiB + 4 * MiB
    del keep


def test_each_stream_gets_its_own_arena(arenas: Allocator) -> None:
    a = arenas.malloc(3 * MiB, stream=0)
    b = arenas.malloc(3 * MiB, stream=5)
    s = arenas.stats()
    assert s["segment.large_pool.current"] == 2
    assert abs(a - b) >= 4 * MiB  # different reservations
    arenas.free(a)
    c = arenas.malloc(3 * MiB, stream=5)  # not the stream-0 block
    assert c != a
    arenas.free(b, stream=5)
    arenas.free(c, stream=5)


def test_a_free_of_an_address_inside_a_hole_is_refused(arenas: Allocator) -> None:
    a = arenas.malloc(6 * MiB)
    arenas.free(a)
    pyalloc.release_cached(0, 0)
    before = arenas.stats()
    with pytest.raises(pyalloc.PyallocError, match="not the start of a live allocation|not allocated"):
        pyalloc.free(a, 6 * MiB)
    after = arenas.stats()
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    assert after["num_invalid_free"] == before["num_invalid_free"] + 1


def test_user_pools_grow_in_arenas_too(arenas: Allocator) -> None:
    with pyalloc.pool("params"):
        p = arenas.malloc(3 * MiB)
    s = arenas.stats()
    assert s["pool.params.reserved_bytes"] == 4 * MiB
    assert s["pool.params.segments"] == 1
    del p


def test_vmm_all_puts_the_small_pool_in_an_arena(arenas: Allocator) -> None:
    pyalloc.configure(fresh_conf(arenas.backend, "vmm=all"))
    ptrs = [arenas.malloc(700 << 10) for _ in range(3)]  # 2.05 MiB: three straddle two granules
    s = arenas.stats()
    assert s["reserved_bytes.small_pool.current"] == 4 * MiB
    assert s["segment.small_pool.current"] == 1
    assert ptrs[1] == ptrs[0] + (700 << 10) and ptrs[2] == ptrs[1] + (700 << 10)


def test_vmm_shared_serves_small_requests_from_the_large_arena(arenas: Allocator) -> None:
    """Note [One arena for small and large]: a small request fills the sliver a large block left."""
    pyalloc.configure(fresh_conf(arenas.backend, "vmm=shared"))
    big = arenas.malloc(3 * MiB)  # two granules: 1 MiB of the second is free
    small = [arenas.malloc(256 << 10) for _ in range(4)]
    assert small == [big + 3 * MiB + k * (256 << 10) for k in range(4)]
    s = arenas.stats()
    assert s["reserved_bytes.all.current"] == 4 * MiB  # no 2 MiB small segment
    assert s["segment.small_pool.current"] == 0 and s["allocation.large_pool.current"] == 5
    if arenas.backend == "host":  # real bytes: the small blocks share the big one's granule
        fill(big, 3 * MiB, 0x5A)
        for k, p in enumerate(small):
            fill(p, 256 << 10, k + 1)
        assert holds(big, 3 * MiB, 0x5A)
        assert all(holds(p, 256 << 10, k + 1) for k, p in enumerate(small))
    # A small block left behind keeps one granule, not a segment: the rest goes back.
    arenas.free(big)
    for p in small[1:]:
        arenas.free(p)
    assert pyalloc.release_cached(0, 0) == GRANULE
    assert arenas.stats()["reserved_bytes.all.current"] == GRANULE
    if arenas.backend == "host":
        assert holds(small[0], 256 << 10, 1)


def test_a_block_of_whole_granules_starts_on_a_granule_boundary(arenas: Allocator) -> None:
    """Note [Whole granules]: it lies over exactly its own granules, and gives them all back."""
    pyalloc.configure(fresh_conf(arenas.backend, "vmm=shared"))
    small = arenas.malloc(256 << 10)
    big = arenas.malloc(4 * MiB)  # packed from the front it would lie over [0.25, 4.25): three granules
    assert big == small + GRANULE
    assert arenas.stats()["reserved_bytes.all.current"] == 6 * MiB
    odd = arenas.malloc(3 * MiB)  # not whole granules: packed right after big
    assert odd == big + 4 * MiB
    filler = arenas.malloc(GRANULE - (256 << 10))  # the front part stays free, for requests that fit it
    assert filler == small + (256 << 10)
    arenas.free(filler)
    arenas.free(small)
    if arenas.backend == "host":
        fill(big, 4 * MiB, 0x3C)
    arenas.free(odd)
    # The first granule and the last two (odd's) go back; big keeps exactly its own two.
    assert pyalloc.release_cached(0, 0) == 3 * GRANULE
    assert arenas.stats()["reserved_bytes.all.current"] == 4 * MiB
    if arenas.backend == "host":
        assert holds(big, 4 * MiB, 0x3C)


def test_a_cache_hit_of_whole_granules_starts_on_a_boundary_too(arenas: Allocator) -> None:
    pyalloc.configure(fresh_conf(arenas.backend, "vmm=shared"))
    small = arenas.malloc(256 << 10)
    odd = arenas.malloc(7 * MiB // 2)  # [0.25, 3.75): packed from the front
    keep = arenas.malloc(GRANULE)  # [4, 6)
    assert odd == small + (256 << 10) and keep == small + 2 * GRANULE
    arenas.free(odd)  # a cached free block [0.25, 4): larger than 2 MiB, not on a boundary
    again = arenas.malloc(GRANULE)  # the fast path finds it and leaves it to the general path
    assert again == small + GRANULE
    exact = arenas.malloc(GRANULE - (256 << 10))  # an exact fit of the front part: the fast path keeps it
    assert exact == small + (256 << 10)
    s = arenas.stats()
    assert s["allocation.all.current"] == 4 and s["reserved_bytes.all.current"] == 6 * MiB


def test_vmm_on_keeps_a_small_pool_of_plain_segments(arenas: Allocator) -> None:
    big = arenas.malloc(3 * MiB)
    small = arenas.malloc(256 << 10)
    s = arenas.stats()
    assert s["reserved_bytes.all.current"] == 6 * MiB  # the arena's two granules and a 2 MiB segment
    assert s["segment.small_pool.current"] == 1 and s["allocation.small_pool.current"] == 1
    del big, small


def test_vmm_is_a_layout_key_with_a_clear_error_for_bad_values() -> None:
    with pytest.raises(pyalloc.PyallocError, match="bad value 'maybe' for vmm: expected auto, on, shared, all or off"):
        pyalloc.configure("vmm=maybe")
    pyalloc.configure(fresh_conf("sim", "vmm=off"))
    assert pyalloc.config()["vmm"] == "off"
    pyalloc.configure(fresh_conf("sim", "vmm=SHARED"))
    assert pyalloc.config()["vmm"] == "shared"
    pyalloc.configure(fresh_conf("sim"))
    assert pyalloc.config()["vmm"] == "auto"


def test_a_small_segment_finds_room_in_arenas_above_a_lowered_memory_fraction(arenas: Allocator) -> None:
    # Found by the property test: the arena caches 100 MiB on one stream, then
    # the limit drops to 64 MiB. A small request on another stream needs a
    # plain 2 MiB segment; stitching gave back only 2 MiB of the arena's free
    # granules, still over the limit, and the request failed with nothing live.
    pyalloc.set_memory_fraction(0.5, 0)  # 128 MiB of the 256 MiB device
    big = arenas.malloc(100 * MiB, stream=0)
    arenas.free(big)
    pyalloc.set_memory_fraction(0.25, 0)  # 64 MiB: less than the arena holds
    assert arenas.stats()["reserved_bytes.all.current"] == 100 * MiB
    small = arenas.malloc(4096, stream=1)
    assert small != 0
    assert arenas.stats()["reserved_bytes.all.current"] <= 64 * MiB
    if arenas.backend == "host":
        fill(small, 4096, 0x5A)
        assert holds(small, 4096, 0x5A)
