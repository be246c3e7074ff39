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

#include "blocks/types.hpp"

namespace pyalloc {

namespace {

constexpr size_t kMinPlanBytes = 2 * kMiB;    // smaller sequences are not worth a region

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

// ---- Planner ---------------------------------------------------------------------------

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

void Planner::observe() {
  learner_.reset();
  plan_.clear();
}

Planner::Outcome Planner::after_alloc() {
  if (learner_.ready()) {
    plan_ = learner_.slots();
    plan_bytes_ = plan_offsets(plan_);
    // Matched allocations count down to the quietest position, where the
    // region is made: it becomes position 0.
    const size_t quiet = quietest_position(plan_);
    std::rotate(plan_.begin(), plan_.begin() + static_cast<std::ptrdiff_t>(quiet), plan_.end());
    plan_pos_ = (plan_.size() - quiet) % plan_.size();
    misses_ = run_misses_ = 0;
    return Outcome::kAdopted;
  }
  if (learner_.full()) {
    wait_ = kWakeAfterMisses;
    return Outcome::kDormant;
  }
  return Outcome::kWatching;
}

bool Planner::wake() { return wait_ > 0 && --wait_ == 0; }

StreamId Planner::region_stream() const {
  StreamId stream = 0;
  for (const PlanSlot& slot : plan_) {
    if (slot.planned) stream = slot.stream;
  }
  return stream;
}

Planner::Match Planner::match(size_t rounded, StreamId stream) {
  const size_t p = plan_.size();
  Match m;
  size_t skip = 0;
  while (skip <= kResync && !matches(plan_[(plan_pos_ + skip) % p], rounded, stream)) ++skip;
  if (skip > kResync) {  // not in the plan: an inserted request
    ++run_misses_;
    m.misses = 1;
    m.drop = note_miss(1);
    return m;
  }
  // One skipped position right after an inserted request was a changed
  // request (a substitution): one miss, already counted.
  if (skip > 0) {
    m.misses = run_misses_ > 0 ? skip - 1 : skip;
    m.drop = note_miss(m.misses);
  }
  run_misses_ = 0;
  m.found = true;
  m.slot = plan_[(plan_pos_ + skip) % p];
  plan_pos_ += skip + 1;
  if (plan_pos_ >= p) {  // the region starts at the first end
    plan_pos_ -= p;
    misses_ = 0;
    m.period_ended = true;
  }
  return m;
}

bool Planner::note_miss(size_t n) {
  misses_ += n;
  return misses_ > std::max<size_t>(2, plan_.size() / 16) || run_misses_ > kMaxRunMisses;
}

bool Planner::fits(size_t bytes) const {
  for (const PlanSlot& s : plan_) {
    if (s.planned && s.offset + s.size > bytes) return false;
  }
  return true;
}

}  // namespace pyalloc
