// sliver_index_inl.hpp: SliverIndex's free-set hooks, inline for the fast
// path (Note [Sliver index] in sliver_index.hpp).
#pragma once

#include "blocks/sliver_index.hpp"
#include "blocks/types.hpp"

namespace pyalloc {


inline size_t SliverIndex::offset(Kind kind, const Block* block, size_t g) {
  const size_t lo = block->addr - block->segment->base;
  const size_t hi = lo + block->size;
  if (kind == kEnd) {
    const size_t into = lo % g;
    return into != 0 && hi >= lo - into + g ? into : 0;
  }
  const size_t into = hi % g;
  return into != 0 && lo <= hi - into ? into : 0;
}

inline void SliverIndex::link(Kind kind, Block* block, size_t unit) {
  ++count_[kind];
  Block* head = heads_[kind].at(unit);
  block->sliver_prev[kind] = nullptr;
  block->sliver_next[kind] = head;
  if (head != nullptr) {
    head->sliver_prev[kind] = block;
    heads_[kind].replace(unit, block);
  } else {
    heads_[kind].insert(unit, block);
  }
}

inline void SliverIndex::unlink(Kind kind, Block* block, size_t unit) {
  --count_[kind];
  Block* prev = block->sliver_prev[kind];
  Block* next = block->sliver_next[kind];
  if (next != nullptr) next->sliver_prev[kind] = prev;
  if (prev != nullptr) {
    prev->sliver_next[kind] = next;
  } else if (next != nullptr) {
    heads_[kind].replace(unit, next);
  } else {
    heads_[kind].erase(unit);
  }
  block->sliver_prev[kind] = block->sliver_next[kind] = nullptr;
}

inline size_t SliverIndex::whole_granules(const Block* block, size_t g) {
  const size_t lo = block->addr - block->segment->base;
  const size_t first = round_up_to(lo, g);
  const size_t end = lo + block->size;
  return end >= first + g ? (end - first) / g : 0;
}

// A twin lends nothing: its granule's slivers are not listed.
inline bool SliverIndex::lends(Kind kind, const Block* block, size_t g) {
  const size_t lo = block->addr - block->segment->base;
  return !block->segment->twinned[(kind == kEnd ? lo : lo + block->size) / g];
}

// Where `block` lies in its arena's granules, in the index's terms: one
// pass over its bounds with the granule's shift and mask, for insert and
// erase (the static helpers above say the same, one question at a time, for
// pyalloc_check).
inline SliverIndex::Place SliverIndex::place(const Block* block) const {
  const size_t mask = granule_ - 1;
  const size_t lo = block->addr - block->segment->base;
  const size_t hi = lo + block->size;
  const size_t first = (lo + mask) & ~mask;  // the first granule boundary at or after lo
  const size_t last = hi & ~mask;            // the last at or before hi
  Place p;
  p.end_unit = (lo & mask) != 0 && hi >= first ? (lo & mask) / kBlockAlign : 0;
  p.start_unit = (hi & mask) != 0 && lo <= last ? (hi & mask) / kBlockAlign : 0;
  p.end_granule = lo >> shift_;
  p.start_granule = hi >> shift_;
  p.first_whole = first >> shift_;
  p.whole = last > first ? (last - first) >> shift_ : 0;
  return p;
}

// `block` is not listed (its sliver_kinds may be stale from an index dropped
// since: it is set here, not added to). Twins are rare: an arena without any
// skips their lookups.
inline void SliverIndex::insert(Block* block) {
  const Place p = place(block);
  const Segment* arena = block->segment;
  const bool twins = !arena->twins.empty();
  uint8_t kinds = 0;
  if (p.end_unit != 0 && !(twins && arena->twinned[p.end_granule])) {
    link(kEnd, block, p.end_unit);
    kinds |= 1u << kEnd;
  }
  if (p.start_unit != 0 && !(twins && arena->twinned[p.start_granule])) {
    link(kStart, block, p.start_unit);
    kinds |= 1u << kStart;
  }
  block->sliver_kinds = kinds;
  if (p.whole != 0) roomy_.insert(p.first_whole, block);
  if (twins) {
    for (const Block* beside : {block->prev, block->next}) {
      if (beside != nullptr && beside->state == BlockState::kLent) check_twin((beside->addr - arena->base) >> shift_);
    }
  }
}

inline void SliverIndex::erase(Block* block) {
  const uint8_t kinds = block->sliver_kinds;
  if (kinds == 0 && block->size < granule_) return;  // no sliver, too small to be roomy
  const Place p = place(block);
  if (kinds & (1u << kEnd)) unlink(kEnd, block, p.end_unit);
  if (kinds & (1u << kStart)) unlink(kStart, block, p.start_unit);
  block->sliver_kinds = 0;
  if (p.whole != 0) {
    assert(roomy_.at(p.first_whole) == block);
    roomy_.erase(p.first_whole);
  }
}

inline size_t SliverIndex::first_whole(const Block* block, size_t g) {
  return round_up_to(block->addr - block->segment->base, g) / g;
}

inline Block* SliverIndex::roomy_from(size_t slot) const { return roomy_.next(slot); }

inline bool SliverIndex::is_roomy(const Block* block) const {
  if (whole_granules(block, granule_) == 0) return false;
  const size_t slot = first_whole(block, granule_);
  return slot < roomy_.slots() && roomy_.at(slot) == block;
}

}  // namespace pyalloc
