"""A planned re-run gets its inputs laid out as the forward gave them: the same strides, storage
offset, dtype and data pointer alignment (mod 16 bytes), and the recompute check's reports say so
(Note [Recompute check] in pyalloc/offloading/check.py).

Why it matters: CUDA's dropout (aten/src/ATen/native/cuda/Dropout.cu, ``get_vector_size``) picks
a vectorised kernel whose width comes from its input's pointer alignment, or an unrolled one for
an input that is not dense, and the kernels hand the generator's numbers to the elements in
different orders: a re-run on an input laid out otherwise draws another mask from the restored
generator state. The H200 run of 2026-11-27 saw a planned dropout re-run draw another mask; what
is checked here is the layout, which the CPU shows (the mask's dependence on it needs a GPU:
tests/gpu/test_offload_cuda.py reports it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pyalloc.offloading import check
from pyalloc.offloading.session import offload

from offload_fixture import assert_bitwise_equal

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # bit-for-bit comparisons (conftest.py)


class _FusedDropout(nn.Module):
    """CUDA's dropout on the CPU: one ``native_dropout`` whose node saves a boolean mask, so the
    plan re-runs it (a stock dropout on the CPU saves its noise and is refilled instead)."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, self.p, True)[0]


class _Shifted(nn.Module):
    """A view one element in: not contiguous, storage offset 1, data pointer 4 bytes off a
    16-byte boundary."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 1:]


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.stride()), t.storage_offset(), t.data_ptr() % 16, t.is_contiguous(), t.dtype)


def _model() -> tuple[nn.Module, list[nn.Module]]:
    # the H200 test's model, smaller, with a second dropout fed a shifted view
    torch.manual_seed(0)
    first, second = _FusedDropout(), _FusedDropout()
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), first, nn.Linear(256, 256), nn.Tanh(), _Shifted(),
                          second, nn.Linear(255, 256), nn.ReLU(), nn.Linear(256, 10))
    return model, [first, second]


def _train(session: Any, steps: int = 4) -> tuple[list[dict[str, torch.Tensor]], list[tuple[int, int, bool, tuple[Any, ...]]]]:
    """The gradients of each step, and each dropout call: (step, which dropout, in backward,
    its input's layout)."""
    model, dropouts = _model()
    calls: list[tuple[int, int, bool, tuple[Any, ...]]] = []
    where = {"step": 0, "backward": False}
    for i, m in enumerate(dropouts):
        m.register_forward_pre_hook(
            lambda _m, args, i=i: calls.append((where["step"], i, where["backward"], _layout(args[0]))))
    grads = []
    for s in range(steps):
        where["step"], where["backward"] = s, False
        torch.manual_seed(s)
        x = torch.randn(128, 64)
        with session:
            loss = model(x).square().mean()
            where["backward"] = True  # re-runs happen in backward
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return grads, calls


def test_a_rerun_gets_its_inputs_laid_out_as_the_forward_gave_them() -> None:
    expected, _ = _train(offload(budget=1 << 40))  # never evicts: a run without offload
    session = offload(budget=128 * 256 * 4, swap=False, check=True)
    got, calls = _train(session)
    forward = {(s, i): layout for s, i, backward, layout in calls if not backward}
    reruns = [(s, i, layout) for s, i, backward, layout in calls if backward]
    # The shifted dropout is re-run in every plan at this budget (below the floor); the first one
    # only in the plans that hold least, which the profiled times decide (seen: about half the
    # runs): each re-run that happens is checked.
    assert 1 in {i for _, i, _ in reruns}, calls
    assert forward[(0, 1)][1:4] == (1, 4, False), forward  # the shifted view, as meant
    for s, i, layout in reruns:
        assert layout == forward[(s, i)], (s, i, layout, forward[(s, i)])
    assert session.recompute_mismatches() == [] and session.stats()["recompute_checked_total"] > 0
    for e, g in zip(expected, got):
        assert_bitwise_equal(e, g)


def test_alike_compares_layout_and_alignment_up_to_16_bytes() -> None:
    buf = torch.empty(4096 + 64)
    base = buf[:4096].view(64, 64)  # 64-byte aligned on the CPU
    g = check.geometry
    assert check.alike([g(base)], [g(torch.empty(64, 64))])  # both aligned to 16 bytes or more
    shifted = buf[1:4097].view(64, 64)  # 4 bytes off: CUDA's dropout would run unvectorised
    assert not check.alike([g(base)], [g(shifted)])
    eight = torch.empty(4096 + 2)[2:].view(64, 64)  # 8 bytes off, storage offset 2
    assert g(eight)["alignment"] == 8
    assert not check.alike([g(base)], [g(base.t())])  # strides
    assert not check.alike([g(base)], [g(base), g(base)])  # how many
    assert check.alike([], [])
