"""Batch-norm refills (Note [Batch-norm refills] in pyalloc/offloading/batchnorm.py): a training-mode
batch norm's output regenerated from its saved statistics, exactly, and only where the profiled step
found it exact; and ReLU outputs (saved by the ReLU itself, before it returns) dropped as outputs."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from pyalloc.offloading import batchnorm
from pyalloc.offloading.batchnorm import refill, refillable, saved_statistics
from pyalloc.offloading.session import offload

from offload_fixture import assert_bitwise_equal as _assert_bitwise_equal
from offload_fixture import profiled, saved_bytes_peak
from offload_fixture import step as _step

STEPS = 5  # one profiled step, then the plan search and settled steps


class _Transposed(nn.Module):
    """A batch norm fed a strided view: the kernel takes its non-contiguous path, whose output
    the refill does not reproduce bit for bit."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x.transpose(2, 3)).transpose(2, 3)


def _cnn() -> nn.Module:
    """Batch norms with weights and biases away from 1 and 0 (there the kernel's paths agree)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32, affine=False), nn.ReLU(),
        nn.Dropout2d(0.2),
        nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32, eps=1e-3), nn.ReLU(),
        nn.Conv2d(32, 8, 1, bias=False), _Transposed(8), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d) and m.affine:
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
    return model


def _input() -> torch.Tensor:
    torch.manual_seed(123)
    return torch.randn(16, 3, 16, 16)


def _plain(model: nn.Module, x: torch.Tensor) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    grads = [_step(model, x, seed) for seed in range(STEPS)]
    return grads, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("eps", [1e-5, 0.1])
def test_a_refill_gives_the_training_output_bit_for_bit_and_leaves_running_statistics(layout, affine, eps) -> None:
    torch.manual_seed(1)
    bn = nn.BatchNorm2d(24, eps=eps, affine=affine)
    if affine:
        with torch.no_grad():
            bn.weight.normal_()
            bn.bias.normal_()
    x = torch.randn(8, 24, 9, 7) * 3 + 1.5
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    out = bn(x.requires_grad_())
    state = {k: v.clone() for k, v in bn.state_dict().items()}
    stats = saved_statistics(out)
    assert stats is not None
    got = refill(bn, x.detach(), *stats)
    assert torch.equal(got, out) and got.stride() == out.stride()
    _assert_bitwise_equal(state, bn.state_dict())  # the eval-mode call wrote no running statistic


def test_only_training_mode_stock_batch_norms_are_refillable() -> None:
    bn = nn.BatchNorm1d(4)
    assert refillable(bn)
    assert not refillable(bn.eval())  # normalises with running statistics: not the batch's
    assert refillable(nn.BatchNorm1d(4, track_running_stats=False).eval())  # batch statistics in eval too
    assert not refillable(nn.LayerNorm(4))
    out = bn.eval()(torch.randn(3, 4, requires_grad=True))
    assert saved_statistics(out) is None


def test_the_profile_marks_refills_only_where_it_found_them_exact() -> None:
    model, x = _cnn(), _input()
    profile = profiled(model, x)
    bns = [c for c in profile.calls if isinstance(c.module(), nn.BatchNorm2d)]
    # the last one is fed a strided view: its refill differs from the forward, it is re-run whole
    assert [c.refill_seconds >= 0 for c in bns] == [True, True, True, False]
    dropouts = [c for c in profile.calls if isinstance(c.module(), nn.modules.dropout._DropoutNd)]
    relus = [c for c in profile.calls if isinstance(c.module(), nn.ReLU)]  # Note [Activation refills]
    assert len(relus) == 4 and all(c.refill_seconds >= 0 for c in relus)
    assert all(c.refill_seconds < 0 for c in profile.calls if c not in bns + dropouts + relus)


def _session_run() -> tuple[dict[str, float], int]:
    """Plain steps, then the same under a session at half the saved bytes, compared bit for bit
    (gradients each step, then the running statistics); the session's stats and the baseline's
    peak of saved bytes."""
    model, x = _cnn(), _input()
    expected, expected_state = _plain(copy.deepcopy(model), x)
    peak = saved_bytes_peak(copy.deepcopy(model), x)
    session = offload(budget=peak // 2, pressure_callback=False)
    for seed in range(STEPS):
        with session:
            _assert_bitwise_equal(expected[seed], _step(model, x, seed))
    _assert_bitwise_equal(expected_state, {k: v.clone() for k, v in model.state_dict().items()})
    return session.stats(), peak


def test_planned_steps_refill_batch_norms_and_drop_relu_outputs_bit_for_bit() -> None:
    """At half the saved bytes the plan regenerates ReLU outputs through refilled batch norms:
    gradients, running statistics and dropout masks as in the plain steps, the budget kept."""
    st, peak = _session_run()
    assert st["batchnorm_refills_total"] > 0 and st["drops_total"] > 0
    assert st["plan_settled"] == 1 and st["profile_steps_total"] == 1
    assert st["step_saved_bytes_peak"] <= peak // 2 * 1.05


def test_a_refill_found_inexact_in_the_profile_is_never_used(monkeypatch) -> None:
    """A refill one ulp off (standing for a device whose kernel forms the output otherwise): the
    profiled step rejects it, batch norms are re-run whole, and the steps stay exact."""
    def off_by_one_ulp(module: nn.Module, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
        out = refill(module, x, mean, invstd)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(batchnorm, "refill", off_by_one_ulp)
    st, _ = _session_run()
    assert st["batchnorm_refills_total"] == 0 and st["drops_total"] > 0


def test_a_strided_batch_norm_at_its_initial_weights_is_not_refilled() -> None:
    """At weight 1 and bias 0 (the default initialisation) the kernel's strided path and the refill
    agree on the profiled output; they part after the first optimizer step, so the profile must
    not mark it (a second reader's probe: every planned step's gradients differed)."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), _Transposed(8), nn.ReLU())
    profile = profiled(model, _input())
    (bn,) = [c for c in profile.calls if isinstance(c.module(), nn.BatchNorm2d)]
    assert bn.refill_seconds < 0


class _Swap(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(2, 3)


@pytest.mark.parametrize("strided", [False, True])
def test_refills_stay_exact_while_an_optimizer_moves_the_weights(strided: bool) -> None:
    """Batch norms at their initial weights, an SGD step after each step: the planned steps'
    gradients equal the plain steps' every step. Contiguous inputs: refilled (the kernel's path
    is the refill's whatever the weights). Strided ones: re-run whole (refilled, they differed
    from the second step on)."""
    def model_() -> nn.Module:
        torch.manual_seed(0)
        swap: list[nn.Module] = [_Swap()] if strided else []
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False), *swap, nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, bias=False), *swap, nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1, bias=False), *swap, nn.BatchNorm2d(32), nn.ReLU(),
            nn.Flatten(), nn.Linear(32 * 16 * 16, 10))

    def run(model: nn.Module, session: object = None) -> list[dict[str, torch.Tensor]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        out = []
        for seed in range(4):  # one thread is deterministic this long (oneDNN's convolutions)
            with session if session is not None else contextlib.nullcontext():
                out.append(_step(model, x, seed))
            for p, g in zip(model.parameters(), out[-1].values()):
                p.grad = g.clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return out

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = _input()
        expected = run(model_())
        session = offload(budget=saved_bytes_peak(model_(), x) // 2, pressure_callback=False)
        got = run(model_(), session)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(expected, got):
        _assert_bitwise_equal(a, b)
    refills = session.stats()["batchnorm_refills_total"]
    assert refills == 0 if strided else refills > 0
