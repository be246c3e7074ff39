// bit_index.hpp: a set of small integers, with the next member at or after
// a given one found in a few word reads.
//
// Two levels: bit i of `bits` says whether i is a member, and bit w of
// `words` whether bits[w] is non-zero. Finding the next member reads the
// rest of one word of `bits`, then `words` (one bit per 64 members) to the
// next non-empty word. Insert and erase are a store or two, with no
// allocation: the sliver index keeps its offset lists and its roomy blocks
// in these (Note [Sliver index] in sliver_index.hpp), updated on every
// change of a free set near a full device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pyalloc {

class BitIndex {
 public:
  static constexpr size_t kNone = SIZE_MAX;

  // Empty, for members 0 to n - 1.
  void reset(size_t n) {
    bits_.assign((n + 63) / 64, 0);
    words_.assign((bits_.size() + 63) / 64, 0);
  }

  bool test(size_t i) const { return (bits_[i / 64] >> (i % 64)) & 1; }

  void insert(size_t i) {
    bits_[i / 64] |= uint64_t{1} << (i % 64);
    words_[i / 4096] |= uint64_t{1} << (i / 64 % 64);
  }

  void erase(size_t i) {
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
      uint64_t t = (word + 1) % 64 == 0 ? words_[top] : words_[top] & (~uint64_t{0} << ((word + 1) % 64));
      while (t == 0) {
        if (++top == words_.size()) return kNone;
        t = words_[top];
      }
      word = top * 64 + static_cast<size_t>(__builtin_ctzll(t));
      w = bits_[word];
    }
    return word * 64 + static_cast<size_t>(__builtin_ctzll(w));
  }

 private:
  std::vector<uint64_t> bits_;
  std::vector<uint64_t> words_;
};

}  // namespace pyalloc
