// arena.cpp: virtual-memory arenas, and stitching (ladder step 2).
//
// Note [Arenas]
// With `vmm` on, a pool does not grow by whole segments. It owns one arena
// per stream: a reservation of address space as large as the device, backed
// by physical granules (2 MiB on CUDA, cuMemCreate; memfd chunks on host)
// only where blocks need them. The blocks of an arena tile the reservation
// like a segment's, with one more state: a hole is address space with no
// granule behind it. Holes start and end on granule boundaries (relative to
// the arena's base) and never touch each other (types.hpp I9).
//
// Growing (grow_arena) looks in the arena for the window of `rounded` bytes,
// inside a run of free blocks and holes, that needs the fewest granules
// mapped; ties go to the lowest address. Mapping those granules turns the
// holes they cover into free memory, which coalesces with the free blocks
// around it, so a request is served from one contiguous range even when the
// free memory it uses came from different places. Physical memory is
// fungible: only the granules under live blocks (and the partly used ones at
// their ends) need to exist, whatever the addresses.
//
// Stitching (stitch, ladder step 2): when the device is full, granules wholly
// inside free blocks anywhere on the device, in any arena, are unmapped (a
// free block becomes free edges around a hole) and mapped again into the
// window the request needs. That is GMLake's idea with the allocator's own
// block structure: the request gets contiguous addresses over physical memory
// that was scattered in free slivers.
//
// Stream order: a free block may still be read by work queued on its
// stream before the free (the caching allocator's usual reuse rule), so an
// arena's stream is synchronized (event recorded and waited for) before any
// of its granules is unmapped. Pending-free blocks (record_stream) are not
// free, so their granules never move.
//
// Accounting: reserved bytes are mapped bytes; an arena counts as one
// segment from its creation until release_free_segments finds it all hole
// and gives the reservation back.
//
// Note [One arena for small and large]
// PyTorch keeps requests up to 1 MiB in a pool of their own, carved from
// 2 MiB segments, so that small blocks do not split the large ones' free
// memory. With plain segments that is right. With arenas it costs twice:
//   - a small segment is given back only when wholly free, and a few small
//     blocks that outlive the rest (a parameter, a step counter) keep
//     several segments of 2 MiB each;
//   - the large arena's free slivers, the partly used granules at the ends
//     of its live runs, are memory no large request can use, and stitching
//     cannot move them (only whole granules move).
// With vmm=shared (select_pool: largest_small_ is 0) every default-pool
// request goes to the large pool's arena. Best fit puts a small request in
// the smallest free block that holds it, which is most often one of those
// slivers, so small blocks live in granules that large blocks have mapped
// already; and a small block that stays behind pins one granule at most,
// anywhere, instead of a segment of its own. Measured on the stress suite
// (docs/benchmarks/2026-11-22-shared-arena-cpu.md), against vmm=on:
// transformer_lm needs 1.015 times its live bytes instead of 1.075,
// seq2seq_varlen 1.022 instead of 1.071, seq2seq 1.017 instead of 1.040,
// lstm_varlen 1.061 instead of 1.072; mlp, batch_growth, size_sweep and
// interleaved_lifetimes need 2 to 4 MiB more. The cost is in the stats: the
// small_pool figures stay zero, as every block counts as large_pool. The
// fast path is unchanged (the limit is a member instead of a constant).
//
// Note [Whole granules]
// Best fit hands out the front of the free block it picks, so blocks pack
// end to end and a block's start lands wherever the one before it ended. A
// block of 4 MiB that starts 0.7 MiB into a granule lies over three
// granules, and when it is freed between live neighbours it gives back one
// whole granule and two slivers, which stitching cannot move. So in an
// arena a request that is a whole number of granules starts on the first
// granule boundary of its free block, when the block has room for it there
// (granule_offset, align_to_granule); the front part stays free, for small
// requests to fill. Such a block lies over exactly its own granules, and
// freed, gives all of them back. Other sizes pack from the front as before:
// aligning them too left a sliver before every block, and cost 4 to 24 MiB
// on seven workloads of the stress suite. Measured on the stress suite
// (docs/benchmarks/2026-11-22-whole-granules-cpu.md), against front
// placement: lstm_varlen (a 4 MiB state per step) needs 198 MiB instead of
// 202, mlp_fixed 150 instead of 152, batch_growth 1622 instead of 1624;
// encoder_padding needs 540 instead of 534 and transformer_lm and
// seq2seq_varlen 2 MiB more, as the 8 MiB blocks they keep for the whole run
// (an embedding, its gradient and optimizer state) leave their slivers in
// front of them. A cache hit that would be placed differently (a free block
// that is larger, and does not start on a granule boundary) takes the general
// path; an exact fit stays on the fast path.
//
// Note [Shared granules]
// Stitching moves whole granules only. What stays behind when blocks of
// sizes that are not whole granules come and go are slivers: the free part
// of a granule that a live block also lies over. On interleaved_lifetimes
// (random sizes, blocks living for hundreds of steps among short-lived
// ones), at the first failed request 86 MiB of the 116 MiB free was in such
// slivers, 95 of them, none usable by a request of a few MiB.
//
// A sliver at the end of a granule (free from offset o to the end, a live
// block before it) has the same bytes, physically, as the end of any other
// address range that maps that granule. So a window taken in a hole of the
// same arena can map that granule a second time as its first granule, the
// request starting at offset o there; and a sliver at the start of a granule
// (free up to offset p, a live block after it) can be its last granule, when
// the request ends at or before p there (plan_share picks the pair that
// leaves the fewest granules to find; map_share maps them). The window's
// other granules are new or stitched. So a request needs up to two granules
// fewer than it spans.
//
// The two mappings are twins (Segment::twins). Each owns the bytes at its
// own offsets that the other does not: the lender keeps its live part, the
// window gets the rest, and each marks the other's part as a lent block
// (BlockState::kLent), which is mapped but never free, handed out, or
// counted: reserved counts the physical granule once (types.hpp I9, I13).
// Same arena means same stream, so reusing a free sliver through the second
// address is ordered after its last use like any cache hit.
//
// When: only near a full device, since a window costs backend calls and
// stitching may synchronize the stream.
//   - Ladder step 2, after stitching found too few whole granules for the
//     ordinary window (grow_arena).
//   - Before the cache (share_first), once reserved memory would pass 95% of
//     what the allocator may reserve (share_from_), for a request of more
//     than a granule that is not a whole number of them, when the window
//     takes fewer granules than the best cached fit would (granules_taken).
//     Waiting for the ladder is too late: a request that fails falls short
//     by more than two granules, and by then the slivers have piled up; near
//     the limit, every such request uses up to two of them instead of
//     splitting a cached block and leaving one more. (Whole-granule requests
//     leave no sliver where they start on a boundary, Note [Whole granules].)
//
// Twins part again lazily, whenever free granules are gathered (untwin_free:
// stitching, release, empty_cache, and share_first): a twin whose own part is
// all free is unmapped (after its stream is synchronized) and becomes a hole,
// and its lent piece in the other twin becomes free memory there. A twin is
// never shared again; one granule maps at most twice.
//
// Measured on the stress suite (docs/benchmarks/2026-11-22-shared-granules-cpu.md),
// against share=0: interleaved_lifetimes needs 608 MiB instead of 660 (1.03
// times its live bytes instead of 1.12), two_stream 920 instead of 948, mlp
// 132 instead of 134 (what the model of PyTorch's allocator needs),
// mlp_fixed 148 instead of 150, encoder_padding, seq2seq and size_sweep 2 to
// 4 MiB less; cnn_multiscale 2 MiB more; the rest the same.
#include <algorithm>
#include <cinttypes>
#include <cstdio>

#include "device/device_allocator.hpp"
#include "device/device_allocator_inl.hpp"

namespace pyalloc {

namespace {

uintptr_t end_of(const Block* b) { return b->addr + b->size; }

bool usable(const Block* b) { return b->state == BlockState::kFree || b->state == BlockState::kHole; }

}  // namespace

size_t DeviceAllocator::granule() {
  if (granule_ == 0) granule_ = backend_->granularity(device_);
  return granule_;
}

Segment* DeviceAllocator::arena_for(Pool& pool, StreamId stream) {
  for (Segment* a : pool.arenas) {
    if (a->stream == stream) return a;
  }
  const size_t g = granule();
  if (g == 0 || g % kBlockAlign != 0) {
    last_backend_error_ = "the backend has no usable virtual-memory granularity";
    return nullptr;
  }
  // Twice the device, so that address space is rarely what runs out: live
  // blocks would have to be spread thinly over all of it.
  const size_t size = round_up_to(2 * device_total(), g);
  uintptr_t va = 0;
  if (!succeeded(backend_->reserve(device_, size, &va))) return nullptr;
  Segment* arena = add_segment(pool, stream, va, size, BlockState::kHole);
  arena->arena = true;
  arena->phys.resize(size / g);
  pool.arenas.push_back(arena);
  return arena;
}

// Splits `block` (free but out of its free set, or a hole) at `offset`
// bytes; the returned second part has the same state.
Block* DeviceAllocator::split_block(Block* block, size_t offset) {
  Block* rest = new_block();
  split_into(block, rest, offset);
  rest->state = block->state;
  return rest;
}

// `block` (free, out of the free set) joins its free neighbours and goes into
// the free set; returns the merged block.
Block* DeviceAllocator::insert_coalesced(Block* block) {
  make_spare_room(2);
  block = coalesce(block);
  insert_free(block);
  return block;
}

// Takes [lo, hi) out of `block` (free, in its free set, holding [lo, hi)):
// what lies before and after it stays free, in the free set; the block of
// [lo, hi) is returned out of the free set, still kFree for the caller to
// change.
Block* DeviceAllocator::carve_free(Block* block, uintptr_t lo, uintptr_t hi) {
  assert(block->is_free() && block->addr <= lo && end_of(block) >= hi);
  erase_free(block);
  Block* middle = block;
  if (lo > block->addr) {
    middle = split_block(block, lo - block->addr);
    insert_free(block);
  }
  if (end_of(middle) > hi) insert_free(split_block(middle, hi - middle->addr));
  return middle;
}

// Splits `block` (free, in its free set) at `offset` bytes: both parts stay
// free, in the free set; returns the part after.
Block* DeviceAllocator::split_free(Block* block, size_t offset) {
  erase_free(block);
  Block* rest = split_block(block, offset);
  insert_free(block);
  insert_free(rest);
  return rest;
}

// Merges a hole with the holes beside it.
void DeviceAllocator::merge_holes(Block* hole) {
  make_spare_room(2);
  if (hole->prev != nullptr && hole->prev->state == BlockState::kHole) {
    hole = hole->prev;
    absorb_next(hole);
  }
  if (hole->next != nullptr && hole->next->state == BlockState::kHole) absorb_next(hole);
}

// ---- choosing where to grow -------------------------------------------------------

namespace {

// Granules that [lo, hi) needs mapped: the holes it overlaps, widened to
// granule boundaries (holes are granule-aligned, so the widened overlap
// stays inside the hole).
size_t granules_to_map(const Segment* arena, const Block* first, uintptr_t lo, uintptr_t hi, size_t g) {
  size_t bytes = 0;
  for (const Block* b = first; b != nullptr && b->addr < hi; b = b->next) {
    if (b->state != BlockState::kHole) continue;
    const uintptr_t a = std::max(lo, b->addr) - arena->base;
    const uintptr_t z = std::min(hi, end_of(b)) - arena->base;
    if (a < z) bytes += round_up_to(z, g) - a / g * g;
  }
  return bytes / g;
}

}  // namespace

// The window of `rounded` bytes in a run of free blocks and holes that needs
// the fewest granules mapped (then the lowest address). Candidates start at a
// block's start or end at a block's end: the cost only changes there.
DeviceAllocator::Window DeviceAllocator::best_window(Segment* arena, size_t rounded) {
  const size_t g = granule_;
  Window best;
  auto consider = [&](Block* first, uintptr_t lo) {
    const size_t cost = granules_to_map(arena, first, lo, lo + rounded, g);
    if (!best.found || cost < best.granules || (cost == best.granules && lo < best.lo)) {
      best = Window{true, lo, cost};
    }
  };
  for (Block* b = arena->head; b != nullptr; b = b->next) {
    if (!usable(b)) continue;
    // Forward from b's start.
    size_t span = 0;
    for (const Block* c = b; c != nullptr && usable(c) && span < rounded; c = c->next) span += c->size;
    if (span >= rounded) consider(b, b->addr);
    // Backward from b's end.
    span = 0;
    Block* first = b;
    for (Block* c = b; c != nullptr && usable(c) && span < rounded; c = c->prev) {
      span += c->size;
      first = c;
    }
    if (span >= rounded && b->prev != nullptr) consider(first, end_of(b) - rounded);
  }
  return best;
}

// ---- placing a block in a free block --------------------------------------------

// The block to hand out for a request of `rounded` bytes from `block` (a
// free block of an arena, in its free set): `block` itself, or the part of
// it from granule_offset() on, whose front part stays free (Note [Whole
// granules]).
Block* DeviceAllocator::align_to_granule(Block* block, size_t rounded) {
  const size_t offset = granule_offset(block, rounded);
  return offset == 0 ? block : split_free(block, offset);
}

// ---- shared granules (Note [Shared granules]) --------------------------------------

// The block of `segment` that holds `addr` (inside the segment).
Block* DeviceAllocator::block_at(Segment* segment, uintptr_t addr) {
  Block* b = segment->head;
  while (end_of(b) <= addr) b = b->next;
  return b;
}

// The lent block of twin granule `slot`: at its start or at its end (I13),
// so the walk from the granule's first block reaches it inside the granule.
Block* DeviceAllocator::lent_block(Segment* arena, size_t slot) {
  Block* b = block_at(arena, arena->base + slot * granule_);
  while (b->state != BlockState::kLent) b = b->next;
  return b;
}

// Makes [from, to), bytes of one free block, a lent block.
void DeviceAllocator::lend(Segment* arena, uintptr_t from, uintptr_t to) {
  carve_free(block_at(arena, from), from, to)->state = BlockState::kLent;
}

// The window for `rounded` bytes in a hole of `arena` whose first granule
// maps the free end of a granule in use and whose last maps the free start of
// another, either one, or neither: the choice that needs the fewest granules
// of its own (SharePlan::fresh). Not found when nothing can be shared.
DeviceAllocator::SharePlan DeviceAllocator::plan_share(const Segment* arena, size_t rounded) const {
  const size_t g = granule_;
  const uintptr_t base = arena->base;
  // A free block that starts inside a granule and runs to its end can lend
  // that end (from `offset` on); one that ends inside a granule, running from
  // its start, can lend that start (up to `offset`). A twin lends nothing.
  struct Sliver {
    size_t slot;
    size_t offset;
  };
  std::vector<Sliver> ends, starts;
  for (const Block* b = arena->head; b != nullptr; b = b->next) {
    if (!b->is_free()) continue;
    const size_t lo = b->addr - base;
    const size_t hi = lo + b->size;
    if (lo % g != 0 && hi >= round_up_to(lo, g) && arena->twins.count(lo / g) == 0) ends.push_back({lo / g, lo % g});
    if (hi % g != 0 && lo <= hi / g * g && arena->twins.count(hi / g) == 0) starts.push_back({hi / g, hi % g});
  }
  SharePlan best;
  if (ends.empty() && starts.empty()) return best;
  std::sort(starts.begin(), starts.end(), [](const Sliver& a, const Sliver& b) { return a.offset < b.offset; });

  // Starting `offset` into a granule that maps ends[i] (or on a boundary),
  // ending in one that maps the smallest free start that holds its last bytes.
  auto consider = [&](size_t front, size_t offset) {
    SharePlan c;
    c.rounded = rounded;
    c.front = front;
    c.offset = offset;
    c.granules = (offset + rounded + g - 1) / g;
    const size_t tail = (offset + rounded) % g;
    if (tail != 0) {
      auto it = std::lower_bound(starts.begin(), starts.end(), tail,
                                 [](const Sliver& s, size_t want) { return s.offset < want; });
      while (it != starts.end() && it->slot == front) ++it;
      if (it != starts.end()) {
        c.back = it->slot;
        c.back_own = it->offset;
      }
    }
    c.fresh = c.granules - (c.front != SharePlan::kNone) - (c.back != SharePlan::kNone);
    if (c.fresh < best.fresh) best = c;
  };
  consider(SharePlan::kNone, 0);
  for (const Sliver& s : ends) consider(s.slot, s.offset);
  if (best.front == SharePlan::kNone && best.back == SharePlan::kNone) return SharePlan{};

  // A hole to hold the window, lowest first.
  const Block* hole = arena->head;
  while (hole != nullptr && !(hole->state == BlockState::kHole && hole->size >= best.granules * g)) hole = hole->next;
  if (hole == nullptr) return SharePlan{};
  best.lo = hole->addr;
  best.found = true;
  return best;
}

// Carries out `plan` (plan_share, on the arena as it is now), taking its
// fresh granules from the back of `handles`: returns the free block of
// exactly the planned range, or nullptr (the arena as it was, `handles` as it was) when a map
// failed.
Block* DeviceAllocator::map_share(Segment* arena, const SharePlan& plan, std::vector<PhysHandle>* handles) {
  const size_t g = granule_;
  const uintptr_t base = arena->base;
  const uintptr_t lo = plan.lo;
  const uintptr_t hi = lo + plan.granules * g;
  assert(handles->size() >= plan.fresh);
  auto twin_of = [&](size_t i) {
    if (i == 0 && plan.front != SharePlan::kNone) return plan.front;
    if (i + 1 == plan.granules && plan.back != SharePlan::kNone) return plan.back;
    return SharePlan::kNone;
  };

  // Map first, so that a failure leaves the arena as it was.
  std::vector<PhysHandle> mapped;
  for (size_t i = 0; i < plan.granules; ++i) {
    const size_t twin = twin_of(i);
    PhysHandle h;
    if (twin != SharePlan::kNone) {
      h = arena->phys[twin];
    } else {
      h = handles->back();
      handles->pop_back();
    }
    if (!succeeded(backend_->map(device_, lo + i * g, h))) {
      if (twin == SharePlan::kNone) handles->push_back(h);
      for (size_t j = 0; j < mapped.size(); ++j) {
        backend_->unmap(device_, lo + j * g, g);
        if (twin_of(j) == SharePlan::kNone) handles->push_back(mapped[j]);
      }
      return nullptr;
    }
    mapped.push_back(h);
  }

  const size_t first = (lo - base) / g;
  for (size_t i = 0; i < plan.granules; ++i) arena->phys[first + i] = mapped[i];
  arena->mapped += plan.granules * g;
  size_t shared = 0;
  for (const size_t i : {size_t{0}, plan.granules - 1}) {
    const size_t twin = twin_of(i);
    if (twin == SharePlan::kNone) continue;
    arena->twins[first + i] = twin;
    arena->twins[twin] = first + i;
    ++shared;
  }
  if (plan.front != SharePlan::kNone) lend(arena, base + plan.front * g + plan.offset, base + (plan.front + 1) * g);
  if (plan.back != SharePlan::kNone) lend(arena, base + plan.back * g, base + plan.back * g + plan.back_own);
  arena->doubled += shared * g;
  stats_.num_shared_granules += static_cast<int64_t>(shared);
  stats_.reserved_bytes.increase(arena->pool->stat, static_cast<int64_t>(plan.fresh * g));
  trace_.record(TraceAction::kSegmentMap, lo, plan.granules * g, arena->stream);

  // Carve the window out of the hole: [lo, lo + offset) lent to the front
  // twin, the request's free block, then the back twin's lent end.
  Block* hole = block_at(arena, lo);
  assert(hole->state == BlockState::kHole && hole->addr == lo);
  if (end_of(hole) > hi) split_block(hole, hi - lo);  // the rest stays a hole
  Block* middle = hole;
  if (plan.front != SharePlan::kNone) {
    middle = split_block(hole, plan.offset);
    hole->state = BlockState::kLent;
  }
  if (plan.back != SharePlan::kNone) {
    Block* tail = split_block(middle, hi - g + plan.back_own - middle->addr);
    tail->state = BlockState::kLent;
  }
  middle->state = BlockState::kFree;
  Block* block = insert_coalesced(middle);
  reserved_changed();
  // The free memory beside the window has joined it: split off what lies
  // before and after the planned range, so that the request lands on the
  // granules planned for it (and a whole-granule request stays off a boundary).
  const uintptr_t at = lo + plan.offset;
  if (block->addr < at) block = split_free(block, at - block->addr);
  if (block->size > plan.rounded) split_free(block, plan.rounded);
  return block;
}

// Unmaps twin granule `slot` of `arena`, whose own part is free, and gives
// its bytes back to the other twin, whose lent piece becomes free memory.
// The arena's stream must be synchronized.
void DeviceAllocator::untwin(Segment* arena, size_t slot) {
  const size_t g = granule_;
  const uintptr_t lo = arena->base + slot * g;
  const uintptr_t hi = lo + g;
  const size_t other = arena->twins.at(slot);

  Block* theirs = lent_block(arena, other);
  theirs->state = BlockState::kFree;
  insert_coalesced(theirs);

  backend_->unmap(device_, lo, g);
  trace_.record(TraceAction::kSegmentUnmap, lo, g, arena->stream);
  arena->phys[slot] = PhysHandle{};
  arena->twins.erase(slot);
  arena->twins.erase(other);
  arena->mapped -= g;
  arena->doubled -= g;

  // This granule's blocks become one hole: its lent piece and the part of
  // the free block beside it that lies inside the granule.
  Block* mine = lent_block(arena, slot);
  Block* beside = mine->addr == lo ? mine->next : mine->prev;
  Block* own = carve_free(beside, std::max(beside->addr, lo), std::min(end_of(beside), hi));
  own->state = BlockState::kHole;
  mine->state = BlockState::kHole;
  Block* hole = own->addr < mine->addr ? own : mine;
  make_spare_room(1);
  absorb_next(hole);
  merge_holes(hole);
  reserved_changed();
}

// Untwins (untwin) every twin of `arena` whose own part is all free, unless
// that part overlaps [skip_lo, skip_hi); synchronizes the stream first, once.
// False when the stream could not be synchronized.
bool DeviceAllocator::untwin_free(Segment* arena, uintptr_t skip_lo, uintptr_t skip_hi) {
  std::vector<size_t> slots;
  for (const auto& t : arena->twins) slots.push_back(t.first);
  std::sort(slots.begin(), slots.end());
  bool synchronized = false;
  for (size_t slot : slots) {
    if (arena->twins.count(slot) == 0) continue;  // its twin went first
    const uintptr_t lo = arena->base + slot * granule_;
    const uintptr_t hi = lo + granule_;
    // The granule's own part is the rest of it, beside its lent piece: all
    // free when the block on that side is free and reaches the granule's edge.
    const Block* mine = lent_block(arena, slot);
    const bool lent_first = mine->addr == lo;
    const Block* own = lent_first ? mine->next : mine->prev;
    if (!own->is_free() || (lent_first ? end_of(own) < hi : own->addr > lo)) continue;
    if (own->addr < skip_hi && end_of(own) > skip_lo) continue;
    if (!synchronized && !(synchronized = synchronize_stream(arena))) return false;
    untwin(arena, slot);
  }
  return true;
}

// ---- mapping and unmapping -------------------------------------------------------

// Maps handles (taken from the back of `handles`) over the granule-aligned
// range [lo, hi) of `hole`; what gets mapped becomes free and coalesces.
// Returns the free block now holding [lo, hi), or nullptr when a map failed
// (what was mapped before the failure is free; the rest stays a hole).
Block* DeviceAllocator::fill_hole(Block* hole, uintptr_t lo, uintptr_t hi, std::vector<PhysHandle>* handles) {
  Segment* arena = hole->segment;
  const size_t g = granule_;
  uintptr_t mapped_to = lo;
  bool ok = true;
  while (mapped_to < hi) {
    const PhysHandle h = handles->back();
    if (!succeeded(backend_->map(device_, mapped_to, h))) {
      ok = false;
      break;
    }
    handles->pop_back();
    arena->phys[(mapped_to - arena->base) / g] = h;
    arena->mapped += g;
    stats_.reserved_bytes.increase(arena->pool->stat, static_cast<int64_t>(g));
    trace_.record(TraceAction::kSegmentMap, mapped_to, g, arena->stream);
    mapped_to += g;
  }
  if (mapped_to == lo) return nullptr;
  // Carve [lo, mapped_to) out of the hole as a free block.
  Block* middle = hole;
  if (lo > hole->addr) middle = split_block(hole, lo - hole->addr);
  if (end_of(middle) > mapped_to) split_block(middle, mapped_to - middle->addr);
  middle->state = BlockState::kFree;
  Block* merged = insert_coalesced(middle);
  reserved_changed();
  return ok ? merged : nullptr;
}

// Unmaps the granule-aligned range [lo, hi) of the free block `block`
// (which must be in its free set); the handles go to `keep`, or back to the
// backend when `keep` is null. The arena's stream must be synchronized.
void DeviceAllocator::unmap_free_range(Block* block, uintptr_t lo, uintptr_t hi, std::vector<PhysHandle>* keep) {
  Segment* arena = block->segment;
  const size_t g = granule_;
  Block* middle = carve_free(block, lo, hi);
  for (uintptr_t va = lo; va < hi; va += g) {
    PhysHandle& slot = arena->phys[(va - arena->base) / g];
    backend_->unmap(device_, va, g);
    trace_.record(TraceAction::kSegmentUnmap, va, g, arena->stream);
    if (keep != nullptr) {
      keep->push_back(slot);
    } else {
      backend_->phys_release(device_, slot);
      ++stats_.num_device_free;
    }
    slot = PhysHandle{};
    arena->mapped -= g;
    stats_.reserved_bytes.decrease(arena->pool->stat, static_cast<int64_t>(g));
  }
  middle->state = BlockState::kHole;
  merge_holes(middle);
  reserved_changed();
}

// Waits for the work queued on the arena's stream, so its free blocks are
// no longer in use. False when the backend cannot record an event.
bool DeviceAllocator::synchronize_stream(const Segment* arena) {
  EventHandle event = 0;
  if (!succeeded(backend_->event_record(device_, arena->stream, &event))) return false;
  backend_->event_synchronize(device_, event);
  backend_->event_release(device_, event);
  return true;
}

// The granule-aligned interior of a free block of an arena: [*lo, *hi).
bool DeviceAllocator::free_interior(const Block* b, uintptr_t* lo, uintptr_t* hi) const {
  const uintptr_t base = b->segment->base;
  *lo = base + round_up_to(b->addr - base, granule_);
  *hi = base + (end_of(b) - base) / granule_ * granule_;
  return *lo < *hi;
}

template <typename F>
void DeviceAllocator::for_each_arena(F fn) {
  for (Pool* pool : pools()) {
    for (Segment* a : pool->arenas) fn(a);
  }
}

// Unmaps up to `wanted` granules wholly inside free blocks of any arena,
// except blocks overlapping [skip_lo, skip_hi); the handles go to `keep`
// (or back to the backend when null). Returns the granules unmapped.
size_t DeviceAllocator::unmap_free_granules(size_t wanted, uintptr_t skip_lo, uintptr_t skip_hi,
                                            std::vector<PhysHandle>* keep) {
  size_t done = 0;
  for_each_arena([&](Segment* arena) {
    if (!arena->twins.empty() && !untwin_free(arena, skip_lo, skip_hi)) return;
    bool synchronized = false;
    for (Block* b = arena->head; b != nullptr && done < wanted; b = b->next) {
      uintptr_t lo, hi;
      if (!b->is_free() || !free_interior(b, &lo, &hi)) continue;
      if (b->addr < skip_hi && end_of(b) > skip_lo) continue;
      if (!synchronized && !(synchronized = synchronize_stream(arena))) return;
      const size_t n = std::min((hi - lo) / granule_, wanted - done);
      hi = lo + n * granule_;
      done += n;
      Block* before = b->prev;
      unmap_free_range(b, lo, hi, keep);
      // b may be gone: go on from what now precedes the hole.
      b = before != nullptr ? before : arena->head;
    }
  });
  return done;
}

// ---- growing and stitching ---------------------------------------------------------

// Granules that `block` (free, in an arena) would take from the free memory
// for `rounded` bytes placed where alloc_block places them: those the range
// overlaps, less the ones at the block's ends that live blocks use already.
size_t DeviceAllocator::granules_taken(const Block* block, size_t rounded) const {
  const size_t g = granule_;
  const size_t lo = block->addr - block->segment->base;
  const size_t hi = lo + block->size;
  const size_t at = lo + granule_offset(block, rounded);
  const size_t first = at / g;
  const size_t last = (at + rounded - 1) / g;
  size_t n = last - first + 1;
  const bool front_used = lo % g != 0;  // the block before it is in use (I2, I9)
  const bool back_used = hi % g != 0;
  if (front_used && first == lo / g) --n;
  if (back_used && last == (hi - 1) / g && !(front_used && lo / g == (hi - 1) / g)) --n;
  return n;
}

// Near a full device (Note [Shared granules]): serves `rounded` bytes from a
// shared window (plan_share) when it takes fewer granules than the best
// cached fit would. Twins whose own part is free part first, and the window's
// fresh granules come from the backend or from free blocks (stitching). The
// free sets may change even when it returns nullptr.
Block* DeviceAllocator::share_first(Pool& pool, size_t rounded, StreamId stream) {
  Segment* arena = arena_for(pool, stream);
  if (arena == nullptr) return nullptr;
  if (!arena->twins.empty() && !untwin_free(arena, 0, 0)) return nullptr;
  const SharePlan plan = plan_share(arena, rounded);
  if (!plan.found) return nullptr;
  if (const Block* cached = pool.free_blocks.best_fit(stream, rounded)) {
    if (plan.fresh >= granules_taken(cached, rounded)) return nullptr;
  }
  std::vector<PhysHandle> handles = new_granules(plan.fresh);
  SharePlan now = plan;
  if (handles.size() < plan.fresh) {
    unmap_free_granules(plan.fresh - handles.size(), 0, 0, &handles);
    if (handles.size() < plan.fresh) {
      release_granules(handles);
      return nullptr;
    }
    now = plan_share(arena, rounded);  // stitching may have split or joined free blocks
  }
  Block* block = now.found && now.fresh <= handles.size() ? map_share(arena, now, &handles) : nullptr;
  release_granules(handles);
  return block;
}

// Up to `n` new granules from the backend, within the reserved limit.
std::vector<PhysHandle> DeviceAllocator::new_granules(size_t n) {
  const size_t g = granule_;
  std::vector<PhysHandle> handles;
  handles.reserve(n);
  const size_t limit = reserved_limit();
  while (handles.size() < n) {
    const size_t reserved = static_cast<size_t>(stats_.reserved_bytes.current(kStatAll)) + handles.size() * g;
    if (reserved > limit || limit - reserved < g) break;
    PhysHandle h;
    if (!succeeded(backend_->phys_create(device_, g, &h))) break;
    ++stats_.num_device_alloc;
    handles.push_back(h);
  }
  return handles;
}

void DeviceAllocator::release_granules(const std::vector<PhysHandle>& handles) {
  for (const PhysHandle& h : handles) {
    backend_->phys_release(device_, h);
    ++stats_.num_device_free;
  }
}

// Ladder step 0 for a pool with arenas (stitch false), and step 2 (stitch
// true: granules may be taken from free blocks elsewhere on the device).
Block* DeviceAllocator::grow_arena(Pool& pool, size_t rounded, StreamId stream, bool stitch) {
  Segment* arena = arena_for(pool, stream);
  if (arena == nullptr) return nullptr;
  const size_t g = granule_;
  const Window w = best_window(arena, rounded);
  if (!w.found) return nullptr;  // the reservation itself is full
  const uintptr_t lo = arena->base + (w.lo - arena->base) / g * g;
  const uintptr_t hi = arena->base + round_up_to(w.lo + rounded - arena->base, g);

  // Gather every handle first, so a failure leaves the arena as it was.
  std::vector<PhysHandle> handles = new_granules(w.granules);
  if (handles.size() < w.granules && stitch) {
    const size_t before = handles.size();
    unmap_free_granules(w.granules - before, lo, hi, &handles);
    if (handles.size() > before) {
      stats_.num_stitches += 1;
      stats_.stitched_bytes += static_cast<int64_t>((handles.size() - before) * g);
    }
  }
  Block* shared = nullptr;
  if (handles.size() < w.granules && stitch && sharing_) {
    const SharePlan plan = plan_share(arena, rounded);
    if (plan.found && plan.fresh <= handles.size()) shared = map_share(arena, plan, &handles);  // < w.granules
  }
  if (handles.size() < w.granules || shared != nullptr) {
    release_granules(handles);
    return shared;
  }

  // Map the window's holes, lowest first. Stitching may have merged holes
  // in this arena, so find the block holding `lo` now; fill_hole
  // coalesces, which may delete the blocks after a hole: go on from the
  // block it returns.
  Block* b = block_at(arena, lo);
  uintptr_t cursor = lo;
  while (b != nullptr && cursor < hi && !handles.empty()) {
    if (end_of(b) <= cursor) {
      b = b->next;
    } else if (b->state != BlockState::kHole) {
      cursor = end_of(b);
    } else {
      const uintptr_t z = std::min(hi, end_of(b));
      b = fill_hole(b, std::max(cursor, b->addr), z, &handles);
      if (b == nullptr) break;  // a map failed
      cursor = z;
    }
  }
  release_granules(handles);  // left over only when a map failed
  return pool.free_blocks.best_fit(stream, rounded);
}

// Ladder step 2. A pool without arenas grows by plain segments from the
// backend: the arenas' free granules go back to it first.
Block* DeviceAllocator::stitch(Pool& pool, size_t rounded, StreamId stream) {
  if (vmm_ == VmmMode::kOff) return nullptr;
  if (pool.in_arenas) return grow_arena(pool, rounded, stream, /*stitch=*/true);
  if (release_arena_memory(segment_size_for(pool, rounded)) == 0) return nullptr;
  return grow(pool, rounded, stream);
}

// Gives back the granules wholly inside free blocks, and the reservations
// of arenas left with nothing mapped, until `bytes` (0: all).
size_t DeviceAllocator::release_arena_memory(size_t bytes) {
  if (granule_ == 0) return 0;  // no arena was ever made
  const size_t wanted = bytes == 0 ? SIZE_MAX : (bytes + granule_ - 1) / granule_;
  const size_t released = unmap_free_granules(wanted, 0, 0, nullptr) * granule_;
  std::vector<Segment*> empty;
  for_each_arena([&](Segment* a) {
    if (a->mapped == 0) empty.push_back(a);
  });
  for (Segment* a : empty) release_arena(a);
  return released;
}

void DeviceAllocator::release_arena(Segment* arena) {
  // Nothing mapped means one hole spans the reservation (I9).
  Pool& pool = *arena->pool;
  pool.arenas.erase(std::find(pool.arenas.begin(), pool.arenas.end(), arena));
  segments_.erase(arena->base);
  stats_.segment.decrease(pool.stat, 1);
  backend_->release_reservation(device_, arena->base, arena->size);
  delete_block(arena->head);
  delete arena;
}

}  // namespace pyalloc
