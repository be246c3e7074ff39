"""Leaves the step made (Note [Step-made leaves] in pyalloc/offloading/plan.py): a saved tensor
without history that an operator of the step made (a dropout's mask, a layer norm's statistics,
the CPU LSTM's workspace) is activation memory: it counts against the budget, and a region drops
it and its re-run makes it again, exactly. Dropout noise a plan keeps is held as a mask (Note
[Packed noise] in pyalloc/offloading/dropout.py)."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

from pyalloc.offloading.bench_models import _LSTMBlock as _Block  # an LSTM and a dropout
from pyalloc.offloading import rng
from pyalloc.offloading import plan as plan_module
from pyalloc.offloading.dropout import noise_pack_seconds, pack_noise, packable_noise, unpack_noise
from pyalloc.offloading.ops import CallOps, run_replay
from pyalloc.offloading.plan import KEEP, REGION, MadeInStep, Profile, is_activation, storage_key
from pyalloc.offloading.session import OffloadFloorWarning, offload

from offload_fixture import assert_bitwise_equal, profiled, saved_bytes_peak, session_steps, step

# one profiled step, then the plan search (here up to four steps: a plan of two regions is tried,
# over the budget, before three) and settled steps, the first of which is counted
STEPS = 8


def _lstm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block(32) for _ in range(4)], nn.Linear(32, 8))


def _input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(8, 16, 32)


def _with_history_only(model: nn.Module, x: torch.Tensor) -> int:
    """What the count was before leaves the step made counted: saves with history alone."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if is_activation(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(model, x, 0)
    return sum(seen.values())


def test_only_leaves_an_operator_of_the_step_made_count() -> None:
    weight = nn.Parameter(torch.randn(4, 4))
    batch = torch.randn(4, 4)  # made before the step
    made = MadeInStep()
    with made:
        mask = torch.rand(4, 4) > 0.5  # a leaf the step made (no grad)
        view = batch.view(16)  # a view of the input: its storage is not made here
        y = batch @ weight  # history
    assert is_activation(mask, made.made) and not is_activation(mask)
    assert not is_activation(weight, made.made) and not is_activation(batch, made.made)
    assert not is_activation(view, made.made)
    assert is_activation(y, made.made) and is_activation(y)


def test_the_lstm_workspace_counts_against_the_budget() -> None:
    model, x = _lstm(), _input()
    total = saved_bytes_peak(model, x)
    history = _with_history_only(model, x)
    # four workspaces of the CPU LSTM (uint8 leaves) and four dropout masks besides the saves with
    # history: several times what those hold
    assert total > 3 * history
    profile = profiled(model, x)
    leaves = [p for p in profile.packs if p.leaf]
    assert {p.signature[1] for p in leaves} >= {torch.uint8}
    assert all(p.activation for p in leaves)
    assert sum(p.nbytes for p in leaves) > 2 * history


def test_a_region_drops_the_leaves_it_made_and_keeps_the_budget_exactly() -> None:
    model, x = _lstm(), _input()
    total = saved_bytes_peak(model, x)
    expected = [step(_lstm(), x, seed) for seed in range(STEPS)]
    budget = total // 2
    session = offload(budget=budget, pressure_callback=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadFloorWarning)  # half is above this model's floor
        got = session_steps(session, model, x, STEPS)
    for e, g in zip(expected, got):
        assert_bitwise_equal(e, g)
    st = session.stats()
    assert st["plan_settled"] == 1 and st["step_saved_bytes_peak"] <= budget * 1.05
    search = session._search
    assert search is not None
    plan = search.plan
    assert plan.leaves and any(plan.actions[seq] == REGION for seq in plan.leaves)
    # the peak counted the workspaces the plan keeps: above what saves with history alone hold
    kept = [seq for seq in plan.leaves if plan.actions[seq] == KEEP]
    if kept:
        assert st["step_saved_bytes_peak"] > _with_history_only(model, x) // 2


def _replayable(block: nn.Module, x: torch.Tensor) -> tuple[list, list[torch.Tensor], CallOps, Callable]:
    """One profiled forward of ``block`` on ``x``, its saves kept: the call's saves as profiled
    and as tensors, its operator table (as the planner makes it for a selective region), and a
    function that runs a recipe's replay from the kept saves, the generator as at the call's start
    (as a region's re-run has it)."""
    profile, saves = Profile(), []

    def pack(t: torch.Tensor) -> torch.Tensor:
        profile.note_pack(t)
        saves.append(t)
        return t

    profile.start()
    state = torch.default_generator.get_state()
    with profile.recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    profile.stop()
    call = profile.roots()[0]
    ops = profile.ops[call.first_op:call.end_op]
    packs = profile.packs[call.first_pack:call.end_pack]
    made = {k for op in ops for k in op.writes}
    geometry = [(p.signature[0], p.stride, p.offset, p.signature[1], torch.device("cpu")) for p in packs]
    params = {storage_key(t): "p:" + name for name, t in block.named_parameters()}
    table = CallOps(ops, [p.key for p in packs], made.__contains__, {k: i for i, k in enumerate(call.input_keys)},
                    params, geometry, call.input_geometry)
    attrs = dict(block.named_parameters())
    saved = saves[call.first_pack:call.end_pack]

    def replay(recipe: Any) -> dict[int, torch.Tensor] | None:
        with rng.replayed(state, ()):
            return run_replay(recipe, {i: saved[i] for i in recipe.source_keys}, [x], lambda name: attrs[name[2:]])

    return packs, saved, table, replay


def test_a_replay_that_cannot_make_a_dropped_save_gives_nothing() -> None:
    """The CPU LSTM layer makes its workspace with grad on only: replayed under no_grad it leaves
    it out, and the replay says so (Note [Operator replay] in ops.py) instead of a KeyError."""
    packs, _, table, replay = _replayable(_Block(32), _input())
    workspace = next(p for p in packs if p.leaf and p.signature[1] is torch.uint8)
    recipe = table.recipe({workspace.key})
    assert recipe is not None and recipe.replay is not None
    assert replay(recipe) is None


class _CachedTable(nn.Module):
    """Builds a table on its first call and keeps it (as rotary tables and cached masks are): the
    profiled step, the first, makes it; the steps after it do not. Kept in a dict, which the
    profile's state check does not look into (an attribute set from None would have the next
    step profiled again: Note [State built on the first call] in plan.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.cache: dict[str, torch.Tensor] = {}

    @property
    def table(self) -> torch.Tensor | None:
        return self.cache.get("table")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "table" not in self.cache:
            self.cache["table"] = torch.linspace(1.0, 2.0, x.shape[-2] * x.shape[-1]).view(x.shape[-2], x.shape[-1])
        return self.lin(x) * self.cache["table"]  # the product saves the table


def test_a_leaf_the_first_step_made_and_kept_is_not_counted_after_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_CachedTable(), nn.GELU(), nn.Linear(32, 8))
    x = _input()
    session = offload(budget=1 << 30, pressure_callback=False)
    with session:
        step(model, x, 0)
    search = session._search
    assert search is not None
    table = model[0].table
    assert table is not None
    kept = [p for p in search.profile.packs if p.signature == (tuple(table.shape), table.dtype)]
    assert kept and not any(p.leaf or p.activation for p in kept)
    # what the plan counts is what a later step saves, the table no longer made there
    assert search.plan.baseline_bytes == saved_bytes_peak(model, x)


class _TwoDropouts(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, d), nn.Linear(d, d)
        self.d1, self.d2 = nn.Dropout(0.3), nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.d2(torch.tanh(self.l1(self.d1(x)))))


def test_a_replay_of_the_second_dropout_noise_draws_the_first_one_before_it() -> None:
    """The noise is a leaf the step made, so a selective recipe may drop the second dropout's
    alone; its replay starts from the generator state of the call's start, so the first
    dropout's draw runs first (a second reviewer's finding: it was left out, and the replayed
    mask was another one)."""
    torch.manual_seed(0)
    packs, saved, table, replay = _replayable(_TwoDropouts(), torch.randn(32, 64, requires_grad=True))
    second = [i for i, p in enumerate(packs) if p.leaf][-1]
    recipe = table.recipe({packs[second].key})
    assert recipe is not None and recipe.replay is not None and recipe.random
    filled = replay(recipe)
    assert filled is not None and torch.equal(filled[second], saved[second])


class _MakesAMask(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = torch.sigmoid(x.repeat(1, 4) * 2)  # x needs no grad: a leaf the step made
        return self.lin(m), m  # the linear saves it


class _TakesTheMask(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(torch.tanh(h)))) + m.sum(-1, keepdim=True)  # m not saved here


def test_a_leaf_the_step_made_counts_as_a_region_input_too() -> None:
    """A region keeps its inputs until backward; one that is a leaf the step made is held there
    even where the call that saved it dropped it (a second reviewer's finding: it was counted as
    freed, and a step held 7.3 MB at a budget of 5.35 MB with no warning)."""
    torch.manual_seed(0)
    made, takes = _MakesAMask(64), _TakesTheMask(64)
    x = torch.randn(32, 64)
    profile = Profile()
    profile.start()
    with profile.saving():
        h, m = made(x)
        takes(h, m).square().mean().backward()
    profile.stop()
    call = next(c for c in profile.calls if c.name == "_TakesTheMask")
    assert call.input_activation == [True, True]  # h has history; m is a leaf the step made


# ---- dropout noise kept as a mask (Note [Packed noise] in dropout.py) ------------------------


def test_noise_packs_to_a_mask_and_back_bit_for_bit_and_nothing_else_packs() -> None:
    torch.manual_seed(0)
    noise = torch.empty(64, 128).bernoulli_(0.9).div_(0.9)
    assert packable_noise(noise)
    packed = pack_noise(noise)
    assert packed is not None
    mask, scale = packed
    assert mask.dtype is torch.bool and mask.untyped_storage().nbytes() * 4 == noise.untyped_storage().nbytes()
    back = unpack_noise(mask, scale)
    assert back.dtype == noise.dtype and back.stride() == noise.stride()
    assert torch.equal(back.view(torch.int32), noise.view(torch.int32))  # the bits, not only the values
    assert pack_noise(torch.randn(64, 128)) is None  # more than one nonzero value
    assert pack_noise(torch.where(noise == 0, -0.0, noise)) is None  # its bits, not its values, come back
    negative_zero = noise.clone()
    negative_zero[0, 0] = -0.0
    assert not packable_noise(negative_zero)  # the mask would give +0.0
    assert packable_noise(noise.t())  # dense in another order: the mask keeps it
    assert not packable_noise(noise[:, ::2])  # not all of its storage


def _forced_plan(pick: Callable[[Any], list[Any]]) -> Callable[..., Any]:
    """A ``make_plan`` that takes the candidates ``pick(planner)`` names, in order."""
    def make_plan(profile: Profile, budget: int, floor_bytes: int | None = None, selective: bool = True) -> Any:
        planner = plan_module._Planner(profile, selective=False)
        for c in pick(planner):
            tried = planner._try(c)
            assert tried is not None
            planner._take((tried[2], tried[3]))
        return plan_module.plan_of(profile, planner, planner.estimate(), budget)
    return make_plan


@pytest.fixture
def packs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plan holds all the noise it can packed, and does nothing else: what packing does to
    a step, tested apart from whether the planner finds it the cheapest (on these small models a
    dropout's re-run measures next to nothing, and the choice goes either way)."""
    monkeypatch.setattr(plan_module, "make_plan", _forced_plan(
        lambda planner: [c for c in planner.candidates if c.kind == plan_module.PACK]))


def _packing_budget(model: nn.Module, x: torch.Tensor) -> int:
    """A budget that packing all of the step's noise meets."""
    profile = profiled(model, x)
    freed = sum(p.nbytes - p.packed for p in profile.packs if p.packed)
    assert freed > 0
    return saved_bytes_peak(model, x) - freed * 9 // 10


@pytest.fixture
def dear_packs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing weighed at 10 s a noise, whatever the profile measured: the planner's choice
    between packing and re-running, made certain."""
    measured = plan_module.noise_pack_seconds
    monkeypatch.setattr(plan_module, "noise_pack_seconds", lambda t: None if measured(t) is None else 10.0)


def test_packing_is_weighed_against_re_runs(dear_packs: None) -> None:
    """A noise is held packed only where the planner finds that cheaper than freeing the bytes
    another way (it was packed wherever kept: 1.08-1.19x the plain step on the BERT-like model at
    95% of its saved bytes, where a refill or two does)."""
    model, x = _lstm(), _input()
    session = offload(budget=saved_bytes_peak(model, x) * 3 // 4, pressure_callback=False)
    session_steps(session, model, x, STEPS)
    st = session.stats()
    assert st["noise_packed_total"] == 0 and st["plan_settled"] == 1 and st["plan_regions"] > 0
    search = session._search
    assert search is not None and not search.plan.noise
    assert any(p.packed and p.pack_seconds == 10.0 for p in search.profile.packs)  # packable, but dear


def test_the_profile_measures_what_a_pack_costs() -> None:
    torch.manual_seed(0)
    seconds = noise_pack_seconds(torch.empty(64, 128).bernoulli_(0.9).div_(0.9))
    assert seconds is not None and 0.0 < seconds < 1.0
    assert noise_pack_seconds(torch.randn(64, 128)) is None


def test_a_pack_is_proved_by_counting_every_element() -> None:
    """Packing holds only where every element is ``+0.0`` or the one positive finite scale, in
    each floating dtype; one element otherwise anywhere and nothing is packed."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        noise = torch.empty(4096, dtype=dtype).bernoulli_(0.7).div_(0.7)
        packed = pack_noise(noise)
        assert packed is not None, dtype
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[noise.element_size()]
        assert torch.equal(unpack_noise(*packed).view(ints), noise.view(ints))
        kept = int(noise.nonzero()[-1])
        for odd in (-0.0, 0.5, float("nan"), float("inf"), -1.0):
            bad = noise.clone()
            bad[kept if odd != -0.0 else int((noise == 0).nonzero()[-1])] = odd
            assert pack_noise(bad) is None, (dtype, odd)
        assert pack_noise(torch.zeros(64, dtype=dtype)) is None  # no scale to keep
        assert pack_noise(torch.full((64,), float("inf"), dtype=dtype)) is None
        assert pack_noise(-noise) is None


def test_planned_steps_keep_dropout_noise_packed_within_the_budget_exactly(packs_only: None) -> None:
    model, x = _lstm(), _input()
    expected = [step(_lstm(), x, seed) for seed in range(STEPS)]
    budget = _packing_budget(model, x)
    session = offload(budget=budget, pressure_callback=False)
    got = session_steps(session, model, x, STEPS)
    for e, g in zip(expected, got):
        assert_bitwise_equal(e, g)
    st = session.stats()
    assert st["noise_packed_total"] > 0 and st["plan_settled"] == 1 and st["step_saved_bytes_peak"] <= budget * 1.05
    search = session._search
    assert search is not None and search.plan.noise
    assert all(search.profile.packs[seq].packed for seq in search.plan.noise)


def test_a_budget_never_reached_packs_nothing() -> None:
    model, x = _lstm(), _input()
    session = offload(budget=saved_bytes_peak(model, x) * 10, pressure_callback=False)
    session_steps(session, model, x, STEPS)
    st = session.stats()
    assert st["noise_packed_total"] == 0 and st["idle_steps_total"] > 0


def test_a_noise_counts_packed_while_kept_and_whole_when_a_re_run_makes_it_again() -> None:
    """The planner holds a kept noise at its mask's bytes, but a selective region that drops it
    makes the float noise again in backward: its refill counts the whole bytes (counting the
    mask's made the plan's estimate low by three quarters of each such noise)."""
    from pyalloc.offloading.bench_models import train_step, workloads
    from pyalloc.offloading.plan import REGION as REGION_KIND, _Planner, packed_bytes

    torch.manual_seed(0)
    bert = workloads("cpu")["bert"]  # attention and feed-forward dropouts in every block
    session = offload(budget=1, pressure_callback=False)
    with session:
        train_step(bert.make_model(), bert.make_input(4))
    search = session._search
    assert search is not None
    profile = search.profile
    planner = _Planner(profile)
    whole = {p.key: p.nbytes for p in profile.packs if p.activation}
    noise = {k for k, seqs in planner.saves.items() if packed_bytes(profile.packs, seqs)}
    assert noise and noise == set(planner.packed_nbytes)
    assert all(planner.packed_nbytes[k] * 4 == whole[k] == planner.nbytes[k] for k in noise)
    selective = [c for c in planner.candidates if c.kind == REGION_KIND and c.recipe is not None]
    assert any(c.drops & noise for c in selective)
    for c in selective:
        assert c.transient == sum(whole[k] for k in c.drops)


def test_a_storage_saved_twice_packs_only_when_every_save_can() -> None:
    from pyalloc.offloading.plan import PackInfo, packed_bytes

    def info(packed: int) -> PackInfo:
        return PackInfo(("s", "cpu"), 4096, True, -1, None, 0, ((1024,), torch.float32), (1,), 0, leaf=True,
                        packed=packed)

    assert packed_bytes([info(1024), info(1024)], [0, 1]) == 2048  # each save holds its own mask
    assert packed_bytes([info(1024), info(0)], [0, 1]) == 0  # one float copy is held anyway
    assert packed_bytes([info(1024)] * 4, [0, 1, 2, 3]) == 0  # four masks hold what the float did


def test_every_planned_step_packs_the_noise_the_plan_holds_packed_counted_or_not(packs_only: None) -> None:
    """A settled plan counts one step in 20; the plan holds the noise at its mask's bytes on the
    others too (a review: they kept it whole, up to 1.5x the budget, unseen by the counted peak)."""
    model, x = _lstm(), _input()
    session = offload(budget=_packing_budget(model, x), pressure_callback=False)
    session_steps(session, model, x, STEPS)
    search = session._search
    assert search is not None and search.plan.noise and session.stats()["plan_settled"] == 1
    for seed in range(3):
        before = session.stats()["noise_packed_total"]
        with session:
            step(model, x, seed)
        assert session.stats()["noise_packed_total"] - before == len(search.plan.noise)


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.detach()  # a leaf the step made: {0, 2} while no element is over 1, else {0, 1, 2}
        return x * ((h > 0).float() * 2.0 - (h > 1.0).float())


def test_a_leaf_that_stops_being_two_valued_makes_the_step_profiled_again() -> None:
    """The profile saw a mask of two values and planned it packed; when a later step's cannot be
    packed the step diverges and the next is profiled again, instead of holding it whole beyond
    the plan (a review: 1.13-1.17x the budget on counted steps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), _Gate(), nn.Linear(128, 32), _Gate(), nn.Linear(32, 4))
    x = torch.randn(64, 32)
    small, large = x * 0.01, x * 10
    session = offload(budget=saved_bytes_peak(model, small) // 2, pressure_callback=False)
    session_steps(session, model, small, STEPS)
    profiles = session.stats()["profile_steps_total"]
    session_steps(session, model, large, 2)
    assert session.stats()["profile_steps_total"] > profiles


# ---- packing beside refills and pins (a review, 2026-11-29) ---------------------------------


def test_a_dropout_refilled_from_a_packed_noise_holds_no_float_copy_until_backward(monkeypatch: Any) -> None:
    """Its refill read the noise when the call returned, which unpacked a float copy that it
    held until backward beside the mask: 1.25 times the noise where the plan counted a quarter."""
    import gc
    import weakref

    from pyalloc.offloading import dropout

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Dropout(0.3), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    monkeypatch.setattr(plan_module, "make_plan", _forced_plan(lambda p: [
        *(c for c in p.candidates if c.kind == plan_module.PACK),
        next(c for c in p.candidates if c.kind == plan_module.OUTPUT and isinstance(c.call.module(), nn.Dropout))]))
    expected = [step(model, x, seed) for seed in range(4)]
    session = offload(budget=saved_bytes_peak(model, x) // 2, pressure_callback=False)
    for e, g in zip(expected, session_steps(session, model, x, 4)):
        assert_bitwise_equal(e, g)
    search = session._search
    assert search is not None and search.plan.noise and search.plan.outputs
    unpacked: list[Any] = []
    real = dropout.unpack_noise
    monkeypatch.setattr(dropout, "unpack_noise", lambda m, s: unpacked.append(weakref.ref(t := real(m, s))) or t)
    before = session.stats()["dropout_refills_total"]
    with session:
        torch.manual_seed(0)
        loss = model(x).square().mean()
        gc.collect()
        assert not [r for r in unpacked if r() is not None]  # the mask alone until backward
        loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert_bitwise_equal(expected[0], got)
    assert session.stats()["dropout_refills_total"] == before + 1 and unpacked  # refilled from the mask


class _Mul(nn.Module):
    def forward(self, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h * m)


class _MaskedInput(nn.Module):
    """A noise the step makes, passed to a module: an output re-run of that module pins it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.mul, self.b = nn.Linear(64, 256), _Mul(), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(self.mul(h, torch.empty_like(h).bernoulli_(0.7).div_(0.7)))


def test_a_pinned_noise_counts_whole_packed_or_not_and_packing_it_is_never_a_gain() -> None:
    torch.manual_seed(0)
    model, x = _MaskedInput(), torch.randn(32, 64)
    planner = plan_module._Planner(profiled(model, x), selective=False)
    (pack,) = [c for c in planner.candidates if c.kind == plan_module.PACK]
    pins = next(c for c in planner.candidates if c.kind == plan_module.OUTPUT and isinstance(c.call.module(), _Mul)
                and pack.packs in c.pins)
    planner._take(([], [pins]))
    pinned = planner.total
    planner._take(([], [pack]))
    whole, mask = planner.nbytes[pack.packs], planner.packed_nbytes[pack.packs]
    assert planner.total == pinned + mask  # the re-run's argument holds the float; the masks come on top
    assert mask * 4 == whole


def test_a_region_that_drops_a_packed_noise_replaces_its_pack_and_no_candidate_is_taken_twice() -> None:
    model, x = _lstm(), _input()
    profile = profiled(model, x)
    planner = plan_module._Planner(profile, selective=False)
    pack = next(c for c in planner.candidates if c.kind == plan_module.PACK)
    planner._take(([], [pack]))
    packed = plan_module.plan_of(profile, planner, planner.estimate(), 1)
    assert planner._try(pack) is None  # chosen already
    region = next(c for c in planner.candidates if c.kind == REGION and pack.packs in c.drops)
    tried = planner._try(region)
    assert tried is not None and pack in tried[2]  # a pack of a dropped storage packs nothing
    planner._take(([pack], []))
    assert packed.noise and not packed.same(plan_module.plan_of(profile, planner, planner.estimate(), 1))


def test_pack_noise_refuses_what_it_cannot_pack_without_raising() -> None:
    assert pack_noise(torch.tensor(1.25)) is not None  # 0-dim: the comparing path
    assert pack_noise(torch.tensor(0.5)) is not None
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int32):
        assert pack_noise(torch.ones(64).to(dtype)) is None
