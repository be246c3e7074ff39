// blocks_inl.hpp: how the device allocator changes blocks, inline: Block
// objects, sizes and pools, splitting and merging, and free-set membership
// with the counters that ride on it (Note [Counters] in observe/stats.hpp).
// The fast path (fast_path.hpp) and the slow paths share these; none of them
// makes a call, given room on the spare-Block stack where they say so.
#pragma once

#include <cassert>

#include "blocks/arena.hpp"
#include "blocks/free_set_inl.hpp"
#include "blocks/sliver_index_inl.hpp"
#include "device/device_allocator.hpp"
#include "ground/compiler.hpp"

namespace pyalloc {

// ---- Block objects ------------------------------------------------------------------

// Blocks come kBlockSlab at a time (Note [Block layout] in blocks/types.hpp):
// one aligned allocation instead of one each, and the blocks a walk passes
// lie near each other. They return to the system with the allocator.
PYALLOC_INLINE Block* DeviceAllocator::new_block() {
  if (spare_blocks_.empty()) {
    block_slabs_.emplace_back(new Block[kBlockSlab]);
    make_spare_room(kBlockSlab);
    Block* slab = block_slabs_.back().get();
    for (size_t i = kBlockSlab; i-- > 1;) spare_blocks_.push_back(&slab[i]);
    return &slab[0];
  }
  Block* b = spare_blocks_.back();
  spare_blocks_.pop_back();
  return b;
}

// Room for `n` more Blocks on the spare stack: recycle_block() needs one.
PYALLOC_INLINE bool DeviceAllocator::spare_room(size_t n) const {
  return spare_blocks_.capacity() - spare_blocks_.size() >= n;
}

PYALLOC_INLINE void DeviceAllocator::make_spare_room(size_t n) {
  if (!spare_room(n)) spare_blocks_.reserve(2 * spare_blocks_.size() + n);
}

// delete_block() where spare_room(1): never allocates.
PYALLOC_INLINE void DeviceAllocator::recycle_block(Block* block) {
  block->uses.clear();
  block->bin_prev = block->bin_next = nullptr;
  block->requested = 0;
  block->freed_at = 0;
  block->state = BlockState::kFree;
  block->prev = block->next = nullptr;
  // Tells the compiler that push_back() will not grow the vector, so that
  // no call to the growth path is compiled in (Note [Fast path]).
  assert(spare_room(1));
  if (spare_blocks_.size() == spare_blocks_.capacity()) __builtin_unreachable();
  spare_blocks_.push_back(block);
}

PYALLOC_INLINE void DeviceAllocator::delete_block(Block* block) {
  make_spare_room(1);
  recycle_block(block);
}

// ---- sizes and pools --------------------------------------------------------------

PYALLOC_INLINE size_t DeviceAllocator::round_size(size_t size) const {
  // `size` > 0: sizes up to 512 B round to 512 B either way.
  if (round_power2_ > 1) {
    // Round up to one of `round_power2_` steps between adjacent powers of
    // two: fewer distinct sizes, so freed blocks fit later requests.
    const size_t floor2 = size_t{1} << (63 - __builtin_clzll(static_cast<unsigned long long>(size)));
    const size_t step = floor2 / static_cast<size_t>(round_power2_);
    if (floor2 != size && step > kBlockAlign) return round_up_to(size, step);
  }
  return round_up_to(size, kBlockAlign);
}

PYALLOC_INLINE Pool& DeviceAllocator::select_pool(size_t rounded, int pool_id) {
  if (PYALLOC_LIKELY(pool_id == 0)) return rounded <= largest_small_ ? small_pool_ : large_pool_;
  return user_pool(pool_id);
}

PYALLOC_INLINE bool DeviceAllocator::should_split(const Pool& pool, size_t remaining) const {
  // A large-pool remainder of 1 MiB or less could only ever serve small
  // requests, which the large pool never sees: keep it inside the block.
  // In an arena that slack would hold physical memory: split.
  if (pool.kind == PoolKind::kLarge && !pool.in_arenas) return remaining > kLargeSplitMin;
  return remaining >= kBlockAlign;
}

// Every arena of every pool, in pools() order, with no list built (the
// slow paths walk them: stitching, releasing, starting the whole-granule
// count).
template <typename F>
void DeviceAllocator::for_each_arena(F fn) {
  for (Pool* pool : {&small_pool_, &large_pool_, &long_pool_, &plan_pool_}) {
    for (Segment* a : pool->arenas) fn(a);
  }
  for (const auto& pool : user_pools_) {
    if (pool) {
      for (Segment* a : pool->arenas) fn(a);
    }
  }
}

// Whether a request of `rounded` bytes in `pool` tries a shared window before
// the cache (Note [Shared granules]): the device is nearly full, and the
// request spans more than a granule.
PYALLOC_INLINE bool DeviceAllocator::shares_first(const Pool& pool, size_t rounded) const {
  return static_cast<size_t>(stats_.reserved_bytes.current(kStatAll)) + rounded >= share_from_ && pool.in_arenas &&
         granule_ != 0 && rounded > granule_;
}

// Whether whole granules cover `rounded` bytes without sharing one (Note
// [Whole-granule count] in share.cpp), as far as it is known without a walk:
// those the device may still reserve, and those inside free blocks of the
// arenas once counted, else inside `fit` (a free block of an arena, the
// request's cached best fit, or nullptr). Needs an arena (granule_ known).
PYALLOC_INLINE bool DeviceAllocator::covered_without_sharing(size_t rounded, const Block* fit) const {
  const size_t span = (rounded + granule_ - 1) / granule_;
  const size_t reserved = static_cast<size_t>(stats_.reserved_bytes.current(kStatAll));
  size_t spare = reserved < share_limit_ ? (share_limit_ - reserved) / granule_ : 0;
  if (whole_counted_) {
    spare += free_whole_bytes_ / granule_;
  } else if (fit != nullptr) {
    spare += SliverIndex::whole_granules(fit, granule_);
  }
  return spare >= span;
}

// pyalloc::whole_granule_offset (blocks/arena.hpp) in this device's arenas,
// for the fast path. An arena exists, so granule_ is known (arena_for).
PYALLOC_INLINE size_t DeviceAllocator::whole_granule_offset(const Block* block, size_t rounded) const {
  return pyalloc::whole_granule_offset(block, rounded, granule_);
}

// ---- splitting and merging -----------------------------------------------------------

// `block` (no longer allocated or pending) becomes free: it coalesces with
// its free neighbours and joins the cache. Needs spare_room(2). kCount: as
// for count_cached (the block and its neighbours share a segment).
template <bool kCount>
PYALLOC_INLINE void DeviceAllocator::give_back(Block* block) {
  block = coalesce<kCount>(block);
  block->bin_class = FreeSet::size_class(block->size);
  cache_block<false, kCount>(block);
}

// `block`, out of any free set, absorbs its free neighbours (which leave
// their free sets); returns the merged block. Needs spare_room(2).
template <bool kCount>
PYALLOC_INLINE Block* DeviceAllocator::coalesce(Block* block) {
  if (Block* prev = block->prev; prev != nullptr && prev->is_free()) {
    erase_free<kCount>(prev);
    absorb_next(prev);
    block = prev;
  }
  if (Block* next = block->next; next != nullptr && next->is_free()) {
    erase_free<kCount>(next);
    absorb_next(block);
  }
  return block;
}

// Splits `block` at `offset` bytes: `rest` (a Block object not in use)
// becomes the part after, in the same segment, pool and stream.
PYALLOC_INLINE void DeviceAllocator::split_into(Block* block, Block* rest, size_t offset) {
  rest->addr = block->addr + offset;
  rest->size = block->size - offset;
  rest->segment = block->segment;
  rest->pool = block->pool;
  rest->stream = block->stream;
  rest->freed_at = 0;  // no request freed this piece as it is: cold (Note [Cold donors])
  rest->prev = block;
  rest->next = block->next;
  if (block->next != nullptr) block->next->prev = rest;
  block->next = rest;
  block->size = offset;
}

// `block` absorbs the block after it, whose object is recycled. Needs spare_room(1).
PYALLOC_INLINE void DeviceAllocator::absorb_next(Block* block) {
  Block* next = block->next;
  block->size += next->size;
  block->next = next->next;
  if (next->next != nullptr) next->next->prev = block;
  recycle_block(next);
}

// ---- free-set membership ----------------------------------------------------------------

// Free-set membership is where cached-free and inactive-split counters live
// (a block is split when it does not fill its segment), and near a full
// device the count of whole free granules in the arenas (Note [Whole-granule
// count] in share.cpp). kCount false: the caller knows the block's segment is
// not counted (the fast path's hits, which keep their few registers so).
template <bool kCount>
PYALLOC_INLINE void DeviceAllocator::count_cached(StatType t, const Block* block) {
  const size_t bytes = block->size;
  cached_free_bytes_ += bytes;
  if (bytes != block->segment->size) {
    stats_.inactive_split.increase(t, 1);
    stats_.inactive_split_bytes.increase(t, static_cast<int64_t>(bytes));
  }
  assert(kCount || !block->segment->counted);
  if (kCount && PYALLOC_UNLIKELY(block->segment->counted)) {
    free_whole_bytes_ += SliverIndex::whole_granules(block, granule_) * granule_;
  }
}

template <bool kCount>
PYALLOC_INLINE void DeviceAllocator::uncount_cached(StatType t, const Block* block) {
  const size_t bytes = block->size;
  cached_free_bytes_ -= bytes;
  if (bytes != block->segment->size) {
    stats_.inactive_split.decrease(t, 1);
    stats_.inactive_split_bytes.decrease(t, static_cast<int64_t>(bytes));
  }
  assert(kCount || !block->segment->counted);
  if (kCount && PYALLOC_UNLIKELY(block->segment->counted)) {
    free_whole_bytes_ -= SliverIndex::whole_granules(block, granule_) * granule_;
  }
}

// An arena's sliver index, once on, follows free-set membership (Note
// [Sliver index]). The fast path never meets an indexed arena: indexing
// diverts every call (kDivertSlivers), so its copies of these operations
// (kFast) leave the index out and keep its few registers.
PYALLOC_INLINE void DeviceAllocator::index_in(Block* block) {
  if (PYALLOC_UNLIKELY(block->segment->indexed)) {
    block->segment->slivers.insert(block);
    ++sliver_upkeep_;
  }
}

PYALLOC_INLINE void DeviceAllocator::index_out(Block* block) {
  if (PYALLOC_UNLIKELY(block->segment->indexed)) {
    block->segment->slivers.erase(block);
    ++sliver_upkeep_;
  }
}

PYALLOC_INLINE void DeviceAllocator::insert_free(Block* block) {
  block->pool->free_blocks.insert(block);
  count_cached(block->pool->stat, block);
  index_in(block);
}

// insert_free() for a block whose stream its pool's free set has seen
// (FreeSet::reinsert): no call.
template <bool kFast, bool kCount>
PYALLOC_INLINE void DeviceAllocator::reinsert_free(Block* block) {
  block->pool->free_blocks.reinsert(block);
  count_cached<kCount>(block->pool->stat, block);
  if constexpr (!kFast) index_in(block);
}

template <bool kCount>
PYALLOC_INLINE void DeviceAllocator::erase_free(Block* block) {
  index_out(block);
  uncount_cached<kCount>(block->pool->stat, block);
  block->pool->free_blocks.erase(block);
}

}  // namespace pyalloc
