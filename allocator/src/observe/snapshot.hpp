// snapshot.hpp: segments and blocks in the format of torch.cuda.memory._snapshot().
//
// PyTorch's tools (python -m torch.cuda._memory_viz) read the pickled dict;
// the field names and block states are theirs. The device allocator calls
// these under its lock.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "blocks/types.hpp"
#include "observe/usage.hpp"

namespace pyalloc {

class JsonWriter;

// One snapshot segment (a plain segment, or a mapped run of an arena) and
// its blocks, as visit_segments hands them out.
struct SnapshotSegment {
  const Segment* segment;  // the segment or arena it lies in
  const Block* first;      // its first block; `end` is one past its last
  const Block* end;
  uintptr_t address;
  uint64_t total, allocated, active, requested;
};

// Calls fn(const SnapshotSegment&) for each snapshot segment, in address order.
template <typename F>
void visit_segments(const std::map<uintptr_t, Segment*>& segments, F fn);

// Whether a block of a snapshot segment counts as allocated or active
// (PyTorch's BlockInfo fields): active is allocated or waiting on events.
inline bool snapshot_allocated(const Block* b) { return b->state == BlockState::kAllocated; }
inline bool snapshot_active(const Block* b) { return b->state != BlockState::kFree; }

// The snapshot's "segments" entries of one device.
void write_segments_json(JsonWriter& w, int device, const std::map<uintptr_t, Segment*>& segments);
// The snapshot's "pools" entries (pyalloc's own): one object per pool.
void write_pools_json(JsonWriter& w, int device, const std::vector<PoolUsage>& usage);

// One snapshot segment per plain segment, and per mapped run of an arena
// (blocks between holes and lent blocks), marked is_expandable as PyTorch
// marks its own virtual-memory segments: PyTorch's tools expect every block
// of a segment to be backed, and a lent block's bytes are another block's
// (Note [Shared granules]), so the segments sum to reserved.
template <typename F>
void visit_segments(const std::map<uintptr_t, Segment*>& segments, F fn) {
  auto unbacked = [](const Block* b) { return b->state == BlockState::kHole || b->state == BlockState::kLent; };
  for (const auto& entry : segments) {
    const Segment* seg = entry.second;
    for (const Block* b = seg->head; b != nullptr;) {
      if (unbacked(b)) {
        b = b->next;
        continue;
      }
      SnapshotSegment s{seg, b, b, b->addr, 0, 0, 0, 0};
      for (; s.end != nullptr && !unbacked(s.end); s.end = s.end->next) {
        s.total += s.end->size;
        if (snapshot_allocated(s.end)) s.allocated += s.end->size;
        if (snapshot_active(s.end)) {
          s.active += s.end->size;
          s.requested += s.end->requested;
        }
      }
      fn(s);
      b = s.end;
    }
  }
}

}  // namespace pyalloc
