"""Pressure coordination: a starving pyalloc process asks the daemon for bytes on a device.

Protocol: one JSON line in, one JSON line out, over a Unix socket.
Request ``{"device": 0, "bytes": 1073741824}``; answer ``{"ok": true,
"freed_bytes": N, "asked": [...]}``. The caller is identified by
SO_PEERCRED, not by anything it says: it must be root or a process with a
valid registry record of its own uid. The daemon then asks the other
opted-in pyalloc processes on the device to trim, largest cache first (the
oldest last allocation breaks ties), until the bytes are found.

No client can hang the daemon: each connection has its own thread, a read
deadline, and a bounded request size; each mailbox has its own timeout.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat as stat_module
import struct
import threading
import time
from pathlib import Path
from typing import Any

from . import registry
from .events import EventLog, silent

MAX_REQUEST_BYTES = 4096
IDLE_TIMEOUT_S = 2.0  # a connection that has not sent its whole request by then is closed
TRIM_TIMEOUT_S = 0.5
REQUEST_DEADLINE_S = 5.0
MAX_CONNECTIONS = 32  # connections served at once; more are closed at once (the socket is 0666)
MAX_PER_UID = 4  # of those, what one non-root uid may hold: its silent clients cannot starve the others
READ_TIMEOUT_S = IDLE_TIMEOUT_S  # the name earlier releases used


def default_socket_path() -> str:
    """Where this daemon listens: /run/gpumemd.sock as root (where every client looks first),
    else this user's runtime folder, else /tmp/gpumemd-<uid> (made 0700; see start())."""
    if os.geteuid() == 0:
        return "/run/gpumemd.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and runtime.startswith("/"):
        return os.path.join(runtime, "gpumemd.sock")
    return os.path.join(f"/tmp/gpumemd-{os.getuid()}", "gpumemd.sock")


def _own_closed_folder(folder: Path) -> None:
    """Makes ``folder`` (mode 0700) or checks that it is ours and closed to others: a folder
    another user made first (in /tmp anyone can) would let them replace our socket."""
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    me = os.geteuid()
    if not stat_module.S_ISDIR(st.st_mode) or st.st_uid not in (me, 0) or st.st_mode & 0o022:
        raise PermissionError(f"{folder} is not a folder of uid {me} closed to others (owner uid {st.st_uid}, "
                              f"mode {stat_module.S_IMODE(st.st_mode):o}): refusing to listen there")


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the connected peer, as the kernel saw it at connect()."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _read_line(conn: socket.socket, deadline: float) -> bytes:
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not received in time")
        conn.settimeout(left)
        chunk = conn.recv(MAX_REQUEST_BYTES + 1 - len(buf))
        if not chunk:
            break  # the client went away (or sent no newline before closing)
        buf += chunk
        if len(buf) > MAX_REQUEST_BYTES:
            raise ValueError("request too long")
    return buf.split(b"\n", 1)[0]


def _claim(path: str) -> int:
    """This daemon's claim on the socket path: an exclusive ``flock`` on ``<path>.lock``, held while
    it serves and let go by the kernel if it dies. Two daemons on one path (a second ``serve``
    took the first one's socket and removed it on exit: a review's finding; probing the socket
    instead left a window between another daemon's bind and listen) find out here."""
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FileExistsError(f"--socket {path}: another gpumemd serves there (stop it, or choose another "
                              "path)") from None
    return fd


def _clear_stale_socket(path: str) -> None:
    """With the claim held, a socket at ``path`` is a dead daemon's: removed. Anything else there is
    refused: a file that is not a socket is not ours to delete (a regular file given as --socket
    was deleted: a review's finding)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat_module.S_ISSOCK(st.st_mode):
        raise FileExistsError(f"--socket {path}: exists and is not a socket; not replaced (choose another path)")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class PressureServer:
    """The pressure socket. Connection handling no local user can starve (Note [Pressure slots]).

    Note [Pressure slots]: the socket is 0666, so any local user can connect as often as they
    like. Each connection is read by a thread of its own, so the number served at once is
    capped (``max_connections``); of those one non-root uid may hold ``max_per_uid``, and a
    connection that has not sent its request within ``idle_timeout_s`` is closed. A connection
    over either cap is closed at once, before anything is read: a user holding a thousand
    connections open keeps ``max_per_uid`` slots, and every other uid finds one free. Root's
    connections count against the total only (the library running as root is a trainer too).
    """

    def __init__(self, path: str, registry_dir: str | Path | None = None,
                 trim_timeout_s: float = TRIM_TIMEOUT_S, log: EventLog | None = None,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 max_per_uid: int = MAX_PER_UID) -> None:
        self.path = path
        self.registry_dir = registry_dir
        self.trim_timeout_s = trim_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_per_uid = max_per_uid
        self.log = log or silent()
        self._sock: socket.socket | None = None
        self._bound: int | None = None  # the inode of the socket this server bound
        self._claim: int | None = None  # the flock on <path>.lock (_claim)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._slots = threading.BoundedSemaphore(max_connections)
        self._per_uid: dict[int, int] = {}
        self._per_uid_lock = threading.Lock()
        self.handled = 0
        self.refused = 0

    def start(self) -> None:
        _own_closed_folder(Path(self.path).parent)
        self._claim = _claim(self.path)
        try:
            _clear_stale_socket(self.path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            sock.bind(self.path)
            sock.listen(64)
            self._bound = os.stat(self.path).st_ino  # stop() removes this socket, not a later one
            os.chmod(self.path, 0o666)  # anyone may ask; SO_PEERCRED decides who is answered
        except BaseException:
            os.close(self._claim)
            self._claim = None
            raise
        sock.settimeout(0.2)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="gpumemd-pressure", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        if self._sock:
            self._sock.close()
        try:
            if self._bound is not None and os.lstat(self.path).st_ino == self._bound:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._claim is not None:  # (the lock file stays: removing it would race a daemon starting)
            os.close(self._claim)
            self._claim = None

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError as e:  # out of descriptors (EMFILE) or memory: wait, do not spin
                self.log.limited("pressure-accept-error", e.errno, error=str(e))
                self._stop.wait(0.05)
                continue
            try:
                pid, uid, _gid = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            if not self._take_uid_slot(uid):
                self._refuse(conn, pid, uid, f"uid {uid} already holds {self.max_per_uid} connections")
                continue
            if not self._slots.acquire(blocking=False):
                self._give_uid_slot(uid)  # a flood of silent clients must not cost a thread each
                self._refuse(conn, pid, uid, "every connection slot is taken")
                continue
            threading.Thread(target=self._serve_slot, args=(conn, pid, uid), daemon=True).start()

    def _refuse(self, conn: socket.socket, pid: int, uid: int, reason: str) -> None:
        """Closes ``conn`` unread; one log line per uid per window however many are refused."""
        conn.close()
        self.refused += 1
        self.log.limited("pressure-refused", uid, peer_pid=pid, peer_uid=uid, reason=reason)

    def _take_uid_slot(self, uid: int) -> bool:
        if uid == 0:
            return True
        with self._per_uid_lock:
            if self._per_uid.get(uid, 0) >= self.max_per_uid:
                return False
            self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
            return True

    def _give_uid_slot(self, uid: int) -> None:
        if uid == 0:
            return
        with self._per_uid_lock:
            left = self._per_uid.get(uid, 0) - 1
            if left > 0:
                self._per_uid[uid] = left
            else:
                self._per_uid.pop(uid, None)

    def _serve_slot(self, conn: socket.socket, pid: int, uid: int) -> None:
        try:
            self._serve(conn, pid, uid)
        finally:
            self._slots.release()
            self._give_uid_slot(uid)

    def _serve(self, conn: socket.socket, pid: int, uid: int) -> None:
        with conn:
            try:
                answer, kind = self._handle(conn, pid, uid)
            except (TimeoutError, ValueError, OSError) as e:  # the peer's doing: too slow, too long, gone
                answer, kind = {"ok": False, "error": f"{type(e).__name__}: {e}"}, "pressure-client-error"
            except Exception as e:  # noqa: BLE001 - one bad client must not stop the server
                answer, kind = {"ok": False, "error": f"{type(e).__name__}: {e}"}, "pressure-error"
            self.handled += 1
            self._log_answer(kind, pid, uid, answer)
            try:
                conn.settimeout(self.idle_timeout_s)
                conn.sendall((json.dumps(answer) + "\n").encode())
            except OSError:
                pass  # the client died before the answer: nothing to do

    def _log_answer(self, kind: str, pid: int, uid: int, answer: dict[str, Any]) -> None:
        """A served request is logged each time (its trims changed other processes); a refusal
        or a client's error once per uid per window (a peer could repeat it without end)."""
        fields = {"peer_pid": pid, "peer_uid": uid}
        if kind == "pressure":
            self.log("pressure", **fields, device=answer["device"], requested_bytes=answer["requested_bytes"],
                     freed_bytes=answer["freed_bytes"], asked=answer["asked"])
        else:
            self.log.limited(kind, uid, **fields, error=answer["error"])

    def _handle(self, conn: socket.socket, pid: int, uid: int) -> tuple[dict[str, Any], str]:
        """The answer to one connection, and the kind of event it is for the log."""
        if uid != 0:
            path = registry.record_path(pid, uid, self.registry_dir)
            try:
                rec = registry.read_record(path)
            except registry.RecordError as e:
                return ({"ok": False, "error": f"peer pid {pid} uid {uid} has no valid registry record: {e}"},
                        "pressure-refused")
            if rec.uid != uid or not registry.is_alive(rec.pid, rec.start_time_ticks):
                return {"ok": False, "error": f"peer pid {pid} uid {uid} does not own its record"}, "pressure-refused"
        line = _read_line(conn, time.monotonic() + self.idle_timeout_s)
        try:
            req = json.loads(line)
            device, want = int(req["device"]), int(req["bytes"])
        except (ValueError, KeyError, TypeError, RecursionError):
            return ({"ok": False, "error": "request must be one JSON line {\"device\": d, \"bytes\": n}"},
                    "pressure-client-error")
        if not (0 <= device < registry.MAX_DEVICES and 0 < want <= registry.MAX_BYTES):
            return {"ok": False, "error": "device or bytes out of range"}, "pressure-client-error"
        return ({"ok": True, "requester": pid, "device": device, "requested_bytes": want,
                 **self.coordinate(pid, device, want)}, "pressure")

    def coordinate(self, requester: int, device: int, want: int) -> dict[str, Any]:
        """Asks opted-in processes to trim, largest idle cache first, until ``want`` is freed."""
        scan = registry.scan(self.registry_dir)
        candidates = []
        for rec in scan.records:
            if rec.pid == requester or not rec.pressure_opt_in or device >= len(rec.devices):
                continue
            d = rec.devices[device]
            if d.cached_free_bytes > 0 and registry.is_alive(rec.pid, rec.start_time_ticks):
                candidates.append((-d.cached_free_bytes, d.last_alloc_unix_ns, rec))
        candidates.sort(key=lambda c: (c[0], c[1]))
        freed = 0
        asked: list[dict[str, Any]] = []
        deadline = time.monotonic() + REQUEST_DEADLINE_S
        for _neg, _last, rec in candidates:
            if freed >= want or time.monotonic() > deadline:
                break
            try:
                got = registry.post_trim(rec.path, device, want - freed, timeout=self.trim_timeout_s)
                # A process answers for itself; it is credited at most the cache it advertised
                # before it was asked, so an answer of 2^60 bytes stops nobody else being asked.
                credited = min(got, rec.devices[device].cached_free_bytes)
                freed += credited
                entry: dict[str, Any] = {"pid": rec.pid, "released_bytes": credited}
                if got > credited:
                    entry["claimed_bytes"] = got
                asked.append(entry)
            except (registry.RecordError, registry.MailboxTimeout, OSError) as e:
                asked.append({"pid": rec.pid, "skipped": str(e)})
        return {"freed_bytes": freed, "asked": asked}


def request(path: str, device: int, nbytes: int, timeout: float = 10.0) -> dict[str, Any]:
    """Client side (what libpyalloc's step 4 does in C): ask for ``nbytes`` on ``device``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall((json.dumps({"device": device, "bytes": nbytes}) + "\n").encode())
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)
