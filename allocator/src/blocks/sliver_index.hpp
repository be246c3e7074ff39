// sliver_index.hpp: an arena's free slivers by their offset in the granule.
//
// Note [Sliver index]
// Near a full device every request that spans more than a granule asks
// plan_share (blocks/arena.cpp) for the free end of a granule in use that
// starts lowest in it, and for the smallest free start of a granule that
// holds the request's last bytes (Note [Shared granules] in
// device/share.cpp). Walking the arena's blocks for that costs O(blocks)
// per request: at 10^3 live blocks, 16 microseconds. The index answers both
// in O(granule / 512 / 64) word reads, whatever the number of blocks.
//
// A free block of an arena is
//   - a free end when it starts inside a granule and reaches that granule's
//     end: its offset is where it starts in the granule;
//   - a free start when it ends inside a granule and covers that granule's
//     start: its offset is where it ends in the granule;
// or both, or neither. Each kind has one list per offset (a multiple of
// kBlockAlign, 1 to g/512 - 1 units) threaded through the blocks
// (Block::sliver_prev/next), and a bitmap of the offsets whose list is not
// empty.
//
// The index follows free-set membership: a block enters it when it enters
// its pool's free set and leaves it when it leaves (count_cached and
// uncount_cached in device/blocks_inl.hpp), geometry unchanged in between.
// It is off until the first request that shares (DeviceAllocator::
// index_slivers builds it with one walk) and stays on: before the device is
// nearly full, a cache hit pays only for the test that it is off.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pyalloc {

struct Block;

class SliverIndex {
 public:
  enum Kind : int { kEnd = 0, kStart = 1 };

  bool on() const { return granule_ != 0; }
  // Turns the index on, empty, for granules of `granule` bytes.
  void start(size_t granule);

  // A free block of the arena enters or leaves the index (no call made;
  // sliver_index_inl.hpp).
  inline void insert(Block* block);
  inline void erase(Block* block);

  // The first sliver of `kind` at an offset of at least `from` bytes, in
  // offset order (lists in insertion order); nullptr when none.
  Block* first(Kind kind, size_t from) const;
  // The one after `block` (a sliver of `kind`) in that order.
  Block* next(Kind kind, const Block* block) const;

  // The offset of `block` as a sliver of `kind` in its granule, or 0 when it
  // is not one.
  static inline size_t offset(Kind kind, const Block* block, size_t granule);

 private:
  void link(Kind kind, Block* block, size_t unit);
  void unlink(Kind kind, Block* block, size_t unit);
  Block* first_from_unit(Kind kind, size_t unit) const;

  size_t granule_ = 0;
  std::vector<Block*> head_[2];     // per offset unit
  std::vector<uint64_t> bits_[2];   // bit u: head_[kind][u] != nullptr
};

}  // namespace pyalloc
