// sliver_index.cpp: SliverIndex's queries (Note [Sliver index] in sliver_index.hpp).
#include "blocks/sliver_index.hpp"

#include <algorithm>

#include "blocks/sliver_index_inl.hpp"

namespace pyalloc {

void SliverIndex::start(size_t granule) {
  granule_ = granule;
  roomy_.clear();
  whole_granules_ = 0;
  const size_t units = granule / kBlockAlign;
  for (const Kind kind : {kEnd, kStart}) {
    head_[kind].assign(units, nullptr);
    bits_[kind].assign((units + 63) / 64, 0);
    words_[kind].assign((units + 4095) / 4096, 0);
  }
}

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
  const std::vector<uint64_t>& bits = bits_[kind];
  size_t word = unit / 64;
  if (word >= bits.size()) return nullptr;
  uint64_t w = bits[word] & (~uint64_t{0} << (unit % 64));
  if (w == 0) {
    // The next non-empty word, from the summary.
    const std::vector<uint64_t>& words = words_[kind];
    size_t top = (word + 1) / 64;
    if (top >= words.size()) return nullptr;
    uint64_t t = (word + 1) % 64 == 0 ? words[top] : words[top] & (~uint64_t{0} << ((word + 1) % 64));
    while (t == 0) {
      if (++top == words.size()) return nullptr;
      t = words[top];
    }
    word = top * 64 + static_cast<size_t>(__builtin_ctzll(t));
    w = bits[word];
  }
  return head_[kind][word * 64 + static_cast<size_t>(__builtin_ctzll(w))];
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
