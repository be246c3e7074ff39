"""Shared granules (Note [Shared granules] in allocator/src/device/share.cpp).

When stitching finds too few whole free granules, the free end of a granule
that a live block also uses is mapped a second time, as the first or last
granule of the new block's range. On the host backend granules are real memfd
chunks, so the tests read the bytes back through both addresses; on the sim
backend the bookkeeping is the same. Every call is followed by
``pyalloc_check``, which verifies I13 (twins in pairs over one granule, lending
complementary pieces, reserved counting the granule once).
"""

from __future__ import annotations

from typing import Iterator

import pytest

import pyalloc
from allocator_fixture import Allocator, fill, fresh_conf, holds, rebuilt
from pyalloc.traces import replay, stress

MiB = 1 << 20


@pytest.fixture(params=["host", "sim"])
def full(request: pytest.FixtureRequest) -> Iterator[tuple[Allocator, dict[str, int]]]:
    """A 6 MiB device (three granules), full: a and b keep the first MiB of
    granule 0 and the last of granule 2, c all of granule 1, and the MiB
    between them on each side is free, a sliver no whole-granule move can use."""
    a = rebuilt(request.param, "vmm=shared", "capacity=6MiB")
    blocks = {name: a.malloc(MiB if name != "c" else 2 * MiB) for name in ("a", "x", "c", "y", "b")}
    assert [blocks[n] - blocks["a"] for n in ("x", "c", "y", "b")] == [MiB, 2 * MiB, 4 * MiB, 5 * MiB]
    if a.backend == "host":
        for name, byte in (("a", 0xA1), ("c", 0xC1), ("b", 0xB1)):
            fill(blocks[name], a.live[blocks[name]][0], byte)
    a.free(blocks.pop("x"))
    a.free(blocks.pop("y"))
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 6 * MiB and s["num_shared_granules"] == 0
    yield a, blocks
    a.free_all()
    pyalloc.check(0)
    pyalloc.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0


def untouched(a: Allocator, blocks: dict[str, int]) -> bool:
    return a.backend != "host" or all(
        holds(blocks[name], a.live[blocks[name]][0], byte) for name, byte in (("a", 0xA1), ("c", 0xC1), ("b", 0xB1))
    )


def test_a_request_is_served_from_two_slivers(full: tuple[Allocator, dict[str, int]]) -> None:
    a, blocks = full
    x, y = blocks["a"] + MiB, blocks["a"] + 4 * MiB  # the slivers' addresses
    n = a.malloc(2 * MiB)  # no whole granule is free and the device is full
    s = a.stats()
    assert n != 0 and s["num_ooms"] == 0
    assert s["num_shared_granules"] == 2
    assert s["reserved_bytes.all.current"] == 6 * MiB  # each shared granule counted once
    assert s["allocated_bytes.all.current"] == 6 * MiB
    if a.backend == "host":
        fill(n, 2 * MiB, 0x5E)
        assert holds(n, 2 * MiB, 0x5E)
        # The same bytes, read through the slivers' own addresses: n's first
        # MiB is granule 0's second half, its second MiB granule 2's first half.
        assert holds(x, MiB, 0x5E) and holds(y, MiB, 0x5E)
    assert untouched(a, blocks)
    snap = pyalloc.snapshot()
    segments = [seg for seg in snap["segments"] if seg["device"] == 0]
    assert sum(seg["total_size"] for seg in segments) == 6 * MiB  # lent pieces are in no segment
    assert all(blk["state"] != "lent" for seg in segments for blk in seg["blocks"])


def test_twins_part_when_the_new_block_is_freed(full: tuple[Allocator, dict[str, int]]) -> None:
    a, blocks = full
    n = a.malloc(2 * MiB)
    a.free(n)
    pyalloc.release_cached(0, 0)  # the window's granules go; the slivers are free where they were
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 6 * MiB
    assert a.malloc(MiB) == blocks["a"] + MiB  # best fit finds the sliver at its own address again
    assert a.malloc(MiB) == blocks["a"] + 4 * MiB
    assert untouched(a, blocks)


def test_twins_part_when_a_lender_block_is_freed_and_the_new_block_keeps_its_bytes(
    full: tuple[Allocator, dict[str, int]]
) -> None:
    a, blocks = full
    n = a.malloc(2 * MiB)
    if a.backend == "host":
        fill(n, 2 * MiB, 0x5E)
    a.free(blocks.pop("a"))  # granule 0's own part is all free: it can be unmapped there
    a.free(blocks.pop("b"))
    pyalloc.release_cached(0, 0)
    s = a.stats()
    # Granules 0 and 2 now live only under n; c keeps granule 1. Nothing else is free whole.
    assert s["reserved_bytes.all.current"] == 6 * MiB
    assert s["allocated_bytes.all.current"] == 4 * MiB
    if a.backend == "host":
        assert holds(n, 2 * MiB, 0x5E)
    # The pieces of n's granules that a and b's granules owned are free memory beside n now.
    assert a.malloc(MiB) in (n - MiB, n + 2 * MiB)
    assert a.malloc(MiB) in (n - MiB, n + 2 * MiB)
    assert a.stats()["reserved_bytes.all.current"] == 6 * MiB


def test_without_share_the_same_request_fails(full: tuple[Allocator, dict[str, int]]) -> None:
    a, _ = full
    pyalloc.configure("share=0,move=0")  # moving a live end would serve it too (test_moving_slivers.py)
    assert pyalloc.config()["share"] is False
    with pytest.raises(pyalloc.PyallocError, match="out of memory"):
        pyalloc.malloc(2 * MiB)
    s = a.stats()
    assert s["num_ooms"] == 1 and s["num_shared_granules"] == 0


def test_share_takes_0_or_1() -> None:
    with pytest.raises(pyalloc.PyallocError, match="share"):
        pyalloc.configure(fresh_conf("sim", "share=sometimes"))
    pyalloc.configure(fresh_conf("sim"))
    assert pyalloc.config()["share"] is True


def test_shared_granules_lower_the_memory_the_mlp_trace_needs() -> None:
    """The recorded MLP trace: one granule less, as little as PyTorch's placement needs (the model's 132)."""
    flat = stress.load_workload("mlp", 0, False).flat
    with_share = replay.find_min_capacity(flat, "pyalloc", "sim")
    without = replay.find_min_capacity(flat, "pyalloc", "sim", "share=0,move=0")
    native = replay.find_min_capacity(flat, "native", "sim")
    assert with_share == without - 2 * MiB
    assert with_share <= native


def test_near_a_full_device_a_cached_fit_is_taken_while_whole_granules_cover_the_request() -> None:
    """A shared window remaps granules (on a GPU, microseconds each): near a full
    device a request takes its cached fit, as far from full, while the whole
    granules the device could still put behind it (unreserved ones, and whole
    free granules in its arenas, which stitching takes) are as many as it spans."""
    for backend in ("host", "sim"):
        a = rebuilt(backend, "vmm=shared", "capacity=10MiB")
        base = a.malloc(MiB)  # [0, 1)
        x = a.malloc(MiB)  # [1, 2)
        c = a.malloc(2 * MiB)  # [2, 4)
        y = a.malloc(MiB)  # [4, 5)
        b = a.malloc(MiB)  # [5, 6)
        spare = a.malloc(4 * MiB)  # [6, 10): the device is full
        assert [p - base for p in (x, c, y, b, spare)] == [MiB, 2 * MiB, 4 * MiB, 5 * MiB, 6 * MiB]
        for p in (x, y, spare):
            a.free(p)
        assert a.stats()["reserved_bytes.all.current"] == 10 * MiB
        # [6, 10) holds two whole granules; 2.5 MiB spans two: best fit, no window,
        # and no sliver index either: the fit's own whole granules answer.
        n = a.malloc(5 * MiB // 2)
        s = a.stats()
        assert n - base == 6 * MiB
        assert s["num_shared_granules"] == 0 and s["num_ooms"] == 0 and s["num_sliver_indexes"] == 0
        a.free_all()
        pyalloc.empty_cache()
        assert a.stats()["reserved_bytes.all.current"] == 0
        del c, b


def test_whole_granules_are_counted_without_the_sliver_indexes() -> None:
    """Near a full device a request that splits its cached fit asks whether whole granules cover
    it before sharing one (Note [Whole-granule count] in share.cpp). When the fit's own do not,
    the device's count of whole free granules answers, kept by free-set membership: no sliver
    index is built (they send every call down the general path), and the request goes where it
    would with no sharing. pyalloc_check compares the count with a walk (I6)."""
    for backend in ("host", "sim"):
        a = rebuilt(backend, "vmm=shared", "capacity=10MiB")
        base = a.malloc(MiB)  # [0, 1)
        x, c, y = a.malloc(MiB), a.malloc(2 * MiB), a.malloc(MiB)  # [1, 2), [2, 4), [4, 5)
        a.malloc(MiB)  # [5, 6)
        spare = a.malloc(4 * MiB)  # [6, 10): the device is full
        assert spare - base == 6 * MiB
        for p in (x, c, y, spare):  # free: [1, 5), one whole granule; [6, 10), two
            a.free(p)
        for _ in range(3):
            # 3.5 MiB spans two granules; its best fit [1, 5) (the lower of two of 4 MiB) holds one
            # whole: the count, three, covers it
            n = a.malloc(7 * MiB // 2)
            assert MiB <= n - base <= 3 * MiB // 2  # in [1, 5)
            pyalloc.check(0)
            for _ in range(50):  # small blocks come and go beside it: the count follows
                a.free(a.malloc(4096))
            pyalloc.check(0)
            a.free(n)
        s = a.stats()
        assert s["num_sliver_indexes"] == 0 and s["num_ooms"] == 0 and s["num_shared_granules"] == 0
        a.free_all()
        pyalloc.empty_cache()


def test_sliver_indexes_go_when_their_upkeep_passes_what_building_them_costs() -> None:
    """Near a full device the sliver indexes, once built for a shared window, follow every
    free-set change and send every call down the general path. When requests stop asking them,
    they go after upkeep of about twice what building them walks, and come back when a request
    needs them again: with 400 small blocks coming and going between two shared windows they
    are built twice, with 10 once."""
    for backend in ("host", "sim"):
        for churn, builds in ((10, 1), (400, 2)):
            # Laid out on 16 MiB (far from full: no window), then capped at 12, as below.
            a = rebuilt(backend, "vmm=shared", "capacity=16MiB")
            sizes = [MiB, MiB, 3 * MiB // 2, MiB // 2, 2 * MiB, MiB, 5 * MiB]
            base, x, y, l1, c, l2, cached = (a.malloc(size) for size in sizes)
            pyalloc.set_memory_fraction(0.75)
            for p in (x, y, cached):
                a.free(p)
            a.malloc(9 * MiB // 2)  # shares two granules: the indexes are built
            assert a.stats()["num_sliver_indexes"] == 1
            for _ in range(churn):  # upkeep, nobody asking
                a.free(a.malloc(4096))
            a.malloc(5 * MiB // 2)  # shares a third
            s = a.stats()
            assert s["num_sliver_indexes"] == builds, (churn, s["num_sliver_indexes"])
            assert s["num_shared_granules"] == 3 and s["num_ooms"] == 0
            pyalloc.check(0)
            a.free_all()
            pyalloc.empty_cache()
            pyalloc.set_memory_fraction(1.0)


def test_near_a_full_device_a_shared_window_comes_before_a_cached_fit() -> None:
    """When the whole granules the device could still use are fewer than a
    request spans, a request of more than a granule (not a whole number of them)
    takes a window that maps free granule ends and starts when that needs fewer
    granules than the cached fit: here one (stitched from the cached block)
    instead of two, with the two slivers of the device as its first and last."""
    for backend in ("host", "sim"):
        # Laid out on 16 MiB (far from full: no window), then capped at 12.
        a = rebuilt(backend, "vmm=shared", "capacity=16MiB")
        sizes = [MiB, MiB, 3 * MiB // 2, MiB // 2, 2 * MiB, MiB, 5 * MiB]
        base, x, y, l1, c, l2, cached = (a.malloc(size) for size in sizes)
        # [0, 1) base, [1, 2) x, [2, 3.5) y, [3.5, 4) l1, [4, 6) c, [6, 7) l2, [7, 12) cached
        assert [p - base for p in (x, y, l1, c, l2, cached)] == [MiB, 2 * MiB, 7 * MiB // 2, 4 * MiB, 6 * MiB, 7 * MiB]
        pyalloc.set_memory_fraction(0.75)
        for p in (x, y, cached):
            a.free(p)
        s = a.stats()
        assert s["reserved_bytes.all.current"] == 12 * MiB and s["num_shared_granules"] == 0
        # [7, 12) holds two whole granules; 4.5 MiB spans three. Best fit would
        # take two granules ([7, 11.5)); a window of x's end (1 MiB), one fresh
        # granule and y's start (1.5 MiB) takes one.
        n = a.malloc(9 * MiB // 2)
        s = a.stats()
        assert s["num_shared_granules"] == 2 and s["num_ooms"] == 0
        assert s["reserved_bytes.all.current"] <= 12 * MiB
        if backend == "host":
            fill(n, 9 * MiB // 2, 0x77)
            assert holds(base + MiB, MiB, 0x77)  # n's first MiB is x's MiB of granule 0
            assert holds(base + 2 * MiB, 3 * MiB // 2, 0x77)  # its last 1.5 MiB are y's
        # The cached block gave one granule and keeps the other whole.
        a.malloc(2 * MiB)
        assert a.stats()["num_ooms"] == 0 and a.stats()["reserved_bytes.all.current"] <= 12 * MiB
        a.free_all()
        pyalloc.empty_cache()
        pyalloc.set_memory_fraction(1.0)
        assert a.stats()["reserved_bytes.all.current"] == 0
        del l1, c, l2


def test_shared_granules_lower_what_workloads_need_below_both_pytorch_models() -> None:
    """Random sizes living long among short-lived ones leave slivers: windows
    over them never need more than no sharing, and less than both models of
    PyTorch (its default and expandable_segments). They need less than no
    sharing on lstm_varlen (196 MiB against 198 on 2026-11-27; two_stream's 944
    against 946 until stitching took the whole granules of a free block the
    window being grown overlaps, beyond the window)."""
    lower = 0
    for name in ("interleaved_lifetimes", "two_stream", "lstm_varlen"):
        flat = stress.load_workload(name, 0, False).flat
        with_share = replay.find_min_capacity(flat, "pyalloc", "sim")
        without = replay.find_min_capacity(flat, "pyalloc", "sim", "share=0,move=0")
        assert with_share <= without, name
        lower += with_share < without
        assert with_share < replay.find_min_capacity(flat, "native-expandable", "sim"), name
        assert with_share < replay.find_min_capacity(flat, "native", "sim"), name
    assert lower >= 1


def test_the_sliver_index_comes_on_near_a_full_device_and_goes_when_memory_is_given_back() -> None:
    """Note [Sliver index]: the first request that shares builds the arena's index
    (num_sliver_indexes) and diverts every call from the fast path; pyalloc_check
    (I14) compares the index with the blocks after every call, through shares,
    frees and merges. Once reserved memory is under 90% of the limit again, the
    next request drops it, and the next time the device fills it is built again."""
    a = rebuilt("sim", "vmm=shared", "capacity=34MiB")
    for _ in range(2):
        # Blocks of 1.5 MiB and 2.25 MiB side by side fill 30 of the 34 MiB;
        # freeing every other one leaves free granule ends and starts among
        # live ones, and few whole free granules.
        before = a.stats()["num_sliver_indexes"]
        sizes = [3 * MiB // 2, 9 * MiB // 4] * 8
        blocks = [a.malloc(s) for s in sizes]
        for p in blocks[1::2]:
            a.free(p)
        for _ in range(4):
            a.malloc(11 * MiB // 4)  # more than a granule, not a whole number, more than spare granules cover
        s = a.stats()
        assert s["num_sliver_indexes"] == before + 1 and s["num_ooms"] == 0
        assert s["num_shared_granules"] > 0
        a.free_all()
        pyalloc.empty_cache()
        assert a.stats()["reserved_bytes.all.current"] == 0
        a.free(a.malloc(MiB))  # a request under 90%: the index goes (I14 checks the fast path is back)
    assert a.stats()["num_sliver_indexes"] == 2
