"""The planner's tries (Note [Moves that cannot help] in plan.py): each try's answer is the one
taking the move, estimating and taking it back gives, whether it ends at a remembered candidate
that rules it out, at a move seen not to lower the estimate, or at a whole estimate."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from pyalloc.offloading.bench_models import GPTSmallish, ResNetish, train_step
from pyalloc.offloading.plan import OUTPUT, PRODUCT, REGION, Profile, _Candidate, _Planner

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _reference_move(planner: _Planner, c: _Candidate) -> Any:
    """The move that takes ``c`` by its definition, from a walk of every chosen candidate (what
    the indexes of :meth:`_Planner._move` stand for): (replaced, added), or None where a chosen
    candidate rules ``c`` out."""
    chosen = planner.chosen
    if c.kind != REGION and any(d.kind != REGION and d.kind != c.kind and d.drops & c.drops for d in chosen):
        return None
    replaced = [d for d in chosen if d.packs is not None and d.packs in c.drops]
    for d in chosen:
        if not d.overlaps(c):
            continue
        if PRODUCT in (c.kind, d.kind):
            if c.kind == REGION and c.contains(d):
                replaced.append(d)
            elif d.kind == REGION and d.contains(c):
                return None
            continue
        if (d.call is c.call and d.kind != c.kind) or (d.call is not c.call and (c.kind != REGION or not c.contains(d))):
            return None
        replaced.append(d)
    added = [c]
    for d in chosen:
        if d.kind == OUTPUT and d not in replaced and c.drops & set(d.pins):
            options = [v for v in planner.variants.get(d.call.index, ())
                       if c.call.index in v.chain and not c.drops & set(v.pins)]
            if not options:
                return None
            replaced.append(d)
            added.append(min(options, key=lambda v: v.seconds))
    return replaced, added


class _Checked(_Planner):
    """A planner whose every try is checked against the move taken and taken back."""

    seen: Counter[str]

    def _try(self, c: _Candidate, peaks: Any = None) -> Any:
        chosen = list(self.chosen)
        # the indexes against the definitions they stand for
        assert self._overlapping(c) == [d for d in chosen if d.overlaps(c)]
        assert [id(d) for d in chosen] == sorted((id(d) for d in chosen), key=lambda i: self._place[i])
        move = None if id(c) in self._place else self._move(c)
        reference = None if id(c) in self._place else _reference_move(self, c)
        assert (reference is None) == (move is None or isinstance(move, _Candidate))
        assert reference is None or (reference[0] == move[0] and reference[1] == move[1])  # type: ignore[index]
        expected = None
        if move is not None and not isinstance(move, _Candidate):
            self._take(move)
            expected = (self.estimate(), self.seconds())
            self._take((move[1], move[0]))
        got = super()._try(c, peaks)
        if expected is None:
            assert got is None
            self.seen["ruled out"] += 1
        elif got is None:
            assert peaks is not None and expected[0] >= peaks[0], (expected, peaks[0])
            self.seen["could not help"] += 1
        else:
            assert (got[0], got[1]) == expected
            assert got[2] == move[0] and got[3] == move[1]  # type: ignore[index]
            self.seen["estimated"] += 1
        return got


def _profile(model: torch.nn.Module, x: torch.Tensor) -> Profile:
    train_step(model, x)
    profile = Profile()
    profile.start()
    with profile.saving():
        train_step(model, x)
    profile.stop()
    return profile


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_every_try_answers_what_the_move_taken_gives(name: str) -> None:
    torch.manual_seed(0)
    if name == "gpt":  # deep for its size: hundreds of candidates, the case the shortcuts are for
        model, x = GPTSmallish(d=32, layers=6, heads=2, seq=32), torch.randint(0, 1024, (4, 32))
    else:
        model, x = ResNetish(), torch.randn(4, 3, 32, 32)
    profile = _profile(model, x)
    base = _Checked(profile)
    base.seen = Counter()
    saved = sum(base.nbytes.values())
    for fraction in (0.5, 0.25, 0.0):
        for seed in [[], *base.seeds()]:
            for closing in (True, False):
                planner = _Checked(profile, like=base)
                planner.seen = base.seen
                planner.seed(seed)
                planner.run(int(saved * fraction), closing)
    # every way a try ends was taken, many times
    assert min(base.seen[k] for k in ("ruled out", "could not help", "estimated")) >= 50, base.seen
