"""`pyalloc run --offload`: the offload manager applied to an unmodified training script, the
process-wide session behind it, and the offload counters in `pyalloc.memory_stats()`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

import pyalloc
from pyalloc import cli
from pyalloc.offloading import process as offload_process
from pyalloc.pytorch import run as run_command
from pyalloc.offloading.session import OffloadError, offload

from test_cli import child_env, pyalloc_cli

# A training script that knows nothing of pyalloc: dropout, both ways of calling backward, an
# in-place update of the parameters, batches from a forked DataLoader worker that reports whether
# the session's call-recording mode is active there.
TRAIN_SCRIPT = '''
import sys
import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.data import DataLoader, Dataset


class Batches(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(64, 64, generator=g), len(_get_current_function_mode_stack())


def main(out):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Dropout(0.1), nn.Linear(512, 512),
                          nn.Tanh(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    loader = DataLoader(Batches(), batch_size=2, num_workers=1, multiprocessing_context="fork")
    grads, worker_modes = [], []
    for step, (x, modes) in enumerate(loader):
        worker_modes += modes.tolist()
        loss = model(x.flatten(0, 1)).square().mean()
        if step % 2:
            torch.autograd.backward(loss)
        else:
            loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        model.zero_grad(set_to_none=True)
    torch.save({"grads": grads, "params": [p.detach() for p in model.parameters()],
                "worker_modes": worker_modes}, out)


if __name__ == "__main__":
    main(sys.argv[1])
'''

STEPS = 4
# 65% of the script's saved activations: 5 of 128 x 512 float32 and the dropout's mask, 1.5 MiB
# (Note [Step-made leaves]); the floor is 773 KiB
BUDGET = 832 << 10


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=300)


def _assert_bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), f"differs by up to {(x - y).abs().max()}"


# ---- pyalloc run --offload ------------------------------------------------------------------


def test_run_offload_trains_an_unmodified_script_bit_for_bit_and_evicts(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    # One CPU thread in both: the comparison is of the offload manager, not of how a loaded
    # machine splits a matmul.
    env = child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    plain = subprocess.Popen([sys.executable, str(script), str(tmp_path / "plain.pt")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # meanwhile
    stats_path = tmp_path / "stats.json"
    run = pyalloc_cli("run", f"--offload={BUDGET}", f"--offload-stats={stats_path}", "--",
                      sys.executable, str(script), str(tmp_path / "offload.pt"), env=env)
    _, plain_err = plain.communicate(timeout=300)
    assert plain.returncode == 0, plain_err
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr

    expected, got = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "offload.pt")
    assert len(got["grads"]) == STEPS
    for step_expected, step_got in zip(expected["grads"], got["grads"]):
        _assert_bitwise_equal(step_expected, step_got)
    _assert_bitwise_equal(expected["params"], got["params"])
    assert got["worker_modes"] == [0] * STEPS * 2  # the DataLoader worker left the session

    stats = json.loads(stats_path.read_text())
    assert stats["budget_bytes"] == BUDGET
    assert stats["steps_total"] == STEPS  # one step per backward, however it was called
    assert stats["evictions_total"] > 0
    assert stats["swap_out_bytes_total"] + stats["dropped_bytes_total"] > 0
    # the promise, budget + 5%, once the plan has settled (a step of the plan search may try a
    # plan over it, and the search then settles on one that kept it)
    assert stats["plan_settled"] == 1 and stats["step_saved_bytes_peak"] <= BUDGET * 1.05
    assert stats["planned_steps_total"] == STEPS - 1  # the first step is profiled
    assert "below the floor" not in run.stderr
    assert stats["resident_bytes"] == 0 and stats["swapped_out_bytes"] == 0  # all released


@pytest.mark.parametrize("value", ["50%", "lots", "-1KiB", ""])
def test_run_offload_bad_budget_is_one_line_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", f"--offload={value}", "--", sys.executable, "-c", "print('ran')"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pyalloc: error: --offload: ")
    assert repr(value) in err and "512MiB" in err


def test_run_offload_stats_needs_offload(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--offload-stats=s.json", "--", sys.executable, "-c", "pass"]) == 2
    assert "--offload-stats needs --offload" in capsys.readouterr().err


def test_run_offload_sets_the_environment_the_bootstrap_reads() -> None:
    env = run_command.child_environment({}, None, "512MiB", "/tmp/s.{pid}.json")
    assert env["PYALLOC_OFFLOAD"] == "512MiB"
    assert env["PYALLOC_OFFLOAD_STATS"] == "/tmp/s.{pid}.json"
    assert "PYALLOC_OFFLOAD" not in run_command.child_environment({}, None)


def test_bootstrap_refuses_a_bad_offload_environment_in_one_line() -> None:
    env = run_command.child_environment(child_env(), None, "bogus")
    result = _python("import torch; print('ran')", env)
    assert result.returncode == 1
    assert "ran" not in result.stdout
    lines = [line for line in result.stderr.strip().splitlines() if "warning: CUDA" not in line]
    assert lines == [line for line in lines if line.startswith("pyalloc: error: ")] and len(lines) == 1, result.stderr
    assert "cannot start the offload session" in lines[0] and "'bogus'" in lines[0]


def test_bootstrap_offload_without_budget_on_cpu_warns_and_evicts_nothing(tmp_path: Path) -> None:
    stats_path = tmp_path / "stats.json"
    env = run_command.child_environment(child_env(), None, "auto", str(stats_path))
    result = _python(
        """
        import torch
        x = torch.randn(256, 256, requires_grad=True)
        (x.exp() @ x).tanh().sum().backward()
        print("ran")
        """,
        env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ran"
    assert "--offload without a budget" in result.stderr
    stats = json.loads(stats_path.read_text())
    assert stats["budget_bytes"] == -1 and stats["saved_tensors_total"] > 0
    assert stats["evictions_total"] == 0 and stats["steps_total"] == 1


# ---- the process-wide session, in this process ----------------------------------------------


@pytest.fixture
def process_session() -> Iterator[None]:
    """Stops the process-wide session a test starts, whatever happens in the test."""
    yield
    offload_process.stop()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 10))


def _steps(model: nn.Module) -> list[list[torch.Tensor]]:
    """Three steps, backward called three ways; the gradients of each."""
    out = []
    params = list(model.parameters())
    for step in range(3):
        torch.manual_seed(step)
        loss = model(torch.randn(128, 64)).square().mean()
        if step == 0:
            loss.backward()
        elif step == 1:
            torch.autograd.backward(loss)
        else:
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p.grad = g
        out.append([p.grad.clone() for p in params])
        model.zero_grad(set_to_none=True)
    return out


def test_process_session_recomputes_bit_for_bit_and_ends_one_step_per_backward(process_session) -> None:
    expected = _steps(_mlp())
    model = _mlp()
    session = offload_process.start(0, swap=False, min_evict_bytes=4096, pressure_callback=False)
    got = _steps(model)
    st = session.stats()
    for e, g in zip(expected, got):
        _assert_bitwise_equal(e, g)
    assert st["steps_total"] == 3
    assert st["recomputed_tensors_total"] > 0 and st["swap_outs_total"] == 0
    assert st["resident_bytes"] == 0


def test_process_session_double_backward_is_exact(process_session) -> None:
    """Autograd entry points are never recorded as producers: a create_graph backward saves
    tensors too, and replaying the backward call to regenerate them would run it again."""

    def gradient_penalty_step(model: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(7)
        x = torch.randn(128, 64, requires_grad=True)
        y = model(x)
        (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        (y.square().mean() + g.square().mean()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return grads

    expected = gradient_penalty_step(_mlp())
    model = _mlp()
    session = offload_process.start(0, swap=False, min_evict_bytes=4096, pressure_callback=False)
    _assert_bitwise_equal(expected, gradient_penalty_step(model))
    assert session.stats()["recomputed_tensors_total"] > 0


def test_process_session_does_not_keep_earlier_steps_alive_through_a_carried_tensor(process_session) -> None:
    """A tensor carried into the next step (an RNN state) must not chain that step's call
    records, and through them every earlier input batch, to it."""
    torch.manual_seed(0)
    cell = nn.Linear(256, 256)
    batches = [torch.randn(64, 256) for _ in range(3)]  # made outside the session, as a DataLoader's
    batch_refs = [weakref.ref(x) for x in batches]
    offload_process.start(None, pressure_callback=False)
    state = torch.zeros(64, 256)
    for _ in range(3):
        x = batches.pop(0)
        out = cell(x + state).tanh()
        out.sum().backward()
        state = out.detach()
        del x, out
    assert [r() is None for r in batch_refs] == [True, True, True]


def test_process_session_runs_compiled_regions_exactly(process_session) -> None:
    """Dynamo must not trace the recording mode, and AOTAutograd's tracing of backward (an
    autograd.grad call) must not end a step; what the region saves is swapped."""
    model = _mlp()
    compiled = torch.compile(model, backend="aot_eager")

    def steps() -> list[list[torch.Tensor]]:
        out = []
        for step in range(2):
            torch.manual_seed(step)
            compiled(torch.randn(128, 64)).square().mean().backward()
            out.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        return out

    expected = steps()
    session = offload_process.start(0, min_evict_bytes=4096, pressure_callback=False)
    got = steps()
    for e, g in zip(expected, got):
        _assert_bitwise_equal(e, g)
    st = session.stats()
    assert st["steps_total"] == 2
    assert st["swap_outs_total"] > 0 and st["recomputed_tensors_total"] == 0


def test_stop_restores_autograd_and_leaves_no_hooks(process_session) -> None:
    backward, grad = torch.autograd.backward, torch.autograd.grad
    offload_process.start(1 << 20, pressure_callback=False)
    assert torch.autograd.backward is not backward and torch.autograd.backward.__wrapped__ is backward
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    offload_process.stop()
    assert torch.autograd.backward is backward and torch.autograd.grad is grad
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert offload_process.session() is None
    with offload(pressure_callback=False):  # the thread is free for a session of its own
        pass


def test_explicit_offload_under_the_process_session_is_refused(process_session) -> None:
    offload_process.start(1 << 20, pressure_callback=False)
    with pytest.raises(OffloadError, match="pyalloc run --offload"):
        with offload(pressure_callback=False):
            pass


# ---- offload.* in pyalloc.memory_stats() ----------------------------------------------------


def test_memory_stats_report_the_sessions_counters_as_offload_keys(allocator) -> None:
    torch.manual_seed(0)
    model = _mlp()
    with offload(budget=0, recompute=False, min_evict_bytes=4096, pressure_callback=False) as s:
        loss = model(torch.randn(128, 64)).square().mean()
        during = pyalloc.memory_stats()
        assert during["offload.swapped_out_bytes"] == s.stats()["swapped_out_bytes"] > 0
        loss.backward()
    stats = pyalloc.memory_stats()
    for key in ("swap_out_bytes_total", "swap_in_bytes_total", "swapped_out_bytes", "recomputed_tensors_total",
                "swap_seconds_total", "recompute_seconds_total", "evictions_total"):
        assert stats[f"offload.{key}"] == s.stats()[key]
    assert stats["offload.swap_out_bytes_total"] > 0 and stats["offload.swap_in_bytes_total"] > 0
    assert "allocated_bytes.all.current" in stats  # the allocator's own keys are still there
    assert list(stats) == sorted(stats)


def test_memory_stats_have_no_offload_keys_without_a_session_and_import_no_torch() -> None:
    result = _python(
        """
        import sys, pyalloc
        keys = pyalloc.memory_stats()
        print(any(k.startswith("offload.") for k in keys), "torch" in sys.modules)
        """,
        child_env(PYALLOC_CONF="backend=host,capacity=64MiB,registry=0"),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_process_session_traces_selective_regions_and_catches_a_changed_constant(process_session, monkeypatch) -> None:
    """Under `pyalloc run --offload` the recording mode traces selective regions itself (Note
    [Call traces]): steps under a plan with selective regions are exact and stay planned, and a
    Python float the model's code passes to torch, changed between steps, has the next step
    profiled again, the step that saw it exact."""
    from pyalloc.offloading import session as session_module
    from pyalloc.offloading.plan import MadeInStep, is_activation, make_plan

    scale = [1.0]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc1, self.fc2 = nn.LayerNorm(64), nn.Linear(64, 256), nn.Linear(256, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x * scale[0]))))

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[Block() for _ in range(3)], nn.Linear(64, 10))

    def step(model: nn.Module) -> list[torch.Tensor]:
        model(x).square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return grads

    monkeypatch.setattr(session_module, "REPLAY_CHECK_EVERY", 1000)
    torch.manual_seed(1)
    x = torch.randn(32, 16, 64)
    reference, model = make(), make()
    saved: dict[int, int] = {}

    made = MadeInStep()

    def count(t: torch.Tensor) -> torch.Tensor:
        if is_activation(t, made.made):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with made, torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        loss = make()(x).square().mean()
    del loss
    expected = step(reference)  # before the session: every backward under it ends one of its steps
    scale[0] = 0.5
    expected_scaled = step(reference)
    scale[0] = 1.0
    # 60%: at half the plan needs whole re-runs of two blocks (a selective one cannot drop the
    # input of the layer norm, x * scale, which the step makes: Note [Step-made leaves])
    session = offload_process.start(sum(saved.values()) * 3 // 5, swap=False, pressure_callback=False)
    step(model)  # profiled
    search = session._search
    assert search is not None
    for call in search.profile.calls:  # times set, not measured: selective regions are the cheapest
        call.seconds = 1.0
    search.plan = make_plan(search.profile, search.budget, selective=True)
    search.selective, search.settled = True, True
    assert search.plan.recipes
    for _ in range(3):  # the first planned step is checked; the others replay
        _assert_bitwise_equal(expected, step(model))
    st = session.stats()
    assert st["replays_stale_total"] == 0 and st["profile_steps_total"] == 1 and st["recomputed_tensors_total"] > 0
    scale[0] = 0.5
    _assert_bitwise_equal(expected_scaled, step(model))
    assert session.stats()["replays_stale_total"] == 1 and session._search is None
