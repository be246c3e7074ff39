"""Fixtures shared by the CPU tests (defined in allocator_fixture.py)."""

from allocator_fixture import allocator  # noqa: F401  (a pytest fixture)
