// sliver_index.cpp: SliverIndex's queries (Note [Sliver index] in sliver_index.hpp).
#include "blocks/sliver_index.hpp"

#include <algorithm>

#include "blocks/sliver_index_inl.hpp"

namespace pyalloc {

void SliverIndex::start(size_t granule, size_t granules) {
  // An index stopped and started again (a device that hovers near full)
  // clears what it listed, not every slot.
  for (size_t s = roomy_.next(0); s != BitIndex::kNone; s = roomy_.next(s + 1)) roomy_at_[s] = nullptr;
  const size_t units = granule / kBlockAlign;
  for (const Kind kind : {kEnd, kStart}) {
    if (head_[kind].size() != units) {
      head_[kind].assign(units, nullptr);
    } else {
      for (size_t u = units_[kind].next(0); u != BitIndex::kNone; u = units_[kind].next(u + 1)) head_[kind][u] = nullptr;
    }
    units_[kind].reset(units);
  }
  if (roomy_at_.size() != granules) roomy_at_.reset(granules);  // once per arena
  granule_ = granule;
  roomy_.reset(granules);
  roomy_count_ = 0;
  whole_granules_ = 0;
  twins_to_check_.clear();
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
  const size_t found = units_[kind].next(unit);
  return found == BitIndex::kNone ? nullptr : head_[kind][found];
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
