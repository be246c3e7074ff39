"""The call traces that check selective regions step by step (Note [Call traces] in
pyalloc/offloading/guard.py): what an entry holds, how two traces compare, and taking the trace
mode off the torch-function stack wherever it is."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from pyalloc.offloading.guard import CallTrace, entry, push_at, remove, same_trace


def _stack() -> list[object]:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def test_an_entry_holds_a_tensors_geometry_not_its_values_and_python_values_as_they_are() -> None:
    a, b = torch.zeros(4, 3), torch.ones(4, 3)
    assert entry(torch.add, (a, 2.0), None) == entry(torch.add, (b, 2.0), None)  # values are data
    assert entry(torch.add, (a, 2.0), None) != entry(torch.add, (a, 3.0), None)  # a constant changed
    assert entry(torch.add, (a, 2.0), None) != entry(torch.add, (a.t(), 2.0), None)  # strides
    assert entry(torch.add, (a, 2.0), None) != entry(torch.add, (a.double(), 2.0), None)  # dtype
    assert entry(torch.cat, ([a, a],), {"dim": 0}) != entry(torch.cat, ([a, a],), {"dim": 1})


def test_a_property_read_is_the_property_alone_and_what_it_returns_shows_where_it_is_used() -> None:
    """``x.dtype`` read in a region is traced as the read of that property (its tensor's geometry
    is not kept: it reaches torch through later calls, traced with it); a setter keeps what it
    sets; a dtype read then used shows in the call that uses it."""
    out: list[tuple[object, ...]] = []
    a, b = torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.float64)

    def traced(x: torch.Tensor, y: torch.Tensor) -> list[tuple[object, ...]]:
        out.clear()
        with CallTrace(lambda: out):
            x.to(y.dtype)
        return list(out)

    ta, tb = traced(a, a), traced(a, b)
    assert len(ta[0]) == 1 and ta[0] == tb[0]  # the read itself: the same property
    assert ta != tb  # where the value went: .to(float32) against .to(float64)
    with CallTrace(lambda: out):
        out.clear()
        c = torch.zeros(2, requires_grad=False)
        c.requires_grad = True  # a property set: what it sets is in the entry
    assert any(len(e) > 1 and e[0].__name__ == "__set__" and True in e[1] for e in out)


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


def test_the_trace_goes_in_at_a_height_and_comes_off_wherever_it_is() -> None:
    ours, theirs, outer = CallTrace(lambda: None), TorchFunctionMode(), TorchFunctionMode()
    before = _stack()
    with outer:
        push_at(ours, len(before))
        assert _stack() == before + [ours, outer]
        torch._C._push_on_torch_function_stack(theirs)  # a program's mode, left entered in the region
        remove(ours)
        assert _stack() == before + [outer, theirs]
        remove(ours)  # not there any more: nothing happens
        assert _stack() == before + [outer, theirs]
        remove(theirs)
    assert _stack() == before


def test_the_trace_sees_a_call_as_a_program_mode_passes_it_on() -> None:
    """A torch.device context adds device= to factory calls: the trace, under it, sees that."""
    out: list[tuple[object, ...]] = []
    trace = CallTrace(lambda: out)
    height = torch._C._len_torch_function_stack()
    with torch.device("cpu"):
        push_at(trace, height)
        try:
            torch.zeros(3)
        finally:
            remove(trace)
    assert [e[0] for e in out] == [torch.zeros] and "device" in dict(out[0][2])


def test_a_function_argument_is_its_code_and_what_its_closure_holds() -> None:
    def hook_for(scale: float, keep: torch.Tensor):  # a gradient hook made anew each step
        return lambda g: g * scale + keep.sum()

    big = torch.zeros(64, 64)
    first = entry(torch.Tensor.register_hook, (big, hook_for(2.0, big)), None)
    assert first == entry(torch.Tensor.register_hook, (big, hook_for(2.0, torch.ones(64, 64))), None)
    assert first != entry(torch.Tensor.register_hook, (big, hook_for(3.0, big)), None)  # a captured scalar changed
    assert not any(x is big for x in first[1][1][2])  # the captured tensor is described, not kept

    def recursive(n: int) -> int:
        return n if n < 2 else recursive(n - 1)

    assert entry(torch.add, (recursive,), None) == entry(torch.add, (recursive,), None)
