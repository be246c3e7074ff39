// free_set_inl.hpp: FreeSet's hot operations, inline for the allocator's
// fast path (included by the files that call them). See Note [Free sets].
#pragma once

#include "free_set.hpp"
#include "types.hpp"

namespace pyalloc {

// (size, address) order within a class.
inline bool FreeSet::before(const Block* a, const Block* b) {
  return a->size != b->size ? a->size < b->size : a->addr < b->addr;
}

inline FreeSet::StreamBins* FreeSet::find(StreamId stream) const {
  if (__builtin_expect(last_ != nullptr && last_->stream == stream, 1)) return last_;
  return find_other(stream);
}

inline FreeSet::StreamBins* FreeSet::find_or_add(StreamId stream) {
  if (StreamBins* bins = find(stream)) return bins;
  return add_stream(stream);
}

inline int FreeSet::first_class_at_or_above(const StreamBins& bins, int c) {
  if (c >= kClasses) return -1;
  int w = c >> 6;
  uint64_t bits = bins.words[w] & (~uint64_t{0} << (c & 63));
  if (bits == 0) {
    const uint64_t above = w + 1 < 64 ? bins.summary & (~uint64_t{0} << (w + 1)) : 0;
    if (above == 0) return -1;
    w = __builtin_ctzll(above);
    bits = bins.words[w];
  }
  return (w << 6) + __builtin_ctzll(bits);
}

inline void FreeSet::insert(Block* block) {
  StreamBins& bins = *find_or_add(block->stream);
  const int c = size_class(block->size);
  block->bin_class = c;
  Block* prev = nullptr;
  Block* cur = bins.heads[c];
  while (cur != nullptr && before(cur, block)) {
    prev = cur;
    cur = cur->bin_next;
  }
  block->bin_prev = prev;
  block->bin_next = cur;
  if (cur != nullptr) cur->bin_prev = block;
  if (prev != nullptr) {
    prev->bin_next = block;
  } else {
    bins.heads[c] = block;
    bins.words[c >> 6] |= uint64_t{1} << (c & 63);
    bins.summary |= uint64_t{1} << (c >> 6);
  }
  ++count_;
}

inline void FreeSet::erase(Block* block) {
  StreamBins& bins = *find(block->stream);
  if (block->bin_next != nullptr) block->bin_next->bin_prev = block->bin_prev;
  if (block->bin_prev != nullptr) {
    block->bin_prev->bin_next = block->bin_next;
  } else {
    const int c = block->bin_class;
    bins.heads[c] = block->bin_next;
    if (block->bin_next == nullptr) {
      bins.words[c >> 6] &= ~(uint64_t{1} << (c & 63));
      if (bins.words[c >> 6] == 0) bins.summary &= ~(uint64_t{1} << (c >> 6));
    }
  }
  block->bin_prev = block->bin_next = nullptr;
  block->bin_class = -1;
  --count_;
}

inline Block* FreeSet::best_fit(StreamId stream, size_t size) const {
  const StreamBins* bins = find(stream);
  if (bins == nullptr) return nullptr;
  const int c = size_class(size);
  // Exact classes hold one size, so their head fits; a range class may
  // start with blocks smaller than the request.
  for (Block* b = bins->heads[c]; b != nullptr; b = b->bin_next) {
    if (b->size >= size) return b;
  }
  const int above = first_class_at_or_above(*bins, c + 1);
  return above < 0 ? nullptr : bins->heads[above];
}

}  // namespace pyalloc
