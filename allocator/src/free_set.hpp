// free_set.hpp: a pool's free blocks, indexed for best fit.
//
// Note [Free sets]
// Free blocks are kept per stream (a block is reused only on its own stream)
// in segregated size classes:
//   - below 64 KiB one class per 512 B step, so a class holds one size;
//   - above, TLSF-style: each power-of-two interval split into 16 classes,
//     so the sizes in a class differ by less than 1/16.
// Each class is an intrusive list sorted by (size, address). Two bitmaps
// (classes, and words of classes) find the first non-empty class at or above
// a request's class in a few instructions. Best fit is then exact: within
// the request's own class, the first block that is large enough; otherwise
// the head of the next non-empty class, whose blocks are all larger. Ties go
// to the lowest address, as with an ordered set on (stream, size, address).
//
// Cost: lookup and erase are O(1) plus the walk of the request's class for
// sizes of 64 KiB and more; insertion walks one class to keep it sorted,
// linear in the blocks of that class (RMM's coalescing free list makes the
// same trade). Used under the device lock only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend.hpp"

namespace pyalloc {

struct Block;

class FreeSet {
 public:
  static constexpr int kExactClasses = 128;  // 512 B .. 64 KiB - 512 B, one size each
  static constexpr int kSubClasses = 16;     // per power of two above 64 KiB
  static constexpr int kClasses = kExactClasses + 37 * kSubClasses;  // sizes up to 2^53 B
  static constexpr int kWords = (kClasses + 63) / 64;

  // The class of a size (a multiple of 512).
  static int size_class(size_t size) {
    const uint64_t units = size >> 9;
    if (units < kExactClasses) return static_cast<int>(units);
    const int log2 = 63 - __builtin_clzll(units);  // >= 7
    const int sub = static_cast<int>((units >> (log2 - 4)) & (kSubClasses - 1));
    return kExactClasses + (log2 - 7) * kSubClasses + sub;
  }

  FreeSet() = default;
  FreeSet(const FreeSet&) = delete;
  FreeSet& operator=(const FreeSet&) = delete;

  // insert, erase and best_fit are defined in free_set_inl.hpp.
  void insert(Block* block);
  void erase(Block* block);
  // The smallest free block of at least `size` bytes on `stream`, lowest
  // address among equals; nullptr when none.
  Block* best_fit(StreamId stream, size_t size) const;

  size_t size() const { return count_; }
  bool contains(const Block* block) const;

  template <typename F>
  void for_each(F fn) const {
    for (const auto& bins : streams_) {
      for (int c = 0; c < kClasses; ++c) {
        for (Block* b = bins->heads[c]; b != nullptr; b = next_of(b)) fn(b);
      }
    }
  }

  // The structure's own invariants: sorted classes, right classes and
  // streams, bitmaps matching the lists, the count. False with *error.
  bool validate(std::string* error) const;

 private:
  struct StreamBins {
    StreamId stream = 0;
    uint64_t summary = 0;         // bit w: words[w] != 0
    uint64_t words[kWords] = {};  // bit c: heads[c] != nullptr
    Block* heads[kClasses] = {};
  };

  static bool before(const Block* a, const Block* b);
  static Block* next_of(const Block* b);
  StreamBins* find(StreamId stream) const;
  StreamBins* find_other(StreamId stream) const;  // find() past the last-used stream
  StreamBins* find_or_add(StreamId stream);
  StreamBins* add_stream(StreamId stream);  // the slow part of find_or_add
  static int first_class_at_or_above(const StreamBins& bins, int c);

  std::vector<std::unique_ptr<StreamBins>> streams_;
  mutable StreamBins* last_ = nullptr;  // most recently used stream: one compare in the common case
  size_t count_ = 0;
};

}  // namespace pyalloc
