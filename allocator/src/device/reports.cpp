// reports.cpp: what the device allocator tells: refused calls, the OOM
// report, the invariant walk, stats, snapshots and the usage figures.
// Counters, the walk and the JSON shapes are the observe layer's; this file
// reads them under the device lock.
#include <algorithm>
#include <cstdio>
#include <utility>

#include "device/device_allocator.hpp"
#include "device/fast_path.hpp"
#include "ground/json.hpp"
#include "ground/last_error.hpp"
#include "ground/text.hpp"
#include "observe/check.hpp"
#include "observe/snapshot.hpp"
#include "observe/usage.hpp"

namespace pyalloc {

// ---- bad calls -------------------------------------------------------------------------

__attribute__((noinline, cold)) FreeResult DeviceAllocator::refuse_size_mismatch(Block* block, size_t size) {
  ++stats_.num_invalid_size;
  set_last_error("pyalloc_free: size " + std::to_string(size) + " does not match the " +
                 std::to_string(block->requested) + " bytes allocated at " + hex(block->addr) + " on device " +
                 std::to_string(device_) + "; the block was not freed");
  return FreeResult::kSizeMismatch;
}

__attribute__((noinline, cold)) FreeResult DeviceAllocator::refuse_stream_mismatch(Block* block, StreamId stream) {
  ++stats_.num_invalid_free_stream;
  set_last_error("pyalloc_free: stream " + hex(stream) + " is not stream " + hex(block->stream) + " that the block at " +
                 hex(block->addr) + " on device " + std::to_string(device_) +
                 " was allocated on; the block was not freed (free it with its own stream, after "
                 "pyalloc_record_stream for a use on another one)");
  return FreeResult::kStreamMismatch;
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

// ---- out of memory -------------------------------------------------------------------

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
  if (capturing_ > 0) {  // Note [Capture]: no ladder
    r += ". A CUDA graph capture is under way, during which pyalloc neither releases nor moves cached memory: "
         "warm up before capturing, or empty the cache first.";
  } else {
    r += ". Released the cache and retried; pressure callbacks freed " + format_bytes(callback_freed);
    if (daemon_freed) r += "; other processes freed " + format_bytes(daemon_freed);
    r += ".";
  }
  if (!last_backend_error_.empty()) r += " Backend said: " + last_backend_error_;
  return r;
}

// ---- the invariant walk ----------------------------------------------------------------

// observe/check.cpp walks the blocks (I1..I9, I13, I14); the pools' rules of
// this device (I11, I12) travel in the view, and its own invariants follow.
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
  heap.whole_counted = whole_counted_;
  heap.free_whole_granules = granule_ != 0 ? free_whole_bytes_ / granule_ : 0;
  heap.frees = frees_;
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
  // The fast path never meets an indexed arena (Note [Sliver index]).
  bool indexed = false;
  for (const Pool* pool : std::as_const(*this).pools()) {
    for (const Segment* arena : pool->arenas) indexed = indexed || arena->indexed;
  }
  if (indexed != ((divert_ & kDivertSlivers) != 0)) {
    return fail("I14", indexed ? "an arena's sliver index is on but the fast path is not diverted"
                               : "the fast path is diverted for sliver indexes but none is on");
  }
  for (const Pool* pool : std::as_const(*this).pools()) {
    if (pool->held && !pool->arenas.empty()) return fail("I15", "held pool " + pool->name + " has an arena");
  }
  if (capturing_ == 0) {
    for (const PendingFree& p : pending_) {
      if (p.deferred) return fail("I15", "a free is deferred for a capture but none is under way");
    }
  }
  if (capture_violations_ != 0) {
    return fail("I15", std::to_string(capture_violations_) + " backend calls that break a capture (a release, an "
                       "unmap, an event recorded, queried or synchronized) were made while one was under way");
  }
  if ((capturing_ > 0) != ((divert_ & kDivertCapture) != 0)) {
    return fail("I15", capturing_ > 0 ? "a capture is under way but the fast path is not diverted"
                                      : "the fast path is diverted for a capture but none is under way");
  }
  return true;
}

// ---- stats and snapshots -----------------------------------------------------------------

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

DeviceAllocator::MemoryInfo DeviceAllocator::memory_info() {
  Lock lock(mutex_);
  const MemInfo device = backend_->mem_info(device_);
  MemoryInfo m;
  m.device_total = device_total();
  m.device_free = device.free_bytes;
  m.reserved = static_cast<size_t>(stats_.reserved_bytes.current(kStatAll));
  m.allocated = static_cast<size_t>(stats_.allocated_bytes.current(kStatAll));
  m.limit = std::min(reserved_limit(), m.device_total);
  m.largest_cached = largest_free_block();
  const size_t room = m.reserved < m.limit ? std::min(m.limit - m.reserved, m.device_free) : 0;
  m.largest_request = std::max(m.largest_cached, room);
  return m;
}

std::string DeviceAllocator::stats_json(int64_t num_invalid_device, int64_t num_invalid_record_stream) {
  Lock lock(mutex_);
  JsonWriter w;
  w.begin_object();
  stats_.write_fields(w, num_invalid_device, num_invalid_record_stream);
  const BackendMeter& meter = backend_->meter(device_);  // Note [Backend time]
  w.key("backend_memory_calls").value(meter.memory_calls.load(std::memory_order_relaxed));
  w.key("backend_memory_ns").value(meter.memory_ns.load(std::memory_order_relaxed));
  w.key("backend_waits").value(meter.waits.load(std::memory_order_relaxed));
  w.key("backend_wait_ns").value(meter.wait_ns.load(std::memory_order_relaxed));
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
  backend_->meter(device_).reset();
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

}  // namespace pyalloc
