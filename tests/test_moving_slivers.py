"""Moving slivers (Note [Moving slivers] in allocator/src/device/move.cpp).

Ladder step 4b: when no whole granule is left and nothing else serves a request, the live
end of one granule is copied into another granule whose live part lies at other offsets,
that granule is mapped in its place, and the first goes back to the backend. On the host
backend granules are real memfd chunks, so the tests read the bytes back through the moved
block's own address and through its new partner's; on the sim backend the bookkeeping is
the same. Every call is followed by ``pyalloc_check`` (I13: twins in pairs over one granule,
lending complementary pieces, reserved counting the granule once).
"""

from __future__ import annotations

from typing import Iterator

import pytest

import pyalloc
from allocator_fixture import Allocator, fill, fresh_conf, holds, rebuilt
from pyalloc.traces import replay, stress

MiB = 1 << 20
KiB = 1 << 10


@pytest.fixture(params=["host", "sim"])
def apart(request: pytest.FixtureRequest) -> Iterator[tuple[Allocator, dict[str, int]]]:
    """A 6 MiB device (three granules), full, sharing off: a keeps the first 512 KiB of granule
    0, c all of granule 1, b the last 512 KiB of granule 2; the 1.5 MiB after a and before b are
    free, slivers no whole-granule move can use, and their live parts lie at different offsets."""
    a = rebuilt(request.param, "vmm=shared", "capacity=6MiB,share=0")
    sizes = {"a": 512 * KiB, "x": 1536 * KiB, "c": 2 * MiB, "y": 1536 * KiB, "b": 512 * KiB}
    blocks = {name: a.malloc(size) for name, size in sizes.items()}
    base = blocks["a"]
    assert [blocks[n] - base for n in ("x", "c", "y", "b")] == [512 * KiB, 2 * MiB, 4 * MiB, 5 * MiB + 512 * KiB]
    yield from full_device(a, blocks, BYTES, ("x", "y"))


BYTES = {"a": 0xA1, "c": 0xC1, "b": 0xB1}  # what `apart`'s live blocks hold on the host backend


def full_device(a: Allocator, blocks: dict[str, int], bytes_of: dict[str, int],
                frees: tuple[str, ...]) -> Iterator[tuple[Allocator, dict[str, int]]]:
    """A fixture's body: fills the blocks named in `bytes_of` (host backend), frees those in
    `frees`, checks the 6 MiB device is all reserved, yields, and at the end frees everything
    and checks that all memory comes back."""
    if a.backend == "host":
        for name, byte in bytes_of.items():
            fill(blocks[name], a.live[blocks[name]][0], byte)
    for name in frees:
        a.free(blocks.pop(name))
    assert a.stats()["reserved_bytes.all.current"] == 6 * MiB
    yield a, blocks
    a.free_all()
    pyalloc.check(0)
    pyalloc.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0


def intact(a: Allocator, blocks: dict[str, int], bytes_of: dict[str, int] = BYTES) -> bool:
    return a.backend != "host" or all(
        holds(blocks[name], a.live[blocks[name]][0], byte) for name, byte in bytes_of.items() if name in blocks
    )


def test_a_request_that_no_granule_serves_moves_a_live_end_and_keeps_its_bytes(
    apart: tuple[Allocator, dict[str, int]]
) -> None:
    a, blocks = apart
    n = a.malloc(2 * MiB)
    s = a.stats()
    assert n != 0 and s["num_ooms"] == 0
    assert s["num_moved_granules"] == 1 and s["moved_bytes"] == 512 * KiB
    assert s["reserved_bytes.all.current"] == 6 * MiB  # granules 0 and 2 are one physical granule now
    assert s["allocated_bytes.all.current"] == 5 * MiB
    assert intact(a, blocks)  # b read through its own address, now backed by granule 0's memory
    if a.backend == "host":
        fill(n, 2 * MiB, 0x5E)
        assert intact(a, blocks)
        # One physical granule under both addresses: what b holds is at the same offset of a's granule.
        fill(blocks["b"], 512 * KiB, 0xB2)
        assert holds(blocks["a"] + 3 * 512 * KiB, 512 * KiB, 0xB2)
        a.free(blocks.pop("b"))
        assert holds(blocks["a"], 512 * KiB, 0xA1) and holds(n, 2 * MiB, 0x5E)


def test_the_twins_part_and_the_memory_comes_back(apart: tuple[Allocator, dict[str, int]]) -> None:
    a, blocks = apart
    n = a.malloc(2 * MiB)
    a.free(blocks.pop("b"))  # granule 2's own part is free: it parts from granule 0 when asked
    pyalloc.release_cached(0, 0)
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 6 * MiB  # a's granule, c's and n's
    assert s["allocated_bytes.all.current"] == 512 * KiB + 4 * MiB
    # Granule 2's address is unmapped; what it lent in granule 0 is free there again.
    assert a.malloc(1536 * KiB) == blocks["a"] + 512 * KiB
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 6 * MiB and s["num_ooms"] == 0
    assert intact(a, blocks)
    a.free(n)


def test_a_block_used_on_another_stream_is_not_moved(apart: tuple[Allocator, dict[str, int]]) -> None:
    a, blocks = apart
    pyalloc.record_stream(blocks["b"], 7)
    with pytest.raises(pyalloc.PyallocError, match="out of memory"):
        pyalloc.malloc(2 * MiB)
    s = a.stats()
    assert s["num_ooms"] == 1 and s["num_moved_granules"] == 0
    assert intact(a, blocks)


def test_a_block_shared_with_another_process_is_not_moved(apart: tuple[Allocator, dict[str, int]]) -> None:
    a, blocks = apart
    if a.backend == "sim":
        pytest.skip("the sim backend exports nothing")
    pyalloc.ipc_export(blocks["b"])  # an importer would map b's own granule
    with pytest.raises(pyalloc.PyallocError, match="out of memory"):
        pyalloc.malloc(2 * MiB)
    assert a.stats()["num_moved_granules"] == 0
    assert intact(a, blocks)


def test_live_parts_that_overlap_do_not_move() -> None:
    """a's live part ends past where b's starts: the two cannot share one granule."""
    a = rebuilt("sim", "vmm=shared", "capacity=6MiB,share=0")
    try:
        sizes = {"a": 1536 * KiB, "x": 512 * KiB, "c": 2 * MiB, "y": 512 * KiB, "b": 1536 * KiB}
        blocks = {name: a.malloc(size) for name, size in sizes.items()}
        a.free(blocks.pop("x"))
        a.free(blocks.pop("y"))
        with pytest.raises(pyalloc.PyallocError, match="out of memory"):
            pyalloc.malloc(2 * MiB)
        assert a.stats()["num_moved_granules"] == 0
    finally:
        a.free_all()
        pyalloc.check(0)


def test_without_move_the_same_request_fails(apart: tuple[Allocator, dict[str, int]]) -> None:
    a, blocks = apart
    pyalloc.configure("move=0")
    assert pyalloc.config()["move"] is False
    with pytest.raises(pyalloc.PyallocError, match="out of memory"):
        pyalloc.malloc(2 * MiB)
    s = a.stats()
    assert s["num_ooms"] == 1 and s["num_moved_granules"] == 0
    pyalloc.configure("move=1")


def test_move_takes_0_or_1_or_auto() -> None:
    with pytest.raises(pyalloc.PyallocError, match="move"):
        pyalloc.configure(fresh_conf("sim", "move=sometimes"))
    pyalloc.configure(fresh_conf("sim"))
    assert pyalloc.config()["move"] is True
    pyalloc.configure("move=auto")
    assert pyalloc.config()["move"] == "auto"
    pyalloc.configure("move=1")


def test_by_default_only_the_host_backend_does_not_move(apart: tuple[Allocator, dict[str, int]]) -> None:
    """move=auto, the default: on the host backend the program's own threads read and write the
    blocks a move copies (a review's eight threads segfaulted in 1 run of 4), so it does not move
    there; the sim backend (and CUDA, where the device synchronizes first) moves."""
    a, blocks = apart
    pyalloc.configure("move=auto")
    if a.backend == "host":
        with pytest.raises(pyalloc.PyallocError, match="out of memory"):
            pyalloc.malloc(2 * MiB)
        assert a.stats()["num_moved_granules"] == 0
    else:
        a.free(a.malloc(2 * MiB))
        assert a.stats()["num_moved_granules"] == 1
    assert intact(a, blocks)
    pyalloc.configure("move=1")


@pytest.mark.parametrize("workload", ["two_stream", "interleaved_lifetimes", "mlp_fixed"])
def test_moving_lowers_the_memory_a_workload_needs(workload: str) -> None:
    """On the stress suite's workloads whose slivers pair up, moving them needs less memory than
    not moving (the figures: docs/benchmarks/2026-11-27-moving-slivers-cpu.md)."""
    flat = stress.load_workload(workload, 0, False).flat
    moving = replay.find_min_capacity(flat, "pyalloc", "sim", "move=1")
    without = replay.find_min_capacity(flat, "pyalloc", "sim", "move=0")
    assert moving is not None and without is not None and moving < without


def test_the_first_move_is_told_on_stderr(apart: tuple[Allocator, dict[str, int]],
                                         capfd: pytest.CaptureFixture[str]) -> None:
    """Live memory that moves is worth knowing of: with oom_report=1 (the default) the first move
    of a device's allocator says so, and how to turn it off (later ones are counted only)."""
    a, _ = apart
    pyalloc.configure("oom_report=1")
    try:
        a.malloc(2 * MiB)
        told = capfd.readouterr().err
        assert "moved the live bytes of 1 granule(s)" in told and "PYALLOC_CONF=move=0" in told
    finally:
        pyalloc.configure("oom_report=0")


def moved_to_serve(a: Allocator, request: int, full: int) -> int:
    """Serves `request` on a device whose `full` bytes are all reserved, with no failure; the
    granules moved to do it."""
    assert a.stats()["reserved_bytes.all.current"] == full
    assert a.malloc(request) != 0
    s = a.stats()
    assert s["num_ooms"] == 0
    return int(s["num_moved_granules"])


def test_a_granule_free_at_both_ends_is_paired_either_way() -> None:
    """Granule 1 is free at its start (live from q = 2 units) and at its end (live up to p = 3):
    taken as the partner of granule 0 (p = 1), it would leave granules 2 (q = 3) and 3 (q = 6)
    with no partner; as the partner of granule 3 it lets granule 0 pair with granule 2, and two
    granules come back (units of 256 KiB, 8 to a granule; a review found the first answer)."""
    unit = 256 * KiB
    a = rebuilt("sim", "vmm=shared", "capacity=8MiB,share=0")
    try:
        plan = [("l0", 1), ("f1a", 5), ("f1b", 4), ("l1", 1), ("f2a", 4), ("f2b", 4), ("l2", 5),
                ("f3a", 3), ("f3b", 3), ("l3", 2)]
        ptrs = {name: a.malloc(units * unit) for name, units in plan}
        for name in ("f1a", "f1b", "f2a", "f2b", "f3a", "f3b"):
            a.free(ptrs.pop(name))
        assert moved_to_serve(a, 4 * MiB, full=8 * MiB) == 2
    finally:
        a.free_all()
        pyalloc.check(0)


def test_granules_free_at_both_ends_pair_with_each_other() -> None:
    """Granules 0 and 2 are free at both ends, live in the middle only (at unit 1 and unit 5;
    granule 1 is live throughout): one is the other's a. Trying each such granule as an a in one
    pass and as a b in another paired neither (found on lstm_varlen's last failing request)."""
    unit = 256 * KiB
    a = rebuilt("sim", "vmm=shared", "capacity=6MiB,share=0")
    try:
        plan = [("f0a", 1), ("l0", 1), ("f0b", 6), ("l1", 8), ("f2a", 5), ("l2", 1), ("f2b", 2)]
        ptrs = {name: a.malloc(units * unit) for name, units in plan}
        for name in ("f0a", "f0b", "f2a", "f2b"):
            a.free(ptrs.pop(name))
        assert moved_to_serve(a, 2 * MiB, full=6 * MiB) == 1
    finally:
        a.free_all()
        pyalloc.check(0)


@pytest.fixture(params=["host", "sim"])
def nested(request: pytest.FixtureRequest) -> Iterator[tuple[Allocator, dict[str, int]]]:
    """A 6 MiB device, full, sharing off, in units of 256 KiB: h keeps units 0 and 7 of granule 0
    (its middle, 1 to 7, free), c all of granule 1, u unit 3 of granule 2 (free at both ends).
    No cut pairs them (h is live at both ends); u's live part lies inside h's free middle."""
    a = rebuilt(request.param, "vmm=shared", "capacity=6MiB,share=0")
    unit = 256 * KiB
    plan = [("h0", 1), ("hf", 6), ("h1", 1), ("c", 8), ("uf0", 3), ("u", 1), ("uf1", 4)]
    blocks = {name: a.malloc(units * unit) for name, units in plan}
    yield from full_device(a, blocks, NESTED_BYTES, ("hf", "uf0", "uf1"))


NESTED_BYTES = {"h0": 0xA1, "h1": 0xA2, "c": 0xC1, "u": 0xB1}


def nested_intact(a: Allocator, blocks: dict[str, int]) -> bool:
    return intact(a, blocks, NESTED_BYTES)


def test_a_granule_live_inside_anothers_free_middle_moves_there(nested: tuple[Allocator, dict[str, int]]) -> None:
    """u's live unit goes to the same offset of h's granule, which lends u its middle; u lends
    its start and its end (I13). A 2 MiB request is served from the granule given back."""
    a, blocks = nested
    assert moved_to_serve(a, 2 * MiB, full=6 * MiB) == 1
    s = a.stats()
    assert s["moved_bytes"] == 256 * KiB and s["reserved_bytes.all.current"] == 6 * MiB
    pyalloc.check(0)
    assert nested_intact(a, blocks)
    if a.backend == "host":  # one physical granule under both: u's byte is at unit 3 of h's range
        assert holds(blocks["h0"] + 3 * 256 * KiB, 256 * KiB, 0xB1)


@pytest.mark.parametrize("first", ["u", "h"])
def test_nested_twins_part_when_either_owns_nothing_live(nested: tuple[Allocator, dict[str, int]],
                                                        first: str) -> None:
    """Freeing u (its own part, h's middle, all free) or both of h's blocks (its two own parts)
    lets the pair part: the granule of the one freed becomes address space again and the
    other's lent pieces free memory, where the next request of their size lands."""
    a, blocks = nested
    n = a.malloc(2 * MiB)
    assert a.stats()["num_moved_granules"] == 1
    unit = 256 * KiB
    if first == "u":
        a.free(blocks.pop("u"))
        size, where = 6 * unit, blocks["h0"] + unit  # h's middle, lent to u until now
    else:
        a.free(blocks.pop("h0"))
        a.free(blocks.pop("h1"))
        size, where = 4 * unit, blocks["u"] + unit  # u's end, lent to h until now
    pyalloc.check(0)
    pyalloc.release_cached(0, 0)  # parts the twins whose own part is free
    pyalloc.check(0)
    assert a.stats()["reserved_bytes.all.current"] == 6 * MiB  # three physical granules, as before
    assert a.malloc(size) == where
    s = a.stats()
    assert s["num_ooms"] == 0 and s["num_moved_granules"] == 1
    assert nested_intact(a, blocks)
    a.free(n)


def test_a_request_moves_the_pairs_it_needs_first() -> None:
    """Four pairs could move; a 2 MiB request moves as many as it spans granules and two more
    (three), and stitches from what they gave back, leaving the fourth pair where it is."""
    a = rebuilt("sim", "vmm=shared", "capacity=32MiB,share=0")
    try:
        frees = []
        for _ in range(4):  # [live 512 KiB | free] [live] [free | live 512 KiB] [live]
            for size, free in ((512 * KiB, False), (1536 * KiB, True), (2 * MiB, False),
                               (1536 * KiB, True), (512 * KiB, False), (2 * MiB, False)):
                ptr = a.malloc(size)
                if free:
                    frees.append(ptr)
        for ptr in frees:
            a.free(ptr)
        assert moved_to_serve(a, 2 * MiB, full=32 * MiB) == 3
    finally:
        a.free_all()
        pyalloc.check(0)


def test_lstm_varlen_fits_194_mib_by_merging_groups_and_keeps_every_byte() -> None:
    """The recorded lstm_varlen trace on the host backend at 194 MiB (peak live 190.31 MiB,
    1.019): its last requests are served only by merging twins into groups (Note [Groups of
    twins]; 196 MiB with pairs alone). Every block's bytes are tagged when it is allocated and
    read back when it is freed and, after every move, for every live block; pyalloc_check every
    200 calls and at the end."""
    import ctypes

    from pyalloc.traces.trace import ALLOC, FREE

    flat = stress.load_workload("lstm_varlen", 0, False).flat
    replay.configure_for_replay("host", 194 * MiB)
    live: dict[int, tuple[int, int, int]] = {}  # slot -> (address, size, byte)

    def intact(ptr: int, size: int, byte: int) -> bool:  # its first, middle and last KiB
        return all(ctypes.string_at(ptr + at, min(KiB, size - at)) == bytes([byte]) * min(KiB, size - at)
                   for at in {0, max(0, size // 2 - KiB // 2), max(0, size - KiB)})

    moved = 0
    for i, (op, slot, size, stream) in enumerate(zip(flat.ops, flat.slots, flat.sizes, flat.streams)):
        if op == ALLOC:
            ptr = pyalloc.malloc(size, stream=stream)  # raises on a failed request
            live[slot] = (ptr, size, 1 + i % 251)
            fill(ptr, size, live[slot][2])
        elif op == FREE:
            ptr, size, byte = live.pop(slot)
            assert intact(ptr, size, byte), f"call {i}: a block lost its bytes"
            pyalloc.free(ptr, size, stream=stream)
        s = pyalloc.memory_stats()
        if s["num_moved_granules"] != moved:
            moved = s["num_moved_granules"]
            assert all(intact(*block) for block in live.values()), f"call {i}: a move lost bytes"
        if i % 200 == 0:
            pyalloc.check(0)
    pyalloc.check(0)
    s = pyalloc.memory_stats()
    for ptr, size, byte in live.values():
        assert intact(ptr, size, byte)
        pyalloc.free(ptr, size)
    pyalloc.empty_cache()
    pyalloc.check(0)
    assert s["num_ooms"] == 0 and s["num_merged_groups"] >= 1
    assert pyalloc.memory_stats()["reserved_bytes.all.current"] == 0
