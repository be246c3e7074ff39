"""``pyalloc gpu-check`` without a GPU: the one-line exit, the orchestration and the report.

The checks themselves need a GPU; here the command runs in its hidden CPU mode (``--device
cpu``), where the training loops run tiny models on the CPU and every check that needs CUDA fails
at once, which is enough to show the processes, the time budget, the files and the targets. The
offload check runs end to end on the CPU (its real models, checkpointing, save_on_cpu and a
pyalloc.offload session): nothing runs out of memory there, so every largest-batch search stops
at --max-batch, and the figures show that the columns run, agree and are timed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from pyalloc.gpucheck import run  # noqa: E402
from pyalloc.gpucheck.batch_search import largest_batch  # noqa: E402


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyalloc.cli", "gpu-check", *args], capture_output=True, text=True,
                          timeout=1600)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    done = _cli("--out", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert done.stderr.startswith("pyalloc gpu-check: no GPU to check: torch ")
    assert not any(tmp_path.iterdir())
    done = _cli("--out", str(tmp_path), "--json")  # with --json, stdout is one JSON object as well
    assert done.returncode == 2 and done.stderr.startswith("pyalloc gpu-check: no GPU to check: torch ")
    answer = json.loads(done.stdout)
    assert answer["gpu"] is False and answer["reason"].startswith("torch ") and answer["checks"] == []


@pytest.mark.parametrize("args, message", [
    (["--only", "growth,offlaod"], "--only: unknown check 'offlaod' (known: environment, growth"),
    (["--budget", "nan"], "--budget must be a finite number of seconds, at least 10, got nan"),
    (["--budget", "inf"], "--budget must be a finite number of seconds, at least 10, got inf"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--out", "/proc/gpu-check"], "--out /proc/gpu-check: cannot write in /proc"),
])
def test_bad_options_are_refused_before_anything_runs_gpu_or_not(args: list[str], message: str) -> None:
    """A mistyped --only name ran nothing and reported success; a NaN budget ran; an unwritable
    --out was found after every check had run; without a GPU no option was looked at (a review's
    findings). Each is one line, exit 2, before the GPU is even probed."""
    for device in ("cuda", "cpu"):
        done = _cli(*args, "--device", device)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_the_cpu_run_writes_both_reports_with_every_check_and_the_targets(tmp_path: Path) -> None:
    # A budget well above what the run takes (about a minute): each check's share of it is its
    # time limit, and a loaded machine must not turn a pass into a timeout.
    done = _cli("--device", "cpu", "--only", "oom,gpt2,resnet50", "--max-batch", "2", "--steps", "2",
                "--budget", "1500", "--out", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report == json.loads((tmp_path / "gpu-check.json").read_text())
    names = [c["name"] for c in report["checks"]]
    assert names == ["oom"] + [f"{m} {kind} ({a})" for m in ("gpt2", "resnet50") for kind in ("max-batch", "step time")
                               for a in run.ALLOCATORS]
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["oom"]["status"] == "fail" and by_name["oom"]["detail"] == "needs a CUDA device"
    for model in ("gpt2", "resnet50"):
        assert by_name[f"{model} max-batch (default)"]["figures"]["largest_batch"] == 2
        step = by_name[f"{model} step time (default)"]
        assert step["status"] == "pass" and step["figures"]["batch"] == 1 and step["figures"]["median_step_seconds"] > 0
        # pyalloc cannot be installed into a CPU build of torch: a failed check, not a crash
        assert by_name[f"{model} step time (pyalloc)"]["status"] == "fail"
        assert "needs CUDA" in by_name[f"{model} step time (pyalloc)"]["detail"]
    assert report["targets"] == [{"target": "no check crashes", "value": 0, "limit": 0, "met": True,
                                  "what": "none crashed or timed out"}]
    text = (tmp_path / "gpu-check.md").read_text()
    assert text.startswith("# pyalloc gpu-check, ") and "| gpt2 step time (default) | pass |" in text


def test_a_child_that_dies_without_a_result_is_a_crash() -> None:
    result = run.run_child("bogus", "no-such-check", {}, timeout=60)
    assert result.status == "crash" and result.detail.startswith("exit status 2: usage:")


def test_targets_compare_pyalloc_with_both_pytorch_allocators() -> None:
    def r(name: str, **figures: float) -> run.CheckResult:
        return run.CheckResult(name, "pass", 1.0, dict(figures))

    results = [r("gpt2 max-batch (default)", largest_batch=20), r("gpt2 max-batch (expandable)", largest_batch=24),
               r("gpt2 max-batch (pyalloc)", largest_batch=26), r("gpt2 step time (default)", median_step_seconds=0.100),
               r("gpt2 step time (expandable)", median_step_seconds=0.101),
               r("gpt2 step time (pyalloc)", median_step_seconds=0.102), run.CheckResult("ipc", "crash", 3.0)]
    got = {t["target"]: t for t in run.targets(results)}
    assert got["gpt2 step time"]["value"] == 1.02 and not got["gpt2 step time"]["met"]
    assert got["gpt2 largest batch"]["value"] == 26 and got["gpt2 largest batch"]["limit"] == 24
    assert got["gpt2 largest batch"]["met"]
    assert not got["no check crashes"]["met"] and got["no check crashes"]["what"] == "ipc"
    md = run.markdown({"date": "2026-11-25", "environment": {}, "checks": [], "targets": list(got.values())})
    assert "- **MISSED** gpt2 step time: 1.02 (limit 1.01" in md


def test_the_batch_search_doubles_then_bisects_to_within_a_32nd() -> None:
    tried: list[int] = []

    def trains(batch: int) -> bool:
        tried.append(batch)
        return batch <= 37

    found = largest_batch(trains, 4, 4096, deadline=float("inf"))
    assert (found.largest, found.first_failing, found.stop) == (37, 38, "out of memory")
    assert tried == [4, 8, 16, 32, 64, 48, 40, 36, 38, 37]


def test_the_batch_search_tries_the_cap_itself_and_stops_on_time() -> None:
    tried: list[int] = []
    found = largest_batch(lambda b: tried.append(b) is None, 3, 10, deadline=float("inf"))
    assert (found.largest, found.first_failing, found.stop, tried) == (10, None, "max_batch", [3, 6, 10])
    found = largest_batch(lambda b: True, 3, 10, deadline=0.0)
    assert (found.largest, found.stop) == (0, "time")


@pytest.fixture(scope="module")
def offload_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """`pyalloc gpu-check --only offload` on the CPU: both models, batches 1, 2 and 4 (about 20 s)."""
    out = tmp_path_factory.mktemp("offload")
    done = _cli("--device", "cpu", "--only", "offload", "--start-batch", "1", "--max-batch", "4", "--steps", "2",
                "--budget", "1500", "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), (out / "gpu-check.md").read_text()


def test_the_offload_check_runs_every_column_and_checkpoint_and_pyalloc_are_exact(
        offload_run: tuple[dict[str, Any], str]) -> None:
    report, _ = offload_run
    assert [c["name"] for c in report["checks"]] == ["offload (gpt-like)", "offload (resnet-like)"]
    for check in report["checks"]:
        assert check["status"] == "pass", check["detail"]
        f = check["figures"]
        assert f["sizes"] == "cpu" and f["common_batch"] == 3  # 90% of the plain step's largest, 4
        assert f["budget_bytes"] == f["baseline_saved_bytes"] // 2 > 0 and f["baseline_repeatable"]
        assert f["determinism"] == "strict"  # every operation of both models has a deterministic kernel
        # no memory cap on the CPU; time enough for every step asked (--steps 2)
        assert f["memory_cap_bytes"] is None and f["common_steps"] == 2
        columns = f["columns"]
        assert list(columns) == ["baseline", "checkpoint", "save_on_cpu", "pyalloc"]
        for c in columns.values():
            # nothing runs out of memory on the CPU: the baseline's search trains 1, 2, 4 and stops
            # at the cap; the others start at the baseline's largest, 4, the cap
            assert (c["largest_batch"], c["first_failing_batch"], c["stop"]) == (4, None, "max_batch")
            assert c["seconds_per_sample"] > 0 and c["step_seconds"] > 0 and c["time_ratio"] > 0
            assert c["steps_at_largest"] == 2
        assert columns["baseline"]["time_ratio"] == 1.0
        for name in ("checkpoint", "pyalloc"):
            assert columns[name]["exact"] and columns[name]["max_abs_diff"] == 0.0, name
        # save_on_cpu(pin_memory=True) repacks a transposed weight contiguously: close, not
        # always bit for bit (pyalloc/gpucheck/offload.py)
        assert columns["save_on_cpu"]["max_abs_diff"] < 1e-6
        ours = columns["pyalloc"]
        # the session dropped and recomputed: its saves stayed near its budget, well under the plain step's
        assert ours["saved_peak_bytes"] <= 1.05 * f["budget_bytes"] < f["baseline_saved_bytes"]
        # its plan re-runs regions or regenerates outputs (the ResNet-like one: outputs alone,
        # through batch-norm refills)
        assert ours["regions"] + ours["outputs"] > 0 and not ours["below_floor_warned"]
        # and it says what it expected them to cost: more than nothing, on the clock it planned by
        assert ours["plan_recompute_seconds"] > 0 and ours["predicted_ratio"] > 1.0
        assert ours["planning_seconds"] > 0  # and what making its plans took


def test_the_offload_check_is_in_the_targets_and_in_gpu_check_md(offload_run: tuple[dict[str, Any], str]) -> None:
    report, md = offload_run
    got = {t["target"]: t for t in report["targets"]}
    for model in ("gpt-like", "resnet-like"):
        largest = got[f"{model} offload largest batch"]
        assert (largest["value"], largest["limit"], largest["met"]) == (4, 4, False)  # both at the cap
        assert "pyalloc max_batch, plain max_batch" in largest["what"]
        assert got[f"{model} offload time per sample"]["value"] > 0
        assert got[f"{model} offload gradients exact"]["met"]
        assert f"## offload ({model})" in md
    assert "| pyalloc | 4 | max_batch |" in md and "| checkpoint | 4 | max_batch |" in md
    assert "- met gpt-like offload gradients exact: 0 (limit 0;" in md
    assert md.count("x the plain step predicted, ") == 2  # each model's plan: predicted against measured


def test_the_offload_check_short_of_time_returns_what_it_measured() -> None:
    # No batch cap and more steps than there is time for: the searches stop on time, the timings
    # run fewer steps, and the figures come out. Whether they come out before the parent would
    # kill the process is a matter of the machine's load (a wall-time assertion here failed once
    # beside a benchmark): what is checked is that time, not the batch cap or the step count,
    # ended every part of the run.
    # 30 s: the searches get half, four ways, after the process's start (importing torch alone
    # took 3 s on a slower machine of this kind, where 15 s left two columns no batch at all)
    limit = 30.0
    cfg = {"device": "cpu", "allocator": "default", "model": "gpt", "start_batch": 1, "max_batch": 1 << 16,
           "steps": 1000, "seconds": 100, "time_limit": limit}
    done = subprocess.run([sys.executable, "-m", "pyalloc.gpucheck.child", "offload", json.dumps(cfg)],
                          capture_output=True, text=True, timeout=120)
    assert run.RESULT_MARKER in done.stdout, done.stderr
    result = json.loads(done.stdout.split(run.RESULT_MARKER)[-1])
    assert result["status"] == "pass", result["detail"]
    f = result["figures"]
    assert f["time_limit_seconds"] == limit and 1 <= f["common_steps"] < 1000
    columns = f["columns"]
    assert columns["baseline"]["stop"] == "time" and columns["baseline"]["largest_batch"] >= 1
    for name, c in columns.items():
        assert c["step_seconds"] > 0 and c["steps_at_largest"] < 1000, name
        if c["largest_batch"] == 0:  # a slow start left its search no time (seen once in a full
            # run): said so, with no time per sample made up for it
            assert c["stop"] == "time" and c["seconds_per_sample"] is None, (name, c)
    assert columns["checkpoint"]["exact"] and columns["pyalloc"]["exact"]


def test_the_offload_check_takes_its_time_limit_from_the_share_run_gives_its_searches() -> None:
    from pyalloc.gpucheck import offload

    assert offload.SEARCH_SHARE == run.OFFLOAD_SEARCH_SHARE  # cfg["seconds"] is that share of the child's limit


def test_offload_targets_compare_pyalloc_with_the_plain_step_and_checkpointing() -> None:
    def column(largest: int, seconds: float, exact: bool = True) -> dict[str, Any]:
        return {"largest_batch": largest, "stop": "out of memory", "step_seconds": seconds,
                "time_ratio": round(seconds / 0.1, 3), "exact": exact}

    figures = {"model": "gpt-like", "common_batch": 90, "baseline_repeatable": True,
               "columns": {"baseline": column(100, 0.100), "checkpoint": column(400, 0.140),
                           "save_on_cpu": column(300, 0.300, exact=False), "pyalloc": column(180, 0.126)}}
    got = {t["target"]: t for t in run.targets([run.CheckResult("offload (gpt-like)", "pass", 1.0, figures)])}
    assert got["gpt-like offload largest batch"]["met"] and got["gpt-like offload largest batch"]["limit"] == 100
    assert got["gpt-like offload time per sample"]["value"] == 0.9 and got["gpt-like offload time per sample"]["met"]
    assert got["gpt-like offload gradients exact"]["met"]  # save_on_cpu's difference is not ours
    figures["columns"]["pyalloc"] = column(100, 0.150, exact=False)
    got = {t["target"]: t for t in run.targets([run.CheckResult("offload (gpt-like)", "pass", 1.0, figures)])}
    assert not any(got[f"gpt-like offload {t}"]["met"] for t in ("largest batch", "time per sample", "gradients exact"))
    assert "pyalloc" in got["gpt-like offload gradients exact"]["what"]


def test_exactness_falls_back_to_warn_only_where_an_operation_has_no_deterministic_kernel() -> None:
    """Strict determinism makes the fused attention kernels' backward deterministic; a model with an
    operation that has no deterministic kernel is compared under warn_only instead, and its
    gradients are still compared, not lost to the refusal. No CPU operation of torch 2.13 raises
    PyTorch's alert (on CUDA adaptive average pooling's backward does), so the model's forward
    raises what the alert raises, with its words, where strict determinism is on."""
    import torch
    from torch import nn

    from pyalloc.gpucheck import offload as check
    from pyalloc.offloading.bench_models import Workload

    class Alerting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
                raise RuntimeError("Alerting.forward does not have a deterministic implementation, but you set "
                                   "'torch.use_deterministic_algorithms(True)'.")
            return self.linear(x)

    class NeedsMoreWhenStrict(nn.Linear):  # as the fused attention's deterministic backward may
        def __init__(self) -> None:
            super().__init__(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
                raise torch.OutOfMemoryError("CUDA out of memory (a test's: strict kernels need more)")
            return super().forward(x)

    for model, expected in ((lambda: nn.Linear(8, 8), "strict"),
                            (Alerting, "warn_only (strict: an operation without a deterministic kernel)"),
                            (NeedsMoreWhenStrict, "warn_only (strict: out of memory)")):
        bench = check.Bench(Workload(model, lambda batch: torch.randn(batch, 8)), "cpu")
        columns = [check.Column(name, bench.model, 0) for name in ("baseline", "checkpoint")]
        bench.model.checkpoint = False  # what the checkpoint column switches (the models' attribute)
        x = bench.input(4)
        mode, diffs = check._exactness(bench, columns, x, lambda c, run: run())
        assert mode == expected
        assert diffs == {"baseline": (True, 0.0), "checkpoint": (True, 0.0)}
        assert not torch.are_deterministic_algorithms_enabled()  # restored


def test_a_column_out_of_memory_at_the_common_batch_leaves_the_other_figures() -> None:
    """pyalloc running out of memory at a batch the plain step trains is a finding, not a lost
    check: its row says out of memory (not exact, no time), the other columns are compared and
    timed, and the targets say what was missed."""
    import torch
    from torch import nn

    from pyalloc.gpucheck import offload as check
    from pyalloc.offloading.bench_models import Workload

    class Full(check.Column):
        def step(self, x: torch.Tensor) -> check.Grads:
            raise torch.OutOfMemoryError("CUDA out of memory (a column that does not fit)")

    bench = check.Bench(Workload(lambda: nn.Linear(8, 8), lambda batch: torch.randn(batch, 8)), "cpu")
    bench.model.checkpoint = False
    columns = [check.Column("baseline", bench.model, 0), check.Column("checkpoint", bench.model, 0),
               check.Column("save_on_cpu", bench.model, 0), Full("pyalloc", bench.model, 1 << 20)]
    repeatable, determinism, timed, rows = check._at_common_batch(bench, columns, 4, 3, float("inf"))
    assert repeatable and determinism == "strict" and timed == 3
    assert rows["pyalloc"]["out_of_memory"] and rows["pyalloc"]["step_seconds"] is None
    assert (rows["pyalloc"]["exact"], rows["pyalloc"]["time_ratio"]) == (False, None)
    for name in ("baseline", "checkpoint", "save_on_cpu"):
        assert rows[name]["exact"] and rows[name]["step_seconds"] > 0 and not rows[name]["out_of_memory"]

    column_row = {"largest_batch": 4, "first_failing_batch": None, "stop": "max_batch", "seconds_per_sample": 0.1,
                  "steps_at_largest": 1}
    figures = {"model": "tiny-like", "common_batch": 4, "baseline_repeatable": True, "budget_bytes": 1 << 20,
               "budget": "a test's", "columns": {name: {**column_row, **row} for name, row in rows.items()}}
    table = run._offload_table("offload (tiny-like)", figures)
    assert [line for line in table if line.startswith("| pyalloc |")] == \
        ["| pyalloc | 4 | max_batch | 0.1 | 1 | out of memory | - | out of memory |"]
    by_name = {t["target"]: t for t in run.offload_targets(figures)}
    assert by_name["tiny-like offload time per sample"]["value"] == "out of memory"
    assert not by_name["tiny-like offload time per sample"]["met"]
    assert by_name["tiny-like offload gradients exact"]["value"] == 1


def test_what_the_budget_left_unfinished_is_named_as_the_next_command() -> None:
    """A GPU session's first run does not fit every check: the report names the --only groups of
    the checks left unrun or cut short, in the run's order, each once, for a second command."""
    args = argparse.Namespace(only=None, start_batch=4, max_batch=4096, steps=10, budget=480.0)
    results = [run.CheckResult("environment", "pass", 4.0),
               run.CheckResult("gpt2 max-batch (pyalloc)", "pass", 20.0),
               run.CheckResult("resnet50 max-batch (default)", "pass", 38.0),
               run.CheckResult("resnet50 max-batch (expandable)", "timeout", 7.5),
               run.CheckResult("resnet50 max-batch (pyalloc)", "not-run", 0.0),
               run.CheckResult("offload (gpt-like)", "fail", 27.0),
               run.CheckResult("tests/gpu", "timeout", 149.0)]
    assert run.unfinished(args, results) == ["resnet50", "tests/gpu"]
    report = {"date": "2026-11-27", "environment": {}, "checks": [], "targets": [],
              "unfinished": run.unfinished(args, results)}
    assert "`pyalloc gpu-check --only resnet50,tests/gpu`" in run.markdown(report)


def test_the_other_columns_search_from_the_batch_the_plain_step_failed_at(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of the other columns' searches starts at the batch it is to pass (starting at the plain
    step's largest spent pyalloc's share on a batch that shows nothing, and on an H200 its search
    stopped by time there), and pyalloc's search gets the largest part of the searches' time.
    The searches, the probe and the timings are recorders: what is checked is what compare asks."""
    from pyalloc.gpucheck import offload as check
    from pyalloc.gpucheck.batch_search import BatchSearch

    asked: list[tuple[str, int, int, float]] = []

    def search(self: Any, column: Any, start: int, cap: int, deadline: float) -> BatchSearch:
        asked.append((column.name, start, cap, deadline - check.time.monotonic()))
        return BatchSearch(8, 9, "out of memory") if column.name == "baseline" else BatchSearch(start, None, "time")

    def at_common(bench: Any, columns: list[Any], batch: int, steps: int, deadline: float) -> Any:
        return True, "strict", 1, {c.name: {} for c in columns}

    monkeypatch.setattr(check.Bench, "search", search)
    monkeypatch.setattr(check, "probed", lambda model, x: (1000, [], []))
    monkeypatch.setattr(check, "_at_common_batch", at_common)
    monkeypatch.setattr(check.Bench, "per_sample", lambda self, column, batch, steps, deadline: (None, 0))
    # a clock that stands still, in a process just started: the shares are fractions of the 70 s,
    # whatever the machine's load and however long the test run has gone on (the time limit
    # counts from the process's start: late in a slow full run it cut the searches' 70 s to 41)
    monkeypatch.setattr(check, "time", types.SimpleNamespace(monotonic=lambda: 1000.0, perf_counter=time.perf_counter))
    monkeypatch.setattr(check, "_process_age", lambda: 0.0)
    figures = check.compare({"device": "cpu", "model": "gpt", "start_batch": 4, "max_batch": 4096, "steps": 1,
                             "seconds": 70, "time_limit": 600})
    assert [(name, start, cap) for name, start, cap, _ in asked] == [
        ("baseline", 4, 4096), ("pyalloc", 9, 24), ("checkpoint", 9, 24), ("save_on_cpu", 9, 24)]
    seconds = {name: share for name, _, _, share in asked}
    # 70 s in parts of 2, 3, 1 and 1, each share of what is left when its search begins (these
    # searches take no time: each leaves all of its share to the next)
    assert seconds["baseline"] == pytest.approx(70.0 * 2 / 7, abs=0.5)
    assert seconds["pyalloc"] == pytest.approx(70.0 * 3 / 5, abs=0.5)
    assert seconds["checkpoint"] == pytest.approx(70.0 / 2, abs=0.5)
    assert seconds["save_on_cpu"] == pytest.approx(70.0, abs=0.5)
    assert figures["common_batch"] == 7 and figures["columns"]["pyalloc"]["largest_batch"] == 9


def test_an_attempts_time_is_predicted_from_the_columns_latest_attempt_not_its_first() -> None:
    """The first attempt of a process pays the device's warm-up: predicting from it stopped the
    plain step's search on an H200 at batch 16 of a model that trained 32 in a tenth of a second."""
    import time

    from pyalloc.gpucheck import offload as check

    class Warming:
        name = "baseline"
        warm = False

        def start(self, x: Any) -> None:
            if not self.warm:
                time.sleep(0.4)  # the first attempt's warm-up
                self.warm = True

        def step(self, x: Any) -> None:
            pass

        def stop(self) -> None:
            pass

    bench = check.Bench.__new__(check.Bench)
    bench.device, bench.rate, bench.attempts = "cpu", {}, {}
    bench.input = lambda batch: None  # type: ignore[method-assign]
    column = Warming()
    assert bench.trains(column, 4) and bench.trains(column, 8)  # type: ignore[arg-type]
    assert [batch for batch, ok, _ in bench.attempts["baseline"]] == [4, 8]
    assert bench.attempts["baseline"][0][2] >= 0.4
    (_, _, first), (_, _, latest) = bench.attempts["baseline"]
    assert bench.rate["baseline"] == pytest.approx(latest / 8, abs=1e-3) and latest < first
    # so a batch that the first attempt's rate says would not end in time is tried
    deadline = time.monotonic() + (latest / 8 + first / 4) / 2 * 64
    assert bench.fits(column, 64, deadline)  # type: ignore[arg-type]


def test_the_offload_report_says_what_pyalloc_predicted_even_when_its_timing_ran_out_of_memory() -> None:
    row = {"largest_batch": 4, "stop": "out of memory", "seconds_per_sample": None, "steps_at_largest": 0,
           "step_seconds": None, "time_ratio": None, "exact": False, "out_of_memory": True, "max_abs_diff": None,
           "attempts": [], "regions": 2, "outputs": 1, "plan_recompute_seconds": 0.0123, "predicted_ratio": 1.1}
    figures = {"common_batch": 4, "budget_bytes": 1 << 20, "budget": "half", "baseline_repeatable": True,
               "columns": {"pyalloc": row}}
    line = run._offload_table("offload (gpt-like)", figures)[-1]
    assert line == ("pyalloc's plan at batch 4: 2 regions and 1 outputs re-run, 12.3 ms a step on the device's "
                    "clock as its profile and plan search measured them: 1.1x the plain step predicted, "
                    "out of memory when timed.")
    row.update(step_seconds=0.2, time_ratio=1.25, exact=True)
    assert run._offload_table("offload (gpt-like)", figures)[-1].endswith("1.1x the plain step predicted, 1.25x measured.")
    row["planning_seconds"] = 0.4567
    assert run._offload_table("offload (gpt-like)", figures)[-1].endswith(
        "1.25x measured. Making its plans took 0.457 s.")
    del row["planning_seconds"]
    del row["predicted_ratio"]  # a report from before the prediction: no such line
    assert "predicted" not in run._offload_table("offload (gpt-like)", figures)[-1]
