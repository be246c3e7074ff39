// usage.hpp: what each pool holds, from a walk of the segments.
//
// Per-pool figures are not counters: the fast path pays nothing for them.
// stats_json (pool.<name>.<figure>) and the snapshot's "pools" entries read
// them from this walk, under the device lock.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "blocks/types.hpp"

namespace pyalloc {

struct PoolUsage {
  const Pool* pool = nullptr;
  int64_t segments = 0;
  int64_t reserved_bytes = 0;
  int64_t allocations = 0;
  int64_t allocated_bytes = 0;
  int64_t requested_bytes = 0;
  int64_t active_bytes = 0;  // allocated + pending-free
  int64_t cached_free_bytes = 0;
  int64_t largest_free_bytes = 0;

  // The figures by name, in the order stats and snapshots write them.
  std::vector<std::pair<const char*, int64_t>> fields() const;
};

// One PoolUsage per pool of `pools`, in that order, summed over `segments`.
std::vector<PoolUsage> pool_usage(const std::vector<const Pool*>& pools,
                                  const std::map<uintptr_t, Segment*>& segments);

}  // namespace pyalloc
