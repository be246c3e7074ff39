"""Reader of the pyalloc process registry (allocator/include/pyalloc/registry.h).

Every process with libpyalloc publishes one fixed-layout record in
``/dev/shm/pyalloc.<uid>.<pid>``. gpumemd reads them here. The files are
written by arbitrary processes, so nothing in them is trusted: every read
refuses symlinks, non-regular files and files of the wrong size or owner,
retries torn reads through the sequence lock a bounded number of times, and
validates every field. A record that fails any check becomes a
:class:`Skipped` with a reason; nothing here raises on hostile input.

The mailbox (:func:`post_trim`) is the daemon's half of the request/response
protocol: it writes ``request_*`` and bumps ``request_seq``; the process's
registry thread answers with ``response_bytes`` and ``response_seq``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import re
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

MAGIC = 0x31474552434F4C41
VERSION = 1
MAX_DEVICES = 16
COMMAND_LEN = 256
BACKEND_LEN = 16
DEFAULT_DIR = "/dev/shm"
PREFIX = "pyalloc."
REQUEST_NONE = 0
REQUEST_TRIM = 1
FLAG_PRESSURE_OPT_IN = 1

SEQLOCK_RETRIES = 200  # attempts before a record that keeps changing is skipped as torn
MAX_BYTES = 1 << 60  # 1 EiB: any counter above this is garbage, not a device
HEARTBEAT_FUTURE_SLACK_NS = 60 * 10**9  # clocks drift; a heartbeat further ahead is garbage

_NAME = re.compile(r"^pyalloc\.(\d{1,10})\.(\d{1,10})$")
_UNPUBLISHED = re.compile(r"^pyalloc\.\d{1,10}\.\d{1,10}\.new$")  # a record being made (registry.cpp)


class RegistryDevice(ctypes.Structure):
    """Mirror of ``pyalloc_registry_device``: one device's counters, in bytes."""

    _fields_ = [
        ("reserved_bytes", ctypes.c_uint64),
        ("allocated_bytes", ctypes.c_uint64),
        ("active_bytes", ctypes.c_uint64),
        ("cached_free_bytes", ctypes.c_uint64),
        ("largest_free_bytes", ctypes.c_uint64),
        ("swapped_out_bytes", ctypes.c_uint64),
        ("peak_reserved_bytes", ctypes.c_uint64),
        ("num_ooms", ctypes.c_uint64),
        ("num_alloc_retries", ctypes.c_uint64),
        ("last_alloc_unix_ns", ctypes.c_uint64),
    ]


class RegistryRecord(ctypes.Structure):
    """Mirror of ``pyalloc_registry_record``; tests compare its layout with the C compiler's."""

    _fields_ = [
        ("magic", ctypes.c_uint64),
        ("version", ctypes.c_uint32),
        ("record_size", ctypes.c_uint32),
        ("seq", ctypes.c_uint64),
        ("pid", ctypes.c_int32),
        ("uid", ctypes.c_uint32),
        ("start_time_ticks", ctypes.c_uint64),
        ("backend", ctypes.c_char * BACKEND_LEN),
        ("command", ctypes.c_char * COMMAND_LEN),
        ("heartbeat_unix_ns", ctypes.c_uint64),
        ("num_devices", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("devices", RegistryDevice * MAX_DEVICES),
        ("request_seq", ctypes.c_uint64),
        ("request_kind", ctypes.c_uint32),
        ("request_device", ctypes.c_int32),
        ("request_bytes", ctypes.c_uint64),
        ("response_seq", ctypes.c_uint64),
        ("response_bytes", ctypes.c_uint64),
        ("requests_served", ctypes.c_uint64),
    ]


RECORD_SIZE = ctypes.sizeof(RegistryRecord)
_SEQ = RegistryRecord.seq.offset
_REQUEST_SEQ = RegistryRecord.request_seq.offset
_REQUEST_KIND = RegistryRecord.request_kind.offset
_REQUEST_DEVICE = RegistryRecord.request_device.offset
_REQUEST_BYTES = RegistryRecord.request_bytes.offset
_RESPONSE_SEQ = RegistryRecord.response_seq.offset
_RESPONSE_BYTES = RegistryRecord.response_bytes.offset


class RecordError(Exception):
    """A registry file that can't be trusted; the message is the reason it was skipped."""


class RecordGone(RecordError):
    """The file was removed between the listing and the open: its process exited (not a fault)."""


@dataclass(frozen=True)
class DeviceCounters:
    """One device's allocator counters as published by the process (bytes)."""

    index: int
    reserved_bytes: int
    allocated_bytes: int
    active_bytes: int
    cached_free_bytes: int
    largest_free_bytes: int
    swapped_out_bytes: int
    peak_reserved_bytes: int
    num_ooms: int
    num_alloc_retries: int
    last_alloc_unix_ns: int


@dataclass(frozen=True)
class Record:
    """A validated registry record, copied out of shared memory."""

    path: str
    pid: int
    uid: int
    start_time_ticks: int
    backend: str
    command: str
    heartbeat_unix_ns: int
    flags: int
    devices: tuple[DeviceCounters, ...]
    request_seq: int
    response_seq: int
    response_bytes: int
    requests_served: int

    @property
    def pressure_opt_in(self) -> bool:
        return bool(self.flags & FLAG_PRESSURE_OPT_IN)

    def heartbeat_age_s(self, now_ns: int | None = None) -> float:
        now_ns = time.time_ns() if now_ns is None else now_ns
        return max(0.0, (now_ns - self.heartbeat_unix_ns) / 1e9)


@dataclass(frozen=True)
class Skipped:
    """A registry file that was not used, and why (shown by ``gpumemd status --json``)."""

    path: str
    reason: str


@dataclass
class Scan:
    records: list[Record] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def registry_dir() -> Path:
    """``PYALLOC_REGISTRY_DIR`` if set (tests, containers with another tmpfs), else /dev/shm."""
    return Path(os.environ.get("PYALLOC_REGISTRY_DIR") or DEFAULT_DIR)


def record_path(pid: int, uid: int | None = None, directory: Path | str | None = None) -> Path:
    uid = os.getuid() if uid is None else uid
    return Path(directory or registry_dir()) / f"{PREFIX}{uid}.{pid}"


def find_record_path(pid: int, directory: Path | str | None = None) -> Path | None:
    """The registry file of ``pid`` whatever its uid, or None."""
    base = Path(directory or registry_dir())
    try:
        names = os.listdir(base)
    except OSError:
        return None
    for name in names:
        m = _NAME.match(name)
        if m and int(m.group(2)) == pid:
            return base / name
    return None


def _open_checked(path: Path | str, writable: bool, as_uid: int | None) -> tuple[int, os.stat_result]:
    """Opens a registry file refusing anything but a regular file of the right size and owner.

    O_NOFOLLOW refuses a symlink planted to make the daemon read (or, for
    the mailbox, write) another file; O_NONBLOCK keeps a FIFO from hanging
    the open. The checks run on the opened descriptor, so a swap between
    check and use is impossible.
    """
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RecordError("symlink refused") from None
        if e.errno == errno.ENOENT:
            raise RecordGone("removed while being read") from None
        raise RecordError(f"cannot open: {os.strerror(e.errno or 0)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecordError("not a regular file")
        me = os.geteuid() if as_uid is None else as_uid
        if me != 0 and st.st_uid != me:
            raise RecordError(f"owned by uid {st.st_uid}, not ours ({me})")
        if st.st_size < RECORD_SIZE:
            raise RecordError(f"truncated: {st.st_size} bytes, expected {RECORD_SIZE}")
        if st.st_size > RECORD_SIZE:
            raise RecordError(f"oversized: {st.st_size} bytes, expected {RECORD_SIZE}")
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def _read_seq(fd: int) -> int:
    raw = os.pread(fd, 8, _SEQ)
    if len(raw) != 8:
        raise RecordError("truncated while reading")
    return struct.unpack("<Q", raw)[0]


def _read_stable(fd: int) -> bytes:
    """The seqlock read: a copy taken between two equal, even sequence numbers."""
    for attempt in range(SEQLOCK_RETRIES):
        s1 = _read_seq(fd)
        if s1 % 2 == 0:
            data = os.pread(fd, RECORD_SIZE, 0)
            if len(data) != RECORD_SIZE:
                raise RecordError("truncated while reading")
            if _read_seq(fd) == s1:
                return data
        if attempt >= 10:
            time.sleep(0.0005)  # the writer holds the lock briefly; don't spin against it
    raise RecordError(f"torn: sequence lock never stable after {SEQLOCK_RETRIES} tries")


def _c_string(raw: bytes, what: str) -> str:
    end = raw.find(b"\0")
    if end < 0:
        raise RecordError(f"{what} not NUL-terminated")
    try:
        text = raw[:end].decode("utf-8")
    except UnicodeDecodeError:
        raise RecordError(f"{what} not valid UTF-8") from None
    if any(ord(c) < 0x20 for c in text):
        raise RecordError(f"{what} holds control characters")
    return text


def _validate(raw: bytes, path: str, st: os.stat_result) -> Record:
    """Checks every field; the first failure is the reason the record is skipped."""
    rec = RegistryRecord.from_buffer_copy(raw)
    if rec.magic != MAGIC:
        raise RecordError(f"wrong magic 0x{rec.magic:016x}")
    if rec.version != VERSION:
        raise RecordError(f"unsupported version {rec.version}")
    if rec.record_size != RECORD_SIZE:
        raise RecordError(f"record_size {rec.record_size}, expected {RECORD_SIZE}")
    if rec.seq % 2:
        raise RecordError("odd sequence number in a stable copy")
    if rec.pid <= 0:
        raise RecordError(f"pid {rec.pid} not positive")
    if rec.uid != st.st_uid:
        raise RecordError(f"uid {rec.uid} does not match file owner {st.st_uid}")
    m = _NAME.match(os.path.basename(path))
    if m is None:
        raise RecordError("file name is not pyalloc.<uid>.<pid>")
    if int(m.group(1)) != rec.uid or int(m.group(2)) != rec.pid:
        raise RecordError(f"file name does not match uid {rec.uid} / pid {rec.pid}")
    if rec.num_devices > MAX_DEVICES:
        raise RecordError(f"num_devices {rec.num_devices} > {MAX_DEVICES}")
    b_off, c_off = RegistryRecord.backend.offset, RegistryRecord.command.offset
    backend = _c_string(raw[b_off:b_off + BACKEND_LEN], "backend")
    if not backend or not re.fullmatch(r"[a-z0-9_-]+", backend):
        raise RecordError(f"backend {backend!r} is not a backend name")
    command = _c_string(raw[c_off:c_off + COMMAND_LEN], "command")
    if rec.heartbeat_unix_ns > time.time_ns() + HEARTBEAT_FUTURE_SLACK_NS:
        raise RecordError("heartbeat in the future")
    devices = []
    for i in range(rec.num_devices):
        d = rec.devices[i]
        names = [field[0] for field in RegistryDevice._fields_]
        counters = DeviceCounters(i, *(getattr(d, name) for name in names))
        for name in names:
            if name.endswith("_bytes") and getattr(d, name) > MAX_BYTES:
                raise RecordError(f"device {i}: {name} {getattr(d, name)} is not a size")
        for name in ("allocated_bytes", "active_bytes", "cached_free_bytes", "largest_free_bytes"):
            if getattr(d, name) > d.reserved_bytes:
                raise RecordError(f"device {i}: {name} {getattr(d, name)} > reserved {d.reserved_bytes}")
        if d.last_alloc_unix_ns > time.time_ns() + HEARTBEAT_FUTURE_SLACK_NS:
            raise RecordError(f"device {i}: last allocation in the future")
        devices.append(counters)
    return Record(
        path=path, pid=rec.pid, uid=rec.uid, start_time_ticks=rec.start_time_ticks,
        backend=backend, command=command, heartbeat_unix_ns=rec.heartbeat_unix_ns,
        flags=rec.flags, devices=tuple(devices), request_seq=rec.request_seq,
        response_seq=rec.response_seq, response_bytes=rec.response_bytes,
        requests_served=rec.requests_served,
    )


def read_record(path: Path | str, as_uid: int | None = None, check_process: bool = True) -> Record:
    """One validated record; raises :class:`RecordError` with the reason otherwise.

    ``as_uid`` decides ownership as that user would (default: our euid; root
    may read every user's record). With ``check_process`` (the default), a
    record of a running pid must describe that process as the kernel knows it
    (:func:`process_problem`); a record of a pid that is gone is returned as
    it is (liveness is the caller's question).
    """
    fd, st = _open_checked(path, writable=False, as_uid=as_uid)
    try:
        record = _validate(_read_stable(fd), str(path), st)
    finally:
        os.close(fd)
    if check_process:
        problem = process_problem(record)
        if problem is not None:
            raise RecordError(problem)
    return record


def _proc_uids(pid: int) -> tuple[int, int] | None:
    """Real and effective uid of ``pid`` from /proc/<pid>/status, or None."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("Uid:"):
                    fields = line.split()
                    return int(fields[1]), int(fields[2])
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_problem(record: Record) -> str | None:
    """Why ``record`` does not describe the running process ``record.pid``, or None.

    Note [Record identity]: anyone can write a file under /dev/shm that names
    any pid, and its owner is only the writer's uid. What a record says about
    a process is believed only when the kernel agrees: the pid runs, started
    at the record's start time (not a reused pid), and its real or effective
    uid is the record's uid, which is the file's owner (checked in _validate).
    A record of a pid that is not running is not judged here: the daemon
    removes it (:func:`remove_dead`) and acts on nothing it says.
    """
    ticks = proc_start_ticks(record.pid)
    if ticks is None:
        return None
    if record.start_time_ticks != ticks:
        return (f"pid {record.pid} started at tick {ticks}, not at the record's {record.start_time_ticks}: "
                f"the record is not this process's")
    return _owner_problem(record)


def _owner_problem(record: Record) -> str | None:
    """Why the running pid ``record.pid`` is not the record's uid's process, or None."""
    uids = _proc_uids(record.pid)
    if uids is None:
        return f"pid {record.pid}: its owner cannot be read from /proc"
    if record.uid not in uids:
        return f"pid {record.pid} belongs to uid {uids[0]}, not to the record's uid {record.uid} (a forged record)"
    return None


# At most this many registry files are read per scan (and per removal pass): a node runs a few
# hundred GPU processes at most, and a user who fills /dev/shm with files must not make each
# collection slower or the daemon bigger without bound.
MAX_RECORDS = 4096


@dataclass
class _Listing:
    paths: list[Path]
    ignored: int  # files named pyalloc.* that are not pyalloc.<uid>.<pid>
    over: int     # record-named files beyond MAX_RECORDS


def _list(directory: Path) -> _Listing:
    """The files named ``pyalloc.<uid>.<pid>``, by name, at most MAX_RECORDS; one pass of scandir,
    nothing else is stat'ed or opened."""
    paths: list[Path] = []
    ignored = over = 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if not entry.name.startswith(PREFIX):
                    continue
                if _NAME.match(entry.name) is None:
                    ignored += _UNPUBLISHED.match(entry.name) is None  # the library's own, mid-creation
                elif len(paths) < MAX_RECORDS:
                    paths.append(directory / entry.name)
                else:
                    over += 1
    except OSError:
        pass
    return _Listing(sorted(paths), ignored, over)


def scan(directory: Path | str | None = None, as_uid: int | None = None) -> Scan:
    """Every record of the directory, valid ones and the skipped ones with their reasons.

    Files named ``pyalloc.*`` that are not ``pyalloc.<uid>.<pid>``, and record files beyond
    :data:`MAX_RECORDS`, are not read: each kind is one skipped entry that counts them."""
    out = Scan()
    listing = _list(Path(directory or registry_dir()))
    if listing.ignored:
        out.skipped.append(Skipped(str(directory or registry_dir()),
                                   f"{listing.ignored} files named {PREFIX}* that are not {PREFIX}<uid>.<pid> ignored"))
    if listing.over:
        out.skipped.append(Skipped(str(directory or registry_dir()),
                                   f"{listing.over} more registry files not read (at most {MAX_RECORDS} per scan)"))
    for path in listing.paths:
        try:
            out.records.append(read_record(path, as_uid=as_uid))
        except RecordGone:
            pass  # its process exited while we listed: nothing to report
        except RecordError as e:
            out.skipped.append(Skipped(str(path), str(e)))
        except Exception as e:  # noqa: BLE001 - a hostile file must never stop the scan
            out.skipped.append(Skipped(str(path), f"unreadable: {type(e).__name__}: {e}"))
    return out


@dataclass(frozen=True)
class DirHealth:
    problem: str | None  # why pyalloc processes cannot publish records there; None: they can
    free_bytes: int | None  # space left for records (statvfs), None when unknown


def dir_health(directory: Path | str | None = None) -> DirHealth:
    """Whether pyalloc processes can publish records in ``directory``: a missing, read-only or
    full registry folder leaves every process unseen (the library then runs without a record),
    and the daemon is the one that can tell the operator."""
    where = Path(directory or registry_dir())
    try:
        st = os.stat(where)
    except OSError as e:
        return DirHealth(f"{where}: {os.strerror(e.errno or 0)}: no pyalloc process can publish a record there",
                         None)
    if not stat.S_ISDIR(st.st_mode):
        return DirHealth(f"{where}: not a directory", None)
    try:
        vfs = os.statvfs(where)
    except OSError:
        return DirHealth(None, None)
    free = vfs.f_bavail * vfs.f_frsize
    if vfs.f_flag & os.ST_RDONLY:
        return DirHealth(f"{where}: read-only file system: pyalloc processes cannot publish records", free)
    if st.st_mode & 0o222 == 0:
        return DirHealth(f"{where}: mode {stat.S_IMODE(st.st_mode):o} lets no one write: pyalloc processes "
                         f"cannot publish records", free)
    if free < RECORD_SIZE:
        return DirHealth(f"{where}: full ({free} bytes free, a record takes {RECORD_SIZE}): new pyalloc "
                         f"processes cannot publish records", free)
    return DirHealth(None, free)


# --- liveness -----------------------------------------------------------------------------

def proc_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = text[text.rfind(")") + 2:].split()
    try:
        return int(rest[19])  # rest[0] is field 3
    except (IndexError, ValueError):
        return None


def is_alive(pid: int, start_time_ticks: int | None) -> bool:
    """True while ``pid`` exists and (when known) started at ``start_time_ticks``: not reused."""
    ticks = proc_start_ticks(pid)
    if ticks is None:
        return False
    return start_time_ticks is None or start_time_ticks == 0 or ticks == start_time_ticks


# A record whose heartbeat is older than this, in a process that no longer
# has libpyalloc mapped, was left behind by an exec() (which runs no exit
# handler): the pid and its start time live on in the new program.
EXEC_ORPHAN_AGE_S = 30.0


def maps_pyalloc(pid: int) -> bool | None:
    """Whether ``pid`` has libpyalloc mapped; None when /proc/<pid>/maps can't be read."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            return any("libpyalloc" in line for line in f)
    except OSError:
        return None


def remove_dead(directory: Path | str | None = None, as_uid: int | None = None) -> list[Skipped]:
    """Removes the files of processes that are gone, whose pid was reused, or that exec'd.

    The pid comes from the validated record, or from the file name when the
    record is unreadable (a process killed mid-write leaves an odd seq).
    Only our own files are removed unless we are root. Returns what was
    removed, with the reason.
    """
    removed: list[Skipped] = []
    me = os.geteuid() if as_uid is None else as_uid
    for path in _list(Path(directory or registry_dir())).paths:
        pid = int(path.name.rsplit(".", 1)[1])  # _list kept only pyalloc.<uid>.<pid>
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if me != 0 and st.st_uid != me:
            continue
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            continue
        record: Record | None
        try:
            record = read_record(path, as_uid=as_uid, check_process=False)
        except RecordError:
            record = None
        ticks = proc_start_ticks(pid)  # read once: every verdict below is about this process
        started = record.start_time_ticks if record else 0
        forged = _owner_problem(record) if record is not None and ticks is not None else None
        if forged is not None:
            reason = forged
        elif ticks is not None and started in (0, ticks):  # is_alive(pid, started)
            if record is None or record.heartbeat_age_s() < EXEC_ORPHAN_AGE_S or maps_pyalloc(pid) is not False:
                continue
            reason = "the process no longer runs pyalloc (exec)"
        else:
            reason = "pid reused" if ticks is not None else "process gone"
        try:
            os.unlink(path)
            removed.append(Skipped(str(path), reason))
        except OSError:
            pass
    return removed


# --- mailbox --------------------------------------------------------------------------------

class MailboxTimeout(TimeoutError):
    """The process did not answer its mailbox in time (hung, stopped, or not serving it)."""


def post_trim(path: Path | str, device: int, nbytes: int = 0, timeout: float = 2.0,
              as_uid: int | None = None) -> int:
    """Asks the process owning ``path`` to release cached memory; returns the bytes it released.

    ``nbytes`` 0 means all of the device's cache. An flock serializes
    concurrent posters (the CLI and the daemon) so each waits for its own
    answer; the process itself never takes the lock.
    """
    if not 0 <= device < MAX_DEVICES:
        raise ValueError(f"device {device} out of range")
    if not 0 <= nbytes <= MAX_BYTES:
        raise ValueError(f"bytes {nbytes} out of range")
    read_record(path, as_uid=as_uid)  # validate before writing anything into it
    fd, _ = _open_checked(path, writable=True, as_uid=as_uid)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise MailboxTimeout("mailbox busy with another request") from None
                time.sleep(0.005)
        with mmap.mmap(fd, RECORD_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
            seq = struct.unpack_from("<Q", m, _REQUEST_SEQ)[0] + 1
            struct.pack_into("<I", m, _REQUEST_KIND, REQUEST_TRIM)
            struct.pack_into("<i", m, _REQUEST_DEVICE, device)
            struct.pack_into("<Q", m, _REQUEST_BYTES, nbytes)
            struct.pack_into("<Q", m, _REQUEST_SEQ, seq)  # published last: the process acts on it
            while time.monotonic() < deadline:
                if struct.unpack_from("<Q", m, _RESPONSE_SEQ)[0] == seq:
                    return int(struct.unpack_from("<Q", m, _RESPONSE_BYTES)[0])
                time.sleep(0.005)
            raise MailboxTimeout(f"no answer within {timeout:g}s")
    finally:
        os.close(fd)  # also drops the flock


# --- writer (tests and tools) ---------------------------------------------------------------

class RecordWriter:
    """A Python publisher of a registry record, following the library's seqlock protocol.

    Tests use it to give child processes known "GPU memory" without the
    library, and to write hostile records. ``serve(trim)`` answers the
    mailbox from a thread the way libpyalloc's registry thread does.
    """

    def __init__(self, path: Path | str, pid: int | None = None, backend: str = "host",
                 command: str | None = None, flags: int = 0) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.ftruncate(fd, RECORD_SIZE)
        self._map = mmap.mmap(fd, RECORD_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self.rec = RegistryRecord.from_buffer(self._map)
        pid = os.getpid() if pid is None else pid
        self.rec.magic = MAGIC
        self.rec.version = VERSION
        self.rec.record_size = RECORD_SIZE
        self.rec.pid = pid
        self.rec.uid = os.getuid()
        self.rec.start_time_ticks = proc_start_ticks(pid) or 0
        self.rec.backend = backend.encode()
        cmd = command if command is not None else " ".join(_cmdline(pid))
        # As the library writes it (node/registry.cpp): one printable line, an argument's
        # newlines (python -c) as spaces, cut on a whole UTF-8 character.
        cmd = "".join(" " if ord(c) < 0x20 or c == "\x7f" else c for c in cmd)
        self.rec.command = cmd.encode()[: COMMAND_LEN - 1].decode(errors="ignore").encode()
        self.rec.flags = flags
        self.rec.heartbeat_unix_ns = time.time_ns()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, device: int = 0, **counters: int) -> None:
        """Sets one device's counters under the sequence lock and refreshes the heartbeat."""
        with self._lock:
            self.rec.seq += 1
            if device >= self.rec.num_devices:
                self.rec.num_devices = device + 1
            for name, value in counters.items():
                setattr(self.rec.devices[device], name, value)
            self.rec.heartbeat_unix_ns = time.time_ns()
            self.rec.seq += 1

    def heartbeat(self) -> None:
        self._touch()

    def _touch(self) -> None:
        with self._lock:
            self.rec.seq += 1
            self.rec.heartbeat_unix_ns = time.time_ns()
            self.rec.seq += 1

    def serve(self, trim: Callable[[int, int], int], period: float = 0.02,
              heartbeat: bool = True) -> None:
        """Answers trim requests from a daemon thread: ``trim(device, nbytes) -> released``."""

        def loop() -> None:
            while not self._stop.wait(period):
                req = self.rec.request_seq
                if req != self.rec.response_seq:
                    released = 0
                    if self.rec.request_kind == REQUEST_TRIM:
                        released = trim(self.rec.request_device, self.rec.request_bytes)
                    with self._lock:
                        self.rec.seq += 1
                        self.rec.response_bytes = released
                        self.rec.requests_served += 1
                        self.rec.response_seq = req
                        self.rec.seq += 1
                if heartbeat:
                    self._touch()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def close(self, unlink: bool = True) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        del self.rec
        self._map.close()
        if unlink:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []
