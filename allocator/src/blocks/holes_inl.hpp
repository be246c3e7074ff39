// holes_inl.hpp: Holes::for_each, which follows the holes' links (holes.hpp).
#pragma once

#include "blocks/holes.hpp"
#include "blocks/types.hpp"

namespace pyalloc {

template <class F>
void Holes::for_each(F&& f) const {
  for (Block* hole = lowest_; hole != nullptr && f(hole);) hole = hole->bin_next;
}

}  // namespace pyalloc
