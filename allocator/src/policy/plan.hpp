// plan.hpp: learning a repeated allocation sequence, and planning its offsets.
//
// SequenceLearner and plan_offsets() are pure bookkeeping: no allocator, no
// backend, no lock of their own (the device lock covers them). The allocator
// uses them as Note [Iteration plans] in plan.cpp describes.
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

}  // namespace pyalloc
