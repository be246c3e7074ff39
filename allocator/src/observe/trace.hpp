// trace.hpp: a fixed-size ring of allocator events, for snapshots.
//
// The action names are those of torch.cuda.memory._snapshot()'s
// device_traces, so PyTorch's _memory_viz reads them. Recording happens
// under the device lock; with capacity 0 (the default) record() is one
// predictable branch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backends/backend.hpp"
#include "ground/config.hpp"

namespace pyalloc {

class JsonWriter;

enum class TraceAction : uint8_t {
  kAlloc,
  kFreeRequested,
  kFreeCompleted,
  kSegmentAlloc,
  kSegmentFree,
  kSegmentMap,
  kSegmentUnmap,
  kOom,
};

const char* trace_action_name(TraceAction action);

struct TraceEvent {
  TraceAction action;
  uintptr_t addr;      // unused for kOom
  size_t size;
  StreamId stream;
  uint64_t time_ns;    // steady clock
  size_t device_free;  // kOom only: bytes the backend reported free
};

static_assert(sizeof(TraceEvent) == kTraceEventBytes, "ground/config.hpp's trace limit assumes this size");

class TraceRing {
 public:
  void resize(size_t capacity);  // drops recorded events
  size_t capacity() const { return capacity_; }
  bool on() const { return capacity_ != 0; }

  void record(TraceAction action, uintptr_t addr, size_t size, StreamId stream) {
    if (__builtin_expect(capacity_ == 0, 1)) return;
    record_slow(action, addr, size, stream, 0);
  }
  void record_oom(size_t size, StreamId stream, size_t device_free) {
    if (capacity_ == 0) return;
    record_slow(TraceAction::kOom, 0, size, stream, device_free);
  }

  // Oldest first, as a JSON array of PyTorch TraceEntry objects.
  void write_json(JsonWriter& w) const;

 private:
  void record_slow(TraceAction action, uintptr_t addr, size_t size, StreamId stream, size_t device_free);

  std::vector<TraceEvent> events_;
  size_t capacity_ = 0;  // == events_.size(), one load for record()
  size_t next_ = 0;      // slot of the next event
  uint64_t total_ = 0;   // events ever recorded
};

uint64_t now_ns();

}  // namespace pyalloc
