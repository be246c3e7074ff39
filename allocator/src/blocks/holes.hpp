// holes.hpp: an arena's holes, by address and by size.
//
// An arena looks for holes in two ways: the runs of free blocks and holes it
// can grow into (best_window, lowest first) and the block beside an address
// (block_near_holes) go by address; a shared window wants the lowest hole of
// at least so many granules (plan_share). Near a full device an arena has
// thousands of small holes (stitching leaves them), so the second keeps the
// holes by size class as well: one class per number of granules below 64,
// then one per power of two. The lowest fitting hole is the lowest of the
// first hole of each class that fits, after a scan of the one class whose
// holes may be too small: O(classes + that class).
//
// Holes start on granule boundaries, so each is listed by its first granule
// (a BitIndex over the arena's granules, and a pointer per granule): a hole
// comes and goes in a few stores, without a tree node, on every growth. The
// walk by address follows a list in address order threaded through the holes'
// free-set links (Block::bin_prev and bin_next, unused while a block is a
// hole), whose neighbours insert finds in the BitIndex: best_window walks
// every hole of the arena on most growths near a full device.
//
// A hole's address and size stay as they are while it is listed: erase it
// before splitting or merging it, insert it after.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "blocks/bit_index.hpp"

namespace pyalloc {

struct Block;
struct Segment;

class Holes {
 public:
  // For the holes of the arena of `bytes` at `base`, of whole granules of
  // `granule` bytes.
  void start(uintptr_t base, size_t bytes, size_t granule);

  void insert(Block* hole);
  void erase(Block* hole);

  size_t size() const { return all_.size(); }
  bool contains(const Block* hole) const;
  // The hole that starts at `addr`, or nullptr.
  Block* at(uintptr_t addr) const;
  // Calls f(hole) for every hole, lowest first, while f returns true
  // (holes_inl.hpp).
  template <class F>
  void for_each(F&& f) const;
  // The lowest hole that starts at or after `addr`, or nullptr.
  Block* first_from(uintptr_t addr) const;
  // The highest hole that starts at or before `addr`, or nullptr.
  Block* last_to(uintptr_t addr) const;
  // The lowest hole of at least `bytes`, or nullptr.
  Block* lowest_fitting(size_t bytes) const;
  // For pyalloc_check: every listed hole is a hole of this arena, listed once
  // by address and once in its size class, and nothing else is listed.
  bool consistent(const Segment* arena) const;

 private:
  static constexpr size_t kExactClasses = 64;  // 1 .. 63 granules, one class each
  static constexpr size_t kClasses = 128;
  size_t size_class(size_t bytes) const;
  size_t slot(uintptr_t addr) const { return (addr - base_) / granule_; }

  uintptr_t base_ = 0;
  size_t granule_ = 0;
  BlockTable all_;                  // per granule: the hole that starts there
  Block* lowest_ = nullptr;         // the first hole of the address-order list
  std::vector<BitIndex> by_class_;  // the granules where one starts, per size class (kClasses; arenas only)
  std::vector<size_t> in_class_;    // holes per class
  uint64_t nonempty_[2] = {0, 0};   // bit c: by_class_[c] holds a hole
};

}  // namespace pyalloc
