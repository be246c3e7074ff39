"""Held pools and captures (Note [Held pools], Note [Capture] in allocator/src/device/pools.cpp).

What a CUDA graph needs of the allocator, shown on every CPU backend variant through the C ABI
(``pyalloc.hold_pool``, ``pyalloc.empty_pool``, ``pyalloc.capturing``), each call followed by
``pyalloc_check``: a held pool's memory is never released or moved by anything but its own
emptying, and during a capture the allocator queries no event, releases nothing and defers the
frees that would need the driver.
"""

from __future__ import annotations

import itertools

import pytest

import pyalloc
from allocator_fixture import Allocator

KiB = 1 << 10
MiB = 1 << 20

_names = itertools.count()


def fresh_pool() -> int:
    """A user pool no other test has used (pool names live as long as the process)."""
    return pyalloc.create_pool(f"test-held-{next(_names)}")


def pool_segments(pool_id: int) -> list[dict]:
    return [s for s in pyalloc.snapshot()["segments"] if s["segment_pool_id"][1] == pool_id]


def block_state(ptr: int) -> str:
    for seg in pyalloc.snapshot()["segments"]:
        for block in seg["blocks"]:
            if block["address"] == ptr:
                return str(block["state"])
    raise AssertionError(f"no block at {ptr:#x}")


def malloc_in(allocator: Allocator, pool_id: int, size: int, stream: int = 0) -> int:
    pyalloc.core.lib().pyalloc_set_current_pool(pool_id)
    try:
        return allocator.malloc(size, stream=stream)
    finally:
        pyalloc.core.lib().pyalloc_set_current_pool(0)


# ---- held pools ----------------------------------------------------------------------


def test_a_held_pool_keeps_its_free_memory_through_empty_cache(allocator: Allocator) -> None:
    pool_id = fresh_pool()
    pyalloc.hold_pool(pool_id)
    a = malloc_in(allocator, pool_id, 3 * MiB)
    allocator.free(a)
    reserved = allocator.stats()["reserved_bytes.all.current"]
    assert reserved > 0
    pyalloc.empty_cache()
    pyalloc.release_cached(0, 0)
    pyalloc.check(0)
    assert allocator.stats()["reserved_bytes.all.current"] == reserved  # a graph would replay into it
    # The pool's own emptying gives it back.
    released, still = pyalloc.empty_pool(pool_id)
    assert (released, still) == (reserved, 0)
    assert allocator.stats()["reserved_bytes.all.current"] == 0


def test_a_held_pool_grows_by_plain_segments_even_with_arenas(allocator: Allocator) -> None:
    pool_id = fresh_pool()
    pyalloc.hold_pool(pool_id)
    a = malloc_in(allocator, pool_id, 3 * MiB)
    segs = pool_segments(pool_id)
    assert len(segs) == 1 and not segs[0]["is_expandable"]  # a plain segment's memory never moves
    allocator.free(a)


def test_a_held_pools_blocks_go_to_its_own_requests_only(allocator: Allocator) -> None:
    pool_id = fresh_pool()
    pyalloc.hold_pool(pool_id)
    a = malloc_in(allocator, pool_id, 4 * MiB)
    allocator.free(a)
    b = allocator.malloc(4 * MiB)  # the default pool: not the held pool's free block
    assert b != a
    c = malloc_in(allocator, pool_id, 4 * MiB)
    assert c == a  # the pool's own request reuses it
    allocator.free(b)
    allocator.free(c)


def test_a_pool_let_go_is_released_like_any_other(allocator: Allocator) -> None:
    pool_id = fresh_pool()
    pyalloc.hold_pool(pool_id)
    a = malloc_in(allocator, pool_id, 3 * MiB)
    b = malloc_in(allocator, pool_id, 30 * MiB)  # a segment of its own, live after the let-go
    allocator.free(a)
    pyalloc.hold_pool(pool_id, False)
    pyalloc.empty_cache()
    pyalloc.check(0)
    assert [s["allocated_size"] > 0 for s in pool_segments(pool_id)] == [True]
    released, still = pyalloc.empty_pool(pool_id)
    assert released == 0 and still == pool_segments(pool_id)[0]["total_size"]
    allocator.free(b)


def test_emptying_a_pool_not_held_releases_its_free_memory_in_arenas_too(allocator: Allocator) -> None:
    # the emptying skipped arena segments (the default with vmm): nothing released, every byte
    # said to be "still reserved" with no block live; empty_cache then released them
    pool_id = fresh_pool()
    a = malloc_in(allocator, pool_id, 3 * MiB)
    b = malloc_in(allocator, pool_id, 100)
    before = allocator.stats()["reserved_bytes.all.current"]
    allocator.free(a)
    allocator.free(b)
    released, still = pyalloc.empty_pool(pool_id)
    pyalloc.check(0)
    assert released > 0 and still == 0
    assert allocator.stats()["reserved_bytes.all.current"] == before - released == 0


def test_holding_a_pool_that_already_has_arenas_is_refused(allocator: Allocator) -> None:
    if allocator.vmm == "vmm=off":
        pytest.skip("user pools have no arenas with vmm=off")
    pool_id = fresh_pool()
    a = malloc_in(allocator, pool_id, 3 * MiB)
    with pytest.raises(pyalloc.PyallocError, match="before its first allocation"):
        pyalloc.hold_pool(pool_id)
    allocator.free(a)


def test_unknown_pools_are_refused_by_name() -> None:
    with pytest.raises(pyalloc.PyallocError, match="pyalloc_pool_hold: no user pool has id 100000"):
        pyalloc.hold_pool(100000)
    with pytest.raises(pyalloc.PyallocError, match="pyalloc_pool_empty_cache: no user pool has id 0"):
        pyalloc.empty_pool(0)


# ---- captures ------------------------------------------------------------------------


def test_during_a_capture_nothing_is_released(allocator: Allocator) -> None:
    a = allocator.malloc(3 * MiB)
    allocator.free(a)
    before = allocator.stats()
    with pyalloc.capturing(0):
        pyalloc.empty_cache()
        assert pyalloc.release_cached(0, 0) == 0
        pyalloc.check(0)
    after = allocator.stats()
    assert after["num_device_free"] == before["num_device_free"]
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    pyalloc.empty_cache()  # after the capture, as always
    assert allocator.stats()["reserved_bytes.all.current"] == 0


def test_a_free_used_on_other_streams_waits_for_the_end_of_the_capture(allocator: Allocator) -> None:
    pyalloc.configure(allocator.conf("event_delay=0"))
    a = allocator.malloc(64 * KiB, stream=1)
    pyalloc.record_stream(a, 2)
    with pyalloc.capturing(0):
        allocator.free(a, stream=1)
        # No event was recorded (it would be part of the graph) and none is queried: the block
        # stays pending however many requests come.
        assert block_state(a) == "active_pending_free"
        for _ in range(3):
            allocator.free(allocator.malloc(12 * MiB, stream=1))
            assert block_state(a) == "active_pending_free"
    # The end of the capture records the event; it has completed (event_delay=0): free again.
    assert block_state(a) == "inactive"
    assert allocator.stats()["active_bytes.all.current"] == 0


def test_arena_frees_during_a_capture_are_deferred_then_finished(allocator: Allocator) -> None:
    blocks = [allocator.malloc(3 * MiB) for _ in range(4)]
    in_arena = [s["is_expandable"] for s in pyalloc.snapshot()["segments"]]
    with pyalloc.capturing(0):
        for b in blocks:
            allocator.free(b)
        stats = allocator.stats()
        if any(in_arena):  # an arena's free may part shared granules: the driver; deferred
            assert stats["active_bytes.all.current"] == 4 * 3 * MiB
        else:  # a plain segment's free is the cache's business: at once
            assert stats["active_bytes.all.current"] == 0
    assert allocator.stats()["active_bytes.all.current"] == 0
    assert allocator.stats()["allocated_bytes.all.current"] == 0


def test_a_capture_serves_from_the_cache_and_grows_but_climbs_no_ladder(allocator: Allocator) -> None:
    # 256 MiB device: fill most of it with cached free memory, then ask for more than is left
    # unreserved. Outside a capture the ladder releases the cache and serves it; during one
    # the request fails with a report that says why.
    cached, pins = [], []
    for _ in range(5):  # live 1 MiB blocks between them, so the cached ones cannot coalesce
        cached.append(allocator.malloc(40 * MiB))
        pins.append(allocator.malloc(3 * MiB))  # the large pool, beside them in an arena
    for c in cached:
        allocator.free(c)
    with pyalloc.capturing(0):
        small = allocator.malloc(1 * MiB)  # from the cache
        assert small
        with pytest.raises(pyalloc.PyallocError, match="A CUDA graph capture is under way"):
            pyalloc.malloc(120 * MiB, 0, 0)
        pyalloc.check(0)
        assert allocator.stats()["num_ooms"] == 1
    big = allocator.malloc(120 * MiB)  # the ladder releases the cache now
    assert big
    allocator.free(big)
    allocator.free(small)
    for p in pins:
        allocator.free(p)


def test_captures_nest_and_an_unbalanced_end_is_refused(allocator: Allocator) -> None:
    with pyalloc.capturing(0):
        with pyalloc.capturing(0):
            pass
        pyalloc.empty_cache()
        a = allocator.malloc(3 * MiB)
        allocator.free(a)
        assert allocator.stats()["reserved_bytes.all.current"] > 0  # still capturing: kept
    with pytest.raises(pyalloc.PyallocError, match="no capture was begun on device 0"):
        with pyalloc.capturing(0):
            pyalloc.core.lib().pyalloc_capture_end(0)
    with pytest.raises(pyalloc.PyallocError, match="device 7 is out of range"):
        with pyalloc.capturing(7):
            pass


def test_a_capture_grows_by_new_granules_and_moves_none(allocator: Allocator) -> None:
    # Cached whole granules that a growth outside a capture would move (Note [Reuse before
    # growing]) stay where they are during one: moving them synchronizes and remaps.
    cached, pins = [], []
    for _ in range(3):
        cached.append(allocator.malloc(8 * MiB))
        pins.append(allocator.malloc(3 * MiB))
    for c in cached:
        allocator.free(c)
    before = allocator.stats()
    with pyalloc.capturing(0):
        big = allocator.malloc(20 * MiB)
        pyalloc.check(0)
    after = allocator.stats()
    assert after["num_reuses"] == before["num_reuses"]
    assert after["num_stitches"] == before["num_stitches"]
    allocator.free(big)
    for p in pins:
        allocator.free(p)


def test_the_ladder_releases_nothing_when_a_capture_begins_during_its_callbacks(allocator: Allocator) -> None:
    """Steps 3 and 4 of the ladder run without the device lock; a capture may begin meanwhile
    (another thread's beginAllocateToPool). What follows them must release nothing: I15 counts
    any release, unmap or event call made during a capture, and pyalloc_check fails on one."""
    held, pins = [], []
    for _ in range(5):  # 40 MiB blocks between live pins: freed, none fits 120 MiB, each releasable
        held.append(allocator.malloc(40 * MiB))
        pins.append(allocator.malloc(3 * MiB))

    device_frees_at_capture: list[int] = []

    def free_and_begin_a_capture(device: int, needed: int) -> int:
        for ptr in held:
            allocator.free(ptr)
        pyalloc.core.lib().pyalloc_capture_begin(0)  # as another thread's capture would, meanwhile
        device_frees_at_capture.append(allocator.stats()["num_device_free"])
        return 40 * MiB * len(held)

    handle = pyalloc.register_pressure_callback(free_and_begin_a_capture)
    try:
        with pytest.raises(pyalloc.PyallocError, match="A CUDA graph capture is under way"):
            pyalloc.malloc(120 * MiB, 0, 0)
        pyalloc.check(0)  # I15: no release, unmap or event call during the capture
        assert device_frees_at_capture  # the capture began inside the ladder
    finally:
        pyalloc.unregister_pressure_callback(handle)
        pyalloc.core.lib().pyalloc_capture_end(0)
    for p in pins:
        allocator.free(p)
