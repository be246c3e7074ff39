// check.hpp: pyalloc_check's walk of one device's blocks.
//
// check_heap() recomputes everything from the segments' block lists and
// compares it with the free sets, the live map, the pending list and every
// counter (blocks/types.hpp I1..I9, I13). It reads the device through a
// HeapView and never modifies it; the device allocator fills the view under
// its lock and checks its own invariants (I10..I12) beside it
// (device/reports.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "blocks/ptr_map.hpp"
#include "blocks/types.hpp"
#include "observe/stats.hpp"

namespace pyalloc {

// What a pool may hold beyond the block invariants: a request of at most
// `largest_request` bytes, and no segment at all when that is 0. A broken
// rule is reported as `invariant` with `what`.
struct PoolRule {
  const Pool* pool;
  size_t largest_request;
  const char* invariant;  // "I11"
  const char* what;       // "the long pool holds a segment while lifetime-aware placement is off"
};

// A device's blocks and the indexes kept beside them, as check_heap reads them.
struct HeapView {
  int device = 0;
  size_t granule = 0;  // the arenas' granule; 0 until an arena was made
  const std::map<uintptr_t, Segment*>* segments = nullptr;
  std::vector<const Pool*> pools;
  const PtrMap<Block*>* live = nullptr;
  std::vector<const Block*> pending;  // the pending-free list, in order
  size_t cached_free_bytes = 0;
  bool whole_counted = false;     // the count of whole free granules is kept (Note [Whole-granule count])
  size_t free_whole_granules = 0;  // and what it says
  uint64_t frees = 0;  // the clock of Block::freed_at
  const DeviceStats* stats = nullptr;
  std::vector<PoolRule> rules;
};

// True when every invariant holds; else false with the first violation in
// *error ("pyalloc_check: device N: I3: ...", or "I7: ..." for a counter).
bool check_heap(const HeapView& heap, std::string* error);

// I9, I13 and I14 for one arena: holes granule-aligned and apart, a granule
// mapped exactly when a non-hole block overlaps it, twins in groups that own
// each offset of their granule once, the sliver index (once on) listing
// exactly the free slivers.
bool check_arena(const Segment& arena, size_t granule, std::string* problem);

}  // namespace pyalloc
