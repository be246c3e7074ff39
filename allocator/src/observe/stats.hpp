// stats.hpp: counters in the shape of torch.cuda.memory_stats().
//
// PyTorch reports each statistic as {current, peak, allocated, freed} for
// three stat types: all, small pool, large pool. The fast path changes a few
// of them on every malloc and free, so they are kept in the cheapest form
// that still yields all four figures exactly (Note [Counters]).
//
// Note [Counters]
// A Counter keeps, for the small and the large pool, `current`, `peak` and
// `decreased` (the sum of decreases since the last reset_accumulated()).
//   - freed is `decreased`; allocated (the sum of increases) is derived:
//       allocated = freed + (current - current_at_reset),
//     where current_at_reset is current when accumulation last restarted.
//     The sum is kept on the decrease side because increase() already has
//     the peak checks to do: increase() stores one word unless it sets a
//     peak, decrease() two.
//   - "all" is derived: current, allocated and freed are sums of the two
//     pools. Its peak is not (a sum of peaks is not a peak), so increase()
//     also raises the all-pool peak from the new sum.
// Active blocks are not counted separately (DeviceStats::active): a block is
// active while allocated or pending-free, so active = allocation + pending,
// and `pending` changes only on the record_stream path. See DeviceStats.
//
// The allocator changes counters only at its state transitions (segment
// created/released, block handed out/returned, made pending, free-set
// insert/erase): see DeviceAllocator. check() recomputes every current value
// from a walk (types.hpp I7).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "blocks/types.hpp"

namespace pyalloc {

class JsonWriter;

// The four figures PyTorch reports for one statistic and stat type.
struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;
  int64_t freed = 0;
};

using StatView = std::array<Stat, kNumStatTypes>;  // indexed by StatType

class Counter {
 public:
  // `t` is kStatSmall or kStatLarge: "all" follows by itself.
  void increase(StatType t, int64_t n) {
    Figures& f = by_type_[t];
    const int64_t now = f.current + n;
    f.current = now;
    if (now > f.peak) f.peak = now;
    const int64_t all = current(kStatAll);
    if (all > by_type_[kStatAll].peak) by_type_[kStatAll].peak = all;
  }
  void decrease(StatType t, int64_t n) {
    Figures& f = by_type_[t];
    f.current -= n;
    f.decreased += n;
  }

  int64_t current(StatType t) const {
    return t == kStatAll ? by_type_[kStatSmall].current + by_type_[kStatLarge].current : by_type_[t].current;
  }
  Stat get(StatType t) const;
  StatView view() const;

  void reset_peak();
  void reset_accumulated();

 private:
  struct Figures {
    int64_t current = 0;
    int64_t peak = 0;
    int64_t decreased = 0;  // since current_at_reset was taken
    int64_t current_at_reset = 0;
  };
  // Indexed by StatType, so that the fast path finds a pool's figures of
  // every counter from one base address. by_type_[kStatAll] keeps only the
  // peak: the other "all" figures are sums over the two pools.
  Figures by_type_[kNumStatTypes];
};

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
  Counter allocation, segment, inactive_split;
  Counter allocated_bytes, reserved_bytes, inactive_split_bytes, requested_bytes;
  // Blocks freed by the caller but still in use on another stream. Changed
  // only on the record_stream path (make_pending, reclaim_pending).
  Counter pending, pending_bytes;

  // active = allocation + pending, and active only increases on malloc, so:
  //   active.allocated = allocation.allocated
  //   active.freed     = (allocation.freed - pending.allocated) + pending.freed
  //                      (frees that completed at once, plus pending ones that
  //                      completed: each counted since the last reset)
  //   active.peak      = max(allocation.peak, active_peak)
  // where active_peak is raised by note_active_peaks() on every malloc made
  // while something is pending: when nothing is pending, active equals
  // allocation, whose own peak covers it.
  StatView active() const { return active_view(allocation, pending, active_peak); }
  StatView active_bytes() const { return active_view(allocated_bytes, pending_bytes, active_bytes_peak); }
  bool any_pending() const { return (pending.current(kStatSmall) | pending.current(kStatLarge)) != 0; }
  void note_active_peaks();

  int64_t num_alloc_retries = 0;     // ladder step 1 ran (cache released and retried)
  int64_t num_ooms = 0;              // requests that failed after the whole ladder
  int64_t num_sync_all_streams = 0;  // pending frees synchronized to release memory
  int64_t num_device_alloc = 0;      // backend segment allocations
  int64_t num_device_free = 0;       // backend segment releases
  int64_t num_pressure_callbacks = 0;         // ladder step 3 invocations
  int64_t pressure_callback_freed_bytes = 0;  // bytes step 3 reported freed
  int64_t num_daemon_requests = 0;            // ladder step 4: requests answered by gpumemd
  int64_t daemon_freed_bytes = 0;             // bytes gpumemd had other processes release
  int64_t num_stitches = 0;     // ladder step 2: requests served by remapping free granules
  int64_t stitched_bytes = 0;   // bytes of granules step 2 moved
  int64_t num_shared_granules = 0;  // granules step 2 mapped a second time (Note [Shared granules])
  int64_t num_moved_granules = 0;   // granules step 4b gave back by moving live bytes (Note [Moving slivers])
  int64_t moved_bytes = 0;          // bytes step 4b copied
  int64_t num_merged_groups = 0;    // of num_moved_granules, by merging a group of twins (Note [Groups of twins])
  int64_t num_reuses = 0;        // growths that took cached free granules before new ones (Note [Reuse before growing])
  int64_t reused_bytes = 0;      // bytes of granules those growths moved
  int64_t num_sliver_indexes = 0;   // arenas' sliver indexes built, near a full device (Note [Sliver index])
  int64_t num_plans = 0;         // iteration plans adopted (Note [Iteration plans])
  int64_t num_plan_drops = 0;    // plans dropped: the sequence changed, or memory ran short
  int64_t plan_served = 0;       // allocations placed by a plan
  int64_t plan_misses = 0;       // allocations that did not match the plan, or found its place taken
  int64_t lifetime_long = 0;     // allocations predicted long-lived, placed in the long pool

  // Bad calls, counted and refused (state unchanged).
  int64_t num_invalid_free = 0;     // pointer not allocated here
  int64_t num_invalid_double_free = 0;  // pointer of a block already free
  int64_t num_invalid_size = 0;     // free size != malloc size, or absurd malloc size
  int64_t num_invalid_free_stream = 0;  // free stream != malloc stream

  OomRecord last_oom;

  void reset_peaks();
  void reset_accumulated();
  // The members of a flat JSON object, with torch.cuda.memory_stats() key
  // names plus pyalloc's own.
  void write_fields(JsonWriter& w, int64_t num_invalid_device, int64_t num_invalid_record_stream) const;

 private:
  static StatView active_view(const Counter& held, const Counter& pending, const int64_t (&peak)[kNumStatTypes]);

  int64_t active_peak[kNumStatTypes] = {};
  int64_t active_bytes_peak[kNumStatTypes] = {};
};

}  // namespace pyalloc
