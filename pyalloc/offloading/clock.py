"""The clock the planned policy measures costs with: thread time, or the device's time where a
plan is made or judged on CUDA.

Note [Device time]
    A plan weighs each re-run, refill and pack by what it costs a step, measured in the profiled
    step and, while the plan search runs, in planned steps (Note [Planned recompute] in plan.py).
    On CPU the cost is the thread's CPU time (``time.thread_time``: the machine's other work is
    not the step's). On CUDA kernels run asynchronously: a call's thread time is what launching
    its kernels took, not what they take on the device (a convolution launches as quickly as a
    ReLU), so a plan costed that way weighs a call by its number of operators, and the search
    judges plans the same way.

    So in the steps whose times are read (a profiled step, and a planned step while the plan
    search has not settled), a CUDA session's clock waits for the device before each reading and
    reads wall time (:func:`device_time`): an interval is what host and device took for it, one
    after the other. Every interval of those steps is read on the same clock, the session's own
    time that is subtracted (its recording, its checks) included. Elsewhere (settled planned
    steps, whose times nothing reads; DTR's policy; a CPU session) it stays thread time: waiting
    for the device there would stall the step. The clock is per thread, as sessions are.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

__all__ = ["device_time", "now", "waits"]

_local = threading.local()


def now() -> float:
    """Seconds on this thread's clock: thread CPU time, or, inside :func:`device_time` with a
    wait, wall time once the device has finished what was queued."""
    wait = getattr(_local, "wait", None)
    if wait is None:
        return time.thread_time()
    wait()
    return time.perf_counter()


def waits() -> bool:
    """Whether :func:`now` waits for a device on this thread now."""
    return getattr(_local, "wait", None) is not None


@contextlib.contextmanager
def device_time(wait: Callable[[], None] | None) -> Iterator[None]:
    """Within: :func:`now` calls ``wait`` (a device's synchronize) and reads wall time; None:
    thread time, as outside."""
    before = getattr(_local, "wait", None)
    _local.wait = wait
    try:
        yield
    finally:
        _local.wait = before
