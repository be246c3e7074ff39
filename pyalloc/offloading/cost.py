"""The DTR cost model: what evicting a saved activation costs, and which one to evict.

Note [Free neighbours]
    DTR's score is ``cost / (size * staleness)``; MegEngine replaces ``size`` with the size of
    the free block the eviction would open: the tensor plus its free address neighbours, so that
    evictions favour opening contiguous space. When pyalloc is the CUDA allocator the session
    asks it (``pyalloc.free_neighbours``: the free blocks just below and above the tensor's
    allocation, one C call under the device lock). Elsewhere (CPU tensors, PyTorch's own
    allocator) there is no view of address adjacency, and the term is the tensor's own span.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .calls import Kept, ProducerCall, Produced
from .saved import RESIDENT, SWAPPED

if TYPE_CHECKING:
    from .saved import SavedActivation

SWAP_BYTES_PER_S = 8e9
"""Assumed host copy bandwidth (bytes/s) for the swap-cost estimate; PCIe gen4 x16 is ~25e9."""

MAX_REPLAY_DEPTH = 4
"""How many producer calls back a recompute may reach for missing inputs before giving up."""

NeighbourQuery = Callable[[int], "tuple[int, int]"]


def neighbour_query(cuda: bool) -> NeighbourQuery | None:
    """pyalloc.free_neighbours if pyalloc is installed as the CUDA allocator, else None."""
    if not cuda:
        return None
    from ..core import free_neighbours
    from ..pytorch.install import is_installed

    return free_neighbours if is_installed() else None


def swap_cost(h: SavedActivation) -> float:
    """Seconds to copy ``h`` out and back in."""
    return 2.0 * h.nbytes / SWAP_BYTES_PER_S


def call_cost(call: ProducerCall, depth: int = 0) -> float:
    """Seconds to re-run ``call`` now, with the producers of its missing inputs (DTR's e*):
    infinite when it cannot be replayed."""
    if not call.replayable or depth > MAX_REPLAY_DEPTH:
        return float("inf")
    cost = call.cost_s
    for ref in call.leaves:
        if isinstance(ref, Kept):
            if ref.tensor._version != ref.version:
                return float("inf")
        elif isinstance(ref, Produced):
            if ref.call.live_output(ref.index, ref.version) is not None:
                continue
            h = ref.call.out_handle(ref.index)
            if h is not None and h.state == RESIDENT:
                continue
            if h is not None and h.state == SWAPPED:
                cost += h.nbytes / SWAP_BYTES_PER_S
                continue
            cost += call_cost(ref.call, depth + 1)
    return cost


def free_neighbour_bytes(query: NeighbourQuery | None, h: SavedActivation) -> int:
    """The free bytes just below and above ``h``'s allocation (Note [Free neighbours])."""
    t = h.tensor
    if query is None or t is None or t.device.type != "cuda":
        return 0
    try:
        below, above = query(t.untyped_storage().data_ptr())
    except Exception:  # not one of pyalloc's allocations (made before install, or foreign)
        return 0
    return below + above


def score(h: SavedActivation, clock: int, swap: bool, recompute: bool,
          free_neighbours: NeighbourQuery | None, beat: float = float("inf")) -> tuple[float, str]:
    """DTR's h = cost / (size x staleness), with MegEngine's free-neighbour term in the size,
    and the cheaper way to evict, "drop" or "swap" (see Note [Free neighbours]).

    ``beat``: the best score so far of an eviction's candidates. A re-run costs at least its own
    call, so when that bound already scores ``beat`` or more, the walk through the producers of
    its missing inputs (``call_cost``, most of an eviction's time) is skipped and the score is
    returned as infinite: the candidate would lose anyway, and the choice is the same."""
    sc = swap_cost(h) if swap else float("inf")
    room = (h.nbytes + free_neighbour_bytes(free_neighbours, h)) * (clock - h.last_use + 1)
    call = h.producer[0] if recompute and h.producer is not None else None
    if min(call.cost_s if call is not None else float("inf"), sc) / room >= beat:
        return float("inf"), "drop"
    rc = call_cost(call) if call is not None else float("inf")
    how = "drop" if rc <= sc else "swap"
    return min(rc, sc) / room, how
