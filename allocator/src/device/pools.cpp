// pools.cpp: held pools and captures, what CUDA graphs need of a device.
//
// Note [Held pools]
// A CUDA graph's kernels keep the addresses its capture saw: every replay
// writes to the blocks the capture allocated, including those it freed again
// during the capture (their memory is reused by later kernels of the same
// graph). So while a graph lives, its pool's memory must stay where it is,
// free blocks included: never released, unmapped or remapped, and never
// handed to a request outside the pool. PyTorch gives each graph (and each
// torch.cuda.MemPool) a private pool with a use count; the torch-facing layer
// (cuda/torch/pools.cpp) maps each to a user pool of pyalloc and holds it
// while the count is above zero.
//   - Blocks of a user pool are only ever handed to requests of that pool
//     (select_pool), and a freed block goes back to its own pool.
//   - A held pool grows by plain segments, never in an arena: an arena's free
//     granules may be unmapped and mapped elsewhere (stitching, sharing), and
//     a plain segment's memory never moves. A pool that already has arena
//     memory cannot be held (hold_pool refuses).
//   - empty_cache, max_cached and the pressure ladder skip the wholly free
//     segments of a held pool (release_free_segments); only release_pool, the
//     pool's own emptying (torch.cuda.MemPool's destructor,
//     emptyCache(mempool_id)), gives them back.
// Letting a pool go (use count zero) makes its wholly free segments
// releasable like any other; its live blocks stay valid and come back to it
// when freed.
//
// Note [Capture]
// Between cudaStreamBeginCapture and cudaStreamEndCapture, work queued on the
// capturing stream is recorded, not run, and in the default capture mode many
// CUDA calls on any thread invalidate the capture: a synchronization, an
// event query, a free of device memory. Allocating new memory is allowed
// (the torch-facing layer switches the calling thread to the relaxed capture
// mode around it, as PyTorch does around cudaMalloc). So between
// begin_capture and end_capture a device only serves from its cache and
// grows (malloc_capturing), on every stream and in every pool:
//   - no pending free is reclaimed (an event query) or synchronized, and no
//     memory is released, unmapped, stitched, shared or reused (Note [Reuse
//     before growing] in arena.cpp); empty_cache and
//     release_cached do nothing; a request the cache and growth cannot serve
//     fails (the OOM report says why) instead of climbing the ladder;
//   - a free that would need the backend (a block used on other streams,
//     whose events must be recorded on those streams; a block in an arena,
//     which may part shared granules) is deferred: the block stays pending,
//     out of every free set, until end_capture records its events (after the
//     capture, an event is no longer part of the graph) and reclaims it; an
//     import of another process's memory closed meanwhile is unmapped then.
// The calls that would break a capture are counted where they are made
// (breaks_capture); pyalloc_check fails if any was made during one (I15).
// A free of a plain segment's block used on its own stream only is the
// cache's business and goes on as always: that is how a graph reuses the
// memory its capture freed.

#include <cstdio>

#include "device/device_allocator.hpp"
#include "device/fast_path.hpp"
#include "ground/last_error.hpp"

namespace pyalloc {

// ---- held pools ----------------------------------------------------------------------

bool DeviceAllocator::hold_pool(int pool_id, bool held, std::string* error) {
  Lock lock(mutex_);
  Pool& pool = user_pool(pool_id);
  if (held && !pool.arenas.empty()) {
    *error = "pool " + std::to_string(pool_id) + " (" + pool.name + ") already has virtual-memory arenas on device " +
             std::to_string(device_) + "; a pool must be held before its first allocation";
    return false;
  }
  pool.held = held;
  if (held) pool.in_arenas = false;
  return true;
}

size_t DeviceAllocator::release_pool(int pool_id, size_t* still_reserved) {
  Lock lock(mutex_);
  *still_reserved = 0;
  if (pool_id < 1 || static_cast<size_t>(pool_id) > user_pools_.size() || !user_pools_[pool_id - 1]) return 0;
  Pool* pool = user_pools_[pool_id - 1].get();
  size_t released = 0;
  if (!capturing_ && !pool->arenas.empty()) {  // its free granules, then arenas left with none mapped
    released = unmap_free_granules(SIZE_MAX, 0, 0, nullptr, pool) * granule_;
    std::vector<Segment*> empty;
    for (Segment* a : pool->arenas) {
      if (a->mapped == 0) empty.push_back(a);
    }
    for (Segment* a : empty) release_arena(a);
  }
  std::vector<Segment*> releasable;
  for (auto& entry : segments_) {
    Segment* seg = entry.second;
    if (seg->pool != pool) continue;
    if (!capturing_ && !seg->arena && seg->wholly_free()) {
      releasable.push_back(seg);
    } else {
      *still_reserved += seg->reserved_bytes();  // an arena: mapped bytes less what its twins map twice
    }
  }
  for (Segment* seg : releasable) {
    released += seg->size;
    release_segment(seg);
  }
  return released;
}

// ---- captures ------------------------------------------------------------------------

void DeviceAllocator::begin_capture() {
  Lock lock(mutex_);
  if (capturing_++ == 0) divert_ |= kDivertCapture;
}

bool DeviceAllocator::end_capture() {
  Lock lock(mutex_);
  if (capturing_ == 0) return false;
  if (--capturing_ > 0) return true;
  divert_ &= static_cast<uint8_t>(~kDivertCapture);
  for (PendingFree& pending : pending_) {
    if (!pending.deferred) continue;
    record_pending_events(&pending);
    pending.deferred = false;
  }
  reclaim_pending(false);  // the deferred frees that needed no event finish now
  for (uintptr_t base : closing_) unmap_import(base);
  closing_.clear();
  if (cached_free_bytes_ > max_cached_) enforce_max_cached();
  return true;
}

void* DeviceAllocator::take_cached(int pool_id, size_t size, StreamId stream) {
  Lock lock(mutex_);
  if (divert_ & kDivertRetired) return nullptr;
  if (divert_ & kDivertSlivers) drop_sliver_indexes(false);
  const size_t rounded = round_size(size);
  Pool& pool = select_pool(rounded, pool_id);
  Block* block = pool.free_blocks.best_fit(stream, rounded);
  return block != nullptr ? take_fit(pool, block, size, rounded) : nullptr;
}

// Hands out `block`, a free block of `pool` that fits, starting a request of
// whole granules on a granule boundary (Note [Whole granules]), as
// alloc_block does.
void* DeviceAllocator::take_fit(Pool& pool, Block* block, size_t size, size_t rounded) {
  if (pool.in_arenas) block = align_to_granule(block, rounded);
  return take(pool, block, size, rounded);
}

// The general path's malloc during a capture: the cache, else growth, else
// an OOM; no ladder (Note [Capture]).
void* DeviceAllocator::malloc_capturing(Pool& pool, size_t size, size_t rounded, StreamId stream, int* status) {
  Block* block = pool.free_blocks.best_fit(stream, rounded);
  if (block == nullptr) block = grow(pool, rounded, stream);
  if (block == nullptr) {
    ++stats_.num_ooms;
    *status = PYALLOC_ENOMEM;
    const std::string report = oom_report(size, rounded, stream, 0, 0);
    if (oom_report_) std::fprintf(stderr, "pyalloc: %s\n", report.c_str());
    set_last_error(report);
    return nullptr;
  }
  return take_fit(pool, block, size, rounded);
}

// A free during a capture that needs the backend waits for end_capture.
__attribute__((noinline, cold)) void DeviceAllocator::defer_free(Block* block) {
  block->state = BlockState::kPendingFree;
  PendingFree pending{block, {}, false};
  pending.deferred = true;
  pending_.push_back(std::move(pending));
  const StatType t = block->pool->stat;
  stats_.pending.increase(t, 1);
  stats_.pending_bytes.increase(t, static_cast<int64_t>(block->size));
}

}  // namespace pyalloc
