"""The planned policy's clock (Note [Device time] in pyalloc/offloading/clock.py): thread time, or
the device's time in the steps that make or judge a plan, and only in those."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from pyalloc.offloading import clock
from pyalloc.offloading import session as session_module
from pyalloc.offloading.bench_models import GPTSmallish
from pyalloc.offloading.regions import PlannedStep
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
            assert not clock.waits()
            c = clock.now()
            time.sleep(0.05)
            assert clock.now() - c < 0.04
        assert clock.waits()
        seen: list[bool] = []
        other = threading.Thread(target=lambda: seen.append(clock.waits()))
        other.start()
        other.join()
        assert seen == [False]  # per thread: another thread's session keeps its own clock
    assert not clock.waits() and len(waited) == 2
    own = clock.reader(lambda: waited.append(1))  # a step's own clock: the same on every thread
    other = threading.Thread(target=own)
    other.start()
    other.join()
    assert len(waited) == 3 and clock.reader(None) is time.thread_time


class _DeviceClock:
    """A stand-in for a CUDA device's clock on the CPU: each wait (the synchronize) moves a wall
    clock on by one second and nothing else does, so an interval read on it is a whole number of
    seconds, and one with a reading of thread time in it is not."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seconds = 1000.0
        self.waits = 0
        monkeypatch.setattr(clock.time, "perf_counter", lambda: self.seconds)

    def wait(self) -> None:
        self.seconds += 1.0
        self.waits += 1


def _whole(x: float) -> bool:
    return abs(x - round(x)) < 1e-9


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPTSmallish(vocab=64, d=32, layers=3, heads=2, seq=16)


def _steps(session: ActivationOffload, model: torch.nn.Module, x: torch.Tensor, steps: int,
           device: _DeviceClock, monkeypatch: pytest.MonkeyPatch,
           backward_thread: bool = False) -> list[tuple[str, int, list[float]]]:
    """Each step's kind as the session stood before it, the waits its clock made, and the times
    its planned step read (re-runs, refills); gradients compared with plain steps'.
    ``backward_thread``: backward on a thread of its own, as autograd runs a CUDA device's."""
    monkeypatch.setattr(session, "_device_wait", lambda: device.wait)  # CUDA's synchronize, on the CPU
    plain = [step(model, x, seed) for seed in range(steps)]
    read: list[float] = []
    original_finish = session._finish_plan_step

    def finish() -> None:  # what the plan search is given
        run = session._planned
        if isinstance(run, PlannedStep):
            for times in (run.rerun_seconds, run.refill_seconds, run.selective_seconds, run.region_seconds):
                read.extend(times.values())
            read.append(run.product_seconds)
        original_finish()

    monkeypatch.setattr(session, "_finish_plan_step", finish)
    kinds = []
    for seed in range(steps):
        search = session._search
        kind = "profile" if search is None else "settled" if search.settled else "search"
        device.waits, read[:] = 0, []
        with session:
            torch.manual_seed(seed)
            loss = model(x).square().mean()
            if backward_thread:
                other = threading.Thread(target=loss.backward)
                other.start()
                other.join()
            else:
                loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
        assert_bitwise_equal(grads, plain[seed])
        kinds.append((kind, device.waits, list(read)))
    return kinds


@pytest.mark.parametrize("backward_thread", [False, True], ids=["backward-here", "backward-on-its-own-thread"])
def test_the_steps_that_make_or_judge_the_plan_read_every_time_on_the_device_clock(
        backward_thread: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _model(), torch.randint(0, 64, (4, 16))
    device = _DeviceClock(monkeypatch)
    session = offload(budget=saved_bytes_peak(model, x) // 2, pressure_callback=False)
    kinds = _steps(session, model, x, 8, device, monkeypatch, backward_thread)
    assert [k for k, *_ in kinds][:2] == ["profile", "search"] and kinds[-1][0] == "settled", kinds
    assert kinds[0][1] > 10 * max(w for k, w, _ in kinds if k == "search") > 0  # every operator; the re-runs
    for kind, waits, read in kinds:
        if kind == "settled":
            assert waits == 0, kinds
        elif kind == "search":  # its re-runs, wherever backward ran them, on the device's clock
            assert read and all(_whole(t) for t in read), (kind, read)
    search = session._search
    assert search is not None and search.plan.recompute_seconds > 0
    # every time the profile read, the session's own subtracted, is whole: no interval mixes clocks
    calls = search.profile.calls
    assert all(_whole(c.seconds) for c in calls) and any(c.seconds >= 1 for c in calls)
    assert all(_whole(c.refill_seconds) for c in calls if c.refill_seconds >= 0)
    assert all(_whole(p.pack_seconds) for p in search.profile.packs)
    assert _whole(search.plan.recompute_seconds)


def test_no_other_step_waits_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _model(), torch.randint(0, 64, (4, 16))
    device = _DeviceClock(monkeypatch)
    never = offload(budget=saved_bytes_peak(model, x) * 10, pressure_callback=False)  # idle once settled
    kinds = _steps(never, model, x, 6, device, monkeypatch)
    assert never.stats()["idle_steps_total"] > 0
    assert [w for k, w, _ in kinds if k == "settled"] == [0] * sum(k == "settled" for k, *_ in kinds)
    dtr = offload(budget=saved_bytes_peak(model, x) // 2, policy="dtr", pressure_callback=False)
    kinds = _steps(dtr, model, x, 3, device, monkeypatch)  # DTR records every torch call, timed
    assert [w for _, w, _ in kinds] == [0, 0, 0] and dtr.stats()["saved_tensors_total"] > 0
    assert dtr.stats()["planning_seconds_total"] == 0  # DTR makes no plan


def test_a_session_waits_for_cuda_only_once_the_process_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    session = offload(budget=1 << 20, pressure_callback=False)
    session._cuda = True  # a CUDA machine
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert session._device_wait() is None  # a CPU model there: thread time, no context made
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: bool(calls and calls[-1] == "capture"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    wait = session._device_wait()
    assert wait is session_module._cuda_synchronize
    wait()
    calls.append("capture")  # a CUDA graph being captured: waiting is not allowed, none is made
    wait()
    assert calls == ["sync", "capture"]
    session._cuda = False  # a machine without CUDA
    assert session._device_wait() is None
