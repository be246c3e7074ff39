"""The model of PyTorch's expandable_segments:True (allocator/src/replay/expandable_model.hpp).

Each figure is derived by hand from the rules the header lists (read from
c10/cuda/CUDACachingAllocator.cpp): pages of 2 MiB in the small pool and
20 MiB in the large, one segment per pool and stream that maps pages at need,
best fit with the expandable-size tie-break, splits down to 512 B, and an OOM
retry that unmaps every whole free page. A policy that mapped differently,
picked another block or retried otherwise would give other bytes.
"""

from __future__ import annotations

import pytest

from pyalloc.traces import generators
from pyalloc.traces.replay import ReplayResult, find_min_capacity, flatten, replay
from test_stress_suite import build

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def run(events: list, capacity: int = 80 * GiB) -> ReplayResult:  # type: ignore[type-arg]
    return replay(flatten(build(events), "hand"), "native-expandable", "sim", capacity)


def peak_reserved(events: list, capacity: int = 80 * GiB) -> int:  # type: ignore[type-arg]
    result = run(events, capacity)
    assert result.ooms == 0
    return result.peak_reserved_bytes


def test_a_small_request_maps_one_2_mib_page() -> None:
    assert peak_reserved([("alloc", 0, 4 * KiB)]) == 2 * MiB


def test_small_requests_fill_a_page_before_the_next_is_mapped() -> None:
    # Three 600 KiB blocks fit in one 2 MiB page; the fourth needs a second
    # page of the same segment.
    assert peak_reserved([("alloc", i, 600 * KiB) for i in range(3)]) == 2 * MiB
    assert peak_reserved([("alloc", i, 600 * KiB) for i in range(4)]) == 4 * MiB


def test_a_large_request_maps_whole_20_mib_pages() -> None:
    # 30 MiB needs two 20 MiB pages; the 10 MiB left after it serves 5 MiB.
    assert peak_reserved([("alloc", 0, 30 * MiB)]) == 40 * MiB
    assert peak_reserved([("alloc", 0, 30 * MiB), ("alloc", 1, 5 * MiB)]) == 40 * MiB


def test_a_request_extends_the_free_block_at_the_mapped_end() -> None:
    # [a 30][free 10 | unmapped]: 25 MiB takes the free 10 MiB and one more
    # page (15 MiB of it) instead of two fresh pages: 60 MiB, not 80.
    events = [("alloc", 0, 30 * MiB), ("alloc", 1, 25 * MiB)]
    assert peak_reserved(events) == 60 * MiB


def test_freed_memory_is_reused_and_stays_mapped() -> None:
    events = [("alloc", 0, 30 * MiB), ("free", 0, 0), ("alloc", 1, 30 * MiB), ("free", 1, 0),
              ("alloc", 2, 40 * MiB)]
    result = run(events)
    assert result.ooms == 0 and result.peak_reserved_bytes == 40 * MiB


def test_best_fit_passes_over_a_block_followed_by_unmapped_space() -> None:
    # One page [0, 20): x [0, 8), y [8, 16), z [16, 20). Freeing x leaves a
    # free 8 MiB block before y. w (16 MiB) fits no free block: a second page,
    # w at [20, 36), a free 4 MiB block [36, 40) before the unmapped rest.
    # Best fit for 4 MiB is [36, 40) (4 MiB), but its size with the unmapped
    # space after it is larger than [0, 8)'s 8 MiB, so the model takes
    # [0, 4). Then 24 MiB takes [36, 40) plus one page: 60 MiB in all. Had
    # the 4 MiB gone to [36, 40), 24 MiB would need two fresh pages: 80.
    events = [("alloc", 0, 8 * MiB), ("alloc", 1, 8 * MiB), ("alloc", 2, 4 * MiB), ("free", 0, 0),
              ("alloc", 3, 16 * MiB), ("alloc", 4, 4 * MiB), ("alloc", 5, 24 * MiB)]
    assert peak_reserved(events) == 60 * MiB


def test_a_large_block_splits_down_to_512_bytes() -> None:
    # With expandable segments a large block splits whenever 512 B remain
    # (the default keeps a remainder of 1 MiB or less inside the block).
    # a (19.5 MiB) leaves [19.5, 20) free; b (20 MiB) takes it and 19.5 MiB of
    # a second page, leaving [39.5, 40) free; freeing b gives one free block
    # [19.5, 40) of 20.5 MiB, which c (20.5 MiB) fits: 40 MiB. Kept inside
    # the blocks, those half MiBs would leave a 20 MiB hole and c would need a
    # third page: 60 MiB.
    events = [("alloc", 0, 39 * MiB // 2), ("alloc", 1, 20 * MiB), ("free", 1, 0), ("alloc", 2, 41 * MiB // 2)]
    assert peak_reserved(events) == 40 * MiB


def test_the_oom_retry_unmaps_free_pages_so_the_segment_can_grow_elsewhere() -> None:
    # A 60 MiB device, three pages: a [0, 20), b [20, 40), c [40, 60). Free a
    # and c: 40 MiB does not fit either free block, and mapping past c is past
    # the device. The retry unmaps both free pages (reserved 20 MiB), then
    # maps two pages after b: reserved 60 MiB again, no OOM.
    events = [("alloc", 0, 20 * MiB), ("alloc", 1, 20 * MiB), ("alloc", 2, 20 * MiB),
              ("free", 0, 0), ("free", 2, 0), ("alloc", 3, 40 * MiB)]
    result = run(events, capacity=60 * MiB)
    assert result.ooms == 0 and result.peak_reserved_bytes == 60 * MiB
    # One byte of device less and the retry cannot help: an OOM.
    assert run(events, capacity=60 * MiB - 1).ooms >= 1


def test_streams_have_segments_of_their_own() -> None:
    same = [("alloc", 0, 600 * KiB, 1), ("free", 0, 0, 1), ("alloc", 1, 600 * KiB, 1)]
    other = [("alloc", 0, 600 * KiB, 1), ("free", 0, 0, 2), ("alloc", 1, 600 * KiB, 2)]
    assert peak_reserved(same) == 2 * MiB
    assert peak_reserved(other) == 4 * MiB


def test_expandable_segments_need_less_than_the_default_when_the_batch_grows() -> None:
    """What expandable segments exist for: slightly larger tensors every step."""
    flat = flatten(generators.generate("batch_growth", 0, quick=True), "batch_growth")
    native = find_min_capacity(flat, "native", "sim")
    expandable = find_min_capacity(flat, "native-expandable", "sim")
    assert expandable < native
    # And with no limit it reserves far less (the default keeps every size's segments).
    assert (replay(flat, "native-expandable", "sim", 80 * GiB).peak_reserved_bytes
            < replay(flat, "native", "sim", 80 * GiB).peak_reserved_bytes)


@pytest.mark.parametrize("bad", [0])
def test_the_model_needs_a_capacity(bad: int) -> None:
    from pyalloc import PyallocError
    from pyalloc.traces.replay import run_replay

    with pytest.raises(PyallocError, match="native-expandable model needs a capacity"):
        run_replay(flatten(build([("alloc", 0, MiB)]), "hand"), "native-expandable", bad, 0)
