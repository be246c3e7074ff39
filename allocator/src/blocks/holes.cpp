// holes.cpp: see holes.hpp.
#include "blocks/holes.hpp"

#include <cassert>

#include "blocks/types.hpp"

namespace pyalloc {

void Holes::start(size_t granule) {
  granule_ = granule;
  by_class_.assign(kClasses, ByAddressSet{});
  nonempty_[0] = nonempty_[1] = 0;
}

size_t Holes::size_class(size_t bytes) const {
  const size_t granules = bytes / granule_;
  if (granules < kExactClasses) return granules;
  // 64 .. 127 granules: class 64; 128 .. 255: 65; ...
  return kExactClasses + static_cast<size_t>(63 - __builtin_clzll(granules)) - 6;
}

void Holes::insert(Block* hole) {
  assert(granule_ != 0 && hole->size % granule_ == 0);
  all_.insert(hole);
  const size_t c = size_class(hole->size);
  by_class_[c].insert(hole);
  nonempty_[c / 64] |= uint64_t{1} << (c % 64);
}

void Holes::erase(Block* hole) {
  all_.erase(hole);
  const size_t c = size_class(hole->size);
  by_class_[c].erase(hole);
  if (by_class_[c].empty()) nonempty_[c / 64] &= ~(uint64_t{1} << (c % 64));
}

Block* Holes::at(uintptr_t addr) const {
  const auto it = all_.find(addr);
  return it == all_.end() ? nullptr : *it;
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
    for (Block* hole : by_class_[c]) {
      if (best != nullptr && hole->addr >= best->addr) break;  // lowest first: nothing lower here
      if (hole->size >= bytes) {
        best = hole;
        break;
      }
    }
  }
  return best;
}

bool Holes::classes_agree() const {
  size_t listed = 0;
  for (size_t c = 0; c < kClasses; ++c) {
    listed += by_class_[c].size();
    if (by_class_[c].empty() == ((nonempty_[c / 64] >> (c % 64) & 1) != 0)) return false;
  }
  if (listed != all_.size()) return false;
  for (Block* hole : all_) {
    if (by_class_[size_class(hole->size)].count(hole) == 0) return false;
  }
  return true;
}

}  // namespace pyalloc
