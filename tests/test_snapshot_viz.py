"""pyalloc's snapshots read by PyTorch's own tool, `python -m torch.cuda._memory_viz`.

The snapshot is made on the host backend with a trace ring, pickled with
pyalloc.dump_snapshot, and fed to the tool in a subprocess, as a user would.
Each check asserts that the tool's output reflects the allocations made here,
not just that it ran.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

import pyalloc

MiB = 1 << 20

# Plain segments: the geometry below (a 30 MiB segment, a shared 20 MiB one)
# is the plain policy's. Arena snapshots are checked at the end of the file.
HOST_CONF = (
    "backend=host,devices=1,capacity=256MiB,trace=1000,event_delay=1000,memory_fraction=1,"
    "max_cached=unlimited,round_power2=0,oom_report=0,vmm=off"
)

# The requests below, in bytes.
BIG = 30 * MiB      # a segment of its own
MID_FREED = 3 * MiB  # shares a 20 MiB segment with MID_PENDING; freed
MID_PENDING = 4 * MiB  # used on another stream (record_stream), then freed: pending
SMALL = 1000        # small pool
MID_LIVE = 5 * MiB
SIDE_STREAM = 7

# The block states PyTorch's snapshot writer emits (torch/csrc/cuda/Module.cpp:
# "active_allocated", "active_pending_free", "inactive"; the TypedDict in
# torch/cuda/memory.py says "active_awaiting_free", but no PyTorch code emits
# that name, and _memory_viz's segment listing looks for "active_pending_free").
PYTORCH_BLOCK_STATES = {"active_allocated", "active_pending_free", "inactive"}


def _bytes(num: float) -> str:
    """PyTorch _memory_viz's size format (its _format_size)."""
    for unit in ["", "Ki", "Mi", "Gi", "Ti"]:
        if abs(num) < 1024.0:
            return f"{num:3.1f}{unit}B"
        num /= 1024.0
    return f"{num:.1f}PiB"


def memory_viz(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", *args],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_clean_run(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result.stdout


@contextmanager
def dumped(path: Path, live: list[tuple[int, int]]) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The snapshot dumped to `path`, and loaded; afterwards the `live` (ptr, size)
    blocks are freed, the cache emptied and the allocator checked."""
    try:
        pyalloc.dump_snapshot(path)
        with open(path, "rb") as f:
            yield path, pickle.load(f)
    finally:
        for ptr, size in live:
            pyalloc.free(ptr, size)
        pyalloc.empty_cache()
        pyalloc.check(0)


@pytest.fixture
def snapshot_file(tmp_path: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Allocations, frees and a record_stream on the host backend, dumped to a pickle."""
    pyalloc.configure(HOST_CONF)
    big = pyalloc.malloc(BIG)
    freed = pyalloc.malloc(MID_FREED)
    pending = pyalloc.malloc(MID_PENDING)
    small = pyalloc.malloc(SMALL)
    pyalloc.free(freed, MID_FREED)
    pyalloc.record_stream(pending, SIDE_STREAM)
    pyalloc.free(pending, MID_PENDING)  # waits for the side stream's event
    live = pyalloc.malloc(MID_LIVE)
    try:
        # empty_cache() completes the pending free.
        with dumped(tmp_path / "snapshot.pickle", [(big, BIG), (small, SMALL), (live, MID_LIVE)]) as snap:
            yield snap
    finally:
        pyalloc.configure("trace=0,event_delay=0")


def test_snapshot_holds_the_pending_block(snapshot_file: tuple[Path, dict[str, Any]]) -> None:
    _, snap = snapshot_file
    states = [b["state"] for seg in snap["segments"] for b in seg["blocks"]]
    assert states.count("active_allocated") == 3
    assert len(snap["device_traces"]) == 1


def test_stats_reports_our_segments_reserved_and_allocated_bytes(
    snapshot_file: tuple[Path, dict[str, Any]],
) -> None:
    path, snap = snapshot_file
    out = assert_clean_run(memory_viz("stats", str(path)))  # PyTorch's segsum printout
    reserved = pyalloc.memory_stats(0)["reserved_bytes.all.current"]
    assert f"segments: {len(snap['segments'])}\n" in out
    assert f"total_reserved: {_bytes(reserved)}\n" in out
    # segsum counts the requested bytes of active_allocated blocks
    assert f"total_allocated: {_bytes(BIG + SMALL + MID_LIVE)}\n" in out
    # segments of 20 MiB and more get a row: the 30 MiB one and the shared 20 MiB one
    rows = re.findall(r"^\[.*\] (\S+) allocated, ", out, re.MULTILINE)
    big_segments = sorted(s["total_size"] for s in snap["segments"] if s["total_size"] >= 20 * MiB)
    assert rows == [_bytes(size) for size in big_segments]
    assert _bytes(BIG) in rows


def test_trace_replays_our_events(snapshot_file: tuple[Path, dict[str, Any]]) -> None:
    path, snap = snapshot_file
    events = snap["device_traces"][0]
    out = assert_clean_run(memory_viz("trace", str(path)))
    assert f"{len(events)} entries" in out
    actions = [e["action"] for e in events]
    assert actions.count("alloc") == 5
    assert out.count("cudaMalloc(") == actions.count("segment_alloc") == len(snap["segments"])
    assert out.count("\ndel ") == actions.count("free_requested") == 2
    assert f"# {_bytes(MID_FREED)}" in out  # the 3 MiB free, as the tool prints it
    # the pending free has not completed: one completion (the 3 MiB block)
    assert out.count("# free completed for") == actions.count("free_completed") == 1


@pytest.mark.parametrize("plot", ["trace_plot", "segment_plot"])
def test_html_plots_embed_our_snapshot(
    snapshot_file: tuple[Path, dict[str, Any]], tmp_path: Path, plot: str
) -> None:
    path, _ = snapshot_file
    html = tmp_path / f"{plot}.html"
    out = assert_clean_run(memory_viz(plot, str(path), "-o", str(html)))
    assert "free_completed without free_requested" not in out
    assert html.stat().st_size > path.stat().st_size  # the pickle, base64-encoded, is inside


def test_filtered_trace_plot_pairs_every_completion_with_a_request(
    snapshot_file: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, _ = snapshot_file
    out = assert_clean_run(memory_viz("trace_plot", "-f", str(path), "-o", str(tmp_path / "f.html")))
    assert "free_completed without free_requested" not in out


def test_block_states_are_pytorch_names(snapshot_file: tuple[Path, dict[str, Any]]) -> None:
    """A freed block waiting for another stream is `active_pending_free`, as PyTorch writes it."""
    _, snap = snapshot_file
    states = {b["state"] for seg in snap["segments"] for b in seg["blocks"]}
    assert states <= PYTORCH_BLOCK_STATES, states - PYTORCH_BLOCK_STATES
    assert "active_pending_free" in states


def test_trace_of_an_oom_is_readable(tmp_path: Path) -> None:
    """PyTorch's `trace` prints an OOM with the device's free bytes (`device_free`)."""
    pyalloc.configure(HOST_CONF)
    try:
        with pytest.raises(pyalloc.PyallocError):
            pyalloc.malloc(1 << 30)  # beyond the 256 MiB device
        path = tmp_path / "oom.pickle"
        pyalloc.dump_snapshot(path)
    finally:
        pyalloc.configure("trace=0,event_delay=0")
    with open(path, "rb") as f:
        events = pickle.load(f)["device_traces"][0]
    assert [e["action"] for e in events] == ["oom"]
    out = assert_clean_run(memory_viz("trace", str(path)))
    assert f"raise OutOfMemoryError # {_bytes(1 << 30)} requested" in out


# ---- arenas: segments are the mapped runs, marked expandable ----------------------------


@pytest.fixture
def arena_snapshot(tmp_path: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Arena allocations with a hole between two mapped runs, dumped to a pickle."""
    pyalloc.configure(HOST_CONF.replace("vmm=off", "vmm=on"))
    first = pyalloc.malloc(BIG)
    middle = pyalloc.malloc(MID_FREED)
    last = pyalloc.malloc(MID_LIVE)
    pyalloc.free(middle, MID_FREED)
    pyalloc.release_cached(0, 0)  # unmaps the middle's whole granule: a hole between two runs
    try:
        with dumped(tmp_path / "arena.pickle", [(first, BIG), (last, MID_LIVE)]) as snap:
            yield snap
    finally:
        pyalloc.configure("trace=0,event_delay=0,vmm=auto")


def test_arena_snapshot_has_one_expandable_segment_per_mapped_run(
    arena_snapshot: tuple[Path, dict[str, Any]],
) -> None:
    _, snap = arena_snapshot
    runs = [s for s in snap["segments"] if s["is_expandable"]]
    assert len(runs) == 2
    for seg in runs:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        assert seg["blocks"][0]["address"] == seg["address"]
    assert sum(s["total_size"] for s in snap["segments"]) == pyalloc.memory_stats(0)["reserved_bytes.all.current"]


def test_memory_viz_reads_an_arena_snapshot(arena_snapshot: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, snap = arena_snapshot
    out = assert_clean_run(memory_viz("stats", str(path)))
    reserved = pyalloc.memory_stats(0)["reserved_bytes.all.current"]
    assert f"segments: {len(snap['segments'])}\n" in out
    assert f"total_reserved: {_bytes(reserved)}\n" in out
    assert f"total_allocated: {_bytes(BIG + MID_LIVE)}\n" in out
    events = snap["device_traces"][0]
    actions = [e["action"] for e in events]
    assert actions.count("segment_map") > 0 and actions.count("segment_unmap") == 1
    out = assert_clean_run(memory_viz("trace", str(path)))
    assert f"{len(events)} entries" in out
    assert_clean_run(memory_viz("segment_plot", str(path), "-o", str(tmp_path / "s.html")))
