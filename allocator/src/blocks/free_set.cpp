// free_set.cpp: see Note [Free sets] in free_set.hpp.
#include "blocks/free_set_inl.hpp"

namespace pyalloc {

FreeSet::StreamBins FreeSet::no_bins_;

Block* FreeSet::next_of(const Block* b) { return b->bin_next; }
bool FreeSet::below(const Block* b, size_t size) { return b->size < size; }

FreeSet::StreamBins* FreeSet::add_stream(StreamId stream) {
  streams_.push_back(std::make_unique<StreamBins>());
  streams_.back()->stream = stream;
  return last_ = streams_.back().get();
}

bool FreeSet::contains(const Block* block) const {
  const StreamBins* bins = find(block->stream);
  if (bins == nullptr) return false;
  for (const Block* b = bins->heads[size_class(block->size)]; b != nullptr; b = b->bin_next) {
    if (b == block) return true;
  }
  return false;
}

bool FreeSet::validate(std::string* error) const {
  for (const auto& bins : streams_) {
    // Bits are cleared lazily (Note [Free sets]): a set bit may stand for an
    // empty class, but every non-empty class must have its bit.
    uint64_t summary = 0;
    for (int w = 0; w < kWords; ++w) {
      for (int c = w * 64; c < kClasses && c < (w + 1) * 64; ++c) {
        const bool bit = (bins->words[w] >> (c & 63)) & 1;
        if (bins->heads[c] != nullptr && !bit) return *error = "free-set class bitmap misses a non-empty class", false;
      }
      if (bins->words[w] != 0) summary |= uint64_t{1} << w;
    }
    if (summary != bins->summary) return *error = "free-set summary bitmap differs from its words", false;
    for (int c = 0; c < kClasses; ++c) {
      const Block* prev = nullptr;
      for (const Block* b = bins->heads[c]; b != nullptr; prev = b, b = b->bin_next) {
        if (b->bin_prev != prev) return *error = "free-set list links are broken", false;
        if (b->stream != bins->stream) return *error = "free-set holds a block under another stream", false;
        if (size_class(b->size) != c || b->bin_class != c) return *error = "free-set holds a block in the wrong size class", false;
        if (prev != nullptr && !before(prev, b)) return *error = "free-set class is not sorted by (size, address)", false;
      }
    }
  }
  return true;
}

}  // namespace pyalloc
