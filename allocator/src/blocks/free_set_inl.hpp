// free_set_inl.hpp: FreeSet's hot operations, inline for the allocator's
// fast path (included by the files that call them). See Note [Free sets].
#pragma once

#include <cassert>

#include "blocks/free_set.hpp"
#include "blocks/types.hpp"

namespace pyalloc {

// (size, address) order within a class.
inline bool FreeSet::before(const Block* a, const Block* b) {
  return a->size != b->size ? a->size < b->size : a->addr < b->addr;
}

inline FreeSet::StreamBins* FreeSet::find(StreamId stream) const {
  if (__builtin_expect(last_->stream == stream, 1)) return last_;
  for (const auto& bins : streams_) {
    if (bins->stream == stream) return last_ = bins.get();
  }
  return nullptr;
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
  StreamBins* bins = find(block->stream);
  if (__builtin_expect(bins == nullptr || bins == &no_bins_, 0)) bins = add_stream(block->stream);
  block->bin_class = size_class(block->size);
  link(*bins, block);
}

inline void FreeSet::reinsert(Block* block) {
  StreamBins* bins = find(block->stream);
  assert(bins != nullptr && bins != &no_bins_ && block->bin_class == size_class(block->size));
  link(*bins, block);
}

inline void FreeSet::link(StreamBins& bins, Block* block) {
  const size_t c = static_cast<unsigned>(block->bin_class);  // unsigned: plain shifts for the bitmaps
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
    uint64_t& word = bins.words[c >> 6];
    if (!((word >> (c & 63)) & 1)) {  // usually set already (Note [Free sets])
      word |= uint64_t{1} << (c & 63);
      bins.summary |= uint64_t{1} << (c >> 6);
    }
  }
}

// The block keeps bin_class (reinsert() puts it back) and stale list links.
inline void FreeSet::erase(Block* block) {
  if (block->bin_next != nullptr) block->bin_next->bin_prev = block->bin_prev;
  if (block->bin_prev != nullptr) {
    block->bin_prev->bin_next = block->bin_next;
  } else {
    find(block->stream)->heads[block->bin_class] = block->bin_next;  // an emptied class keeps its bit
  }
}

inline Block* FreeSet::best_fit(StreamId stream, size_t size) const {
  StreamBins* bins = find(stream);
  if (bins == nullptr) return nullptr;
  const int c = size_class(size);
  // Exact classes hold one size, so their head fits; a range class may
  // start with blocks smaller than the request.
  for (Block* b = bins->heads[c]; b != nullptr; b = b->bin_next) {
    if (b->size >= size) return b;
  }
  return first_above(*bins, c);
}

inline Block* FreeSet::first_above(StreamBins& bins, int c) {
  for (;;) {
    c = first_class_at_or_above(bins, c + 1);
    if (c < 0) return nullptr;
    if (Block* head = bins.heads[c]) return head;
    // A class emptied since its bit was set: clear the bit now.
    uint64_t& word = bins.words[c >> 6];
    word &= ~(uint64_t{1} << (c & 63));
    if (word == 0) bins.summary &= ~(uint64_t{1} << (c >> 6));
  }
}

}  // namespace pyalloc
