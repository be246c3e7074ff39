"""Growth across iterations: which allocation sites keep more live bytes after every iteration,
and what keeps them.

Note [Doctor's growth test]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
At each iteration boundary (after an optimizer step; failing that, after a backward) the
session records the live bytes of every allocation site, and for the live tensors that have an
autograd history, how many graph nodes each site's tensors reach. The first boundary is
warm-up: optimizer state made at the first step, lazily built buffers and the allocator's
cache (never seen: the tracker counts tensors, not cached memory) settle there. From the
second boundary on, a site leaks when its live bytes end higher than they started, never fall
from one boundary to the next, and rise in at least two intervals and at least half of them:
a clean loop keeps every site exactly level, a site whose bytes go up and down (variable batch
shapes) is not a leak, and neither is state made once after warm-up (an optimizer's state for
a parameter that first gets a gradient at step 3). So growth is judged from four iterations
on. Bytes per iteration are the rise divided by the iterations it took.

A loss summed with its graph (``total += loss``) keeps no tensor bytes once backward freed the
saved tensors, but its autograd graph (host memory) grows by one iteration's nodes each time:
a site whose tensors reach more graph nodes at every boundary is reported too, with its
nodes per iteration, and named as the holder in the reasons of the sites whose saved tensors
that graph keeps.

Reasons (``reason_for``): a leaking site's newest surviving tensors are looked up among the
program's containers (``gc.get_referrers``): in a list (named when a module global, a local of
a running function or an attribute holds it) or an attribute of an object; whether the tensor
has an autograd history; whether autograd holds its storage for backward (SavedRef), and then
whether the module that saved it was in eval mode (evaluation without ``torch.no_grad()``) or
training (a graph that outlives its iteration: a tensor carried across iterations). Walking
graphs is bounded (MAX_GRAPH_NODES a boundary), and so is the number of boundaries kept
(MAX_BOUNDARIES: the first two and the most recent ones).
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from typing import Any

import torch

from .sites import SiteTable
from .tracker import StorageTracker

MAX_BOUNDARIES = 256
MIN_RISES = 2  # a site must rise in at least this many intervals to leak
MIN_BOUNDARIES = MIN_RISES + 2  # warm-up, then MIN_RISES intervals
MAX_GRAPH_NODES = 200_000  # graph nodes walked at one boundary, over all roots
REASON_SAMPLES = 2  # newest surviving tensors of a leaking site looked up
HOLDER_SAMPLES = 3  # tensors of a graph-holding site whose name is looked up


@dataclass
class Boundary:
    iteration: int
    total: int
    sites: dict[int, int]  # site -> live bytes
    graphs: dict[int, int]  # site -> most graph nodes reached from one live tensor made there


class Boundaries:
    """The boundaries kept: the first two and the newest, at most MAX_BOUNDARIES."""

    def __init__(self) -> None:
        self.items: list[Boundary] = []
        self.count = 0

    def add(self, b: Boundary) -> None:
        self.count += 1
        self.items.append(b)
        if len(self.items) > MAX_BOUNDARIES:
            del self.items[2]


def graph_sizes(tracker: StorageTracker) -> tuple[dict[int, int], dict[int, Any]]:
    """Site -> the most autograd nodes reachable from one live tensor the site made, and
    site -> a weak reference to that tensor."""
    seen_roots: set[int] = set()
    budget = MAX_GRAPH_NODES
    out: dict[int, int] = {}
    roots: dict[int, Any] = {}
    for record in list(tracker.live.values()):
        t = record.tensor() if record.tensor is not None else None
        fn = getattr(t, "grad_fn", None) if t is not None else None
        if fn is None or id(fn) in seen_roots:
            continue
        seen_roots.add(id(fn))
        count, budget = _count_nodes(fn, budget)
        if count > out.get(record.site, 0):
            out[record.site] = count
            roots[record.site] = record.tensor
        if budget <= 0:
            break
    return out, roots


def _count_nodes(root: Any, budget: int) -> tuple[int, int]:
    seen = {id(root)}
    stack = [root]
    while stack and budget > 0:
        node = stack.pop()
        budget -= 1
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                stack.append(nxt)
    return len(seen), budget


def boundary(tracker: StorageTracker, iteration: int) -> tuple[Boundary, dict[int, Any]]:
    """The boundary, and the largest graph's root tensor of each site (weak references)."""
    sizes, roots = graph_sizes(tracker)
    return Boundary(iteration, tracker.live_bytes, dict(tracker.site_live), sizes), roots


@dataclass
class Leak:
    site: int
    bytes_per_iteration: float
    graph_nodes_per_iteration: float = 0.0
    reason: str = ""


def _rising(values: list[int], strict: bool) -> bool:
    diffs = [b - a for a, b in zip(values, values[1:])]
    if not diffs or values[-1] <= values[0] or any(d < 0 for d in diffs):
        return False
    ups = sum(1 for d in diffs if d > 0)
    return ups == len(diffs) if strict else ups >= MIN_RISES and 2 * ups >= len(diffs)


def find_leaks(bounds: list[Boundary]) -> tuple[float, list[Leak]]:
    """(growth of all live bytes per iteration, leaks largest first) from the second boundary on;
    see Note [Doctor's growth test]. Needs MIN_BOUNDARIES boundaries."""
    if len(bounds) < MIN_BOUNDARIES:
        return 0.0, []
    window = bounds[1:]
    span = window[-1].iteration - window[0].iteration
    growth = (window[-1].total - window[0].total) / span
    leaks: dict[int, Leak] = {}
    sites = set().union(*(b.sites for b in window))
    for site in sites:
        values = [b.sites.get(site, 0) for b in window]
        if _rising(values, strict=False):
            leaks[site] = Leak(site, (values[-1] - values[0]) / span)
    for site in set().union(*(b.graphs for b in window)):
        values = [b.graphs.get(site, 0) for b in window]
        if _rising(values, strict=True):
            leak = leaks.setdefault(site, Leak(site, 0.0))
            leak.graph_nodes_per_iteration = (values[-1] - values[0]) / span
    ordered = sorted(leaks.values(), key=lambda k: (-k.bytes_per_iteration, -k.graph_nodes_per_iteration, k.site))
    return growth, ordered


# ---- reasons ------------------------------------------------------------------------------------


def _name_of(container: Any, sites: SiteTable) -> str | None:
    """A name the program knows `container` by: a local of a function running now, a global of
    the main script, or an attribute (Class.attr). Names are looked up before referrers, since
    one gc.get_referrers() call scans every object of the process."""
    seen: set[int] = set()
    scopes: list[dict[str, Any]] = []
    frame = sites.user_frame(sys._getframe(1))
    while frame is not None:
        try:
            scopes.append(frame.f_locals)
            scopes.append(frame.f_globals)
        except Exception:
            pass
        frame = sites.user_frame(frame.f_back)
    main = sys.modules.get("__main__")
    if main is not None:
        scopes.append(vars(main))
    for scope in scopes:
        if id(scope) in seen:
            continue
        seen.add(id(scope))
        for k, v in list(scope.items()):
            if v is container and isinstance(k, str):
                return k
    for ref in gc.get_referrers(container):
        if isinstance(ref, dict) and id(ref) not in seen:
            for k, v in ref.items():
                if v is container and isinstance(k, str):
                    owner = _dict_owner(ref)
                    return f"{type(owner).__name__}.{k}" if owner is not None else k
        else:
            attr = _attribute_of(ref, container)
            if attr is not None:
                return attr
    return None


def _attribute_of(obj: Any, value: Any) -> str | None:
    """"Class.attr" when `value` is an attribute of `obj` (an object whose attributes live in
    the object itself, as CPython 3.11+ keeps them until __dict__ is asked for)."""
    if isinstance(obj, (type, type(sys), list, tuple, dict)) or type(obj).__name__ == "frame":
        return None
    try:
        attrs = vars(obj)
    except TypeError:
        return None
    for k, v in attrs.items():
        if v is value:
            return f"{type(obj).__name__}.{k}"
    return None


def _dict_owner(d: dict[Any, Any]) -> Any:
    """The object whose __dict__ `d` is, or None (a module's globals or any other dict)."""
    for ref in gc.get_referrers(d):
        if getattr(ref, "__dict__", None) is d and not isinstance(ref, type(sys)):
            return ref
    return None


def _holders(t: torch.Tensor, sites: SiteTable) -> tuple[str, str] | None:
    """("list"|"attribute", name) when a list, or an object's attribute, holds `t`."""
    referrers = gc.get_referrers(t)
    for ref in referrers:
        if isinstance(ref, list):
            return "list", _name_of(ref, sites) or "a list"
        if isinstance(ref, tuple):  # outputs kept as (out, target) pairs
            for outer in gc.get_referrers(ref):
                if isinstance(outer, list):
                    return "list", _name_of(outer, sites) or "a list"
    for ref in referrers:
        if isinstance(ref, torch.nn.Module):
            continue
        if isinstance(ref, dict):
            owner = _dict_owner(ref)
            if owner is not None and not isinstance(owner, torch.nn.Module):
                for k, v in ref.items():
                    if v is t:
                        return "attribute", f"{type(owner).__name__}.{k}"
        else:
            attr = _attribute_of(ref, t)
            if attr is not None:
                return "attribute", attr
    return None


def _holder_text(tracker: StorageTracker, sites: SiteTable, holder_sites: list[int],
                 roots: dict[int, Any]) -> str:
    if not holder_sites:
        return ""
    names = []
    for site in holder_sites[:2]:
        root = roots.get(site)
        t = root() if root is not None else None
        name = _name_of(t, sites) if t is not None else None
        if name is None:
            # The root seen at the last boundary may have been replaced since (x = x + ...):
            # the largest graph among the site's newest tensors is the likeliest holder.
            t = _largest_root(tracker, site)
            name = _name_of(t, sites) if t is not None else None
        where = sites[site].where()
        names.append(f"`{name}` ({where})" if name else where)
    return ", kept by the graph of " + " and ".join(names)


def _largest_root(tracker: StorageTracker, site: int) -> torch.Tensor | None:
    records = [r for r in list(tracker.live.values()) if r.site == site and r.tensor is not None]
    newest = max((r.iteration for r in records), default=0)
    best, best_count, budget = None, 0, MAX_GRAPH_NODES
    for record in records:
        t = record.tensor() if record.iteration == newest and record.tensor is not None else None
        if t is None or t.grad_fn is None:
            continue
        count, budget = _count_nodes(t.grad_fn, budget)
        if count > best_count:
            best, best_count = t, count
        if budget <= 0:
            break
    return best


def reason_for(leak: Leak, tracker: StorageTracker, sites: SiteTable, since: int,
               holder_sites: list[int], roots: dict[int, Any]) -> str:
    """Why the site's storages made after iteration `since` are still alive, when it can be told."""
    newest = sorted(((k, r) for k, r in list(tracker.live.items()) if r.site == leak.site and r.iteration >= since),
                    key=lambda kr: -kr[1].iteration)[:REASON_SAMPLES]
    if not newest and leak.graph_nodes_per_iteration:
        newest = [(k, r) for k, r in list(tracker.live.items()) if r.site == leak.site][:REASON_SAMPLES]
    kept = None
    has_graph = False
    saved = None
    for key, record in newest:
        t = record.tensor() if record.tensor is not None else None
        if t is not None:
            kept = kept or _holders(t, sites)
            has_graph = has_graph or t.grad_fn is not None
        saved = saved or tracker.saved_owner.get(key)
    if kept is not None:
        kind, holder_name = kept
        what = (f"appended to the list `{holder_name}` every iteration" if kind == "list" and holder_name != "a list"
                else "appended to a list every iteration" if kind == "list"
                else f"kept in the attribute `{holder_name}`")
        if has_graph:
            return (f"{what}, and each keeps its autograd graph: keep .detach() of it "
                    f"(or .item() for a number)")
        return f"{what}: keep only what you need (.item() for a number) or bound the list"
    if saved is not None:
        # A tensor made at the leaking site itself that keeps a growing graph (an RNN's state)
        # is the likeliest holder; then the others, largest first.
        ordered = sorted(holder_sites, key=lambda s: s != leak.site)
        holder = _holder_text(tracker, sites, ordered, roots)
        if not saved.training:
            return (f"saved for backward by forward passes of {saved.top} run in eval mode without "
                    f"torch.no_grad(){holder}: run evaluation under torch.no_grad() "
                    f"(and accumulate .item() of its results)")
        return (f"saved for backward by an autograd graph that outlives its iteration{holder}: a tensor "
                f"carried across iterations keeps its history; .detach() it (for a number, .item()); "
                f"if this is evaluation, run it under torch.no_grad()")
    if leak.graph_nodes_per_iteration:
        root = roots.get(leak.site)
        t = root() if root is not None else None
        name = _name_of(t, sites) if t is not None else None
        if name is None:
            t = _largest_root(tracker, leak.site)
            name = _name_of(t, sites) if t is not None else None
        subject = f"`{name}`" if name else "a tensor made here"
        return (f"{subject} keeps an autograd graph that grows by {leak.graph_nodes_per_iteration:.0f} nodes "
                f"an iteration (host memory, and the graph's saved tensors when backward has not freed them): "
                f"accumulate .item() (a number) or .detach() instead")
    if has_graph:
        return "the tensor keeps an autograd graph: keep .detach() of it (or .item() for a number)"
    return ""
