"""Allocation traces (format version 1, see TRACE_FORMAT.md): reading and validation.

A trace is validated whole before anything replays it: a bad line raises
:class:`TraceError` carrying its line number and the reason, so a replay
never half-applies a bad trace.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

ALLOC, FREE, MARK = 0, 1, 2
_OPS = {"alloc": ALLOC, "free": FREE, "mark": MARK}


class TraceError(ValueError):
    """A trace line that breaks the format; ``line`` is 1-based, 0 for the file as a whole."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}" if line > 0 else f"{path}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


@dataclass
class Trace:
    """A validated trace: parallel lists, one entry per event (marks included)."""

    source: str
    header: dict[str, Any]
    ops: list[int] = field(default_factory=list)     # ALLOC, FREE or MARK
    ids: list[int] = field(default_factory=list)     # allocation id (-1 for marks)
    sizes: list[int] = field(default_factory=list)   # requested bytes (0 unless alloc)
    streams: list[int] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)  # (event index, name)

    def __len__(self) -> int:
        return len(self.ops)

    @property
    def num_ops(self) -> int:
        """Allocations and frees (marks excluded)."""
        return sum(1 for op in self.ops if op != MARK)

    def peak_live_bytes(self) -> int:
        """Largest sum of requested sizes live at once."""
        live: dict[int, int] = {}
        current = peak = 0
        for op, ident, size in zip(self.ops, self.ids, self.sizes):
            if op == ALLOC:
                live[ident] = size
                current += size
                peak = max(peak, current)
            elif op == FREE:
                current -= live.pop(ident)
        return peak


def _open_text(path: Path) -> IO[str]:
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


# Every integer of a trace (sizes, ids, streams) must fit the 64-bit fields the replay
# hands to the library; sizes must also be below 2^63 (no device is that large).
_MAX_INT = (1 << 63) - 1


def _int_field(event: dict[str, Any], key: str, default: int | None = None) -> int | None:
    value = event.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"'{key}' must be an integer, got {value!r}")
    if not -_MAX_INT - 1 <= value <= _MAX_INT:
        raise ValueError(f"'{key}' {value} does not fit in a signed 64-bit integer (at most {_MAX_INT})")
    return value


def parse_lines(lines: Iterable[str], name: str = "<trace>") -> Trace:
    """Validates and collects a trace from its text lines."""
    it: Iterator[tuple[int, str]] = enumerate(lines, start=1)
    header: dict[str, Any] | None = None
    trace: Trace | None = None
    live: set[int] = set()
    for number, raw in it:
        text = raw.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(name, number, f"not valid JSON ({e.msg})") from None
        except RecursionError:
            raise TraceError(name, number, "JSON nested too deeply to be a trace event") from None
        if not isinstance(obj, dict):
            raise TraceError(name, number, "a line must be a JSON object")
        if header is None:
            version = obj.get("version")
            if version != 1 or isinstance(version, bool):  # True == 1 in Python
                raise TraceError(name, number, f"the header must carry \"version\": 1, got {version!r}")
            capacity = obj.get("device_capacity")
            if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0):
                raise TraceError(name, number, f"the header's device_capacity must be a whole number of bytes > 0, "
                                 f"got {capacity!r}")
            if not isinstance(obj.get("source", ""), str):
                raise TraceError(name, number, f"the header's source must be a string, got {obj['source']!r}")
            header = obj
            trace = Trace(source=str(obj.get("source", "")), header=obj)
            continue
        assert trace is not None
        op_name = obj.get("op")
        if op_name not in _OPS:
            raise TraceError(name, number, f"unknown op {op_name!r} (expected alloc, free or mark)")
        op = _OPS[op_name]
        try:
            stream = _int_field(obj, "stream", 0)
            if op == MARK:
                mark = obj.get("name")
                if not isinstance(mark, str):
                    raise ValueError("a mark needs a string 'name'")
                trace.marks.append((len(trace.ops), mark))
                ident, size = -1, 0
            else:
                maybe_id = _int_field(obj, "id")
                if maybe_id is None:
                    raise ValueError(f"{op_name} needs an integer 'id'")
                ident = maybe_id
                if op == ALLOC:
                    maybe_size = _int_field(obj, "size")
                    if maybe_size is None or maybe_size <= 0:
                        raise ValueError(f"alloc needs a positive 'size', got {obj.get('size')!r}")
                    size = maybe_size
                    if ident in live:
                        raise ValueError(f"alloc of id {ident}, which is already live")
                    live.add(ident)
                else:
                    if ident not in live:
                        raise ValueError(f"free of id {ident}, which is not live")
                    live.remove(ident)
                    size = 0
        except ValueError as e:
            raise TraceError(name, number, str(e)) from None
        trace.ops.append(op)
        trace.ids.append(ident)
        trace.sizes.append(size)
        trace.streams.append(stream if stream is not None else 0)
    if trace is None:
        raise TraceError(name, 1, "the trace is empty: no header line")
    return trace


def _check_file(p: Path) -> None:
    if p.is_dir():
        raise TraceError(str(p), 0, "is a folder, not a trace file")
    if not p.exists():
        raise TraceError(str(p), 0, "no such file")
    if not p.is_file():  # a FIFO, a device: read to the end, it may never end or never begin
        raise TraceError(str(p), 0, "is not a regular file")


def load(path: str | Path) -> Trace:
    """Reads a JSON Lines trace, gzip-compressed or not, validating every line."""
    p = Path(path)
    _check_file(p)
    try:
        with _open_text(p) as f:
            return parse_lines(f, str(p))
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:  # zlib: gzip data corrupt mid-stream
        raise TraceError(str(p), 0, f"cannot read the file ({e})") from None


def workloads_dir() -> Path:
    """The recorded workloads shipped inside the package."""
    return Path(__file__).resolve().parent / "workloads"


class _SnapshotUnpickler:
    """Reads a PyTorch snapshot pickle without running code from the file.

    ``torch.cuda.memory._snapshot()`` holds only dicts, lists, strings and
    numbers; any other class in the pickle is refused.
    """

    @staticmethod
    def load(path: Path) -> Any:
        import pickle

        class Restricted(pickle.Unpickler):
            def find_class(self, module: str, name: str) -> Any:
                raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a plain snapshot")

        with open(path, "rb") as f:
            return Restricted(f).load()


def from_snapshot(snapshot: Any, name: str, device: int = 0) -> Trace:
    """Maps a snapshot's device trace to a Trace: alloc / free_completed by address.

    Frees of addresses allocated before recording started are skipped: they
    belong to no allocation of the trace.
    """
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("device_traces"), list):
        raise TraceError(name, 0, "not a PyTorch memory snapshot: no 'device_traces' list")
    traces = snapshot["device_traces"]
    if not 0 <= device < len(traces):
        raise TraceError(name, 0, f"the snapshot has no device {device} (devices 0 to {len(traces) - 1})"
                         if traces else "the snapshot has no device trace")
    if not isinstance(traces[device], list):
        raise TraceError(name, 0, f"not a PyTorch memory snapshot: device {device}'s trace is not a list")
    def allocates(entries: Any) -> bool:
        return isinstance(entries, list) and any(isinstance(e, dict) and e.get("action") == "alloc" for e in entries)

    if not allocates(traces[device]):
        others = [i for i, t in enumerate(traces) if i != device and allocates(t)]
        if others:  # (an empty replay of device 0 reported zeros, a review)
            raise TraceError(name, 0, f"device {device}'s trace has no allocation; device"
                             f"{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} "
                             f"{'have' if len(others) > 1 else 'has'}: choose one (--snapshot-device)")
    trace = Trace(source=f"PyTorch snapshot {name}, device {device}", header={"version": 1})
    live: dict[int, int] = {}
    next_id = 0
    for index, entry in enumerate(traces[device]):
        if not isinstance(entry, dict):
            raise TraceError(name, index, "a trace entry is not a dict")
        action = entry.get("action")
        if action not in ("alloc", "free_completed"):
            continue
        try:  # what the trace written from it must hold (a True size, a 2^70 stream were written as is)
            addr, size, stream = _int_field(entry, "addr"), _int_field(entry, "size"), _int_field(entry, "stream", 0)
        except ValueError as e:
            raise TraceError(name, index, f"{'an' if action == 'alloc' else 'a'} {action} entry's {e}") from None
        if action == "alloc":
            if addr is None or size is None or size <= 0:
                raise TraceError(name, index, "an alloc entry needs an integer addr and a positive size")
            if addr in live:
                raise TraceError(name, index, f"alloc at {addr:#x}, which is already live")
            live[addr] = next_id
            trace.ops.append(ALLOC)
            trace.ids.append(next_id)
            trace.sizes.append(size)
            trace.streams.append(stream or 0)
            next_id += 1
        elif action == "free_completed":
            if addr not in live:
                continue
            trace.ops.append(FREE)
            trace.ids.append(live.pop(addr))
            trace.sizes.append(0)
            trace.streams.append(stream or 0)
    return trace


def load_any(path: str | Path, device: int = 0) -> Trace:
    """A JSON Lines trace (plain or gzip) or a pickled PyTorch memory snapshot."""
    p = Path(path)
    _check_file(p)
    with open(p, "rb") as f:
        magic = f.read(2)
    if magic[:1] == b"\x80":  # pickle protocol 2+
        import pickle

        try:
            snapshot = _SnapshotUnpickler.load(p)
        except Exception as e:  # a corrupt pickle fails in many ways (MemoryError, AttributeError, OverflowError)
            raise TraceError(str(p), 0, f"cannot read the snapshot pickle ({type(e).__name__}: {e})") from None
        return from_snapshot(snapshot, str(p), device)
    return load(p)
