"""psutil collector: who a process is, who its parent is, whether it is alive, how busy.

A :class:`ProcessSampler` keeps its psutil handles between samples so CPU %
is measured over the interval between two calls (psutil's first reading is
meaningless), and remembers each pid's first parent so a later reparenting
is seen as such.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

# Parents that adopt orphans besides PID 1 (PR_SET_CHILD_SUBREAPER): user systemd instances.
DEFAULT_SUBREAPERS = ("systemd",)


@dataclass
class ProcInfo:
    pid: int
    exists: bool
    user: str | None = None
    uid: int | None = None
    ppid: int | None = None
    parent_alive: bool | None = None
    parent_name: str | None = None
    status: str | None = None  # psutil status: running, sleeping, zombie, ...
    create_time: float | None = None
    command: str | None = None
    cpu_percent: float | None = None
    cpu_seconds: float | None = None  # user + system time since start
    sid: int | None = None
    pgid: int | None = None
    first_ppid: int | None = None  # parent when first seen by this sampler

    @property
    def zombie(self) -> bool:
        return self.status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)

    def orphan(self, subreapers: tuple[str, ...] = DEFAULT_SUBREAPERS) -> tuple[bool, str]:
        """Reparented (or its parent vanished), with the evidence.

        ppid 1 alone is not enough: systemd services and container entry
        points are legitimately children of init. A reparented process is
        one whose parent changed since we first saw it, or one adopted by
        init or a subreaper while not leading its own session and process
        group (a service calls setsid; a leftover DataLoader worker doesn't).
        """
        if not self.exists or self.zombie:
            return False, ""
        if self.first_ppid is not None and self.ppid != self.first_ppid:
            return True, f"parent changed from {self.first_ppid} to {self.ppid}"
        if self.parent_alive is False:
            return True, f"parent {self.ppid} is gone"
        adopted = self.ppid == 1 or (self.parent_name in subreapers)
        if adopted and self.sid != self.pid and self.pgid != self.pid:
            return True, (f"adopted by {self.parent_name or '?'} (pid {self.ppid}) and not a "
                          f"session or group leader (sid {self.sid}, pgid {self.pgid})")
        return False, ""


MIN_CPU_WINDOW_S = 0.01  # a shorter window measures the clock's tick, not the process


class ProcessSampler:
    def __init__(self) -> None:
        self._handles: dict[int, psutil.Process] = {}
        self._first_ppid: dict[tuple[int, float], int] = {}
        self._window_start: dict[int, float] = {}  # when each handle's CPU % window opened

    def _handle(self, pid: int) -> psutil.Process | None:
        h = self._handles.get(pid)
        try:
            if h is not None and h.is_running():
                return h
            h = psutil.Process(pid)
            h.cpu_percent(None)  # primes the CPU counter
            self._window_start[pid] = time.monotonic()
            self._handles[pid] = h
            return h
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            self._handles.pop(pid, None)
            return None

    def prime(self, pids: list[int]) -> None:
        for pid in pids:
            self._handle(pid)

    def sample(self, pids: list[int], wait: float = 0.0) -> dict[int, ProcInfo]:
        """Info on each pid; CPU % over ``wait`` seconds (or since the previous call)."""
        fresh = [p for p in pids if p not in self._handles]
        self.prime(fresh)
        if wait > 0 and fresh:
            time.sleep(wait)
        out = {pid: self._info(pid) for pid in pids}
        live = set(pids)
        for pid in list(self._handles):
            if pid not in live:
                del self._handles[pid]
                self._window_start.pop(pid, None)
        return out

    def _info(self, pid: int) -> ProcInfo:
        h = self._handle(pid)
        if h is None:
            return ProcInfo(pid, exists=False)
        info = ProcInfo(pid, exists=True)
        try:
            with h.oneshot():
                info.status = h.status()
                info.create_time = h.create_time()
                info.ppid = h.ppid()
                info.uid = h.uids().real
                try:
                    info.user = h.username()
                except (KeyError, psutil.Error):
                    info.user = str(info.uid)
                try:
                    info.command = " ".join(h.cmdline()) or f"[{h.name()}]"
                except psutil.Error:
                    info.command = None
                try:
                    # psutil reads 0.0 over a window of no time: a process primed or read a
                    # moment ago (--cpu-sample 0, a pid just reused) has no CPU % yet (shown
                    # ?), not an idle one.
                    now = time.monotonic()
                    if now - self._window_start.get(pid, 0.0) >= MIN_CPU_WINDOW_S:
                        info.cpu_percent = h.cpu_percent(None)  # over the window; opens the next
                        self._window_start[pid] = now
                    times = h.cpu_times()
                    info.cpu_seconds = times.user + times.system
                except psutil.Error:
                    info.cpu_percent = None
        except psutil.NoSuchProcess:
            return ProcInfo(pid, exists=False)
        except psutil.AccessDenied:
            pass
        try:
            info.sid = os.getsid(pid)
            info.pgid = os.getpgid(pid)
        except OSError:
            pass
        if info.ppid is not None:
            key = (pid, info.create_time or 0.0)
            info.first_ppid = self._first_ppid.setdefault(key, info.ppid)
            try:
                parent = psutil.Process(info.ppid) if info.ppid > 0 else None
                info.parent_alive = parent is not None or info.ppid == 0
                info.parent_name = parent.name() if parent else None
            except psutil.NoSuchProcess:
                info.parent_alive = False
            except psutil.Error:
                info.parent_alive = True
        return info
