// holes.cpp: see holes.hpp.
#include "blocks/holes.hpp"

#include <cassert>

#include "blocks/types.hpp"

namespace pyalloc {

void Holes::start(size_t granule) {
  granule_ = granule;
  by_class_.assign(kExactClasses + 64, ByAddressSet{});
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
  by_class_[size_class(hole->size)].insert(hole);
}

void Holes::erase(Block* hole) {
  all_.erase(hole);
  by_class_[size_class(hole->size)].erase(hole);
}

Block* Holes::at(uintptr_t addr) const {
  const auto it = all_.find(addr);
  return it == all_.end() ? nullptr : *it;
}

Block* Holes::lowest_fitting(size_t bytes) const {
  if (granule_ == 0) return nullptr;
  const size_t first = size_class(bytes < granule_ ? granule_ : bytes);
  Block* best = nullptr;
  for (size_t c = first; c < by_class_.size(); ++c) {
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
  for (const ByAddressSet& c : by_class_) listed += c.size();
  if (listed != all_.size()) return false;
  for (Block* hole : all_) {
    if (by_class_[size_class(hole->size)].count(hole) == 0) return false;
  }
  return true;
}

}  // namespace pyalloc
