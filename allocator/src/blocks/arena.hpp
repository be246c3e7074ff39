// arena.hpp: an arena's geometry: where a request fits, which granules a
// placement takes, which slivers can be shared.
//
// An arena is a segment made with the backend's virtual-memory calls
// (types.hpp): one reservation tiled by blocks, holes among them, a granule
// mapped under every block that is not a hole (I9), and twins, granules
// that map one physical granule and lend each other the parts they do not
// use (I13). Everything here reads an arena and changes nothing. The device
// allocator maps, unmaps, lends and stitches (Note [Arenas] and Note [Whole
// granules] in device/arena.cpp, Note [Shared granules] in device/share.cpp).
//
// `g` is the arena's granule (the backend's mapping granularity); offsets
// into granules are relative to the arena's base.
#pragma once

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "blocks/types.hpp"
#include "ground/compiler.hpp"

namespace pyalloc {

inline uintptr_t end_of(const Block* b) { return b->addr + b->size; }

// The block holding `addr`, walked to from `from`, a block of the same
// segment (a move's surgery: it only splits blocks, so a block found before
// it is still a block; Note [Moving slivers]).
inline Block* walk_to(Block* from, uintptr_t addr) {
  while (end_of(from) <= addr) from = from->next;
  while (from->addr > addr) from = from->prev;
  return from;
}

// Note [Balanced slivers]
// Near a full device, moves and shared windows pair a granule's free end
// (live up to p, free after) with another's free start (free up to q, live
// after), when p <= q (Note [Moving slivers] in device/move.cpp, Note [Shared
// granules] in device/share.cpp). Front placement makes only free ends: a
// block that is not a whole number of granules, placed at the front of a free
// block on a granule boundary, leaves its last granule's end free. On
// interleaved_lifetimes at 612 MiB, the first capacity that failed, 79
// granules were partly free (28 MiB), and 3 of them had a free start: there
// was nothing to pair. So while an arena's slivers are indexed (built near a
// full device for a share or a move, and dropped once memory is given back or
// no request has asked for them for a while: Note [Sliver index]; never with
// share=0 and move=0) and it has more free ends than free starts (by over
// kSliverImbalance), such a request ends on the boundary of the last granule
// it spans instead, and leaves the start of its first granule free
// (granule_offset): a free start, and the rest of its free block starts on a
// boundary. Not when that first granule is part of an extent (Note [Extents]
// in device/chunks.cpp), which neither shares nor moves: a window grown for a
// request of 64 MiB or more maps the granules the request covers wholly from
// the window's start as extents and keeps its last, partly used granule
// single, for the free end that front placement leaves there. (The counts
// include the slivers of extents' granules, which the walks for pairs skip.)
// Measured on the stress suite
// (docs/benchmarks/2026-11-29-balanced-slivers-cpu.md): interleaved_lifetimes
// needs 606 MiB instead of 614, the other 17 workloads the same with the
// default policy; generated again with seeds 1 to 4, interleaved_lifetimes
// needs 6 to 8 MiB less, and two_stream, size_sweep and batch_growth with
// seeds 1 to 3 up to 12 MiB less, never more. Tried and not kept: the same
// for every request of more than a granule at any occupancy (200 MiB more on
// vit_l_b256_s224, 80 on resnet50_b256_s224); by the granule's parity instead
// of the counts (604 MiB on interleaved_lifetimes, but 2 more on its seed 1);
// only for requests of more than a granule, or only for those whose last
// granule is less than half used (less gained: 600 and 604 MiB on seeds 1 and
// 4 instead of 594 and 600; 610 MiB).

// Free ends may outnumber free starts by this many before a placement
// starts making free starts (Note [Balanced slivers]).
inline constexpr size_t kSliverImbalance = 2;

// Where in `block` (a free block of an arena) a request of `rounded` bytes
// starts: 0, its start, unless
//   - `rounded` is a whole number of granules and the block's first granule
//     boundary leaves room for it: the distance to that boundary (Note
//     [Whole granules]);
//   - `rounded` is not, the block starts on a granule boundary, in a granule
//     of its own (not an extent's), and holds the granules the request
//     spans, and the arena's sliver index is on and lists more free ends
//     than free starts (by over kSliverImbalance): the request ends on the
//     last of those granules' boundaries, its first granule's start left
//     free (Note [Balanced slivers]).
size_t granule_offset(const Block* block, size_t rounded, size_t g);

// The first rule of granule_offset alone: the fast path's, which an index
// diverts, so the second never applies there (Note [Fast path]).
PYALLOC_INLINE size_t whole_granule_offset(const Block* block, size_t rounded, size_t g) {
  assert(g != 0);
  if (rounded % g != 0) return 0;
  const size_t into = (block->addr - block->segment->base) % g;
  if (into == 0 || block->size - rounded < g - into) return 0;
  return g - into;
}

// Granules that `block` (free, in an arena) would take from the free memory
// for `rounded` bytes placed at granule_offset: those the range overlaps,
// less the ones at the block's ends that live blocks use already.
size_t granules_taken(const Block* block, size_t rounded, size_t g);

// The first granule of the physical chunk mapped at granule `slot` of
// `arena` (mapped): `slot` itself, unless the chunk is an extent of several
// granules (Note [Extents] in device/chunks.cpp), each of which holds its
// handle in phys[]. Twins are single granules, and no two live chunks share
// a handle, so the walk back stops at the extent's first granule.
inline size_t extent_start(const Segment* arena, size_t slot, size_t g) {
  const PhysHandle h = arena->phys[slot];
  if (h.size <= g) return slot;
  while (slot > 0 && arena->phys[slot - 1].value == h.value) --slot;
  return slot;
}

// The part of [lo, hi) (granule-aligned, mapped) that whole chunks cover:
// [*a, *z), where a chunk that reaches past either end is left out; false
// when that is empty.
bool whole_chunks(const Segment* arena, uintptr_t lo, uintptr_t hi, size_t g, uintptr_t* a, uintptr_t* z);

// The block of `segment` (plain or arena) that holds `addr`, which must lie
// inside the segment: a walk from its first block.
Block* block_at(const Segment* segment, uintptr_t addr);

// block_at() in an arena, from the nearest holes (Segment::holes): cheap when
// a hole lies at or soon after `addr`, as where an arena grows.
Block* block_near_holes(const Segment* arena, uintptr_t addr);

// The parts of [lo, hi) that `lent` (blocks inside it, in address order,
// none overlapping) leaves: what a twin granule owns (I13).
std::vector<std::pair<uintptr_t, uintptr_t>> lent_gaps(const std::vector<Block*>& lent, uintptr_t lo, uintptr_t hi);

// Whether twin granule `slot` of `arena` owns nothing live: every block of
// the granule but its lent pieces (I13) is free. *overlaps (when given) says
// whether one of those free blocks overlaps [skip_lo, skip_hi).
bool own_part_free(const Segment* arena, size_t slot, size_t g, uintptr_t skip_lo = 0, uintptr_t skip_hi = 0,
                   bool* overlaps = nullptr);

// The granule-aligned interior of a free block of an arena: [*lo, *hi);
// false when it holds no whole granule.
bool free_interior(const Block* block, size_t g, uintptr_t* lo, uintptr_t* hi);

// The part of free_interior() outside [skip_lo, skip_hi) (granule-aligned: a
// window being grown), the lower part when there are two; false when none
// holds a whole granule.
bool interior_outside(const Block* block, size_t g, uintptr_t skip_lo, uintptr_t skip_hi, uintptr_t* lo,
                      uintptr_t* hi);

// Where an arena grows for a request: the window of `rounded` bytes, in a
// run of free blocks and holes, that needs the fewest granules mapped (then
// the lowest address).
struct Window {
  bool found = false;
  uintptr_t lo = 0;     // where the window starts
  size_t granules = 0;  // granules it needs mapped
};
Window best_window(const Segment* arena, size_t rounded, size_t g);

// A shared window (Note [Shared granules]): a window in a hole of the arena
// whose first granule maps a used granule's free end a second time, and
// whose last maps another's free start, either one, or neither.
struct SharePlan {
  static constexpr size_t kNone = SIZE_MAX;
  bool found = false;
  uintptr_t lo = 0;                    // the window's start: a hole's start
  size_t rounded = 0;                  // the request
  size_t granules = 0;                 // the window's granules
  size_t fresh = SIZE_MAX;             // of those, the ones that need a handle
  size_t front = kNone, back = kNone;  // the granules whose free end and free start it maps, or kNone
  size_t offset = 0;                   // where the request starts in the window's first granule
  size_t back_own = 0;                 // the length of the free start it maps last
  // The free blocks whose end and start it maps, as the arena is now: good
  // until the arena next changes.
  Block* front_block = nullptr;
  Block* back_block = nullptr;
};
// The choice that needs the fewest granules of its own (SharePlan::fresh);
// not found when nothing can be shared or no hole holds the window. Reads the
// arena's sliver index, which must be on (Note [Sliver index]).
SharePlan plan_share(const Segment* arena, size_t rounded, size_t g);

}  // namespace pyalloc
