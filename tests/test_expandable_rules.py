"""The native-expandable policy: a model of PyTorch's allocator with expandable_segments:True.

A second set of hand-derived cases, written independently of
tests/test_expandable_model.py and of the model's code, from the same
PyTorch source: two readings of the rules that agree. Each answer below is derived by hand from the rules in
allocator/src/replay/expandable_model.hpp (read from PyTorch's
c10/cuda/CUDACachingAllocator.cpp):
  - one virtual range per (stream, pool); the small pool (requests up to
    1 MiB) maps 2 MiB pages, the large pool 20 MiB pages; sizes rounded up to
    512 B; reserved = mapped bytes;
  - best fit over the free mapped blocks on (stream, size, address), stepping
    on to the next block while its size plus the unmapped space right after it
    is smaller (so the free block at a segment's mapped end, followed by the
    unmapped rest of the range, is passed over for a larger one inside);
  - growth maps ceil(missing / page) pages, at the lowest address where free
    and unmapped blocks add up to the request, joining a free block just
    before the unmapped space;
  - any remainder of 512 B or more is split off, in both pools;
  - when a map would pass the capacity: unmap the whole free pages of every
    free block (every stream and pool), then try once more.
Replays go through ``pyalloc_replay`` like every other policy (sizes in MiB
in the comments; layouts as [block offset-end) within one range).
"""

from __future__ import annotations

from hand_traces import Event, build
from pyalloc.traces import stress
from pyalloc.traces.generators import KiB, MiB
from pyalloc.traces.replay import POLICIES, POLICY_CONF, ReplayResult, find_min_capacity, flatten, replay

GiB = 1 << 30
POLICY = "native-expandable"


def run(events: list[Event], policy: str = POLICY, capacity: int = 80 * GiB) -> ReplayResult:
    """One replay, with the reserved bytes sampled after every event."""
    return replay(flatten(build(events), "hand"), policy, "sim", capacity, curve_points=len(events))


def peak(events: list[Event], policy: str = POLICY) -> int:
    result = run(events, policy)
    assert result.ooms == 0
    return result.peak_reserved_bytes


def min_capacity(events: list[Event], policy: str = POLICY) -> int:
    return find_min_capacity(flatten(build(events), "hand"), policy)


# ---- the policy is registered ---------------------------------------------------------------


def test_the_policy_is_a_model_with_no_pyalloc_configuration() -> None:
    assert POLICY in POLICIES and POLICY not in POLICY_CONF
    assert stress.policy_label(POLICY) == "expandable (model)"
    assert stress.DEFAULT_POLICIES.index(POLICY) == stress.DEFAULT_POLICIES.index("native") + 1
    assert run([("alloc", 0, MiB)]).backend == "model"


# ---- pages and ranges -------------------------------------------------------------------------


def test_a_small_request_maps_one_2_mib_page() -> None:
    assert peak([("alloc", 0, 600 * KiB)]) == 2 * MiB


def test_small_requests_tile_the_pages_of_one_range() -> None:
    # Ten 600 KiB blocks, back to back: 6000 KiB -> 3 pages of 2 MiB. The default
    # model packs three to a 2 MiB segment: 4 segments, 8 MiB.
    events = [("alloc", i, 600 * KiB) for i in range(10)]
    assert peak(events) == 6 * MiB
    assert peak(events, "native") == 8 * MiB
    # At the peak the one free block is the rest of the third page: 6144 - 6000 KiB.
    assert run(events).largest_free_at_peak_bytes == 144 * KiB


def test_a_30_mib_request_maps_two_20_mib_pages_and_splits_off_the_rest() -> None:
    result = run([("alloc", 0, 30 * MiB)])
    assert result.peak_reserved_bytes == 40 * MiB
    assert result.largest_free_at_peak_bytes == 10 * MiB
    assert peak([("alloc", 0, 30 * MiB)], "native") == 30 * MiB


def test_a_3_mib_request_maps_one_20_mib_page_that_then_serves_more() -> None:
    # [a 3)[b 3-19)[free 19-20): one page.
    assert peak([("alloc", 0, 3 * MiB), ("alloc", 1, 16 * MiB)]) == 20 * MiB
    # 18 MiB more does not fit the 17 left: [b 3-21) maps a second page.
    assert peak([("alloc", 0, 3 * MiB), ("alloc", 1, 18 * MiB)]) == 40 * MiB


def test_growth_starts_at_the_free_block_before_the_unmapped_space() -> None:
    # [a 0-16)[free 16-20); 42 MiB takes the free 4 and maps ceil(38 / 20) = 2
    # pages: [b 16-58). Starting at the page boundary it would need 3 pages.
    assert peak([("alloc", 0, 16 * MiB), ("alloc", 1, 42 * MiB)]) == 60 * MiB


def test_each_stream_and_each_pool_has_a_range_of_its_own() -> None:
    assert peak([("alloc", 0, 600 * KiB, 1), ("alloc", 1, 600 * KiB, 2)]) == 4 * MiB
    # A block freed on stream 1 is not reused on stream 2.
    assert peak([("alloc", 0, 600 * KiB, 1), ("free", 0, 0, 1), ("alloc", 1, 600 * KiB, 2)]) == 4 * MiB
    assert peak([("alloc", 0, 600 * KiB, 1), ("free", 0, 0, 1), ("alloc", 1, 600 * KiB, 1)]) == 2 * MiB
    # 1 MiB is small (one 2 MiB page), 1 MiB + 1 B large (one 20 MiB page).
    assert peak([("alloc", 0, MiB), ("alloc", 1, MiB + 1)]) == 22 * MiB


def test_freeing_and_reallocating_reuses_the_mapped_pages() -> None:
    # Freeing keeps the 40 MiB mapped: [free 0-40) serves 35 MiB. The default
    # model caches a 30 MiB segment that 35 MiB does not fit: 30 + 36 MiB.
    events = [("alloc", 0, 30 * MiB), ("free", 0, 0), ("alloc", 1, 35 * MiB)]
    assert peak(events) == 40 * MiB
    assert [v // MiB for v in run(events).curve_reserved] == [40, 40, 40]
    assert peak(events, "native") == 66 * MiB


def test_a_large_pool_remainder_of_512_kib_is_split_off() -> None:
    # [a 3)[b 3-19.5)[free 19.5-20): the 512 KiB remainder is a free block of its
    # own (the default splits a large-pool remainder only above 1 MiB).
    events = [("alloc", 0, 3 * MiB), ("alloc", 1, 16 * MiB + 512 * KiB)]
    assert run(events).largest_free_at_peak_bytes == 512 * KiB
    assert run(events, "native").largest_free_at_peak_bytes == 0


# ---- best fit and its expandable tie-break -----------------------------------------------------


def test_best_fit_passes_over_the_free_block_at_the_end_of_the_mapped_range() -> None:
    # [a 0-8)[b 8-14)[free 14-20 | unmapped]; free a: [free 0-8)[b][free 14-20 | unmapped].
    # 5 MiB fits the 6 MiB block at the end best, but that block's expandable size
    # (6 MiB + the unmapped rest of the range) is larger than the 8 MiB block's:
    # c goes to [c 0-5)[free 5-8). Then 26 MiB starts at the 6 MiB free block and
    # maps one page: 40 MiB. Plain best fit (c at the end, [free 19-20)) would
    # leave 1 MiB before the unmapped space and map two pages: 60 MiB.
    events = [("alloc", 0, 8 * MiB), ("alloc", 1, 6 * MiB), ("free", 0, 0), ("alloc", 2, 5 * MiB),
              ("alloc", 3, 26 * MiB)]
    result = run(events)
    assert result.ooms == 0
    assert result.peak_reserved_bytes == 40 * MiB
    assert [v // MiB for v in result.curve_reserved] == [20, 20, 20, 20, 40]
    # At the peak: [c 0-5)[free 5-8)[b 8-14)[d 14-40): the 3 MiB block is the largest free.
    assert result.largest_free_at_peak_bytes == 3 * MiB


# Stream 1 (large pool, 20 MiB pages), capacity 100 MiB:
#   w 12, t 48, x 20, v 8, y 12     [w 0-12)[t 12-60)[x 60-80)[v 80-88)[y 88-100): 100 mapped
#   free v, free t                  [w][free 12-60)[x][free 80-88)[y]
#   z 40 on stream 2                140 > 100: the retry unmaps pages 20-60 of stream 1,
#                                   keeping [free 12-20) (page 0 holds w); z maps 40: 100
#   free z                          stream 2: [free 0-40) stays mapped
#   r 8                             two 8 MiB free blocks: [12-20), followed by the 40 MiB
#                                   hole, and [80-88), followed by y: r takes [80-88)
#   s 48                            [free 12-20) + the hole hold 48: mapping 40 passes 100,
#                                   the retry unmaps z's range, then 60 + 40 = 100
# Had r taken [12-20) (the lower address), s would need 3 new pages at the end:
# 60 + 60 > 100, an OOM.
EQUAL_BLOCKS = [("alloc", 0, 12 * MiB, 1), ("alloc", 1, 48 * MiB, 1), ("alloc", 2, 20 * MiB, 1),
                ("alloc", 3, 8 * MiB, 1), ("alloc", 4, 12 * MiB, 1), ("free", 3, 0, 1), ("free", 1, 0, 1),
                ("alloc", 5, 40 * MiB, 2), ("free", 5, 0, 2), ("alloc", 6, 8 * MiB, 1), ("alloc", 7, 48 * MiB, 1)]


def test_between_equal_free_blocks_the_one_not_followed_by_unmapped_space_is_taken() -> None:
    result = run(EQUAL_BLOCKS, capacity=100 * MiB)
    assert result.ooms == 0
    assert result.peak_reserved_bytes == 100 * MiB
    assert [v // MiB for v in result.curve_reserved] == [20, 60, 80, 100, 100, 100, 100, 100, 100, 100, 100]


# ---- out of memory: unmap whole free pages and retry ------------------------------------------------


# Stream 1: a 10 MiB -> [a 0-10)[free 10-20); b 35 MiB -> [b 10-45)[free 45-60): 60 mapped.
# free b: [a][free 10-60). Stream 2: c 20 MiB needs a page: at 60 MiB capacity the
# retry unmaps pages 20-60 (page 0 holds a), 20 mapped, and c maps one: 40.
RELEASE = [("alloc", 0, 10 * MiB, 1), ("alloc", 1, 35 * MiB, 1), ("free", 1, 0, 1), ("alloc", 2, 20 * MiB, 2)]


def test_at_capacity_the_retry_unmaps_whole_free_pages_of_one_range_so_another_grows() -> None:
    result = run(RELEASE, capacity=60 * MiB)
    assert result.ooms == 0
    assert result.peak_reserved_bytes == 60 * MiB
    assert [v // MiB for v in result.curve_reserved] == [20, 60, 60, 40]
    # At the peak of live bytes (a + b) the free block is [45-60).
    assert result.largest_free_at_peak_bytes == 15 * MiB


def test_with_room_to_spare_nothing_is_unmapped() -> None:
    result = run(RELEASE, capacity=80 * MiB)
    assert result.ooms == 0
    assert [v // MiB for v in result.curve_reserved] == [20, 60, 60, 80]


def test_below_the_pages_a_request_needs_it_fails() -> None:
    # At 58 MiB b cannot map its two pages, and no free block holds a whole page
    # ([free 10-20) shares page 0 with a): one OOM. c then maps a page: 40.
    result = run(RELEASE, capacity=58 * MiB)
    assert result.ooms == 1
    assert [v // MiB for v in result.curve_reserved] == [20, 20, 20, 40]
    assert min_capacity(RELEASE) == 60 * MiB
    # The default model: 10 + 36 MiB segments, then b's cached segment is freed for c.
    assert min_capacity(RELEASE, "native") == 46 * MiB


# ---- where expandable segments beat the default ----------------------------------------------------


def test_growing_batch_fits_in_the_freed_range_where_the_default_strands_slivers() -> None:
    # Two 20 MiB blocks, freed; then three 13 MiB blocks. Expandable: one free
    # 40 MiB block holds all three: 40 MiB. The default: each 13 MiB block splits
    # a cached 20 MiB segment, leaving 7 MiB slivers that no 13 MiB block fits and
    # that cannot be released (their segments are split): a third segment of 14 MiB.
    events = [("alloc", 0, 20 * MiB), ("alloc", 1, 20 * MiB), ("free", 0, 0), ("free", 1, 0),
              ("alloc", 2, 13 * MiB), ("alloc", 3, 13 * MiB), ("alloc", 4, 13 * MiB)]
    assert min_capacity(events) == 40 * MiB
    assert min_capacity(events, "native") == 54 * MiB
    assert run(events, capacity=40 * MiB).ooms == 0
    assert run(events, "native", capacity=52 * MiB).ooms == 1


def test_a_generated_stress_workload_replays_without_failures() -> None:
    flat = flatten(stress.generators.generate("batch_growth", quick=True), "batch_growth")
    result = replay(flat, POLICY, "sim")
    assert result.ooms == 0
    assert result.peak_live_bytes == flat.peak_live_bytes
    assert result.peak_reserved_bytes >= flat.peak_live_bytes
    minimum = find_min_capacity(flat, POLICY)
    assert replay(flat, POLICY, "sim", minimum).ooms == 0
    assert replay(flat, POLICY, "sim", minimum - 2 * MiB).ooms > 0


def test_stress_labels_both_models_in_the_table() -> None:
    run_ = stress.WorkloadRun(stress.load_workload("mlp", 0, True))
    for p in ("pyalloc", "native", POLICY):
        run_.runs[p] = stress.run_policy(run_.workload, p, False, 10)
    table = stress.format_table([run_], ["pyalloc", "native", POLICY], wide=True)
    header = table.splitlines()[0]
    assert "native (model)" in header and "expandable (model)" in header
    assert "expandable (model): a model of PyTorch's policy with expandable_segments:True" in table
