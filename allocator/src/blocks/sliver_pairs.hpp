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
// ten thousand, where trying each granule free at both ends as an a in one
// pass and as a b in another, as moves did at first, was short on a quarter.
//
// `ends`: the granules free from `edge` to their end (a's); `starts`: those
// free up to `edge` (b's); each in increasing edge, a granule in each at
// most once, every `slot` below `slots` (no granule is its own pair: its end
// comes after its start). T has members `slot` and `edge` (size_t). Returns
// the pairs (a, b), pointing into `ends` and `starts`.
template <typename T>
std::vector<std::pair<const T*, const T*>> pair_slivers(const std::vector<T>& ends, const std::vector<T>& starts,
                                                         size_t slots) {
  constexpr size_t kNone = SIZE_MAX;
  std::vector<size_t> end_of_slot(slots, kNone), start_of_slot(slots, kNone), partner(slots, kNone);
  std::vector<bool> taken(slots, false);
  for (size_t i = 0; i < ends.size(); ++i) end_of_slot[ends[i].slot] = i;
  for (size_t i = 0; i < starts.size(); ++i) start_of_slot[starts[i].slot] = i;
  auto q_of = [&](size_t slot) { return start_of_slot[slot] == kNone ? size_t{0} : starts[start_of_slot[slot]].edge; };
  auto end_of = [&](size_t slot) { return end_of_slot[slot] == kNone ? SIZE_MAX : ends[end_of_slot[slot]].edge; };
  auto as_b = [&](size_t slot) { return partner[slot] != kNone; };  // in a pair, as its b

  using Open = std::pair<size_t, size_t>;  // (a key, slot): the smallest first
  std::priority_queue<Open, std::vector<Open>, std::greater<Open>> open;  // (q of its own, slot)
  std::priority_queue<Open, std::vector<Open>, std::greater<Open>> paired_duals;  // (its a's end, slot)
  std::vector<size_t> unpaired;      // b's that found no a
  size_t e = 0;
  for (const T& b : starts) {
    for (; e < ends.size() && ends[e].edge <= b.edge; ++e) {
      const size_t slot = ends[e].slot;
      if (as_b(slot)) {
        paired_duals.push({end_of(partner[slot]), slot});
      } else if (!taken[slot]) {
        open.push({q_of(slot), slot});
      }
    }
    if (taken[b.slot]) continue;  // an a already
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
      unpaired.push_back(b.slot);
      continue;
    }
    const size_t d = paired_duals.top().second;
    paired_duals.pop();
    const size_t a0 = partner[d];
    partner[d] = kNone;  // d is b's a now
    partner[b.slot] = d;
    taken[b.slot] = true;
    taken[a0] = false;
    size_t best = kNone;  // the unpaired b that a0 fits and that ends last
    for (const size_t f : unpaired) {
      if (taken[f] || f == a0 || q_of(f) < end_of(a0)) continue;
      if (best == kNone || end_of(f) > end_of(best)) best = f;
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
