"""Call arguments taken apart and put back, and tensors as dictionary keys.

The recording's hot path (every torch call in a session goes through it), so plain containers
are handled here, without pytree's registry, and tensors are keyed by identity without a
Python-level key object per lookup.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

class NotPlain(Exception):
    """An argument container the plain flattener does not take apart (namedtuple, OrderedDict)."""


def _flatten_plain(obj: Any, leaves: list[Any]) -> Any:
    kind = type(obj)
    if kind is tuple or kind is list:
        return (kind, [_flatten_plain(x, leaves) for x in obj])
    if kind is dict:
        return (dict, [(k, _flatten_plain(v, leaves)) for k, v in obj.items()])
    if isinstance(obj, (tuple, list, dict)) and kind is not torch.Size:
        raise NotPlain
    leaves.append(obj)
    return None


def flatten(obj: Any) -> tuple[list[Any], Any]:
    """``tree_flatten`` for call arguments and results: exact tuples, lists and dicts are taken
    apart here (a few microseconds); other containers go to pytree. The same object always takes
    the same path, so output indices agree between a call and its replay."""
    leaves: list[Any] = []
    try:
        return leaves, ("plain", _flatten_plain(obj, leaves))
    except NotPlain:
        leaves, spec = tree_flatten(obj)
        return leaves, ("pytree", spec)


def _unflatten_plain(spec: Any, leaves: Iterator[Any]) -> Any:
    if spec is None:
        return next(leaves)
    kind, children = spec
    if kind is dict:
        return {k: _unflatten_plain(c, leaves) for k, c in children}
    return kind(_unflatten_plain(c, leaves) for c in children)


def unflatten(leaves: list[Any], spec: tuple[str, Any]) -> Any:
    how, inner = spec
    if how == "plain":
        return _unflatten_plain(inner, iter(leaves))
    return tree_unflatten(leaves, inner)


class TensorMap:
    """tensor -> value by identity, holding the tensor weakly: an entry goes when its tensor
    dies. A dict keyed by ``id`` with a weakref callback; ``WeakIdKeyDictionary`` does the same
    with a Python-level key object per lookup, which the recording can't afford."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, t: torch.Tensor) -> Any:
        entry = self._entries.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def __contains__(self, t: torch.Tensor) -> bool:
        return self.get(t) is not None

    def __setitem__(self, t: torch.Tensor, value: Any) -> None:
        key, entries = id(t), self._entries

        def gone(ref: weakref.ref, key: int = key, entries: dict = entries) -> None:
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(t, gone), value)

    def __len__(self) -> int:
        return len(self._entries)
