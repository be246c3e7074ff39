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

    So in the steps whose times are read, a CUDA session's clock waits for the device before each
    reading and reads wall time: an interval is what host and device took for it, one after the
    other. The profiled step's readings (module calls, operators, refills, packs, and the
    session's own time that is subtracted from them, all in forward on the step's thread) go
    through :func:`now` inside :func:`device_time`, which is per thread. A planned step while the
    plan search runs reads its re-runs' and refills' times on a clock of its own
    (:func:`reader`, ``PlannedStep.now``): they run in backward, which on CUDA runs on autograd's
    thread for the device, where no thread-local setting of the step's is seen. Elsewhere
    (settled planned steps, whose times nothing reads; DTR's policy; a session in a process that
    has not started CUDA, such as a CPU model on a CUDA machine) it stays thread time: waiting
    for the device there would stall the step.

    What it waits for is the current CUDA device (``torch.cuda.synchronize()``): a model on
    another device than the current one is timed by launch time again, unless the program sets
    that device current (as PyTorch's own CUDA calls without a device assume). Nothing waits
    while this thread's stream captures a CUDA graph; a capture on another thread in the global
    capture mode would refuse the wait (a program should not profile a step during one).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

__all__ = ["device_time", "now", "reader", "stop_waiting", "waits"]

_local = threading.local()  # .read: this thread's clock, while device_time() sets one
_thread_time = time.thread_time


def now() -> float:
    """Seconds on this thread's clock: thread CPU time, or, inside :func:`device_time` with a
    wait, wall time once the device has finished what was queued."""
    return getattr(_local, "read", _thread_time)()


def waits() -> bool:
    """Whether :func:`now` waits for a device on this thread now."""
    return getattr(_local, "read", _thread_time) is not _thread_time


def reader(wait: Callable[[], None] | None) -> Callable[[], float]:
    """A clock: thread time, or with ``wait``, wall time once ``wait`` returned. What
    :func:`device_time` sets for :func:`now`, and a clock of its own for measurements that run on
    other threads than the step's (backward runs on autograd's thread for the device on CUDA)."""
    if wait is None:
        return _thread_time

    def read() -> float:
        wait()
        return time.perf_counter()

    return read


@contextlib.contextmanager
def device_time(wait: Callable[[], None] | None) -> Iterator[None]:
    """Within: :func:`now` reads :func:`reader` with ``wait`` on this thread (None: thread time,
    as outside)."""
    before = getattr(_local, "read", _thread_time)
    _local.read = reader(wait)
    try:
        yield
    finally:
        _local.read = before


def stop_waiting() -> None:
    """Until the :func:`device_time` around this ends, :func:`now` reads thread time on this
    thread: a profiled step let go runs on as a DTR step, whose readings must not wait for the
    device (Note [Plans per shape] in session.py)."""
    _local.read = _thread_time
