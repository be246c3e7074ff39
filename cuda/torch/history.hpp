// history.hpp: torch.cuda.memory._record_memory_history under pyalloc.
//
// Note [Memory history under PyTorch]
// PyTorch's recordHistory hands its allocator a context recorder: a function
// that captures the calling thread's Python (and C++) stack as a
// GatheredContext. PyTorch's own allocator calls it on each allocation, keeps
// the context with the block (a snapshot's "frames") and in a ring of trace
// entries; torch.cuda.memory._snapshot() then asks snapshot() for both, and
// PyTorch turns the contexts into frames that memory_viz shows. This class
// does the same around pyalloc: the torch-facing allocator calls on_alloc and
// on_free around the C ABI (only while recording: one relaxed load
// otherwise), and snapshot segments come from pyalloc_snapshot_walk with
// each allocated block's context attached by address.
//
// c10 only (no CUDA header): the CPU build of PyTorch has these types, and the
// tests drive the history through torch.ops.pyalloc.
#pragma once

#include <c10/core/CachingDeviceAllocator.h>

#include <atomic>
#include <cstddef>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace pyalloc::torch_layer {

class History {
 public:
  using Context = std::shared_ptr<c10::GatheredContext>;
  using TraceEntry = c10::CachingDeviceAllocator::TraceEntry;

  static History& instance();

  // CUDAAllocator::recordHistory: starts (or stops, enabled false) recording;
  // `max_entries` bounds each device's trace ring; `clear` drops what was
  // recorded so far.
  void configure(bool enabled, c10::CachingDeviceAllocator::CreateContextFn recorder, size_t max_entries,
                 c10::CachingDeviceAllocator::RecordContext when, bool clear);
  bool recording() const { return recording_.load(std::memory_order_relaxed); }

  void on_alloc(int device, void* ptr, size_t size, void* stream);
  void on_free(int device, void* ptr, size_t size, void* stream);
  void on_oom(int device, size_t size, size_t device_free, void* stream);

  // The context recorded with live allocation `ptr` (getContextForPointer),
  // or null.
  Context context_of(const void* ptr);

  // The snapshot's segments of `device`, with each allocated block's context.
  std::vector<c10::CachingDeviceAllocator::SegmentInfo> segments(int device);
  // Each device's trace, oldest first, after a SNAPSHOT entry is added.
  std::vector<std::vector<TraceEntry>> traces(int devices);

 private:
  Context capture(c10::CachingDeviceAllocator::RecordContext at_least);
  void append(int device, TraceEntry entry);

  std::atomic<bool> recording_{false};
  std::mutex mutex_;
  c10::CachingDeviceAllocator::CreateContextFn recorder_ = nullptr;
  c10::CachingDeviceAllocator::RecordContext when_ = c10::CachingDeviceAllocator::RecordContext::NEVER;
  size_t max_entries_ = 0;
  std::map<uintptr_t, Context> live_;                // context of each live allocation
  std::map<int, std::deque<TraceEntry>> traces_;     // per device
};

}  // namespace pyalloc::torch_layer
