"""The reaper: finds processes that hold GPU memory for nothing and, when enforcing, ends them.

Policy (TOML, see docs/deployment.md), one table per criterion, each with
``enabled`` and thresholds:

- ``zombie``: a defunct process still charged GPU memory. Signals can't kill
  a zombie (it is already dead; only its parent's wait() removes it), so
  the decision is a report unless ``signal_parent`` names a signal to send
  the parent ("SIGCHLD" to nudge it to wait, "SIGTERM" to end it so init
  adopts and reaps the zombie).
- ``orphan``: reparented to init or a subreaper while holding GPU memory.
- ``idle``: no SM activity and CPU under ``cpu_percent`` for ``window``,
  holding more than ``min_bytes``.
- ``stale_heartbeat``: a pyalloc record whose heartbeat is older than
  ``window``: report only unless ``action = "kill"``.
- ``no_proc``: NVML lists a pid with no process in /proc: always a report.

Never touched: PID 1, the daemon and its ancestors, uids under
``protect.min_uid`` (system daemons), listed pids/users/command patterns,
and other users' processes unless running as root with the user named in
``protect.allow_other_users`` (a list of user names or uids; ``true`` means
every user at or above ``min_uid``). Every decision, dry run or not, is one
JSON line in the audit log with its evidence.

Note [Signal only who was judged]: between the decision and the signal, the
process may exit and its pid go to a newcomer. Right before each signal the
reaper opens a pidfd for the pid (which pins that very process), then checks
through /proc that it is the judged one: same start time, same uid. Only then
is the signal sent, through the pidfd, after the audit line that announces it
has been written and fsynced: the log says what was done even if the daemon
dies the next instant.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import stat
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, maintained outside the standard library
    import tomli as tomllib

from .model import ProcessRow, Snapshot
from .units import parse_duration, parse_size


@dataclass
class Criterion:
    enabled: bool
    min_bytes: int = 0
    window_s: float = 0.0
    cpu_percent: float = 1.0
    action: str = "kill"  # "kill" or "report"
    signal_parent: str | None = None


@dataclass
class Policy:
    zombie: Criterion = field(default_factory=lambda: Criterion(True, action="report"))
    orphan: Criterion = field(default_factory=lambda: Criterion(True, min_bytes=1))
    idle: Criterion = field(default_factory=lambda: Criterion(False, 1 << 30, 3600.0))
    stale_heartbeat: Criterion = field(default_factory=lambda: Criterion(True, 0, 300.0, action="report"))
    no_proc: Criterion = field(default_factory=lambda: Criterion(True, action="report"))
    grace_s: float = 10.0
    cpu_sample_s: float = 1.0
    min_uid: int = 1000
    protected_pids: list[int] = field(default_factory=list)
    protected_users: list[str] = field(default_factory=list)
    protected_commands: list[str] = field(default_factory=list)
    allow_other_users: bool = False  # every other user (at or above min_uid); see other_users
    other_users: list[str] = field(default_factory=list)  # user names or uids that may be signalled
    subreapers: list[str] = field(default_factory=lambda: ["systemd"])
    audit_log: str | None = None

    @classmethod
    def load(cls, path: str | Path | None) -> "Policy":
        if path is None:
            return cls()
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # (a FIFO or a device: a read that never ends)
                raise ValueError("not a regular file")
            with open(path, "rb") as f:
                return cls.from_dict(tomllib.load(f))
        except OSError as e:
            raise ValueError(f"policy {path}: {e.strerror or e}") from None
        except (ValueError, TypeError, re.error) as e:  # TOMLDecodeError is a ValueError
            raise ValueError(f"policy {path}: {e}") from None

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "Policy":
        """The policy a parsed TOML document describes. Every key is checked for its name, type and
        range (ValueError naming the key): a typo or a wrong type must never turn a rule on or
        leave a process unprotected, as ``bool("false")`` or a string read as a list would."""
        p = cls()
        _known(doc, "", {"zombie", "orphan", "idle", "stale_heartbeat", "no_proc", "protect",
                         "grace_period", "cpu_sample", "audit_log", "subreapers"})
        for name in ("zombie", "orphan", "idle", "stale_heartbeat", "no_proc"):
            table = _table(doc, name)
            _known(table, name + ".", {"enabled", "min_bytes", "window", "cpu_percent", "action", "signal_parent"})
            c: Criterion = getattr(p, name)
            if "enabled" in table:
                c.enabled = _bool(table, "enabled", name)
            if "min_bytes" in table:
                c.min_bytes = _size(table, "min_bytes", name)
            if "window" in table:
                c.window_s = _duration(table, "window", name)
            if "cpu_percent" in table:
                c.cpu_percent = _number(table, "cpu_percent", name, 0.0, 100.0)
            if "action" in table:
                if table["action"] not in ("kill", "report"):
                    raise ValueError(f"{name}.action must be kill or report")
                c.action = table["action"]
            if "signal_parent" in table:
                value = table["signal_parent"]
                if value is not False and value not in ("SIGCHLD", "SIGTERM"):
                    raise ValueError(f"{name}.signal_parent must be false, SIGCHLD or SIGTERM")
                c.signal_parent = value or None
        p.zombie.action = "report"  # see the module docstring: signals can't kill zombies
        p.no_proc.action = "report"
        if "grace_period" in doc:
            p.grace_s = _duration(doc, "grace_period", "")
        if "cpu_sample" in doc:
            p.cpu_sample_s = _duration(doc, "cpu_sample", "")
        if "audit_log" in doc:
            if not isinstance(doc["audit_log"], str) or not doc["audit_log"]:
                raise ValueError("audit_log must be a path (a non-empty string)")
            p.audit_log = doc["audit_log"]
        if "subreapers" in doc:
            p.subreapers = _strings(doc, "subreapers", "")
        prot = _table(doc, "protect")
        _known(prot, "protect.", {"min_uid", "pids", "users", "commands", "allow_other_users"})
        if "min_uid" in prot:
            p.min_uid = _integer(prot, "min_uid", "protect")
        p.protected_pids = [_pid(x) for x in _list(prot, "pids", "protect")]
        p.protected_users = [str(x) for x in _list(prot, "users", "protect", (str, int))]
        p.protected_commands = _strings(prot, "commands", "protect")
        for pattern in p.protected_commands:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"protect.commands: {pattern!r} is not a regular expression ({e})") from None
        others = prot.get("allow_other_users", False)
        if isinstance(others, bool):
            p.allow_other_users = others
        elif isinstance(others, list) and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in others):
            p.other_users = [str(x) for x in others]
        else:
            raise ValueError("protect.allow_other_users must be a list of user names or uids (or true for all)")
        return p


# ---- checked reading of the policy's values (each error names the key) ---------------------


def _key(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _known(table: dict[str, Any], prefix: str, known: set[str]) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"unknown key {prefix}{unknown[0]} (known: {', '.join(sorted(known))})")


def _table(doc: dict[str, Any], name: str) -> dict[str, Any]:
    table = doc.get(name, {})
    if not isinstance(table, dict):
        raise ValueError(f"{name} must be a table ([{name}]), not {type(table).__name__} {table!r}")
    return table


def _bool(table: dict[str, Any], key: str, section: str) -> bool:
    value = table[key]
    if not isinstance(value, bool):
        raise ValueError(f"{_key(section, key)} must be true or false, not {value!r}")
    return value


def _integer(table: dict[str, Any], key: str, section: str) -> int:
    value = table[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{_key(section, key)} must be a whole number >= 0, not {value!r}")
    return value


def _number(table: dict[str, Any], key: str, section: str, lo: float, hi: float) -> float:
    value = table[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{_key(section, key)} must be a number from {lo:g} to {hi:g}, not {value!r}")
    return float(value)


def _size(table: dict[str, Any], key: str, section: str) -> int:
    value = table[key]
    try:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"not a size: {value!r}")
        n = parse_size(value)
    except ValueError as e:
        raise ValueError(f"{_key(section, key)}: {e}") from None
    if n < 0:
        raise ValueError(f"{_key(section, key)} must be a size >= 0, not {value!r}")
    return n


def _duration(table: dict[str, Any], key: str, section: str) -> float:
    value = table[key]
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"not a duration: {value!r}")
        seconds = parse_duration(value)
    except ValueError as e:
        raise ValueError(f"{_key(section, key)}: {e}") from None
    if not seconds >= 0:
        raise ValueError(f"{_key(section, key)} must be a duration >= 0, not {value!r}")
    return seconds


def _list(table: dict[str, Any], key: str, section: str, types: tuple[type, ...] = (int,)) -> list[Any]:
    """A list whose items are of ``types`` (booleans never count as numbers): a string given
    where a list is meant is an error, not a list of its characters."""
    value = table.get(key, [])
    names = " or ".join(t.__name__ for t in types)
    if not isinstance(value, list) or not all(isinstance(x, types) and not isinstance(x, bool) for x in value):
        raise ValueError(f"{_key(section, key)} must be a list of {names} (e.g. [...]), not {value!r}")
    return value


def _strings(table: dict[str, Any], key: str, section: str) -> list[str]:
    return [str(x) for x in _list(table, key, section, (str,))]


def _pid(value: int) -> int:
    if value <= 0:
        raise ValueError(f"protect.pids: {value} is not a process id")
    return value


def default_audit_log() -> Path:
    if os.geteuid() == 0:
        return Path("/var/log/gpumemd/audit.jsonl")
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(state) / "gpumemd" / "audit.jsonl"


@dataclass
class Decision:
    time: float
    pid: int
    criterion: str
    action: str  # "kill", "report", "signal-parent", "protected"
    dry_run: bool
    evidence: dict[str, Any]
    protected_reason: str | None = None
    result: str | None = None


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1:
        out.add(pid)
        try:
            pid = psutil.Process(pid).ppid()
        except psutil.Error:
            break
    return out


def protected_reason(pid: int, uid: int | None, user: str | None, command: str | None,
                     policy: Policy) -> str | None:
    """Why ``pid`` must not be signalled, or None."""
    if pid <= 1:
        return "PID 1"
    if pid in _ancestors():
        return "gpumemd itself or its ancestor"
    if pid in policy.protected_pids:
        return "listed in protect.pids"
    if uid is None:
        return "owner unknown"
    if uid < policy.min_uid:
        return f"system uid {uid} < protect.min_uid {policy.min_uid}"
    me = os.geteuid()
    if uid != me:
        if me != 0:
            return f"another user's process (uid {uid}): only root signals other users"
        named = str(uid) in policy.other_users or (user is not None and user in policy.other_users)
        if not (policy.allow_other_users or named):
            return f"another user's process (uid {uid}) not named in protect.allow_other_users"
    if user is not None and user in policy.protected_users:
        return f"user {user} listed in protect.users"
    for pattern in policy.protected_commands:
        if command and re.search(pattern, command):
            return f"command matches protect.commands {pattern!r}"
    return None


def _held_bytes(rows: list[ProcessRow]) -> int:
    """GPU bytes the process holds: NVML's count where known, else the allocator's reserve."""
    total = 0
    for r in rows:
        if r.used_bytes is not None:
            total += r.used_bytes
        elif r.allocator is not None:
            total += r.allocator.reserved_bytes
    return total


def _evidence(rows: list[ProcessRow], now: float) -> dict[str, Any]:
    r = rows[0]
    return {
        "user": r.user, "uid": r.uid, "command": r.command, "status": r.status, "ppid": r.ppid,
        "start_time": r.start_time, "cpu_percent": r.cpu_percent,
        "held_bytes": _held_bytes(rows),
        "devices": [{"device": x.device, "uuid": x.uuid, "used_bytes": x.used_bytes, "sm_util": x.sm_util,
                     "allocator": asdict(x.allocator) if x.allocator else None} for x in rows],
        "flags": asdict(r.flags),
        # Which registry files (and owners) the decision read, if any: Note [Record identity].
        "records": sorted({(x.allocator.record_path, x.allocator.record_uid) for x in rows if x.allocator}),
        "idle_s": None if r.flags.idle_since is None else round(now - r.flags.idle_since, 1),
    }


def decide(snap: Snapshot, policy: Policy, dry_run: bool) -> list[Decision]:
    """Which processes match which criterion (the first that matches), with evidence."""
    by_pid: dict[int, list[ProcessRow]] = {}
    for row in snap.processes:
        by_pid.setdefault(row.pid, []).append(row)
    out: list[Decision] = []
    now = snap.time
    for pid, rows in sorted(by_pid.items()):
        r = rows[0]
        held = _held_bytes(rows)
        ev = _evidence(rows, now)
        match: tuple[str, Criterion] | None = None
        if r.flags.no_proc and policy.no_proc.enabled:
            match = ("no_proc", policy.no_proc)
        elif r.flags.zombie and policy.zombie.enabled and held > policy.zombie.min_bytes - 1 and held > 0:
            match = ("zombie", policy.zombie)
        elif r.flags.orphan and policy.orphan.enabled and held >= max(1, policy.orphan.min_bytes):
            ev["orphan_evidence"] = r.flags.orphan_evidence
            match = ("orphan", policy.orphan)
        elif (policy.idle.enabled and r.flags.idle_since is not None
              and now - r.flags.idle_since >= policy.idle.window_s
              and (r.cpu_percent is not None and r.cpu_percent < policy.idle.cpu_percent)
              and held > policy.idle.min_bytes):
            match = ("idle", policy.idle)
        elif (policy.stale_heartbeat.enabled and any(
                x.allocator is not None and x.allocator.heartbeat_age_s >= policy.stale_heartbeat.window_s
                for x in rows)):
            match = ("stale_heartbeat", policy.stale_heartbeat)
        if match is None:
            continue
        name, crit = match
        action = crit.action
        if name == "zombie" and crit.signal_parent:
            action = "signal-parent"
        target = r.ppid if action == "signal-parent" else pid
        reason = None
        if action != "report":
            if action == "signal-parent" and target is not None:
                try:
                    pp = psutil.Process(target)
                    ev["parent_start_time"], ev["parent_uid"] = pp.create_time(), pp.uids().real
                    reason = protected_reason(target, pp.uids().real, pp.username(),
                                              " ".join(pp.cmdline()), policy)
                except psutil.Error:
                    reason = "parent gone"
            else:
                reason = protected_reason(pid, r.uid, r.user, r.command, policy)
            if reason:
                action = "protected"
        ev["criterion_thresholds"] = asdict(crit)
        out.append(Decision(now, pid, name, action, dry_run, ev, reason))
    return out


def _verify_and_open(pid: int, start_time: float | None, uid: int | None) -> tuple[int | None, str]:
    """A pidfd for ``pid`` if it is still the process that was judged (Note [Signal only who was
    judged]): opened first, so the checks that follow are about the process the pidfd pins."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None, "gone before signalling"
    try:
        proc = psutil.Process(pid)
        if start_time is None or abs(proc.create_time() - start_time) > 0.01:
            problem = "pid reused before signalling (start time differs)" if start_time is not None \
                else "start time unknown: identity cannot be checked"
        elif uid is None or uid not in (proc.uids().real, proc.uids().effective):
            problem = f"pid reused before signalling (uid {proc.uids().real}, judged {uid})"
        else:
            return fd, ""
    except psutil.Error:
        problem = "gone before signalling"
    os.close(fd)
    return None, problem


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class AuditLog:
    """The audit file, opened once per pass; every line is written whole (O_APPEND). A line that
    announces a signal is fsynced before ``write`` returns, so it is on disk before the signal;
    the other lines of an enforcing pass are fsynced together when the log is closed."""

    def __init__(self, path: str | Path, sync_at_close: bool = False) -> None:
        path = Path(path)
        self.sync_at_close = sync_at_close
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # O_NOFOLLOW: a symlink planted at the configured path (by anyone who can write its
            # folder) must not make root append to a file of the planter's choice.
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            refused = " (a symlink is refused)" if e.errno == errno.ELOOP else ""
            raise OSError(e.errno, f"audit log {path}: {e.strerror}{refused}") from None

    def write(self, d: Decision, **extra: Any) -> None:
        os.write(self.fd, (json.dumps({**asdict(d), **extra}, default=str) + "\n").encode())
        if extra.get("phase") == "signalling":
            os.fsync(self.fd)

    def close(self) -> None:
        try:
            if self.sync_at_close:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


def _target(d: Decision) -> tuple[int, float | None, int | None, signal.Signals] | None:
    """Whom ``d`` signals, with the identity judged (start time, uid), and with which signal."""
    ev = d.evidence
    if d.action == "kill":
        return d.pid, ev.get("start_time"), ev.get("uid"), signal.SIGTERM
    if d.action == "signal-parent":
        sig = signal.SIGCHLD if ev["criterion_thresholds"]["signal_parent"] == "SIGCHLD" else signal.SIGTERM
        return ev["ppid"], ev.get("parent_start_time"), ev.get("parent_uid"), sig
    return None


def enforce(decisions: list[Decision], grace_s: float, log: AuditLog | None = None) -> None:
    """SIGTERM every target, wait up to ``grace_s`` for all, SIGKILL the rest; results in place.
    Each signal is preceded by its audit line (``phase: "signalling"``) when ``log`` is given."""
    pending: dict[int, tuple[Decision, int]] = {}
    for d in decisions:
        target = _target(d)
        if target is None:
            continue
        pid, start, uid, sig = target
        fd, problem = _verify_and_open(pid, start, uid)
        if fd is None:
            d.result = problem
            continue
        try:
            if log is not None:
                log.write(d, phase="signalling", signal=sig.name, target=pid)
            signal.pidfd_send_signal(fd, sig)
            d.result = f"sent {sig.name} to {pid}"
            if sig == signal.SIGTERM:
                pending[pid] = (d, fd)
                continue
        except OSError as e:
            d.result = f"signal failed: {e}"
        os.close(fd)
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        for gone in [t for t in pending if _gone(t)]:
            d, fd = pending.pop(gone)
            d.result = "SIGTERM: exited"
            os.close(fd)
        time.sleep(0.05)
    for pid, (d, fd) in pending.items():
        try:
            if log is not None:
                log.write(d, phase="signalling", signal="SIGKILL", target=pid)
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            d.result = f"SIGTERM ignored for {grace_s:g}s: SIGKILL sent"
        except OSError as e:
            d.result = f"SIGKILL failed: {e}"
        os.close(fd)


def audit(decisions: list[Decision], path: str | Path) -> None:
    """Appends one JSON line a decision, fsynced."""
    log = AuditLog(path, sync_at_close=True)
    try:
        for d in decisions:
            log.write(d)
    finally:
        log.close()


def audit_log_path(policy: Policy, audit_log: str | Path | None) -> Path:
    """Where the reaper's decisions go: ``audit_log`` (the command line's), the policy's, or the
    default."""
    return Path(audit_log or policy.audit_log or default_audit_log())


def check_audit_log(policy: Policy, audit_log: str | Path | None) -> None:
    """Opens the audit log once, so that a path it cannot be written to is an error before the
    reaper's first pass rather than a failure in every pass (a daemon up with no metrics)."""
    AuditLog(audit_log_path(policy, audit_log)).close()


def reap_once(snap: Snapshot, policy: Policy, enforce_: bool, audit_log: str | Path | None) -> list[Decision]:
    decisions = decide(snap, policy, dry_run=not enforce_)
    log = AuditLog(audit_log_path(policy, audit_log), sync_at_close=enforce_)
    try:
        if enforce_:
            enforce(decisions, policy.grace_s, log)
        for d in decisions:
            if d.result is None:
                d.result = "dry run" if d.action not in ("report", "protected") else d.action
            log.write(d, phase="done")
    finally:
        log.close()
    return decisions
