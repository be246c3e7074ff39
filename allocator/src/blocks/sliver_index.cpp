// sliver_index.cpp: SliverIndex's queries (Note [Sliver index] in sliver_index.hpp).
#include "blocks/sliver_index.hpp"

#include <algorithm>
#include <cassert>

#include "blocks/sliver_index_inl.hpp"

namespace pyalloc {

void SliverIndex::start(size_t granule, size_t granules) {
  assert(granule != 0 && (granule & (granule - 1)) == 0);
  granule_ = granule;
  shift_ = static_cast<unsigned>(__builtin_ctzll(granule));
  for (const Kind kind : {kEnd, kStart}) heads_[kind].reset(granule / kBlockAlign);
  roomy_.reset(granules);  // an index stopped and started again clears what it listed
  twins_to_check_.clear();
  count_[kEnd] = count_[kStart] = 0;
}

void SliverIndex::stop() { granule_ = 0; }

std::vector<size_t> SliverIndex::take_twins_to_check() {
  std::vector<size_t> slots = std::move(twins_to_check_);
  twins_to_check_.clear();
  std::sort(slots.begin(), slots.end());
  slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
  return slots;
}

bool SliverIndex::noted(size_t slot) const {
  return std::find(twins_to_check_.begin(), twins_to_check_.end(), slot) != twins_to_check_.end();
}

Block* SliverIndex::first_from_unit(Kind kind, size_t unit) const {
  return heads_[kind].next(unit);
}

Block* SliverIndex::first(Kind kind, size_t from) const {
  if (!on()) return nullptr;
  return first_from_unit(kind, (from + kBlockAlign - 1) / kBlockAlign);
}

Block* SliverIndex::next(Kind kind, const Block* block) const {
  if (block->sliver_next[kind] != nullptr) return block->sliver_next[kind];
  return first_from_unit(kind, offset(kind, block, granule_) / kBlockAlign + 1);
}

}  // namespace pyalloc
