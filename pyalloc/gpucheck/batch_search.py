"""The largest batch that trains: doubling, then bisection, as a batch-size finder does.

Used by the training loops of ``pyalloc gpu-check`` (:mod:`.child`) and its offload check
(:mod:`.offload`). ``trains(batch)`` runs a few steps at that batch and says whether they ran
without running out of memory; the caller frees what a failed attempt left behind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

BISECT_PRECISION = 32
"""Bisection stops when the gap between the largest batch that trained and the smallest that did
not is at most 1/32 of the former (or 1): about 3% below the true largest batch, at worst."""


@dataclass(frozen=True)
class BatchSearch:
    largest: int  # the largest batch that trained; 0 when none did
    first_failing: int | None  # the smallest batch that did not; None when none failed
    stop: str  # why doubling stopped: "out of memory", "max_batch" (the cap trained) or "time"


def largest_batch(trains: Callable[[int], bool], start: int, cap: int, deadline: float,
                  affordable: Callable[[int], bool] = lambda batch: True) -> BatchSearch:
    """Doubles from ``start`` (the last step is ``cap`` itself) until a batch fails, the cap
    trains or time runs out; then bisects between the largest batch that trained and the first
    that failed, while time is left. Time runs out when ``time.monotonic()`` passes ``deadline``,
    or when ``affordable(batch)`` says the next attempt would end after it (a caller that can
    predict an attempt's time)."""
    good, bad, size = 0, None, min(start, cap)
    while bad is None and good < cap and time.monotonic() < deadline and affordable(size):
        if trains(size):
            good, size = size, min(2 * size, cap)
        else:
            bad = size
    stop = "out of memory" if bad is not None else "max_batch" if good >= cap else "time"
    while bad is not None and bad - good > max(1, good // BISECT_PRECISION) and time.monotonic() < deadline:
        middle = (good + bad) // 2
        if not affordable(middle):
            break
        if trains(middle):
            good = middle
        else:
            bad = middle
    return BatchSearch(good, bad, stop)
