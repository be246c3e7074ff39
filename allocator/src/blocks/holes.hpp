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
// A hole's address and size stay as they are while it is listed: erase it
// before splitting or merging it, insert it after.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

#include "blocks/sliver_index.hpp"  // ByAddress

namespace pyalloc {

struct Block;

class Holes {
 public:
  using ByAddressSet = std::set<Block*, ByAddress>;

  // For holes of whole granules of `granule` bytes.
  void start(size_t granule);

  void insert(Block* hole);
  void erase(Block* hole);

  // Every hole, lowest first.
  const ByAddressSet& by_address() const { return all_; }
  size_t size() const { return all_.size(); }
  bool contains(Block* hole) const { return all_.count(hole) != 0; }
  // The hole that starts at `addr`, or nullptr.
  Block* at(uintptr_t addr) const;
  // The lowest hole of at least `bytes`, or nullptr.
  Block* lowest_fitting(size_t bytes) const;
  // For pyalloc_check: every hole listed in its size class, and nothing else.
  bool classes_agree() const;

 private:
  static constexpr size_t kExactClasses = 64;  // 1 .. 63 granules, one class each
  static constexpr size_t kClasses = 128;
  size_t size_class(size_t bytes) const;

  size_t granule_ = 0;
  ByAddressSet all_;
  std::vector<ByAddressSet> by_class_;
  uint64_t nonempty_[2] = {0, 0};  // bit c: by_class_[c] holds a hole
};

}  // namespace pyalloc
