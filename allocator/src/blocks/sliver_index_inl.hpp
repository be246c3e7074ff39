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

// `block` is not listed (its sliver_kinds may be stale from an index dropped
// since: it is set here, not added to).
inline void SliverIndex::insert(Block* block) {
  uint8_t kinds = 0;
  for (const Kind kind : {kEnd, kStart}) {
    const size_t off = offset(kind, block, granule_);
    if (off == 0 || !lends(kind, block, granule_)) continue;
    link(kind, block, off / kBlockAlign);
    kinds |= static_cast<uint8_t>(1u << kind);
  }
  block->sliver_kinds = kinds;
  if (const size_t whole = whole_granules(block, granule_)) {
    roomy_.insert(first_whole(block, granule_), block);
    whole_granules_ += whole;
  }
  const uintptr_t base = block->segment->base;
  for (const Block* beside : {block->prev, block->next}) {
    if (beside != nullptr && beside->state == BlockState::kLent) check_twin((beside->addr - base) / granule_);
  }
}

inline void SliverIndex::erase(Block* block) {
  for (const Kind kind : {kEnd, kStart}) {
    if (!(block->sliver_kinds & (1u << kind))) continue;
    unlink(kind, block, offset(kind, block, granule_) / kBlockAlign);
  }
  block->sliver_kinds = 0;
  if (const size_t whole = whole_granules(block, granule_)) {
    const size_t slot = first_whole(block, granule_);
    assert(roomy_.at(slot) == block);
    roomy_.erase(slot);
    whole_granules_ -= whole;
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
