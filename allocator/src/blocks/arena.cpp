// arena.cpp: an arena's geometry (arena.hpp).
#include "blocks/arena.hpp"

#include <algorithm>

namespace pyalloc {

namespace {

bool usable(const Block* b) { return b->state == BlockState::kFree || b->state == BlockState::kHole; }

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
// block's start or end at a block's end: the cost only changes there.
Window best_window(const Segment* arena, size_t rounded, size_t g) {
  Window best;
  auto consider = [&](const Block* first, uintptr_t lo) {
    const size_t cost = granules_to_map(arena, first, lo, lo + rounded, g);
    if (!best.found || cost < best.granules || (cost == best.granules && lo < best.lo)) {
      best = Window{true, lo, cost};
    }
  };
  for (const Block* b = arena->head; b != nullptr; b = b->next) {
    if (!usable(b)) continue;
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
  return best;
}

// ---- finding blocks ---------------------------------------------------------------

// The block of `segment` that holds `addr` (inside the segment).
Block* block_at(const Segment* segment, uintptr_t addr) {
  Block* b = segment->head;
  while (end_of(b) <= addr) b = b->next;
  return b;
}

// The granule-aligned interior of a free block of an arena: [*lo, *hi).
bool free_interior(const Block* b, size_t granule, uintptr_t* lo, uintptr_t* hi) {
  const uintptr_t base = b->segment->base;
  *lo = base + round_up_to(b->addr - base, granule);
  *hi = base + (end_of(b) - base) / granule * granule;
  return *lo < *hi;
}

// ---- shared granules (Note [Shared granules] in device/share.cpp) ----------------

// The window for `rounded` bytes in a hole of `arena` whose first granule
// maps the free end of a granule in use and whose last maps the free start of
// another, either one, or neither: the choice that needs the fewest granules
// of its own (SharePlan::fresh). Not found when nothing can be shared.
SharePlan plan_share(const Segment* arena, size_t rounded, size_t g) {
  const uintptr_t base = arena->base;
  // A free block that starts inside a granule and runs to its end can lend
  // that end (from `offset` on); one that ends inside a granule, running from
  // its start, can lend that start (up to `offset`). A twin lends nothing.
  struct Sliver {
    size_t slot;
    size_t offset;
  };
  std::vector<Sliver> ends, starts;
  for (const Block* b = arena->head; b != nullptr; b = b->next) {
    if (!b->is_free()) continue;
    const size_t lo = b->addr - base;
    const size_t hi = lo + b->size;
    if (lo % g != 0 && hi >= round_up_to(lo, g) && arena->twins.count(lo / g) == 0) ends.push_back({lo / g, lo % g});
    if (hi % g != 0 && lo <= hi / g * g && arena->twins.count(hi / g) == 0) starts.push_back({hi / g, hi % g});
  }
  SharePlan best;
  if (ends.empty() && starts.empty()) return best;
  std::sort(starts.begin(), starts.end(), [](const Sliver& a, const Sliver& b) { return a.offset < b.offset; });

  // Starting `offset` into a granule that maps ends[i] (or on a boundary),
  // ending in one that maps the smallest free start that holds its last bytes.
  auto consider = [&](size_t front, size_t offset) {
    SharePlan c;
    c.rounded = rounded;
    c.front = front;
    c.offset = offset;
    c.granules = (offset + rounded + g - 1) / g;
    const size_t tail = (offset + rounded) % g;
    if (tail != 0) {
      auto it = std::lower_bound(starts.begin(), starts.end(), tail,
                                 [](const Sliver& s, size_t want) { return s.offset < want; });
      while (it != starts.end() && it->slot == front) ++it;
      if (it != starts.end()) {
        c.back = it->slot;
        c.back_own = it->offset;
      }
    }
    c.fresh = c.granules - (c.front != SharePlan::kNone) - (c.back != SharePlan::kNone);
    if (c.fresh < best.fresh) best = c;
  };
  consider(SharePlan::kNone, 0);
  for (const Sliver& s : ends) consider(s.slot, s.offset);
  if (best.front == SharePlan::kNone && best.back == SharePlan::kNone) return SharePlan{};

  // A hole to hold the window, lowest first.
  const Block* hole = arena->head;
  while (hole != nullptr && !(hole->state == BlockState::kHole && hole->size >= best.granules * g)) hole = hole->next;
  if (hole == nullptr) return SharePlan{};
  best.lo = hole->addr;
  best.found = true;
  return best;
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
