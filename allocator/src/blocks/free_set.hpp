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
// The bitmaps are cleared lazily: a class's bit is set when a block goes
// into it, and cleared only when best_fit's search finds the class empty.
// So a set bit means "maybe non-empty", a clear bit "empty", and a block
// that leaves and re-enters its class (a cache hit, then its free) touches
// no bitmap.
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

#include "backends/backend.hpp"

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
    // For 2^k <= units < 2^(k+1), k >= 7: class 128 + 16 (k - 7) + the four
    // bits below the leading one. units >> (k - 4) is 16 + those bits, so
    // that is 16 k + (units >> (k - 4)).
    const int log2 = 63 ^ __builtin_clzll(units);  // == 63 - clz: one bsr
    return kSubClasses * log2 + static_cast<int>(units >> (log2 - 4));
  }

  FreeSet() = default;
  FreeSet(const FreeSet&) = delete;
  FreeSet& operator=(const FreeSet&) = delete;

  // insert, reinsert, erase and best_fit are defined in free_set_inl.hpp.
  // insert() sets block->bin_class; the first block of a stream allocates
  // the stream's bins.
  void insert(Block* block);
  // insert() for a block whose bin_class is still size_class(size) and whose
  // stream already has bins here: any block that was in this set before and
  // kept its size, or a piece of one given its class (bins are never
  // removed). Makes no call.
  void reinsert(Block* block);
  void erase(Block* block);
  // The smallest free block of at least `size` bytes on `stream`, lowest
  // address among equals; nullptr when none. Clears the bits of the empty
  // classes its search meets (Note [Free sets]).
  Block* best_fit(StreamId stream, size_t size) const;

  // The number of free blocks, by walking the lists (for check(): the fast
  // path keeps no count).
  size_t size() const {
    size_t n = 0;
    for_each([&n](const Block*) { ++n; });
    return n;
  }
  bool contains(const Block* block) const;

  template <typename F>
  void for_each(F fn) const {
    for (const auto& bins : streams_) {
      for (int c = 0; c < kClasses; ++c) {
        for (Block* b = bins->heads[c]; b != nullptr; b = next_of(b)) fn(b);
      }
    }
  }

  // Calls fn(block) for the free blocks of `stream` of at least `size` bytes,
  // smallest first (class by class, each in (size, address) order), until fn
  // returns false. fn must not change the set (collect, then change).
  template <typename F>
  void for_each_at_least(StreamId stream, size_t size, F fn) const {
    const StreamBins* bins = find(stream);
    if (bins == nullptr) return;
    for (int c = first_class_at_or_above(*bins, size_class(size)); c >= 0;
         c = first_class_at_or_above(*bins, c + 1)) {
      for (Block* b = bins->heads[c]; b != nullptr; b = next_of(b)) {
        if (!below(b, size) && !fn(b)) return;
      }
    }
  }

  // The structure's own invariants: sorted classes, right classes and
  // streams, a bit set for every non-empty class. False with *error.
  bool validate(std::string* error) const;

 private:
  struct StreamBins {
    StreamId stream = 0;
    uint64_t summary = 0;         // bit w: words[w] != 0
    uint64_t words[kWords] = {};  // bit c: heads[c] may be non-null (cleared lazily)
    Block* heads[kClasses] = {};
  };

  static bool before(const Block* a, const Block* b);
  static bool below(const Block* b, size_t size);
  static Block* next_of(const Block* b);
  // The stream's bins; nullptr when it has none, or, until the first stream
  // is added, possibly the empty no_bins_ (which only insert() must tell).
  StreamBins* find(StreamId stream) const;
  StreamBins* add_stream(StreamId stream);
  static int first_class_at_or_above(const StreamBins& bins, int c);
  static Block* first_above(StreamBins& bins, int c);  // head of the first non-empty class above c
  void link(StreamBins& bins, Block* block);  // into class block->bin_class

  std::vector<std::unique_ptr<StreamBins>> streams_;
  // The most recently used stream's bins: one compare in the common case.
  // Never null, so that the compare needs no test first.
  static StreamBins no_bins_;  // empty, and never written
  mutable StreamBins* last_ = &no_bins_;
};

}  // namespace pyalloc
