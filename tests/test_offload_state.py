"""A re-run calls a module's forward again and sees the module as it is then (Note [State a re-run
reads] in pyalloc/offloading/plan.py): a forward that changes a buffer it reads, a Python
attribute or a generator of its own is never re-run, so gradients stay bit for bit the plain
step's. Also: one session is not entered by two threads at once, and a torch.compile'd module
inside a profiled step is compiled once (a review found all four, 2026-11-28)."""

from __future__ import annotations

import copy
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyalloc.offloading.session import OffloadError, OffloadFloorWarning, offload

from offload_fixture import assert_bitwise_equal, saved_bytes_peak, session_steps, step

STEPS = 6


class Stateful(nn.Module):
    """A block whose forward reads state it changes: an EMA buffer, a call counter, or a generator
    of its own."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.l1, self.l2 = nn.Linear(32, 128), nn.Linear(128, 32)
        self.register_buffer("ema", torch.zeros(128))
        self.calls = 0
        self.generator = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.l1(x))
        if self.kind == "buffer":
            with torch.no_grad():
                self.ema.mul_(0.9).add_(h.mean((0, 1)), alpha=0.1)
            h = h - self.ema
        elif self.kind == "attribute":
            self.calls += 1
            h = h * (1 + 0.1 * (self.calls % 3))
        else:
            h = h * (torch.rand(h.shape, generator=self.generator) > 0.3)
        return x + self.l2(h.tanh())


@pytest.mark.parametrize("kind", ["buffer", "attribute", "generator"])
@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_a_forward_that_changes_state_it_reads_is_not_re_run(kind: str, fraction: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Stateful(kind) for _ in range(4)])
    x = torch.randn(16, 8, 32)
    budget = int(saved_bytes_peak(copy.deepcopy(model), x) * fraction)
    plain, planned = copy.deepcopy(model), copy.deepcopy(model)
    expected = [step(plain, x, seed) for seed in range(STEPS)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadFloorWarning)  # nothing but these blocks to re-run
        got = session_steps(offload(budget=budget, pressure_callback=False), planned, x, STEPS)
    for a, b in zip(expected, got):  # up to 6e-3 apart before (each re-run saw the state changed)
        assert_bitwise_equal(a, b)
    for a, b in zip(plain.buffers(), planned.buffers()):
        assert torch.equal(a, b)


def test_one_session_is_not_entered_by_two_threads_at_once() -> None:
    session = offload(budget="1MiB", pressure_callback=False)
    inside, leave = threading.Event(), threading.Event()

    def first() -> None:
        with session:
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=first)
    t.start()
    try:
        assert inside.wait(30)
        with pytest.raises(OffloadError, match="runs a step on another thread"):
            with session:
                pass
    finally:
        leave.set()
        t.join(30)
    with session:  # one at a time is fine
        pass


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.l1, self.l2, self.drop = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.l2(F.gelu(self.l1(self.norm(x)))))


def test_a_compiled_module_inside_the_step_is_compiled_once_and_stays_exact() -> None:
    import torch._dynamo

    def make() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(_Block(), _Block(), _Block(), nn.Linear(32, 8))
        m[1] = torch.compile(m[1])  # type: ignore[assignment]
        return m

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plain, planned = make(), make()
    x = torch.randn(8, 16, 32)
    session = offload(budget=3000, pressure_callback=False)
    counters = torch._dynamo.utils.counters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadFloorWarning)
        for seed in range(16):
            expected = step(plain, x, seed)
            with session:
                got = step(planned, x, seed)
            assert_bitwise_equal(expected, got)
    # the session's modes are off the stack while the compiled module runs: no recompiles
    # (before: one each profiled step, and dynamo's eager fallback after 8 drew other masks)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
                           for _ in range(4)])


def test_steps_of_more_shapes_than_plans_kept_are_told_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A review's loader alternated sequence lengths 8 and 12: every other step differed from the
    # profile, kept every save, and the session said nothing. Now each shape has its plan (Note
    # [Plans per shape]); a loader of more shapes than plans are kept is told.
    from pyalloc.offloading import session as session_module
    from pyalloc.offloading.session import OffloadUnsettledWarning

    monkeypatch.setattr(session_module, "MAX_PLANS", 2)
    model = _blocks()
    for lengths, told in (([8, 12, 16, 20], 1), ([8, 12], 0), ([8], 0)):
        session = offload(budget=330_000, pressure_callback=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(16):
                x = torch.randn(16, lengths[i % len(lengths)], 32)
                with session:
                    model(x).square().mean().backward()
                model.zero_grad(set_to_none=True)
        unsettled = [w for w in caught if issubclass(w.category, OffloadUnsettledWarning)]
        assert len(unsettled) == told, [str(w.message) for w in caught]
        if told:
            assert "shapes past the 2 whose plans are kept" in str(unsettled[0].message)
        assert session.stats()["plans_kept"] == min(2, len(lengths))


def _kinds_of_steps(session: Any, model: nn.Module, lengths: list[int], steps: int,
                    budget: int) -> tuple[list[str], list[int]]:
    """Steps of ``model`` under ``session``, the sequence length taking turns through ``lengths``,
    each step's gradients checked against the plain step's: what each step was, and the most
    bytes it held that count against the budget."""
    plain = copy.deepcopy(model)
    peaks: list[int] = []
    note_peak = session._note_peak

    def noted() -> None:
        note_peak()
        peaks[-1] = max(peaks[-1], session.resident_bytes - session.uncounted_bytes)

    session._note_peak = noted
    kinds = []
    for i in range(steps):
        x = torch.randn(16, lengths[i % len(lengths)], 32)
        plain(x).square().mean().backward()
        before = session.stats()
        peaks.append(0)
        with session:
            model(x).square().mean().backward()
        after = session.stats()
        grew = {k for k in ("profile_steps_total", "unsettled_dtr_steps_total", "profiles_let_go_total",
                            "plan_switches_total") if after[k] > before[k]}
        kinds.append("profiled" if "profile_steps_total" in grew else "dtr" if "unsettled_dtr_steps_total" in grew
                     else "let go" if "profiles_let_go_total" in grew else "switched" if "plan_switches_total" in grew
                     else "planned")
        if kinds[-1] in ("planned", "switched"):  # a planned step counts its saves itself
            peaks[-1] = int(after["step_saved_bytes_peak"])
        for p, q in zip(plain.parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), i  # type: ignore[arg-type]
        plain.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    return kinds, peaks


def test_steps_that_keep_differing_run_under_dtr_and_keep_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Unsettled steps]: before, those steps took turns forever, a profiled step and a
    planned step that differed and kept every save (the budget broken on every other step);
    after three, steps run under per-operator DTR, a step is profiled again now and then, and
    every step's gradients stay the plain step's. One plan kept (MAX_PLANS): two shapes are
    already too many."""
    from pyalloc.offloading import session as session_module

    monkeypatch.setattr(session_module, "UNSETTLED_DTR_STEPS", 4)
    monkeypatch.setattr(session_module, "MAX_PLANS", 1)
    budget = 330_000
    session = offload(budget=budget, pressure_callback=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", session_module.OffloadUnsettledWarning)
        kinds, peaks = _kinds_of_steps(session, _blocks(), [8, 12], 16, budget)
    # the first shape profiled and kept; the other's planned steps differ (kept every save), and
    # the steps that would profile again are of the kept shape, let go and run under DTR; after
    # three such differing steps, four under DTR, a profile let go again, one planned step
    # differing once more, and DTR again at once
    assert kinds == ["profiled", "planned", "let go", "planned", "let go", "planned"] + ["dtr"] * 4 \
        + ["let go", "planned"] + ["dtr"] * 4, kinds
    assert all(peaks[i] <= budget for i, kind in enumerate(kinds) if kind in ("dtr", "let go")), list(zip(kinds, peaks))
    assert max(peaks[i] for i, kind in enumerate(kinds) if kind == "planned") > budget  # what DTR spares them


@pytest.mark.parametrize("lengths", [[8, 12], [8, 12, 16]])
def test_steps_of_a_few_shapes_taking_turns_each_run_under_their_own_plan(lengths: list[int]) -> None:
    """Note [Plans per shape]: a loader that takes turns among a few sequence lengths (buckets)
    gets a plan for each; once each shape was profiled, every step runs under its shape's plan,
    switching at the model's call, with the budget kept and gradients bit for bit."""
    from pyalloc.offloading.session import OffloadUnsettledWarning

    budget = 500_000  # above each shape's floor (430,080 bytes at length 16), under each one's saves
    session = offload(budget=budget, pressure_callback=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadUnsettledWarning)
        kinds, peaks = _kinds_of_steps(session, _blocks(), lengths, 12 * len(lengths), budget)
    st = session.stats()
    assert st["plans_kept"] == len(lengths) and st["profile_steps_total"] == len(lengths), kinds
    assert all(search.settled for search in session._searches.values())  # the promise is a settled plan's
    settled = kinds[-3 * len(lengths):]
    assert settled == ["switched"] * len(settled), kinds  # the last steps: each under its own shape's plan
    assert max(peaks[-3 * len(lengths):]) <= budget * 1.05, list(zip(kinds, peaks))


@pytest.mark.parametrize("budget", ["half", "never reached"])
def test_a_model_copied_or_saved_inside_a_step_carries_none_of_the_sessions_hooks(budget: str) -> None:
    """``copy.deepcopy(model)`` (an EMA, a snapshot) or ``torch.save(model)`` inside a planned or
    idle step raised "cannot pickle '_thread.RLock' object": the step's hooks on the planned
    modules were copied with them (a review's finding). The copies run, a deep copy loses the
    hooks at its first call, and the stepped model's gradients stay the plain steps'."""
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(128, 64)
    plain = copy.deepcopy(model)
    expected = [step(plain, x, seed) for seed in range(6)]
    peak = saved_bytes_peak(copy.deepcopy(model), x)
    session = offload(budget=peak // 2 if budget == "half" else peak * 10, pressure_callback=False)

    def hooks(m: nn.Module) -> int:
        return sum(len(s._forward_pre_hooks) + len(s._forward_hooks) for s in m.modules())

    hooked = 0
    for seed in range(6):
        with session:
            assert_bitwise_equal(expected[seed], step(model, x, seed))
            hooked = max(hooked, hooks(model))
            twin = copy.deepcopy(model)
            buffer = io.BytesIO()
            torch.save(model, buffer)
            assert b"pyalloc" not in buffer.getvalue()  # loads where pyalloc is not installed
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)
            for other in (twin, loaded):
                with torch.no_grad():
                    assert torch.equal(other(x), model(x))
            assert hooks(twin) == 0  # the detached hooks took themselves off at its first call
            # the pickle's stand-ins: a builtin that takes anything and returns None (Note [Session hooks])
            assert all(h == None.__init__ for m in loaded.modules()  # noqa: E711
                       for h in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()])
        assert hooks(model) == 0
    assert hooked > 0  # the steps did hang hooks on the model (so the copies had some to drop)
    st = session.stats()
    assert st["planned_steps_total"] + st["idle_steps_total"] >= 4, st


def test_a_copy_made_inside_a_step_compiles_with_fullgraph() -> None:
    """The detached hooks a copy carries until its first eager call change nothing while dynamo
    traces (it could not trace their removal: a review's finding)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    x = torch.randn(64, 32)
    session = offload(budget=saved_bytes_peak(copy.deepcopy(model), x) // 2, pressure_callback=False)
    for seed in range(3):
        with session:
            step(model, x, seed)
            twin = copy.deepcopy(model)
    compiled = torch.compile(twin, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))


@pytest.mark.parametrize("budget", ["half", "never reached"])
def test_torch_utils_checkpoint_inside_a_step_keeps_batch_norm_statistics(budget: str) -> None:
    """The profile read a batch norm's saved statistics inside a non-reentrant checkpoint, whose
    unpack re-ran the checkpointed forward: the running statistics moved twice more than in the
    plain step (a review's finding). What a checkpoint saved is not the session's to read."""
    from torch.utils.checkpoint import checkpoint

    def conv() -> nn.Module:
        return nn.Conv2d(8, 8, 3, padding=1, bias=False)

    torch.manual_seed(0)
    model = nn.Sequential(conv(), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2), conv())
    plain = copy.deepcopy(model)
    x = torch.randn(8, 8, 16, 16)

    def one(m: nn.Module, seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        checkpoint(m, x, use_reentrant=False).square().mean().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad(set_to_none=True)
        return grads

    peak = saved_bytes_peak(copy.deepcopy(model), x)
    session = offload(budget=peak // 2 if budget == "half" else peak * 10, pressure_callback=False)
    for seed in range(4):
        expected = one(plain, seed)
        with session:
            assert_bitwise_equal(expected, one(model, seed))
        assert_bitwise_equal(plain.state_dict(), model.state_dict())


def test_an_idle_step_that_differs_after_its_first_root_call_has_its_shapes_profiled_again() -> None:
    """Note [Plans per shape]: a plan is kept by its first root call's shapes. An idle step whose
    second root call changed shape (the first still matching) kept its plan and had the next
    step profiled, which, of shapes already planned, was let go: idle and let-go steps took turns
    for good. Such a step's plan no longer holds for its shapes: it is profiled again, and idle
    steps follow."""
    torch.manual_seed(0)
    a, b = nn.Sequential(nn.Linear(32, 64), nn.GELU()), nn.Sequential(nn.Linear(32, 64), nn.GELU())
    session = offload(budget=10**9, pressure_callback=False)
    kinds = []
    for i in range(16):
        before = session.stats()
        with session:
            (a(torch.randn(16, 32)).sum() + b(torch.randn(8 if i < 6 else 12, 32)).sum()).backward()
        after = session.stats()
        grew = {k for k in after if k.endswith("_total") and after[k] > before[k]}
        kinds.append("profiled" if "profile_steps_total" in grew else "let go" if "profiles_let_go_total" in grew
                     else "idle" if "idle_steps_total" in grew else "planned")
    assert kinds[7:9] == ["profiled", "planned"] and kinds[9:] == ["idle"] * 7, kinds
    assert session.stats()["profiles_let_go_total"] == 0
