"""Dropout refills (Note [Dropout refills] in pyalloc/offloading/dropout.py): a training-mode
dropout's output regenerated from the noise its forward saved, exactly, without drawing it again,
and only where the profiled step found it exact."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pyalloc.offloading import activations, dropout, refills
from pyalloc.offloading.dropout import refill, refillable, saved_noise
from pyalloc.offloading.plan import Profile
from pyalloc.offloading.session import offload

from offload_fixture import assert_bitwise_equal as _assert_bitwise_equal
from offload_fixture import profiled, saved_bytes_peak
from offload_fixture import step as _step

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # bit-for-bit comparisons (conftest.py)

STEPS = 8  # one profiled step, then the plan search (the families measured twice: Note CLOSE_CALL in plan.py) and settled steps


class _FeedForward(nn.Module):
    """A BERT-like feed-forward block: the dropout's output is what the second linear layer saves."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.linear1, self.act, self.drop, self.linear2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.linear2(self.drop(self.act(self.linear1(x)))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_FeedForward() for _ in range(4)], nn.Flatten(), nn.Linear(64 * 32, 10))


def _input() -> torch.Tensor:
    torch.manual_seed(123)
    return torch.randn(16, 32, 64)


@pytest.mark.parametrize("module", [nn.Dropout(0.1), nn.Dropout(0.5), nn.Dropout2d(0.3)], ids=str)
def test_a_refill_gives_the_training_output_bit_for_bit_and_draws_nothing(module) -> None:
    torch.manual_seed(1)
    x = torch.randn(8, 16, 12, 12, requires_grad=True) * 3
    out = module(x)
    noise = saved_noise(out)
    assert noise is not None
    state = torch.get_rng_state()
    got = refill(x.detach(), noise)
    assert torch.equal(torch.get_rng_state(), state)  # the noise is not drawn again
    assert torch.equal(got, out) and got.stride() == out.stride()
    assert refills.exact_refill_seconds(module, x, out) is not None


def test_only_stock_training_dropouts_that_draw_noise_are_refillable() -> None:
    assert refillable(nn.Dropout(0.1)) and refillable(nn.Dropout2d(0.2))
    assert not refillable(nn.Dropout(0.1).eval())
    assert not refillable(nn.Dropout(0.0)) and not refillable(nn.Dropout(1.0))
    assert not refillable(nn.Dropout(0.1, inplace=True))
    assert not refillable(nn.AlphaDropout(0.1))  # another formula

    class Scaled(nn.Dropout):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    assert not refillable(Scaled(0.1))
    assert saved_noise(nn.Dropout(0.1).eval()(torch.randn(64, 64, requires_grad=True))) is None


def test_the_profile_marks_dropout_refills_it_found_exact() -> None:
    model, x = _model(), _input()
    profile = profiled(model, x)
    drops = [c for c in profile.calls if isinstance(c.module(), nn.Dropout)]
    assert len(drops) == 4 and all(c.refill_seconds >= 0 for c in drops)
    others = [c for c in profile.calls if c not in drops]
    # the activations too (Note [Activation refills]); nothing else
    assert all((c.refill_seconds >= 0) == activations.refillable(c.module()) for c in others)


def _session_run(fraction: float = 0.5) -> tuple[dict[str, float], int]:
    """Plain steps, then the same under a session, compared bit for bit each step; the session's
    stats and the baseline's peak of saved bytes."""
    model, x = _model(), _input()
    plain = copy.deepcopy(model)
    expected = [_step(plain, x, seed) for seed in range(STEPS)]
    peak = saved_bytes_peak(copy.deepcopy(model), x)
    session = offload(budget=int(peak * fraction), pressure_callback=False)
    for seed in range(STEPS):
        with session:
            _assert_bitwise_equal(expected[seed], _step(model, x, seed))
    return session.stats(), peak


def _dropout_outputs_dear_elsewhere(monkeypatch) -> None:
    """Every call but the dropouts and GELUs profiled as dear as a second, so that the plan at half
    the bytes regenerates the dropouts' outputs (through the GELUs) whatever the machine measures."""
    close = Profile._close

    def timed(self: Profile, call, output, kwargs=None) -> None:
        close(self, call, output, kwargs)
        if call.name not in ("Dropout", "GELU"):
            call.seconds = 1.0

    monkeypatch.setattr(Profile, "_close", timed)


def test_planned_steps_refill_dropouts_bit_for_bit(monkeypatch) -> None:
    _dropout_outputs_dear_elsewhere(monkeypatch)
    st, peak = _session_run()
    assert st["dropout_refills_total"] > 0 and st["drops_total"] > 0
    assert st["plan_settled"] == 1 and st["step_saved_bytes_peak"] <= peak // 2 * 1.05


def test_a_dropout_refill_found_inexact_in_the_profile_is_never_used(monkeypatch) -> None:
    """A refill one ulp off (standing for a kernel that forms the product otherwise): the profiled
    step rejects it, dropouts are re-run whole (the noise drawn again from the replayed generator
    state), and the steps stay exact."""
    def off_by_one_ulp(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        out = refill(x, noise)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    _dropout_outputs_dear_elsewhere(monkeypatch)
    monkeypatch.setattr(dropout, "refill", off_by_one_ulp)
    st, _ = _session_run()
    assert st["dropout_refills_total"] == 0 and st["drops_total"] > 0
