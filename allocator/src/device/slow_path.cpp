// slow_path.cpp: a request the cache cannot serve, and giving memory back.
//
// Note [Pressure ladder]
// A request that finds no cached block goes to malloc_slow(), which climbs
// until one step yields a block:
//   0. reclaim pending frees whose events completed, and grow: a new segment
//      from the backend, or with arenas new granules mapped where the
//      request fits best (Note [Arenas] in arena.cpp), within
//      memory_fraction's limit;
//   1. synchronize pending frees, release every wholly free plain segment of
//      this device, and grow again (counted in num_alloc_retries);
//   2. stitch (arenas only): unmap granules lying wholly inside free blocks
//      anywhere on the device, after their streams are synchronized, and map
//      them where the request needs them (counted in num_stitches);
//   3. call the registered pressure callbacks (the offload manager swaps or
//      drops tensors), WITHOUT the device lock, then retry steps 0-2;
//   4. ask gpumemd to have other processes trim (DeviceHooks::ask_daemon,
//      also without the lock), then retry steps 0-2;
//   4b. move (arenas only): copy the live end of a granule into another
//      granule whose live part lies elsewhere in it, map that one in its
//      place and give the first back, pair by pair (Note [Moving slivers]
//      in move.cpp; counted in num_moved_granules), and stitch again;
//   5. fail: count the OOM, record it in the trace and stats, and return
//      nullptr with a report naming reserved, allocated, the largest free
//      block, fragmentation and the biggest live blocks.
// Steps 3 and 4 drop the lock, so the state may change meanwhile; every
// retry starts again from the free set.

#include <algorithm>
#include <cstdio>

#include "device/device_allocator.hpp"
#include "device/fast_path.hpp"
#include "ground/last_error.hpp"

namespace pyalloc {

namespace {

// Releases a held device lock for a scope, and takes it back on leaving it,
// exception or not: the caller's guard still owns the lock.
class Unlocked {
 public:
  explicit Unlocked(DeviceMutex& m) : m_(m) { m_.unlock(); }
  ~Unlocked() { m_.lock(); }
  Unlocked(const Unlocked&) = delete;
  Unlocked& operator=(const Unlocked&) = delete;

 private:
  DeviceMutex& m_;
};

}  // namespace

// ---- the pressure ladder -------------------------------------------------------------

__attribute__((noinline, cold)) Block* DeviceAllocator::malloc_slow(Pool& pool, size_t size, size_t rounded,
                                                                    StreamId stream, int* status) {
  reclaim_pending(false);
  // A dormant planner watches again once the cache keeps missing.
  if (planning_ && !(divert_ & kDivertPlanner) && planner_.wake()) observe();
  Block* block = find_or_grow(pool, rounded, stream);
  if (block == nullptr) {  // step 1: nothing changed since find_or_grow failed, so release first
    ++stats_.num_alloc_retries;
    block = release_and_retry(pool, rounded, stream);
  }
  if (block == nullptr) block = stitch(pool, rounded, stream);  // step 2
  size_t callback_freed = 0;
  size_t daemon_freed = 0;
  if (block == nullptr) {  // step 3
    ++stats_.num_pressure_callbacks;
    {
      Unlocked unlocked(mutex_);
      callback_freed = hooks_.run_pressure_callbacks(device_, rounded);
    }
    if (divert_ & kDivertRetired) return *status = PYALLOC_EBUSY, nullptr;
    stats_.pressure_callback_freed_bytes += static_cast<int64_t>(callback_freed);
    block = retry_after_outside_help(pool, rounded, stream);
  }
  if (block == nullptr) {  // step 4
    bool answered;
    {
      Unlocked unlocked(mutex_);
      answered = hooks_.ask_daemon(device_, rounded, &daemon_freed);
    }
    if (divert_ & kDivertRetired) return *status = PYALLOC_EBUSY, nullptr;
    if (answered) {
      ++stats_.num_daemon_requests;
      stats_.daemon_freed_bytes += static_cast<int64_t>(daemon_freed);
    }
    if (daemon_freed > 0) block = retry_after_outside_help(pool, rounded, stream);
  }
  if (block == nullptr && plan_region_ != nullptr) {  // a plan never costs an OOM the cache avoids
    drop_plan();
    block = retry_after_outside_help(pool, rounded, stream);
  }
  if (block == nullptr) block = move_and_retry(pool, rounded, stream);  // step 4b
  if (block == nullptr) {  // step 5
    ++stats_.num_ooms;
    trace_.record_oom(size, stream, trace_.capacity() ? backend_->mem_info(device_).free_bytes : 0);
    *status = PYALLOC_ENOMEM;
    const std::string report = oom_report(size, rounded, stream, callback_freed, daemon_freed);
    if (oom_report_) std::fprintf(stderr, "pyalloc: %s\n", report.c_str());
    set_last_error(report);
    return nullptr;
  }
  return block;
}

Block* DeviceAllocator::find_or_grow(Pool& pool, size_t rounded, StreamId stream) {
  if (Block* b = pool.free_blocks.best_fit(stream, rounded)) return b;
  return grow(pool, rounded, stream);
}

Block* DeviceAllocator::release_and_retry(Pool& pool, size_t rounded, StreamId stream) {
  synchronize_pending();
  if (Block* b = pool.free_blocks.best_fit(stream, rounded)) return b;
  if (release_free_segments(0) == 0) return nullptr;
  return grow(pool, rounded, stream);
}

// Steps 3 and 4 ran without the lock: what others freed may fit as it is, or
// leave room to grow, before the cache has to go.
Block* DeviceAllocator::retry_after_outside_help(Pool& pool, size_t rounded, StreamId stream) {
  if (Block* b = find_or_grow(pool, rounded, stream)) return b;
  if (Block* b = release_and_retry(pool, rounded, stream)) return b;
  return stitch(pool, rounded, stream);
}

// ---- growing -------------------------------------------------------------------------

Block* DeviceAllocator::grow(Pool& pool, size_t rounded, StreamId stream) {
  if (pool.in_arenas) return grow_arena(pool, rounded, stream, /*stitch=*/false);
  Segment* segment = alloc_segment(pool, segment_size_for(pool, rounded), stream);
  return segment != nullptr ? segment->head : nullptr;
}

// A plain segment of `size` bytes from the backend, within memory_fraction's
// limit: one free block, in the pool's free set.
Segment* DeviceAllocator::alloc_segment(Pool& pool, size_t size, StreamId stream) {
  const size_t reserved = static_cast<size_t>(stats_.reserved_bytes.current(kStatAll));
  if (size > reserved_limit() || reserved > reserved_limit() - size) return nullptr;
  uintptr_t addr = 0;
  if (!succeeded(backend_->segment_alloc(device_, size, &addr))) return nullptr;
  Segment* segment = add_segment(pool, stream, addr, size, BlockState::kFree);
  stats_.reserved_bytes.increase(pool.stat, static_cast<int64_t>(size));
  ++stats_.num_device_alloc;
  trace_.record(TraceAction::kSegmentAlloc, addr, size, stream);
  insert_free(segment->head);
  reserved_changed();
  return segment;
}

// A segment of `size` bytes at `base`, tiled by one block in `head_state`
// (free for a plain segment, a hole for an arena), filed and counted.
Segment* DeviceAllocator::add_segment(Pool& pool, StreamId stream, uintptr_t base, size_t size,
                                      BlockState head_state) {
  Segment* segment = new Segment;
  segment->base = base;
  segment->size = size;
  segment->pool = &pool;
  segment->stream = stream;
  segment->id = next_segment_id_++;
  Block* block = new_block();
  block->addr = base;
  block->size = size;
  block->segment = segment;
  block->pool = &pool;
  block->stream = stream;
  block->state = head_state;
  segment->head = block;
  segments_.emplace(base, segment);
  stats_.segment.increase(pool.stat, 1);
  return segment;
}

// Whether a backend call succeeded; if not, its message is kept for the OOM
// report.
bool DeviceAllocator::succeeded(const Status& s) {
  if (!s.ok) last_backend_error_ = s.message;
  return s.ok;
}

// ---- frees pending on other streams (record_stream) -----------------------------------

__attribute__((noinline, cold)) void DeviceAllocator::make_pending(Block* block) {
  if (!block->uses.empty()) breaks_capture();  // records events
  PendingFree pending{block, {}, false};
  record_pending_events(&pending);
  block->state = BlockState::kPendingFree;
  pending_.push_back(std::move(pending));
  const StatType t = block->pool->stat;
  stats_.pending.increase(t, 1);
  stats_.pending_bytes.increase(t, static_cast<int64_t>(block->size));
}

// An event on each stream the block was used on, after the work queued there.
void DeviceAllocator::record_pending_events(PendingFree* pending) {
  for (StreamId s : pending->block->uses) {
    EventHandle event = 0;
    if (!succeeded(backend_->event_record(device_, s, &event))) {
      // Without an event we can never know the stream is done with this
      // memory: keep it out of circulation rather than risk reuse.
      pending->stuck = true;
      continue;
    }
    pending->events.push_back(event);
  }
  pending->block->uses.clear();
}

size_t DeviceAllocator::reclaim_pending(bool synchronize) {
  if (capturing_ > 0) return 0;  // an event query would break the capture (Note [Capture])
  size_t reclaimed = 0;
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (!it->events.empty()) breaks_capture();
    bool done = !it->stuck;
    for (EventHandle e : it->events) {
      if (synchronize) {
        backend_->event_synchronize(device_, e);
      } else if (!backend_->event_query(device_, e)) {
        done = false;
        break;
      }
    }
    if (!done) {
      ++it;
      continue;
    }
    for (EventHandle e : it->events) backend_->event_release(device_, e);
    Block* block = it->block;
    it = pending_.erase(it);
    reclaimed += block->size;
    const StatType t = block->pool->stat;
    stats_.pending.decrease(t, 1);
    stats_.pending_bytes.decrease(t, static_cast<int64_t>(block->size));
    finish_free(block);
  }
  return reclaimed;
}

void DeviceAllocator::synchronize_pending() {
  if (pending_.empty() || capturing_ > 0) return;  // Note [Capture]
  ++stats_.num_sync_all_streams;
  reclaim_pending(true);
}

// ---- giving memory back -----------------------------------------------------------------

size_t DeviceAllocator::release_free_segments(size_t bytes) {
  if (capturing_ > 0) return 0;  // Note [Capture]: steps 3 and 4 may see a capture begin
  std::vector<Segment*> candidates;
  for (auto& entry : segments_) {
    const Segment* seg = entry.second;
    if (!seg->arena && seg->wholly_free() && seg != plan_region_ && !seg->pool->held) {
      candidates.push_back(entry.second);  // a held pool's memory stays (Note [Held pools])
    }
  }
  std::sort(candidates.begin(), candidates.end(), [](const Segment* a, const Segment* b) {
    // The longest free first: a wholly free segment is its one free block.
    return a->head->freed_at != b->head->freed_at ? a->head->freed_at < b->head->freed_at : a->id < b->id;
  });
  size_t released = 0;
  for (Segment* segment : candidates) {
    if (bytes != 0 && released >= bytes) break;
    released += segment->size;
    release_segment(segment);
  }
  return released;
}

void DeviceAllocator::release_segment(Segment* segment) {
  Block* block = segment->head;
  erase_free(block);
  const StatType t = segment->pool->stat;
  stats_.segment.decrease(t, 1);
  stats_.reserved_bytes.decrease(t, static_cast<int64_t>(segment->size));
  ++stats_.num_device_free;
  trace_.record(TraceAction::kSegmentFree, segment->base, segment->size, segment->stream);
  breaks_capture();
  backend_->segment_free(device_, segment->base, segment->size);
  reserved_changed();
  segments_.erase(segment->base);
  delete_block(block);
  delete segment;
}

size_t DeviceAllocator::release_cached_memory(size_t bytes) {
  size_t released = release_free_segments(bytes);
  if (bytes == 0 || released < bytes) released += release_arena_memory(bytes == 0 ? 0 : bytes - released);
  return released;
}

__attribute__((noinline, cold)) void DeviceAllocator::enforce_max_cached() {
  if (capturing_ > 0) return;  // Note [Capture]; end_capture enforces it
  // Releasing, oldest first, at least the excess brings the cache back under
  // the cap, as far as the cache is releasable (a free block that shares a
  // granule or segment with a live one stays).
  if (cached_free_bytes_ > max_cached_) release_cached_memory(cached_free_bytes_ - max_cached_);
}

size_t DeviceAllocator::empty_cache() {
  Lock lock(mutex_);
  if (capturing_ > 0) return 0;  // Note [Capture]
  synchronize_pending();
  drop_plan();  // its region goes too; observation starts over
  return release_cached_memory(0);
}

size_t DeviceAllocator::release_cached(size_t bytes) {
  Lock lock(mutex_);
  if (capturing_ > 0) return 0;  // Note [Capture]
  reclaim_pending(false);
  return release_cached_memory(bytes);
}

}  // namespace pyalloc
