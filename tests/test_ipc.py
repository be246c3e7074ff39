"""Sharing a live block with another process (Note [Sharing blocks] in allocator/src/device/ipc.cpp).

Real processes: the exporter is this test, the importer a child Python process with its own
pyalloc on the host backend. Arena granules are memfds, which the importer takes with
pidfd_getfd (or reopens through /proc) and maps in order, so both processes see the same bytes:
what one writes, the other reads. Plain segments of the host backend are private memory, and
exporting one is refused by name.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

from typing import Callable, Iterator

import pytest

import pyalloc
from allocator_fixture import Allocator, rebuilt

MiB = 1 << 20

IMPORTER = textwrap.dedent("""
    import ctypes, sys
    import pyalloc
    pyalloc.configure("backend=host,devices=1,capacity=64MiB")
    handle = bytes.fromhex(sys.stdin.readline())
    offset, size = int(sys.argv[1]), int(sys.argv[2])
    base = pyalloc.ipc_import(handle)
    seen = ctypes.string_at(base + offset, size)
    print(len(set(seen)), seen[0], flush=True)
    ctypes.memset(base + offset, 0x5A, size)  # the exporter sees this
    pyalloc.ipc_close(base)
    try:
        pyalloc.ipc_close(base)
    except pyalloc.PyallocError as e:
        print("second close:", e, flush=True)
""")


@pytest.fixture
def fresh() -> Iterator[Callable[[str, str], Allocator]]:
    """A freshly built allocator on a backend and vmm setting; whatever is left live is freed."""
    made: list[Allocator] = []

    def build(backend: str, vmm: str) -> Allocator:
        made.append(rebuilt(backend, vmm))
        return made[-1]

    yield build
    for a in made:
        a.free_all()
    pyalloc.check(0)


def import_in_child(handle: bytes, offset: int, size: int) -> list[str]:
    env = dict(os.environ, PYALLOC_CONF="backend=host")
    done = subprocess.run([sys.executable, "-c", IMPORTER, str(offset), str(size)], input=handle.hex() + "\n",
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("vmm", ["vmm=shared", "vmm=on"])
@pytest.mark.parametrize("size", [5 * MiB + 4096, 64 * MiB + 4096], ids=["granules", "extents"])
def test_a_block_in_an_arena_is_shared_with_another_process(vmm: str, size: int,
                                                            fresh: Callable[[str, str], Allocator]) -> None:
    """A block spanning granules, not a whole number of them; the larger one lies over extents
    of 4 MiB between its single end granules (Note [Extents]), each sent with its size."""
    a = fresh("host", vmm)
    a.malloc(1 * MiB)  # something before it, so the block does not start the arena
    ptr = a.malloc(size)
    ctypes.memset(ptr, 0x11, size)
    handle, offset = pyalloc.ipc_export(ptr)
    assert handle.startswith(b"pyalloc-ipc")
    out = import_in_child(handle, offset, size)
    assert out[0] == "1 17"  # one distinct byte, 0x11: the importer read the block
    assert out[1].startswith("second close: pyalloc_ipc_close: 0x") and "is not memory imported on device 0" in out[1]
    assert ctypes.string_at(ptr, size) == b"\x5a" * size  # and wrote it, in this process's memory
    pyalloc.check(0)


def test_a_plain_segment_of_the_host_backend_is_refused_by_name(fresh: Callable[[str, str], Allocator]) -> None:
    a = fresh("host", "vmm=off")
    ptr = a.malloc(3 * MiB)
    with pytest.raises(pyalloc.PyallocError, match="plain segment is private memory and cannot be shared"):
        pyalloc.ipc_export(ptr)


def test_the_sim_backend_cannot_share_and_says_so(fresh: Callable[[str, str], Allocator]) -> None:
    a = fresh("sim", "vmm=shared")
    ptr = a.malloc(3 * MiB)
    with pytest.raises(pyalloc.PyallocError, match="the sim backend cannot share memory with other processes"):
        pyalloc.ipc_export(ptr)


def test_bad_handles_and_pointers_are_errors_that_name_them(allocator: Allocator) -> None:
    ptr = allocator.malloc(3 * MiB)  # the large pool: in an arena unless vmm=off
    with pytest.raises(pyalloc.PyallocError, match="is not the start of a live allocation"):
        pyalloc.ipc_export(ptr + 512)
    with pytest.raises(pyalloc.PyallocError, match=r"not a pyalloc IPC handle \(5 bytes\)"):
        pyalloc.ipc_import(b"hello")
    if allocator.backend == "host" and allocator.vmm != "vmm=off":
        handle, _ = pyalloc.ipc_export(ptr)
        with pytest.raises(pyalloc.PyallocError, match="truncated or malformed"):
            pyalloc.ipc_import(handle[:-1])
        corrupt = handle[:12] + bytes([99]) + handle[13:]
        with pytest.raises(pyalloc.PyallocError, match="version 99"):
            pyalloc.ipc_import(corrupt)
    with pytest.raises(pyalloc.PyallocError, match="is not memory imported on device 0"):
        pyalloc.ipc_close(ptr)
    allocator.free(ptr)


def test_a_handle_from_a_process_that_is_gone_is_a_clear_error(fresh: Callable[[str, str], Allocator]) -> None:
    a = fresh("host", "vmm=shared")
    ptr = a.malloc(3 * MiB)
    handle, _ = pyalloc.ipc_export(ptr)
    # Rewrite the exporter's pid to one that has exited.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    at = 40 + 8 + 4  # the header, the chunk's size (8 bytes) and its part's length (4); then pid (4), descriptor (4)
    forged = handle[:at] + int(dead).to_bytes(4, "little") + handle[at + 4:]
    with pytest.raises(pyalloc.PyallocError, match=f"cannot take descriptor .* of process {dead}"):
        pyalloc.ipc_import(forged)
    pyalloc.check(0)


def test_sharing_raises_the_soft_descriptor_limit_to_the_hard_one() -> None:
    """An arena block keeps one descriptor per 2 MiB granule in the exporter (a 1 GiB tensor: 512,
    against a soft limit that is often 1,024): the first export raises the soft limit."""
    code = (
        "import resource, pyalloc\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
        "pyalloc.configure('backend=host,capacity=64MiB,vmm=shared')\n"
        "p = pyalloc.malloc(3 << 20)\n"
        "pyalloc.ipc_export(p)\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def _parts(handle: bytes) -> list[tuple[int, int]]:
    """(offset of the size field, size) of each part of a kGranules handle: after the 40-byte
    header, each part is its mapped size (8 bytes), its length (4) and its bytes."""
    at, out = 40, []
    while at < len(handle):
        size = int.from_bytes(handle[at:at + 8], "little")
        length = int.from_bytes(handle[at + 8:at + 12], "little")
        out.append((at, size))
        at += 12 + length
    return out


def _with_size(handle: bytes, at: int, size: int) -> bytes:
    return handle[:at] + (size % (1 << 64)).to_bytes(8, "little") + handle[at + 8:]


def test_chunk_sizes_that_wrap_around_to_the_total_are_refused_and_nothing_is_mapped(
        fresh: Callable[[str, str], Allocator]) -> None:
    """Sizes of 6 MiB and 2**64 - 2 MiB add up, modulo 2**64, to what the header says: mapping
    them would cover whatever lies past the reservation. The handle is refused, and the
    importer's own live memory is untouched."""
    a = fresh("host", "vmm=shared")
    a.malloc(1 * MiB)
    ptr = a.malloc(5 * MiB + 4096)  # four single granules
    neighbour = a.malloc(8 * MiB)
    ctypes.memset(neighbour, 0x6B, 8 * MiB)
    handle, _ = pyalloc.ipc_export(ptr)
    (first, _), (second, _) = _parts(handle)[:2]
    forged = _with_size(_with_size(handle, first, 6 * MiB), second, -2 * MiB)
    with pytest.raises(pyalloc.PyallocError, match="truncated or malformed"):
        pyalloc.ipc_import(forged)
    assert ctypes.string_at(neighbour, 8 * MiB) == b"\x6b" * (8 * MiB)
    pyalloc.check(0)


def test_a_chunk_larger_than_the_memory_shared_is_refused_by_name(fresh: Callable[[str, str], Allocator]) -> None:
    a = fresh("host", "vmm=shared")
    a.malloc(1 * MiB)
    ptr = a.malloc(5 * MiB + 4096)
    handle, _ = pyalloc.ipc_export(ptr)
    first, size = _parts(handle)[0]
    total = int.from_bytes(handle[24:32], "little")
    forged = _with_size(_with_size(handle, first, size + 2 * MiB), 24, total + 2 * MiB)  # the header's size too
    with pytest.raises(pyalloc.PyallocError, match="a shared chunk holds 2097152 bytes, fewer than the 4194304"):
        pyalloc.ipc_import(forged)
    pyalloc.check(0)


def test_a_block_that_starts_inside_an_extent_is_shared_from_the_extent_start(
        fresh: Callable[[str, str], Allocator]) -> None:
    """A 64 MiB block freed, then a 3 MiB block and one of 20 MiB + 4 KiB placed in it: the second starts
    3 MiB into the first 4 MiB extent (Note [Extents]), which travels whole, and the offset says
    where the block begins in it."""
    a = fresh("host", "vmm=shared")
    big = a.malloc(64 * MiB)
    a.free(big)
    a.malloc(3 * MiB)
    size = 20 * MiB + 4096  # not whole granules: packed at the free block's front
    ptr = a.malloc(size)
    assert ptr == big + 3 * MiB
    ctypes.memset(ptr, 0x11, size)
    handle, offset = pyalloc.ipc_export(ptr)
    assert offset == 3 * MiB and _parts(handle)[0][1] == 4 * MiB
    out = import_in_child(handle, offset, size)
    assert out[0] == "1 17"
    assert ctypes.string_at(ptr, size) == b"\x5a" * size
    pyalloc.check(0)
