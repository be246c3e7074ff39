"""Fixtures shared by the CPU tests (the allocator's is defined in allocator_fixture.py)."""

from __future__ import annotations

from typing import Iterator

import pytest
from allocator_fixture import allocator  # noqa: F401  (a pytest fixture)


@pytest.fixture(scope="module")
def one_cpu_thread() -> Iterator[None]:
    """Runs a module's tests with one torch CPU thread.

    Bit-for-bit comparisons of training runs need one reduction order in every run. With several
    threads the BLAS may split a matrix product differently when the machine is loaded (seen on
    the 2-core CI machine: about one run in thirty differed in the forward pass alone); one thread
    fixes the order.
    """
    import torch  # only the modules that ask for this fixture need torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
