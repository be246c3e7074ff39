"""What a ``__del__`` of pyalloc's runs through.

Python ignores an exception raised in ``__del__`` ("Exception ignored in ..."), and a Ctrl-C is
one: the signal's handler raises KeyboardInterrupt in whatever bytecode runs next, and where that
is a finalizer the interrupt was lost. Under ``pyalloc run --offload`` a finalizer runs for
every saved activation autograd lets go of, and 2 of 9 Ctrl-Cs sent to a training loop landed in
one: the loop ran on (a review, 2026-11-29). :func:`finalize` hands such an interrupt back to the
main thread (``_thread.interrupt_main``) from a timer thread, a few milliseconds on: called in
the finalizer, or by a thread that starts at once (``Thread.start`` waits for it), the main thread
takes it at its very next check, still inside the finalizer. Should it land in another finalizer
again, that one hands it back in turn.
"""

from __future__ import annotations

import _thread
import threading
from typing import Any, Callable

__all__ = ["finalize"]

_LATER_S = 0.005
"""How long after a finalizer took a Ctrl-C the main thread is given it again."""


def finalize(fn: Callable[..., Any], *args: Any) -> None:
    """Calls ``fn(*args)`` from a ``__del__``: an error is dropped (the object is going; the
    interpreter may be shutting down), a KeyboardInterrupt raised again in the main thread."""
    try:
        fn(*args)
    except KeyboardInterrupt:
        timer = threading.Timer(_LATER_S, _thread.interrupt_main)
        timer.daemon = True
        timer.start()
    except Exception:
        pass
