// snapshot.cpp: see snapshot.hpp.
#include "observe/snapshot.hpp"

#include "ground/json.hpp"

namespace pyalloc {

namespace {

const char* block_state_name(BlockState s) {
  switch (s) {
    case BlockState::kAllocated: return "active_allocated";
    case BlockState::kPendingFree: return "active_pending_free";
    case BlockState::kFree: return "inactive";
    case BlockState::kHole: return "unmapped";  // never written: holes split an arena into segments
    case BlockState::kLent: return "lent";      // never written: lent blocks split it too
  }
  return "?";
}

}  // namespace

void write_segments_json(JsonWriter& w, int device, const std::map<uintptr_t, Segment*>& segments) {
  visit_segments(segments, [&](const SnapshotSegment& s) {
    const Segment* seg = s.segment;
    w.begin_object();
    w.key("device").value(device);
    w.key("address").value(static_cast<uint64_t>(s.address));
    w.key("total_size").value(s.total);
    w.key("allocated_size").value(s.allocated);
    w.key("active_size").value(s.active);
    w.key("requested_size").value(s.requested);
    w.key("stream").value(static_cast<uint64_t>(seg->stream));
    w.key("segment_type").value(seg->pool->kind == PoolKind::kSmall ? "small" : "large");
    w.key("segment_pool_id").begin_array().value(0).value(seg->pool->id).end_array();
    w.key("pool").value(seg->pool->name);
    w.key("is_expandable").value(seg->arena);
    w.key("frames").begin_array().end_array();
    w.key("blocks").begin_array();
    for (const Block* b = s.first; b != s.end; b = b->next) {
      w.begin_object();
      w.key("address").value(static_cast<uint64_t>(b->addr));
      w.key("size").value(static_cast<uint64_t>(b->size));
      w.key("requested_size").value(static_cast<uint64_t>(b->requested));
      w.key("state").value(block_state_name(b->state));
      w.key("frames").begin_array().end_array();
      w.end_object();
    }
    w.end_array();
    w.end_object();
  });
}

void write_pools_json(JsonWriter& w, int device, const std::vector<PoolUsage>& usage) {
  for (const PoolUsage& u : usage) {
    w.begin_object();
    w.key("device").value(device);
    w.key("pool").value(u.pool->name);
    w.key("pool_id").value(u.pool->id);
    for (const auto& field : u.fields()) w.key(field.first).value(field.second);
    w.end_object();
  }
}

}  // namespace pyalloc
