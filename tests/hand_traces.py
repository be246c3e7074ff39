"""Traces written by hand in tests: (op, id, size[, stream]) tuples, op "alloc" or "free"."""

from __future__ import annotations

from pyalloc.traces.generators import TraceBuilder
from pyalloc.traces.trace import Trace

Event = tuple  # (op, id, size[, stream]); sizes of frees are ignored


def build(events: list[Event]) -> Trace:
    """A trace from (op, id, size[, stream]) tuples; ids are the test's own names for blocks."""
    b = TraceBuilder("hand-built")
    ids: dict[int, int] = {}
    for event in events:
        op, key, size = event[0], event[1], event[2]
        stream = event[3] if len(event) > 3 else 0
        if op == "alloc":
            ids[key] = b.alloc(size, stream)
        else:
            b.free(ids.pop(key), stream)
    return b.build("hand-built")
