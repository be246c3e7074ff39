"""A seeded random churn near a full device for moving slivers (Note [Moving slivers]) and
merging groups of twins (Note [Groups of twins]): layouts of granules live at one end, at both
ends around a free middle, or only in their middle, so that cut pairs and nested pairs move, then
requests of whole granules and odd sizes, frees in random order, a second stream, record_stream,
release_cached and empty_cache. After every call ``pyalloc_check`` holds (I13: every offset of a
group's granule owned by one twin) and, on the host backend, every live block still holds its own
byte; at the end all memory comes back.
"""

from __future__ import annotations

import random

import pytest

import pyalloc
from allocator_fixture import Allocator, fill, holds, rebuilt

MiB = 1 << 20
KiB = 1 << 10
GRANULE = 2 * MiB
SEEDS = range(12)


class Churn:
    def __init__(self, seed: int, backend: str, share: int) -> None:
        self.rng = random.Random(seed)
        self.granules = self.rng.choice([3, 4, 6, 8, 10])
        self.a: Allocator = rebuilt(backend, "vmm=shared", f"capacity={2 * self.granules}MiB,share={share}")
        self.byte: dict[int, int] = {}

    def intact(self) -> bool:
        return self.a.backend != "host" or all(holds(p, self.a.live[p][0], b) for p, b in self.byte.items())

    def malloc(self, size: int, stream: int = 0) -> int | None:
        try:
            ptr = self.a.malloc(size, stream)  # checks
        except pyalloc.PyallocError as e:
            assert "out of memory" in str(e)
            pyalloc.check(0)
            return None
        self.byte[ptr] = 1 + len(self.byte) % 255
        if self.a.backend == "host":
            fill(ptr, size, self.byte[ptr])
        return ptr

    def free(self, ptr: int) -> None:
        del self.byte[ptr]
        self.a.free(ptr)  # checks

    def drain(self) -> None:
        """Frees every live block and empties the cache: all memory comes back, twins parted."""
        for p in list(self.byte):
            self.free(p)
        pyalloc.empty_cache()
        pyalloc.check(0)
        assert self.a.stats()["reserved_bytes.all.current"] == 0

    def layout(self) -> None:
        """One granule at a time, in units: live at its start, its end, both ends around a free
        middle, only in its middle (two blocks at times), or all of it; then the free units go."""
        unit = self.rng.choice([256 * KiB, 128 * KiB])
        per = GRANULE // unit
        pieces: list[tuple[int, bool]] = []  # (units, stays live)
        for _ in range(self.granules):
            kind = self.rng.choice(["start", "end", "middle_free", "middle_live", "middle_live", "full"])
            i = self.rng.randint(1, per // 2 - 1)
            j = self.rng.randint(per // 2 + 1, per - 1)
            if kind == "start":
                pieces += [(i, True), (per - i, False)]
            elif kind == "end":
                pieces += [(j, False), (per - j, True)]
            elif kind == "middle_free":
                pieces += [(i, True), (j - i, False), (per - j, True)]
            elif kind == "middle_live" and j - i > 1 and self.rng.random() < 0.3:
                k = self.rng.randint(1, j - i - 1)
                pieces += [(i, False), (k, True), (j - i - k, True), (per - j, False)]
            elif kind == "middle_live":
                pieces += [(i, False), (j - i, True), (per - j, False)]
            else:
                pieces += [(per, True)]
        made = [(self.malloc(units * unit), live) for units, live in pieces]
        dead = [p for p, live in made if p is not None and not live]
        self.rng.shuffle(dead)
        for p in dead:
            self.free(p)

    def churn(self, calls: int) -> None:
        for _ in range(calls):
            r = self.rng.random()
            if r < 0.35:
                size = self.rng.choice([self.rng.randint(1, 16) * 256 * KiB, self.rng.randint(1, 3) * GRANULE,
                                        self.rng.randint(1, 6 * MiB // 512) * 512])
                self.malloc(size)
            elif r < 0.40:
                self.malloc(self.rng.randint(1, 8) * 256 * KiB, stream=1)
            elif r < 0.43 and self.byte:
                pyalloc.record_stream(self.rng.choice(list(self.byte)), 7)
                pyalloc.check(0)
            elif r < 0.85 and self.byte:
                self.free(self.rng.choice(list(self.byte)))
            elif r < 0.93:
                pyalloc.release_cached(0, 0)
                pyalloc.check(0)
            else:
                pyalloc.empty_cache()
                pyalloc.check(0)
            assert self.intact()


@pytest.mark.parametrize("backend", ["host", "sim"])
@pytest.mark.parametrize("share", [0, 1])
def test_a_churn_near_a_full_device_moves_slivers_and_loses_no_byte(backend: str, share: int) -> None:
    moved = nested = 0
    for seed in SEEDS:
        c = Churn(seed, backend, share)
        c.layout()
        for _ in range(c.rng.randint(1, 3)):  # requests that only moves can serve, often
            c.malloc(c.rng.randint(1, 3) * GRANULE)
        nested += lends_a_middle()
        assert c.intact()
        c.churn(50)
        moved += int(c.a.stats()["num_moved_granules"])
        c.drain()
    assert moved > 0 and nested > 0  # both kinds of pair ran


class SmallPieces(Churn):
    """Granules that keep one or two units of 64 KiB live anywhere in them: pairs form first, and
    the pairs' granules still hold free memory where another pair's or granule's live bytes fit,
    so later requests merge whole groups (Note [Groups of twins])."""

    def layout(self) -> None:
        unit = 64 * KiB
        per = GRANULE // unit
        pieces: list[tuple[int, bool]] = []
        for _ in range(self.granules):
            where = self.rng.randint(0, per - 2)
            size = self.rng.randint(1, 2)
            pieces += [(where, False)] if where else []
            pieces += [(size, True)] + ([(per - where - size, False)] if per - where - size > 0 else [])
        made = [(self.malloc(units * unit), live) for units, live in pieces]
        dead = [p for p, live in made if p is not None and not live]
        self.rng.shuffle(dead)
        for p in dead:
            self.free(p)


@pytest.mark.parametrize("backend", ["host", "sim"])
def test_a_churn_of_small_live_pieces_merges_groups_and_loses_no_byte(backend: str) -> None:
    merged = 0
    for seed in SEEDS:
        c = SmallPieces(seed, backend, 0)
        c.layout()
        for _ in range(4):  # requests that only moves and merges can serve
            c.malloc(c.rng.randint(1, 3) * GRANULE)
        assert c.intact()
        c.churn(40)
        for _ in range(3):
            c.malloc(c.rng.randint(1, 2) * GRANULE)
            pyalloc.check(0)
        assert c.intact()
        merged += int(c.a.stats()["num_merged_groups"])
        c.drain()
    assert merged > 0  # groups merged, and parted again at the end


def lends_a_middle() -> int:
    """Twin granules that lend their middle now: the snapshot splits an arena at lent pieces, so
    two of its segments that end and start inside the same granule have one between them."""
    segments = sorted((s["address"], s["address"] + s["total_size"]) for s in pyalloc.snapshot()["segments"]
                      if s["is_expandable"])
    return sum(1 for (_, end), (start, _) in zip(segments, segments[1:])
               if end % GRANULE and start % GRANULE and end // GRANULE == start // GRANULE and start > end)
