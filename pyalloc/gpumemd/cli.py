"""`gpumemd`: status, top, serve, reap, trim. Exits non-zero with a one-line reason on failure."""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import json
import os
import shutil
import signal
import sys
import textwrap
import threading
import time
from dataclasses import asdict
from typing import Any, NoReturn

from . import registry
from . import reaper
from .events import EventLog
from .model import Collector
from .table import render
from .units import format_bytes, parse_duration, parse_size


class CliError(Exception):
    pass


# The --audit-log help of serve and reap, after "where each [reaper] decision is ".
_AUDIT_LOG_HELP = ("appended as one JSON line, fsynced before any signal (default: the policy's audit_log, "
                   "else /var/log/gpumemd/audit.jsonl as root, ~/.local/state/gpumemd/audit.jsonl otherwise)")


def _collector(args: argparse.Namespace, **kw: Any) -> Collector:
    return Collector(registry_dir=args.registry_dir, use_nvml=not args.no_nvml, **kw)


def _version() -> str:
    try:
        return importlib.metadata.version("pyalloc")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _warn_registry(snap: Any) -> None:
    """A registry folder that is missing, read-only or full hides every pyalloc process: say so
    on stderr instead of showing an empty table as if there were none."""
    if snap.registry_problem:
        print(f"gpumemd: warning: registry {snap.registry_problem}", file=sys.stderr)


def cmd_status(args: argparse.Namespace) -> int:
    snap = _collector(args).collect(cpu_sample_s=args.cpu_sample)
    _warn_registry(snap)
    if args.json:
        print(json.dumps(snap.to_json(), indent=2))
    else:
        width = shutil.get_terminal_size((100, 24)).columns if sys.stdout.isatty() else 100
        print(render(snap, width=None if args.wide else width))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise CliError("top needs a terminal on stdin and stdout; for a file or a pipe use "
                       "`gpumemd status` (or `status --json`)")
    import curses

    collector = _collector(args)

    def loop(scr: Any) -> None:
        try:
            curses.curs_set(0)
        except curses.error:
            pass  # a terminal that cannot hide the cursor
        scr.timeout(100)
        next_at = 0.0
        while True:
            if time.monotonic() >= next_at:
                snap = collector.collect()
                h, w = scr.getmaxyx()
                scr.erase()
                for y, line in enumerate(render(snap, width=max(20, w - 1)).splitlines()[: h - 1]):
                    scr.addnstr(y, 0, line, w - 1)
                scr.addnstr(h - 1, 0, "q: quit", w - 1, curses.A_REVERSE)
                scr.refresh()
                next_at = time.monotonic() + args.interval
            if scr.getch() in (ord("q"), ord("Q"), 27):
                return

    try:
        curses.wrapper(loop)
    except curses.error as e:
        raise CliError(f"top: cannot draw on this terminal ({e}); TERM={os.environ.get('TERM', '')!r}") from None
    return 0


def _print_decisions(decisions: list[reaper.Decision], as_json: bool) -> None:
    if as_json:
        print(json.dumps([asdict(d) for d in decisions], indent=2, default=str))
        return
    if not decisions:
        print("reap: nothing to do")
    for d in decisions:
        ev = d.evidence
        why = d.protected_reason or d.result or ""
        print(f"{'DRY RUN ' if d.dry_run else ''}{d.action:<13} pid {d.pid:<7} {d.criterion:<15} "
              f"held {format_bytes(ev['held_bytes']):>9} cpu {'?' if ev['cpu_percent'] is None else ev['cpu_percent']}% "
              f"idle {'-' if ev['idle_s'] is None else str(ev['idle_s']) + 's'} "
              f"status {ev['status']} ppid {ev['ppid']}  [{why}]  {(ev['command'] or '')[:60]}")


def _check_audit_log(policy: reaper.Policy, audit_log: str | None) -> None:
    """Refuses an audit log that cannot be written, naming where its path came from."""
    try:
        reaper.check_audit_log(policy, audit_log)
    except OSError as e:
        where = "--audit-log" if audit_log else "the policy's audit_log" if policy.audit_log else "the default audit log"
        raise CliError(f"{where} {reaper.audit_log_path(policy, audit_log)}: {os.strerror(e.errno or 0)}") from None


def cmd_reap(args: argparse.Namespace) -> int:
    policy = reaper.Policy.load(args.policy)
    _check_audit_log(policy, args.audit_log)
    collector = _collector(args, subreapers=tuple(policy.subreapers),
                           idle_cpu_percent=policy.idle.cpu_percent)
    snap = collector.collect(cpu_sample_s=policy.cpu_sample_s)
    decisions = reaper.reap_once(snap, policy, args.enforce, args.audit_log)
    _print_decisions(decisions, args.json)
    return 0


def cmd_trim(args: argparse.Namespace) -> int:
    nbytes = 0  # all of the device's cache
    if args.bytes is not None:  # checked first: a bad value is the same mistake whatever the pid
        try:
            nbytes = parse_size(args.bytes)
        except ValueError as e:
            raise CliError(f"--bytes: {e}") from None
        if nbytes <= 0:
            raise CliError(f"--bytes {args.bytes}: nothing to release (leave --bytes out to release the whole cache)")
    path = registry.find_record_path(args.pid, args.registry_dir)
    if path is None:
        raise CliError(f"pid {args.pid} has no pyalloc registry record")
    try:
        devices = len(registry.read_record(path).devices)
        if not 0 <= args.device < devices:
            raise CliError(f"--device {args.device}: pid {args.pid} has {devices} device(s): 0 to {devices - 1}")
        released = registry.post_trim(path, args.device, nbytes, timeout=args.timeout)
    except registry.RecordError as e:
        raise CliError(f"{path}: {e}") from None
    except registry.MailboxTimeout as e:
        raise CliError(f"pid {args.pid}: {e}") from None
    if args.json:
        print(json.dumps({"pid": args.pid, "device": args.device, "released_bytes": released}))
    else:
        print(f"pid {args.pid} device {args.device}: released {released} bytes ({format_bytes(released)})")
    return 0


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` (loopback) or ``[V6]:PORT`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:9877, [::1]:9877, or :9877 for loopback)")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration of at most a year (e.g. 500ms, 2s, "
                                         "1m)") from None


def _period(text: str) -> float:
    """A duration that paces a loop or a wait: zero would spin or close everything at once."""
    seconds = _duration(text)
    if seconds < 0.01:
        raise argparse.ArgumentTypeError(f"{text!r} is too short: at least 10ms")
    return seconds


def _listen(state: Any, host: str, port: int, show_commands: bool, log: EventLog) -> Any:
    from .metrics import make_server

    try:
        return make_server(state, host, port, show_commands=show_commands, log=log)
    except OSError as e:
        hint = " (another gpumemd? choose another with --listen)" if e.errno == errno.EADDRINUSE else ""
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None


class _ChangeLog:
    """Logs what a collection pass found that the previous one did not: a removed record, a newly
    skipped file, a device that stopped answering, a registry folder that became unusable, a
    reaper decision. A state that lasts is one line when it starts, not one a pass."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self._seen: dict[str, set[Any]] = {}

    def _new(self, kind: str, keys: set[Any]) -> set[Any]:
        before = self._seen.get(kind, set())
        self._seen[kind] = keys
        return keys - before

    def snapshot(self, snap: Any) -> None:
        for r in snap.removed_records:
            self.log("record-removed", path=r.path, reason=r.reason)
        skipped = {(s.path, s.reason) for s in snap.skipped_records}
        for path, reason in sorted(self._new("skipped", skipped)):
            self.log("record-skipped", path=path, reason=reason)
        was_lost = {device for device, _uuid, _error in self._seen.get("lost", set())}
        lost = {(d.device, d.uuid, d.error) for d in snap.devices if d.error}
        for device, uuid, error in sorted(self._new("lost", lost), key=str):
            self.log("device-lost", device=device, uuid=uuid, error=error)
        for device in sorted(was_lost - {device for device, _uuid, _error in lost}):
            self.log("device-back", device=device)
        problem = {snap.registry_problem} if snap.registry_problem else set()
        for p in self._new("registry", problem):
            self.log("registry-problem", dir=snap.registry_dir, problem=p)

    def decisions(self, decisions: list[reaper.Decision]) -> None:
        keys = {(d.pid, d.criterion, d.action, d.dry_run) for d in decisions}
        fresh = self._new("reap", keys)
        for d in decisions:
            acted = not d.dry_run and d.action in ("kill", "signal-parent")
            if (d.pid, d.criterion, d.action, d.dry_run) in fresh or acted:
                self.log("reaper-decision", pid=d.pid, criterion=d.criterion, action=d.action, dry_run=d.dry_run,
                         result=d.result, protected_reason=d.protected_reason,
                         user=d.evidence.get("user"), held_bytes=d.evidence.get("held_bytes"))


def cmd_serve(args: argparse.Namespace) -> int:
    from .metrics import State
    from .pressure import PressureServer, default_socket_path

    if args.enforce and not args.policy:
        raise CliError("serve --enforce: the reaper runs only with --policy FILE (without it there is nothing "
                       "to enforce)")
    log = EventLog()
    host, port = args.listen
    policy = reaper.Policy.load(args.policy) if args.policy else None
    if policy is not None:
        _check_audit_log(policy, args.audit_log)
    collector = _collector(args, subreapers=tuple(policy.subreapers) if policy else ("systemd",),
                           **({"idle_cpu_percent": policy.idle.cpu_percent} if policy else {}))
    state = State()
    server = _listen(state, host, port, args.show_commands, log)
    pressure = None
    if args.socket != "none":
        pressure = PressureServer(args.socket or default_socket_path(), args.registry_dir, log=log,
                                  idle_timeout_s=args.idle_timeout, max_per_uid=args.max_per_uid)
        try:
            pressure.start()
        except OSError as e:
            server.server_close()
            raise CliError(f"--socket {pressure.path}: {e.strerror or e}") from None
    threading.Thread(target=server.serve_forever, name="gpumemd-http", daemon=True).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address is bracketed in a URL
    log("listening", metrics=f"http://{shown}:{server.server_address[1]}/metrics",
        socket=pressure.path if pressure else None, registry_dir=str(args.registry_dir or registry.registry_dir()),
        interval_s=args.interval, policy=args.policy, enforce=args.enforce)
    changes = _ChangeLog(log)
    while not stop.is_set():
        start = time.perf_counter()
        try:
            snap = collector.collect()
            changes.snapshot(snap)
            reap = None
            if policy is not None:
                decisions = reaper.reap_once(snap, policy, args.enforce, args.audit_log)
                changes.decisions(decisions)
                reap = [asdict(d) for d in decisions]
            state.set(snap, time.perf_counter() - start, reap)
        except Exception as e:  # noqa: BLE001 - the daemon outlives one bad pass
            log.limited("collect-error", type(e).__name__, error=f"{type(e).__name__}: {e}")
        stop.wait(max(0.0, args.interval - (time.perf_counter() - start)))
    server.shutdown()
    if pressure:
        pressure.stop()
    log("stopped")
    return 0


COLUMNS_HELP = """\
columns of the process table (sizes in binary units: KiB, MiB, GiB):
  DEVICE   cuda:N (NVML index) or <backend>:N for a pyalloc device without NVML
  PID USER the process and its owner
  USED     device memory the driver charges the process (NVML; N/A without it)
  ALLOC    bytes the process's pyalloc allocator has handed out
  RESV     bytes the allocator holds from the device (ALLOC + CACHED)
  CACHED   free bytes in the allocator's cache: what a trim can release
  LFREE    the largest free block in that cache
  SWAP     bytes the offload manager moved to host memory
  OOM      out-of-memory failures of the allocator
  SM%      SM utilization over the last sample (NVML; N/A without it)
  CPU%     CPU use since the previous sample, 100 = one core
  FLAGS    zombie, orphan, stale (registry heartbeat older than 5 s),
           no-proc (NVML pid not in /proc), idle Ns (no SM use, CPU under 1%)
  COMMAND  the command line (cut to the width)
a dash (-) is a process without a pyalloc record; N/A is a value no source gave.
"""


def _wrap(text: str) -> str:
    """A description as paragraphs of 79 columns (the raw formatter keeps the column legend as written)."""
    return textwrap.fill(text, 79)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the bad input, the reason, and where the help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="gpumemd", description=__doc__, formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"gpumemd {_version()}")
    p.add_argument("--registry-dir", default=None, metavar="DIR",
                   help="folder of the pyalloc processes' records (default: $PYALLOC_REGISTRY_DIR, else /dev/shm)")
    p.add_argument("--no-nvml", action="store_true",
                   help="do not ask NVML: devices and processes from the registry and /proc only "
                        "(default: use NVML when a driver is present)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("status", help="one table of GPU processes", description=_wrap("One table of devices and GPU "
                       "processes, then exit."), epilog=COLUMNS_HELP, formatter_class=fmt)
    s.add_argument("--json", action="store_true", help="the snapshot as JSON instead of the table")
    s.add_argument("--cpu-sample", type=_duration, default=0.2, metavar="DURATION",
                   help="window over which CPU%% is measured, e.g. 200ms, 1s; 0 waits for nothing and "
                        "shows no CPU%% (?) (default: 200ms)")
    s.add_argument("--wide", action="store_true",
                   help="every column, command lines uncut (default: fit the terminal, 100 columns when "
                        "not a terminal)")
    s.set_defaults(fn=cmd_status)

    t = sub.add_parser("top", help="live view; q quits", description=_wrap("The status table refreshed in place "
                       "(q or Esc quits). Needs a terminal; in a narrow one the less important columns are "
                       "dropped first."), epilog=COLUMNS_HELP, formatter_class=fmt)
    t.add_argument("--interval", type=_period, default=1.0, metavar="DURATION",
                   help="time between refreshes, e.g. 500ms, 2s (default: 1s)")
    t.set_defaults(fn=cmd_top)

    v = sub.add_parser("serve", help="metrics, status JSON, pressure socket, reaper",
                       description=_wrap("The daemon: collects every --interval, serves /metrics and /v1/status over "
                       "HTTP, answers the pressure socket, and runs the reaper on each pass when --policy is "
                       "given. Logs one JSON line per event on stdout."), formatter_class=fmt)
    v.add_argument("--listen", type=parse_listen, default=("127.0.0.1", 9877), metavar="HOST:PORT",
                   help="address of /metrics and /v1/status; :PORT means loopback, port 0 picks a free one "
                        "(default: 127.0.0.1:9877)")
    v.add_argument("--show-commands", action="store_true",
                   help="show full command lines in /v1/status (default: program names only; any local "
                        "user can read /v1/status, and arguments may carry secrets)")
    v.add_argument("--interval", type=_period, default=2.0, metavar="DURATION",
                   help="time between collections (NVML, registry, /proc) and reaper passes, e.g. 100ms, "
                        "2s (default: 2s)")
    v.add_argument("--policy", default=None, metavar="FILE",
                   help="reaper policy (TOML, see docs/deployment.md); without it the reaper does not run "
                        "(default: none)")
    v.add_argument("--enforce", action="store_true",
                   help="let the reaper signal the processes its policy names (default: dry run: decisions "
                        "are logged and audited, nothing is signalled)")
    v.add_argument("--audit-log", default=None, metavar="FILE",
                   help="where each reaper decision is " + _AUDIT_LOG_HELP)
    v.add_argument("--socket", default=None, metavar="PATH",
                   help="pressure socket path, or 'none' for no socket (default: /run/gpumemd.sock as root, "
                        "else $XDG_RUNTIME_DIR/gpumemd.sock, else /tmp/gpumemd-<uid>/gpumemd.sock)")
    v.add_argument("--idle-timeout", type=_period, default=2.0, metavar="DURATION",
                   help="a pressure connection that has not sent its request by then is closed (default: 2s)")
    v.add_argument("--max-per-uid", type=_positive, default=4, metavar="N",
                   help="pressure connections one non-root user may hold at once, of 32 in all; more are "
                        "closed unread (default: 4)")
    v.set_defaults(fn=cmd_serve)

    r = sub.add_parser("reap", help="one reaper pass (dry run unless --enforce)",
                       description=_wrap("One collection and one reaper pass: prints each decision with its evidence "
                       "and appends it to the audit log."), formatter_class=fmt)
    r.add_argument("--policy", default=None, metavar="FILE",
                   help="reaper policy (TOML, see docs/deployment.md) (default: the built-in policy: report "
                        "zombies, kill orphans holding memory, no idle reaping, report stale heartbeats)")
    r.add_argument("--enforce", action="store_true",
                   help="signal the processes the policy names: SIGTERM, then SIGKILL after the policy's "
                        "grace_period (default: dry run, nothing is signalled)")
    r.add_argument("--audit-log", default=None, metavar="FILE",
                   help="where each decision is " + _AUDIT_LOG_HELP)
    r.add_argument("--json", action="store_true", help="the decisions as JSON instead of lines")
    r.set_defaults(fn=cmd_reap)

    m = sub.add_parser("trim", help="ask a pyalloc process to release cached memory",
                       description=_wrap("Writes a trim request into the process's registry mailbox and waits for "
                       "its answer."), formatter_class=fmt)
    m.add_argument("pid", type=int, help="the pyalloc process")
    m.add_argument("--device", type=int, default=0, metavar="N", help="device index in that process (default: 0)")
    m.add_argument("--bytes", default=None, metavar="SIZE",
                   help="how much to release, e.g. 512MiB (default: all of the device's cache)")
    m.add_argument("--timeout", type=_period, default=2.0, metavar="DURATION",
                   help="how long to wait for the process's answer (default: 2s)")
    m.add_argument("--json", action="store_true", help="the answer as JSON")
    m.set_defaults(fn=cmd_trim)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except (CliError, ValueError, OSError) as e:
        print(f"gpumemd: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
