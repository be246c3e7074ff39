"""The one size syntax of pyalloc and gpumemd, as the C++ configuration reads it.

A size is a number of bytes, optionally with a fraction, and a unit:

- binary (IEC): ``KiB``, ``MiB``, ``GiB``, ``TiB``, and the single letters ``K``, ``M``, ``G``,
  ``T`` for the same (as ``PYTORCH_CUDA_ALLOC_CONF`` sizes, ``free -g`` and nvidia-smi's MiB);
- decimal (SI): ``KB``, ``MB``, ``GB``, ``TB`` are 10^3, 10^6, 10^9 and 10^12 bytes, what the
  standards say they are; ``2GB`` is 2,000,000,000 bytes, not 2 GiB;
- ``B`` or nothing: bytes.

Case does not matter; the value must come to a whole number of bytes. This module imports nothing
of pyalloc, so the daemon (which must run without the training stack) and the core binding share
it; ``allocator/src/ground/config.cpp``'s ``parse_size`` is the same rule, and
``tests/test_sizes.py`` checks that all three read every example alike.
"""

from __future__ import annotations

import math
import re

UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}  # fmt: skip
# The bound of every reader: sizes are size_t (and far larger than any memory).
MAX_SIZE = 9 * 10**18
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", re.ASCII)


def parse_size(text: str) -> int:
    """``"512"``, ``"64KiB"``, ``"1.5GiB"``, ``"2GB"`` -> bytes; ValueError names what is wrong."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"bad size {text!r}: expected a number of bytes with an optional unit, "
                         "such as 512, 64KiB, 1.5GiB or 2GB (GB is 10^9 bytes, GiB 2^30)")
    unit = m.group(2).lower()
    if unit not in UNITS:
        raise ValueError(f"bad size {text!r}: unknown unit {m.group(2)!r}; use B, KiB, MiB, GiB, TiB "
                         "(or K, M, G, T for the same), or KB, MB, GB, TB for powers of 10")
    number = m.group(1)
    # a whole number is read exactly; one with a fraction through a double, as the C++ parser does
    value = int(number) * UNITS[unit] if "." not in number else float(number) * UNITS[unit]
    if not math.isfinite(value) or value >= MAX_SIZE:
        raise ValueError(f"bad size {text!r}: larger than any memory")
    if value != math.floor(value):
        raise ValueError(f"bad size {text!r}: not a whole number of bytes")
    return int(value)


def format_size(n: int) -> str:
    """Bytes as a person reads them: ``"512 B"``, ``"64 KiB"``, ``"1.5 GiB"`` (binary units)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            text = f"{value:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{n} B"
