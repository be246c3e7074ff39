// trace.cpp: the event ring.
#include "observe/trace.hpp"

#include <chrono>

#include "ground/json.hpp"

namespace pyalloc {

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

const char* trace_action_name(TraceAction action) {
  switch (action) {
    case TraceAction::kAlloc: return "alloc";
    case TraceAction::kFreeRequested: return "free_requested";
    case TraceAction::kFreeCompleted: return "free_completed";
    case TraceAction::kSegmentAlloc: return "segment_alloc";
    case TraceAction::kSegmentFree: return "segment_free";
    case TraceAction::kSegmentMap: return "segment_map";
    case TraceAction::kSegmentUnmap: return "segment_unmap";
    case TraceAction::kOom: return "oom";
  }
  return "?";
}

void TraceRing::resize(size_t capacity) {
  events_.assign(capacity, TraceEvent{});
  events_.shrink_to_fit();
  capacity_ = capacity;
  next_ = 0;
  total_ = 0;
}

void TraceRing::record_slow(TraceAction action, uintptr_t addr, size_t size, StreamId stream,
                            size_t device_free) {
  events_[next_] = TraceEvent{action, addr, size, stream, now_ns(), device_free};
  next_ = (next_ + 1) % events_.size();
  ++total_;
}

void TraceRing::write_json(JsonWriter& w) const {
  w.begin_array();
  const size_t n = total_ < events_.size() ? static_cast<size_t>(total_) : events_.size();
  const size_t first = total_ < events_.size() ? 0 : next_;
  for (size_t i = 0; i < n; ++i) {
    const TraceEvent& e = events_[(first + i) % events_.size()];
    w.begin_object();
    w.key("action").value(trace_action_name(e.action));
    if (e.action == TraceAction::kOom) {
      w.key("device_free").value(static_cast<uint64_t>(e.device_free));  // PyTorch: no addr on OOM
    } else {
      w.key("addr").value(static_cast<uint64_t>(e.addr));
    }
    w.key("size").value(static_cast<uint64_t>(e.size));
    w.key("stream").value(static_cast<uint64_t>(e.stream));
    w.key("time_us").value(static_cast<uint64_t>(e.time_ns / 1000));
    w.key("frames").begin_array().end_array();
    w.end_object();
  }
  w.end_array();
}

}  // namespace pyalloc
