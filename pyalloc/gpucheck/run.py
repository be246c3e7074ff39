"""``pyalloc gpu-check``: the one command a machine with a GPU runs, and its report.

Runs, each in a fresh interpreter (:mod:`pyalloc.gpucheck.child`), within a time budget, in the
order of :func:`plan`: the environment under pyalloc; what growing to 60% of the device costs
under PyTorch's default allocator, ``expandable_segments:True`` and pyalloc; a failed allocation
caught as torch.OutOfMemoryError and a batch-size finder converging; a ``cudnn.benchmark``
ResNet-50 step; CUDA graph capture and replay and ``torch.compile(mode="reduce-overhead")``; a
CUDA tensor passed to another process; a snapshot with Python frames read by memory_viz; an
A/B/C of a GPT-2-size and a ResNet-50 training loop with variable shapes under the three
allocators: the largest batch each trains, then the step time and peak reserved of each at one
batch near full memory (90% of the smallest largest batch); the offload check (issue 20,
:mod:`pyalloc.gpucheck.offload`) on a GPT-like and a ResNet-like model under PyTorch's own
allocator: the plain step, ``torch.utils.checkpoint`` on every block,
``save_on_cpu(pin_memory=True)`` and ``pyalloc.offload``, each column's largest batch and time per
sample at it, and at one common batch (90% of the plain step's largest) each column's step time
against the plain step's and its gradients against the plain step's, bit for bit; last,
``tests/gpu`` (when run from a source checkout). Under pyalloc the training and growth figures
carry its own counters: slow-path events and the seconds spent in the driver's memory calls and
waiting for streams (Note [Backend time]).

Writes ``gpu-check.json`` and ``gpu-check.md`` into ``--out``. Targets, printed as met or missed:
(issue 19) step time <= 1.01x PyTorch's default; largest batch >= PyTorch with
expandable_segments; (issue 20) pyalloc.offload's largest batch > the plain step's; its step
time at the common batch <= checkpointing's; checkpointing's and its gradients equal the plain
step's; and no check crashes. Exits 0 when every check ran (failures are in the
report), 1 when the command itself failed, 2 when there is no GPU (one line says why).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..command import Subparsers, UsageError, unwritable
from .child import RESULT_MARKER

EXIT_NO_GPU = 2
ALLOCATORS = ("default", "expandable", "pyalloc")
STEP_TIME_TARGET = 1.01
FEATURE_CHECKS = ("environment", "oom", "cudnn-benchmark", "graphs", "ipc", "snapshot")
OFFLOAD_MODELS = ("gpt", "resnet")  # of pyalloc.offloading.bench_models
OFFLOAD_SHARE = 0.2  # of the budget, kept for the offload check (both models) by the checks before it
TESTS_SHARE = 0.35  # of the budget, kept for tests/gpu, which runs last (its 22 tests took 160-165 s on an H200)
MAX_BATCH_SEARCH_SHARE = 0.75  # of a largest-batch check's time, for the search itself
OFFLOAD_SEARCH_SHARE = 0.5  # of an offload check's time, for its largest-batch searches; the rest times steps


@dataclass
class CheckResult:
    name: str
    status: str  # pass, fail, crash (no result: the child died), timeout, not-run
    seconds: float
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


def _child_env(allocator: str) -> dict[str, str]:
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for key in ("PYALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYALLOC_PATCH_TORCH"):
        env.pop(key, None)
    if allocator == "pyalloc":
        env["PYALLOC_CONF"] = "backend=cuda"
    elif allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def run_child(name: str, check: str, cfg: dict[str, Any], timeout: float) -> CheckResult:
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pyalloc.gpucheck.child", check, json.dumps(cfg)],
                              capture_output=True, text=True, timeout=max(1.0, timeout),
                              env=_child_env(cfg.get("allocator", "default")))
    except subprocess.TimeoutExpired:
        return CheckResult(name, "timeout", time.monotonic() - start, detail=f"did not finish within {timeout:.0f} s")
    seconds = time.monotonic() - start
    lines = [line[len(RESULT_MARKER):] for line in done.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-3:]
        return CheckResult(name, "crash", seconds, detail=f"exit status {done.returncode}: " + " | ".join(tail))
    result = json.loads(lines[-1])
    detail = result.get("detail", "")
    if result.get("traceback"):
        detail += "\n" + result["traceback"]
    return CheckResult(name, result["status"], seconds, result.get("figures", {}), detail)


def run_gpu_tests(timeout: float, out: Path | None = None) -> CheckResult:
    """pytest on tests/gpu. With ``out``: pytest's output goes to ``out/tests-gpu.log``, and each
    test's outcome, with a failure's whole report, to ``out/tests-gpu-results.log`` as it finishes
    (tests/gpu/conftest.py writes it where PYALLOC_GPU_TEST_LOG says), so a run stopped by the
    time budget still says why every finished test failed."""
    tests = Path(__file__).resolve().parents[2] / "tests" / "gpu"
    if not tests.is_dir():
        return CheckResult("tests/gpu", "not-run", 0.0, detail=f"{tests} is not here (run from a source checkout)")
    start = time.monotonic()
    env = _child_env("default")
    log = results_log = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        log, results_log = out / "tests-gpu.log", out / "tests-gpu-results.log"
        results_log.unlink(missing_ok=True)
        env["PYALLOC_GPU_TEST_LOG"] = str(results_log)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
                                   f"--junitxml={junit}"], capture_output=True, text=True, timeout=timeout,
                                  cwd=tests.parents[1], env=env)
        except subprocess.TimeoutExpired as exc:
            _write_log(log, exc.stdout, exc.stderr)
            return CheckResult("tests/gpu", "timeout", time.monotonic() - start, _outcomes(results_log),
                               detail=f"over {timeout:.0f} s")
        _write_log(log, done.stdout, done.stderr)
        figures: dict[str, Any] = {}
        failed: list[str] = []
        if junit.is_file():
            root = ET.parse(junit).getroot()
            found = root if root.tag == "testsuite" else root.find("testsuite")
            suite = found if found is not None else root
            for key in ("tests", "failures", "errors", "skipped"):
                figures[key] = int(suite.get(key, 0))
            for case in suite.iter("testcase"):
                if case.find("failure") is not None or case.find("error") is not None:
                    failed.append(f"{case.get('classname')}.{case.get('name')}")
    status = "pass" if done.returncode == 0 else "fail"
    detail = "; ".join(failed[:20]) or (done.stdout.strip().splitlines() or [""])[-1]
    return CheckResult("tests/gpu", status, time.monotonic() - start, figures, detail)


def _outcomes(results_log: Path | None) -> dict[str, Any]:
    """Counts of the outcomes tests/gpu's per-test log recorded (a run that timed out)."""
    if results_log is None or not results_log.is_file():
        return {}
    counts: dict[str, int] = {}
    for line in results_log.read_text(errors="replace").splitlines():
        word = line.split(" ", 1)[0]
        if word in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
            counts[word.lower()] = counts.get(word.lower(), 0) + 1
    return counts


def _write_log(log: Path | None, stdout: str | bytes | None, stderr: str | bytes | None) -> None:
    """pytest's whole output beside the report: the report names failed tests, the log says why."""
    if log is None:
        return
    text = [part.decode(errors="replace") if isinstance(part, bytes) else part for part in (stdout, stderr) if part]
    log.write_text("\n".join(text))


def gpu_reason() -> str | None:
    """Why there is no GPU to check, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    return None


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass(frozen=True)
class Planned:
    """One child check of the run: ``share`` is the most it may take, ``reserve`` what the checks
    before it must leave for it (both fractions of the budget)."""

    name: str
    group: str  # what --only names
    check: str  # the child's check, or "tests/gpu"
    cfg: dict[str, Any]
    share: float
    reserve: float = 0.0


def plan(args: argparse.Namespace) -> list[Planned]:
    """The run, most telling first. A GPU session has 15 minutes of device time, start and build
    included, and one command may run 10 (the first run on an H200: building the library and the
    torch layer took 55 s, tests/gpu needed over 140 s, the six feature checks 112 s, one GPT-2
    largest-batch search 17-34 s): the default budget of 480 s fits one command with room to
    build. What does not fit is not-run, and ``--only`` runs it next.
    Order: the environment; what growing costs under each allocator (the figure that says why one
    is slower); the features under pyalloc; the A/B/C of GPT-2 then ResNet-50 (a model's second
    and third largest-batch searches double from the largest batch an allocator before trained,
    not from ``--start-batch``: on an H200 ResNet-50's first search, from 4 to 2,496, took 29 s);
    the offload check (a fifth of the budget kept for it); last, tests/gpu with 35% kept for it (its
    22 tests took 160-165 s on an H200), whose per-test log (tests-gpu-results.log) keeps the
    details of every test that finished even when time runs out."""
    steps: list[Planned] = [Planned("environment", "environment", "environment", {"allocator": "pyalloc"}, 0.04)]
    steps += [Planned(f"growth ({a})", "growth", "growth", {"allocator": a}, 0.04) for a in ALLOCATORS]
    steps += [Planned(c, c, c, {"allocator": "pyalloc"}, 0.08) for c in FEATURE_CHECKS if c != "environment"]
    for model in ("gpt2", "resnet50"):
        steps += [Planned(f"{model} max-batch ({a})", model, "train",
                          {"allocator": a, "model": model, "mode": "max-batch", "start_batch": args.start_batch,
                           "max_batch": args.max_batch}, 0.08) for a in ALLOCATORS]
        steps += [Planned(f"{model} step time ({a})", model, "train",
                          {"allocator": a, "model": model, "mode": "time", "steps": args.steps}, 0.05)
                  for a in ALLOCATORS]
    each = OFFLOAD_SHARE / len(OFFLOAD_MODELS)
    steps += [Planned(f"offload ({model}-like)", "offload", "offload",
                      {"allocator": "default", "model": model, "start_batch": args.start_batch,
                       "max_batch": args.max_batch, "steps": args.steps}, each, each) for model in OFFLOAD_MODELS]
    steps.append(Planned("tests/gpu", "tests/gpu", "tests/gpu", {}, 1.0, TESTS_SHARE))
    if not args.only:
        return steps
    wanted = set(args.only.split(","))
    chosen = [p for p in steps if p.group in wanted]
    # The shares are of the whole run's budget; checks run alone get all of it between them
    # (`--only offload --budget 200`: 100 s a model, not the 20 s each has in the whole run).
    scale = max(1.0, 1.0 / sum(p.share for p in chosen)) if chosen else 1.0
    return [Planned(p.name, p.group, p.check, p.cfg, min(1.0, p.share * scale), p.reserve * scale) for p in chosen]


def run_checks(args: argparse.Namespace, device: str, say: Any) -> list[CheckResult]:
    budget = Budget(args.budget)
    results: list[CheckResult] = []
    steps = [p for p in plan(args) if device == "cuda" or p.check != "tests/gpu"]
    largest: dict[str, dict[str, int]] = {}  # model -> allocator -> largest batch

    for i, step in enumerate(steps):
        kept = sum(later.reserve for later in steps[i + 1:]) * args.budget
        left = budget.left() - kept
        timeout = min(left, step.share * args.budget)
        cfg = dict(step.cfg)
        found = largest.get(cfg.get("model", ""), {})
        if cfg.get("mode") == "time":  # 90% of the smallest largest batch of the model's searches
            cfg["batch"] = max(1, int(0.9 * min(found.values()))) if found else args.start_batch
        elif cfg.get("mode") == "max-batch" and found:  # from where an allocator before trained
            cfg["start_batch"] = max(args.start_batch, min(found.values()))
        if timeout < 5:
            result = CheckResult(step.name, "not-run", 0.0, detail="the time budget was spent")
        elif step.check == "tests/gpu":
            result = run_gpu_tests(timeout, Path(args.out))
        else:
            if step.check == "offload":  # the searches take half of its time, the rest times steps
                cfg.update(seconds=OFFLOAD_SEARCH_SHARE * timeout, time_limit=timeout)
            elif cfg.get("mode") == "max-batch":  # the search stops in time to report what it found
                cfg["seconds"] = MAX_BATCH_SEARCH_SHARE * timeout
            result = run_child(step.name, step.check, {"device": device, **cfg}, timeout)
        if cfg.get("mode") == "max-batch" and result.status == "pass":
            largest.setdefault(cfg["model"], {})[cfg["allocator"]] = int(result.figures["largest_batch"])
        results.append(result)
        say(f"{result.name:<32} {result.status:<8} {result.seconds:6.1f} s  "
            f"{result.detail.splitlines()[0] if result.detail else ''}")
    return results


def _find(results: list[CheckResult], name: str) -> CheckResult | None:
    return next((r for r in results if r.name == name), None)


def targets(results: list[CheckResult]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for model in ("gpt2", "resnet50"):
        times = {a: _find(results, f"{model} step time ({a})") for a in ALLOCATORS}
        batches = {a: _find(results, f"{model} max-batch ({a})") for a in ALLOCATORS}
        t_py, t_def = times["pyalloc"], times["default"]
        if t_py and t_def and t_py.status == t_def.status == "pass":
            ratio = t_py.figures["median_step_seconds"] / t_def.figures["median_step_seconds"]
            out.append({"target": f"{model} step time", "value": round(ratio, 3), "limit": STEP_TIME_TARGET,
                        "met": ratio <= STEP_TIME_TARGET, "what": "pyalloc / PyTorch default, median step"})
        b_py, b_exp = batches["pyalloc"], batches["expandable"]
        if b_py and b_exp and b_py.status == b_exp.status == "pass":
            py, exp = b_py.figures["largest_batch"], b_exp.figures["largest_batch"]
            stops = f"searches stopped by: pyalloc {b_py.figures.get('stop', '?')}, " \
                    f"expandable {b_exp.figures.get('stop', '?')}"
            out.append({"target": f"{model} largest batch", "value": py, "limit": exp, "met": py >= exp,
                        "what": f"pyalloc's largest batch against PyTorch with expandable_segments:True ({stops})"})
    for model in OFFLOAD_MODELS:
        result = _find(results, f"offload ({model}-like)")
        if result and result.status == "pass":
            out += offload_targets(result.figures)
    crashed = [r.name for r in results if r.status in ("crash", "timeout")]
    out.append({"target": "no check crashes", "value": len(crashed), "limit": 0, "met": not crashed,
                "what": ", ".join(crashed) or "none crashed or timed out"})
    return out


def offload_targets(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 20's targets from one offload check: pyalloc.offload trains a larger batch than the plain
    step, takes no more time per sample than checkpointing at the same batch, and, like
    checkpointing, leaves the gradients bit for bit those of the plain step."""
    model, columns = figures["model"], figures["columns"]
    base, ckpt, ours, swap = (columns[c] for c in ("baseline", "checkpoint", "pyalloc", "save_on_cpu"))
    timed = ours["step_seconds"] is not None and ckpt["step_seconds"] is not None
    ratio: Any = round(ours["step_seconds"] / ckpt["step_seconds"], 3) if timed else "out of memory"
    inexact = [c for c in ("checkpoint", "pyalloc") if not columns[c]["exact"]]
    return [
        {"target": f"{model} offload largest batch", "value": ours["largest_batch"], "limit": base["largest_batch"],
         "met": ours["largest_batch"] > base["largest_batch"],
         "what": f"pyalloc.offload's largest batch, to exceed the plain step's (searches stopped by: "
                 f"pyalloc {ours['stop']}, plain {base['stop']})"},
        {"target": f"{model} offload time per sample", "value": ratio, "limit": 1.0, "met": timed and ratio <= 1.0,
         "what": f"pyalloc.offload / checkpoint on every block at the common batch {figures['common_batch']} "
                 f"(against the plain step: pyalloc {ours['time_ratio']}x, checkpoint {ckpt['time_ratio']}x)"},
        {"target": f"{model} offload gradients exact", "value": len(inexact), "limit": 0, "met": not inexact,
         "what": f"checkpoint and pyalloc.offload against the plain step, bit for bit: "
                 f"{', '.join(inexact) or 'both equal'} (save_on_cpu: {'equal' if swap['exact'] else 'differs'}; "
                 f"two plain steps {'agreed' if figures['baseline_repeatable'] else 'differed'})"},
    ]


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"# pyalloc gpu-check, {report['date']}", "",
             f"Device: {env.get('device', '?')} ({_gib(env.get('total_memory_bytes'))}), torch {env.get('torch', '?')}, "
             f"CUDA {env.get('cuda', '?')}, pyalloc {env.get('pyalloc', '?')}; allocator under pyalloc: "
             f"{env.get('allocator', '?')}. Every figure here was measured in this run.", "",
             "| check | status | seconds | figures / detail |", "|---|---|---|---|"]
    for r in report["checks"]:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in r["figures"].items()
                          if k != "allocator" and not isinstance(v, dict))
        detail = (r["detail"].splitlines() or [""])[0]
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.1f} | {shown}{' — ' if shown and detail else ''}{detail} |")
    for r in report["checks"]:
        if "columns" in r["figures"]:
            lines += _offload_table(r["name"], r["figures"])
    lines += ["", "## Targets", ""]
    for t in report["targets"]:
        lines.append(f"- {'met' if t['met'] else '**MISSED**'} {t['target']}: {t['value']} (limit {t['limit']}; {t['what']})")
    if report.get("unfinished"):
        lines += ["", f"Not finished in the budget: {', '.join(report['unfinished'])} "
                      f"(next: `pyalloc gpu-check --only {','.join(report['unfinished'])}`)."]
    return "\n".join(lines) + "\n"


def _offload_table(name: str, figures: dict[str, Any]) -> list[str]:
    common = figures["common_batch"]
    cap = figures.get("memory_cap_bytes")
    lines = ["", f"## {name}", "",
             f"pyalloc's budget: {figures['budget_bytes']} bytes ({figures['budget']}). Two plain steps "
             f"{'agreed' if figures['baseline_repeatable'] else 'differed'} bit for bit (deterministic algorithms: "
             f"{figures.get('determinism', '?')}); allocated when the common batch began: "
             f"{_gib(figures.get('allocated_before_common_bytes'))}. Device memory capped at "
             f"{_gib(cap) if cap else figures.get('memory_cap', 'none')} (peak reserved "
             f"{_gib(figures.get('peak_reserved_bytes'))}); step times at the common batch are medians of "
             f"{figures.get('common_steps', '?')} repetitions; time limit {figures.get('time_limit_seconds', '?')} s.", "",
             f"| column | largest batch | search stopped by | time per sample at it (s) | steps timed at it "
             f"| step at batch {common} (s) | against the plain step | gradients equal the plain step's |",
             "|---|---|---|---|---|---|---|---|"]
    for column, c in figures["columns"].items():
        per_sample = "-" if c["seconds_per_sample"] is None else f"{c['seconds_per_sample']:.4g}"
        exact = "yes" if c["exact"] else "out of memory" if c.get("out_of_memory") else \
            f"no (max difference {c['max_abs_diff']})"
        step = "out of memory" if c["step_seconds"] is None else f"{c['step_seconds']:.4g}"
        ratio = "-" if c["time_ratio"] is None else f"{c['time_ratio']}x"
        lines.append(f"| {column} | {c['largest_batch']} | {c['stop']} | {per_sample} | {c.get('steps_at_largest', '?')} "
                     f"| {step} | {ratio} | {exact} |")
    searched = [f"{column} " + ", ".join(f"{batch}{'' if ok else ' (failed)'} {seconds:.2g} s"
                                         for batch, ok, seconds in c["attempts"])
                for column, c in figures["columns"].items() if c.get("attempts")]
    if searched:
        lines += ["", "The searches' attempts (batch, seconds: a fresh start and the steps): " + "; ".join(searched) + "."]
    ours = figures["columns"].get("pyalloc", {})
    if ours.get("predicted_ratio") is not None:
        measured = "out of memory when timed" if ours.get("time_ratio") is None else f"{ours['time_ratio']}x measured"
        lines += ["", f"pyalloc's plan at batch {common}: {ours.get('regions', '?')} regions and "
                      f"{ours.get('outputs', '?')} outputs re-run, {ours['plan_recompute_seconds'] * 1e3:.3g} ms "
                      f"a step on the device's clock as its profile and plan search measured them: "
                      f"{ours['predicted_ratio']}x the plain step predicted, {measured}."]
        if ours.get("planning_seconds") is not None:  # (reports before 2026-11-29 have none)
            lines[-1] += f" Making its plans took {ours['planning_seconds']:.3g} s."
    return lines


def _gib(value: Any) -> str:
    return f"{value / (1 << 30):.1f} GiB" if isinstance(value, (int, float)) else "?"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def unfinished(args: argparse.Namespace, results: list[CheckResult]) -> list[str]:
    """The ``--only`` groups, in the run's order, of the checks that the time budget left unrun or
    cut short: what a second command on the same machine runs (a GPU session's first run does
    not fit everything: docs/benchmarks/2026-11-27-gpu-check-h200-run4.md)."""
    group_of = {p.name: p.group for p in plan(args)}
    groups: list[str] = []
    for r in results:
        group = group_of.get(r.name)
        if r.status in ("not-run", "timeout") and group is not None and group not in groups:
            groups.append(group)
    return groups


def _check_options(args: argparse.Namespace) -> Path:
    """The options, checked before anything runs (a GPU session's minutes are the scarcest thing
    this command spends: a review found a mistyped --only name that ran nothing and reported
    success, a NaN budget, and an unwritable --out found only after every check had run).
    Returns the report folder (made when the report is written)."""
    if not math.isfinite(args.budget) or args.budget < 10:
        raise UsageError(f"--budget must be a finite number of seconds, at least 10, got {args.budget}")
    for flag, value in (("--start-batch", args.start_batch), ("--max-batch", args.max_batch), ("--steps", args.steps)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if args.only is not None:
        known = list(dict.fromkeys(p.group for p in plan(argparse.Namespace(**{**vars(args), "only": None}))))
        names = [n.strip() for n in args.only.split(",") if n.strip()]  # (a trailing comma is fine)
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise UsageError(f"--only: unknown check {', '.join(map(repr, unknown)) or repr(args.only)} "
                             f"(known: {', '.join(known)})")
        args.only = ",".join(names)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: not a folder")
    if (problem := unwritable(out, makes_folder=True)) is not None:  # the folder is made when the report is written
        raise UsageError(f"--out {out}: {problem}")
    return out


def _gpu_check(args: argparse.Namespace) -> int:
    device = args.device
    out = _check_options(args)
    if device == "cuda":
        reason = gpu_reason()
        if reason is not None:
            print(f"pyalloc gpu-check: no GPU to check: {reason}", file=sys.stderr)
            if args.json:  # a script that reads stdout gets an answer too
                print(json.dumps({"gpu": False, "reason": reason, "checks": []}))
            return EXIT_NO_GPU
    say = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    results = run_checks(args, device, say)
    environment = _find(results, "environment")
    report = {"date": datetime.date.today().isoformat(), "device_kind": device,
              "environment": environment.figures if environment else {},
              "checks": [asdict(r) for r in results], "targets": targets(results),
              "unfinished": unfinished(args, results)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu-check.md").write_text(markdown(report))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for t in report["targets"]:
            print(f"{'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']} (limit {t['limit']})")
        print(f"report: {out / 'gpu-check.json'}, {out / 'gpu-check.md'}")
        if report["unfinished"]:
            print(f"not finished in the budget: {', '.join(report['unfinished'])}; next: "
                  f"pyalloc gpu-check --only {','.join(report['unfinished'])} --out {out}-rest")
    return 0


def register_cli(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "gpu-check", help="run everything that needs a GPU and write one report",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-check", metavar="DIR", help="where the report goes (default ./gpu-check)")
    parser.add_argument("--budget", type=float, default=480.0, metavar="S",
                        help="seconds for the whole run (default 480: one 10-minute device command, with "
                             "room to build first)")
    parser.add_argument("--only", metavar="NAME,...",
                        help="only these: " + ", ".join(FEATURE_CHECKS) + ", growth, gpt2, resnet50, offload, tests/gpu")
    parser.add_argument("--start-batch", type=int, default=4, help="first batch of the largest-batch search")
    parser.add_argument("--max-batch", type=int, default=4096, help="the search stops there")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per allocator and per offload column")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    parser.set_defaults(handler=_gpu_check)
