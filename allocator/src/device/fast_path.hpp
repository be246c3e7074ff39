// fast_path.hpp: the cache-hit path of DeviceAllocator, and the general
// path's entry points, inline.
//
// Note [Fast path]
// pyalloc_malloc and pyalloc_free first try malloc_cached() / free_cached():
// a request the cache serves (best fit, split, merge) in the default pool.
// These make no call that returns to them (only tail calls, and the futex
// wake of a contended unlock), so the C entry points (abi/capi.cpp) need no
// frame, few saved registers and no exception scope. Whatever would need a
// call makes them give up before anything has changed, and the entry point
// takes the general path, malloc() / free() under guarded(), which does the
// same operation the same way:
//   - both: a contended lock, a retired allocator, a planner at work,
//     lifetime-aware placement, a CUDA graph capture or a trace being
//     recorded (all in divert_, one test);
//   - malloc: a thread in a user pool (abi/capi.cpp), a pending free (active
//     peaks), no fitting block (the slow path), a live map that must grow, a
//     split with no spare Block object, a split in an arena that starts the
//     block on a granule boundary (Note [Whole granules]) or that may take a
//     shared window near a full device, unless the counted whole free
//     granules pass the request by a granule (then they cover it: Note
//     [Whole-granule count] in share.cpp);
//   - free: a bad call (a size or stream other than the malloc's), a block
//     used on other streams (record_stream), a
//     free that takes the cache past max_cached, a merge with fewer than two
//     free slots on the spare-Block stack (a merge recycles up to two Blocks).
// The state changes are shared: hand_out() and give_back() make no call
// either, given room in the live map and on the spare-Block stack. The
// general path makes that room first (it may allocate); the fast path checks
// that it is there. Splits, merges and hits in an arena whose whole free
// granules are counted are tail calls out of line (split_and_unlock,
// merge_and_unlock, counted_hand_out_and_unlock, counted_cache_and_unlock),
// so that a plain hit keeps its registers.
//
// A cache hit costs: the lock, best fit in the request's size class (its
// class computed once: Block::bin_class keeps it for the free), erase from
// the free set, the live-map insert, five counter updates (Note [Counters]);
// and on free, the live-map erase, the neighbour checks, insert into the
// free set (Note [Free sets]: no bitmap write), five counter updates.
// tools/bench/hotpath.py counts the instructions.

#pragma once

#include <cassert>

#include "device/blocks_inl.hpp"
#include "device/device_allocator.hpp"
#include "ground/compiler.hpp"
#include "pyalloc/pyalloc.h"

namespace pyalloc {

// Note [Locals on the fast path]
// The fast path copies the fields it needs (sizes, stat type) into locals
// before it writes anything: a store to a size_t counter may alias a Block's
// size_t fields as far as the compiler knows, and would make it load them
// again after every counter update.

// ---- the fast path (Note [Fast path]) --------------------------------------------

template <typename Otherwise>
PYALLOC_INLINE void* DeviceAllocator::malloc_cached(size_t size, StreamId stream, Otherwise otherwise) {
  if (PYALLOC_UNLIKELY(divert_ || stats_.any_pending() || live_.full())) return otherwise();
  const size_t rounded = round_size(size);
  Pool& pool = select_pool(rounded, 0);
  Block* block = pool.free_blocks.best_fit(stream, rounded);
  if (PYALLOC_UNLIKELY(block == nullptr)) return otherwise();
  if (PYALLOC_LIKELY(block->size == rounded || !should_split(pool, block->size - rounded))) {
    if (PYALLOC_UNLIKELY(block->segment->counted)) return counted_hand_out_and_unlock(pool, block, size, rounded);
    void* p = hand_out<true, false>(pool, block, nullptr, size, rounded);
    mutex_.unlock();
    return p;
  }
  if (PYALLOC_UNLIKELY(spare_blocks_.empty())) return otherwise();
  if (PYALLOC_UNLIKELY(pool.in_arenas) && (whole_granule_offset(block, rounded) != 0 ||
                                            (shares_first(pool, rounded) && free_whole_bytes_ < rounded + granule_))) {
    return otherwise();
  }
  return split_and_unlock(pool, block, size, rounded);
}

template <typename Otherwise>
PYALLOC_INLINE void DeviceAllocator::free_cached(uintptr_t addr, size_t size, StreamId stream, Otherwise otherwise) {
  if (PYALLOC_UNLIKELY(divert_)) return otherwise();
  auto* entry = live_.find(addr);
  if (PYALLOC_UNLIKELY(entry == nullptr)) return otherwise();
  Block* block = entry->value;
  if (PYALLOC_UNLIKELY((size != block->requested && size != kAnySize) ||
                       (stream != block->stream && stream != kAnyStream) || !block->uses.empty() ||
                       cached_free_bytes_ + block->size > max_cached_)) {
    return otherwise();
  }
  if (PYALLOC_UNLIKELY(has_free_neighbour(block))) {
    if (!spare_room(2)) return otherwise();
    count_freed(block);
    live_.erase(entry);
    return merge_and_unlock(block);
  }
  count_freed(block);
  live_.erase(entry);
  if (PYALLOC_UNLIKELY(block->segment->counted)) return counted_cache_and_unlock(block);
  cache_block<true, false>(block);
  mutex_.unlock();
}

// The state changes of a hit: no call (Note [Fast path]).

// Hands out `block` (a free block of `pool` of at least `rounded` bytes). When
// `rest` is not null (should_split), it becomes the free remainder. The live
// map must have room. kFast: on the fast path (no sliver index, index_in).
// kCount false: the block's segment is not counted (Note [Whole-granule
// count] in share.cpp), and the count's code is left out.
template <bool kFast, bool kCount>
PYALLOC_INLINE void* DeviceAllocator::hand_out(Pool& pool, Block* block, Block* rest, size_t size,
                                               size_t rounded) {
  assert(!kFast || !block->segment->indexed);
  const uintptr_t addr = block->addr;
  const StatType t = pool.stat;
  if constexpr (!kFast) index_out(block);
  uncount_cached<kCount>(t, block);
  pool.free_blocks.erase(block);  // erase_free(), with the pool at hand
  if (rest != nullptr) {
    split_into(block, rest, rounded);
    block->bin_class = FreeSet::size_class(rounded);
    rest->bin_class = FreeSet::size_class(rest->size);
    reinsert_free<kFast, kCount>(rest);
  }
  const size_t bytes = block->size;
  block->state = BlockState::kAllocated;
  block->requested = size;
  stats_.allocation.increase(t, 1);
  stats_.allocated_bytes.increase(t, static_cast<int64_t>(bytes));
  stats_.requested_bytes.increase(t, static_cast<int64_t>(size));
  live_.place(addr, block);
  return reinterpret_cast<void*>(addr);
}

// An allocated block leaves the allocation counters.
PYALLOC_INLINE void DeviceAllocator::count_freed(const Block* block) {
  const size_t requested = block->requested;
  const size_t bytes = block->size;
  const StatType t = block->pool->stat;
  stats_.allocation.decrease(t, 1);
  stats_.allocated_bytes.decrease(t, static_cast<int64_t>(bytes));
  stats_.requested_bytes.decrease(t, static_cast<int64_t>(requested));
}

PYALLOC_INLINE bool DeviceAllocator::has_free_neighbour(const Block* block) const {
  return (block->prev != nullptr && block->prev->is_free()) || (block->next != nullptr && block->next->is_free());
}

// give_back() for a block with no free neighbour, whose bin_class is still
// the class of its size (Block::bin_class). kFast, kCount: as for hand_out.
template <bool kFast, bool kCount>
PYALLOC_INLINE void DeviceAllocator::cache_block(Block* block) {
  assert(block->bin_class == FreeSet::size_class(block->size));
  assert(!kFast || !block->segment->indexed);
  block->state = BlockState::kFree;
  block->requested = 0;
  block->freed_at = ++frees_;  // also orders wholly free segments' release (release_free_segments)
  reinsert_free<kFast, kCount>(block);
}

// The rarer halves of malloc_cached() and free_cached(), out of line so that
// a plain hit keeps its few registers. They release the lock.
__attribute__((noinline)) inline void* DeviceAllocator::split_and_unlock(Pool& pool, Block* block, size_t size,
                                                                         size_t rounded) {
  // The block and its rest share a segment: one look at its count flag for both.
  void* p = PYALLOC_UNLIKELY(block->segment->counted) ? hand_out<true>(pool, block, new_block(), size, rounded)
                                                      : hand_out<true, false>(pool, block, new_block(), size, rounded);
  mutex_.unlock();
  return p;
}

__attribute__((noinline)) inline void DeviceAllocator::merge_and_unlock(Block* block) {
  if (PYALLOC_UNLIKELY(block->segment->counted)) {
    give_back(block);
  } else {
    give_back<false>(block);
  }
  mutex_.unlock();
}

// A hit (no split, no merge) in an arena whose free blocks' whole granules
// are counted (Note [Whole-granule count] in share.cpp): the inline hits
// leave the count out, so that they keep their registers.
__attribute__((noinline)) inline void* DeviceAllocator::counted_hand_out_and_unlock(Pool& pool, Block* block,
                                                                                    size_t size, size_t rounded) {
  void* p = hand_out<true>(pool, block, nullptr, size, rounded);
  mutex_.unlock();
  return p;
}

__attribute__((noinline)) inline void DeviceAllocator::counted_cache_and_unlock(Block* block) {
  cache_block<true>(block);
  mutex_.unlock();
}

// ---- the general path ----------------------------------------------------------------

PYALLOC_INLINE void* DeviceAllocator::malloc(size_t size, StreamId stream, int pool_id, int* status) {
  Lock lock(mutex_);
  if (PYALLOC_UNLIKELY(divert_ & kDivertRetired)) {
    *status = PYALLOC_EBUSY;
    return nullptr;
  }
  // Between requests, never inside one: a plan_share needs its index.
  if (PYALLOC_UNLIKELY(divert_ & kDivertSlivers)) drop_sliver_indexes(false);
  const size_t rounded = round_size(size);  // reads round_power2_: under the lock
  Pool& pool = select_pool(rounded, pool_id);
  if (PYALLOC_UNLIKELY(divert_ & kDivertCapture)) return malloc_capturing(pool, size, rounded, stream, status);
  // Default-pool requests meet the planner and lifetime placement (both
  // divert); a user pool is the caller's choice.
  if (PYALLOC_UNLIKELY(pool_id == 0 && divert_)) {
    return malloc_default(pool, size, rounded, stream, status);
  }
  return malloc_cache(pool, size, rounded, stream, status);
}

// A request served by the cache: best fit, else the slow path. Near a full
// device, a request that would split its best fit tries a shared window
// first, used when it takes fewer granules (Note [Shared granules]); a fit
// that needs no split is taken as it is, as the fast path takes it, so that
// the path a request happens to take (a contended lock, a trace being
// recorded) never changes where it goes.
PYALLOC_INLINE Block* DeviceAllocator::alloc_block(Pool& pool, size_t size, size_t rounded, StreamId stream,
                                                   int* status) {
  Block* block = pool.free_blocks.best_fit(stream, rounded);
  if (PYALLOC_UNLIKELY(shares_first(pool, rounded)) &&
      (block == nullptr || should_split(pool, block->size - rounded))) {
    Block* shared = share_first(pool, rounded, stream, block);
    // share_first may change the free sets even when it finds no window.
    block = shared != nullptr ? shared : pool.free_blocks.best_fit(stream, rounded);
  }
  if (PYALLOC_UNLIKELY(block == nullptr)) {
    block = malloc_slow(pool, size, rounded, stream, status);
    if (block == nullptr) return nullptr;
  }
  if (pool.in_arenas) block = align_to_granule(block, rounded);
  take(pool, block, size, rounded);  // the block keeps its object when split: it is the front part
  return block;
}

PYALLOC_INLINE void* DeviceAllocator::malloc_cache(Pool& pool, size_t size, size_t rounded, StreamId stream,
                                                   int* status) {
  Block* block = alloc_block(pool, size, rounded, stream, status);
  return block != nullptr ? reinterpret_cast<void*>(block->addr) : nullptr;
}

// Hands out `block` (a free block of `pool` of at least `rounded` bytes),
// splitting off the rest when it is worth keeping.
PYALLOC_INLINE void* DeviceAllocator::take(Pool& pool, Block* block, size_t size, size_t rounded) {
  Block* rest = should_split(pool, block->size - rounded) ? new_block() : nullptr;
  live_.make_room();
  void* p = hand_out(pool, block, rest, size, rounded);
  if (PYALLOC_UNLIKELY(stats_.any_pending())) stats_.note_active_peaks();
  trace_.record(TraceAction::kAlloc, block->addr, block->requested, block->stream);
  return p;
}

PYALLOC_INLINE FreeResult DeviceAllocator::free(uintptr_t addr, size_t size, StreamId stream) {
  Lock lock(mutex_);
  if (PYALLOC_UNLIKELY(divert_ & kDivertRetired)) return FreeResult::kRetired;
  auto* entry = live_.find(addr);
  if (PYALLOC_UNLIKELY(entry == nullptr)) return classify_bad_free(addr);
  Block* block = entry->value;
  if (PYALLOC_UNLIKELY(size != kAnySize && size != block->requested)) return refuse_size_mismatch(block, size);
  if (PYALLOC_UNLIKELY(stream != kAnyStream && stream != block->stream)) return refuse_stream_mismatch(block, stream);
  if (PYALLOC_UNLIKELY(divert_ & kDivertPlanner)) watch_free(block);
  count_freed(block);
  live_.erase(entry);
  trace_.record(TraceAction::kFreeRequested, addr, block->requested, block->stream);

  if (PYALLOC_UNLIKELY(divert_ & kDivertCapture) && (!block->uses.empty() || block->segment->arena)) {
    defer_free(block);  // Note [Capture]
    return FreeResult::kOk;
  }
  if (PYALLOC_UNLIKELY(!block->uses.empty())) {
    make_pending(block);
  } else {
    finish_free(block);
  }
  if (PYALLOC_UNLIKELY(cached_free_bytes_ > max_cached_) && !(divert_ & kDivertCapture)) enforce_max_cached();
  return FreeResult::kOk;
}

// The block becomes free: coalesce with free neighbours and cache it.
PYALLOC_INLINE void DeviceAllocator::finish_free(Block* block) {
  trace_.record(TraceAction::kFreeCompleted, block->addr, block->requested, block->stream);
  make_spare_room(2);
  give_back(block);
}

}  // namespace pyalloc
