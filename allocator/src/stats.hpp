// stats.hpp: counters in the shape of torch.cuda.memory_stats().
//
// Each Stat is {current, peak, allocated, freed}: `allocated` and `freed`
// accumulate increases and decreases, so current == allocated - freed until
// reset_accumulated(). A StatArray holds one Stat per stat type (all, small
// pool, large pool); update() keeps "all" equal to the sum of the others.
//
// The allocator changes these only at its state transitions (segment
// created/released, block handed out/returned, free-set insert/erase): see
// DeviceAllocator. check() recomputes every current value from a walk.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "types.hpp"

namespace pyalloc {

struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;
  int64_t freed = 0;

  void increase(int64_t n) {
    current += n;
    allocated += n;
    if (current > peak) peak = current;
  }
  void decrease(int64_t n) {
    current -= n;
    freed += n;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = freed = 0; }
};

using StatArray = std::array<Stat, kNumStatTypes>;

inline void stat_increase(StatArray& a, StatType t, int64_t n) {
  a[kStatAll].increase(n);
  a[t].increase(n);
}
inline void stat_decrease(StatArray& a, StatType t, int64_t n) {
  a[kStatAll].decrease(n);
  a[t].decrease(n);
}

// Facts about the most recent OOM, flattened into the stats as last_oom.*.
struct OomRecord {
  int64_t request_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t allocated_bytes = 0;
  int64_t cached_free_bytes = 0;
  int64_t largest_free_bytes = 0;
  int64_t limit_bytes = 0;
};

struct DeviceStats {
  StatArray allocation, segment, active, inactive_split;
  StatArray allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes;

  int64_t num_alloc_retries = 0;     // ladder step 1 ran (cache released and retried)
  int64_t num_ooms = 0;              // requests that failed after the whole ladder
  int64_t num_sync_all_streams = 0;  // pending frees synchronized to release memory
  int64_t num_device_alloc = 0;      // backend segment allocations
  int64_t num_device_free = 0;       // backend segment releases
  int64_t num_pressure_callbacks = 0;         // ladder step 3 invocations
  int64_t pressure_callback_freed_bytes = 0;  // bytes step 3 reported freed
  int64_t num_daemon_requests = 0;            // ladder step 4: requests answered by gpumemd
  int64_t daemon_freed_bytes = 0;             // bytes gpumemd had other processes release

  // Bad calls, counted and refused (state unchanged).
  int64_t num_invalid_free = 0;     // pointer not allocated here
  int64_t num_invalid_double_free = 0;  // pointer of a block already free
  int64_t num_invalid_size = 0;     // free size != malloc size, or absurd malloc size

  OomRecord last_oom;

  void reset_peaks();
  void reset_accumulated();
  // Flat JSON with torch.cuda.memory_stats() key names plus pyalloc's own.
  std::string to_json(int64_t num_invalid_device, int64_t num_invalid_record_stream) const;
};

}  // namespace pyalloc
