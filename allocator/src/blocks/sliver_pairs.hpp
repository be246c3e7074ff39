// sliver_pairs.hpp: which granules of an arena can share one physical
// granule once live bytes move (Note [Pairing slivers]). A pure function of
// the granules' edges, header-only so that tests/native/sliver_pairs_test.cpp
// can hold it against an exhaustive search.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <queue>
#include <utility>
#include <vector>

namespace pyalloc {

// Note [Pairing slivers]
// Two granules of an arena fit in one physical granule when a's live part
// ends at or before b's starts (Note [Moving slivers], device/move.cpp). A
// granule free at both ends may be either. pair_slivers finds the pairs, a
// granule in one at most, in one sweep over the edges in increasing offset
// (an a's end before a b's start at the same offset):
//
//   a's end p      the granule is open: a later b may take it (unless it is
//                  in a pair already, as a b);
//   b's start q    b takes the open a with the smallest start of its own, the
//                  least use as a b later (0: live at its start). With none
//                  open, a b already paired whose own end is <= q (free at
//                  both ends) becomes this b's a instead, the one whose a
//                  ends first; that a, open again, pairs with a b that found
//                  none earlier and starts at or after its end (the one that
//                  ends last), or else stays open.
//
// Pairing each b as it comes takes a granule free at both ends as a b where
// it had to be an a (tests/test_moving_slivers.py: both ends); the exchange
// keeps the count and reopens the earlier a, which serves every b the
// exchanged granule could. Not always a maximum: against an exhaustive
// search (tests/native/sliver_pairs_test.cpp, random sets of 2 to 12
// granules, many free at both ends) it is one pair short on a few sets in
// ten thousand; a review measured it against an exact matching (Edmonds) on
// larger random sets: short on 4% of sets of 300 granules, 14% of 1,000 and
// a quarter of 3,000, by under 1% of the pairs. Trying each granule free at
// both ends as an a in one pass and as a b in another, as moves did at
// first, was short on 28% of the small sets. Time O(n log n) in the
// granules listed: the b's that found no a are in a tree by position
// (Unpaired); a linear scan of them made 50,000 granules free at both ends
// take 500 ms, the tree 12 ms.

// The b's that found no a, in the order they came (increasing start), and
// the one that ends last from a given position on: a tournament tree over
// the positions, a removed b is out of it. O(log n) a query or a change.
class Unpaired {
 public:
  static constexpr size_t kNone = SIZE_MAX;

  // `ends[slot]`: where the granule's live part ends (SIZE_MAX: at its end).
  Unpaired(size_t most, const std::vector<size_t>* ends) : ends_(ends) {
    while (leaves_ < most) leaves_ *= 2;
    best_.assign(2 * leaves_, kNone);
  }
  size_t size() const { return slots_.size(); }
  size_t slot(size_t pos) const { return slots_[pos]; }
  size_t add(size_t slot) {
    slots_.push_back(slot);
    show(slots_.size() - 1, true);
    return slots_.size() - 1;
  }
  // Whether position `pos` takes part in queries.
  void show(size_t pos, bool shown) {
    size_t x = pos + leaves_;
    best_[x] = shown ? pos : kNone;
    for (x /= 2; x > 0; x /= 2) best_[x] = later(best_[2 * x], best_[2 * x + 1]);
  }
  // The shown position in [from, size()) whose b ends last (the first of
  // equals), or kNone.
  size_t last_ending(size_t from) const {
    size_t left = kNone, right = kNone;
    for (size_t l = from + leaves_, r = slots_.size() + leaves_; l < r; l /= 2, r /= 2) {
      if (l & 1) left = later(left, best_[l++]);
      if (r & 1) right = later(best_[--r], right);
    }
    return later(left, right);
  }

 private:
  size_t later(size_t i, size_t j) const {  // i before j in position
    if (i == kNone) return j;
    if (j == kNone) return i;
    return (*ends_)[slots_[j]] > (*ends_)[slots_[i]] ? j : i;
  }
  const std::vector<size_t>* ends_;
  size_t leaves_ = 1;
  std::vector<size_t> slots_;
  std::vector<size_t> best_;  // per tree node: its shown position that ends last
};

// `ends`: the granules free from `edge` to their end (a's); `starts`: those
// free up to `edge` (b's); each in increasing edge, a granule in each at
// most once, every `slot` below `slots`; a granule in both whose end is not
// after its start (no live byte) is left out. T has members `slot` and
// `edge` (size_t). Returns the pairs (a, b), pointing into `ends` and
// `starts`.
template <typename T>
std::vector<std::pair<const T*, const T*>> pair_slivers(const std::vector<T>& ends, const std::vector<T>& starts,
                                                         size_t slots) {
  constexpr size_t kNone = SIZE_MAX;
  std::vector<size_t> end_of_slot(slots, kNone), start_of_slot(slots, kNone), partner(slots, kNone);
  std::vector<bool> taken(slots, false);
  for (size_t i = 0; i < ends.size(); ++i) end_of_slot[ends[i].slot] = i;
  for (size_t i = 0; i < starts.size(); ++i) start_of_slot[starts[i].slot] = i;
  std::vector<size_t> live_end(slots, SIZE_MAX);  // where each granule's live part ends
  for (const T& a : ends) live_end[a.slot] = a.edge;
  auto q_of = [&](size_t slot) { return start_of_slot[slot] == kNone ? size_t{0} : starts[start_of_slot[slot]].edge; };
  auto end_of = [&](size_t slot) { return live_end[slot]; };
  auto as_b = [&](size_t slot) { return partner[slot] != kNone; };  // in a pair, as its b
  // A granule free from its end back to at or before its start holds no live
  // byte: never one of a pair (not a case I2 lets happen, where its free
  // blocks would have merged; were it, it could pair with itself).
  auto empty = [&](size_t slot) { return end_of_slot[slot] != kNone && end_of(slot) <= q_of(slot); };

  using Open = std::pair<size_t, size_t>;  // (a key, slot): the smallest first
  std::priority_queue<Open, std::vector<Open>, std::greater<Open>> open;  // (q of its own, slot)
  std::priority_queue<Open, std::vector<Open>, std::greater<Open>> paired_duals;  // (its a's end, slot)
  Unpaired unpaired(starts.size(), &live_end);
  std::vector<size_t> unpaired_at(slots, kNone);  // its position there
  size_t e = 0;
  for (const T& b : starts) {
    for (; e < ends.size() && ends[e].edge <= b.edge; ++e) {
      const size_t slot = ends[e].slot;
      if (empty(slot)) continue;
      if (as_b(slot)) {
        paired_duals.push({end_of(partner[slot]), slot});
      } else if (!taken[slot]) {
        open.push({q_of(slot), slot});
      }
    }
    if (taken[b.slot] || empty(b.slot)) continue;  // an a already
    while (!open.empty() && taken[open.top().second]) open.pop();
    if (!open.empty()) {
      const size_t a = open.top().second;
      open.pop();
      taken[a] = taken[b.slot] = true;
      partner[b.slot] = a;
      continue;
    }
    while (!paired_duals.empty() && !as_b(paired_duals.top().second)) paired_duals.pop();
    if (paired_duals.empty()) {
      unpaired_at[b.slot] = unpaired.add(b.slot);
      continue;
    }
    const size_t d = paired_duals.top().second;
    paired_duals.pop();
    const size_t a0 = partner[d];
    partner[d] = kNone;  // d is b's a now
    partner[b.slot] = d;
    taken[b.slot] = true;
    taken[a0] = false;
    if (unpaired_at[a0] != kNone) unpaired.show(unpaired_at[a0], true);  // a b again, should one fit it
    // The unpaired b that a0 fits (it starts at or after a0's end) and that
    // ends last; those taken since they were unpaired leave the tree here.
    size_t from = 0;  // the first position that starts at or after a0's end (they come in increasing start)
    for (size_t count = unpaired.size(); count > 0;) {
      const size_t half = count / 2;
      if (q_of(unpaired.slot(from + half)) < end_of(a0)) {
        from += half + 1;
        count -= half + 1;
      } else {
        count = half;
      }
    }
    size_t best = kNone;
    for (size_t pos; (pos = unpaired.last_ending(from)) != kNone;) {
      if (!taken[unpaired.slot(pos)]) {
        best = unpaired.slot(pos);
        break;
      }
      unpaired.show(pos, false);
    }
    if (best != kNone) {
      taken[a0] = taken[best] = true;
      partner[best] = a0;
      if (end_of(best) <= b.edge) paired_duals.push({end_of(a0), best});
    } else {
      open.push({q_of(a0), a0});
    }
  }
  std::vector<std::pair<const T*, const T*>> pairs;
  for (size_t slot = 0; slot < slots; ++slot) {
    if (partner[slot] != kNone) pairs.emplace_back(&ends[end_of_slot[partner[slot]]], &starts[start_of_slot[slot]]);
  }
  return pairs;
}

}  // namespace pyalloc
