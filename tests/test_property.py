"""Property tests: random operation sequences checked against a model of the contract.

Hypothesis drives a state machine over malloc (random sizes, streams and
pools; PyTorch and CuPy entry points), free, record_stream, empty_cache,
release_cached, set_memory_fraction, in-place changes of runtime keys and
deliberate bad calls, on the host backend with its defaults (vmm=shared)
and on the sim backend with a small pool beside the arenas (vmm=on). After every step
``pyalloc.check(0)`` must pass (the allocator's own invariant walk) and the
stats and the snapshot must agree with the model: the number and requested
bytes of live allocations, the small/large split, allocated <= active <=
reserved <= capacity, no two live blocks overlapping, each live block in a
segment of its own stream. On host the bytes written into each block must
survive until it is freed.

The library is process-global: every example starts by configuring a fresh
allocator (nothing is live then) and ends by freeing everything it allocated.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

import pyalloc
from pyalloc._lib import last_error as pyalloc_last_error
from pyalloc._lib import lib as pyalloc_lib

KiB = 1 << 10
MiB = 1 << 20
BLOCK_ALIGN = 512          # every size is rounded to, and every pointer aligned to, 512 B
SMALL_REQUEST = 1 * MiB    # requests up to this go to the small pool
SMALL_SEGMENT = 2 * MiB
LARGE_SEGMENT = 20 * MiB
LARGE_ROUND = 2 * MiB
STREAMS = st.integers(0, 3)
POOLS = st.sampled_from([None, None, "prop-a", "prop-b"])  # mostly the default pools
FRACTIONS = st.sampled_from([0.25, 0.5, 0.75, 1.0])

SETTINGS = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def invalid_count(stats: dict) -> int:
    """All bad-call counters together (num_invalid_free, _size, ...)."""
    return sum(v for k, v in stats.items() if k.startswith("num_invalid"))


def round_size(size: int, round_power2: int) -> int:
    """The documented rounding: 512 B, or one of ``round_power2`` steps per power of two."""
    if size <= BLOCK_ALIGN:
        return BLOCK_ALIGN
    if round_power2 > 1:
        floor2 = 1 << (size.bit_length() - 1)
        step = floor2 // round_power2
        if floor2 != size and step > BLOCK_ALIGN:
            return round_up(size, step)
    return round_up(size, BLOCK_ALIGN)


def segment_needed(size: int, round_power2: int) -> int:
    """Bytes of the segment a request of ``size`` needs on an empty device (the documented policy)."""
    rounded = round_size(size, round_power2)
    if rounded <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if rounded < LARGE_SEGMENT // 2:
        return LARGE_SEGMENT
    return round_up(rounded, LARGE_ROUND)


@dataclass
class Live:
    ptr: int
    size: int
    stream: int
    pool: str | None
    cupy: bool     # allocated through pyalloc_cupy_malloc, freed without a size
    rounded: int   # the size the documented rounding gives, at malloc time
    fill: int      # the byte the whole block was filled with (host only)


def sizes(max_size: int) -> st.SearchStrategy[int]:
    boundaries = [1, 511, 512, 513, SMALL_REQUEST - 1, SMALL_REQUEST, SMALL_REQUEST + 1,
                  LARGE_SEGMENT // 2 - 1, LARGE_SEGMENT // 2, LARGE_SEGMENT, LARGE_SEGMENT + 1]
    return st.one_of(
        st.integers(1, 64 * KiB),
        st.integers(64 * KiB, SMALL_REQUEST),
        st.integers(SMALL_REQUEST + 1, 4 * MiB),
        st.integers(4 * MiB, max_size),
        st.sampled_from([b for b in boundaries if b <= max_size]),
    )


def make_machine(backend: str, capacity: int, max_size: int, vmm: str) -> type[RuleBasedStateMachine]:
    writes_memory = backend == "host"
    has_small_pool = vmm in ("on", "all", "off")  # vmm=shared: small requests share the large arena

    class AllocatorMachine(RuleBasedStateMachine):
        blocks = Bundle("blocks")

        def __init__(self) -> None:
            super().__init__()
            # Every key that an earlier test may have changed is set here:
            # unmentioned keys keep their values.
            pyalloc.configure(
                f"backend={backend},devices=1,capacity={capacity},event_delay=2,"
                f"oom_report=0,memory_fraction=1,max_cached=unlimited,round_power2=0,"
                f"small_segment={SMALL_SEGMENT},large_segment={LARGE_SEGMENT},vmm={vmm}"
            )
            self.live: dict[int, Live] = {}
            self.fraction = 1.0
            self.round_power2 = 0
            self.serial = 0

        # ---- helpers -------------------------------------------------------

        def verify(self, block: Live, when: str) -> None:
            if not writes_memory:
                return
            data = ctypes.string_at(block.ptr, block.size)
            if data.count(block.fill) != block.size:
                bad = next(i for i, b in enumerate(data) if b != block.fill)
                raise AssertionError(
                    f"{when}: block {block.ptr:#x} (size {block.size}) was filled with "
                    f"{block.fill:#04x} but byte {bad} is {data[bad]:#04x}"
                )

        # ---- rules -----------------------------------------------------------

        @staticmethod
        def _cupy_malloc(size: int, stream: int) -> int:
            lib = pyalloc_lib()
            lib.pyalloc_cupy_set_stream(stream)
            ptr = lib.pyalloc_cupy_malloc(None, size, 0)
            if not ptr:
                raise pyalloc.PyallocError(pyalloc_last_error())
            return int(ptr)

        @rule(target=blocks, size=sizes(max_size), stream=STREAMS, pool=POOLS,
              cupy=st.sampled_from([False, False, False, True]))
        def malloc(self, size: int, stream: int, pool: str | None, cupy: bool):
            before = pyalloc.memory_stats()
            allocate = self._cupy_malloc if cupy else (lambda n, s: pyalloc.malloc(n, 0, s))
            try:
                if pool is None:
                    ptr = allocate(size, stream)
                else:
                    with pyalloc.pool(pool):
                        ptr = allocate(size, stream)
            except pyalloc.PyallocError as e:
                # The arguments are valid, so the only reason to fail is OOM,
                # and an OOM is counted.
                after = pyalloc.memory_stats()
                assert after["num_ooms"] == before["num_ooms"] + 1, f"malloc({size}) failed: {e}"
                # Releasing the cache (ladder step 1) makes all memory
                # available when nothing is live: what fits must not fail.
                limit = int(self.fraction * capacity)
                assert self.live or segment_needed(size, self.round_power2) > limit, (
                    f"malloc({size}) failed with nothing live, fraction {self.fraction} "
                    f"of {capacity}: {e}"
                )
                return multiple()
            assert ptr != 0
            assert ptr % BLOCK_ALIGN == 0, f"malloc({size}) returned {ptr:#x}, not 512-B aligned"
            assert ptr not in self.live, f"malloc returned {ptr:#x}, which is live"
            self.serial += 1
            block = Live(ptr, size, stream, pool, cupy, round_size(size, self.round_power2),
                         fill=self.serial % 251 + 1)
            if writes_memory:
                ctypes.memset(ptr, block.fill, size)
            self.live[ptr] = block
            return block

        @rule(block=consumes(blocks))
        def free(self, block: Live) -> None:
            self.verify(block, "before free")
            self._free(block)

        def _free(self, block: Live) -> None:
            if block.cupy:
                before = invalid_count(pyalloc.memory_stats())
                pyalloc_lib().pyalloc_cupy_free(None, block.ptr, 0)
                assert invalid_count(pyalloc.memory_stats()) == before, pyalloc_last_error()
            else:
                pyalloc.free(block.ptr, block.size, 0, block.stream)
            del self.live[block.ptr]

        @rule(block=blocks, stream=STREAMS)
        def record_stream(self, block: Live, stream: int) -> None:
            pyalloc.record_stream(block.ptr, stream)

        @rule()
        def empty_cache(self) -> None:
            pyalloc.empty_cache()

        @rule(nbytes=st.sampled_from([0, 1, SMALL_SEGMENT, LARGE_SEGMENT, capacity]))
        def release_cached(self, nbytes: int) -> None:
            before = pyalloc.memory_stats()["reserved_bytes.all.current"]
            released = pyalloc.release_cached(0, nbytes)
            after = pyalloc.memory_stats()["reserved_bytes.all.current"]
            assert released == before - after, (
                f"release_cached({nbytes}) says {released} bytes, reserved went {before} -> {after}"
            )

        @rule(fraction=FRACTIONS)
        def set_memory_fraction(self, fraction: float) -> None:
            pyalloc.set_memory_fraction(fraction, 0)
            self.fraction = fraction

        @rule(max_cached=st.sampled_from(["0", "4MiB", "64MiB", "unlimited"]),
              round_power2=st.sampled_from([0, 4]))
        def change_runtime_keys_with_blocks_live(self, max_cached: str, round_power2: int) -> None:
            # Not layout keys: accepted while blocks are live, applied in place.
            pyalloc.configure(f"max_cached={max_cached},round_power2={round_power2},"
                              f"memory_fraction={self.fraction}")
            self.round_power2 = round_power2

        @rule(block=blocks)
        def free_with_wrong_size_is_refused(self, block: Live) -> None:
            before = invalid_count(pyalloc.memory_stats())
            try:
                pyalloc.free(block.ptr, block.size + 2 * MiB, 0, block.stream)
            except pyalloc.PyallocError:
                pass  # reported; the binding raises only when the message changed
            assert invalid_count(pyalloc.memory_stats()) == before + 1
            self.verify(block, "after a refused wrong-size free")

        @rule(block=blocks)
        def free_of_interior_pointer_is_refused(self, block: Live) -> None:
            before = invalid_count(pyalloc.memory_stats())
            try:
                pyalloc.free(block.ptr + 8, block.size, 0, block.stream)
            except pyalloc.PyallocError:
                pass
            assert invalid_count(pyalloc.memory_stats()) == before + 1
            self.verify(block, "after a refused interior-pointer free")

        @rule(block=blocks)
        def free_on_a_device_out_of_range_is_refused(self, block: Live) -> None:
            before = pyalloc.memory_stats()["num_invalid_device"]
            try:
                pyalloc.free(block.ptr, block.size, 1, block.stream)  # devices=1
            except pyalloc.PyallocError:
                pass
            assert pyalloc.memory_stats()["num_invalid_device"] == before + 1
            self.verify(block, "after a refused free on device 1")

        @rule()
        def malloc_beyond_any_device_is_refused_not_oom(self) -> None:
            before = pyalloc.memory_stats()
            with pytest.raises(pyalloc.PyallocError):
                pyalloc.malloc(1 << 62)
            after = pyalloc.memory_stats()
            assert invalid_count(after) == invalid_count(before) + 1
            assert after["num_ooms"] == before["num_ooms"]

        @rule(block=blocks, stream=STREAMS)
        def record_stream_of_interior_pointer_changes_nothing(self, block: Live, stream: int) -> None:
            # That it is also counted is pinned down by
            # test_record_stream_of_an_unknown_pointer_is_counted_as_a_bad_call;
            # here the invariants check that it changed nothing.
            try:
                pyalloc.record_stream(block.ptr + 8, stream)
            except pyalloc.PyallocError:
                pass
            self.verify(block, "after record_stream of an interior pointer")

        # ---- the oracle --------------------------------------------------------

        @staticmethod
        def in_small_pool(block: Live) -> bool:
            return has_small_pool and block.pool is None and block.size <= SMALL_REQUEST

        @invariant()
        def allocator_agrees_with_the_model(self) -> None:
            pyalloc.check(0)
            s = pyalloc.memory_stats()
            live = list(self.live.values())
            assert s["allocation.all.current"] == len(live)
            assert s["requested_bytes.all.current"] == sum(b.size for b in live)
            small = [b for b in live if self.in_small_pool(b)]
            assert s["allocation.small_pool.current"] == len(small)
            assert s["requested_bytes.small_pool.current"] == sum(b.size for b in small)
            assert s["allocated_bytes.all.current"] >= sum(b.rounded for b in live)
            assert s["active_bytes.all.current"] >= s["allocated_bytes.all.current"]
            assert s["reserved_bytes.all.current"] >= s["active_bytes.all.current"]
            assert s["reserved_bytes.all.current"] <= capacity
            ordered = sorted(live, key=lambda b: b.ptr)
            for a, b in zip(ordered, ordered[1:]):
                assert a.ptr + round_up(a.size, BLOCK_ALIGN) <= b.ptr, (
                    f"live blocks overlap: {a.ptr:#x}+{a.size} and {b.ptr:#x}+{b.size}"
                )
            self.snapshot_agrees(s)

        def snapshot_agrees(self, stats: dict) -> None:
            segments = [g for g in pyalloc.snapshot()["segments"] if g["device"] == 0]
            assert sum(g["total_size"] for g in segments) == stats["reserved_bytes.all.current"]
            allocated: dict[int, tuple[int, dict]] = {}
            for g in segments:
                addr = g["address"]
                for b in g["blocks"]:  # blocks tile their segment in address order
                    assert b["address"] == addr, f"segment {g['address']:#x}: gap or overlap at {addr:#x}"
                    addr += b["size"]
                    if b["state"] == "active_allocated":
                        allocated[b["address"]] = (b["requested_size"], g)
                        live = self.live.get(b["address"])
                        assert live is None or b["size"] >= live.rounded, (
                            f"block {b['address']:#x} of {b['size']} B holds a request rounded "
                            f"to {live.rounded} B"
                        )
                assert addr == g["address"] + g["total_size"]
            assert {a: r for a, (r, _) in allocated.items()} == {
                b.ptr: b.size for b in self.live.values()
            }
            for b in self.live.values():
                segment = allocated[b.ptr][1]
                # Stream-ordered: a block is carved from a segment of its own stream.
                assert segment["stream"] == b.stream, f"block {b.ptr:#x} of stream {b.stream}"
                small = self.in_small_pool(b)
                assert (segment["segment_type"] == "small") == small, f"block {b.ptr:#x} size {b.size}"

        def teardown(self) -> None:
            for block in list(self.live.values()):
                self.verify(block, "at teardown")
                self._free(block)
            pyalloc.check(0)
            # empty_cache synchronizes pending frees and releases every wholly
            # free segment: with nothing live, that is all of them.
            pyalloc.empty_cache()
            s = pyalloc.memory_stats()
            assert s["allocated_bytes.all.current"] == 0
            assert s["allocation.all.current"] == 0
            assert s["reserved_bytes.all.current"] == 0
            pyalloc.check(0)

    AllocatorMachine.__name__ = f"AllocatorMachine_{backend}"
    return AllocatorMachine


HostMachine = make_machine("host", capacity=64 * MiB, max_size=24 * MiB, vmm="auto")
SimMachine = make_machine("sim", capacity=4 * 1024 * MiB, max_size=1024 * MiB, vmm="on")


def test_host_allocator_keeps_its_contract_under_random_operations() -> None:
    run_state_machine_as_test(HostMachine, settings=SETTINGS)


def test_sim_allocator_keeps_its_contract_under_random_operations() -> None:
    run_state_machine_as_test(SimMachine, settings=SETTINGS)


@pytest.mark.parametrize("backend", ["host", "sim"])
def test_record_stream_of_an_unknown_pointer_is_counted_as_a_bad_call(backend: str) -> None:
    # pyalloc.h: "A bad call (unknown pointer, ...) is counted in the stats,
    # reported through pyalloc_last_error(), and leaves the state as it was."
    pyalloc.configure(f"backend={backend},devices=1,capacity={64 * MiB},oom_report=0")
    ptr = pyalloc.malloc(4096)
    try:
        before = pyalloc.memory_stats()
        with pytest.raises(pyalloc.PyallocError):
            pyalloc.record_stream(ptr + 8, 1)  # inside a live block, not its start
        after = pyalloc.memory_stats()
        assert invalid_count(after) == invalid_count(before) + 1
        assert after["allocation.all.current"] == before["allocation.all.current"]
        pyalloc.check(0)
    finally:
        pyalloc.free(ptr, 4096)
        pyalloc.empty_cache()


@pytest.fixture(autouse=True)
def _nothing_live_after_each_test():
    yield
    # A failing example still runs teardown, so nothing of ours stays live;
    # say so loudly if it did, since it would break every later configure.
    assert pyalloc.memory_stats()["allocation.all.current"] == 0
