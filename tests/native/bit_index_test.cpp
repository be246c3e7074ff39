// bit_index_test.cpp: BitIndex (allocator/src/blocks/bit_index.hpp) against
// std::set, on random inserts and erases around word and summary boundaries,
// with every query checked after every change. Exits 0 and prints
// "bit_index: ok" when all agree; else prints the first disagreement.
#include <algorithm>
#include <cstdio>
#include <random>
#include <set>

#include "blocks/bit_index.hpp"

using pyalloc::BitIndex;

namespace {

size_t expected_next(const std::set<size_t>& s, size_t i) {
  const auto it = s.lower_bound(i);
  return it == s.end() ? BitIndex::kNone : *it;
}

size_t expected_prev(const std::set<size_t>& s, size_t i) {
  const auto it = s.upper_bound(i);
  return it == s.begin() ? BitIndex::kNone : *std::prev(it);
}

bool agree(const BitIndex& b, const std::set<size_t>& s, size_t q) {
  if (b.next(q) != expected_next(s, q) || b.prev(q) != expected_prev(s, q) || b.test(q) != (s.count(q) != 0)) {
    std::printf("bit_index: at %zu: next %zu (want %zu), prev %zu (want %zu), test %d\n", q, b.next(q),
                expected_next(s, q), b.prev(q), expected_prev(s, q), static_cast<int>(b.test(q)));
    return false;
  }
  return true;
}

}  // namespace

int main() {
  std::mt19937_64 rng(1);
  // Ranges below one word, across one summary word (4,096 members), and an
  // arena's worth of granules (80 GiB x 8 / 2 MiB).
  for (const size_t range : {size_t{130}, size_t{64 * 64 * 3 + 7}, size_t{327680}}) {
    for (int round = 0; round < 40; ++round) {
      BitIndex b;
      b.reset(range);
      std::set<size_t> s;
      if (!agree(b, s, 0) || !agree(b, s, range + 5)) return 1;
      for (int op = 0; op < 3000; ++op) {
        size_t i = rng() % range;
        if (rng() % 4 == 0) i = std::min(range - 1, (rng() % (range / 64 + 1)) * 64 + (rng() % 2 ? 0 : 63));
        if (rng() % 3 != 0) {
          b.insert(i);
          s.insert(i);
        } else if (!s.empty()) {
          auto it = s.lower_bound(i);
          if (it == s.end()) it = s.begin();
          b.erase(*it);
          s.erase(it);
        }
        if (!agree(b, s, rng() % (range + 200)) || !agree(b, s, i) || !agree(b, s, i + 1)) return 1;
      }
      if (b.next(SIZE_MAX - 1) != BitIndex::kNone || b.prev(SIZE_MAX - 1) != expected_prev(s, SIZE_MAX - 1)) {
        std::printf("bit_index: queries past the end disagree\n");
        return 1;
      }
    }
  }
  std::printf("bit_index: ok\n");
  return 0;
}
