"""The `allocator` fixture: a fresh allocator on each CPU backend, checked after every test.

libpyalloc is process-global. Each test that uses ``allocator`` starts from a
freshly built allocator (``pyalloc.configure`` with layout keys rebuilds it
when nothing is live), and the fixture frees whatever the test left live,
then runs ``pyalloc.check`` so a test can't leave corruption behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import pytest

import pyalloc

CPU_BACKENDS = ["host", "sim"]


@dataclass
class Allocator:
    """A test's handle on the allocator: remembers live blocks and checks after each call."""

    backend: str
    live: dict[int, tuple[int, int]] = field(default_factory=dict)  # ptr -> (size, device)

    def configure(self, conf: str) -> None:
        pyalloc.configure(conf)

    def malloc(self, size: int, stream: int = 0, device: int = 0) -> int:
        ptr = pyalloc.malloc(size, device, stream)
        if ptr:
            self.live[ptr] = (size, device)
        pyalloc.check(device)
        return ptr

    def free(self, ptr: int, stream: int = 0) -> None:
        size, device = self.live.pop(ptr)
        pyalloc.free(ptr, size, device, stream)
        pyalloc.check(device)

    def stats(self, device: int = 0) -> dict[str, int]:
        return dict(pyalloc.memory_stats(device))

    def free_all(self) -> None:
        for ptr in list(self.live):
            self.free(ptr)


def fresh_conf(backend: str, extra: str = "") -> str:
    base = (
        f"backend={backend},devices=1,capacity=256MiB,memory_fraction=1,max_cached=unlimited,"
        "small_segment=2MiB,large_segment=20MiB,round_power2=0,trace=0,event_delay=0,oom_report=0"
    )
    return base + ("," + extra if extra else "")


@pytest.fixture(params=CPU_BACKENDS)
def allocator(request: pytest.FixtureRequest) -> Iterator[Allocator]:
    backend = request.param
    # Switching backend forces a rebuild, so every test starts with no segments.
    other = "sim" if backend == "host" else "host"
    pyalloc.configure(fresh_conf(other))
    pyalloc.configure(fresh_conf(backend))
    a = Allocator(backend)
    yield a
    for device in range(pyalloc.device_count()):
        pyalloc.check(device)
    a.free_all()
    for device in range(pyalloc.device_count()):
        pyalloc.check(device)
    pyalloc.core.lib().pyalloc_set_current_pool(0)
