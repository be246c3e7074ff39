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

// The snapshot's "segments" entries of one device.
void write_segments_json(JsonWriter& w, int device, const std::map<uintptr_t, Segment*>& segments);
// The snapshot's "pools" entries (pyalloc's own): one object per pool.
void write_pools_json(JsonWriter& w, int device, const std::vector<PoolUsage>& usage);

}  // namespace pyalloc
