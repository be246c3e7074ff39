// snapshot.cpp: segments and blocks in the format of torch.cuda.memory._snapshot().
//
// PyTorch's tools (python -m torch.cuda._memory_viz) read the pickled dict;
// the field names and block states below are theirs.
#include "device_allocator.hpp"
#include "json.hpp"

namespace pyalloc {

namespace {

const char* block_state_name(BlockState s) {
  switch (s) {
    case BlockState::kAllocated: return "active_allocated";
    case BlockState::kPendingFree: return "active_pending_free";
    case BlockState::kFree: return "inactive";
  }
  return "?";
}

}  // namespace

void DeviceAllocator::write_segments_json(JsonWriter& w) {
  Lock lock(mutex_);
  for (const auto& entry : segments_) {
    const Segment* seg = entry.second;
    uint64_t allocated = 0, active = 0, requested = 0;
    for (const Block* b = seg->head; b != nullptr; b = b->next) {
      if (b->state == BlockState::kAllocated) allocated += b->size;
      if (b->state != BlockState::kFree) {
        active += b->size;
        requested += b->requested;
      }
    }
    w.begin_object();
    w.key("device").value(device_);
    w.key("address").value(static_cast<uint64_t>(seg->base));
    w.key("total_size").value(static_cast<uint64_t>(seg->size));
    w.key("allocated_size").value(allocated);
    w.key("active_size").value(active);
    w.key("requested_size").value(requested);
    w.key("stream").value(static_cast<uint64_t>(seg->stream));
    w.key("segment_type").value(seg->pool->kind == PoolKind::kSmall ? "small" : "large");
    w.key("segment_pool_id").begin_array().value(0).value(seg->pool->id).end_array();
    w.key("pool").value(seg->pool->name);
    w.key("is_expandable").value(false);
    w.key("frames").begin_array().end_array();
    w.key("blocks").begin_array();
    for (const Block* b = seg->head; b != nullptr; b = b->next) {
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

void DeviceAllocator::write_pools_json(JsonWriter& w) {
  Lock lock(mutex_);
  for (const PoolUsage& u : pool_usage_locked()) {
    w.begin_object();
    w.key("device").value(device_);
    w.key("pool").value(u.pool->name);
    w.key("pool_id").value(u.pool->id);
    for (const auto& field : u.fields()) w.key(field.first).value(field.second);
    w.end_object();
  }
}

}  // namespace pyalloc
