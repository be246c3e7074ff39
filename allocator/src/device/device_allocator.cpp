// device_allocator.cpp: the caching allocator of one device.
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
//   5. fail: count the OOM, record it in the trace and stats, and return
//      nullptr with a report naming reserved, allocated, the largest free
//      block, fragmentation and the biggest live blocks.
// Steps 3 and 4 drop the lock, so the state may change meanwhile; every
// retry starts again from the free set.
#include "device/device_allocator.hpp"
#include "device/device_allocator_inl.hpp"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <utility>

#include "ground/json.hpp"
#include "pyalloc/pyalloc.h"
#include "ground/last_error.hpp"
#include "ground/text.hpp"
#include "observe/check.hpp"
#include "observe/snapshot.hpp"
#include "observe/usage.hpp"


namespace pyalloc {

DeviceAllocator::DeviceAllocator(int device, const Config& config, Backend* backend,
                                 DeviceHooks& hooks)
    : device_(device),
      backend_(backend),
      hooks_(hooks),
      small_segment_(config.small_segment),
      large_segment_(config.large_segment),
      largest_small_(config.vmm_mode() == VmmMode::kShared ? 0 : kSmallRequest),
      vmm_(config.vmm_mode()),
      planning_(config.plan),
      placing_lifetimes_(config.lifetime),
      small_pool_(PoolKind::kSmall, 0, "small"),
      large_pool_(PoolKind::kLarge, 0, "large"),
      plan_pool_(PoolKind::kPlan, 0, "plan"),
      long_pool_(PoolKind::kLong, 0, "long") {
  small_pool_.in_arenas = vmm_ == VmmMode::kAll;
  large_pool_.in_arenas = vmm_ != VmmMode::kOff;
  long_pool_.in_arenas = vmm_ != VmmMode::kOff;
  apply_settings(config);
  if (planning_) observe();
  if (placing_lifetimes_) divert_ |= kDivertLifetime;
}

DeviceAllocator::~DeviceAllocator() {
  // Host-side bookkeeping only: no backend call (see Note [Shutdown]).
  for (auto& entry : segments_) {
    Block* b = entry.second->head;
    while (b != nullptr) {
      Block* next = b->next;
      delete b;
      b = next;
    }
    delete entry.second;
  }
  for (Block* b : spare_blocks_) delete b;
}

void DeviceAllocator::apply_settings(const Config& config) {
  Lock lock(mutex_);
  memory_fraction_ = config.memory_fraction;
  max_cached_ = config.max_cached;
  round_power2_ = config.round_power2;
  oom_report_ = config.oom_report;
  sharing_ = config.share;
  update_share_from();
  if (trace_.capacity() != config.trace) trace_.resize(config.trace);
  if (cached_free_bytes_ > max_cached_) enforce_max_cached();
}

void DeviceAllocator::set_memory_fraction(double fraction) {
  Lock lock(mutex_);
  memory_fraction_ = fraction;
  update_share_from();
}

// 95% of what the device, or the memory fraction, lets this allocator reserve
// (Note [Shared granules]); never without sharing or arenas, or when the
// backend reports no total. Measured on the stress suite against 80%, 90% and
// 98% (docs/benchmarks/2026-11-22-shared-granules-cpu.md).
void DeviceAllocator::update_share_from() {
  const size_t limit = std::min(reserved_limit(), device_total());
  share_from_ = sharing_ && vmm_ != VmmMode::kOff && limit != 0 ? limit / 20 * 19 : SIZE_MAX;
}

// ---- sizes and pools (the fast path's share is in device_allocator_inl.hpp) -----------

Pool& DeviceAllocator::user_pool(int pool_id) {
  const size_t index = static_cast<size_t>(pool_id - 1);
  if (index >= user_pools_.size()) user_pools_.resize(index + 1);
  if (!user_pools_[index]) {
    user_pools_[index] = std::make_unique<Pool>(PoolKind::kUser, pool_id, hooks_.pool_name(pool_id));
    user_pools_[index]->in_arenas = vmm_ != VmmMode::kOff;
  }
  return *user_pools_[index];
}

size_t DeviceAllocator::segment_size_for(const Pool& pool, size_t rounded) const {
  if (pool.kind == PoolKind::kSmall || rounded <= kSmallRequest) return small_segment_;
  if (rounded < large_segment_ / 2) return large_segment_;
  return round_up_to(rounded, kLargeRound);
}

// Asked lazily: on cuda, asking creates the device's context, which a
// process must not pay for devices it never uses.
size_t DeviceAllocator::device_total() {
  if (device_total_ == 0) device_total_ = backend_->mem_info(device_).total_bytes;
  return device_total_;
}

size_t DeviceAllocator::reserved_limit() {
  if (memory_fraction_ >= 1.0) return SIZE_MAX;
  return static_cast<size_t>(memory_fraction_ * static_cast<double>(device_total()));
}

// ---- the fast path -------------------------------------------------------------

bool DeviceAllocator::record_stream(uintptr_t addr, StreamId stream) {
  Lock lock(mutex_);
  auto* entry = live_.find(addr);
  if (entry == nullptr) return false;
  Block* block = entry->value;
  // Use on the allocation stream is already ordered; nothing to wait for.
  if (stream != block->stream &&
      std::find(block->uses.begin(), block->uses.end(), stream) == block->uses.end()) {
    block->uses.push_back(stream);
  }
  return true;
}

bool DeviceAllocator::free_neighbours(uintptr_t addr, size_t* below, size_t* above) {
  Lock lock(mutex_);
  auto* entry = live_.find(addr);
  if (entry == nullptr) return false;
  const Block* block = entry->value;
  // Free neighbours are already coalesced (I2): one block on each side at most.
  *below = block->prev != nullptr && block->prev->is_free() ? block->prev->size : 0;
  *above = block->next != nullptr && block->next->is_free() ? block->next->size : 0;
  return true;
}

void DeviceAllocator::count_invalid_size() {
  Lock lock(mutex_);
  ++stats_.num_invalid_size;
}

// ---- the slow path -----------------------------------------------------------------

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

// Whether a backend call succeeded; if not, its message is kept for the OOM
// report.
bool DeviceAllocator::succeeded(const Status& s) {
  if (!s.ok) last_backend_error_ = s.message;
  return s.ok;
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

__attribute__((noinline, cold)) void DeviceAllocator::make_pending(Block* block) {
  PendingFree pending{block, {}, false};
  for (StreamId s : block->uses) {
    EventHandle event = 0;
    if (!succeeded(backend_->event_record(device_, s, &event))) {
      // Without an event we can never know the stream is done with this
      // memory: keep it out of circulation rather than risk reuse.
      pending.stuck = true;
      continue;
    }
    pending.events.push_back(event);
  }
  block->uses.clear();
  block->state = BlockState::kPendingFree;
  pending_.push_back(std::move(pending));
  const StatType t = block->pool->stat;
  stats_.pending.increase(t, 1);
  stats_.pending_bytes.increase(t, static_cast<int64_t>(block->size));
}

size_t DeviceAllocator::reclaim_pending(bool synchronize) {
  size_t reclaimed = 0;
  for (auto it = pending_.begin(); it != pending_.end();) {
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
  if (pending_.empty()) return;
  ++stats_.num_sync_all_streams;
  reclaim_pending(true);
}

size_t DeviceAllocator::release_free_segments(size_t bytes) {
  std::vector<Segment*> candidates;
  for (auto& entry : segments_) {
    const Segment* seg = entry.second;
    if (!seg->arena && seg->wholly_free() && seg != plan_region_) candidates.push_back(entry.second);
  }
  std::sort(candidates.begin(), candidates.end(), [](const Segment* a, const Segment* b) {
    return a->free_since != b->free_since ? a->free_since < b->free_since : a->id < b->id;
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
  // Releasing, oldest first, at least the excess brings the cache back under
  // the cap, as far as the cache is releasable (a free block that shares a
  // granule or segment with a live one stays).
  if (cached_free_bytes_ > max_cached_) release_cached_memory(cached_free_bytes_ - max_cached_);
}

size_t DeviceAllocator::empty_cache() {
  Lock lock(mutex_);
  synchronize_pending();
  drop_plan();  // its region goes too; observation starts over
  return release_cached_memory(0);
}

size_t DeviceAllocator::release_cached(size_t bytes) {
  Lock lock(mutex_);
  reclaim_pending(false);
  return release_cached_memory(bytes);
}

// ---- bad calls and reports ------------------------------------------------------------

__attribute__((noinline, cold)) FreeResult DeviceAllocator::refuse_size_mismatch(Block* block, size_t size) {
  ++stats_.num_invalid_size;
  set_last_error("pyalloc_free: size " + std::to_string(size) + " does not match the " +
                 std::to_string(block->requested) + " bytes allocated at " + hex(block->addr) + " on device " +
                 std::to_string(device_) + "; the block was not freed");
  return FreeResult::kSizeMismatch;
}

__attribute__((noinline, cold)) FreeResult DeviceAllocator::classify_bad_free(uintptr_t addr) {
  const std::string where = hex(addr) + " on device " + std::to_string(device_);
  auto it = segments_.upper_bound(addr);
  if (it != segments_.begin()) {
    const Segment* segment = std::prev(it)->second;
    if (addr < segment->base + segment->size) {
      for (const Block* b = segment->head; b != nullptr; b = b->next) {
        if (b->addr == addr && (b->state == BlockState::kFree || b->state == BlockState::kPendingFree)) {
          ++stats_.num_invalid_double_free;
          set_last_error("pyalloc_free: double free of " + where + " (the block is already free)");
          return FreeResult::kDoubleFree;
        }
      }
      ++stats_.num_invalid_free;
      set_last_error("pyalloc_free: " + where + " is inside a segment but is not the start of a live allocation");
      return FreeResult::kUnknownPointer;
    }
  }
  ++stats_.num_invalid_free;
  set_last_error("pyalloc_free: " + where + " was not allocated by pyalloc");
  return FreeResult::kUnknownPointer;
}

std::vector<Pool*> DeviceAllocator::pools() {
  std::vector<Pool*> out = {&small_pool_, &large_pool_, &long_pool_, &plan_pool_};
  for (const auto& pool : user_pools_) {
    if (pool) out.push_back(pool.get());
  }
  return out;
}

std::vector<const Pool*> DeviceAllocator::pools() const {
  const std::vector<Pool*> all = const_cast<DeviceAllocator*>(this)->pools();
  return {all.begin(), all.end()};
}

size_t DeviceAllocator::largest_free_block() const {
  size_t largest = 0;
  for (const Pool* pool : pools()) pool->free_blocks.for_each([&](const Block* b) { largest = std::max(largest, b->size); });
  return largest;
}

std::string DeviceAllocator::oom_report(size_t size, size_t rounded, StreamId stream,
                                        size_t callback_freed, size_t daemon_freed) {
  const size_t reserved = static_cast<size_t>(stats_.reserved_bytes.current(kStatAll));
  const size_t allocated = static_cast<size_t>(stats_.allocated_bytes.current(kStatAll));
  const size_t largest = largest_free_block();
  const size_t limit = reserved_limit();
  const double fragmentation =
      cached_free_bytes_ == 0 ? 0.0 : 1.0 - static_cast<double>(largest) / cached_free_bytes_;

  stats_.last_oom = OomRecord{static_cast<int64_t>(size),
                              static_cast<int64_t>(reserved),
                              static_cast<int64_t>(allocated),
                              static_cast<int64_t>(cached_free_bytes_),
                              static_cast<int64_t>(largest),
                              limit == SIZE_MAX ? static_cast<int64_t>(device_total())
                                                : static_cast<int64_t>(limit)};

  std::vector<const Block*> live;
  live.reserve(live_.size());
  live_.for_each([&](uintptr_t, Block* b) { live.push_back(b); });
  const size_t top = std::min<size_t>(5, live.size());
  std::partial_sort(live.begin(), live.begin() + top, live.end(),
                    [](const Block* a, const Block* b) { return a->size > b->size; });

  char fr[32];
  std::snprintf(fr, sizeof fr, "%.1f%%", 100.0 * fragmentation);
  std::string r = "out of memory on device " + std::to_string(device_) + " (" + backend_->name() +
                  " backend): tried to allocate " + format_bytes(size);
  if (rounded != size) r += " (" + format_bytes(rounded) + " rounded)";
  r += " on stream " + hex(stream) + ". Device total " + format_bytes(device_total());
  if (limit != SIZE_MAX) r += ", memory_fraction limit " + format_bytes(limit);
  r += "; reserved " + format_bytes(reserved) + ", allocated " + format_bytes(allocated) +
       ", cached free " + format_bytes(cached_free_bytes_) + ", largest free block " +
       format_bytes(largest) + " (fragmentation " + fr + ")";
  if (!pending_.empty()) r += ", " + std::to_string(pending_.size()) + " frees pending on events";
  r += ". Biggest live blocks:";
  if (top == 0) r += " none";
  for (size_t i = 0; i < top; ++i) {
    r += (i ? ", " : " ") + format_bytes(live[i]->size) + " at " + hex(live[i]->addr);
  }
  r += ". Released the cache and retried; pressure callbacks freed " + format_bytes(callback_freed);
  if (daemon_freed) r += "; other processes freed " + format_bytes(daemon_freed);
  r += ".";
  if (!last_backend_error_.empty()) r += " Backend said: " + last_backend_error_;
  return r;
}

// ---- the invariant walk ----------------------------------------------------------------

// observe/check.cpp walks the blocks (I1..I9, I13); the pools' rules of this
// device (I11, I12) travel in the view, and its own invariants follow.
bool DeviceAllocator::check(std::string* error) {
  Lock lock(mutex_);
  HeapView heap;
  heap.device = device_;
  heap.granule = granule_;
  heap.segments = &segments_;
  heap.pools = std::as_const(*this).pools();
  heap.live = &live_;
  for (const PendingFree& p : pending_) heap.pending.push_back(p.block);
  heap.cached_free_bytes = cached_free_bytes_;
  heap.stats = &stats_;
  // A pool that serves nothing holds nothing: the long pool with placement
  // off (I11), the small pool with vmm=shared (I12).
  if (!placing_lifetimes_) {
    heap.rules.push_back({&long_pool_, 0, "I11", "the long pool holds a segment while lifetime-aware placement is off"});
  }
  heap.rules.push_back({&small_pool_, largest_small_, "I12", "the small pool holds a segment with vmm=shared"});
  if (!check_heap(heap, error)) return false;
  auto fail = [&](const char* invariant, const std::string& problem) {
    *error = "pyalloc_check: device " + std::to_string(device_) + ": " + invariant + ": " + problem;
    return false;
  };
  if (std::string problem; !check_plan(&problem)) return fail("I10", problem);
  if (std::string problem; !check_lifetimes(&problem)) return fail("I11", problem);
  return true;
}

// ---- stats, snapshots, reconfiguration ---------------------------------------------------

DeviceAllocator::Usage DeviceAllocator::usage() {
  Lock lock(mutex_);
  Usage u;
  u.reserved = static_cast<size_t>(stats_.reserved_bytes.current(kStatAll));
  u.allocated = static_cast<size_t>(stats_.allocated_bytes.current(kStatAll));
  u.active = static_cast<size_t>(stats_.active_bytes()[kStatAll].current);
  u.cached_free = cached_free_bytes_;
  u.largest_free = largest_free_block();
  u.peak_reserved = static_cast<size_t>(stats_.reserved_bytes.get(kStatAll).peak);
  u.num_ooms = static_cast<uint64_t>(stats_.num_ooms);
  u.num_alloc_retries = static_cast<uint64_t>(stats_.num_alloc_retries);
  u.allocations_total = static_cast<uint64_t>(stats_.allocation.get(kStatAll).allocated);
  return u;
}

std::string DeviceAllocator::stats_json(int64_t num_invalid_device, int64_t num_invalid_record_stream) {
  Lock lock(mutex_);
  JsonWriter w;
  w.begin_object();
  stats_.write_fields(w, num_invalid_device, num_invalid_record_stream);
  for (const PoolUsage& u : pool_usage(std::as_const(*this).pools(), segments_)) {
    const std::string prefix = "pool." + u.pool->name + ".";
    for (const auto& field : u.fields()) w.key((prefix + field.first).c_str()).value(field.second);
  }
  w.end_object();
  return w.str();
}

void DeviceAllocator::reset_peaks() {
  Lock lock(mutex_);
  stats_.reset_peaks();
}

void DeviceAllocator::reset_accumulated() {
  Lock lock(mutex_);
  stats_.reset_accumulated();
}

void DeviceAllocator::write_segments_json(JsonWriter& w) {
  Lock lock(mutex_);
  pyalloc::write_segments_json(w, device_, segments_);
}

void DeviceAllocator::write_pools_json(JsonWriter& w) {
  Lock lock(mutex_);
  pyalloc::write_pools_json(w, device_, pool_usage(std::as_const(*this).pools(), segments_));
}

void DeviceAllocator::write_trace_json(JsonWriter& w) {
  Lock lock(mutex_);
  trace_.write_json(w);
}

bool DeviceAllocator::retire_if_idle(int64_t* live_bytes) {
  Lock lock(mutex_);
  *live_bytes = stats_.allocated_bytes.current(kStatAll);
  if (live_.size() != 0 || !pending_.empty()) {
    // Pending frees finish on their own; only live allocations block.
    if (live_.size() == 0) {
      synchronize_pending();
    } else {
      return false;
    }
  }
  drop_plan();
  release_cached_memory(0);
  divert_ |= kDivertRetired;
  return true;
}

void DeviceAllocator::unretire() {
  Lock lock(mutex_);
  divert_ &= ~kDivertRetired;
}

}  // namespace pyalloc
