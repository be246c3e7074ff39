// check.cpp: pyalloc_check's walk of one device's blocks (check.hpp).
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <unordered_map>
#include <unordered_set>

#include "blocks/arena.hpp"
#include "blocks/sliver_index_inl.hpp"
#include "ground/text.hpp"
#include "observe/check.hpp"

namespace pyalloc {

namespace {

struct Sums {
  int64_t segments[kNumStatTypes] = {};
  int64_t reserved[kNumStatTypes] = {};
  int64_t allocations[kNumStatTypes] = {};
  int64_t allocated[kNumStatTypes] = {};
  int64_t requested[kNumStatTypes] = {};
  int64_t active[kNumStatTypes] = {};
  int64_t active_bytes[kNumStatTypes] = {};
  int64_t inactive_split[kNumStatTypes] = {};
  int64_t inactive_split_bytes[kNumStatTypes] = {};
  int64_t pending[kNumStatTypes] = {};
  int64_t pending_bytes_by_type[kNumStatTypes] = {};
  int64_t cached_free = 0;
  size_t free_whole_granules = 0;  // inside free blocks of arenas
  int64_t pending_bytes = 0;

  void add(int64_t (&a)[kNumStatTypes], StatType t, int64_t n) {
    a[kStatAll] += n;
    a[t] += n;
  }
};

bool compare(const char* name, const StatView& counters, const int64_t (&walked)[kNumStatTypes],
             std::string* error) {
  static const char* const types[] = {"all", "small_pool", "large_pool"};
  for (int t = 0; t < kNumStatTypes; ++t) {
    if (counters[t].current != walked[t]) {
      *error = std::string("I7: ") + name + "." + types[t] + ".current is " +
               std::to_string(counters[t].current) + " but the walk sums " +
               std::to_string(walked[t]);
      return false;
    }
    if (counters[t].peak < counters[t].current) {
      *error = std::string("I7: ") + name + "." + types[t] + ".peak is below current";
      return false;
    }
  }
  return true;
}

}  // namespace

// I14: once on, an arena's sliver index holds exactly its free slivers, each
// in the list of its offset (Note [Sliver index] in blocks/sliver_index.hpp).
static bool check_sliver_index(const Segment& arena, size_t g, std::string* problem) {
  if (arena.indexed != arena.slivers.on()) {
    *problem = "the arena's indexed flag disagrees with its sliver index";
    return false;
  }
  if (!arena.indexed) return true;
  for (const SliverIndex::Kind kind : {SliverIndex::kEnd, SliverIndex::kStart}) {
    std::unordered_set<const Block*> expected;
    for (const Block* b = arena.head; b != nullptr; b = b->next) {
      if (b->is_free() && SliverIndex::offset(kind, b, g) != 0 && SliverIndex::lends(kind, b, g)) expected.insert(b);
    }
    size_t found = 0;
    size_t last = 0;
    for (const Block* b = arena.slivers.first(kind, 1); b != nullptr; b = arena.slivers.next(kind, b)) {
      const size_t off = b->segment == &arena ? SliverIndex::offset(kind, b, g) : 0;
      if (expected.count(b) == 0 || off < last || ++found > expected.size()) {
        *problem = std::string("the sliver index lists ") + hex(b->addr) + " as a free " +
                   (kind == SliverIndex::kEnd ? "end" : "start") + " out of place";
        return false;
      }
      last = off;
    }
    if (found != expected.size() || arena.slivers.count(kind) != found) {
      *problem = "the sliver index lists " + std::to_string(found) + " free " +
                 (kind == SliverIndex::kEnd ? "ends" : "starts") + " of " + std::to_string(expected.size()) +
                 " and counts " + std::to_string(arena.slivers.count(kind));
      return false;
    }
  }
  size_t roomy = 0;
  for (const Block* b = arena.head; b != nullptr; b = b->next) {
    if (!b->is_free() || SliverIndex::whole_granules(b, g) == 0) continue;
    ++roomy;
    if (!arena.slivers.is_roomy(b)) {
      *problem = "free block " + hex(b->addr) + " holds a whole granule but is not listed as roomy";
      return false;
    }
  }
  // And the other way: every block the index lists as roomy is one.
  size_t listed = 0;
  for (const Block* b = arena.slivers.roomy_from(0); b != nullptr;
       b = arena.slivers.roomy_from(SliverIndex::first_whole(b, g) + 1)) {
    if (b->segment != &arena || !b->is_free() || SliverIndex::whole_granules(b, g) == 0) {
      *problem = "the sliver index lists " + hex(b->addr) + " as roomy, which holds no free whole granule";
      return false;
    }
    ++listed;
  }
  if (roomy != arena.slivers.roomy_count() || listed != roomy) {
    *problem = "the sliver index lists " + std::to_string(arena.slivers.roomy_count()) + " roomy blocks of " +
               std::to_string(roomy);
    return false;
  }
  // A twin whose own part is all free must be noted, or untwin_free would
  // never part it.
  for (const auto& twin : arena.twins) {
    const size_t slot = twin.first;
    if (own_part_free(&arena, slot, g) && !arena.slivers.noted(slot)) {
      *problem = "twin granule " + std::to_string(slot) + " has its own part free but is not noted for untwinning";
      return false;
    }
  }
  return true;
}

bool check_arena(const Segment& arena_ref, size_t granule, std::string* problem) {
  const Segment* arena = &arena_ref;
  const size_t g = granule;
  if (g == 0 || arena->size % g != 0 || arena->phys.size() != arena->size / g) {
    *problem = "reservation is not a whole number of granules";
    return false;
  }
  std::vector<bool> needed(arena->phys.size(), false);
  size_t backed_blocks = 0;
  size_t lent_bytes = 0;
  size_t holes = 0;
  std::unordered_map<size_t, std::vector<std::pair<size_t, size_t>>> lent;  // granule -> its lent pieces [lo, hi)
  const Block* prev = nullptr;
  for (const Block* b = arena->head; b != nullptr; prev = b, b = b->next) {
    const size_t lo = b->addr - arena->base;
    const size_t hi = lo + b->size;
    if (b->state == BlockState::kLent) {
      const size_t slot = lo / g;
      const auto twin = arena->twins.find(slot);
      if ((hi - 1) / g != slot || twin == arena->twins.end()) {
        *problem = "lent block " + hex(b->addr) + " is not one of the pieces of one twin granule";
        return false;
      }
      const std::vector<Block*>& named = twin->second.lent;
      if (lent[slot].size() >= named.size() || named[lent[slot].size()] != b) {
        *problem = "twin granule " + std::to_string(slot) + " does not name its lent piece " + hex(b->addr) +
                   " (in address order)";
        return false;
      }
      lent[slot].emplace_back(lo % g, hi - slot * g);
      lent_bytes += b->size;
    }
    if (b->state == BlockState::kHole) {
      ++holes;
      if (!arena->holes.contains(b)) {
        *problem = "hole " + hex(b->addr) + " is not in the arena's hole set";
        return false;
      }
      if (lo % g != 0 || hi % g != 0) {
        *problem = "hole " + hex(b->addr) + " does not start and end on granule boundaries";
        return false;
      }
      if (prev != nullptr && prev->state == BlockState::kHole) {
        *problem = "two adjacent holes at " + hex(b->addr);
        return false;
      }
      continue;
    }
    backed_blocks += b->size;
    for (size_t i = lo / g; i < (hi + g - 1) / g; ++i) needed[i] = true;
  }
  if (holes != arena->holes.size() || !arena->holes.consistent(arena)) {
    *problem = "the hole set lists " + std::to_string(arena->holes.size()) + " holes of " + std::to_string(holes);
    return false;
  }
  size_t mapped = 0;
  for (size_t i = 0; i < needed.size(); ++i) {
    const bool is_mapped = arena->phys[i].value != 0;
    if (is_mapped != needed[i]) {
      *problem = "granule " + std::to_string(i) + (is_mapped ? " is mapped under a hole" : " is not mapped under a block");
      return false;
    }
    if (is_mapped) mapped += g;
  }
  // I13: twins in groups (rings), over one physical granule; at every offset
  // exactly one twin of the group owns the bytes, the others lend them; each
  // record names all of its granule's lent pieces.
  size_t groups = 0;
  std::unordered_map<size_t, bool> seen;  // twin granule -> its group was checked
  for (const auto& t : arena->twins) {
    const size_t first = t.first;
    const auto pieces = lent.find(first);
    if ((pieces == lent.end() ? 0 : pieces->second.size()) != t.second.lent.size()) {
      *problem = "twin granule " + std::to_string(first) + " names " + std::to_string(t.second.lent.size()) +
                 " lent pieces, not the ones it has";
      return false;
    }
    if (seen.count(first) != 0) continue;
    ++groups;
    std::vector<std::pair<size_t, size_t>> owned;  // every member's own ranges, as offsets
    std::vector<size_t> members;
    size_t i = first;
    do {
      const auto twin = arena->twins.find(i);
      if (twin == arena->twins.end() || arena->phys[i].value == 0 ||
          arena->phys[i].value != arena->phys[first].value || members.size() > arena->twins.size()) {
        *problem = "twin granules from " + std::to_string(first) + " do not form a ring over one physical granule";
        return false;
      }
      members.push_back(i);
      seen[i] = true;
      const uintptr_t lo = arena->base + i * g;
      const auto gaps = lent_gaps(twin->second.lent, lo, lo + g);
      if (gaps.empty() || twin->second.lent.empty()) {
        *problem = "twin granule " + std::to_string(i) + (gaps.empty() ? " owns nothing" : " lends nothing");
        return false;
      }
      for (const auto& [a, z] : gaps) owned.emplace_back(a - lo, z - lo);
      i = twin->second.other;
    } while (i != first);
    std::sort(owned.begin(), owned.end());
    size_t at = 0;
    for (const auto& [a, z] : owned) {
      if (a != at) break;
      at = z;
    }
    if (members.size() < 2 || at != g || owned.back().second != g ||
        std::adjacent_find(owned.begin(), owned.end(), [](const auto& x, const auto& y) { return x.second > y.first; }) !=
            owned.end()) {
      *problem = "the group of twin granules from " + std::to_string(first) + " (" + std::to_string(members.size()) +
                 " granules) does not own each offset of its granule exactly once";
      return false;
    }
  }
  // I16: a chunk of k granules lies over k granules that record it; none of an extent is a twin.
  for (size_t i = 0; i < arena->phys.size();) {
    const PhysHandle h = arena->phys[i];
    const size_t k = h.value == 0 ? 1 : h.size / g;
    bool whole = h.value == 0 || (h.size % g == 0 && k > 0 && i + k <= arena->phys.size());
    for (size_t j = i; whole && j < i + k; ++j) {
      whole = arena->phys[j].value == h.value && arena->phys[j].size == h.size && (k == 1 || !arena->twinned[j]);
    }
    if (!whole) {
      *problem = "granule " + std::to_string(i) + " starts a chunk of " + std::to_string(h.size) +
                 " bytes that is not mapped whole over its granules (or is a twin)";
      return false;
    }
    i += k;
  }
  size_t twinned = 0;
  for (size_t i = 0; i < arena->twinned.size(); ++i) {
    if (!arena->twinned[i]) continue;
    ++twinned;
    if (arena->twins.count(i) == 0) {
      *problem = "granule " + std::to_string(i) + " is flagged a twin but has no twin";
      return false;
    }
  }
  if (twinned != arena->twins.size()) {
    *problem = std::to_string(arena->twins.size()) + " twins but " + std::to_string(twinned) + " flagged";
    return false;
  }
  if (arena->doubled != (arena->twins.size() - groups) * g || lent_bytes != arena->doubled) {
    *problem = "doubled bytes " + std::to_string(arena->doubled) + " but " + std::to_string(arena->twins.size()) +
               " twins lend " + std::to_string(lent_bytes);
    return false;
  }
  if (mapped != arena->mapped || backed_blocks != arena->mapped) {
    *problem = "mapped bytes " + std::to_string(arena->mapped) + " but granules give " + std::to_string(mapped) +
               " and non-hole blocks " + std::to_string(backed_blocks);
    return false;
  }
  return check_sliver_index(*arena, g, problem);
}

namespace {

const PoolRule* rule_for(const HeapView& heap, const Pool* pool) {
  for (const PoolRule& r : heap.rules) {
    if (r.pool == pool) return &r;
  }
  return nullptr;
}

}  // namespace

bool check_heap(const HeapView& heap, std::string* error) {
  const std::string where = "device " + std::to_string(heap.device) + ": ";
  auto fail = [&](const std::string& message) {
    *error = "pyalloc_check: " + where + message;
    return false;
  };

  size_t free_set_entries = 0;
  for (const Pool* pool : heap.pools) free_set_entries += pool->free_blocks.size();

  const std::unordered_set<const Block*> pending_blocks(heap.pending.begin(), heap.pending.end());

  Sums sums;
  size_t free_blocks_walked = 0;
  size_t allocated_walked = 0;
  for (const auto& entry : *heap.segments) {
    const Segment* seg = entry.second;
    const std::string sname = "segment " + hex(seg->base);
    if (entry.first != seg->base) return fail(sname + " is filed under " + hex(entry.first));
    if (seg->head == nullptr || seg->head->prev != nullptr) return fail(sname + ": bad head block");
    if (seg->head->addr != seg->base) return fail("I1: " + sname + ": first block does not start at the base");
    // A pool that serves nothing holds nothing (the device's rules: I11, I12).
    const PoolRule* rule = rule_for(heap, seg->pool);
    if (rule != nullptr && rule->largest_request == 0) return fail(std::string(rule->invariant) + ": " + rule->what);
    const StatType t = seg->pool->stat;
    sums.add(sums.segments, t, 1);
    sums.add(sums.reserved, t, static_cast<int64_t>(seg->reserved_bytes()));
    if (seg->counted != (seg->arena && heap.whole_counted)) {
      return fail("I6: " + sname + (seg->counted ? " is" : " is not") + " in the count of whole free granules, " +
                  (heap.whole_counted ? "which is kept" : "which is not kept"));
    }
    if (seg->arena) {
      std::string problem;
      if (!check_arena(*seg, heap.granule, &problem)) return fail("I9: " + sname + ": " + problem);
    }

    size_t tiled = 0;
    const Block* prev = nullptr;
    for (const Block* b = seg->head; b != nullptr; prev = b, b = b->next) {
      const std::string bname = sname + ": block " + hex(b->addr);
      if (b->prev != prev) return fail("I1: " + bname + ": prev link is broken");
      if (b->segment != seg || b->pool != seg->pool || b->stream != seg->stream) {
        return fail(bname + ": segment, pool or stream differs from its segment's");
      }
      if (b->addr != seg->base + tiled) return fail("I1: " + bname + ": blocks do not tile the segment");
      if (b->size == 0 || b->size % kBlockAlign != 0 || b->addr % kBlockAlign != 0) {
        return fail("I8: " + bname + ": size or address is not a multiple of 512");
      }
      tiled += b->size;
      if (tiled > seg->size) return fail("I1: " + bname + ": blocks run past the segment end");
      if (rule != nullptr && b->requested > rule->largest_request) {
        return fail(std::string(rule->invariant) + ": the " + seg->pool->name + " pool holds a request of " +
                    std::to_string(b->requested) + " bytes");
      }

      const bool in_free_set = seg->pool->free_blocks.contains(b);
      const auto* live_entry = heap.live->find(b->addr);
      const bool in_live = live_entry != nullptr && live_entry->value == b;
      const bool in_pending = pending_blocks.count(b) == 1;
      switch (b->state) {
        case BlockState::kFree:
          if (prev != nullptr && prev->is_free()) return fail("I2: " + bname + ": two adjacent free blocks");
          if (!in_free_set) return fail("I3: " + bname + " is free but not in its pool's free set");
          if (in_live || in_pending) return fail("I4/I5: " + bname + " is free but listed live or pending");
          if (b->requested != 0) return fail(bname + ": free block keeps a requested size");
          if (b->freed_at > heap.frees) return fail(bname + ": freed later than the last free (Block::freed_at)");
          ++free_blocks_walked;
          sums.cached_free += static_cast<int64_t>(b->size);
          if (seg->arena) sums.free_whole_granules += SliverIndex::whole_granules(b, heap.granule);
          if (b->size != seg->size) {
            sums.add(sums.inactive_split, t, 1);
            sums.add(sums.inactive_split_bytes, t, static_cast<int64_t>(b->size));
          }
          break;
        case BlockState::kAllocated:
          if (!in_live) return fail("I4: " + bname + " is allocated but not in the live map");
          if (in_free_set || in_pending) return fail("I3/I5: " + bname + " is allocated but listed free or pending");
          if (b->requested == 0 || b->requested > b->size) return fail(bname + ": requested size out of range");
          ++allocated_walked;
          sums.add(sums.allocations, t, 1);
          sums.add(sums.allocated, t, static_cast<int64_t>(b->size));
          sums.add(sums.requested, t, static_cast<int64_t>(b->requested));
          sums.add(sums.active, t, 1);
          sums.add(sums.active_bytes, t, static_cast<int64_t>(b->size));
          break;
        case BlockState::kHole:
          if (in_free_set || in_live || in_pending) return fail("I9: " + bname + " is a hole but listed free, live or pending");
          if (b->requested != 0) return fail(bname + ": hole keeps a requested size");
          break;
        case BlockState::kLent:
          if (!seg->arena) return fail("I13: " + bname + " is lent outside an arena");
          if (in_free_set || in_live || in_pending) return fail("I13: " + bname + " is lent but listed free, live or pending");
          if (b->requested != 0) return fail(bname + ": lent block keeps a requested size");
          break;
        case BlockState::kPendingFree:
          if (!in_pending) return fail("I5: " + bname + " is pending but not in the pending list");
          if (in_free_set || in_live) return fail("I3/I4: " + bname + " is pending but listed free or live");
          sums.pending_bytes += static_cast<int64_t>(b->size);
          sums.add(sums.pending, t, 1);
          sums.add(sums.pending_bytes_by_type, t, static_cast<int64_t>(b->size));
          sums.add(sums.active, t, 1);
          sums.add(sums.active_bytes, t, static_cast<int64_t>(b->size));
          break;
      }
    }
    if (tiled != seg->size) return fail("I1: " + sname + ": blocks cover " + std::to_string(tiled) + " of " + std::to_string(seg->size) + " bytes");
  }

  if (free_blocks_walked != free_set_entries) {
    return fail("I3: free sets hold " + std::to_string(free_set_entries) + " blocks but the walk found " +
                std::to_string(free_blocks_walked) + " free blocks");
  }
  for (const Pool* pool : heap.pools) {
    std::string problem;
    if (!pool->free_blocks.validate(&problem)) return fail("I3: pool " + pool->name + ": " + problem);
    pool->free_blocks.for_each([&](const Block* b) {
      if (!problem.empty()) return;
      if (b->pool != pool || !b->is_free()) problem = "I3: free set of pool " + pool->name + " holds a foreign or non-free block";
      auto it = heap.segments->find(b->segment->base);
      if (it == heap.segments->end() || it->second != b->segment) problem = "I3: free set holds a block of an unknown segment";
    });
    if (!problem.empty()) return fail(problem);
  }
  if (allocated_walked != heap.live->size()) {
    return fail("I4: live map holds " + std::to_string(heap.live->size()) + " entries but the walk found " +
                std::to_string(allocated_walked) + " allocated blocks");
  }
  if (pending_blocks.size() != heap.pending.size()) return fail("I5: a block is pending twice");
  if (!heap.whole_counted && heap.free_whole_granules != 0) {
    return fail("I6: the count of whole free granules is not kept but says " + std::to_string(heap.free_whole_granules));
  }
  if (heap.whole_counted && sums.free_whole_granules != heap.free_whole_granules) {
    return fail("I6: the count of whole free granules is " + std::to_string(heap.free_whole_granules) +
                " but the arenas' free blocks hold " + std::to_string(sums.free_whole_granules));
  }
  if (sums.cached_free != static_cast<int64_t>(heap.cached_free_bytes)) {
    return fail("I6: cached free counter is " + std::to_string(heap.cached_free_bytes) + " but the walk sums " +
                std::to_string(sums.cached_free));
  }
  for (const Pool* pool : heap.pools) {
    for (const Segment* a : pool->arenas) {
      auto it = heap.segments->find(a->base);
      if (it == heap.segments->end() || it->second != a || a->pool != pool || !a->arena) {
        return fail("I9: pool " + pool->name + " lists an arena that is not one of its segments");
      }
    }
  }
  if (sums.reserved[kStatAll] != sums.allocated[kStatAll] + sums.pending_bytes + sums.cached_free) {
    return fail("I6: reserved != allocated + pending_free + cached_free");
  }
  const DeviceStats& stats = *heap.stats;
  return compare("segment", stats.segment.view(), sums.segments, error) &&
         compare("reserved_bytes", stats.reserved_bytes.view(), sums.reserved, error) &&
         compare("allocation", stats.allocation.view(), sums.allocations, error) &&
         compare("allocated_bytes", stats.allocated_bytes.view(), sums.allocated, error) &&
         compare("requested_bytes", stats.requested_bytes.view(), sums.requested, error) &&
         compare("active", stats.active(), sums.active, error) &&
         compare("active_bytes", stats.active_bytes(), sums.active_bytes, error) &&
         compare("inactive_split", stats.inactive_split.view(), sums.inactive_split, error) &&
         compare("inactive_split_bytes", stats.inactive_split_bytes.view(), sums.inactive_split_bytes, error) &&
         compare("pending", stats.pending.view(), sums.pending, error) &&
         compare("pending_bytes", stats.pending_bytes.view(), sums.pending_bytes_by_type, error);
}

}  // namespace pyalloc
