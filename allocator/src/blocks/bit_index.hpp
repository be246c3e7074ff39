// bit_index.hpp: a set of small integers, with the next member at or after
// a given one, or the last before it, found in a few word reads.
//
// Two levels: bit i of `bits` says whether i is a member, and bit w of
// `words` whether bits[w] is non-zero. Finding the next member reads the
// rest of one word of `bits`, then `words` (one bit per 64 members) to the
// next non-empty word. Insert and erase are a store or two: an arena keeps
// its holes in these (holes.hpp), and the sliver index its offset lists and
// roomy blocks (Note [Sliver index] in sliver_index.hpp), updated on every
// change of a free set near a full device. The words grow with the largest
// member inserted (doubling, up to the bound given to reset): an arena uses
// the low end of its reservation, eight times the device's size.
#pragma once

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include <sys/mman.h>

namespace pyalloc {

struct Block;

class BitIndex {
 public:
  static constexpr size_t kNone = SIZE_MAX;

  // Empty, for members below n.
  void reset(size_t n) {
    bits_.clear();
    words_.clear();
    limit_words_ = (n + 63) / 64;
  }

  bool test(size_t i) const { return i / 64 < bits_.size() && ((bits_[i / 64] >> (i % 64)) & 1); }

  void insert(size_t i) {
    assert(i / 64 < limit_words_);
    if (i / 64 >= bits_.size()) grow(i);
    bits_[i / 64] |= uint64_t{1} << (i % 64);
    words_[i / 4096] |= uint64_t{1} << (i / 64 % 64);
  }

  // i must be a member.
  void erase(size_t i) {
    assert(test(i));
    uint64_t& word = bits_[i / 64];
    word &= ~(uint64_t{1} << (i % 64));
    if (word == 0) words_[i / 4096] &= ~(uint64_t{1} << (i / 64 % 64));
  }

  // The smallest member >= i, or kNone.
  size_t next(size_t i) const {
    size_t word = i / 64;
    if (word >= bits_.size()) return kNone;
    uint64_t w = bits_[word] & (~uint64_t{0} << (i % 64));
    if (w == 0) {
      // The next non-empty word, from the summary.
      size_t top = (word + 1) / 64;
      if (top >= words_.size()) return kNone;
      uint64_t t = words_[top] & (~uint64_t{0} << ((word + 1) % 64));
      while (t == 0) {
        if (++top == words_.size()) return kNone;
        t = words_[top];
      }
      word = top * 64 + static_cast<size_t>(__builtin_ctzll(t));
      w = bits_[word];
    }
    return word * 64 + static_cast<size_t>(__builtin_ctzll(w));
  }

  // The largest member <= i, or kNone.
  size_t prev(size_t i) const {
    if (bits_.empty()) return kNone;
    size_t word = i / 64;
    uint64_t w;
    if (word >= bits_.size()) {
      word = bits_.size() - 1;
      w = bits_[word];
    } else {
      w = bits_[word] & (~uint64_t{0} >> (63 - i % 64));
    }
    if (w == 0) {
      // The previous non-empty word, from the summary.
      if (word == 0) return kNone;
      size_t top = (word - 1) / 64;
      uint64_t t = words_[top] & (~uint64_t{0} >> (63 - (word - 1) % 64));
      while (t == 0) {
        if (top == 0) return kNone;
        t = words_[--top];
      }
      word = top * 64 + 63 - static_cast<size_t>(__builtin_clzll(t));
      w = bits_[word];
    }
    return word * 64 + 63 - static_cast<size_t>(__builtin_clzll(w));
  }

 private:
  // Room for member i: doubling (amortized O(1) per insert), up to the bound.
  void grow(size_t i) {
    const size_t words = std::min(limit_words_, std::max(i / 64 + 1, 2 * bits_.size()));
    bits_.resize(words, 0);
    words_.resize((words + 63) / 64, 0);
  }

  std::vector<uint64_t> bits_;
  std::vector<uint64_t> words_;
  size_t limit_words_ = 0;
};

// A table of one Block pointer per granule of an arena, all null at first:
// pages the system zeroes when first touched (an anonymous mapping), so a
// table for the 327,680 granules of an 80 GiB device's arena costs what its
// used low end touches, not 2.5 MiB written up front (which a near-full
// device paid in the middle of a request when the sliver index came on).
class SlotTable {
 public:
  SlotTable() = default;
  SlotTable(const SlotTable&) = delete;
  SlotTable& operator=(const SlotTable&) = delete;
  ~SlotTable() { unmap(); }

  // n slots, all null; throws std::bad_alloc when the system has no room.
  void reset(size_t n) {
    unmap();
    if (n == 0) return;
    void* p = mmap(nullptr, n * sizeof(Block*), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    slots_ = static_cast<Block**>(p);
    size_ = n;
  }
  size_t size() const { return size_; }
  Block*& operator[](size_t i) {
    assert(i < size_);
    return slots_[i];
  }
  Block* operator[](size_t i) const {
    assert(i < size_);
    return slots_[i];
  }

 private:
  void unmap() {
    if (slots_ != nullptr) munmap(slots_, size_ * sizeof(Block*));
    slots_ = nullptr;
    size_ = 0;
  }

  Block** slots_ = nullptr;
  size_t size_ = 0;
};

}  // namespace pyalloc
