// plan.hpp: learning a repeated allocation sequence, planning its offsets,
// and matching requests against the plan.
//
// SequenceLearner, plan_offsets() and Planner are pure bookkeeping: no
// allocator, no backend, no lock of their own (the device lock covers them).
// The device allocator makes the plan's region and carves planned blocks out
// of it (device/placement.cpp), as Note [Iteration plans] in plan.cpp
// describes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "backends/backend.hpp"

namespace pyalloc {

// One allocation of the repeated sequence, at its position in the period.
struct PlanSlot {
  size_t size = 0;         // rounded bytes
  StreamId stream = 0;
  uint64_t lifetime = 0;   // allocations made while it lives (<= the period)
  bool planned = false;    // false: left to the cache (see plan_offsets)
  size_t offset = 0;       // from the plan region's base, when planned
};

// Watches the default pools' allocations in order and finds a period: a
// sequence of at least `min_period` allocations (by rounded size and
// stream) that just repeated, whose allocations are (nearly all) freed
// before the same position comes round again. Allocation numbers ("the
// clock") count every observed allocation from 0.
class SequenceLearner {
 public:
  static constexpr size_t kWindow = 8;           // allocations hashed to find a candidate period
  static constexpr size_t kMinPeriod = 8;
  static constexpr size_t kMaxPeriod = 4096;     // planning is O(period^2)
  static constexpr size_t kHistory = size_t{1} << 16;  // allocations remembered before starting over

  void reset();
  // Records the next allocation; returns its number.
  uint64_t on_alloc(size_t rounded, StreamId stream);
  // Records the free of allocation `number` (ignored unless it is remembered).
  void on_free(uint64_t number);
  uint64_t clock() const { return start_ + history_.size(); }
  bool full() const { return history_.size() >= kHistory; }

  // After on_alloc(): true when the last three periods are identical and their
  // allocations are short-lived enough to plan. Then slots() describes the
  // period whose position 0 is the next allocation.
  bool ready() const { return ready_; }
  std::vector<PlanSlot> slots() const;

 private:
  static constexpr uint64_t kLive = UINT64_MAX;
  struct Event {
    size_t size;
    StreamId stream;
    uint64_t freed_at;  // the clock when it was freed; kLive while live
  };
  bool same(size_t i, size_t j) const {
    return history_[i].size == history_[j].size && history_[i].stream == history_[j].stream;
  }
  uint64_t window_hash(size_t last) const;
  bool plannable(size_t first) const;  // the periods starting at history index `first`
  uint64_t lifetime(size_t k) const;
  uint64_t slot_lifetime(size_t first, size_t k) const;

  uint64_t start_ = 0;            // the clock of history_[0]
  std::vector<Event> history_;
  std::unordered_map<uint64_t, size_t> seen_;  // window hash -> history index of its last allocation
  size_t period_ = 0;             // candidate period, 0 = none
  size_t run_ = 0;                // consecutive allocations equal to the one a period before
  bool ready_ = false;
};

// Assigns offsets to the planned slots, greedy by size as static planners
// do: biggest first, each at the lowest offset where it overlaps no placed
// slot that is live at the same time. Lifetimes wrap round the period (the
// sequence repeats). Returns the plan's size in bytes.
size_t plan_offsets(std::vector<PlanSlot>& slots);

// The planner's state machine (Note [Iteration plans]): observing, dormant,
// or a plan in force. It decides; the device allocator acts: it diverts
// requests to the planner while observing or planning, makes and drops the
// region, and carves the blocks.
class Planner {
 public:
  static constexpr size_t kResync = 4;               // plan positions skipped to find a request
  static constexpr size_t kMaxRunMisses = 32;        // requests in a row that match nothing
  static constexpr uint64_t kWakeAfterMisses = 1024; // cache misses before a dormant planner observes again

  // (Re)starts observation: the sequence is learnt afresh, no plan in force.
  void observe();
  bool in_force() const { return !plan_.empty(); }

  // ---- observing ----
  // Records a default-pool request before the cache serves it; returns its
  // number (keep it with the block for on_free).
  uint64_t on_alloc(size_t rounded, StreamId stream) { return learner_.on_alloc(rounded, stream); }
  // The block of request `number` was freed (or the request failed).
  void on_free(uint64_t number) {
    if (!in_force()) learner_.on_free(number);
  }
  enum class Outcome { kWatching, kAdopted, kDormant };
  // After a request was recorded and served: adopts the plan once the
  // learner is ready; goes dormant when the learner gave up (then the device
  // stops diverting requests until wake() says so).
  Outcome after_alloc();
  // A dormant planner counts the cache's misses: true once it should observe
  // again.
  bool wake();

  // ---- a plan in force ----
  // The region is made at the plan's start position (the quietest one).
  bool at_region_start() const { return plan_pos_ == 0; }
  size_t region_bytes() const { return plan_bytes_; }
  StreamId region_stream() const;
  // A request matched against the plan: found when it is one of the next
  // kResync + 1 positions (the plan moves past it), with its slot; drop when
  // the misses counted now say the plan should go; `misses` is how many were
  // counted.
  struct Match {
    bool found = false;
    PlanSlot slot;
    bool period_ended = false;  // the plan wrapped round to its start position
    bool drop = false;
    size_t misses = 0;
  };
  Match match(size_t rounded, StreamId stream);
  // Counts `n` misses (a planned place still taken); true when the plan
  // should go: more than max(2, period/16) in this period, or more than
  // kMaxRunMisses requests in a row matched nothing.
  bool note_miss(size_t n);
  // Ends the plan in force; observation starts again with observe().
  void drop() { plan_.clear(); }
  // Whether every planned slot lies within `bytes` of the region's base (I10).
  bool fits(size_t bytes) const;

 private:
  SequenceLearner learner_;
  std::vector<PlanSlot> plan_;  // empty: observing (or dormant); else the plan in force
  size_t plan_bytes_ = 0;       // the plan's size
  size_t plan_pos_ = 0;         // the position the next request should match
  size_t misses_ = 0;           // in the current period
  size_t run_misses_ = 0;       // requests in a row that matched nothing
  uint64_t wait_ = 0;           // dormant: cache misses before observing again
};

}  // namespace pyalloc
