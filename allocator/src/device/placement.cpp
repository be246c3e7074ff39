// placement.cpp: the device allocator's side of its placement policies:
// lifetime-aware placement (Note [Lifetime-aware placement] in
// policy/lifetime.cpp) and iteration plans (Note [Iteration plans] in
// policy/plan.cpp). The policies decide (LifetimeLearner, Planner); this file
// routes default-pool requests to them, makes and drops the plan's region,
// and carves planned blocks out of it.
#include "device/device_allocator.hpp"
#include "device/fast_path.hpp"

namespace pyalloc {

// A default-pool request on the general path while lifetimes are placed or
// the planner is at work (divert_).
void* DeviceAllocator::malloc_default(Pool& pool, size_t size, size_t rounded, StreamId stream, int* status) {
  Block* block;
  if (placing_lifetimes_ && lifetimes_.predicts_long(rounded)) {
    block = alloc_block(long_pool_, size, rounded, stream, status);
    if (block != nullptr) ++stats_.lifetime_long;
  } else if (divert_ & kDivertPlanner) {
    block = malloc_watched(pool, size, rounded, stream, status);
  } else {
    block = alloc_block(pool, size, rounded, stream, status);
  }
  if (placing_lifetimes_) {
    const uintptr_t addr = block != nullptr ? block->addr : 0;
    const uint64_t number = lifetimes_.record(rounded, addr, [this](uintptr_t a, uint64_t n) {
      const auto* entry = live_.find(a);
      return entry != nullptr && entry->value->lifetime_number == n;
    });
    if (block != nullptr) block->lifetime_number = number;
  }
  return block != nullptr ? reinterpret_cast<void*>(block->addr) : nullptr;
}

// ---- iteration plans -------------------------------------------------------------------

void DeviceAllocator::observe() {
  planner_.observe();
  divert_ |= kDivertPlanner;
}

Block* DeviceAllocator::malloc_watched(Pool& pool, size_t size, size_t rounded, StreamId stream, int* status) {
  if (planner_.in_force()) return malloc_from_plan(pool, size, rounded, stream, status);
  const uint64_t number = planner_.on_alloc(rounded, stream);
  Block* block = alloc_block(pool, size, rounded, stream, status);
  if (block != nullptr) {
    block->born = number;
  } else {
    planner_.on_free(number);  // a failed request: as if freed at once, so the period still holds
  }
  if (planner_.after_alloc() == Planner::Outcome::kDormant) {
    divert_ &= ~kDivertPlanner;  // until the cache misses often (malloc_slow)
  }
  return block;
}

void DeviceAllocator::watch_free(Block* block) {
  const PoolKind kind = block->pool->kind;
  if (kind != PoolKind::kUser && kind != PoolKind::kLong) planner_.on_free(block->born);
}

// Serves a default-pool request while a plan is in force: matched requests
// count down to the plan's start position, where the region is made; after
// that a planned request is carved out of the region at its offset. Anything
// else goes to the cache at once.
Block* DeviceAllocator::malloc_from_plan(Pool& pool, size_t size, size_t rounded, StreamId stream, int* status) {
  if (plan_region_ == nullptr && planner_.at_region_start() && !start_plan_region()) {
    drop_plan();
    return alloc_block(pool, size, rounded, stream, status);
  }
  const Planner::Match m = planner_.match(rounded, stream);
  stats_.plan_misses += static_cast<int64_t>(m.misses);
  if (m.drop || (m.found && m.period_ended && plan_region_ == nullptr && !start_plan_region())) {
    drop_plan();
    return alloc_block(pool, size, rounded, stream, status);
  }
  // Slots before the region's start are served by the cache; after it, the
  // plan keeps every planned slot's place free when its turn comes.
  if (m.found && m.slot.planned && plan_region_ != nullptr) {
    if (Block* b = carve_planned(m.slot.offset, rounded)) {
      ++stats_.plan_served;
      take(plan_pool_, b, size, rounded);
      return b;
    }
    ++stats_.plan_misses;  // its place is still taken
    if (planner_.note_miss(1)) drop_plan();
  }
  return alloc_block(pool, size, rounded, stream, status);
}

// The region: a plain segment of the plan pool, made at the quietest
// position after the cache's wholly free memory is released.
bool DeviceAllocator::start_plan_region() {
  release_cached_memory(0);
  plan_region_ = alloc_segment(plan_pool_, round_up_to(planner_.region_bytes(), kLargeRound), planner_.region_stream());
  if (plan_region_ == nullptr) return false;
  ++stats_.num_plans;
  return true;
}

// A free block of the region starting at base + offset, at least `rounded`
// bytes, in the free set (take() splits off the rest); nullptr when part of
// that range is not free.
Block* DeviceAllocator::carve_planned(size_t offset, size_t rounded) {
  const uintptr_t addr = plan_region_->base + offset;
  Block* b = block_at(plan_region_, addr);  // planned slots lie inside the region (I10)
  if (!b->is_free() || b->addr + b->size < addr + rounded) return nullptr;
  // The free memory before the planned place stays free.
  return addr > b->addr ? split_free(b, addr - b->addr) : b;
}

// Ends the plan, if any: its region is no longer pinned (released when
// wholly free, like any segment), and observation starts again.
void DeviceAllocator::drop_plan() {
  if (plan_region_ != nullptr) {
    ++stats_.num_plan_drops;
    Segment* region = plan_region_;
    plan_region_ = nullptr;
    if (region->wholly_free()) release_segment(region);
  }
  planner_.drop();
  if (planning_) observe();
}

// ---- the policies' invariants ----------------------------------------------------------

// I10: the plan region, while there is one, is a plain segment of the plan
// pool, and every planned slot lies inside it.
bool DeviceAllocator::check_plan(std::string* problem) const {
  if (plan_region_ == nullptr) return true;
  if (plan_region_->pool != &plan_pool_ || plan_region_->arena || !planner_.in_force()) {
    *problem = "the plan region is not a plain segment of the plan pool with a plan";
    return false;
  }
  if (!planner_.fits(plan_region_->size)) {
    *problem = "a planned offset lies outside the plan region";
    return false;
  }
  return true;
}

// I11: placement on means every call is diverted (the fast path would place
// by size alone). Its other half, no long-pool segment with placement off,
// is a pool rule of check_heap's walk.
bool DeviceAllocator::check_lifetimes(std::string* problem) const {
  if (placing_lifetimes_ && !(divert_ & kDivertLifetime)) {
    *problem = "lifetime-aware placement is on but the fast path is open";
    return false;
  }
  return true;
}

}  // namespace pyalloc
