// arena.cpp: an arena's geometry (arena.hpp).
#include "blocks/arena.hpp"

#include <algorithm>
#include <cassert>

#include "blocks/holes_inl.hpp"
#include "blocks/sliver_index.hpp"

namespace pyalloc {

namespace {

// Free or a hole: one test of a bit mask (best_window asks it of every block of every run).
constexpr unsigned kUsable = 1u << static_cast<unsigned>(BlockState::kFree) | 1u << static_cast<unsigned>(BlockState::kHole);
bool usable(const Block* b) { return (kUsable >> static_cast<unsigned>(b->state)) & 1u; }

// Granules that [lo, hi) needs mapped: the holes it overlaps, widened to
// granule boundaries (holes are granule-aligned, so the widened overlap
// stays inside the hole).
size_t granules_to_map(const Segment* arena, const Block* first, uintptr_t lo, uintptr_t hi, size_t g) {
  size_t bytes = 0;
  for (const Block* b = first; b != nullptr && b->addr < hi; b = b->next) {
    if (b->state != BlockState::kHole) continue;
    const uintptr_t a = std::max(lo, b->addr) - arena->base;
    const uintptr_t z = std::min(hi, end_of(b)) - arena->base;
    if (a < z) bytes += round_up_to(z, g) - a / g * g;
  }
  return bytes / g;
}

}  // namespace

// ---- choosing where to grow -------------------------------------------------------

// The window of `rounded` bytes in a run of free blocks and holes that needs
// the fewest granules mapped (then the lowest address). Candidates start at a
// block's start or end at a block's end: the cost only changes there. Only
// runs with a hole are walked, found from the hole set: the arena grows only
// for a request that no free block holds, and a run without a hole is one
// free block (free neighbours merge), so every window that fits needs a hole:
// a window that maps one granule is the cheapest there is, and the walk stops
// at the run that holds the first (ties go to the lowest address, and runs
// are walked lowest first). Callers have found no free block that holds
// `rounded`.
Window best_window(const Segment* arena, size_t rounded, size_t g) {
  Window best;
  auto consider = [&](const Block* first, uintptr_t lo) {
    const size_t cost = granules_to_map(arena, first, lo, lo + rounded, g);
    if (!best.found || cost < best.granules || (cost == best.granules && lo < best.lo)) {
      best = Window{true, lo, cost};
    }
  };
  uintptr_t walked_to = arena->base;  // runs end before holes beyond this start
  arena->holes.for_each([&](const Block* hole) {
    if (hole->addr < walked_to) return true;  // in the run just walked
    // A run shorter than the request holds no window: skip it in one walk,
    // back from the hole to the run's start and on until the request fits.
    size_t run = hole->size;
    const Block* b = hole;
    for (const Block* p = hole->prev; p != nullptr && usable(p); p = p->prev) {
      run += p->size;
      b = p;
    }
    const Block* end = hole->next;
    for (; end != nullptr && usable(end) && run < rounded; end = end->next) run += end->size;
    if (run < rounded) {
      walked_to = end != nullptr ? end->addr : arena->base + arena->size;
      return end != nullptr;
    }
    for (; b != nullptr && usable(b); b = b->next) {
      // Forward from b's start.
      size_t span = 0;
      for (const Block* c = b; c != nullptr && usable(c) && span < rounded; c = c->next) span += c->size;
      if (span >= rounded) consider(b, b->addr);
      // Backward from b's end.
      span = 0;
      const Block* first = b;
      for (const Block* c = b; c != nullptr && usable(c) && span < rounded; c = c->prev) {
        span += c->size;
        first = c;
      }
      if (span >= rounded && b->prev != nullptr) consider(first, end_of(b) - rounded);
    }
    walked_to = b != nullptr ? b->addr : arena->base + arena->size;
    return b != nullptr && best.granules > 1;
  });
  assert(!best.found || best.granules > 0);  // else a free block held the request
  return best;
}

// ---- finding blocks ---------------------------------------------------------------

// The block of `segment` that holds `addr` (inside the segment).
Block* block_at(const Segment* segment, uintptr_t addr) {
  Block* b = segment->head;
  while (end_of(b) <= addr) b = b->next;
  return b;
}

// The block of `arena` that holds `addr`, found from the holes around it: the
// hole before it, if that reaches it, else back from the hole after it.
Block* block_near_holes(const Segment* arena, uintptr_t addr) {
  if (Block* before = arena->holes.last_to(addr); before != nullptr && end_of(before) > addr) return before;
  Block* b = arena->holes.first_from(addr + 1);
  if (b == nullptr) return block_at(arena, addr);
  while (b->addr > addr) b = b->prev;
  return b;
}

// The part of [lo, hi) that whole chunks cover.
bool whole_chunks(const Segment* arena, uintptr_t lo, uintptr_t hi, size_t g, uintptr_t* a, uintptr_t* z) {
  const uintptr_t base = arena->base;
  const size_t first = (lo - base) / g;
  const size_t start = extent_start(arena, first, g);
  *a = start == first ? lo : base + start * g + arena->phys[start].size;
  const size_t last = (hi - base) / g - 1;
  *z = base + extent_start(arena, last, g) * g;
  if (*z + arena->phys[(*z - base) / g].size == hi) *z = hi;  // the last chunk ends at hi
  return *a < *z;
}

// The parts of [lo, hi) that `lent` leaves (arena.hpp).
std::vector<std::pair<uintptr_t, uintptr_t>> lent_gaps(const std::vector<Block*>& lent, uintptr_t lo, uintptr_t hi) {
  std::vector<std::pair<uintptr_t, uintptr_t>> gaps;
  uintptr_t at = lo;
  for (const Block* piece : lent) {
    if (piece->addr > at) gaps.emplace_back(at, piece->addr);
    at = end_of(piece);
  }
  if (at < hi) gaps.emplace_back(at, hi);
  return gaps;
}

// Whether twin granule `slot` owns nothing live (arena.hpp).
bool own_part_free(const Segment* arena, size_t slot, size_t g, uintptr_t skip_lo, uintptr_t skip_hi,
                   bool* overlaps) {
  const uintptr_t lo = arena->base + slot * g;
  const uintptr_t hi = lo + g;
  const Block* b = arena->twins.at(slot).lent.front();
  while (b->addr > lo) b = b->prev;
  bool touched = false;
  for (; b != nullptr && b->addr < hi; b = b->next) {
    if (b->state == BlockState::kLent) continue;  // one of its pieces: the granule's lent blocks are its own
    if (!b->is_free()) return false;
    touched = touched || (b->addr < skip_hi && end_of(b) > skip_lo);
  }
  if (overlaps != nullptr) *overlaps = touched;
  return true;
}

// The granule-aligned interior of a free block of an arena: [*lo, *hi). The
// granule is a power of two (arena_for).
bool free_interior(const Block* b, size_t granule, uintptr_t* lo, uintptr_t* hi) {
  const uintptr_t base = b->segment->base;
  const size_t mask = granule - 1;
  *lo = base + ((b->addr - base + mask) & ~mask);
  *hi = base + ((end_of(b) - base) & ~mask);
  return *lo < *hi;
}

bool interior_outside(const Block* b, size_t granule, uintptr_t skip_lo, uintptr_t skip_hi, uintptr_t* lo,
                      uintptr_t* hi) {
  if (!free_interior(b, granule, lo, hi)) return false;
  if (*hi <= skip_lo || *lo >= skip_hi) return true;  // apart from the window
  if (*lo < skip_lo) {
    *hi = skip_lo;  // the part before it
  } else {
    *lo = skip_hi;  // the part after it, if any
  }
  return *lo < *hi;
}

// ---- shared granules (Note [Shared granules] in device/share.cpp) ----------------

// The window for `rounded` bytes in a hole of `arena` whose first granule
// maps the free end of a granule in use and whose last maps the free start of
// another, either one, or neither: the choice that needs the fewest granules
// of its own (SharePlan::fresh). Not found when nothing can be shared. The
// arena's sliver index must be on (Note [Sliver index]). Only a granule that
// is a chunk of its own can be mapped a second time (Note [Extents]).
//
// Starting `o` bytes into a granule, the request spans one granule more once
// o passes g - (rounded % g), and its last bytes need a free start of
// (o + rounded) % g bytes. Both only grow with o below that point and start
// again small above it, where the span is a granule longer: so the free end
// with the lowest offset is never worse than another, except when the best
// free start lies in that same granule (which cannot be mapped twice over).
// The lowest few are tried, and among equals the lowest granule wins, which
// keeps the arena's used memory low (measured on the stress suite: lowest
// offset alone needed 4 to 6 MiB more on interleaved_lifetimes and
// transformer_lm; the lowest of eight 2 to 4 MiB less on two_stream and
// size_sweep than the walk over every block it replaces).
SharePlan plan_share(const Segment* arena, size_t rounded, size_t g) {
  constexpr size_t kFrontsTried = 8;
  assert(arena->slivers.on());
  const uintptr_t base = arena->base;
  const SliverIndex& slivers = arena->slivers;

  SharePlan best;
  // Starting `offset` into granule `front` (or on a boundary, kNone), ending
  // in the granule whose smallest free start holds its last bytes.
  auto consider = [&](Block* front_block, size_t front, size_t offset) {
    SharePlan c;
    c.rounded = rounded;
    c.front = front;
    c.offset = offset;
    c.front_block = front_block;
    c.granules = (offset + rounded + g - 1) / g;
    const size_t tail = (offset + rounded) % g;
    // A window of one granule maps one physical granule: a front twin, or
    // a back one, never both (their sum would exceed the window's granules).
    if (tail != 0 && !(c.granules == 1 && front != SharePlan::kNone)) {
      for (Block* b = slivers.first(SliverIndex::kStart, tail); b != nullptr;
           b = slivers.next(SliverIndex::kStart, b)) {
        const size_t slot = (end_of(b) - base) / g;
        if (slot == front || arena->phys[slot].size != g) continue;  // one granule cannot be both; Note [Extents]
        c.back = slot;
        c.back_own = (end_of(b) - base) % g;
        c.back_block = b;
        break;
      }
    }
    c.fresh = c.granules - (c.front != SharePlan::kNone) - (c.back != SharePlan::kNone);
    // Fewest fresh granules, then the lowest free end.
    if (c.fresh < best.fresh || (c.fresh == best.fresh && best.front != SharePlan::kNone && front < best.front)) {
      best = c;
    }
  };
  consider(nullptr, SharePlan::kNone, 0);
  size_t tried = 0;
  for (Block* b = slivers.first(SliverIndex::kEnd, 1); b != nullptr && tried < kFrontsTried;
       b = slivers.next(SliverIndex::kEnd, b)) {
    const size_t slot = (b->addr - base) / g;
    if (arena->phys[slot].size != g) continue;  // a granule of an extent maps only with it (Note [Extents])
    consider(b, slot, (b->addr - base) % g);
    ++tried;
  }
  if (best.front == SharePlan::kNone && best.back == SharePlan::kNone) return SharePlan{};

  // A hole to hold the window, lowest first.
  const Block* hole = arena->holes.lowest_fitting(best.granules * g);
  if (hole == nullptr) return SharePlan{};
  best.lo = hole->addr;
  best.found = true;
  return best;
}

size_t granule_offset(const Block* block, size_t rounded, size_t g) {
  const Segment* arena = block->segment;
  if (rounded % g == 0 || !arena->indexed) return whole_granule_offset(block, rounded, g);
  const size_t lo = block->addr - arena->base;
  const size_t spanned = round_up_to(rounded, g);
  const SliverIndex& slivers = arena->slivers;
  if (lo % g != 0 || block->size < spanned || arena->phys[lo / g].size != g ||
      slivers.count(SliverIndex::kEnd) <= slivers.count(SliverIndex::kStart) + kSliverImbalance) {
    return 0;
  }
  return spanned - rounded;
}

// Granules that `block` (free, in an arena) would take from the free memory
// for `rounded` bytes placed where alloc_block places them: those the range
// overlaps, less the ones at the block's ends that live blocks use already.
size_t granules_taken(const Block* block, size_t rounded, size_t g) {
  const size_t lo = block->addr - block->segment->base;
  const size_t hi = lo + block->size;
  const size_t at = lo + granule_offset(block, rounded, g);
  const size_t first = at / g;
  const size_t last = (at + rounded - 1) / g;
  size_t n = last - first + 1;
  const bool front_used = lo % g != 0;  // the block before it is in use (I2, I9)
  const bool back_used = hi % g != 0;
  if (front_used && first == lo / g) --n;
  if (back_used && last == (hi - 1) / g && !(front_used && lo / g == (hi - 1) / g)) --n;
  return n;
}

}  // namespace pyalloc
