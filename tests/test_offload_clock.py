"""The planned policy's clock (Note [Device time] in pyalloc/offloading/clock.py): thread time, or
the device's time in the steps that make or judge a plan, and only in those."""

from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch

from pyalloc.offloading import clock
from pyalloc.offloading.bench_models import GPTSmallish
from pyalloc.offloading.session import ActivationOffload, offload

from offload_fixture import assert_bitwise_equal, saved_bytes_peak, step

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # bit-for-bit comparisons (conftest.py)


def test_the_clock_is_thread_time_and_waits_for_the_device_only_where_asked() -> None:
    waited: list[int] = []
    assert not clock.waits()
    before = clock.now()
    time.sleep(0.05)  # wall time passes; this thread's CPU time barely does
    assert clock.now() - before < 0.04
    with clock.device_time(lambda: waited.append(1)):
        assert clock.waits()
        a = clock.now()
        time.sleep(0.05)
        b = clock.now()
        assert b - a >= 0.05 and len(waited) == 2  # wall time, read after each wait
        with clock.device_time(None):  # a CPU session inside: thread time again
            assert not clock.waits() and clock.now() - a < 10.0
        assert clock.waits()
        seen: list[bool] = []
        other = threading.Thread(target=lambda: seen.append(clock.waits()))
        other.start()
        other.join()
        assert seen == [False]  # per thread: another thread's session keeps its own clock
    assert not clock.waits() and len(waited) == 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPTSmallish(vocab=64, d=32, layers=3, heads=2, seq=16)


def _steps_with_waits(session: ActivationOffload, model: torch.nn.Module, x: torch.Tensor, steps: int,
                      monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, bool]]:
    """Each step's kind as the session stood before it, the waits its clock made, and whether a
    forward inside it read the device's clock; the gradients compared with plain steps'."""
    waits = [0]

    def wait() -> None:
        waits[0] += 1

    monkeypatch.setattr(session, "_device_wait", lambda: wait)  # a CPU stand-in for CUDA's synchronize
    seen: list[bool] = []
    hook = model.blocks[0].register_forward_hook(lambda m, a, o: seen.append(clock.waits()))
    plain = [step(model, x, seed) for seed in range(steps)]
    kinds = []
    try:
        for seed in range(steps):
            search = session._search
            kind = "profile" if search is None else "settled" if search.settled else "search"
            waits[0], seen[:] = 0, []
            with session:
                assert_bitwise_equal(step(model, x, seed), plain[seed])
            kinds.append((kind, waits[0], any(seen)))
    finally:
        hook.remove()
    return kinds


def test_only_the_steps_that_make_or_judge_the_plan_wait_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _model(), torch.randint(0, 64, (4, 16))
    session = offload(budget=saved_bytes_peak(model, x) // 2, pressure_callback=False)
    kinds = _steps_with_waits(session, model, x, 8, monkeypatch)
    assert [k for k, *_ in kinds][:2] == ["profile", "search"] and kinds[-1][0] == "settled"
    for kind, waits, inside in kinds:
        if kind == "settled":
            assert waits == 0 and not inside, kinds
        else:  # every call's time, the session's own subtracted, read after the device's work
            assert waits > 0 and inside, kinds
    assert kinds[0][1] > 10 * kinds[1][1]  # the profile times every operator; a search step, its re-runs
    assert session.stats()["plan_regions"] + session.stats()["plan_outputs"] > 0  # a plan that re-runs


def test_a_budget_never_reached_waits_for_nothing_once_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _model(), torch.randint(0, 64, (4, 16))
    session = offload(budget=saved_bytes_peak(model, x) * 10, pressure_callback=False)
    kinds = _steps_with_waits(session, model, x, 6, monkeypatch)
    assert session.stats()["idle_steps_total"] > 0
    assert [w for k, w, _ in kinds if k == "settled"] == [0] * sum(k == "settled" for k, *_ in kinds)


def test_a_cpu_session_reads_thread_time() -> None:
    session = offload(budget=1 << 20, pressure_callback=False)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    wait: Callable[[], None] | None = session._device_wait()
    assert wait is None
