"""Parsing and printing of sizes and durations for the command line and policies."""

from __future__ import annotations

import re

from .. import sizes

_TIME_UNITS = {"": 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(text: str | int) -> int:
    """'512MiB', '2G', '1024' -> bytes: pyalloc's one size syntax (pyalloc.sizes; ``GB`` is 10^9
    bytes, ``GiB`` and ``G`` 2^30). ValueError names a bad one."""
    if isinstance(text, int):
        return text
    return sizes.parse_size(text)


MAX_DURATION_S = 366 * 86400.0
"""The longest duration anything of gpumemd waits or measures: a year. Longer ones overflowed the
clock's arithmetic in a traceback (``serve --interval 1000000000d``), or printed Infinity into
the JSON event log (a review's finding)."""


def parse_duration(text: str | int | float) -> float:
    """'2s', '500ms', '10m', '1h', 3 -> seconds (ASCII digits, at most a year)."""
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*", text)
        if not m or m.group(2) not in _TIME_UNITS:
            raise ValueError(f"not a duration: {text!r}")
        seconds = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if not seconds <= MAX_DURATION_S:  # NaN, inf and too long alike
        raise ValueError(f"{text!r} is not a duration of at most a year")
    return seconds


def format_bytes(n: int | None) -> str:
    if n is None:
        return "N/A"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"
