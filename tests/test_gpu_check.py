"""``pyalloc gpu-check`` without a GPU: the one-line exit, the orchestration and the report.

The checks themselves need a GPU; here the command runs in its hidden CPU mode (``--device
cpu``), where the training loops run tiny models on the CPU and every check that needs CUDA fails
at once, which is enough to show the processes, the time budget, the files and the targets.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from pyalloc.gpucheck import run  # noqa: E402


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyalloc.cli", "gpu-check", *args], capture_output=True, text=True,
                          timeout=1600)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    done = _cli("--out", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert done.stderr.startswith("pyalloc gpu-check: no GPU to check: torch ")
    assert not any(tmp_path.iterdir())


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
