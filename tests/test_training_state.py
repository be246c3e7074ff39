"""relocate_training_state: the in-place update pool recipe for a model and its optimizer."""

from __future__ import annotations

import pytest
import torch

import pyalloc


pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # bit-for-bit comparisons (conftest.py)


def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=False)
    model(x).square().mean().backward()
    opt.step()


def test_relocation_keeps_identity_and_training_bit_for_bit() -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    plain, plain_opt = make(0)
    moved, moved_opt = make(0)
    step(plain, plain_opt, x)
    step(moved, moved_opt, x)

    params_before = list(moved.parameters())
    storages_before = [p.data_ptr() for p in params_before]
    result = pyalloc.relocate_training_state(moved, moved_opt, "params")

    assert list(moved.parameters()) == params_before  # the same Parameter objects
    assert all(p.data_ptr() != old for p, old in zip(params_before, storages_before))  # new storage
    assert result.parameters == 4 and result.gradients == 4
    assert result.optimizer_tensors == 3 * 4  # step, exp_avg, exp_avg_sq per parameter
    assert result.pool_id == pyalloc.create_pool("params")
    assert set(moved_opt.state) == set(params_before)

    for _ in range(3):
        step(plain, plain_opt, x)
        step(moved, moved_opt, x)
    for a, b in zip(plain.parameters(), moved.parameters()):
        assert torch.equal(a, b)
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


def test_missing_gradients_are_created_as_zeros_in_place() -> None:
    model, _ = make(0)
    result = pyalloc.relocate_training_state(model)
    assert result.gradients == 4
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert pyalloc.relocate_training_state(model, gradients=False).gradients == 0
