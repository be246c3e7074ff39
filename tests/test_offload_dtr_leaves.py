"""Per-operator DTR and the leaves the step made (Note [Leaves DTR evicts] in
pyalloc/offloading/session.py): a CPU dropout's noise and an LSTM's oneDNN workspace are evicted
and regenerated like any save, and count against the budget; parameters, the batch and buffers
neither count nor move."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from pyalloc.offloading.check import RecomputeCheck
from pyalloc.offloading.session import OffloadFloorWarning, offload

from offload_fixture import assert_bitwise_equal, saved_bytes_peak, session_steps
from offload_fixture import step as _step

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # bit-for-bit comparisons (conftest.py)

STEPS = 3


class _Dropouts(nn.Module):
    """Most of what it saves is dropout noise (a float tensor the input's size on CPU)."""

    def __init__(self, d: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = nn.functional.dropout(torch.tanh(layer(x)), 0.2)
        return x


class _LSTM(nn.Module):
    """Most of what it saves is the CPU LSTM's workspaces: bytes, leaves the layer made."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


CASES = {  # and the budget, a fraction of the plain step's saved bytes that the leaves alone pass
    "dropout": (_Dropouts, lambda: torch.randn(128, 256), 0.25),  # the noise: a third of the saves
    "lstm": (_LSTM, lambda: torch.randn(8, 32, 32), 0.5),  # the workspaces: 0.8 of them
}


@pytest.mark.parametrize("name", list(CASES))
def test_dtr_keeps_the_budget_with_the_leaves_the_step_made_and_gradients_stay_exact(name: str) -> None:
    make_model, make_input, fraction = CASES[name]
    model, x = make_model(), make_input()
    expected = [_step(copy.deepcopy(model), x, s) for s in range(STEPS)]
    budget = int(saved_bytes_peak(copy.deepcopy(model), x) * fraction)
    session = offload(budget=budget, policy="dtr", pressure_callback=False, check=True, min_evict_bytes=4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadFloorWarning)  # well above the floor
        got = session_steps(session, model, x, STEPS)
    for e, g in zip(expected, got):
        assert_bitwise_equal(e, g)
    st = session.stats()
    # before leaves were evicted, the noise (or the workspaces) stayed on top of the budget
    assert st["counted_resident_bytes_peak"] <= budget * 1.05, (st["counted_resident_bytes_peak"], budget)
    assert st["drops_total"] > 0 and st["recompute_checked_total"] > 0
    assert st["recompute_mismatches_total"] == 0, session.recompute_mismatches()


def test_a_leaf_a_recorded_call_made_counts_and_moves_and_the_batch_and_parameters_do_not() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(256, 256)
    x = torch.randn(128, 256, requires_grad=True)  # the batch: a leaf the step did not make

    def step() -> torch.Tensor:
        h = lin(x)  # saves x and the weight
        torch.manual_seed(1)
        return (h * torch.rand_like(h)).sum()

    expected = torch.autograd.grad(step(), [lin.weight, x])
    with offload(budget=0, policy="dtr", min_evict_bytes=1, pressure_callback=False) as s:
        h = lin(x)
        st = s.stats()
        assert st["drops_total"] == 0 and st["swap_outs_total"] == 0
        assert st["uncounted_bytes"] >= (x.numel() + lin.weight.numel()) * 4
        torch.manual_seed(1)
        noise = torch.rand_like(h)  # a leaf a recorded call made: counted, and evicted at budget 0
        loss = (h * noise).sum()
        del noise
        st = s.stats()
        assert st["drops_total"] + st["swap_outs_total"] >= 1
        assert st["resident_bytes"] - st["uncounted_bytes"] == 0
        got = torch.autograd.grad(loss, [lin.weight, x])
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def test_a_frozen_weight_and_a_view_of_the_batch_neither_count_nor_move() -> None:
    torch.manual_seed(0)
    emb, head = nn.Embedding(100, 64), nn.Linear(64, 100)
    head.weight.requires_grad_(False)  # frozen: a leaf without grad, not one the step made
    ids = torch.randint(0, 100, (8, 33))
    with offload(budget=0, policy="dtr", min_evict_bytes=1, pressure_callback=False) as s:
        logits = head(emb(ids[:, :-1]))  # the slices are leaves too, views of the batch
        loss = nn.functional.cross_entropy(logits.reshape(-1, 100), ids[:, 1:].reshape(-1))
        st = s.stats()
        assert st["uncounted_bytes"] >= head.weight.numel() * 4 and st["resident_bytes"] == st["uncounted_bytes"]
        assert st["drops_total"] + st["swap_outs_total"] >= 1  # the log-softmax's result: counted, evicted
        loss.backward()


def test_below_what_dtr_cannot_evict_it_warns_once_naming_that_floor() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    x = torch.randn(32, 64)  # every save 8 KiB: under min_evict_bytes, so none can be evicted
    session = offload(budget=1, policy="dtr", pressure_callback=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session_steps(session, model, x, 2)
    floor = [w for w in caught if issubclass(w.category, OffloadFloorWarning)]
    assert len(floor) == 1
    assert "budget of 1 bytes is below the floor of" in str(floor[0].message)
    assert "per-operator DTR cannot evict" in str(floor[0].message)
    assert session.stats()["counted_resident_bytes_peak"] > 1


def test_a_workspace_is_compared_by_layout_and_other_saves_by_value() -> None:
    check = RecomputeCheck()
    workspace = torch.randint(0, 255, (4096,), dtype=torch.uint8)
    assert check.compare(check.original(workspace), torch.zeros_like(workspace))  # unused bytes differ
    assert not check.compare(check.original(workspace), torch.zeros(2048, 2, dtype=torch.uint8))  # layout
    values = torch.randn(64)
    assert not check.compare(check.original(values), values + 1)
    assert check.checked == 3 and check.mismatched == 2
