"""Re-runs draw what the original call drew, on the CUDA generators too (Note [Generator states]
in pyalloc/offloading/rng.py), and the debug check names a recomputed tensor that differs (Note
[Recompute check] in pyalloc/offloading/check.py).

A planned re-run of a dropout whose input the plan regenerated took no CUDA generator state (its
arguments, as held, were placeholders): found by reading, while looking for why the H200 run of
tests/gpu/test_offload_cuda.py differed where the plan re-ran a dropout (not the whole of that:
Note [Generator states]). This machine has no GPU, so the CUDA generators are stood in for by CPU generators, one a
device, behind ``torch.cuda``'s RNG functions (the only mocks here), and the dropout below draws
its mask from them as CUDA's fused dropout draws from the device's generator.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from pyalloc.offloading import calls, rng
from pyalloc.offloading.session import offload

from offload_fixture import assert_bitwise_equal

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # bit-for-bit comparisons (conftest.py)


class _FakeCudaGenerators:
    """``torch.cuda``'s generators on a machine without a GPU: a CPU generator per device."""

    def __init__(self, devices: int = 2) -> None:
        self.gens = {d: torch.Generator() for d in range(devices)}
        self.seed(0)

    def seed(self, seed: int) -> None:
        for d, g in self.gens.items():
            g.manual_seed(1000 * seed + d)

    @staticmethod
    def _index(device: Any) -> int:
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return device.index or 0

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.gens[self._index(device)].get_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        self.gens[self._index(device)].set_state(state)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeCudaGenerators:
    """A process that has initialised CUDA, as far as the session's RNG handling can see."""
    fake = _FakeCudaGenerators()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # (Note [Device time])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state", fake.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake.set_rng_state)
    return fake


class _DeviceDropout(nn.Module):
    """A dropout whose mask comes from the current device's generator, as CUDA's fused dropout's
    does; like it, it saves only the mask (a leaf), so its output is re-run, never refilled."""

    def __init__(self, generators: dict[int, torch.Generator], p: float = 0.1) -> None:
        super().__init__()
        self.generators, self.p = generators, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.rand(x.shape, generator=self.generators[torch.cuda.current_device()]) >= self.p
        return x * mask / (1 - self.p)


def _model(noise: nn.Module) -> nn.Module:
    # the H200 test's model, smaller: Linear -> GELU -> dropout -> Linear, each output dropped by
    # the plan, so the dropout's input is regenerated through the GELU and the first linear layer
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), noise, nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _train(model: nn.Module, fake: _FakeCudaGenerators | None, session: Any, steps: int = 4) -> list[dict[str, torch.Tensor]]:
    grads = []
    for step in range(steps):
        torch.manual_seed(step)
        if fake is not None:
            fake.seed(step)
        x = torch.randn(128, 64)
        if session is None:
            model(x).square().mean().backward()
        else:
            with session:
                model(x).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return grads


def test_a_rerun_dropout_draws_its_cuda_mask_again_when_its_input_is_regenerated(fake_cuda: _FakeCudaGenerators) -> None:
    # Before the fix the re-run took no CUDA state (its arguments, as the plan holds them, are
    # placeholders for the regenerated input), so it drew a new mask: the first planned step's
    # gradients differed and the check named the dropout.
    expected = _train(_model(_DeviceDropout(fake_cuda.gens)), fake_cuda, None)
    session = offload(budget=128 * 256 * 4, swap=False, check=True)
    got = _train(_model(_DeviceDropout(fake_cuda.gens)), fake_cuda, session)
    st = session.stats()
    assert st["policy_plan"] == 1 and st["planned_steps_total"] >= 3 and st["recomputed_tensors_total"] > 0, st
    assert session.recompute_mismatches() == []
    assert st["recompute_checked_total"] > 0 and st["recompute_mismatches_total"] == 0, st
    for e, g in zip(expected, got):
        assert_bitwise_equal(e, g)


def test_a_rerun_leaves_the_cuda_generators_where_the_program_left_them(fake_cuda: _FakeCudaGenerators) -> None:
    model = _model(_DeviceDropout(fake_cuda.gens))
    session = offload(budget=128 * 256 * 4, swap=False)
    _train(model, fake_cuda, session, steps=2)  # a profiled step, then a planned one with re-runs
    assert session.stats()["recomputed_tensors_total"] > 0
    after = {d: fake_cuda.get_rng_state(d) for d in fake_cuda.gens}
    # the same two steps without offload: the generators must end at the same place
    fake_cuda.seed(0)
    _train(_model(_DeviceDropout(fake_cuda.gens)), fake_cuda, None, steps=2)
    for d in fake_cuda.gens:
        assert torch.equal(fake_cuda.get_rng_state(d), after[d]), f"device {d}'s generator moved"


def test_a_dtr_replay_draws_on_the_current_device_again_and_restores_it(fake_cuda: _FakeCudaGenerators) -> None:
    recorder = calls.CallRecorder(cuda=True)
    gen = fake_cuda.gens[0]

    def noisy(x: torch.Tensor) -> torch.Tensor:  # no CUDA tensor among its arguments
        return x * (torch.rand(x.shape, generator=gen) >= 0.5)

    x = torch.randn(32, 32, requires_grad=True)
    with torch.enable_grad():
        first = recorder.record(noisy, (x,), {}, 0, lambda t: None)
    producer = recorder.producers.get(first)
    assert producer is not None
    call = producer[0]
    assert [d for d, _ in call.cuda_rng] == [0]
    torch.rand(5, generator=gen)  # the program draws on
    before = gen.get_state()
    outputs, _ = calls.replay_call(call, [x])
    assert torch.equal(outputs[0], first)
    assert torch.equal(gen.get_state(), before)  # the replay drew nothing from the program's stream


def test_without_cuda_no_generator_state_but_the_cpu_one_is_taken() -> None:
    tensors = [torch.zeros(2)]
    assert rng.cuda_states(tensors, cuda=False) == ()
    if not torch.cuda.is_initialized():
        assert rng.cuda_devices(tensors) == []


class _PrivateNoise(nn.Module):
    """Draws from a generator of its own, which no session replays: a re-run would differ."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand(x.shape, generator=self.gen) >= 0.1)


_OUTSIDE = [0]  # state kept outside the module, which the profile does not see change


class _OutsideCounter(nn.Module):
    """Reads and moves a counter kept outside itself: its re-run differs, and nothing but the
    check can tell (Note [State a re-run reads] in plan.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _OUTSIDE[0] += 1
        return x * (1.0 + 0.01 * _OUTSIDE[0])


def test_a_module_with_a_generator_of_its_own_is_not_re_run() -> None:
    # Until 2026-11-28 it was, and the check above all that caught it (this test's old form).
    model = _model(_PrivateNoise())
    expected = _train(copy.deepcopy(model), None, None, steps=3)
    session = offload(budget=128 * 256 * 4, check=True)
    got = _train(model, None, session, steps=3)
    for a, b in zip(expected, got):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert session.recompute_mismatches() == []


def test_the_check_names_the_module_whose_rerun_differs() -> None:
    session = offload(budget=128 * 256 * 4, check=True)
    _train(_model(_OutsideCounter()), None, session, steps=2)
    reports = session.recompute_mismatches()
    st = session.stats()
    assert st["recompute_mismatches_total"] >= 1 and st["recompute_checked_total"] >= st["recompute_mismatches_total"]
    first = reports[0]
    assert first["module"] == "_OutsideCounter" and first["kind"] == "output" and first["step"] == 1, first
    assert first["values_equal"] is False and first["elements_differing"] > 0, first
    assert first["original"]["shape"] == [128, 256] and first["recomputed"]["stride"] == first["original"]["stride"]
    assert first["cuda_generators"] == [] and first["linked_inputs"] == 1, first  # its input came through the GELU
    # the re-run's input, regenerated through the GELU, laid out as the forward's (a kernel that
    # picks its code by layout and alignment, as CUDA's dropout does, sees them alike)
    assert first["input_layouts"][0]["shape"] == [128, 256] and len(first["rerun_input_layouts"]) == 1, first
    assert first["inputs_alike"] is True, first


def test_the_check_is_off_by_default_and_costs_no_copy() -> None:
    session = offload(budget=128 * 256 * 4)
    _train(_model(nn.Dropout(0.1)), None, session, steps=2)
    st = session.stats()
    assert st["recomputed_tensors_total"] > 0
    assert st["recompute_checked_total"] == 0 and session.recompute_mismatches() == []
