// free_set.cpp: see Note [Free sets] in free_set.hpp.
#include "free_set.hpp"

#include "types.hpp"

namespace pyalloc {

namespace {

// (size, address) order within a class.
bool before(const Block* a, const Block* b) {
  return a->size != b->size ? a->size < b->size : a->addr < b->addr;
}

}  // namespace

Block* FreeSet::next_of(const Block* b) { return b->bin_next; }

FreeSet::StreamBins* FreeSet::find(StreamId stream) const {
  if (last_ != nullptr && last_->stream == stream) return last_;
  for (const auto& bins : streams_) {
    if (bins->stream == stream) return last_ = bins.get();
  }
  return nullptr;
}

FreeSet::StreamBins* FreeSet::find_or_add(StreamId stream) {
  if (StreamBins* bins = find(stream)) return bins;
  streams_.push_back(std::make_unique<StreamBins>());
  streams_.back()->stream = stream;
  return last_ = streams_.back().get();
}

int FreeSet::first_class_at_or_above(const StreamBins& bins, int c) {
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

void FreeSet::insert(Block* block) {
  StreamBins& bins = *find_or_add(block->stream);
  const int c = size_class(block->size);
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

void FreeSet::erase(Block* block) {
  StreamBins& bins = *find(block->stream);
  if (block->bin_next != nullptr) block->bin_next->bin_prev = block->bin_prev;
  if (block->bin_prev != nullptr) {
    block->bin_prev->bin_next = block->bin_next;
  } else {
    const int c = size_class(block->size);
    bins.heads[c] = block->bin_next;
    if (block->bin_next == nullptr) {
      bins.words[c >> 6] &= ~(uint64_t{1} << (c & 63));
      if (bins.words[c >> 6] == 0) bins.summary &= ~(uint64_t{1} << (c >> 6));
    }
  }
  block->bin_prev = block->bin_next = nullptr;
  --count_;
}

Block* FreeSet::best_fit(StreamId stream, size_t size) const {
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

bool FreeSet::contains(const Block* block) const {
  const StreamBins* bins = find(block->stream);
  if (bins == nullptr) return false;
  for (const Block* b = bins->heads[size_class(block->size)]; b != nullptr; b = b->bin_next) {
    if (b == block) return true;
  }
  return false;
}

bool FreeSet::validate(std::string* error) const {
  size_t counted = 0;
  for (const auto& bins : streams_) {
    uint64_t summary = 0;
    for (int w = 0; w < kWords; ++w) {
      uint64_t word = 0;
      for (int c = w * 64; c < kClasses && c < (w + 1) * 64; ++c) {
        if (bins->heads[c] != nullptr) word |= uint64_t{1} << (c & 63);
      }
      if (word != bins->words[w]) return *error = "free-set class bitmap differs from its lists", false;
      if (word != 0) summary |= uint64_t{1} << w;
    }
    if (summary != bins->summary) return *error = "free-set summary bitmap differs from its words", false;
    for (int c = 0; c < kClasses; ++c) {
      const Block* prev = nullptr;
      for (const Block* b = bins->heads[c]; b != nullptr; prev = b, b = b->bin_next) {
        if (b->bin_prev != prev) return *error = "free-set list links are broken", false;
        if (b->stream != bins->stream) return *error = "free-set holds a block under another stream", false;
        if (size_class(b->size) != c) return *error = "free-set holds a block in the wrong size class", false;
        if (prev != nullptr && !before(prev, b)) return *error = "free-set class is not sorted by (size, address)", false;
        ++counted;
      }
    }
  }
  if (counted != count_) return *error = "free-set count differs from its lists", false;
  return true;
}

}  // namespace pyalloc
