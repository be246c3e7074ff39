"""pyalloc/_finalizers.py: a Ctrl-C that lands in a finalizer of pyalloc's is not lost."""

from __future__ import annotations

import time

import pytest

from pyalloc._finalizers import finalize


def _interrupted() -> None:
    raise KeyboardInterrupt


def _failed() -> None:
    raise RuntimeError("the library is gone")


class _Held:
    def __init__(self, fn) -> None:
        self.fn = fn

    def __del__(self) -> None:
        finalize(self.fn)


def test_a_ctrl_c_in_a_finalizer_is_raised_again_outside_it() -> None:
    with pytest.raises(KeyboardInterrupt):
        held = _Held(_interrupted)
        del held  # Python would print "Exception ignored in" and carry on
        deadline = time.monotonic() + 10  # it comes a few milliseconds on
        while time.monotonic() < deadline:
            pass


def test_an_error_in_a_finalizer_is_dropped(recwarn) -> None:
    held = _Held(_failed)
    del held
    assert not recwarn.list
