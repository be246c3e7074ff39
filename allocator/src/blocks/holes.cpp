// holes.cpp: see holes.hpp.
#include "blocks/holes.hpp"

#include <cassert>

#include "blocks/types.hpp"

namespace pyalloc {

void Holes::start(uintptr_t base, size_t bytes, size_t granule) {
  base_ = base;
  granule_ = granule;
  const size_t slots = bytes / granule;
  all_.reset(slots);
  lowest_ = nullptr;
  by_class_.assign(kClasses, BitIndex{});
  for (BitIndex& c : by_class_) c.reset(slots);
  in_class_.assign(kClasses, 0);
  nonempty_[0] = nonempty_[1] = 0;
}

size_t Holes::size_class(size_t bytes) const {
  const size_t granules = bytes / granule_;
  if (granules < kExactClasses) return granules;
  // 64 .. 127 granules: class 64; 128 .. 255: 65; ...
  return kExactClasses + static_cast<size_t>(63 - __builtin_clzll(granules)) - 6;
}

void Holes::insert(Block* hole) {
  assert(granule_ != 0 && hole->size % granule_ == 0 && (hole->addr - base_) % granule_ == 0);
  const size_t s = slot(hole->addr);
  // Its neighbours in the address-order list: the hole before it, and the one that follows that.
  Block* before = all_.prev(s);
  Block* after = before != nullptr ? before->bin_next : lowest_;
  hole->bin_prev = before;
  hole->bin_next = after;
  (before != nullptr ? before->bin_next : lowest_) = hole;
  if (after != nullptr) after->bin_prev = hole;
  all_.insert(s, hole);
  const size_t c = size_class(hole->size);
  by_class_[c].insert(s);
  ++in_class_[c];
  nonempty_[c / 64] |= uint64_t{1} << (c % 64);
}

void Holes::erase(Block* hole) {
  const size_t s = slot(hole->addr);
  assert(all_.at(s) == hole);
  all_.erase(s);
  (hole->bin_prev != nullptr ? hole->bin_prev->bin_next : lowest_) = hole->bin_next;
  if (hole->bin_next != nullptr) hole->bin_next->bin_prev = hole->bin_prev;
  hole->bin_prev = hole->bin_next = nullptr;
  const size_t c = size_class(hole->size);
  by_class_[c].erase(s);
  if (--in_class_[c] == 0) nonempty_[c / 64] &= ~(uint64_t{1} << (c % 64));
}

bool Holes::contains(const Block* hole) const { return at(hole->addr) == hole; }

Block* Holes::at(uintptr_t addr) const {
  if (addr < base_ || (addr - base_) % granule_ != 0 || slot(addr) >= all_.slots()) return nullptr;
  return all_.at(slot(addr));
}

Block* Holes::first_from(uintptr_t addr) const {
  if (granule_ == 0) return nullptr;
  return all_.next(addr <= base_ ? 0 : (addr - base_ + granule_ - 1) / granule_);
}

Block* Holes::last_to(uintptr_t addr) const {
  if (granule_ == 0 || addr < base_) return nullptr;
  return all_.prev(slot(addr));
}

Block* Holes::lowest_fitting(size_t bytes) const {
  if (granule_ == 0) return nullptr;
  const size_t first = size_class(bytes < granule_ ? granule_ : bytes);
  Block* best = nullptr;
  for (size_t c = first; c < kClasses; ++c) {
    const uint64_t rest = nonempty_[c / 64] >> (c % 64);
    if (rest == 0) {  // nothing more in this word
      c = c / 64 * 64 + 63;
      continue;
    }
    c += static_cast<size_t>(__builtin_ctzll(rest));
    const BitIndex& holes = by_class_[c];
    for (size_t s = holes.next(0); s != BitIndex::kNone; s = holes.next(s + 1)) {
      Block* hole = all_.at(s);
      if (best != nullptr && hole->addr >= best->addr) break;  // lowest first: nothing lower here
      if (hole->size >= bytes) {
        best = hole;
        break;
      }
    }
  }
  return best;
}

bool Holes::consistent(const Segment* arena) const {
  size_t listed = 0;
  for (size_t c = 0; c < kClasses; ++c) {
    size_t here = 0;
    for (size_t s = by_class_[c].next(0); s != BitIndex::kNone; s = by_class_[c].next(s + 1)) {
      if (all_.at(s) == nullptr || size_class(all_.at(s)->size) != c) return false;
      ++here;
    }
    if (here != in_class_[c] || (here == 0) == ((nonempty_[c / 64] >> (c % 64) & 1) != 0)) return false;
    listed += here;
  }
  size_t all = 0;
  bool ok = true;
  const Block* in_list = lowest_;  // the address-order list lists the same holes, in order
  const Block* before = nullptr;
  all_.for_each([&](size_t s, const Block* hole) {
    ok = hole->segment == arena && hole->state == BlockState::kHole && slot(hole->addr) == s &&
         in_list == hole && hole->bin_prev == before;
    before = hole;
    in_list = hole->bin_next;
    ++all;
    return ok;
  });
  return ok && in_list == nullptr && listed == all_.size() && all == all_.size();
}

}  // namespace pyalloc
