// groups.cpp: merging groups of twins, the last kind of move.
//
// Note [Groups of twins]
// A pair's physical granule still has free bytes in it, and a pair never
// paired again: at lstm_varlen's first failing request at 194 MiB (once
// nested pairs had taken it from its 11,605th call to its 26,837th), the
// 5.7 MiB free lay inside three physical granules, each shared by a pair,
// and two of those pairs held live bytes at offsets that did not overlap:
// [0, 34 KiB) and [1.9932, 1.9937) MiB in one, [0.84, 0.86) and [1.488,
// 1.520) MiB in the other. One physical granule mapped at all four addresses
// holds them all, and gives the request its granule.
//
// So twins come in groups (I13): a ring of granules over one physical
// granule, each owning some offsets (its blocks there are not lent) and
// lending the rest, every offset owned by exactly one. A merge (merge_in,
// after move_in's pairs, as part of the same ladder step) takes a source, a
// group or a single granule with free bytes, whose live bytes, every
// member's, lie inside free memory that members of a destination group (or
// a single granule) own: the live bytes are copied to the same offsets of
// the destination's granule (through the owner's address: free there), each
// source granule maps the destination's granule instead, and the source's
// physical granule goes back to the backend. Afterwards each source granule
// owns its live bytes and lends everything else; each owner lends what it
// gave. A twin whose own part is all free leaves its group (untwin) and gives
// what it owned to the next twin of the ring, as a pair's twin gives it to
// the other; a twin that a merge left owning nothing (a source granule with
// no live byte, an owner that gave all it had) leaves at once.
//
// Measured on the stress suite (docs/benchmarks/2026-11-28-groups-of-twins-cpu.md):
// lstm_varlen needs 194 MiB instead of 196 (1.019 times its peak live
// bytes); no other workload's minimum or peak reserved moved.
//
// Sources go smallest live bytes first, each to the first destination that
// holds all of it; a destination takes several sources, and is not a source
// in the same pass. Every live block of a source must be movable (allocated,
// no other stream's use recorded, never exported).
#include <algorithm>
#include <vector>

#include "blocks/arena.hpp"
#include "device/device_allocator.hpp"
#include "device/fast_path.hpp"

namespace pyalloc {

namespace {

// A group of twins (the members of one ring) or a single granule, as
// merge_in sees it: what its granules own, as offsets: `live` (allocated
// ranges, each with the granule that owns it) and `free` (the free ranges,
// each with its owner and a block that held it when found).
struct Group {
  std::vector<size_t> members;
  struct Range {
    size_t lo, hi, owner;
    Block* block;
  };
  std::vector<Range> live, free;
  size_t live_bytes = 0;
  size_t free_bytes = 0;
  bool movable = true;
};

// A block of granule `slot` of `group` (a member), found when the group was:
// one of its own ranges, or a twin's lent piece.
Block* anchor(const Group& group, size_t slot) {
  for (const auto* ranges : {&group.live, &group.free}) {
    for (const Group::Range& r : *ranges) {
      if (r.owner == slot) return r.block;
    }
  }
  return nullptr;
}

// One merge: `source`'s granules go over to `dest`'s physical granule, each
// live range of the source into the free range of dest listed beside it.
struct Merge {
  const Group* source;
  const Group* dest;
  std::vector<Group::Range> into;  // per live range of source, in order: where it goes
};

}  // namespace

// Merges groups of twins, and single granules, into others (Note [Groups of
// twins]), up to `wanted`; returns the physical granules given back. The
// device is synchronized before the first copy (*synchronized says whether
// it was).
size_t DeviceAllocator::merge_in(Segment* arena, size_t wanted, bool* synchronized) {
  const size_t g = granule_;
  const uintptr_t base = arena->base;
  // Every group, and every single granule that has both live and free bytes,
  // with what its granules own: one walk of the arena.
  std::vector<Group> groups;
  std::vector<size_t> group_of(arena->phys.size(), SIZE_MAX);
  for (const auto& t : arena->twins) {
    if (group_of[t.first] != SIZE_MAX) continue;
    Group group;
    size_t i = t.first;
    do {
      group_of[i] = groups.size();
      group.members.push_back(i);
      i = arena->twins.at(i).other;
    } while (i != t.first);
    groups.push_back(std::move(group));
  }
  for (Block* b = arena->head; b != nullptr; b = b->next) {
    if (b->state == BlockState::kHole || b->state == BlockState::kLent) continue;
    for (uintptr_t lo = b->addr; lo < end_of(b); lo = base + ((lo - base) / g + 1) * g) {
      const size_t slot = (lo - base) / g;
      const uintptr_t hi = std::min(end_of(b), base + (slot + 1) * g);
      if (group_of[slot] == SIZE_MAX) {
        if (arena->phys[slot].size != g || (b->is_free() && hi - lo == g)) continue;  // an extent, or wholly free
        group_of[slot] = groups.size();
        groups.push_back(Group{{slot}, {}, {}, 0, 0, true});
      }
      Group& group = groups[group_of[slot]];
      const Group::Range r{lo - base - slot * g, hi - base - slot * g, slot, b};
      if (b->is_free()) {
        group.free.push_back(r);
      } else {
        group.live.push_back(r);
        group.live_bytes += hi - lo;
        group.movable = group.movable && b->state == BlockState::kAllocated && b->uses.empty() &&
                        exported_.count(b->addr) == 0;
      }
    }
  }
  // A single granule all live, or all free, is no use either way.
  std::vector<size_t> order;
  for (size_t k = 0; k < groups.size(); ++k) {
    const Group& group = groups[k];
    if (group.members.size() > 1 || (!group.live.empty() && !group.free.empty())) order.push_back(k);
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return groups[x].live_bytes < groups[y].live_bytes; });

  // Plan: sources smallest first, each into the first destination that holds
  // every live range of it. A destination's free ranges are disjoint and in
  // offset order, and so are a source's live ranges: each live range fits
  // in at most one free range, the one that starts last at or before it,
  // whatever the other live ranges take. So the test needs no copy; the
  // free ranges are cut only for the merge chosen.
  for (Group& group : groups) {
    std::sort(group.free.begin(), group.free.end(), [](const Group::Range& x, const Group::Range& y) { return x.lo < y.lo; });
    for (const Group::Range& f : group.free) group.free_bytes += f.hi - f.lo;
  }
  auto holder = [](std::vector<Group::Range>& free, const Group::Range& r) -> std::vector<Group::Range>::iterator {
    auto it = std::upper_bound(free.begin(), free.end(), r.lo, [](size_t lo, const Group::Range& f) { return lo < f.lo; });
    if (it == free.begin() || std::prev(it)->hi < r.hi) return free.end();
    return std::prev(it);
  };
  std::vector<char> role(groups.size(), 0);  // 1: merged away, 2: received
  std::vector<Merge> merges;
  size_t budget = size_t{1} << 20;  // live ranges tested, at most (a few ms of a request that fails)
  for (const size_t k : order) {
    const Group& source = groups[k];
    if (merges.size() >= wanted || budget == 0) break;
    if (role[k] != 0 || !source.movable || source.live.empty()) continue;
    for (const size_t d : order) {
      Group& dest = groups[d];
      if (d == k || role[d] == 1 || dest.free_bytes < source.live_bytes || budget == 0) continue;
      bool fits = true;
      for (size_t i = 0; i < source.live.size() && fits; ++i, --budget) {
        fits = budget > 0 && holder(dest.free, source.live[i]) != dest.free.end();
      }
      if (!fits) continue;
      std::vector<Group::Range> into;
      for (const Group::Range& r : source.live) {
        const auto it = holder(dest.free, r);
        const Group::Range f = *it;
        into.push_back(f);
        // What is left of f: the part before r in its place, the part after r next to it.
        const auto at = static_cast<std::ptrdiff_t>(it - dest.free.begin());
        dest.free.erase(it);
        if (f.hi > r.hi) dest.free.insert(dest.free.begin() + at, {r.hi, f.hi, f.owner, f.block});
        if (r.lo > f.lo) dest.free.insert(dest.free.begin() + at, {f.lo, r.lo, f.owner, f.block});
      }
      dest.free_bytes -= source.live_bytes;
      merges.push_back({&source, &dest, std::move(into)});
      role[k] = 1;
      role[d] = 2;
      break;
    }
  }
  if (merges.empty()) return 0;

  // Every stream's work first, then the copies on the arena's stream, then one wait for them.
  synchronize_for_moves(synchronized);
  std::vector<const Merge*> copied;
  for (const Merge& m : merges) {
    bool ok = true;
    for (size_t i = 0; i < m.source->live.size() && ok; ++i) {
      const Group::Range& r = m.source->live[i];
      const uintptr_t from = base + r.owner * g + r.lo;
      const uintptr_t to = base + m.into[i].owner * g + r.lo;
      ok = succeeded(backend_->copy_device_async(device_, to, from, r.hi - r.lo, arena->stream));
    }
    if (ok) copied.push_back(&m);
  }
  if (copied.empty() || !synchronize_stream(arena)) return 0;

  size_t merged = 0;
  std::vector<size_t> idle;  // granules of merged groups: those left owning nothing part at the end
  for (const Merge* m : copied) {
    const PhysHandle own = arena->phys[m->source->members.front()];
    const PhysHandle theirs = arena->phys[m->dest->members.front()];
    // Each source granule maps the destination's granule; on a failure, all of them back.
    if (!remap(arena, m->source->members.data(), m->source->members.size(), theirs)) continue;
    release_chunks(&own, 1);
    // The owners lend what they gave; the source's granules lend all but their live bytes.
    for (size_t i = 0; i < m->source->live.size(); ++i) {
      const Group::Range& r = m->source->live[i];
      const size_t owner = m->into[i].owner;
      const uintptr_t lo = base + owner * g;
      Block* lent = lend(walk_to(m->into[i].block, lo + r.lo), lo + r.lo, lo + r.hi);
      if (arena->twinned[owner]) {
        std::vector<Block*>& pieces = arena->twins.at(owner).lent;
        pieces.insert(std::upper_bound(pieces.begin(), pieces.end(), lent,
                                       [](const Block* x, const Block* y) { return x->addr < y->addr; }),
                      lent);
      }
    }
    for (const size_t slot : m->source->members) {
      const uintptr_t lo = base + slot * g;
      std::vector<Block*> pieces;
      Block* from = anchor(*m->source, slot);  // none: a twin that owns nothing, all lent
      if (from == nullptr) from = arena->twins.at(slot).lent.front();
      for (Block* b = walk_to(from, lo); b != nullptr && b->addr < lo + g;) {
        if (b->is_free()) b = lend(b, std::max(b->addr, lo), std::min(end_of(b), lo + g));
        if (b->state == BlockState::kLent) pieces.push_back(b);
        b = b->next;
      }
      arena->twins[slot].lent = std::move(pieces);
      arena->twinned[slot] = true;
      arena->phys[slot] = theirs;
    }
    // A single destination granule is a twin now.
    const size_t first = m->dest->members.front();
    if (!arena->twinned[first]) {
      const uintptr_t lo = base + first * g;
      std::vector<Block*> pieces;
      for (Block* b = walk_to(anchor(*m->dest, first), lo); b != nullptr && b->addr < lo + g; b = b->next) {
        if (b->state == BlockState::kLent) pieces.push_back(b);
      }
      arena->twins[first] = Twin{first, std::move(pieces)};
      arena->twinned[first] = true;
    }
    // The ring: the source's granules after the destination's first.
    size_t after = arena->twins.at(first).other;
    for (auto it = m->source->members.rbegin(); it != m->source->members.rend(); ++it) {
      arena->twins.at(*it).other = after;
      after = *it;
    }
    arena->twins.at(first).other = after;
    arena->doubled += g;  // the source's k granules join: k more doubled, less the k - 1 they had
    for (const Group* group : {m->source, m->dest}) {
      for (const size_t slot : group->members) idle.push_back(slot);
    }
    for (size_t i = 0; i < m->into.size(); ++i) {  // each owner that gave, once
      const Group::Range& r = m->into[i];
      const bool seen = std::any_of(m->into.begin(), m->into.begin() + static_cast<std::ptrdiff_t>(i),
                                    [&](const Group::Range& q) { return q.owner == r.owner; });
      if (!seen && arena->twinned[r.owner]) relist_granule(arena, r.owner, r.block);
    }
    if (arena->indexed) {  // a twin that owns nothing live parts at the next gathering
      for (const Group* group : {m->source, m->dest}) {
        for (const size_t slot : group->members) {
          if (arena->twinned[slot] && own_part_free(arena, slot, g)) arena->slivers.check_twin(slot);
        }
      }
    }
    stats_.reserved_bytes.decrease(arena->pool->stat, static_cast<int64_t>(g));
    ++stats_.num_moved_granules;
    ++stats_.num_merged_groups;
    stats_.moved_bytes += static_cast<int64_t>(m->source->live_bytes);
    ++merged;
  }
  // A twin that owns nothing now (a source granule with no live byte, an
  // owner that gave all it had) leaves its group: every twin owns some
  // offset (I13), so every twin lends some too. Not before every merge is
  // done: parting frees lent pieces, whose merges with free blocks would
  // take blocks that later merges named.
  for (const size_t slot : idle) {
    const uintptr_t lo = base + slot * g;
    if (arena->twinned[slot] && lent_gaps(arena->twins.at(slot).lent, lo, lo + g).empty()) untwin(arena, slot);
  }
  return merged;
}

}  // namespace pyalloc
