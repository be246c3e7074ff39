// plan.cpp: iteration-aware planning.
//
// Note [Iteration plans]
// A training loop asks for the same sizes in the same order every
// iteration. The cache serves them by best fit, one request at a time, and
// fragments as lifetimes interleave; a static planner that knows the whole
// sequence (MegEngine, TFLite) packs it nearly at its live bytes. pyalloc
// learns the sequence instead of being told it:
//
//   observe  The fast path is off (divert_ & kDivertPlanner) and every
//            default-pool allocation goes through malloc_watched(): the
//            SequenceLearner records its rounded size, stream and, when it
//            is freed, its lifetime counted in allocations. A candidate
//            period comes from a hash of the last 8 sizes seen before; it
//            holds while each new allocation equals the one a period
//            earlier. After three identical periods whose allocations are
//            freed before their position comes round again (a few longer-
//            lived ones, at most a quarter of the bytes, are left to the
//            cache), the learner is ready. Three periods, so that the
//            lifetimes of the first are complete.
//   plan     plan_offsets() places the period's allocations on the plan's
//            stream, biggest first, at the lowest offset free of every
//            allocation live at the same time, lifetimes wrapping round the
//            period. The plan starts at the position where the fewest
//            planned bytes are live (an iteration boundary, in a training
//            loop), so that the cache's copies of them are mostly freed.
//   serve    The next allocations are matched against the plan; matched ones
//            count down to the start position. There the plan region is
//            made: one plain segment of the plan pool (stats: large_pool),
//            after the cache's wholly free memory is released to make room.
//            From then on a matching allocation is carved out of the region
//            at its planned offset. Frees need nothing special: a planned
//            block is an ordinary block of the plan pool and coalesces
//            there.
//   fall back  An allocation that does not match is served by the cache at
//            once (no stall, no copy); up to 4 plan positions are skipped to
//            find it (an allocation the program left out), else it counts as
//            inserted (and an insertion followed by one skip, as one changed
//            request). A matching allocation whose place is still taken is
//            served by the cache too. More than max(2, period/16) misses in a
//            period, or 32 in a row, drop the plan: its region is unpinned
//            (released once its blocks are freed) and observation starts
//            again. empty_cache() and reconfiguration drop it as well, and a
//            request about to fail drops it before the OOM.
//
// Observation ends after 65536 allocations without a plan; it starts again
// after 1024 requests miss the cache (the program has changed). While
// observing or planning, every call takes the general path: planning trades
// speed for memory, and `plan=off` keeps the fast path always.
#include "policy/plan.hpp"

#include <algorithm>

#include "device/device_allocator.hpp"
#include "device/device_allocator_inl.hpp"

namespace pyalloc {

namespace {

constexpr size_t kMinPlanBytes = 2 * kMiB;    // smaller sequences are not worth a region
constexpr size_t kResync = 4;                 // plan positions skipped to find a request
constexpr size_t kMaxRunMisses = 32;
constexpr uint64_t kWakeAfterMisses = 1024;   // cache misses before observing again

}  // namespace

// ---- SequenceLearner ---------------------------------------------------------------

void SequenceLearner::reset() {
  start_ = clock();
  history_.clear();
  seen_.clear();
  period_ = run_ = 0;
  ready_ = false;
}

uint64_t SequenceLearner::window_hash(size_t last) const {
  uint64_t h = 1469598103934665603ull;
  for (size_t k = last + 1 - kWindow; k <= last; ++k) {
    h = (h ^ history_[k].size) * 1099511628211ull;
    h = (h ^ history_[k].stream) * 1099511628211ull;
  }
  return h;
}

uint64_t SequenceLearner::on_alloc(size_t rounded, StreamId stream) {
  ready_ = false;
  history_.push_back(Event{rounded, stream, kLive});
  const size_t i = history_.size() - 1;
  if (period_ != 0) {
    if (same(i, i - period_)) {
      ++run_;
    } else {
      period_ = run_ = 0;
    }
  }
  if (i + 1 >= kWindow) {
    auto [it, inserted] = seen_.try_emplace(window_hash(i), i);
    if (!inserted) {
      const size_t p = i - it->second;
      it->second = i;
      if (period_ == 0 && p >= kMinPeriod && p <= kMaxPeriod) {
        bool equal = true;  // the hashes may collide
        for (size_t k = 0; k < kWindow && equal; ++k) equal = same(i - k, i - k - p);
        if (equal) {
          period_ = p;
          run_ = kWindow;
        }
      }
    }
  }
  // Checked once per whole repetition, from three identical periods: the
  // first has every lifetime up to a period complete.
  if (period_ != 0 && run_ >= 2 * period_ && run_ % period_ == 0) ready_ = plannable(i + 1 - 3 * period_);
  return start_ + i;
}

void SequenceLearner::on_free(uint64_t number) {
  if (number < start_ || number >= clock()) return;
  history_[number - start_].freed_at = clock();
}

// The lifetime of the allocation at history index k, or 0 when it is still
// live or lived longer than a period.
uint64_t SequenceLearner::lifetime(size_t k) const {
  const Event& e = history_[k];
  if (e.freed_at == kLive || e.freed_at - (start_ + k) > period_) return 0;
  return e.freed_at - (start_ + k);
}

// Slot k of the period is planned when its allocation was short-lived in
// the middle one of the last three periods: its lifetimes up to a period
// are all known, and the first period may still hold a start-up pattern
// (state allocated once, at a position a transient takes later).
uint64_t SequenceLearner::slot_lifetime(size_t first, size_t k) const { return lifetime(first + period_ + k); }

bool SequenceLearner::plannable(size_t first) const {
  size_t total = 0, planned = 0;
  for (size_t k = 0; k < period_; ++k) {
    total += history_[first + k].size;
    if (slot_lifetime(first, k) != 0) planned += history_[first + k].size;
  }
  return planned >= kMinPlanBytes && 4 * planned >= 3 * total;
}

std::vector<PlanSlot> SequenceLearner::slots() const {
  const size_t p = period_;
  const size_t first = history_.size() - 3 * p;  // position 0 is the next allocation
  std::vector<PlanSlot> out(p);
  std::unordered_map<StreamId, size_t> bytes_on;
  for (size_t k = 0; k < p; ++k) {
    const Event& e = history_[first + k];
    PlanSlot& s = out[k];
    s.size = e.size;
    s.stream = e.stream;
    s.lifetime = slot_lifetime(first, k);
    s.planned = s.lifetime != 0;
    if (s.planned) bytes_on[s.stream] += s.size;
  }
  // One region serves one stream (a block is reused only on its own stream):
  // the stream with the most planned bytes.
  StreamId stream = 0;
  size_t most = 0;
  for (const auto& [s, bytes] : bytes_on) {
    if (bytes > most || (bytes == most && s < stream)) stream = s, most = bytes;
  }
  for (PlanSlot& s : out) s.planned = s.planned && s.stream == stream;
  return out;
}

// ---- plan_offsets --------------------------------------------------------------------

namespace {

// Whether slots a < b of a period of p positions are live at the same time:
// a's lifetime reaches b, or b's wraps round to a in the next period.
bool overlap(size_t a, const PlanSlot& sa, size_t b, const PlanSlot& sb, size_t p) {
  if (a > b) return overlap(b, sb, a, sa, p);
  return a + sa.lifetime > b || b + sb.lifetime > a + p;
}

}  // namespace

size_t plan_offsets(std::vector<PlanSlot>& slots) {
  const size_t p = slots.size();
  std::vector<size_t> order;
  for (size_t i = 0; i < p; ++i) {
    if (slots[i].planned) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (slots[a].size != slots[b].size) return slots[a].size > slots[b].size;
    if (slots[a].lifetime != slots[b].lifetime) return slots[a].lifetime > slots[b].lifetime;
    return a < b;
  });
  size_t total = 0;
  std::vector<size_t> placed;
  std::vector<std::pair<size_t, size_t>> taken;  // [offset, end) of overlapping placed slots
  for (size_t s : order) {
    taken.clear();
    for (size_t t : placed) {
      if (overlap(s, slots[s], t, slots[t], p)) taken.emplace_back(slots[t].offset, slots[t].offset + slots[t].size);
    }
    std::sort(taken.begin(), taken.end());
    size_t offset = 0;
    for (const auto& [lo, hi] : taken) {
      if (offset + slots[s].size <= lo) break;
      offset = std::max(offset, hi);
    }
    slots[s].offset = offset;
    total = std::max(total, offset + slots[s].size);
    placed.push_back(s);
  }
  return total;
}

// ---- the allocator's side ------------------------------------------------------------

namespace {

// The position where the fewest planned bytes are live before its
// allocation: where the plan region is cheapest to start.
size_t quietest_position(const std::vector<PlanSlot>& slots) {
  const size_t p = slots.size();
  std::vector<int64_t> delta(p + 1, 0);  // live bytes change at positions (circular)
  auto add = [&](size_t from, size_t to, int64_t bytes) {  // [from, to), to <= p
    delta[from] += bytes;
    delta[to] -= bytes;
  };
  for (size_t s = 0; s < p; ++s) {
    const PlanSlot& slot = slots[s];
    if (!slot.planned || slot.lifetime < 2) continue;
    // Live before the allocations at positions s+1 .. s+lifetime-1.
    const size_t from = s + 1, to = s + slot.lifetime;
    if (to <= p) {
      add(from, to, static_cast<int64_t>(slot.size));
    } else {
      if (from < p) add(from, p, static_cast<int64_t>(slot.size));
      add(0, to - p, static_cast<int64_t>(slot.size));
    }
  }
  size_t best = 0;
  int64_t live = 0, least = INT64_MAX;
  for (size_t x = 0; x < p; ++x) {
    live += delta[x];
    if (live < least) least = live, best = x;
  }
  return best;
}

bool matches(const PlanSlot& slot, size_t rounded, StreamId stream) {
  return slot.size == rounded && slot.stream == stream;
}

}  // namespace

void DeviceAllocator::observe() {
  learner_.reset();
  divert_ |= kDivertPlanner;
}

Block* DeviceAllocator::malloc_watched(Pool& pool, size_t size, size_t rounded, StreamId stream, int* status) {
  if (!plan_.empty()) return malloc_from_plan(pool, size, rounded, stream, status);
  const uint64_t number = learner_.on_alloc(rounded, stream);
  Block* block = alloc_block(pool, size, rounded, stream, status);
  if (block != nullptr) {
    block->born = number;
  } else {
    learner_.on_free(number);  // a failed request: as if freed at once, so the period still holds
  }
  if (learner_.ready()) {
    plan_ = learner_.slots();
    plan_bytes_ = plan_offsets(plan_);
    // Matched allocations count down to the quietest position, where the
    // region is made (start_plan_region): it becomes position 0.
    const size_t quiet = quietest_position(plan_);
    std::rotate(plan_.begin(), plan_.begin() + static_cast<std::ptrdiff_t>(quiet), plan_.end());
    plan_pos_ = (plan_.size() - quiet) % plan_.size();
    plan_misses_ = plan_run_misses_ = 0;
  } else if (learner_.full()) {
    divert_ &= ~kDivertPlanner;  // dormant until the cache misses often (malloc_slow)
    planner_wait_ = kWakeAfterMisses;
  }
  return block;
}

void DeviceAllocator::watch_free(Block* block) {
  const PoolKind kind = block->pool->kind;
  if (plan_.empty() && kind != PoolKind::kUser && kind != PoolKind::kLong) learner_.on_free(block->born);
}

// Serves a default-pool request while a plan is in force.
Block* DeviceAllocator::malloc_from_plan(Pool& pool, size_t size, size_t rounded, StreamId stream, int* status) {
  const size_t p = plan_.size();
  if (plan_region_ == nullptr && plan_pos_ == 0 && !start_plan_region()) {
    drop_plan();
    return alloc_block(pool, size, rounded, stream, status);
  }
  size_t skip = 0;
  while (skip <= kResync && !matches(plan_[(plan_pos_ + skip) % p], rounded, stream)) ++skip;
  if (skip > kResync) {  // not in the plan: an inserted request
    ++plan_run_misses_;
    if (note_plan_miss(1)) drop_plan();
    return alloc_block(pool, size, rounded, stream, status);
  }
  // One skipped position right after an inserted request was a changed
  // request (a substitution): one miss, already counted.
  const bool too_many = skip > 0 && note_plan_miss(plan_run_misses_ > 0 ? skip - 1 : skip);
  plan_run_misses_ = 0;
  const PlanSlot slot = plan_[(plan_pos_ + skip) % p];
  plan_pos_ += skip + 1;
  const bool period_ends = plan_pos_ >= p;  // the region starts at the first end
  if (period_ends) {
    plan_pos_ -= p;
    plan_misses_ = 0;
  }
  if (too_many || (period_ends && plan_region_ == nullptr && !start_plan_region())) {
    drop_plan();
    return alloc_block(pool, size, rounded, stream, status);
  }
  // Slots before the region's start are served by the cache; after it, the
  // plan keeps every planned slot's place free when its turn comes.
  if (slot.planned && plan_region_ != nullptr) {
    if (Block* b = carve_planned(slot.offset, rounded)) {
      ++stats_.plan_served;
      take(plan_pool_, b, size, rounded);
      return b;
    }
    if (note_plan_miss(1)) drop_plan();  // its place is still taken
  }
  return alloc_block(pool, size, rounded, stream, status);
}

// Counts misses; true when the plan should go: more than max(2, period/16)
// in this period, or more than 32 requests in a row matched nothing.
bool DeviceAllocator::note_plan_miss(size_t n) {
  plan_misses_ += n;
  stats_.plan_misses += static_cast<int64_t>(n);
  return plan_misses_ > std::max<size_t>(2, plan_.size() / 16) || plan_run_misses_ > kMaxRunMisses;
}

// The region: a plain segment of the plan pool, made at the quietest
// position after the cache's wholly free memory is released.
bool DeviceAllocator::start_plan_region() {
  release_cached_memory(0);
  StreamId stream = 0;
  for (const PlanSlot& slot : plan_) {
    if (slot.planned) stream = slot.stream;
  }
  plan_region_ = alloc_segment(plan_pool_, round_up_to(plan_bytes_, kLargeRound), stream);
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
  plan_.clear();
  if (planning_) observe();
}

bool DeviceAllocator::check_plan(std::string* problem) const {
  if (plan_region_ == nullptr) return true;
  if (plan_region_->pool != &plan_pool_ || plan_region_->arena || plan_.empty()) {
    *problem = "the plan region is not a plain segment of the plan pool with a plan";
    return false;
  }
  for (const PlanSlot& s : plan_) {
    if (s.planned && s.offset + s.size > plan_region_->size) {
      *problem = "a planned offset lies outside the plan region";
      return false;
    }
  }
  return true;
}

}  // namespace pyalloc
