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
// Two more things near a full device would cost a walk of the arena: the
// free blocks that hold a whole granule, lowest first, which stitching
// unmaps (roomy blocks, by their first whole granule: a BitIndex over the
// arena's granules, so that a free-set change near a full device costs a
// store or two and no tree node); and the twins whose own part is all free,
// which part before free granules are gathered (untwin_free). A twin's own
// part becomes all free only when a free block arrives beside its lent
// piece, so the index notes the granule then (twins_to_check), and
// untwin_free looks at those alone.
//
// The index follows free-set membership: a block enters it when it enters
// its pool's free set and leaves it when it leaves, geometry unchanged in
// between (index_in and index_out in device/blocks_inl.hpp). It is off until
// the first request that shares; then DeviceAllocator::index_slivers builds
// one for every arena of the device with one walk each, and every call takes
// the general path (kDivertSlivers), so that the fast path never pays for
// it. The first request after reserved memory falls under 90% of the limit
// drops them all (drop_sliver_indexes), and so does the first after their
// upkeep since they were last asked (index_slivers) passed twice what building
// them again walks (tools/bench/scale.py at 10^2 live blocks and 1.05 times
// their peak: 719 instructions per operation, 532 with the drop). Whether a
// request needs a shared window at all is answered without them, by the
// device's count of whole free granules (Note [Whole-granule count] in
// device/share.cpp): built to answer that, they stayed on through churns
// where no request shared (at 10^3 and 10^4 live blocks, 630 and 471
// instructions per operation against 486 and 345 with the count).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "blocks/bit_index.hpp"

namespace pyalloc {

struct Block;

class SliverIndex {
 public:
  enum Kind : int { kEnd = 0, kStart = 1 };

  bool on() const { return granule_ != 0; }
  // Turns the index on, empty, for an arena of `granules` granules of
  // `granule` bytes, a power of two (arena_for refuses other granularities).
  void start(size_t granule, size_t granules);
  // Turns it off; its storage stays for the next start().
  void stop();

  // A free block of the arena enters or leaves the index (sliver_index_inl.hpp).
  inline void insert(Block* block);
  inline void erase(Block* block);

  // The first sliver of `kind` at an offset of at least `from` bytes, in
  // offset order (lists in insertion order); nullptr when none.
  Block* first(Kind kind, size_t from) const;
  // The one after `block` (a sliver of `kind`) in that order.
  Block* next(Kind kind, const Block* block) const;

  // The roomy block (a free block that holds a whole granule) whose first
  // whole granule is the lowest at or after granule `slot`; nullptr when none.
  inline Block* roomy_from(size_t slot) const;
  // Whether `block` is listed as roomy.
  inline bool is_roomy(const Block* block) const;
  size_t roomy_count() const { return roomy_.size(); }
  // The granule of the arena where roomy `block`'s first whole granule lies.
  static inline size_t first_whole(const Block* block, size_t granule);

  // How many slivers of `kind` are listed (Note [Balanced slivers] in
  // blocks/arena.hpp).
  size_t count(Kind kind) const { return count_[kind]; }

  // Twin granules to look at: a free block arrived beside their lent piece
  // since the last call (or the index was built). Each at most once.
  std::vector<size_t> take_twins_to_check();
  void check_twin(size_t slot) { twins_to_check_.push_back(slot); }
  bool noted(size_t slot) const;  // for pyalloc_check: whether check_twin(slot) is pending

  // The offset of `block` as a sliver of `kind` in its granule, or 0 when it
  // is not one.
  static inline size_t offset(Kind kind, const Block* block, size_t granule);
  // How many whole granules `block` holds (0: it is not roomy).
  static inline size_t whole_granules(const Block* block, size_t granule);
  // Whether the granule in which `block` is a sliver of `kind` may lend it:
  // it is no twin.
  static inline bool lends(Kind kind, const Block* block, size_t granule);

 private:
  // Where a block lies in the arena's granules (sliver_index_inl.hpp).
  struct Place {
    size_t end_unit;       // its offset unit as a free end; 0: it is none
    size_t start_unit;     // as a free start; 0: it is none
    size_t end_granule;    // the granule where it would be a free end
    size_t start_granule;  // the granule where it would be a free start
    size_t first_whole;    // its first whole granule, if any
    size_t whole;          // how many whole granules it holds
  };
  inline Place place(const Block* block) const;
  void link(Kind kind, Block* block, size_t unit);
  void unlink(Kind kind, Block* block, size_t unit);
  Block* first_from_unit(Kind kind, size_t unit) const;

  size_t granule_ = 0;
  unsigned shift_ = 0;  // log2(granule_)
  BlockTable heads_[2];       // per offset unit: the first sliver of the list
  size_t count_[2] = {0, 0};  // slivers listed, per kind
  BlockTable roomy_;          // per granule: the roomy block whose first whole granule it is
  std::vector<size_t> twins_to_check_;
};

}  // namespace pyalloc
