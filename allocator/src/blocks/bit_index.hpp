// bit_index.hpp: a set of small integers, with the next member at or after
// a given one, or the last before it, found in a few word reads.
//
// Two levels: bit i of `bits` says whether i is a member, and bit w of
// `words` whether bits[w] is non-zero. Finding the next member reads the
// rest of one word of `bits`, then `words` (one bit per 64 members) to the
// next non-empty word. Insert and erase are a store or two: an arena keeps
// its holes in these (holes.hpp), and the sliver index its offset lists and
// roomy blocks (Note [Sliver index] in sliver_index.hpp), through BlockTable,
// updated on every change of a free set near a full device. The words grow with the largest
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

  // Calls f(i) for every member, lowest first, while f returns true: each
  // word read once. The set must not change meanwhile.
  template <class F>
  void for_each(F&& f) const {
    for (size_t top = 0; top < words_.size(); ++top) {
      for (uint64_t t = words_[top]; t != 0; t &= t - 1) {
        const size_t word = top * 64 + static_cast<size_t>(__builtin_ctzll(t));
        for (uint64_t w = bits_[word]; w != 0; w &= w - 1) {
          if (!f(word * 64 + static_cast<size_t>(__builtin_ctzll(w)))) return;
        }
      }
    }
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

// Blocks by slot (a granule of an arena, an offset unit of the sliver
// index): at most one block per slot, the slots listed in a BitIndex, so that
// the next and the last listed are found in a few word reads. The pointers
// live on an anonymous mapping: pages the system zeroes when first touched,
// so a table for the 327,680 granules of an 80 GiB device's arena costs what
// its used low end touches, not 2.5 MiB written up front (which a near-full
// device paid in the middle of a request when the sliver index came on).
class BlockTable {
 public:
  BlockTable() = default;
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;
  ~BlockTable() { unmap(); }

  // Empty, for slots 0 to n - 1; throws std::bad_alloc when the system has
  // no room. A table of n slots already clears only what it listed.
  void reset(size_t n) {
    if (n == slots_) {
      for_each([&](size_t slot, Block*) {
        table_[slot] = nullptr;
        return true;
      });
    } else {
      unmap();
      if (n != 0) {
        void* p = mmap(nullptr, n * sizeof(Block*), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::bad_alloc();
        table_ = static_cast<Block**>(p);
        slots_ = n;
      }
    }
    listed_.reset(n);
    count_ = 0;
  }

  size_t slots() const { return slots_; }
  size_t size() const { return count_; }  // slots listed
  Block* at(size_t slot) const {
    assert(slot < slots_);
    return table_[slot];
  }
  // Lists `block` at `slot`, which must be free.
  void insert(size_t slot, Block* block) {
    assert(slot < slots_ && table_[slot] == nullptr && block != nullptr);
    table_[slot] = block;
    listed_.insert(slot);
    ++count_;
  }
  // Unlists `slot`, which must be listed.
  void erase(size_t slot) {
    assert(slot < slots_ && table_[slot] != nullptr);
    table_[slot] = nullptr;
    listed_.erase(slot);
    --count_;
  }
  // Another block at `slot`, which must be listed.
  void replace(size_t slot, Block* block) {
    assert(slot < slots_ && table_[slot] != nullptr && block != nullptr);
    table_[slot] = block;
  }
  // The block at the lowest listed slot >= `slot`, or nullptr.
  Block* next(size_t slot) const {
    const size_t s = listed_.next(slot);
    return s == BitIndex::kNone ? nullptr : table_[s];
  }
  // The block at the highest listed slot <= `slot`, or nullptr.
  Block* prev(size_t slot) const {
    const size_t s = listed_.prev(slot);
    return s == BitIndex::kNone ? nullptr : table_[s];
  }
  // Calls f(slot, block) for every listed slot, lowest first, while f returns
  // true. The table must not change meanwhile (BitIndex::for_each).
  template <class F>
  void for_each(F&& f) const {
    listed_.for_each([&](size_t s) { return f(s, table_[s]); });
  }

 private:
  void unmap() {
    if (table_ != nullptr) munmap(table_, slots_ * sizeof(Block*));
    table_ = nullptr;
    slots_ = 0;
  }

  Block** table_ = nullptr;
  size_t slots_ = 0;
  size_t count_ = 0;
  BitIndex listed_;
};

}  // namespace pyalloc
