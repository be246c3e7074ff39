"""The torch-facing layer (cuda/torch/, Note [Out of memory under PyTorch]) on a CPU build of PyTorch.

PyTorch's CPU build has c10::OutOfMemoryError and its translation to
torch.OutOfMemoryError, so a failed allocation through the layer's operators
(torch.ops.pyalloc, built against the installed torch) reaches Python exactly
as it would from PyTorch's own allocator. The CUDA half (the
CUDAPluggableAllocator subclass) needs a CUDA build to load; here it is
compiled against the installed headers and its symbols are checked.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")

import pyalloc  # noqa: E402
from allocator_fixture import fresh_conf  # noqa: E402
from pyalloc.pytorch import layer  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("PYALLOC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    layer.load_ops()
    yield
    mp.undo()


@pytest.fixture
def device(ops: None) -> Iterator[None]:
    pyalloc.configure(fresh_conf("host", "capacity=64MiB"))
    pyalloc.reset_accumulated_memory_stats()
    pyalloc.reset_peak_memory_stats()
    yield
    pyalloc.empty_cache()


def test_a_failed_allocation_is_torch_out_of_memory_error_with_pytorchs_message(device: None) -> None:
    held = torch.ops.pyalloc.allocate(32 * MiB)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        torch.ops.pyalloc.allocate(48 * MiB)
    message = str(caught.value)
    assert isinstance(caught.value, RuntimeError)  # what `except RuntimeError` loops catch
    assert message.startswith("CUDA out of memory. Tried to allocate 48.00 MiB. GPU 0 has a total capacity of "
                              "64.00 MiB of which 32.00 MiB is free. Of the allocated memory 32.00 MiB is "
                              "allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated")
    assert "pyalloc: out of memory on device 0 (host backend): tried to allocate 48.00 MiB" in message
    assert pyalloc.memory_stats()["num_ooms"] == 1
    torch.ops.pyalloc.free(held, 32 * MiB)


def test_catch_halve_and_retry_converges(device: None) -> None:
    """What HF accelerate's find_executable_batch_size and Lightning's BatchSizeFinder do."""
    held = torch.ops.pyalloc.allocate(20 * MiB)
    batch, tries = 64, 0
    while True:
        tries += 1
        try:
            block = torch.ops.pyalloc.allocate(batch * MiB)
            break
        except torch.OutOfMemoryError as e:
            assert "CUDA out of memory." in str(e)
            batch //= 2
    assert batch == 32 and tries == 2
    torch.ops.pyalloc.free(block, batch * MiB)
    torch.ops.pyalloc.free(held, 20 * MiB)


def test_a_bad_device_is_a_runtime_error_not_out_of_memory(device: None) -> None:
    with pytest.raises(RuntimeError, match="device 7 is out of range") as caught:
        torch.ops.pyalloc.allocate(MiB, 7)
    assert not isinstance(caught.value, torch.OutOfMemoryError)
    with pytest.raises(RuntimeError, match="size must not be negative"):
        torch.ops.pyalloc.allocate(-1)


def test_a_bad_free_is_a_runtime_error_and_frees_nothing(device: None) -> None:
    p = torch.ops.pyalloc.allocate(MiB)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.pyalloc.free(p, 2 * MiB)
    assert pyalloc.memory_stats()["allocated_bytes.all.current"] == MiB
    torch.ops.pyalloc.free(p, MiB)
    assert pyalloc.memory_stats()["allocated_bytes.all.current"] == 0


def test_cache_info_is_the_largest_request_served_without_releasing(device: None) -> None:
    """cuDNN's benchmark mode sizes its workspace with cacheInfo: the largest
    cached block, or what pyalloc may still reserve, whichever is larger."""
    assert torch.ops.pyalloc.cache_info(0) == 64 * MiB
    a = torch.ops.pyalloc.allocate(40 * MiB)
    assert torch.ops.pyalloc.cache_info(0) == 24 * MiB
    b = torch.ops.pyalloc.allocate(8 * MiB)
    torch.ops.pyalloc.free(a, 40 * MiB)  # 40 MiB cached, 16 MiB never reserved
    assert torch.ops.pyalloc.cache_info(0) == 40 * MiB
    pyalloc.set_memory_fraction(0.25)  # 16 MiB: no room to grow under the cap
    try:
        assert torch.ops.pyalloc.cache_info(0) == 40 * MiB
    finally:
        pyalloc.set_memory_fraction(1.0)
    torch.ops.pyalloc.free(b, 8 * MiB)


def test_device_stats_carry_pyallocs_counters_under_pytorchs_keys(device: None) -> None:
    """What getDeviceStats gives torch.cuda.memory_stats() from C++."""
    blocks = [(torch.ops.pyalloc.allocate(size), size) for size in (MiB, 3 * MiB, 512, 10 * MiB)]
    torch.ops.pyalloc.free(*blocks.pop(1))
    mine = pyalloc.memory_stats()
    theirs = torch.ops.pyalloc.device_stats(0)
    assert len(theirs) == 9 * 12 + 8
    for key, value in theirs.items():
        assert mine[key] == value, key
    assert theirs["allocated_bytes.all.current"] == MiB + 512 + 10 * MiB
    assert theirs["allocation.all.allocated"] == 4 and theirs["allocation.all.freed"] == 1
    for p, size in blocks:
        torch.ops.pyalloc.free(p, size)


def test_a_compiler_that_fails_is_a_layer_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYALLOC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(layer.LayerError, match=r"building the torch-facing layer \(ops\) against torch"):
        layer.build("ops")
    assert not list(tmp_path.rglob("*.so"))  # nothing half-written left in the cache


def test_a_failed_build_is_remembered_and_a_changed_command_builds_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every gpu-check child compiled a build that could not succeed, ~20 s each, and timed out:
    the failure is remembered under the same sources and compiler command."""
    calls = tmp_path / "calls"
    failing = tmp_path / "failing-cxx"
    failing.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'layer.cpp:1:1: error: planted' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("PYALLOC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(failing))
    with pytest.raises(layer.LayerError, match="error: planted"):
        layer.build("ops")
    with pytest.raises(layer.LayerError, match=r"error: planted.*\(remembered in .*\.failed; delete it to build again\)"):
        layer.build("ops")
    assert calls.read_text().count("x") == 1  # the second call compiled nothing
    other = tmp_path / "other-cxx"  # another compiler: another command, built again
    other.write_text(failing.read_text())
    other.chmod(0o755)
    monkeypatch.setenv("CXX", str(other))
    with pytest.raises(layer.LayerError, match="error: planted"):
        layer.build("ops")
    assert calls.read_text().count("x") == 2


def test_the_cuda_allocator_compiles_against_the_installed_pytorch(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDAPluggableAllocator subclass: built against this torch's headers and
    CUDA's runtime headers; on a CPU build it cannot load (libtorch_cuda is not
    there), so its symbols are what is checked."""
    if layer.cuda_include_dir() is None:
        pytest.skip("CUDA's runtime headers are not installed (pip install nvidia-cuda-runtime nvidia-cuda-crt)")
    if shutil.which("nm") is None:
        pytest.skip("no nm")
    monkeypatch.setenv("PYALLOC_CACHE_DIR", str(tmp_path))
    path = layer.build("cuda")
    defined = subprocess.run(["nm", "-DC", "--defined-only", str(path)], capture_output=True, text=True).stdout
    undefined = subprocess.run(["nm", "-DCu", str(path)], capture_output=True, text=True).stdout
    assert "pyalloc_torch_install" in defined and "pyalloc_torch_error" in defined
    assert "CUDAPluggableAllocator::CUDAPluggableAllocator(" in undefined  # the base, from libtorch_cuda
    assert "CUDAPluggableAllocator::changeCurrentAllocator" in undefined
    assert "pyalloc_malloc" in undefined and "pyalloc_memory_info" in undefined  # from libpyalloc.so


# ---- memory history (Note [Memory history under PyTorch]) ----------------------------------

ALLOC, FREE_REQUESTED, FREE_COMPLETED, OOM, SNAPSHOT = 0, 1, 2, 8, 7


def _recorded(device: int = 0) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    segments, blocks, trace = torch.ops.pyalloc.snapshot_recorded(device)
    return ([segments[i:i + 6] for i in range(0, len(segments), 6)], [blocks[i:i + 5] for i in range(0, len(blocks), 5)],
            [trace[i:i + 4] for i in range(0, len(trace), 4)])


@pytest.fixture
def history(device: None) -> Iterator[None]:
    yield
    torch.ops.pyalloc.record_history(False)


def test_history_keeps_each_live_blocks_context_and_a_trace_of_allocs_and_frees(history: None) -> None:
    torch.ops.pyalloc.record_history(True, 100, 2, True)  # when=ALLOC: contexts for allocations
    a = torch.ops.pyalloc.allocate(MiB)
    b = torch.ops.pyalloc.allocate(2 * MiB)
    torch.ops.pyalloc.free(a, MiB)
    segments, blocks, trace = _recorded()
    mine = pyalloc.snapshot()["segments"]
    assert [s[:4] for s in segments] == [[s["address"], s["total_size"], s["allocated_size"], s["active_size"]]
                                         for s in mine]
    assert sum(s[5] for s in segments) == len(blocks) == sum(len(s["blocks"]) for s in mine)
    live = [blk for blk in blocks if blk[2]]
    assert len(live) == 1 and live[0][0] == 2 * MiB
    b_context = live[0][4]
    assert b_context > 0
    assert [(e[0], e[1], e[2]) for e in trace] == [(ALLOC, a, MiB), (ALLOC, b, 2 * MiB), (FREE_REQUESTED, a, MiB),
                                                  (FREE_COMPLETED, a, MiB), (SNAPSHOT, 0, 0)]
    assert trace[1][3] == b_context and trace[0][3] == b_context - 1  # contexts of the allocations, in order
    assert trace[2][3] == 0  # frees carry a context only with when=ALL
    assert torch.ops.pyalloc.context_for_pointer(b) == b_context  # getContextForPointer
    assert torch.ops.pyalloc.context_for_pointer(a) == 0  # freed: no context
    torch.ops.pyalloc.free(b, 2 * MiB)


def test_history_ring_keeps_the_newest_entries_and_state_mode_keeps_no_trace(history: None) -> None:
    torch.ops.pyalloc.record_history(True, 3, 2, True)
    ptrs = [torch.ops.pyalloc.allocate(MiB) for _ in range(5)]
    _, _, trace = _recorded()
    assert [e[0] for e in trace] == [ALLOC, ALLOC, SNAPSHOT] and trace[1][1] == ptrs[4]
    torch.ops.pyalloc.record_history(True, 3, 1, True)  # when=STATE: contexts, no trace
    p = torch.ops.pyalloc.allocate(MiB)
    _, blocks, trace = _recorded()
    assert [e[0] for e in trace] == [SNAPSHOT]
    assert sum(1 for blk in blocks if blk[2] and blk[4] > 0) == 6  # all six live blocks keep their contexts
    torch.ops.pyalloc.record_history(False)
    _, blocks, trace = _recorded()
    assert trace == [] and all(blk[4] == 0 for blk in blocks)  # stopping drops what was recorded
    for q in [*ptrs, p]:
        torch.ops.pyalloc.free(q, MiB)


def test_history_records_a_failed_allocation(history: None) -> None:
    torch.ops.pyalloc.record_history(True, 100, 2, True)
    with pytest.raises(torch.OutOfMemoryError):
        torch.ops.pyalloc.allocate(128 * MiB)
    _, _, trace = _recorded()
    assert [e[0] for e in trace] == [OOM, SNAPSHOT] and trace[0][2] == 128 * MiB


# ---- private pools (Note [Private pools under PyTorch]) ------------------------------------

GRAPH_POOL = (7, 0)  # a graph's own pool: {capture id, 0}
MEM_POOL = (0, 9)  # a MemPool's, or graph_pool_handle()'s


def _pool_of(address: int) -> tuple[int, int]:
    flat = torch.ops.pyalloc.snapshot_pools(0)
    segments = [flat[i:i + 3] for i in range(0, len(flat), 3)]
    owners = [(first, second) for base, first, second in segments if base <= address]
    assert owners, f"no segment holds {address:#x}"
    return owners[-1]


def _reserved() -> int:
    return int(pyalloc.memory_stats()["reserved_bytes.all.current"])


def test_a_graphs_pool_takes_its_streams_allocations_and_keeps_them_for_replays(device: None) -> None:
    torch.ops.pyalloc.pool_begin(0, *GRAPH_POOL, 5)  # beginAllocateToPool: the capture's stream is 5
    a = torch.ops.pyalloc.allocate(4 * MiB, 0, 5)
    other = torch.ops.pyalloc.allocate(4 * MiB, 0, 0)  # another stream: the default pools
    assert _pool_of(a) == GRAPH_POOL and _pool_of(other) == (0, 0)
    torch.ops.pyalloc.free(a, 4 * MiB, 0, 5)
    b = torch.ops.pyalloc.allocate(4 * MiB, 0, 5)
    assert b == a  # memory the capture freed is reused inside the graph
    torch.ops.pyalloc.pool_end(0, *GRAPH_POOL)  # endAllocateToPool
    torch.ops.pyalloc.free(b, 4 * MiB, 0, 5)
    torch.ops.pyalloc.free(other, 4 * MiB)
    c = torch.ops.pyalloc.allocate(4 * MiB, 0, 5)  # no longer routed: not the graph's memory
    assert c != a and _pool_of(c) == (0, 0)
    torch.ops.pyalloc.free(c, 4 * MiB, 0, 5)
    pyalloc.empty_cache()  # torch.cuda.empty_cache(): the graph's pool stays, it replays into it
    assert _reserved() >= 4 * MiB and _pool_of(a) == GRAPH_POOL
    assert torch.ops.pyalloc.pool_use_count(0, *GRAPH_POOL) == 1
    torch.ops.pyalloc.pool_release(0, *GRAPH_POOL)  # the graph is reset: its memory goes
    assert torch.ops.pyalloc.pool_use_count(0, *GRAPH_POOL) == 0
    assert _reserved() == 0
    pyalloc.check(0)


def test_a_mempools_use_count_follows_pytorchs_calls(device: None) -> None:
    torch.ops.pyalloc.pool_incref(0, *MEM_POOL)  # MemPool()
    torch.ops.pyalloc.pool_begin(0, *MEM_POOL, 0)  # with use_mem_pool(pool):
    assert torch.ops.pyalloc.pool_use_count(0, *MEM_POOL) == 2
    a = torch.ops.pyalloc.allocate(3 * MiB)
    torch.ops.pyalloc.pool_end(0, *MEM_POOL)
    torch.ops.pyalloc.pool_release(0, *MEM_POOL)
    assert torch.ops.pyalloc.pool_use_count(0, *MEM_POOL) == 1
    assert torch.ops.pyalloc.pool_live_allocations_are(0, *MEM_POOL, [a])
    assert not torch.ops.pyalloc.pool_live_allocations_are(0, *MEM_POOL, [])
    torch.ops.pyalloc.free(a, 3 * MiB)
    assert torch.ops.pyalloc.pool_live_allocations_are(0, *MEM_POOL, [])
    assert torch.ops.pyalloc.pool_empty(*MEM_POOL) > 0  # emptyCache(pool.id)
    assert _reserved() == 0
    torch.ops.pyalloc.pool_release(0, *MEM_POOL)  # ~MemPool
    assert torch.ops.pyalloc.pool_use_count(0, *MEM_POOL) == 0


def test_a_pool_let_go_with_live_blocks_keeps_them_valid(device: None) -> None:
    torch.ops.pyalloc.pool_begin(0, *GRAPH_POOL, 5)
    out = torch.ops.pyalloc.allocate(4 * MiB, 0, 5)  # a graph's output, alive after the graph
    torch.ops.pyalloc.pool_end(0, *GRAPH_POOL)
    torch.ops.pyalloc.pool_release(0, *GRAPH_POOL)
    assert _reserved() > 0
    torch.ops.pyalloc.free(out, 4 * MiB, 0, 5)
    pyalloc.empty_cache()  # let go: released like any other memory
    assert _reserved() == 0
    pyalloc.check(0)


def test_use_on_oom_pools_serve_a_request_the_default_pools_cannot(device: None) -> None:
    torch.ops.pyalloc.pool_incref(0, *MEM_POOL)
    torch.ops.pyalloc.pool_begin(0, *MEM_POOL, 0)
    cached = torch.ops.pyalloc.allocate(48 * MiB)
    torch.ops.pyalloc.pool_end(0, *MEM_POOL)
    torch.ops.pyalloc.free(cached, 48 * MiB)  # 48 of the 64 MiB held in the pool's cache
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory. Tried to allocate 24.00 MiB"):
        torch.ops.pyalloc.allocate(24 * MiB)
    torch.ops.pyalloc.pool_use_on_oom(0, *MEM_POOL, True)
    ooms = pyalloc.memory_stats()["num_ooms"]
    p = torch.ops.pyalloc.allocate(24 * MiB)  # from the pool's cache: no second ladder, no growth
    assert pyalloc.memory_stats()["num_ooms"] == ooms + 1  # the default pools' failure only
    assert _pool_of(p) == MEM_POOL
    torch.ops.pyalloc.free(p, 24 * MiB)
    torch.ops.pyalloc.pool_use_on_oom(0, *MEM_POOL, False)
    torch.ops.pyalloc.pool_release(0, *MEM_POOL)
    torch.ops.pyalloc.pool_release(0, *MEM_POOL)
    assert _reserved() == 0


def test_pools_are_reused_so_graphs_can_be_made_without_end(device: None) -> None:
    # pyalloc keeps at most 4096 user pools per process; a program may make a graph per step.
    for capture in range(5000):
        torch.ops.pyalloc.pool_begin(0, capture + 1, 0, 5)
        a = torch.ops.pyalloc.allocate(1 * MiB, 0, 5)
        torch.ops.pyalloc.free(a, 1 * MiB, 0, 5)
        torch.ops.pyalloc.pool_end(0, capture + 1, 0)
        torch.ops.pyalloc.pool_release(0, capture + 1, 0)
    assert _reserved() == 0
    pyalloc.check(0)


def test_a_release_while_routed_waits_for_the_end_of_the_route(device: None,
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    torch.ops.pyalloc.pool_begin(0, *GRAPH_POOL, 5)
    a = torch.ops.pyalloc.allocate(4 * MiB, 0, 5)
    torch.ops.pyalloc.free(a, 4 * MiB, 0, 5)
    torch.ops.pyalloc.pool_release(0, *GRAPH_POOL)  # a warning (c10's, on stderr), not a throw
    assert "private pool (7, 0) released while allocations are still routed to it" in capfd.readouterr().err
    pyalloc.empty_cache()
    assert _reserved() > 0  # still held: allocations may still come
    torch.ops.pyalloc.pool_end(0, *GRAPH_POOL)
    assert _reserved() == 0


def test_bad_pool_calls_are_errors_that_name_the_pool(device: None, capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match=r"endAllocateToPool of private pool \(3, 0\) on device 0, to which no"):
        torch.ops.pyalloc.pool_end(0, 3, 0)
    torch.ops.pyalloc.pool_release(0, 3, 0)  # releasePool runs in destructors: it warns
    assert "releasePool of private pool (3, 0) on device 0, which was never made" in capfd.readouterr().err


def test_a_route_is_a_capture_for_the_device_and_a_mark_alone_is_not(device: None) -> None:
    a = torch.ops.pyalloc.allocate(4 * MiB)
    torch.ops.pyalloc.free(a, 4 * MiB)
    torch.ops.pyalloc.pool_begin(0, *GRAPH_POOL, 5)  # beginAllocateToPool, before cudaStreamBeginCapture
    pyalloc.empty_cache()
    assert _reserved() > 0  # capture mode: nothing released (Note [Capture])
    torch.ops.pyalloc.capture_mark(0, True)  # markCaptureBegin
    torch.ops.pyalloc.pool_end(0, *GRAPH_POOL)  # a reset after a failed capture: a route's end, no mark's
    pyalloc.empty_cache()
    assert _reserved() == 0  # the route's end ended capture mode
    torch.ops.pyalloc.capture_mark(0, False)
    torch.ops.pyalloc.pool_release(0, *GRAPH_POOL)


def test_a_second_route_to_a_pool_is_refused(device: None) -> None:
    torch.ops.pyalloc.pool_begin(0, *MEM_POOL, 0)
    with pytest.raises(RuntimeError, match=r"already go to private pool \(0, 9\) \(beginAllocateToPool twice"):
        torch.ops.pyalloc.pool_begin(0, *MEM_POOL, 0)
    torch.ops.pyalloc.pool_end(0, *MEM_POOL)
    torch.ops.pyalloc.pool_release(0, *MEM_POOL)


# ---- sharing (Note [Sharing under PyTorch]) ------------------------------------------------


def test_a_shared_tensors_memory_is_mapped_once_per_handle_and_closed_with_the_last_holder(device: None) -> None:
    size = 5 * MiB
    ptr = torch.ops.pyalloc.allocate(size)  # the host backend's arenas: shareable
    ctypes.memset(ptr, 0x2B, size)
    handle, offset = torch.ops.pyalloc.ipc_share(ptr)  # shareIpcHandle
    assert bytes(handle).startswith(b"pyalloc-ipc")
    first, base = torch.ops.pyalloc.ipc_open(0, handle)  # getIpcDevPtr (this process stands for the receiver)
    second, again = torch.ops.pyalloc.ipc_open(0, handle)
    assert again == base and base != ptr  # one mapping for both holders, of its own
    assert ctypes.string_at(base + offset, size) == b"\x2b" * size
    torch.ops.pyalloc.ipc_release(first)
    assert ctypes.string_at(base + offset, 16) == b"\x2b" * 16  # the second holder keeps it
    torch.ops.pyalloc.ipc_release(second)
    with pytest.raises(pyalloc.PyallocError, match="is not memory imported on device 0"):
        pyalloc.ipc_close(base)  # the last holder closed it
    torch.ops.pyalloc.free(ptr, size)


def test_a_tensor_that_cannot_be_shared_is_an_error_that_says_why(device: None) -> None:
    pyalloc.configure(fresh_conf("host", "capacity=64MiB,vmm=off"))
    ptr = torch.ops.pyalloc.allocate(3 * MiB)
    with pytest.raises(RuntimeError, match="cannot share this CUDA tensor with another process: .*plain segment"):
        torch.ops.pyalloc.ipc_share(ptr)
    with pytest.raises(RuntimeError, match=r"cannot open a CUDA tensor shared by another process: its handle \(4 bytes\)"):
        torch.ops.pyalloc.ipc_open(0, list(b"junk"))
    torch.ops.pyalloc.free(ptr, 3 * MiB)


def _pyalloc_plain_handle(ipc: bytes) -> bytes:
    """pyalloc's handle of a plain segment on the cuda backend (pyalloc.h): header, one 64-byte part."""
    header = b"pyalloc-ipc\0" + bytes([1, ord("S"), 0, 0]) + (1).to_bytes(4, "little") + bytes(4) + \
        (20 << 20).to_bytes(8, "little") + bytes(8)
    return header + (64).to_bytes(4, "little") + ipc


def test_a_plain_segments_handle_travels_in_pytorchs_form_both_ways(ops: None) -> None:
    ipc = bytes(range(64))  # cudaIpcGetMemHandle's bytes
    theirs = bytes(torch.ops.pyalloc.ipc_convert(list(_pyalloc_plain_handle(ipc)), True))
    assert theirs == b"\x02c" + ipc  # what PyTorch's own allocator opens in a process without pyalloc
    back = bytes(torch.ops.pyalloc.ipc_convert(list(theirs), False))
    assert back[:14] == b"pyalloc-ipc\0\x01S" and back.endswith((64).to_bytes(4, "little") + ipc)
    granules = b"pyalloc-ipc\0\x01G" + bytes(30)  # an arena block's handle: no PyTorch form
    assert bytes(torch.ops.pyalloc.ipc_convert(list(granules), True)) == granules


def test_pytorch_handles_of_every_version_with_the_same_payload_are_read(ops: None) -> None:
    """PyTorch 2.13 writes version 3 where 2.12 wrote 2, the 'c' payload unchanged: a tensor sent
    by either arrives (2.11 refused pyalloc's handle of an arena block as "from a future version")."""
    ipc = bytes(range(64, 128))
    for version in (1, 2, 3):
        back = bytes(torch.ops.pyalloc.ipc_convert(list(bytes([version]) + b"c" + ipc), False))
        assert back[:14] == b"pyalloc-ipc\0\x01S" and back.endswith(ipc), version
    with pytest.raises(RuntimeError, match=r"neither pyalloc's nor PyTorch's"):
        torch.ops.pyalloc.ipc_convert(list(b"\x04c" + ipc), False)  # a version not known
    with pytest.raises(RuntimeError, match="expandable_segments, which pyalloc cannot open"):
        torch.ops.pyalloc.ipc_convert(list(b"\x03e" + bytes(40)), False)


def test_handles_pyalloc_cannot_open_are_errors_that_say_why(ops: None) -> None:
    with pytest.raises(RuntimeError, match="PyTorch's own with expandable_segments, which pyalloc cannot open"):
        torch.ops.pyalloc.ipc_convert(list(b"\x02e" + bytes(40)), False)
    with pytest.raises(RuntimeError, match=r"its handle \(3 bytes\) is neither pyalloc's nor PyTorch's"):
        torch.ops.pyalloc.ipc_convert([1, 2, 3], False)
