"""One size syntax (issue 23): PYALLOC_CONF (C++), pyalloc's Python API and CLI flags, and
gpumemd's flags and policies read every size alike (pyalloc/sizes.py says the rule)."""

from __future__ import annotations

import pytest

import pyalloc
from allocator_fixture import fresh_conf
from pyalloc import sizes
from pyalloc.gpumemd import units

GiB = 1 << 30

ACCEPTED = [
    ("512", 512), ("0", 0), ("64KiB", 64 << 10), ("64k", 64 << 10), ("1.5GiB", 3 << 29),
    ("2G", 2 * GiB), ("2g", 2 * GiB), ("2GB", 2_000_000_000), ("2gb", 2_000_000_000),
    ("10MB", 10_000_000), ("3 MiB", 3 << 20), (" 1TiB ", 1 << 40), ("1TB", 10**12), ("7b", 7),
    (".5KiB", 512), ("4.KiB", 4096),
    # whole numbers are read exactly, not through a double (2^53 + 1 became 2^53)
    ("9007199254740993", 2**53 + 1), ("8999999999999999999", 9 * 10**18 - 1),
    ("8185452T", 8185452 << 40),
]  # fmt: skip
REJECTED = ["", "abc", "-1", "1.5", "1e3", "2 GiBs", "1XB", "0.3KB7", "9000PB", "1.0000001GiB",
            "9000000000000000000", "99999999999999999999999", "8185453T"]


def cpp_reads(text: str) -> int | None:
    """What the C++ configuration makes of ``text`` as a size (None: refused)."""
    pyalloc.configure(fresh_conf("host"))
    try:
        pyalloc.configure(f"max_cached={text}")
    except pyalloc.PyallocError:
        return None
    return int(pyalloc.config()["max_cached"])


@pytest.mark.parametrize(("text", "expected"), ACCEPTED)
def test_every_reader_takes_a_size_the_same_way(text: str, expected: int) -> None:
    assert sizes.parse_size(text) == expected
    assert pyalloc.core.parse_size(text) == expected
    assert units.parse_size(text) == expected
    if text.strip() != "0":  # max_cached=0 means "cache nothing", not a size the config echoes
        assert cpp_reads(text) == expected


@pytest.mark.parametrize("text", REJECTED)
def test_every_reader_refuses_the_same_sizes_with_a_line_that_names_them(text: str) -> None:
    with pytest.raises(ValueError, match="bad size"):
        sizes.parse_size(text)
    with pytest.raises(pyalloc.PyallocError, match="bad size"):
        pyalloc.core.parse_size(text)
    with pytest.raises(ValueError, match="bad size"):
        units.parse_size(text)
    assert cpp_reads(text) is None


def test_sizes_print_in_binary_units() -> None:
    assert [sizes.format_size(n) for n in (0, 512, 64 << 10, 3 << 29, 4 * GiB, 80 * GiB + (1 << 29))] == [
        "0 B", "512 B", "64 KiB", "1.5 GiB", "4 GiB", "80.5 GiB"]  # fmt: skip
