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

// One snapshot segment per plain segment, and per mapped run of an arena
// (blocks between holes and lent blocks), marked is_expandable as PyTorch
// marks its own virtual-memory segments: PyTorch's tools expect every block
// of a segment to be backed, and a lent block's bytes are another block's
// (Note [Shared granules]), so the segments sum to reserved.
void write_segments_json(JsonWriter& w, int device, const std::map<uintptr_t, Segment*>& segments) {
  for (const auto& entry : segments) {
    const Segment* seg = entry.second;
    const Block* b = seg->head;
    while (b != nullptr) {
      if (b->state == BlockState::kHole || b->state == BlockState::kLent) {
        b = b->next;
        continue;
      }
      const Block* first = b;
      const Block* end = b;
      uint64_t total = 0, allocated = 0, active = 0, requested = 0;
      for (; end != nullptr && end->state != BlockState::kHole && end->state != BlockState::kLent; end = end->next) {
        total += end->size;
        if (end->state == BlockState::kAllocated) allocated += end->size;
        if (end->state != BlockState::kFree) {
          active += end->size;
          requested += end->requested;
        }
      }
      w.begin_object();
      w.key("device").value(device);
      w.key("address").value(static_cast<uint64_t>(first->addr));
      w.key("total_size").value(total);
      w.key("allocated_size").value(allocated);
      w.key("active_size").value(active);
      w.key("requested_size").value(requested);
      w.key("stream").value(static_cast<uint64_t>(seg->stream));
      w.key("segment_type").value(seg->pool->kind == PoolKind::kSmall ? "small" : "large");
      w.key("segment_pool_id").begin_array().value(0).value(seg->pool->id).end_array();
      w.key("pool").value(seg->pool->name);
      w.key("is_expandable").value(seg->arena);
      w.key("frames").begin_array().end_array();
      w.key("blocks").begin_array();
      for (; b != end; b = b->next) {
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
    }
  }
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
