"""The conformance suite: one set of behaviours, run against every CPU backend.

Every allocation and free goes through the C ABI (via ctypes) and is followed
by ``pyalloc_check``; the ``allocator`` fixture (allocator_fixture.py)
parametrizes over the host and sim backends, each with plain segments and with
virtual-memory arenas. Arena-specific behaviour is in test_arenas.py.
"""

from __future__ import annotations

import ctypes
import threading

import pytest

import pyalloc
from allocator_fixture import PLAIN, WITH_SMALL_POOL, Allocator

KiB = 1 << 10
MiB = 1 << 20


def segments(device: int = 0) -> list[dict]:
    return [s for s in pyalloc.snapshot()["segments"] if s["device"] == device]


def block_at(ptr: int) -> dict:
    for seg in pyalloc.snapshot()["segments"]:
        for block in seg["blocks"]:
            if block["address"] == ptr:
                return block
    raise AssertionError(f"no block at {ptr:#x}")


# ---- alloc, split, coalesce, reuse -------------------------------------------------


def test_malloc_returns_512_aligned_distinct_blocks(allocator: Allocator) -> None:
    ptrs = [allocator.malloc(n) for n in (1, 511, 512, 513, 4000, 100_000)]
    assert all(p % 512 == 0 for p in ptrs)
    assert len(set(ptrs)) == len(ptrs)
    spans = sorted((p, p + max(512, -(-n // 512) * 512)) for p, n in zip(ptrs, (1, 511, 512, 513, 4000, 100_000)))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize("allocator", WITH_SMALL_POOL, indirect=True)  # small-segment geometry
def test_small_requests_share_one_small_segment(allocator: Allocator) -> None:
    for _ in range(10):
        allocator.malloc(10 * KiB)
    s = allocator.stats()
    assert s["segment.small_pool.current"] == 1
    assert s["reserved_bytes.all.current"] == 2 * MiB
    assert s["allocated_bytes.small_pool.current"] == 10 * 10 * KiB
    assert s["requested_bytes.all.current"] == 10 * 10 * KiB


def test_sizes_round_up_to_512_bytes(allocator: Allocator) -> None:
    allocator.malloc(1000)
    s = allocator.stats()
    assert s["allocated_bytes.all.current"] == 1024
    assert s["requested_bytes.all.current"] == 1000


def test_split_leaves_the_remainder_free_as_an_inactive_split(allocator: Allocator) -> None:
    allocator.malloc(4 * KiB)
    s = allocator.stats()
    assert s["inactive_split.all.current"] == 1
    assert s["inactive_split_bytes.all.current"] == 2 * MiB - 4 * KiB


@pytest.mark.parametrize("allocator", WITH_SMALL_POOL, indirect=True)  # small-segment geometry
def test_free_coalesces_with_both_neighbours(allocator: Allocator) -> None:
    a, b, c = (allocator.malloc(64 * KiB) for _ in range(3))
    allocator.free(a)
    allocator.free(c)  # c merges with the segment's free tail
    assert allocator.stats()["inactive_split.all.current"] == 2
    allocator.free(b)  # b merges with a and with the tail: one free block
    seg = segments()[0]
    assert [blk["state"] for blk in seg["blocks"]] == ["inactive"]
    assert allocator.stats()["inactive_split.all.current"] == 0


def test_freed_block_is_reused_at_the_same_address_on_its_stream(allocator: Allocator) -> None:
    a = allocator.malloc(100 * KiB)
    allocator.malloc(100 * KiB)
    allocator.free(a)
    assert allocator.malloc(100 * KiB) == a
    assert allocator.stats()["segment.all.current"] == 1


def test_best_fit_picks_the_smallest_block_that_fits(allocator: Allocator) -> None:
    sizes = [16 * KiB, 8 * KiB, 4 * KiB]
    holes = []
    for size in sizes:
        holes.append(allocator.malloc(size))
        allocator.malloc(512)  # keep the holes from coalescing
    for h in holes:
        allocator.free(h)
    assert allocator.malloc(6 * KiB) == holes[1]  # the 8 KiB hole, not 16 KiB nor the tail


def test_equal_sizes_are_served_lowest_address_first(allocator: Allocator) -> None:
    a = allocator.malloc(4 * KiB)
    allocator.malloc(512)
    b = allocator.malloc(4 * KiB)
    allocator.malloc(512)
    allocator.free(b)
    allocator.free(a)
    assert allocator.malloc(4 * KiB) == min(a, b)


@pytest.mark.parametrize("allocator", PLAIN, indirect=True)  # plain-segment geometry
def test_mid_size_requests_are_carved_from_a_large_segment(allocator: Allocator) -> None:
    allocator.malloc(3 * MiB)
    allocator.malloc(3 * MiB)
    s = allocator.stats()
    assert s["segment.large_pool.current"] == 1
    assert s["reserved_bytes.large_pool.current"] == 20 * MiB


@pytest.mark.parametrize("allocator", PLAIN, indirect=True)  # plain-segment geometry
def test_big_requests_get_their_own_segment_rounded_to_2_mib(allocator: Allocator) -> None:
    allocator.malloc(11 * MiB + 1)
    s = allocator.stats()
    assert s["reserved_bytes.large_pool.current"] == 12 * MiB
    assert s["inactive_split.all.current"] == 0  # 1 MiB - 512 B remainder: not worth a split


@pytest.mark.parametrize("allocator", PLAIN, indirect=True)  # plain-segment geometry
def test_large_pool_keeps_small_remainders_inside_the_block(allocator: Allocator) -> None:
    allocator.malloc(19 * MiB + 512 * KiB)
    s = allocator.stats()
    assert s["allocated_bytes.large_pool.current"] == 20 * MiB
    assert s["inactive_split.all.current"] == 0


def test_round_power2_rounds_to_power_of_two_divisions(allocator: Allocator) -> None:
    allocator.configure("round_power2=4")
    allocator.malloc(int(1.1 * MiB))  # between 1 MiB and 2 MiB in steps of 256 KiB
    assert allocator.stats()["allocated_bytes.all.current"] == 1 * MiB + 256 * KiB


# ---- streams and events ------------------------------------------------------------


def test_a_freed_block_is_not_reused_on_another_stream(allocator: Allocator) -> None:
    a = allocator.malloc(64 * KiB, stream=1)
    allocator.free(a, stream=1)
    b = allocator.malloc(64 * KiB, stream=2)
    assert b != a
    assert allocator.stats()["segment.all.current"] == 2


def test_record_stream_defers_reuse_until_the_event_completes(allocator: Allocator) -> None:
    pyalloc.configure(allocator.conf("event_delay=3"))
    a = allocator.malloc(64 * KiB, stream=1)
    pyalloc.record_stream(a, 2)
    allocator.free(a, stream=1)
    assert block_at(a)["state"] == "active_pending_free"
    s = allocator.stats()
    assert s["allocated_bytes.all.current"] == 0
    assert s["active_bytes.all.current"] == 64 * KiB

    # Every slow-path visit queries the event once; it completes on the 4th.
    for _ in range(3):
        allocator.malloc(12 * MiB, stream=1)  # own segment each time: slow path
        assert block_at(a)["state"] == "active_pending_free"
    allocator.malloc(8 * MiB, stream=1)
    s = allocator.stats()
    # No longer pending: free again, and in an arena possibly already moved
    # into the 8 MiB block's window (Note [Reuse before growing]).
    assert s["active_bytes.all.current"] == s["allocated_bytes.all.current"]
    assert s["active_bytes.small_pool.current"] == 0


def test_empty_cache_synchronizes_pending_frees(allocator: Allocator) -> None:
    pyalloc.configure(allocator.conf("event_delay=1000"))
    a = allocator.malloc(64 * KiB, stream=1)
    pyalloc.record_stream(a, 2)
    allocator.free(a, stream=1)
    pyalloc.empty_cache()
    pyalloc.check(0)
    s = allocator.stats()
    assert s["num_sync_all_streams"] == 1
    assert s["reserved_bytes.all.current"] == 0
    assert s["active_bytes.all.current"] == 0


def test_free_neighbours_report_the_space_a_free_would_open(allocator: Allocator) -> None:
    a = allocator.malloc(64 * KiB)
    b = allocator.malloc(100_000)  # rounds to 100,352 B
    c = allocator.malloc(64 * KiB)
    assert pyalloc.free_neighbours(b) == (0, 0)
    allocator.free(a)
    below, above = pyalloc.free_neighbours(b)
    assert (below, above) == (64 * KiB, 0)
    seg = next(s for s in segments() if any(blk["address"] == c for blk in s["blocks"]))
    tail = seg["total_size"] - (2 * 64 * KiB + 100_352)
    assert pyalloc.free_neighbours(c) == (0, tail)
    with pytest.raises(pyalloc.PyallocError, match="not a live allocation"):
        pyalloc.free_neighbours(a)  # freed: no longer live


def test_a_null_pointer_is_not_a_live_allocation(allocator: Allocator) -> None:
    # key 0 marks an empty slot of the live-block map, and NULL matched one (a segfault)
    allocator.free(allocator.malloc(64 * KiB))  # (the map's slots as a program leaves them)
    with pytest.raises(pyalloc.PyallocError, match="not a live allocation"):
        pyalloc.free_neighbours(0)
    with pytest.raises(pyalloc.PyallocError, match="not the start of a live allocation"):
        pyalloc.ipc_export(0)
    pyalloc.check()


def test_integers_the_c_types_cannot_hold_are_refused_not_wrapped(allocator: Allocator) -> None:
    # ctypes passes 2**64 + 4096 as 4096 and device 2**32 as device 0
    for call, match in ((lambda: pyalloc.malloc(2**64 + 4096), "size 18446744073709555712 is out of range"),
                        (lambda: pyalloc.malloc(100, device=2**32), "device 4294967296 is out of range"),
                        (lambda: pyalloc.malloc(2**64), "size 18446744073709551616 is out of range"),
                        (lambda: pyalloc.free(2**64 + 4096, 4096), "ptr .* is out of range"),
                        (lambda: pyalloc.core.memory_info(-2**31 - 1), "device .* is out of range")):
        with pytest.raises(pyalloc.PyallocError, match=match):
            call()
    assert allocator.stats()["allocated_bytes.all.current"] == 0


def test_arguments_that_are_not_whole_numbers_are_a_type_error_naming_them(allocator: Allocator) -> None:
    # ctypes said "argument 1: TypeError: wrong type"; True was taken as 1 byte
    for call, match in ((lambda: pyalloc.malloc("abc"), "size must be a whole number, got 'abc'"),  # type: ignore[arg-type]
                        (lambda: pyalloc.malloc(1.5), "size must be a whole number, got 1.5"),  # type: ignore[arg-type]
                        (lambda: pyalloc.malloc(True), "size must be a whole number, got True"),
                        (lambda: pyalloc.malloc(64, device=None), "device must be a whole number"),  # type: ignore[arg-type]
                        (lambda: pyalloc.free(None, 64), "ptr must be a whole number")):  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=match):
            call()
    assert allocator.stats()["allocated_bytes.all.current"] == 0


def test_a_user_pool_cannot_take_a_built_in_pools_name(allocator: Allocator) -> None:
    # its figures would have shared the stats' pool.large.* keys with the built-in pool's
    for name in ("small", "large", "plan", "long"):
        with pytest.raises(pyalloc.PyallocError, match=f"'{name}' is the name of a built-in pool"):
            pyalloc.create_pool(name)
    assert pyalloc.create_pool("large-activations") > 0


def test_record_stream_on_the_allocation_stream_frees_at_once(allocator: Allocator) -> None:
    pyalloc.configure(allocator.conf("event_delay=1000"))
    a = allocator.malloc(64 * KiB, stream=1)
    pyalloc.record_stream(a, 1)
    allocator.free(a, stream=1)
    assert block_at(a)["state"] == "inactive"


# ---- pools --------------------------------------------------------------------------


def test_current_pool_routes_allocations_to_their_own_segments(allocator: Allocator) -> None:
    outside = allocator.malloc(64 * KiB)
    with pyalloc.pool("params") as pool_id:
        assert pyalloc.current_pool() == pool_id
        inside = allocator.malloc(64 * KiB)
    assert pyalloc.current_pool() == 0
    by_addr = {}
    for seg in segments():
        for blk in seg["blocks"]:
            by_addr[blk["address"]] = seg
    assert by_addr[inside]["pool"] == "params"
    assert by_addr[outside]["pool"] == allocator.small_pool
    assert by_addr[inside]["address"] != by_addr[outside]["address"]


def test_pool_figures_in_stats_and_snapshot_follow_each_pool(allocator: Allocator) -> None:
    outside = allocator.malloc(64 * KiB)
    with pyalloc.pool("weights"):
        w1 = allocator.malloc(3 * MiB)
        w2 = allocator.malloc(1 * MiB)
    allocator.free(w2)
    s = allocator.stats()
    assert s["pool.weights.allocations"] == 1
    assert s["pool.weights.allocated_bytes"] == 3 * MiB
    assert s["pool.weights.requested_bytes"] == 3 * MiB
    assert s["pool.weights.active_bytes"] == 3 * MiB
    assert s["pool.weights.reserved_bytes"] == s["pool.weights.allocated_bytes"] + s["pool.weights.cached_free_bytes"]
    assert s["pool.weights.largest_free_bytes"] >= 1 * MiB
    assert s[f"pool.{allocator.small_pool}.allocated_bytes"] == 64 * KiB
    assert s[f"pool.{allocator.small_pool}.segments"] == 1
    # The pools add up to the device's own counters.
    pools = {name.split(".")[1] for name in s if name.startswith("pool.")}
    for figure, total in (("reserved_bytes", "reserved_bytes.all.current"),
                          ("allocated_bytes", "allocated_bytes.all.current"),
                          ("segments", "segment.all.current")):
        assert sum(s[f"pool.{p}.{figure}"] for p in pools) == s[total]
    snap = {entry["pool"]: entry for entry in pyalloc.snapshot()["pools"] if entry["device"] == 0}
    assert snap["weights"]["allocated_bytes"] == 3 * MiB and snap["weights"]["pool_id"] >= 1
    assert snap["small"]["pool_id"] == 0
    allocator.free(w1)
    allocator.free(outside)
    assert allocator.stats()["pool.weights.allocated_bytes"] == 0


def test_pool_create_returns_the_same_id_for_the_same_name(allocator: Allocator) -> None:
    assert pyalloc.create_pool("optimizer") == pyalloc.create_pool("optimizer")
    assert pyalloc.create_pool("optimizer") != pyalloc.create_pool("grads")


def test_setting_an_unknown_pool_is_refused(allocator: Allocator) -> None:
    assert pyalloc.core.lib().pyalloc_set_current_pool(1_000_000) != 0
    assert "no pool has id" in pyalloc.core.last_error()
    assert pyalloc.current_pool() == 0


# ---- capacity, OOM and the pressure ladder ----------------------------------------------


def test_oom_at_capacity_then_recovery_after_a_free(allocator: Allocator) -> None:
    pyalloc.configure(allocator.conf().replace("capacity=256MiB", "capacity=64MiB"))
    held = [allocator.malloc(16 * MiB) for _ in range(4)]
    with pytest.raises(pyalloc.PyallocError, match="out of memory on device 0"):
        allocator.malloc(16 * MiB)
    s = allocator.stats()
    assert s["num_ooms"] == 1
    assert s["last_oom.request_bytes"] == 16 * MiB
    assert s["last_oom.reserved_bytes"] == 64 * MiB
    allocator.free(held[0])
    assert allocator.malloc(16 * MiB) == held[0]


@pytest.mark.parametrize("allocator", PLAIN, indirect=True)  # plain-segment geometry
def test_oom_report_names_the_largest_free_block_and_live_blocks(allocator: Allocator) -> None:
    pyalloc.configure(allocator.conf().replace("capacity=256MiB", "capacity=40MiB"))
    # Two 20 MiB large segments of 3 MiB blocks; freeing every other block of
    # the first leaves 3 MiB holes that no 4 MiB request can use.
    first = [allocator.malloc(3 * MiB) for _ in range(6)]
    for _ in range(6):
        allocator.malloc(3 * MiB)
    for p in first[::2]:
        allocator.free(p)
    with pytest.raises(pyalloc.PyallocError) as err:
        allocator.malloc(4 * MiB)
    message = str(err.value)
    assert "largest free block 3.00 MiB" in message
    assert "cached free 13.00 MiB" in message
    assert "fragmentation 76.9%" in message  # 1 - 3/13
    assert "Biggest live blocks: 3.00 MiB at" in message
    assert allocator.stats()["last_oom.largest_free_bytes"] == 3 * MiB


@pytest.mark.parametrize("allocator", WITH_SMALL_POOL, indirect=True)  # small-segment geometry
def test_cached_segments_are_released_to_serve_a_request(allocator: Allocator) -> None:
    pyalloc.configure(allocator.conf().replace("capacity=256MiB", "capacity=32MiB"))
    small = [allocator.malloc(1 * MiB) for _ in range(30)]  # 15 small segments: 30 MiB
    for p in small:
        allocator.free(p)
    assert allocator.stats()["reserved_bytes.all.current"] == 30 * MiB
    allocator.malloc(24 * MiB)  # needs the cache back
    s = allocator.stats()
    assert s["num_alloc_retries"] == 1
    assert s["reserved_bytes.small_pool.current"] == 0
    assert s["num_ooms"] == 0


def test_memory_fraction_caps_reserved_memory(allocator: Allocator) -> None:
    pyalloc.configure(allocator.conf().replace("capacity=256MiB", "capacity=100MiB"))
    pyalloc.set_memory_fraction(0.5, 0)
    allocator.malloc(40 * MiB)
    with pytest.raises(pyalloc.PyallocError, match="memory_fraction limit 50.00 MiB"):
        allocator.malloc(12 * MiB)


def test_memory_fraction_takes_what_torch_takes(allocator: Allocator) -> None:
    # [0, 1], as torch.cuda.set_per_process_memory_fraction: 0 was refused, and through
    # PyTorch (which checks the range itself and reads no error back) no cap was set at all
    pyalloc.set_memory_fraction(0.0, 0)
    with pytest.raises(pyalloc.PyallocError, match="memory_fraction limit 0 B"):
        allocator.malloc(1 * MiB)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(pyalloc.PyallocError, match=r"is not in \[0, 1\]"):
            pyalloc.set_memory_fraction(bad, 0)
    pyalloc.set_memory_fraction(1.0, 0)
    allocator.free(allocator.malloc(1 * MiB))


@pytest.mark.parametrize("allocator", PLAIN, indirect=True)  # plain-segment geometry
def test_max_cached_releases_the_oldest_free_segments_first(allocator: Allocator) -> None:
    pyalloc.configure(allocator.conf("max_cached=24MiB"))
    first = allocator.malloc(12 * MiB)
    second = allocator.malloc(12 * MiB)
    third = allocator.malloc(12 * MiB)
    allocator.free(first)
    allocator.free(second)  # cached 24 MiB: at the cap
    allocator.free(third)  # 36 MiB > 24 MiB: the oldest free segment (first) goes
    bases = {seg["address"] for seg in segments()}
    assert bases == {second, third}
    assert allocator.stats()["reserved_bytes.all.current"] == 24 * MiB


@pytest.mark.parametrize("allocator", PLAIN, indirect=True)  # plain-segment geometry
def test_release_cached_frees_at_least_the_bytes_asked(allocator: Allocator) -> None:
    ptrs = [allocator.malloc(12 * MiB) for _ in range(3)]
    for p in ptrs:
        allocator.free(p)
    released = pyalloc.release_cached(0, 20 * MiB)
    assert released == 24 * MiB
    assert allocator.stats()["reserved_bytes.all.current"] == 12 * MiB


def test_pressure_callback_frees_memory_and_the_request_succeeds(allocator: Allocator) -> None:
    pyalloc.configure(allocator.conf().replace("capacity=256MiB", "capacity=32MiB"))
    victim = allocator.malloc(24 * MiB)
    calls: list[tuple[int, int, int]] = []

    def on_pressure(device: int, needed: int) -> int:
        # Reading stats takes the device lock: this would deadlock if the
        # allocator held it while calling us.
        allocated = pyalloc.memory_stats(device)["allocated_bytes.all.current"]
        calls.append((device, needed, allocated))
        allocator.free(victim)
        return 24 * MiB

    handle = pyalloc.register_pressure_callback(on_pressure)
    try:
        ptr = allocator.malloc(16 * MiB)
    finally:
        pyalloc.unregister_pressure_callback(handle)
    assert ptr
    assert calls == [(0, 16 * MiB, 24 * MiB)]
    s = allocator.stats()
    assert s["num_pressure_callbacks"] == 1
    assert s["pressure_callback_freed_bytes"] == 24 * MiB
    assert s["num_ooms"] == 0


def test_an_allocation_inside_a_pressure_callback_does_not_reenter_it(allocator: Allocator) -> None:
    pyalloc.configure(allocator.conf().replace("capacity=256MiB", "capacity=32MiB"))
    allocator.malloc(24 * MiB)
    depth: list[int] = []

    def on_pressure(device: int, needed: int) -> int:
        depth.append(needed)
        with pytest.raises(pyalloc.PyallocError):
            pyalloc.malloc(30 * MiB)  # would recurse into this callback if re-entered
        return 0

    handle = pyalloc.register_pressure_callback(on_pressure)
    try:
        with pytest.raises(pyalloc.PyallocError, match="out of memory"):
            allocator.malloc(16 * MiB)
    finally:
        pyalloc.unregister_pressure_callback(handle)
    assert depth == [16 * MiB]


# ---- bad calls ------------------------------------------------------------------------


def _state() -> tuple[dict, list]:
    stats = {k: v for k, v in pyalloc.memory_stats(0).items() if not k.startswith("num_invalid")}
    return stats, pyalloc.snapshot()["segments"]


def test_free_of_an_unknown_pointer_is_refused_and_counted(allocator: Allocator) -> None:
    allocator.malloc(4 * KiB)
    before = _state()
    with pytest.raises(pyalloc.PyallocError, match="was not allocated by pyalloc"):
        pyalloc.free(0x1234000, 4096, 0)
    assert _state() == before
    assert allocator.stats()["num_invalid_free"] == 1


def test_free_of_an_interior_pointer_is_refused(allocator: Allocator) -> None:
    p = allocator.malloc(4 * KiB)
    before = _state()
    with pytest.raises(pyalloc.PyallocError, match="not the start of a live allocation"):
        pyalloc.free(p + 512, 512, 0)
    assert _state() == before


def test_double_free_is_refused_and_counted(allocator: Allocator) -> None:
    p = allocator.malloc(4 * KiB)
    allocator.malloc(4 * KiB)
    allocator.free(p)
    before = _state()
    with pytest.raises(pyalloc.PyallocError, match="double free"):
        pyalloc.free(p, 4 * KiB, 0)
    assert _state() == before
    assert allocator.stats()["num_invalid_double_free"] == 1


def test_free_with_the_wrong_size_leaves_the_block_allocated(allocator: Allocator) -> None:
    p = allocator.malloc(4 * KiB)
    before = _state()
    with pytest.raises(pyalloc.PyallocError, match="does not match"):
        pyalloc.free(p, 8 * KiB, 0)
    assert _state() == before
    assert block_at(p)["state"] == "active_allocated"
    assert allocator.stats()["num_invalid_size"] == 1


def test_free_on_another_stream_than_the_mallocs_is_refused_and_counted(allocator: Allocator) -> None:
    # PyTorch frees on the allocation's stream; a use on another stream is declared with
    # record_stream. A free that names another stream is a caller's bug: refused, nothing changes.
    p = allocator.malloc(4 * KiB, stream=1)
    before = _state()
    with pytest.raises(pyalloc.PyallocError, match="is not stream 0x1 that the block .* was allocated on"):
        pyalloc.free(p, 4 * KiB, 0, 2)
    assert _state() == before
    assert block_at(p)["state"] == "active_allocated"
    assert allocator.stats()["num_invalid_free_stream"] == 1
    pyalloc.free(p, 4 * KiB, 0)  # stream not given: not checked
    allocator.live.pop(p)
    assert allocator.stats()["allocation.all.current"] == 0


def test_malloc_of_zero_bytes_returns_null_without_error(allocator: Allocator) -> None:
    lib = pyalloc.core.lib()
    lib.pyalloc_configure(b"trace=0")  # leaves last_error empty on this thread
    assert lib.pyalloc_malloc(0, 0, None) is None
    assert allocator.stats()["allocation.all.current"] == 0
    lib.pyalloc_free(None, 0, 0, None)  # free(NULL) is a no-op
    assert allocator.stats()["num_invalid_free"] == 0


@pytest.mark.parametrize("size", [2**64 - 1, 2**64 - 512, 2**63, 2**53])
def test_sizes_near_size_max_are_refused_without_overflow(allocator: Allocator, size: int) -> None:
    before = _state()
    with pytest.raises(pyalloc.PyallocError, match="beyond any device"):
        pyalloc.malloc(size, 0, 0)
    assert _state() == before
    assert allocator.stats()["num_invalid_size"] == 1


@pytest.mark.parametrize("device", [-1, 1, 1000])
def test_a_device_out_of_range_is_refused(allocator: Allocator, device: int) -> None:
    with pytest.raises(pyalloc.PyallocError, match=f"device {device} is out of range"):
        pyalloc.malloc(4096, device, 0)
    with pytest.raises(pyalloc.PyallocError, match="out of range"):
        pyalloc.free(0x1000, 4096, device)
    with pytest.raises(pyalloc.PyallocError, match="out of range"):
        pyalloc.check(device)
    assert allocator.stats()["num_invalid_device"] >= 2


def test_record_stream_of_an_unknown_pointer_is_reported_and_counted(allocator: Allocator) -> None:
    before = allocator.stats()["num_invalid_record_stream"]
    with pytest.raises(pyalloc.PyallocError, match="is not the start of a live allocation"):
        pyalloc.record_stream(0xDEAD000, 3)
    assert allocator.stats()["num_invalid_record_stream"] == before + 1


# ---- configuration ------------------------------------------------------------------------


def test_an_unknown_key_is_an_error_naming_it_and_the_known_keys(allocator: Allocator) -> None:
    with pytest.raises(pyalloc.PyallocError, match="unknown key 'max_cache'.*max_cached"):
        pyalloc.configure("max_cache=1GiB")


@pytest.mark.parametrize(
    ("conf", "form"),
    [
        ("capacity=lots", "a size such as 8GiB"),
        ("capacity=1025GiB", "at most 1TiB"),  # metadata per granule; sim devices 4 PiB apart
        ("memory_fraction=1.5", r"a number in \(0, 1\]"),
        ("round_power2=3", "power of two"),
        ("backend=tpu", "one of cuda, host, sim"),
        ("small_segment=1000", "multiple of 512"),
        ("trace=-1", "integer"),
        ("oom_report=maybe", "0 or 1"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_key_and_the_form(allocator: Allocator, conf: str, form: str) -> None:
    key = conf.split("=")[0]
    with pytest.raises(pyalloc.PyallocError, match=f"for {key}: expected .*{form}"):
        pyalloc.configure(conf)


def test_a_bad_configuration_changes_nothing(allocator: Allocator) -> None:
    before = pyalloc.config()
    with pytest.raises(pyalloc.PyallocError):
        pyalloc.configure("trace=100,capacity=nope")
    assert pyalloc.config() == before


def test_layout_keys_are_refused_while_memory_is_allocated(allocator: Allocator) -> None:
    p = allocator.malloc(4 * KiB)
    with pytest.raises(pyalloc.PyallocError, match="while 4096 bytes are allocated"):
        pyalloc.configure("capacity=1GiB")
    assert pyalloc.config()["capacity"] == 256 * MiB
    allocator.free(p)
    pyalloc.configure("capacity=1GiB")
    assert pyalloc.config()["capacity"] == 1 << 30


def test_runtime_keys_apply_while_memory_is_allocated(allocator: Allocator) -> None:
    allocator.malloc(4 * KiB)
    pyalloc.configure("trace=64,max_cached=1GiB,round_power2=2")
    cfg = pyalloc.config()
    assert (cfg["trace"], cfg["max_cached"], cfg["round_power2"]) == (64, 1 << 30, 2)


def test_sizes_accept_binary_and_decimal_units(allocator: Allocator) -> None:
    for text, expected in [("512", 512), ("4KiB", 4096), ("1.5GiB", 3 << 29), ("2GB", 2_000_000_000), ("1m", MiB)]:
        pyalloc.configure(f"max_cached={text}")
        assert pyalloc.config()["max_cached"] == expected


def test_multiple_devices_have_separate_allocators(allocator: Allocator) -> None:
    pyalloc.configure(allocator.conf("devices=2"))
    allocator.malloc(4 * KiB, device=0)
    allocator.malloc(3 * MiB, device=1)
    assert allocator.stats(0)["allocated_bytes.all.current"] == 4 * KiB
    assert allocator.stats(1)["allocated_bytes.all.current"] == 3 * MiB
    assert {s["device"] for s in pyalloc.snapshot()["segments"]} == {0, 1}


# ---- stats, trace, snapshot ---------------------------------------------------------------


def test_peaks_follow_the_high_water_mark_and_reset(allocator: Allocator) -> None:
    a = allocator.malloc(3 * MiB)
    allocator.malloc(3 * MiB)
    allocator.free(a)
    s = allocator.stats()
    assert s["allocated_bytes.all.peak"] == 6 * MiB
    assert s["allocated_bytes.all.current"] == 3 * MiB
    assert s["allocation.all.allocated"] == 2 and s["allocation.all.freed"] == 1
    pyalloc.reset_peak_memory_stats(0)
    assert allocator.stats()["allocated_bytes.all.peak"] == 3 * MiB
    pyalloc.reset_accumulated_memory_stats(0)
    assert allocator.stats()["allocation.all.allocated"] == 0


def test_active_figures_are_exact_across_pending_frees_and_resets(allocator: Allocator) -> None:
    # active = allocated + pending-free (Note [Counters]): check every field of
    # it by hand through a pending free, both resets and its completion.
    pyalloc.configure(allocator.conf("event_delay=1000"))
    a = allocator.malloc(64 * KiB, stream=1)
    b = allocator.malloc(32 * KiB, stream=1)
    pyalloc.record_stream(a, 2)
    allocator.free(a, stream=1)  # a: pending
    s = allocator.stats()
    assert (s["active.all.current"], s["active_bytes.all.current"]) == (2, 96 * KiB)
    assert (s["active.all.allocated"], s["active.all.freed"]) == (2, 0)
    assert s["allocation.all.freed"] == 1
    pyalloc.reset_peak_memory_stats(0)
    pyalloc.reset_accumulated_memory_stats(0)
    c = allocator.malloc(16 * KiB, stream=1)  # while a is pending: active peaks here
    s = allocator.stats()
    assert (s["active.all.peak"], s["active_bytes.all.peak"]) == (3, 112 * KiB)
    assert (s["allocated_bytes.all.peak"], s["active.all.allocated"], s["active.all.freed"]) == (48 * KiB, 1, 0)
    allocator.free(b, stream=1)
    allocator.free(c, stream=1)
    pyalloc.empty_cache()  # completes a's pending free
    pyalloc.check(0)
    s = allocator.stats()
    assert (s["active.all.current"], s["active.all.allocated"], s["active.all.freed"]) == (0, 1, 3)
    assert (s["active_bytes.all.allocated"], s["active_bytes.all.freed"]) == (16 * KiB, 112 * KiB)
    assert s["active_bytes.all.peak"] == 112 * KiB
    other = "large" if allocator.small_pool == "small" else "small"
    assert s[f"active_bytes.{allocator.small_pool}_pool.peak"] == 112 * KiB and s[f"active_bytes.{other}_pool.peak"] == 0


def test_stats_use_pytorch_key_names(allocator: Allocator) -> None:
    s = allocator.stats()
    for name in ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                 "active_bytes", "inactive_split_bytes", "requested_bytes"):
        for pool in ("all", "small_pool", "large_pool"):
            for field in ("current", "peak", "allocated", "freed"):
                assert f"{name}.{pool}.{field}" in s
    for key in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free"):
        assert key in s


@pytest.mark.parametrize("allocator", PLAIN, indirect=True)  # plain-segment geometry
def test_device_alloc_and_free_counts_follow_segments(allocator: Allocator) -> None:
    p = allocator.malloc(12 * MiB)
    allocator.free(p)
    pyalloc.empty_cache()
    s = allocator.stats()
    assert (s["num_device_alloc"], s["num_device_free"]) == (1, 1)


@pytest.mark.parametrize("allocator", WITH_SMALL_POOL, indirect=True)  # small-segment geometry
def test_trace_ring_records_events_in_order(allocator: Allocator) -> None:
    pyalloc.configure("trace=100")
    p = allocator.malloc(4 * KiB, stream=5)
    allocator.free(p, stream=5)
    pyalloc.empty_cache()
    trace = pyalloc.snapshot()["device_traces"][0]
    assert [e["action"] for e in trace] == [
        "segment_alloc", "alloc", "free_requested", "free_completed", "segment_free"
    ]
    assert trace[1]["addr"] == p and trace[1]["size"] == 4 * KiB and trace[1]["stream"] == 5
    assert all(a["time_us"] <= b["time_us"] for a, b in zip(trace, trace[1:]))


def test_trace_ring_keeps_only_the_newest_events(allocator: Allocator) -> None:
    pyalloc.configure("trace=4")
    for _ in range(5):
        allocator.free(allocator.malloc(4 * KiB))
    trace = pyalloc.snapshot()["device_traces"][0]
    assert [e["action"] for e in trace] == ["free_completed", "alloc", "free_requested", "free_completed"]


def test_snapshot_blocks_carry_their_states(allocator: Allocator) -> None:
    pyalloc.configure(allocator.conf("event_delay=1000"))
    a = allocator.malloc(4 * KiB, stream=1)
    b = allocator.malloc(4 * KiB, stream=1)
    pyalloc.record_stream(b, 2)
    allocator.free(b, stream=1)
    seg = segments()[0]
    assert {blk["address"]: blk["state"] for blk in seg["blocks"]}[a] == "active_allocated"
    assert {blk["address"]: blk["state"] for blk in seg["blocks"]}[b] == "active_pending_free"
    assert seg["total_size"] == 2 * MiB and seg["allocated_size"] == 4 * KiB
    assert seg["active_size"] == 8 * KiB and seg["segment_type"] == allocator.small_pool
    pyalloc.empty_cache()


def test_host_blocks_are_real_writable_memory(allocator: Allocator) -> None:
    if allocator.backend != "host":
        pytest.skip("sim addresses are fake")
    p = allocator.malloc(3 * MiB)
    ctypes.memset(p, 0xAB, 3 * MiB)
    assert ctypes.string_at(p + 3 * MiB - 4, 4) == b"\xab" * 4


def test_concurrent_malloc_and_free_from_many_threads_stay_consistent(allocator: Allocator) -> None:
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            held = []
            for i in range(300):
                size = 512 * (1 + (seed * 7919 + i * 104729) % 4000)
                held.append((pyalloc.malloc(size, 0, seed % 3), size))
                if len(held) > 8:
                    ptr, sz = held.pop(0)
                    pyalloc.free(ptr, sz, 0)
            for ptr, sz in held:
                pyalloc.free(ptr, sz, 0)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    pyalloc.check(0)
    assert allocator.stats()["allocated_bytes.all.current"] == 0
