"""A child process that "holds GPU memory" through a registry record it publishes.

Modes: plain (sleeps, or spins with --busy), zombie (a forked child publishes
and exits while this parent never waits), orphan (double fork: the
grandchild publishes and is adopted by init). Prints "pid N" once published.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from pyalloc.gpumemd import registry


def publish(args: argparse.Namespace) -> registry.RecordWriter:
    w = registry.RecordWriter(registry.record_path(os.getpid(), directory=args.dir),
                              flags=registry.FLAG_PRESSURE_OPT_IN if args.opt_in else 0)
    last = time.time_ns() - int(args.last_alloc_ago * 1e9)
    state = {"cached": args.cached}

    def trim(device: int, nbytes: int) -> int:
        got = state["cached"] if nbytes == 0 else min(nbytes, state["cached"])
        state["cached"] -= got
        w.update(device, reserved_bytes=args.allocated + state["cached"], cached_free_bytes=state["cached"],
                 largest_free_bytes=state["cached"])
        return got

    w.update(0, reserved_bytes=args.allocated + args.cached, allocated_bytes=args.allocated,
             active_bytes=args.allocated, cached_free_bytes=args.cached, largest_free_bytes=args.cached,
             last_alloc_unix_ns=last)
    if not args.no_serve:
        w.serve(trim)
    return w


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--allocated", type=int, default=1 << 20)
    p.add_argument("--cached", type=int, default=0)
    p.add_argument("--last-alloc-ago", type=float, default=0.0)
    p.add_argument("--busy", action="store_true")
    p.add_argument("--allocating", action="store_true", help="a fresh allocation every 0.3 s, little CPU")
    p.add_argument("--opt-in", action="store_true")
    p.add_argument("--no-serve", action="store_true")
    p.add_argument("--mode", choices=["plain", "zombie", "orphan"], default="plain")
    args = p.parse_args()
    if args.mode == "zombie":
        r, wfd = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(r)
            publish(args).close(unlink=False)
            os.write(wfd, b"x")
            os._exit(0)
        os.close(wfd)
        os.read(r, 1)
        print(f"pid {child}", flush=True)
        while True:
            time.sleep(1)  # never waits: the child stays a zombie
    if args.mode == "orphan":
        r, wfd = os.pipe()
        if os.fork() == 0:
            if os.fork() == 0:
                os.close(r)
                publish(args)
                os.write(wfd, f"{os.getpid()}\n".encode())
                os.close(wfd)
                while True:
                    time.sleep(1)
            os._exit(0)
        os.close(wfd)
        pid = int(os.read(r, 64).decode())
        time.sleep(0.1)
        print(f"pid {pid}", flush=True)
        sys.exit(0)
    if args.busy:
        try:  # busy means busy on a loaded machine too: ahead of the other tests' processes (root only)
            os.nice(-10)
        except OSError:
            pass
    w = publish(args)
    print(f"pid {os.getpid()}", flush=True)
    while True:
        if args.allocating:
            w.update(0, last_alloc_unix_ns=time.time_ns())
            time.sleep(0.3)
        elif args.busy:
            t = time.monotonic()
            while time.monotonic() - t < 1:
                pass
        else:
            time.sleep(1)


if __name__ == "__main__":
    main()
