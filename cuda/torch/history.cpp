// history.cpp: Note [Memory history under PyTorch] (history.hpp).
#include "history.hpp"

#include "pools.hpp"

#include <pyalloc/pyalloc.h>

#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>

namespace pyalloc::torch_layer {

using c10::CachingDeviceAllocator::BlockInfo;
using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::SegmentInfo;

History& History::instance() {
  static History* h = new History;  // leaked: allocations may be freed during interpreter shutdown
  return *h;
}

void History::configure(bool enabled, c10::CachingDeviceAllocator::CreateContextFn recorder, size_t max_entries,
                        RecordContext when, bool clear) {
  std::lock_guard<std::mutex> lock(mutex_);
  recorder_ = enabled ? recorder : nullptr;
  when_ = enabled ? when : RecordContext::NEVER;
  max_entries_ = enabled ? max_entries : 0;
  if (clear || !enabled) traces_.clear();
  if (!enabled) live_.clear();
  recording_.store(enabled, std::memory_order_relaxed);
}

// Called with mutex_ held.
History::Context History::capture(RecordContext at_least) {
  if (recorder_ == nullptr || static_cast<int>(when_) < static_cast<int>(at_least)) return nullptr;
  return recorder_();
}

// Called with mutex_ held.
void History::append(int device, TraceEntry entry) {
  if (max_entries_ == 0) return;
  std::deque<TraceEntry>& ring = traces_[device];
  if (ring.size() == max_entries_) ring.pop_front();
  ring.push_back(std::move(entry));
}

void History::on_alloc(int device, void* ptr, size_t size, void* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  Context context = capture(RecordContext::STATE);
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  if (context) live_[addr] = context;
  if (static_cast<int>(when_) >= static_cast<int>(RecordContext::ALLOC)) {
    append(device, TraceEntry(TraceEntry::ALLOC, static_cast<c10::DeviceIndex>(device), addr, size, stream, {0, 0},
                              c10::getApproximateTime(), context));
  }
}

void History::on_free(int device, void* ptr, size_t size, void* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  live_.erase(addr);
  if (static_cast<int>(when_) >= static_cast<int>(RecordContext::ALLOC)) {
    Context context = capture(RecordContext::ALL);
    const auto dev = static_cast<c10::DeviceIndex>(device);
    append(device, TraceEntry(TraceEntry::FREE_REQUESTED, dev, addr, size, stream, {0, 0}, c10::getApproximateTime(),
                              context));
    append(device, TraceEntry(TraceEntry::FREE_COMPLETED, dev, addr, size, stream, {0, 0}, c10::getApproximateTime(),
                              context));
  }
}

void History::on_oom(int device, size_t size, size_t device_free, void* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (static_cast<int>(when_) < static_cast<int>(RecordContext::ALLOC)) return;
  append(device, TraceEntry(TraceEntry::OOM, static_cast<c10::DeviceIndex>(device), device_free, size, stream, {0, 0},
                            c10::getApproximateTime(), capture(RecordContext::ALLOC)));
}

namespace {

struct Walk {
  int device;
  std::vector<SegmentInfo> segments;
  std::vector<uintptr_t> addresses;  // of each block, in the order added
};

void add_segment(const pyalloc_segment_info_t* s, void* user) {
  auto* walk = static_cast<Walk*>(user);
  SegmentInfo info;
  info.device = static_cast<c10::DeviceIndex>(walk->device);
  info.address = s->address;
  info.total_size = s->total_size;
  info.requested_size = s->requested_size;
  info.allocated_size = s->allocated_size;
  info.active_size = s->active_size;
  info.stream = s->stream;
  info.is_large = s->is_large != 0;
  info.is_expandable = s->is_expandable != 0;
  info.owner_private_pool_id = {0, static_cast<unsigned long long>(s->pool_id)};  // pyalloc's, for now
  walk->segments.push_back(std::move(info));
}

void add_block(const pyalloc_block_info_t* b, void* user) {
  auto* walk = static_cast<Walk*>(user);
  BlockInfo info;
  info.size = b->size;
  info.requested_size = b->requested_size;
  info.allocated = b->allocated != 0;
  info.active = b->active != 0;
  walk->segments.back().blocks.push_back(std::move(info));
  walk->addresses.push_back(b->address);
}

}  // namespace

History::Context History::context_of(const void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = live_.find(reinterpret_cast<uintptr_t>(ptr));
  return it == live_.end() ? nullptr : it->second;
}

std::vector<SegmentInfo> History::segments(int device) {
  Walk walk{device, {}, {}};
  // The walk runs under pyalloc's lock; contexts are attached after it, under
  // this one (on_alloc takes this lock with pyalloc's not held: no cycle).
  const int status = pyalloc_snapshot_walk(device, add_segment, add_block, &walk);
  TORCH_CHECK(status == PYALLOC_OK, "pyalloc: ", pyalloc_last_error());
  // PyTorch's ids of the private pools, read after the walk: Pools calls
  // into pyalloc under its own lock, so it must not be taken under pyalloc's.
  for (SegmentInfo& segment : walk.segments) {
    segment.owner_private_pool_id = Pools::instance().key_of(static_cast<int>(segment.owner_private_pool_id.second));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  size_t i = 0;
  for (SegmentInfo& segment : walk.segments) {
    for (BlockInfo& block : segment.blocks) {
      const auto it = block.allocated ? live_.find(walk.addresses[i]) : live_.end();
      if (it != live_.end()) block.context_when_allocated = it->second;
      ++i;
    }
  }
  return std::move(walk.segments);
}

std::vector<std::vector<History::TraceEntry>> History::traces(int devices) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<TraceEntry>> out(static_cast<size_t>(std::max(devices, 0)));
  for (int d = 0; d < devices; ++d) {
    if (recording()) {
      append(d, TraceEntry(TraceEntry::SNAPSHOT, static_cast<c10::DeviceIndex>(d), 0, 0, nullptr, {0, 0},
                           c10::getApproximateTime()));
    }
    const auto it = traces_.find(d);
    if (it != traces_.end()) out[d].assign(it->second.begin(), it->second.end());
  }
  return out;
}

}  // namespace pyalloc::torch_layer
