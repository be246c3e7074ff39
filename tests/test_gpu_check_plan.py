"""How ``pyalloc gpu-check`` spends its budget (:func:`pyalloc.gpucheck.run.plan`): the order of
its checks, the time kept for the offload check and tests/gpu, and the batch each timed loop gets.

The children are replaced by a recorder that answers at once (no GPU, no torch model), so what is
checked is the orchestration alone: which check runs, with what configuration and time limit.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from pyalloc.gpucheck import run


def _args(tmp_path: Path, **over: Any) -> argparse.Namespace:
    values: dict[str, Any] = {"budget": 480.0, "only": None, "start_batch": 4, "max_batch": 4096, "steps": 10,
                              "out": str(tmp_path)}
    values.update(over)
    return argparse.Namespace(**values)


def test_the_plan_runs_the_cheap_telling_checks_first_and_tests_gpu_last(tmp_path: Path) -> None:
    names = [p.name for p in run.plan(_args(tmp_path))]
    assert names[:4] == ["environment", "growth (default)", "growth (expandable)", "growth (pyalloc)"]
    assert names.index("snapshot") < names.index("gpt2 max-batch (default)") < names.index("resnet50 max-batch (default)")
    assert names.index("resnet50 step time (pyalloc)") < names.index("offload (gpt-like)")
    assert names[-1] == "tests/gpu"
    assert [p.name for p in run.plan(_args(tmp_path, only="growth,tests/gpu"))] == [
        "growth (default)", "growth (expandable)", "growth (pyalloc)", "tests/gpu"]


def test_checks_before_the_offload_check_and_tests_gpu_leave_them_their_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, dict[str, Any], float]] = []

    def child(name: str, check: str, cfg: dict[str, Any], timeout: float) -> run.CheckResult:
        calls.append((name, cfg, timeout))
        figures = {"largest_batch": {"default": 100, "expandable": 120, "pyalloc": 130}[cfg["allocator"]]} \
            if cfg.get("mode") == "max-batch" else {}
        return run.CheckResult(name, "pass", 0.0, figures)

    def tests(timeout: float, out: Path | None = None) -> run.CheckResult:
        calls.append(("tests/gpu", {}, timeout))
        return run.CheckResult("tests/gpu", "pass", 0.0)

    monkeypatch.setattr(run, "run_child", child)
    monkeypatch.setattr(run, "run_gpu_tests", tests)
    results = run.run_checks(_args(tmp_path), "cuda", lambda line: None)
    assert [r.status for r in results] == ["pass"] * len(results)
    limits = {name: timeout for name, _, timeout in calls}
    budget = 480.0
    # A check's limit is its share, and never eats into what later checks keep: with the whole
    # budget still there, the environment may take 4% of it.
    assert limits["environment"] == pytest.approx(0.04 * budget, abs=0.5)
    assert limits["offload (gpt-like)"] == pytest.approx(run.OFFLOAD_SHARE / 2 * budget, abs=0.5)
    assert limits["tests/gpu"] == pytest.approx(budget, abs=1.0)  # last: all that is left
    # Each timed loop runs at 90% of the smallest largest batch of its model.
    timed = [cfg for name, cfg, _ in calls if cfg.get("mode") == "time"]
    assert {cfg["batch"] for cfg in timed} == {90} and len(timed) == 6
    offload = [cfg for name, cfg, _ in calls if name.startswith("offload")]
    assert all(cfg["seconds"] == pytest.approx(run.OFFLOAD_SEARCH_SHARE * limits["offload (gpt-like)"], abs=0.5)
               for cfg in offload)


def test_a_spent_budget_leaves_later_checks_not_run_but_keeps_tests_gpus_share(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that takes all the time it is given (here: its limit is added to a fake clock)."""
    clock = [0.0]
    monkeypatch.setattr(run.time, "monotonic", lambda: clock[0])

    def child(name: str, check: str, cfg: dict[str, Any], timeout: float) -> run.CheckResult:
        clock[0] += timeout
        return run.CheckResult(name, "timeout", timeout)

    def tests(timeout: float, out: Path | None = None) -> run.CheckResult:
        clock[0] += timeout
        return run.CheckResult("tests/gpu", "timeout", timeout)

    monkeypatch.setattr(run, "run_child", child)
    monkeypatch.setattr(run, "run_gpu_tests", tests)
    results = {r.name: r for r in run.run_checks(_args(tmp_path), "cuda", lambda line: None)}
    assert results["resnet50 step time (pyalloc)"].status == "not-run"
    assert results["offload (gpt-like)"].status == "timeout"  # ran: its share was kept
    assert results["tests/gpu"].seconds == pytest.approx(run.TESTS_SHARE * 480.0, abs=1.0)
    assert sum(r.seconds for r in results.values()) == pytest.approx(480.0, abs=1.0)


def test_checks_run_alone_share_the_whole_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--only offload --budget 200` gives each model 100 s, not the 20 s it has in the whole run;
    checks whose shares already fill the budget keep them."""
    calls: dict[str, tuple[dict[str, Any], float]] = {}

    def child(name: str, check: str, cfg: dict[str, Any], timeout: float) -> run.CheckResult:
        calls[name] = (cfg, timeout)
        return run.CheckResult(name, "pass", 0.0, {"largest_batch": 8} if cfg.get("mode") == "max-batch" else {})

    monkeypatch.setattr(run, "run_child", child)
    monkeypatch.setattr(run, "run_gpu_tests", lambda timeout, out=None: run.CheckResult("tests/gpu", "pass", 0.0))
    run.run_checks(_args(tmp_path, only="offload", budget=200.0), "cuda", lambda line: None)
    assert calls["offload (gpt-like)"][1] == pytest.approx(100.0, abs=0.5)
    assert calls["offload (resnet-like)"][1] == pytest.approx(100.0, abs=0.5)
    assert calls["offload (gpt-like)"][0]["seconds"] == pytest.approx(run.OFFLOAD_SEARCH_SHARE * 100.0, abs=0.5)

    calls.clear()
    run.run_checks(_args(tmp_path, only="growth", budget=100.0), "cuda", lambda line: None)
    assert [timeout for _, timeout in calls.values()] == pytest.approx([100.0 / 3] * 3, abs=0.5)

    calls.clear()
    run.run_checks(_args(tmp_path, budget=480.0), "cuda", lambda line: None)  # the whole run: shares as planned
    cfg, timeout = calls["gpt2 max-batch (default)"]
    assert timeout == pytest.approx(0.08 * 480.0, abs=0.5)
    assert cfg["seconds"] == pytest.approx(run.MAX_BATCH_SEARCH_SHARE * timeout)
