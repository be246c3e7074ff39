"""The `allocator` fixture: a fresh allocator on each CPU backend, checked after every test.

Each backend runs three times: with plain segments only (``host``, ``sim``:
``vmm=off``), with the large and user pools in virtual-memory arenas beside a
small pool of plain segments (``host-arenas``, ``sim-arenas``: ``vmm=on``),
and with requests of every size in the large pool's arena (``host-shared``,
``sim-shared``: ``vmm=shared``, the default on these backends).
A test that pins plain-segment geometry (segment sizes, counts) asks for the
plain variants only with ``@pytest.mark.parametrize("allocator", PLAIN, indirect=True)``.

libpyalloc is process-global. Each test that uses ``allocator`` starts from a
freshly built allocator (``pyalloc.configure`` with layout keys rebuilds it
when nothing is live), and the fixture frees whatever the test left live,
then runs ``pyalloc.check`` so a test can't leave corruption behind.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Iterator

import pytest

import pyalloc

CPU_BACKENDS = ["host", "sim"]
PLAIN = CPU_BACKENDS
WITH_SMALL_POOL = PLAIN + [f"{b}-arenas" for b in CPU_BACKENDS]  # small requests in 2 MiB plain segments
VARIANTS = PLAIN + [f"{b}-{kind}" for kind in ("arenas", "shared") for b in CPU_BACKENDS]
VARIANT_VMM = {"": "vmm=off", "arenas": "vmm=on", "shared": "vmm=shared"}


@dataclass
class Allocator:
    """A test's handle on the allocator: remembers live blocks and checks after each call."""

    backend: str
    vmm: str = "vmm=auto"  # the variant's arena setting, kept by conf()
    live: dict[int, tuple[int, int]] = field(default_factory=dict)  # ptr -> (size, device)
    streams: dict[int, int] = field(default_factory=dict)  # ptr -> the stream it was allocated on

    @property
    def small_pool(self) -> str:
        """The pool a default request of up to 1 MiB goes to: with vmm=shared, the large pool
        (Note [One arena for small and large])."""
        return "large" if self.vmm == "vmm=shared" else "small"

    def conf(self, extra: str = "") -> str:
        """A fresh configuration of this variant (backend and arenas), plus ``extra``."""
        return fresh_conf(self.backend, self.vmm + ("," + extra if extra else ""))

    def configure(self, conf: str) -> None:
        pyalloc.configure(conf)

    def malloc(self, size: int, stream: int = 0, device: int = 0) -> int:
        ptr = pyalloc.malloc(size, device, stream)
        if ptr:
            self.live[ptr] = (size, device)
            self.streams[ptr] = stream
        pyalloc.check(device)
        return ptr

    def free(self, ptr: int, stream: int | None = None) -> None:
        """Frees on the block's own stream unless ``stream`` says otherwise."""
        size, device = self.live.pop(ptr)
        own = self.streams.pop(ptr, 0)
        pyalloc.free(ptr, size, device, own if stream is None else stream)
        pyalloc.check(device)

    def stats(self, device: int = 0) -> dict[str, int]:
        return dict(pyalloc.memory_stats(device))

    def free_all(self) -> None:
        for ptr in list(self.live):
            self.free(ptr)


def fill(ptr: int, size: int, byte: int) -> None:
    """Writes `byte` over [ptr, ptr + size): real bytes on the host backend."""
    ctypes.memset(ptr, byte, size)


def holds(ptr: int, size: int, byte: int) -> bool:
    return ctypes.string_at(ptr, size) == bytes([byte]) * size


def fresh_conf(backend: str, extra: str = "") -> str:
    base = (
        f"backend={backend},devices=1,capacity=256MiB,memory_fraction=1,max_cached=unlimited,"
        "small_segment=2MiB,large_segment=20MiB,round_power2=0,trace=0,event_delay=0,oom_report=0,vmm=auto,plan=0,lifetime=0,share=1,move=1,reuse=1,extent=32MiB"
    )
    return base + ("," + extra if extra else "")


MECHANISM_VARIANTS = ["host", "sim", "sim-plain"]


def checked(a: Allocator) -> Iterator[Allocator]:
    """The body of a fixture: `a`, whose leftovers are freed and checked afterwards."""
    yield a
    a.free_all()
    pyalloc.check(0)


def mechanism_allocator(variant: str, extra: str) -> Iterator[Allocator]:
    """The body of a mechanism's fixture (params=MECHANISM_VARIANTS): a fresh
    allocator with `extra`, whose leftovers are freed and checked afterwards."""
    yield from checked(fresh_allocator(variant, extra))


def rebuilt(backend: str, vmm: str, extra: str = "") -> Allocator:
    """A freshly built allocator on `backend` with `vmm` and the keys in `extra`:
    switching backend first forces a rebuild, so it starts with no segments."""
    pyalloc.configure(fresh_conf("sim" if backend == "host" else "host"))
    pyalloc.configure(fresh_conf(backend, vmm + ("," + extra if extra else "")))
    return Allocator(backend, vmm)


def fresh_allocator(variant: str, extra: str) -> Allocator:
    """A freshly built allocator for a mechanism's tests: `variant` is host or sim
    (arenas, vmm=on) or sim-plain (vmm=off), with the keys in `extra` on top."""
    backend, _, plain = variant.partition("-")
    return rebuilt(backend, "vmm=off" if plain else "vmm=on", extra)


@pytest.fixture(params=VARIANTS)
def allocator(request: pytest.FixtureRequest) -> Iterator[Allocator]:
    backend, _, kind = request.param.partition("-")
    a = rebuilt(backend, VARIANT_VMM[kind])
    yield a
    for device in range(pyalloc.device_count()):
        pyalloc.check(device)
    a.free_all()
    for device in range(pyalloc.device_count()):
        pyalloc.check(device)
    pyalloc.core.lib().pyalloc_set_current_pool(0)
