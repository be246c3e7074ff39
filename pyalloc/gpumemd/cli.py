"""`gpumemd`: status, top, serve, reap, trim. Exits non-zero with a one-line reason on failure."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from . import registry
from . import reaper
from .model import Collector
from .table import render
from .units import format_bytes, parse_duration, parse_size


class CliError(Exception):
    pass


def _collector(args: argparse.Namespace, **kw: Any) -> Collector:
    return Collector(registry_dir=args.registry_dir, use_nvml=not args.no_nvml, **kw)


def cmd_status(args: argparse.Namespace) -> int:
    snap = _collector(args).collect(cpu_sample_s=args.cpu_sample)
    if args.json:
        print(json.dumps(snap.to_json(), indent=2))
    else:
        print(render(snap))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    import curses

    interval = parse_duration(args.interval)
    collector = _collector(args)

    def loop(scr: Any) -> None:
        curses.curs_set(0)
        scr.timeout(100)
        next_at = 0.0
        while True:
            if time.monotonic() >= next_at:
                snap = collector.collect()
                h, w = scr.getmaxyx()
                scr.erase()
                for y, line in enumerate(render(snap, width=w - 1).splitlines()[: h - 1]):
                    scr.addnstr(y, 0, line, w - 1)
                scr.addnstr(h - 1, 0, "q: quit", w - 1, curses.A_REVERSE)
                scr.refresh()
                next_at = time.monotonic() + interval
            if scr.getch() in (ord("q"), ord("Q"), 27):
                return

    curses.wrapper(loop)
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
              f"held {format_bytes(ev['held_bytes']):>9} cpu {ev['cpu_percent']}% idle {ev['idle_s']}s "
              f"status {ev['status']} ppid {ev['ppid']}  [{why}]  {(ev['command'] or '')[:60]}")


def cmd_reap(args: argparse.Namespace) -> int:
    policy = reaper.Policy.load(args.policy)
    collector = _collector(args, subreapers=tuple(policy.subreapers),
                           idle_cpu_percent=policy.idle.cpu_percent)
    snap = collector.collect(cpu_sample_s=policy.cpu_sample_s)
    decisions = reaper.reap_once(snap, policy, args.enforce, args.audit_log)
    _print_decisions(decisions, args.json)
    return 0


def cmd_trim(args: argparse.Namespace) -> int:
    path = registry.find_record_path(args.pid, args.registry_dir)
    if path is None:
        raise CliError(f"pid {args.pid} has no pyalloc registry record")
    nbytes = parse_size(args.bytes) if args.bytes else 0
    try:
        released = registry.post_trim(path, args.device, nbytes, timeout=parse_duration(args.timeout))
    except registry.RecordError as e:
        raise CliError(f"{path}: {e}") from None
    except registry.MailboxTimeout as e:
        raise CliError(f"pid {args.pid}: {e}") from None
    if args.json:
        print(json.dumps({"pid": args.pid, "device": args.device, "released_bytes": released}))
    else:
        print(f"pid {args.pid} device {args.device}: released {released} bytes ({format_bytes(released)})")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .metrics import State, make_server
    from .pressure import PressureServer, default_socket_path

    host, _, port = args.listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    interval = parse_duration(args.interval)
    policy = reaper.Policy.load(args.policy) if args.policy else None
    collector = _collector(args, subreapers=tuple(policy.subreapers) if policy else ("systemd",),
                           **({"idle_cpu_percent": policy.idle.cpu_percent} if policy else {}))
    state = State()
    server = make_server(state, host, int(port), show_commands=args.show_commands)
    pressure = None
    if args.socket != "none":
        pressure = PressureServer(args.socket or default_socket_path(), args.registry_dir)
        pressure.start()
    threading.Thread(target=server.serve_forever, name="gpumemd-http", daemon=True).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(json.dumps({"event": "listening", "metrics": f"http://{host}:{server.server_address[1]}/metrics",
                      "socket": pressure.path if pressure else None}), flush=True)
    while not stop.is_set():
        start = time.perf_counter()
        try:
            snap = collector.collect()
            reap = None
            if policy is not None:
                decisions = reaper.reap_once(snap, policy, args.enforce, args.audit_log)
                reap = [asdict(d) for d in decisions]
            state.set(snap, time.perf_counter() - start, reap)
        except Exception as e:  # noqa: BLE001 - the daemon outlives one bad pass
            print(json.dumps({"event": "collect-error", "error": f"{type(e).__name__}: {e}"}), flush=True)
        stop.wait(max(0.0, interval - (time.perf_counter() - start)))
    server.shutdown()
    if pressure:
        pressure.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpumemd", description=__doc__)
    p.add_argument("--registry-dir", default=None,
                   help="where pyalloc records live (default $PYALLOC_REGISTRY_DIR or /dev/shm)")
    p.add_argument("--no-nvml", action="store_true", help="registry and psutil only")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("status", help="one table of GPU processes")
    s.add_argument("--json", action="store_true")
    s.add_argument("--cpu-sample", type=parse_duration, default=0.2, help="CPU %% sample window")
    s.set_defaults(fn=cmd_status)

    t = sub.add_parser("top", help="live view; q quits")
    t.add_argument("--interval", default="1s")
    t.set_defaults(fn=cmd_top)

    v = sub.add_parser("serve", help="metrics, status JSON, pressure socket, reaper")
    v.add_argument("--listen", default="127.0.0.1:9877")
    v.add_argument("--show-commands", action="store_true",
                   help="show full command lines in /v1/status (default: program names only; any local "
                        "user can read /v1/status, and arguments may carry secrets)")
    v.add_argument("--interval", default="2s")
    v.add_argument("--policy", default=None)
    v.add_argument("--enforce", action="store_true")
    v.add_argument("--audit-log", default=None)
    v.add_argument("--socket", default=None, help="pressure socket path, or 'none'")
    v.set_defaults(fn=cmd_serve)

    r = sub.add_parser("reap", help="one reaper pass (dry run unless --enforce)")
    r.add_argument("--policy", default=None)
    r.add_argument("--enforce", action="store_true")
    r.add_argument("--audit-log", default=None)
    r.add_argument("--json", action="store_true")
    r.set_defaults(fn=cmd_reap)

    m = sub.add_parser("trim", help="ask a pyalloc process to release cached memory")
    m.add_argument("pid", type=int)
    m.add_argument("--device", type=int, default=0)
    m.add_argument("--bytes", default=None, help="how much (default: all cached)")
    m.add_argument("--timeout", default="2s")
    m.add_argument("--json", action="store_true")
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
