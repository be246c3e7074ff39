"""The doctor on the program's other threads.

Note [Doctor's threads]
~~~~~~~~~~~~~~~~~~~~~~~
A TorchDispatchMode and a saved_tensors_hooks pair are per thread: entered on one thread, they
see nothing another thread does. DataParallel runs each replica's forward on a thread of its
own (``torch.nn.parallel.parallel_apply``), and programs run models on thread pools. So while
the doctor runs, ``threading.Thread.start`` is wrapped: a thread started then gets its own
``ThreadMode`` and saved-tensor hooks, entered before its ``run()`` and left after it, both
writing to the one storage tracker. Wrapping ``start`` (public, and called by every
``threading.Thread``, its subclasses, ``concurrent.futures`` pools and ``parallel_apply``) on the
class and ``run`` on the instance, rather than ``_bootstrap_inner``, keeps to public names.

What the new thread inherits from the thread that started it, read when ``start()`` is called:
- the module stack (the modules whose forward is running there), so a replica's forward on its
  thread nests under the DataParallel (or other module) that started it, and what it saves for
  backward is owned by the wrapped model and its block, not by a new top-level module per
  replica (DataParallel makes new replicas every forward). They count only while the starting
  thread is still inside them: a pool's thread, started in one forward, outlives it;
- the site of the ``start()`` call, for what the thread makes with no user frame on its stack.

Not seen: threads started before the doctor (a pool made before ``import torch``), threads made
without ``threading`` (``_thread.start_new_thread``, C++ threads; autograd's device threads
inherit the mode from PyTorch itself, see Note [Doctor's storage tracking]).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .tracker import StorageTracker


class ThreadMode(TorchDispatchMode):
    """The dispatch mode of one watched thread: notes what its operators make in the tracker."""

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.tracker.paused:
            self.tracker.note_outputs(out)
        return out


class ThreadWatch:
    """Wraps ``threading.Thread.start`` from start() to stop(); see Note [Doctor's threads]."""

    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self.threads_watched = 0
        self._original: Callable[..., Any] | None = None
        self._wrapper: Callable[..., Any] | None = None

    def start(self) -> None:
        original = threading.Thread.start
        watch = self

        def start(thread: threading.Thread) -> None:
            if watch._wrapper is not None:  # not stopped since this thread's start() began
                try:
                    watch._adopt(thread)
                except Exception:  # the doctor must never stop a thread from starting
                    pass
            original(thread)

        self._original, self._wrapper = original, start
        threading.Thread.start = start  # type: ignore[method-assign, assignment]

    def stop(self) -> None:
        if self._original is not None and threading.Thread.start is self._wrapper:
            threading.Thread.start = self._original  # type: ignore[method-assign]
        self._original = self._wrapper = None

    def _adopt(self, thread: threading.Thread) -> None:
        tracker = self.tracker
        if tracker.paused:
            return
        inherited = tracker.thread.inheritance()
        with tracker.lock:
            start_site = tracker.sites.current(skip=3)  # the caller of Thread.start
        if start_site == tracker.sites.no_user_frame:  # started by library code: its own starter's
            start_site = tracker.thread.start_site if tracker.thread.start_site is not None else start_site
        run = thread.run

        def watched_run() -> None:
            tracker.thread.adopt(inherited, start_site)
            mode = ThreadMode(tracker)
            hooks = torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack)
            with hooks, mode:
                try:
                    run()
                finally:
                    thread.__dict__.pop("run", None)  # the thread object no longer holds the doctor

        thread.run = watched_run  # type: ignore[method-assign]
        self.threads_watched += 1
