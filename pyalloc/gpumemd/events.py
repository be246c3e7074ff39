"""The daemon's log: one JSON object a line on stdout, one line an event.

Every line has ``event`` (what happened) and ``time`` (unix seconds); the
other keys name the actors (peer pid and uid, record path, device) and the
reason. A journal or a log shipper parses each line alone; nothing the daemon
writes spans lines, so a peer's misbehaviour (a scraper that hangs up, a
client that sends garbage) is one line, never a traceback.

Events a peer can cause at will (refused connections, client errors) pass
through :meth:`EventLog.limited`: the first of a kind for one key is written
at once, the next ones within ``period_s`` are counted and their number is
carried by the next line written for that key, so a flood of connections
cannot become a flood of log lines.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, Callable, TextIO

LIMIT_PERIOD_S = 10.0  # at most one line per (event, key) in this window; the rest are counted
MAX_LIMITED_KEYS = 1024  # keys remembered for rate limiting; a uid-spraying peer cannot grow it further


class EventLog:
    """Writes event lines; safe from any thread; a closed or broken stdout is not an error."""

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.time) -> None:
        self._stream = stream
        self._clock = clock
        self._lock = threading.Lock()
        self._limited: dict[tuple[str, str], tuple[float, int]] = {}  # (event, key) -> (last written, suppressed)

    def __call__(self, event: str, **fields: Any) -> None:
        self.emit(event, **fields)

    def emit(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "time": round(self._clock(), 3), **fields}, default=str)
        with self._lock:
            stream = self._stream or sys.stdout
            try:
                stream.write(line + "\n")
                stream.flush()
            except (OSError, ValueError):
                pass  # stdout closed or a broken pipe: the daemon goes on without its log

    def limited(self, event: str, key: object, period_s: float = LIMIT_PERIOD_S, **fields: Any) -> bool:
        """Writes the event unless one with the same ``key`` was written in the last ``period_s``;
        returns whether it wrote. A written line carries ``suppressed``: how many were held back."""
        now = self._clock()
        k = (event, str(key))
        with self._lock:
            last, held = self._limited.get(k, (float("-inf"), 0))
            if now - last < period_s:
                self._limited[k] = (last, held + 1)
                return False
            if len(self._limited) >= MAX_LIMITED_KEYS and k not in self._limited:
                self._forget_oldest(now - period_s)
            self._limited[k] = (now, 0)
        self.emit(event, **fields, **({"suppressed": held} if held else {}))
        return True

    def _forget_oldest(self, before: float) -> None:
        """Drops keys whose window is over (their held-back counts are lost: a bounded table
        matters more than an exact count for a peer that sprays keys)."""
        for k in [k for k, (last, _held) in self._limited.items() if last < before] or list(self._limited)[:1]:
            del self._limited[k]


class _Nowhere:
    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def silent() -> EventLog:
    """A log that writes nothing: for library use of the servers, where no one reads a log."""
    return EventLog(_Nowhere())  # type: ignore[arg-type]
