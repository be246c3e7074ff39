// lifetime.cpp: lifetime-aware placement.
//
// Note [Lifetime-aware placement]
// A block that lives long, placed in a free block a short-lived request has
// just left, splits it. Afterwards the free memory beside it can merge only
// with what lies on its other side, and in an arena the granules it shares
// with free neighbours cannot be unmapped. The more long-lived blocks are
// scattered among short-lived ones, the more memory is stranded around
// them. Kept apart, long-lived blocks pack against each other, and the
// short-lived ones leave whole ranges, and whole granules, free.
//
// pyalloc learns which requests live long instead of being told:
//
//   learn    Every default-pool request is recorded (LifetimeLearner) with
//            its rounded size and its order signature: that size with the
//            two sizes requested just before, which in a training loop
//            tells apart requests of one size made at different places.
//            32 requests later (kHorizon) it is judged: long-lived if its
//            block is still allocated. The block carries its request
//            number, so a later block at the same address is not mistaken
//            for it. The verdicts are counted per signature, per size, and
//            per coarse class (four per power of two).
//   predict  A request is predicted long-lived when at least half of the
//            judged requests with its signature were. A signature never
//            judged falls back to the size, then to the coarse class (sizes
//            never seen, as with random shapes); a request with none of
//            these is short-lived. Learning never stops, so the predictions
//            follow the program when it changes.
//   place    A request predicted long-lived goes to the `long` pool instead
//            of the small or large pool. That pool grows like a user pool:
//            in an arena of its own (with vmm), a separate reservation, so
//            long-lived blocks fill one range of addresses and short-lived
//            ones another; without vmm, in segments of its own. Its stats
//            count as large_pool (pool.long.* per pool). Physical memory
//            still moves between the two through stitching (ladder step 2).
//
// The horizon counts requests, not time: a block outlives 32 requests when
// it survives the operation that made it (a saved activation, a gradient,
// optimizer state, a cache), and a temporary does not.
//
// Cost: the signature must be seen for every request, and a prediction
// made for every request, so with placement on every call takes the general
// path (divert_ & kDivertLifetime), and the fast path's instruction budget
// stays what it is with placement off. Predicting by size class alone would
// have fit the fast path (one bit per class), and was measured: a size is
// shared by long- and short-lived requests, and once a whole pass had been
// counted, the size verdicts sent most of the long-lived ones to the
// default pools (transformer_lm needed 1.10x its live bytes; 1.04 with
// signatures).
//
// A thread in a user pool is not placed: the user's choice stands. With
// iteration plans on, requests predicted long-lived go to the long pool
// before the planner sees them, so a plan holds the short-lived ones.
#include "policy/lifetime.hpp"

namespace pyalloc {

// ---- LifetimeLearner -------------------------------------------------------------

size_t LifetimeLearner::coarse_class(size_t rounded) {
  const int log2 = 63 ^ __builtin_clzll(static_cast<unsigned long long>(rounded));  // >= 9: sizes are >= 512
  return 4 * static_cast<size_t>(log2) + ((rounded >> (log2 - 2)) & 3);
}

namespace {

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h * 0xbf58476d1ce4e5b9ULL;
}

}  // namespace

LifetimeLearner::Key LifetimeLearner::key_of(size_t rounded) const {
  return Key{mix(mix(mix(0, rounded), before_[0]), before_[1]), rounded};
}

void LifetimeLearner::bump(std::unordered_map<uint64_t, Counts>& map, uint64_t key, bool long_lived) {
  auto it = map.find(key);
  if (it == map.end()) {
    if (map.size() >= kMaxKeys) return;
    it = map.emplace(key, Counts{}).first;
  }
  ++(long_lived ? it->second.long_lived : it->second.short_lived);
}

void LifetimeLearner::count(const Key& key, bool long_lived) {
  bump(by_order_, key.order, long_lived);
  bump(by_size_, key.size, long_lived);
  Counts& c = by_class_[coarse_class(key.size)];
  ++(long_lived ? c.long_lived : c.short_lived);
}

bool LifetimeLearner::predicts_long(size_t rounded) const {
  const Key key = key_of(rounded);
  // A key is in a map once it has been judged.
  if (const auto it = by_order_.find(key.order); it != by_order_.end()) return it->second.mostly_long();
  if (const auto it = by_size_.find(key.size); it != by_size_.end()) return it->second.mostly_long();
  const Counts& c = by_class_[coarse_class(rounded)];
  return c.seen() && c.mostly_long();
}

}  // namespace pyalloc
