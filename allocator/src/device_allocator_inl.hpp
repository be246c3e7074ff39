// device_allocator_inl.hpp: the fast path of DeviceAllocator, inline.
//
// malloc() and free() are defined here so that the C ABI entry points
// (capi.cpp) compile them into their own frame: one call per operation
// instead of two. Everything here runs under the device lock; anything rare
// (the slow path, bad calls, pending frees, the cache cap) is an out-of-line
// call into device_allocator.cpp.
//
// A cache hit costs: the lock, best fit in the request's size class, erase
// from the free set, the live-map insert, three counters (Note [Counters]);
// and on free, the live-map erase, three counters, the neighbour checks,
// insert into the free set. tools/bench/hotpath.py counts the instructions.
#pragma once

#include "device_allocator.hpp"
#include "free_set_inl.hpp"
#include "pyalloc/pyalloc.h"

#define PYALLOC_LIKELY(x) __builtin_expect(!!(x), 1)
#define PYALLOC_UNLIKELY(x) __builtin_expect(!!(x), 0)
// The fast path's pieces are written as functions for reading, and inlined.
#define PYALLOC_INLINE inline __attribute__((always_inline))

namespace pyalloc {

inline size_t round_up_to(size_t n, size_t step) { return (n + step - 1) / step * step; }

PYALLOC_INLINE Block* DeviceAllocator::new_block() {
  if (spare_blocks_.empty()) return new Block;
  Block* b = spare_blocks_.back();
  spare_blocks_.pop_back();
  return b;
}

PYALLOC_INLINE void DeviceAllocator::delete_block(Block* block) {
  block->uses.clear();
  block->bin_prev = block->bin_next = nullptr;
  block->requested = 0;
  block->state = BlockState::kFree;
  block->prev = block->next = nullptr;
  spare_blocks_.push_back(block);
}

PYALLOC_INLINE size_t DeviceAllocator::round_size(size_t size) const {
  if (size <= kBlockAlign) return kBlockAlign;
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
  if (PYALLOC_LIKELY(pool_id == 0)) return rounded <= kSmallRequest ? small_pool_ : large_pool_;
  return user_pool(pool_id);
}

PYALLOC_INLINE bool DeviceAllocator::should_split(const Pool& pool, size_t remaining) const {
  // A large-pool remainder of 1 MiB or less could only ever serve small
  // requests, which the large pool never sees: keep it inside the block.
  if (pool.kind == PoolKind::kLarge) return remaining > kLargeSplitMin;
  return remaining >= kBlockAlign;
}

// Note [Locals on the fast path]
// The fast path copies the fields it needs (sizes, stat type) into locals
// before it writes anything: a store to a size_t counter may alias a Block's
// size_t fields as far as the compiler knows, and would make it load them
// again after every counter update.

PYALLOC_INLINE void* DeviceAllocator::malloc(size_t size, StreamId stream, int pool_id, int* status) {
  Lock lock(mutex_);
  if (PYALLOC_UNLIKELY(retired_)) {
    *status = PYALLOC_EBUSY;
    return nullptr;
  }
  const size_t rounded = round_size(size);  // reads round_power2_: under the lock
  Pool& pool = select_pool(rounded, pool_id);
  Block* block = pool.free_blocks.best_fit(stream, rounded);
  if (PYALLOC_UNLIKELY(block == nullptr)) return malloc_slow(pool, size, rounded, stream, status);
  return take(pool, block, size, rounded);
}

// Hands out `block` (a free block of `pool` of at least `rounded` bytes),
// splitting off the rest when it is worth keeping.
PYALLOC_INLINE void* DeviceAllocator::take(Pool& pool, Block* block, size_t size, size_t rounded) {
  const uintptr_t addr = block->addr;
  const StatType t = pool.stat;
  erase_free(block);
  const size_t remaining = block->size - rounded;
  if (should_split(pool, remaining)) {
    Block* rest = new_block();
    rest->addr = addr + rounded;
    rest->size = remaining;
    rest->segment = block->segment;
    rest->pool = &pool;
    rest->stream = block->stream;
    rest->prev = block;
    rest->next = block->next;
    if (block->next != nullptr) block->next->prev = rest;
    block->next = rest;
    block->size = rounded;
    insert_free(rest);
  }
  const size_t bytes = block->size;
  block->state = BlockState::kAllocated;
  block->requested = size;
  live_.insert(addr, block);

  stats_.allocation.increase(t, 1);
  stats_.allocated_bytes.increase(t, static_cast<int64_t>(bytes));
  stats_.requested_bytes.increase(t, static_cast<int64_t>(size));
  if (PYALLOC_UNLIKELY(stats_.any_pending())) stats_.note_active_peaks();
  trace_.record(TraceAction::kAlloc, addr, bytes, block->stream);
  return reinterpret_cast<void*>(addr);
}

PYALLOC_INLINE FreeResult DeviceAllocator::free(uintptr_t addr, size_t size) {
  Lock lock(mutex_);
  if (PYALLOC_UNLIKELY(retired_)) return FreeResult::kRetired;
  auto* entry = live_.find(addr);
  if (PYALLOC_UNLIKELY(entry == nullptr)) return classify_bad_free(addr);
  Block* block = entry->value;
  const size_t requested = block->requested;
  const size_t bytes = block->size;
  const StatType t = block->pool->stat;
  if (PYALLOC_UNLIKELY(size != kAnySize && size != requested)) return refuse_size_mismatch(block, size);
  live_.erase(entry);

  stats_.allocation.decrease(t, 1);
  stats_.allocated_bytes.decrease(t, static_cast<int64_t>(bytes));
  stats_.requested_bytes.decrease(t, static_cast<int64_t>(requested));
  trace_.record(TraceAction::kFreeRequested, addr, bytes, block->stream);

  if (PYALLOC_UNLIKELY(!block->uses.empty())) {
    make_pending(block);
  } else {
    finish_free(block);
  }
  if (PYALLOC_UNLIKELY(cached_free_bytes_ > max_cached_)) enforce_max_cached();
  return FreeResult::kOk;
}

// The block becomes free: coalesce with free neighbours and cache it.
PYALLOC_INLINE void DeviceAllocator::finish_free(Block* block) {
  trace_.record(TraceAction::kFreeCompleted, block->addr, block->size, block->stream);
  block->state = BlockState::kFree;
  block->requested = 0;

  if (Block* prev = block->prev; prev != nullptr && prev->is_free()) {
    erase_free(prev);
    prev->size += block->size;
    prev->next = block->next;
    if (block->next != nullptr) block->next->prev = prev;
    delete_block(block);
    block = prev;
  }
  if (Block* next = block->next; next != nullptr && next->is_free()) {
    erase_free(next);
    block->size += next->size;
    block->next = next->next;
    if (next->next != nullptr) next->next->prev = block;
    delete_block(next);
  }
  insert_free(block);
  if (block->segment->wholly_free()) block->segment->free_since = ++tick_;
}

// Free-set membership is where cached-free and inactive-split counters live.
PYALLOC_INLINE void DeviceAllocator::insert_free(Block* block) {
  const size_t bytes = block->size;
  const bool split = bytes != block->segment->size;
  const StatType t = block->pool->stat;
  block->pool->free_blocks.insert(block);
  cached_free_bytes_ += bytes;
  if (split) {
    stats_.inactive_split.increase(t, 1);
    stats_.inactive_split_bytes.increase(t, static_cast<int64_t>(bytes));
  }
}

PYALLOC_INLINE void DeviceAllocator::erase_free(Block* block) {
  const size_t bytes = block->size;
  const bool split = bytes != block->segment->size;
  const StatType t = block->pool->stat;
  block->pool->free_blocks.erase(block);
  cached_free_bytes_ -= bytes;
  if (split) {
    stats_.inactive_split.decrease(t, 1);
    stats_.inactive_split_bytes.decrease(t, static_cast<int64_t>(bytes));
  }
}

}  // namespace pyalloc
