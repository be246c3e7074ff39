"""pyalloc doctor (issue 22): real training scripts, written here and run as a user runs them.

Through the command (``pyalloc doctor [--json] -- python script.py``, a subprocess with the
bootstrap) and through the context manager in this process (``with pyalloc.doctor(): runpy``),
each classic leak is named at its file:line with its reason, a clean loop has none, and the
peak's parameters, gradients and optimizer state are the bytes computed by hand.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import pyalloc
from pyalloc.diagnosis.session import Doctor

ROOT = Path(__file__).resolve().parents[1]

# nn.Sequential(Linear(32, 64), ReLU(), Linear(64, 8)) in float32, by hand
MLP_PARAM_BYTES = (32 * 64 + 64 + 64 * 8 + 8) * 4
MLP_PARAMS = 4  # tensors: two weights, two biases


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("PYALLOC_DOCTOR", None)
    return env


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body).lstrip())
    return path


def _line_of(path: Path, text: str) -> int:
    lines = [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line]
    assert len(lines) == 1, (text, lines)
    return lines[0]


def _doctor(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyalloc.cli", "doctor", *args], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _doctor_json(script: Path, *options: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    done = _doctor("--json", *options, "--", sys.executable, str(script))
    try:
        return json.loads(done.stdout), done
    except ValueError:
        raise AssertionError(f"not JSON on stdout:\n{done.stdout}\nstderr:\n{done.stderr}") from None


def _in_process(script: Path, **options: Any) -> dict[str, Any]:
    with pyalloc.doctor(print_report=False, **options) as d:
        namespace = runpy.run_path(str(script), run_name="__main__")  # its globals stay alive, as in a script
    assert d.report is not None and namespace
    return d.report


MLP = """
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
"""

# ---- the classic leaks --------------------------------------------------------------------------


def test_outputs_kept_in_a_list_are_named_with_the_list_and_their_graph(tmp_path: Path) -> None:
    script = _script(tmp_path, "train_list.py", MLP + """
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
outputs = []
for step in range(6):
    x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))
    opt.zero_grad()
    out = model(x)
    loss = nn.functional.cross_entropy(out, y)
    loss.backward()
    opt.step()
    outputs.append(out)
print("trained")
""")
    report, done = _doctor_json(script)
    assert done.returncode == 0, done.stderr
    assert "trained" in done.stderr and "trained" not in done.stdout  # --json keeps stdout for JSON
    leak = report["leaks"][0]
    assert (leak["file"], leak["line"]) == (str(script), _line_of(script, "out = model(x)"))
    assert leak["bytes_per_iteration"] == 16 * 8 * 4  # one (16, 8) float32 output an iteration
    assert "`outputs`" in leak["reason"] and "autograd graph" in leak["reason"] and ".detach()" in leak["reason"]
    assert report["growth_bytes_per_iteration"] == 16 * 8 * 4
    assert report["iteration_kind"] == "optimizer step" and report["iterations"] == 6


def test_a_loss_summed_with_its_graph_is_named_at_the_sum(tmp_path: Path) -> None:
    script = _script(tmp_path, "train_sum.py", MLP + """
opt = torch.optim.SGD(model.parameters(), lr=0.1)
total_loss = 0
for step in range(6):
    x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    total_loss += loss
""")
    report = _in_process(script)
    [leak] = report["leaks"]
    assert (leak["file"], leak["line"]) == (str(script), _line_of(script, "total_loss += loss"))
    # backward freed the saved tensors: the growth is the graph (host memory), not tensor bytes
    assert leak["bytes_per_iteration"] == 0 and leak["graph_nodes_per_iteration"] > 0
    assert "`total_loss`" in leak["reason"] and "autograd graph" in leak["reason"] and ".item()" in leak["reason"]


def test_a_hidden_state_never_detached_is_named_with_its_bytes(tmp_path: Path) -> None:
    script = _script(tmp_path, "train_rnn.py", """
import torch
import torch.nn as nn

torch.manual_seed(0)


class Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.rec = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x, h):
        h = torch.tanh(self.inp(x) + self.rec(h))
        return self.out(h), h


model = Cell()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
h = torch.zeros(8, 32)
for step in range(6):
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    opt.zero_grad()
    pred, h = model(x, h)
    loss = ((pred - y) ** 2).mean()
    loss.backward(retain_graph=True)
    opt.step()
""")
    report = _in_process(script)
    by_line = {leak["line"]: leak for leak in report["leaks"]}
    state = by_line[_line_of(script, "h = torch.tanh")]
    assert state["file"] == str(script)
    assert state["bytes_per_iteration"] == 8 * 32 * 4  # tanh's result, saved for its backward
    assert "autograd graph" in state["reason"] and ".detach()" in state["reason"] and "`h`" in state["reason"]
    x_line = by_line[_line_of(script, "x, y = torch.randn(8, 16)")]
    assert x_line["bytes_per_iteration"] == 8 * 16 * 4  # the input the Linear saved
    assert report["leaks"][0] is not x_line or state["bytes_per_iteration"] < x_line["bytes_per_iteration"]
    assert [leak["bytes_per_iteration"] for leak in report["leaks"]] == \
        sorted((leak["bytes_per_iteration"] for leak in report["leaks"]), reverse=True)


def test_evaluation_without_no_grad_is_named_with_eval_mode_and_no_grad(tmp_path: Path) -> None:
    script = _script(tmp_path, "train_eval.py", MLP + """
opt = torch.optim.SGD(model.parameters(), lr=0.1)
xv, yv = torch.randn(64, 32), torch.randint(0, 8, (64,))
val_loss = 0.0
for step in range(6):
    model.train()
    x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    model.eval()
    val_loss = val_loss + nn.functional.cross_entropy(model(xv), yv)
""")
    report = _in_process(script)
    leak = report["leaks"][0]
    assert (leak["file"], leak["line"]) == (str(script), _line_of(script, "val_loss = val_loss +"))
    assert leak["bytes_per_iteration"] >= 64 * 64 * 4  # at least the ReLU's saved (64, 64) result
    assert "eval mode" in leak["reason"] and "torch.no_grad()" in leak["reason"] and "`val_loss`" in leak["reason"]


def test_losses_kept_in_an_attribute_list_are_named_by_class_and_attribute(tmp_path: Path) -> None:
    script = _script(tmp_path, "train_attr.py", MLP + """
class Trainer:
    def __init__(self):
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1)
        self.history = []

    def step(self, x, y):
        self.opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        self.opt.step()
        self.history.append(loss)


trainer = Trainer()
for _ in range(6):
    trainer.step(torch.randn(16, 32), torch.randint(0, 8, (16,)))
""")
    report = _in_process(script)
    leak = report["leaks"][0]
    assert (leak["file"], leak["line"]) == (str(script), _line_of(script, "loss = nn.functional.cross_entropy"))
    assert leak["called_from"] == f"{script}:{_line_of(script, 'trainer.step(')}"
    assert leak["bytes_per_iteration"] == 4  # one float32 scalar an iteration, and its graph
    assert "`Trainer.history`" in leak["reason"] and ".item()" in leak["reason"]


def test_without_an_optimizer_iterations_are_backward_calls(tmp_path: Path) -> None:
    script = _script(tmp_path, "train_manual.py", MLP + """
logits = []
for step in range(6):
    out = model(torch.randn(16, 32))
    out.square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
            p.grad = None
    logits.append(out)
""")
    report = _in_process(script)
    assert report["iteration_kind"] == "backward" and report["iterations"] == 6
    [leak] = report["leaks"]
    assert leak["line"] == _line_of(script, "out = model(") and leak["bytes_per_iteration"] == 16 * 8 * 4
    assert "`logits`" in leak["reason"]


# ---- no false alarm, and the peak by hand -----------------------------------------------------------


CLEAN = MLP + """
import sys
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
losses = []
for step in range(6):
    x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
print("checksum", repr(sum(float(p.detach().double().sum()) for p in model.parameters())), file=sys.stderr)
"""


def test_a_clean_adam_loop_has_no_leak_and_its_peak_matches_the_bytes_by_hand(tmp_path: Path) -> None:
    script = _script(tmp_path, "train_clean.py", CLEAN)
    report, done = _doctor_json(script)
    assert done.returncode == 0, done.stderr
    assert report["leaks"] == [] and report["growth_bytes_per_iteration"] == 0
    peak = report["peak"]
    assert peak["parameters"] == MLP_PARAM_BYTES
    assert peak["gradients"] == MLP_PARAM_BYTES
    # Adam: exp_avg and exp_avg_sq like each parameter, and a float32 `step` scalar per parameter
    assert peak["optimizer_state"] == 2 * MLP_PARAM_BYTES + MLP_PARAMS * 4
    assert report["devices"]["cpu"]["peak_bytes"] == report["peak_bytes"] >= peak["total"]
    # the doctor changes nothing the program computes: the same script run here without it
    plain = io.StringIO()
    with contextlib.redirect_stderr(plain):
        runpy.run_path(str(script), run_name="__main__")
    checksum = [line for line in plain.getvalue().splitlines() if line.startswith("checksum")]
    assert checksum and checksum[0] in done.stderr.splitlines()


def test_optimizer_state_made_late_is_not_a_leak(tmp_path: Path) -> None:
    # A second head first gets gradients at step 3 of 4: Adam makes its state then, once, in one
    # of the two intervals after warm-up (rising in half the intervals is not enough: two rises).
    script = _script(tmp_path, "train_late.py", MLP + """
head2 = nn.Linear(8, 8)
opt = torch.optim.Adam(list(model.parameters()) + list(head2.parameters()), lr=1e-3)
for step in range(4):
    opt.zero_grad()
    out = model(torch.randn(16, 32))
    if step >= 2:
        out = head2(out)
    out.square().mean().backward()
    opt.step()
""")
    report = _in_process(script)
    assert report["iterations"] == 4 and report["leaks"] == []
    assert report["peak"]["optimizer_state"] == 2 * (MLP_PARAM_BYTES + (8 * 8 + 8) * 4) + (MLP_PARAMS + 2) * 4


def test_activations_at_the_peak_are_owned_by_their_top_level_module(tmp_path: Path) -> None:
    script = _script(tmp_path, "train_acts.py", """
import torch
import torch.nn as nn

torch.manual_seed(0)
encoder = nn.Sequential(nn.Linear(8, 512), nn.ReLU())
head = nn.Linear(512, 2)
opt = torch.optim.SGD(list(encoder.parameters()) + list(head.parameters()), lr=0.1)
for step in range(3):
    opt.zero_grad(set_to_none=True)
    out = head(encoder(torch.randn(256, 8)))
    out.square().sum().backward()
    opt.step()
""")
    report = _in_process(script)
    peak = report["peak"]
    # The peak is in backward, when ReLU's backward makes its (256, 512) gradient while the
    # gradient flowing in and ReLU's saved result are alive; the encoder then still holds its
    # input (saved by its Linear) and the ReLU's result: activations of the top-level module
    # `encoder` (a Sequential), by block, and nothing of `head` (its saved input was released).
    assert peak["phase"] == "backward"
    assert peak["activations_by_module"] == {"Sequential": (256 * 512 + 256 * 8) * 4}
    assert peak["activations_by_block"] == {"Sequential.1": 256 * 512 * 4, "Sequential.0": 256 * 8 * 4}
    assert peak["activations"] == peak["activations_float32"] == (256 * 512 + 256 * 8) * 4
    advice = report["advice"]
    assert [a["saves_bytes"] for a in advice] == sorted((a["saves_bytes"] for a in advice), reverse=True)
    changes = {a["change"]: a["saves_bytes"] for a in advice}
    assert changes["half the batch size"] == peak["activations"] // 2
    checkpoint = next(n for c, n in changes.items() if c.startswith("activation checkpointing per block"))
    assert checkpoint == 256 * 8 * 4  # all but the largest block's


class Net(torch.nn.Module):
    """A body and a head: what a DataParallel-wrapped model looks like to the doctor."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU())
        self.head = torch.nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_activations_under_data_parallel_are_owned_by_the_wrapped_model() -> None:
    model = torch.nn.DataParallel(Net())  # without GPUs it runs the module in this thread
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pyalloc.doctor(print_report=False) as d:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(32, 8)).sum().backward()
            opt.step()
    assert d.report is not None
    peak = d.report["peak"]
    assert set(peak["activations_by_module"]) == {"Net"}
    assert set(peak["activations_by_block"]) <= {"Net.body", "Net.head"} and "Net.body" in peak["activations_by_block"]


def test_a_pool_thread_started_in_one_forward_does_not_carry_that_module_into_later_work() -> None:
    # A thread pool's thread starts at the first submit and lives on: started inside Outer's
    # forward, it runs Outer's block then; later, submitted from outside any forward, it runs
    # Other, whose activations are Other's.
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1)

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = torch.nn.Linear(8, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return pool.submit(self.block, x).result()

    outer, other = Outer(), torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU())
    with pyalloc.doctor(print_report=False) as d:
        kept = [outer(torch.randn(16, 8))]  # the pool's thread starts here, inside Outer
        assert {o.top for o in d.tracker.saved_owner.values()} == {"Outer"}
        kept.append(pool.submit(other, torch.randn(16, 8)).result())
        tops = {(o.top, o.child) for o in d.tracker.saved_owner.values()}
    pool.shutdown()
    assert d.threads.threads_watched == 1
    assert tops == {("Outer", "block"), ("Sequential", "0"), ("Sequential", "1")}


def test_a_compiled_model_runs_eagerly_under_the_doctor_and_is_named_by_its_own_class() -> None:
    # Dynamo skips every frame while a TorchDispatchMode that is not PyTorch's own is on the stack
    # ("non-infra torch dispatch mode present"): the compiled model runs as eager code, which the
    # doctor measures. If a later PyTorch compiles under a mode, the frame count says so and
    # docs/doctor.md's limits must change.
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with pyalloc.doctor(print_report=False) as d:
            for _ in range(4):
                opt.zero_grad()
                compiled(torch.randn(16, 32)).sum().backward()
                opt.step()
        assert not torch._dynamo.utils.counters["frames"]  # nothing was compiled
        # Dynamo remembers the frames it skipped: after the doctor they stay eager until a reset
        compiled(torch.randn(16, 32))
        assert not torch._dynamo.utils.counters["frames"]
    finally:
        torch._dynamo.reset()  # the other tests' compiled code compiles again
    assert d.report is not None and d.report["iterations"] == 4 and d.report["leaks"] == []
    peak = d.report["peak"]
    assert peak["parameters"] == MLP_PARAM_BYTES
    assert set(peak["activations_by_module"]) == {"Sequential"}
    assert set(peak["activations_by_block"]) <= {"Sequential.0", "Sequential.1", "Sequential.2"}


# ---- crash, OOM, no optimizer, --steps -------------------------------------------------------------


def test_a_crashing_script_shows_its_traceback_and_a_partial_report(tmp_path: Path) -> None:
    script = _script(tmp_path, "train_crash.py", MLP + """
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    opt.zero_grad()
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    if step == 3:
        raise ValueError("bad batch at step 3")
""")
    done = _doctor("--", sys.executable, str(script))
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr and "ValueError: bad batch at step 3" in done.stderr
    assert "the program failed: ValueError: bad batch at step 3" in done.stdout
    assert "4 iterations (optimizer steps)" in done.stdout and "parameters" in done.stdout


def test_an_out_of_memory_error_gets_the_breakdown_and_ranked_advice(tmp_path: Path) -> None:
    script = _script(tmp_path, "train_oom.py", """
import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    out = model(torch.randn(64, 32))
    if step == 2:  # as a CUDA allocator raises it (here on CPU)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB")
    opt.zero_grad()
    out.sum().backward()
    opt.step()
""")
    report, done = _doctor_json(script)
    assert done.returncode == 1 and "torch.OutOfMemoryError: CUDA out of memory" in done.stderr
    oom = report["oom"]
    assert oom["request_bytes"] == 2 << 30 and oom["device"] == "cuda:0"
    at = oom["breakdown"]
    params = (32 * 256 + 256 + 256 * 256 + 256 + 256 * 8 + 8) * 4
    assert at["parameters"] == params and at["gradients"] == params  # zero_grad() comes after the forward
    assert at["activations"] >= (64 * 32 + 2 * 64 * 256) * 4  # the forward in flight
    changes = {a["change"]: a["saves_bytes"] for a in oom["advice"]}
    assert changes["optimizer.zero_grad(set_to_none=True) before the forward"] == params
    assert changes["half the batch size"] == at["activations"] // 2
    assert [a["saves_bytes"] for a in oom["advice"]] == sorted(changes.values(), reverse=True)
    assert isinstance(oom["other_processes"]["processes"], list)  # no GPU here: an empty list, and why


def test_a_script_without_optimizer_gets_the_peak_and_says_no_iterations(tmp_path: Path) -> None:
    script = _script(tmp_path, "infer.py", MLP + """
with torch.no_grad():
    for _ in range(3):
        y = model(torch.randn(16, 32))
print("done", tuple(y.shape))
""")
    report, done = _doctor_json(script)
    assert done.returncode == 0, done.stderr
    assert "done (16, 8)" in done.stderr  # the program's own stdout, on stderr under --json
    assert any("no iterations were seen" in note for note in report["notes"])
    assert report["iterations"] == 0 and report["leaks"] == [] and report["growth_bytes_per_iteration"] == 0
    assert report["peak"]["parameters"] == MLP_PARAM_BYTES


def test_steps_stops_the_program_after_that_many_iterations(tmp_path: Path) -> None:
    script = _script(tmp_path, "train_long.py", MLP + """
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10_000):
    opt.zero_grad()
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
raise SystemExit("ran to the end")
""")
    report, done = _doctor_json(script, "--steps", "4")
    assert done.returncode == 0 and "ran to the end" not in done.stderr
    assert report["iterations"] == 4 and report["stopped_after_steps"] == 4 and report["leaks"] == []


# ---- several devices -----------------------------------------------------------------------------


def test_per_device_peaks_and_imbalance_by_tensor_device(tmp_path: Path) -> None:
    # No second GPU here: one replica on cpu, one on meta (shapes only), as DataParallel's
    # replicas sit on cuda:0 and cuda:1; attribution is by tensor.device either way.
    script = _script(tmp_path, "train_two.py", """
import torch
import torch.nn as nn

big = nn.Linear(64, 64)
small = nn.Linear(64, 64).to("meta")
opt = torch.optim.SGD(list(big.parameters()) + list(small.parameters()), lr=0.1)
for step in range(3):
    opt.zero_grad()
    big(torch.randn(256, 64)).sum().backward()
    small(torch.randn(16, 64, device="meta")).sum().backward()
    opt.step()
""")
    report = _in_process(script)
    devices = report["devices"]
    assert set(devices) == {"cpu", "meta"}
    params = (64 * 64 + 64) * 4
    # each device holds its replica's parameters and gradients at least, and its own batch
    assert devices["meta"]["peak_bytes"] >= 2 * params + 16 * 64 * 4
    assert devices["cpu"]["peak_bytes"] >= 2 * params + 256 * 64 * 4
    imbalance = report["imbalance"]
    assert imbalance["largest"] == "cpu" and imbalance["smallest"] == "meta"
    assert imbalance["difference_bytes"] == devices["cpu"]["peak_bytes"] - devices["meta"]["peak_bytes"]
    assert set(report["peak"]["devices"]) <= {"cpu", "meta"}


REPLICAS = """
import sys
import threading
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU())
        self.head = nn.Linear(256, 8)

    def forward(self, x):
        return self.head(self.body(x))


torch.manual_seed(0)
replicas = [Net(), Net().to("meta")]  # as DataParallel's replicas on cuda:0 and cuda:1
batches = [512, 128]
opt = torch.optim.SGD([p for r in replicas for p in r.parameters()], lr=0.1)
kept = []


def replica_forward(i, outputs):
    x = torch.randn(batches[i], 64, device=next(replicas[i].parameters()).device)
    out = replicas[i](x)
    outputs[i] = out
    if i == 0:
        kept.append(out)  # a leak made on the replica's thread


for step in range(6):
    opt.zero_grad()
    outputs = [None, None]
    if sys.argv[1] == "threads":
        threads = [threading.Thread(target=replica_forward, args=(i, outputs)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(2):
            replica_forward(i, outputs)
    for out in outputs:
        out.sum().backward()
    outputs = out = None
    opt.step()
"""


def test_replicas_run_on_threads_are_measured_as_on_the_main_thread(tmp_path: Path) -> None:
    # DataParallel runs each replica's forward on a thread of its own (it needs GPUs, so plain
    # threads here, one replica on cpu and one on meta): the per-device peaks and the leak made
    # on a thread are those of the same forwards run one after the other on the main thread.
    script = _script(tmp_path, "train_replicas.py", REPLICAS)
    reports = {}
    for how in ("threads", "inline"):
        done = _doctor("--json", "--", sys.executable, str(script), how)
        assert done.returncode == 0, done.stderr
        reports[how] = json.loads(done.stdout)
    threaded, inline = reports["threads"], reports["inline"]
    assert threaded["threads_watched"] == 12 and inline["threads_watched"] == 0
    params = (64 * 256 + 256 + 256 * 8 + 8) * 4
    assert threaded["devices"]["meta"]["peak_bytes"] >= params + 128 * (64 + 256) * 4
    assert ({d: v["peak_bytes"] for d, v in threaded["devices"].items()}
            == {d: v["peak_bytes"] for d, v in inline["devices"].items()})
    assert threaded["imbalance"] == inline["imbalance"] and threaded["imbalance"]["largest"] == "cpu"
    leak = threaded["leaks"][0]
    assert (leak["file"], leak["line"]) == (str(script), _line_of(script, "return self.head(self.body(x))"))
    assert leak["called_from"] == f"{script}:{_line_of(script, 'out = replicas[i](x)')}"
    assert leak["bytes_per_iteration"] == 512 * 8 * 4 == inline["leaks"][0]["bytes_per_iteration"]
    assert "`kept`" in leak["reason"] and leak["reason"] == inline["leaks"][0]["reason"]
    assert threaded["growth_bytes_per_iteration"] == inline["growth_bytes_per_iteration"]


def test_activations_saved_by_replicas_on_their_threads_belong_to_the_wrapped_model() -> None:
    import copy
    import threading

    class ThreadedDataParallel(torch.nn.DataParallel):  # type: ignore[type-arg]
        """DataParallel's forward without GPUs: new replicas every forward (cpu and meta here),
        each run on a thread of its own, as parallel_apply runs them."""

        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            replicas = [copy.deepcopy(self.module), copy.deepcopy(self.module).to("meta")]
            inputs = [x, torch.empty(8, 8, device="meta")]
            outputs: list[torch.Tensor] = []
            threads = [threading.Thread(target=lambda r, i: outputs.append(r(i)), args=(r, i))
                       for r, i in zip(replicas, inputs)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return outputs

    model = ThreadedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pyalloc.doctor(print_report=False) as d:
        for _ in range(3):
            opt.zero_grad()
            for out in model(torch.randn(32, 8)):
                out.sum().backward(retain_graph=True)  # keeps the graphs' saved tensors until the next step
            opt.step()
    assert d.report is not None
    peak = d.report["peak"]
    assert set(peak["activations_by_module"]) == {"Net"}
    assert set(peak["activations_by_block"]) == {"Net.body", "Net.head"}
    assert set(d.report["devices"]) == {"cpu", "meta"}
    # six sets of replicas ran, but one top-level module is known: the one DataParallel wraps
    assert [label for _ref, label in d.tracker.top_modules.values()] == ["Net"]


def test_several_processes_are_reported_each_and_merged(tmp_path: Path) -> None:
    # As torchrun starts one Python process per rank: a launcher that imports no torch starts two
    # workers; each gets a doctor through the bootstrap, and the command merges their reports.
    worker = _script(tmp_path, "worker.py", """
import sys
import torch
import torch.nn as nn

rank = int(sys.argv[1])
model = nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    opt.zero_grad()
    model(torch.randn(64 * (1 + 3 * rank), 64)).sum().backward()  # rank 1 has 4x the batch
    opt.step()
""")
    launcher = _script(tmp_path, "launch.py", f"""
import subprocess
import sys

workers = [subprocess.Popen([sys.executable, {str(worker)!r}, str(rank)]) for rank in (0, 1)]
sys.exit(max(w.wait() for w in workers))
""")
    report, done = _doctor_json(launcher)
    assert done.returncode == 0, done.stderr
    ranks = sorted(report["processes"], key=lambda r: r["argv"][-1])
    assert [r["argv"][-1] for r in ranks] == ["0", "1"] and all(r["iterations"] == 3 for r in ranks)
    params = (64 * 64 + 64) * 4
    assert all(r["peak"]["parameters"] == params for r in ranks)
    cpu = {f"cpu (pid {r['pid']})": r["devices"]["cpu"]["peak_bytes"] for r in ranks}
    assert {d: v["peak_bytes"] for d, v in report["devices"].items()} == cpu
    assert report["imbalance"]["largest"] == f"cpu (pid {ranks[1]['pid']})"
    assert report["peak_bytes"] == ranks[1]["peak_bytes"] > ranks[0]["peak_bytes"]


# ---- the context manager ---------------------------------------------------------------------------


def test_the_context_manager_stops_at_steps_and_leaves_nothing_behind() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    backward = torch.autograd.backward
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = []
    with pyalloc.doctor(steps=4, print_report=False) as d:
        for _ in range(1000):
            out = model(torch.randn(2, 8))
            opt.zero_grad()
            out.sum().backward()
            opt.step()
            kept.append(out)
    assert isinstance(d, Doctor) and d.report is not None
    # stopped inside the 4th opt.step(), before the loop appended its output
    assert d.report["iterations"] == 4 and d.report["stopped_after_steps"] == 4 and len(kept) == 3
    assert d.report["leaks"][0]["line"] > 0 and "`kept`" in d.report["leaks"][0]["reason"]
    assert torch.autograd.backward is backward and not _get_current_dispatch_mode_stack()
    model(torch.randn(2, 8)).sum().backward()  # hooks are gone: nothing raises or counts
    assert d.optimizer_steps == 4 and d.backward_calls == 4


def test_storages_made_with_no_user_frame_during_backward_name_the_backward_line() -> None:
    # CUDA backward runs on autograd's device threads, where no frame is the user's: a thread
    # running only library code stands in for one (no GPU here). It is started with _thread, as
    # those are started by C++: a threading.Thread would be watched (Note [Doctor's threads]).
    import _thread

    model = torch.nn.Linear(4, 4)
    made: list[torch.Tensor] = []
    with pyalloc.doctor(print_report=False) as d:
        library_code = compile("try:\n    made.append(torch.empty(100)); tracker.note(made[-1])\n"
                               "finally:\n    done.release()", torch.__file__, "exec")
        original = d._original_backward
        assert original is not None

        def backward_on_a_device_thread(*args: Any, **kwargs: Any) -> None:
            original(*args, **kwargs)
            done = _thread.allocate_lock()
            done.acquire()
            _thread.start_new_thread(exec, (library_code, {"torch": torch, "made": made, "tracker": d.tracker,
                                                           "done": done}))
            done.acquire()  # released by the thread when it is done

        d._original_backward = backward_on_a_device_thread
        model(torch.randn(2, 4)).sum().backward()
        line = sys._getframe().f_lineno - 1
    record = next(r for r in d.tracker.live.values() if r.size == 400)
    site = d.sites[record.site]
    assert (site.file, site.line) == (__file__, line)


def test_the_context_manager_refuses_bad_steps() -> None:
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        pyalloc.doctor(steps=0)


# ---- bad arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize("args, needle", [
    ([], "missing command"),
    (["--steps", "0", "--", "python3", "x.py"], "--steps must be a positive integer"),
    (["--steps", "many", "--", "python3", "x.py"], "--steps must be a positive integer"),
    (["--", "no-such-command-pyalloc"], "command not found"),
])
def test_bad_arguments_are_one_line(args: list[str], needle: str) -> None:
    done = _doctor(*args)
    assert done.returncode != 0 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("pyalloc: error: doctor:")


def test_a_command_that_never_imports_torch_is_one_line(tmp_path: Path) -> None:
    done = _doctor("--", sys.executable, "-c", "print('hello')")
    assert done.returncode == 1 and done.stdout == "hello\n"
    assert done.stderr.strip().splitlines() == [
        f"pyalloc: error: doctor: no report: {sys.executable} -c print('hello') exited with status 0 "
        "without a Python process importing torch"]
