"""The planner's tries (Note [Moves that cannot help] in plan.py): each try's answer is the one
taking the move and estimating gives, whether it ends at a remembered candidate that rules it out,
at a move seen not to lower the estimate, or at a whole estimate, and whether what it read was
remembered from an earlier try or not."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from pyalloc.offloading.bench_models import GPTSmallish, ResNetish
from pyalloc.offloading.plan import OUTPUT, PRODUCT, REGION, Profile, _Candidate, _Planner

from offload_fixture import profiled, step

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
    """A planner whose every try is checked against the reference move taken on a replica: a
    planner of the same profile with the same candidates chosen, in the same order (taking the
    move on the planner itself would forget what its tries remembered, so that no answer from
    memory would be checked)."""

    seen: Counter[str]
    profile: Profile

    def _try(self, c: _Candidate, peaks: Any = None) -> Any:
        chosen = list(self.chosen)
        # the indexes against the definitions they stand for
        assert self._overlapping(c) == [d for d in chosen if d.overlaps(c)]
        assert [id(d) for d in chosen] == sorted((id(d) for d in chosen), key=lambda i: self._place[i])
        remembered = id(c) in self._moves or id(c) in self._cut or id(c) in self._no_help
        move = None if id(c) in self._place else _reference_move(self, c)
        expected = None
        if move is not None:
            replica = _Planner(self.profile, like=self)
            for d in chosen:
                replica._apply(d, +1)
                replica._join(d)
            replica._take(move)
            expected = (replica.estimate(), replica.seconds())
        got = super()._try(c, peaks)
        assert list(self.chosen) == chosen  # a try changes nothing chosen
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
        if remembered and move is not None:
            self.seen["from memory"] += 1
        return got


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_every_try_answers_what_the_move_taken_gives(name: str) -> None:
    torch.manual_seed(0)
    if name == "gpt":  # deep for its size: hundreds of candidates, the case the shortcuts are for
        model, x = GPTSmallish(d=32, layers=6, heads=2, seq=32), torch.randint(0, 1024, (4, 32))
    else:
        model, x = ResNetish(), torch.randn(4, 3, 32, 32)
    step(model, x, 0)  # (state made on the first call is not the profile's)
    profile = profiled(model, x)
    base = _Checked(profile)
    base.seen, base.profile = Counter(), profile
    saved = sum(base.nbytes.values())
    for fraction in (0.5, 0.25, 0.0):
        for seed in [[], *base.seeds()]:
            for closing in (True, False):
                planner = _Checked(profile, like=base)
                planner.seen, planner.profile = base.seen, profile
                planner.seed(seed)
                planner.run(int(saved * fraction), closing)
    # every way a try ends was taken, many times
    assert min(base.seen[k] for k in ("ruled out", "could not help", "estimated", "from memory")) >= 50, base.seen
