// usage.cpp: see usage.hpp.
#include "observe/usage.hpp"

#include <algorithm>

namespace pyalloc {

std::vector<PoolUsage> pool_usage(const std::vector<const Pool*>& all, const std::map<uintptr_t, Segment*>& segments) {
  std::vector<PoolUsage> usage(all.size());
  for (size_t i = 0; i < all.size(); ++i) usage[i].pool = all[i];
  auto slot = [&](const Pool* pool) { return static_cast<size_t>(std::find(all.begin(), all.end(), pool) - all.begin()); };
  for (const auto& seg_entry : segments) {
    const Segment* seg = seg_entry.second;
    PoolUsage& u = usage[slot(seg->pool)];
    u.segments += 1;
    u.reserved_bytes += static_cast<int64_t>(seg->reserved_bytes());
    for (const Block* b = seg->head; b != nullptr; b = b->next) {
      const int64_t size = static_cast<int64_t>(b->size);
      if (b->state == BlockState::kHole || b->state == BlockState::kLent) continue;
      if (b->state == BlockState::kFree) {
        u.cached_free_bytes += size;
        if (size > u.largest_free_bytes) u.largest_free_bytes = size;
        continue;
      }
      u.active_bytes += size;
      if (b->state == BlockState::kAllocated) {
        u.allocations += 1;
        u.allocated_bytes += size;
        u.requested_bytes += static_cast<int64_t>(b->requested);
      }
    }
  }
  return usage;
}

std::vector<std::pair<const char*, int64_t>> PoolUsage::fields() const {
  return {{"segments", segments},
          {"reserved_bytes", reserved_bytes},
          {"allocations", allocations},
          {"allocated_bytes", allocated_bytes},
          {"requested_bytes", requested_bytes},
          {"active_bytes", active_bytes},
          {"cached_free_bytes", cached_free_bytes},
          {"largest_free_bytes", largest_free_bytes}};
}

}  // namespace pyalloc
