"""The call traces that check selective regions step by step (Note [Call traces] in
pyalloc/offloading/guard.py): what an entry holds, how two traces compare, and taking the trace
mode off the torch-function stack wherever it is."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from pyalloc.offloading.guard import CallTrace, entry, push, remove, same_trace


def _stack() -> list[object]:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def test_an_entry_holds_a_tensors_geometry_not_its_values_and_python_values_as_they_are() -> None:
    a, b = torch.zeros(4, 3), torch.ones(4, 3)
    assert entry(torch.add, (a, 2.0), None) == entry(torch.add, (b, 2.0), None)  # values are data
    assert entry(torch.add, (a, 2.0), None) != entry(torch.add, (a, 3.0), None)  # a constant changed
    assert entry(torch.add, (a, 2.0), None) != entry(torch.add, (a.t(), 2.0), None)  # strides
    assert entry(torch.add, (a, 2.0), None) != entry(torch.add, (a.double(), 2.0), None)  # dtype
    assert entry(torch.cat, ([a, a],), {"dim": 0}) != entry(torch.cat, ([a, a],), {"dim": 1})


def test_a_trace_writes_only_while_its_owner_says_so_and_each_composite_call_once() -> None:
    out: list[tuple[object, ...]] = []
    on = [True]
    x = torch.randn(8, 16)
    with CallTrace(lambda: out if on[0] else None):
        torch.nn.functional.layer_norm(x, (16,), eps=1e-5)  # a composite: one entry, not its insides
        on[0] = False
        torch.relu(x)
    assert [e[0] for e in out] == [torch.nn.functional.layer_norm]


class _Ambiguous:
    """An argument whose == is not a truth value (as an array's is not)."""

    def __eq__(self, other: object) -> bool:
        return torch.tensor([True, False])  # type: ignore[return-value]

    __hash__ = object.__hash__


def test_traces_whose_arguments_cannot_be_compared_count_as_different() -> None:
    got = [(torch.add, (_Ambiguous(),))]
    assert not same_trace(got, [(torch.add, (_Ambiguous(),))])
    assert not same_trace(got, None)
    assert same_trace([], [])


def test_remove_takes_the_mode_off_wherever_it_is_and_keeps_the_modes_above_in_order() -> None:
    ours, theirs, outer = CallTrace(lambda: None), TorchFunctionMode(), TorchFunctionMode()
    before = _stack()
    with outer:
        push(ours)
        push(theirs)  # a program's mode, entered inside the region and left entered
        remove(ours)
        assert _stack() == before + [outer, theirs]
        remove(ours)  # not there any more: nothing happens
        assert _stack() == before + [outer, theirs]
        remove(theirs)
    assert _stack() == before
