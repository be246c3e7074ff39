// share.cpp: shared granules, near a full device.
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
// When: only near a full device, and only when whole granules run short,
// since a window costs backend calls (on a GPU, a map and an unmap of each
// granule it stitches: microseconds each) and stitching may synchronize the
// stream.
//   - Ladder step 2, after stitching found too few whole granules for the
//     ordinary window (grow_arena).
//   - Before the cache (share_first), once reserved memory would pass 95% of
//     what the allocator may reserve (share_from_), for a request of more
//     than a granule, when the whole
//     granules the device could still put behind it (unreserved ones, and
//     those wholly inside free blocks of its arenas: spare_covers) are fewer
//     than it spans, and the window takes fewer granules than the best cached
//     fit would (granules_taken). A cached block that fits with no split is
//     taken as it is, on either path (alloc_block).
//     Waiting for the ladder is too late: a request that fails falls short
//     by more than two granules, and by then the slivers have piled up; once
//     whole granules run short, every such request uses up to two of them
//     instead of splitting a cached block and leaving one more. A request of
//     a whole number of granules, which starts on a boundary elsewhere (Note
//     [Whole granules]), saves a granule only when a free end and a free
//     start hold a granule between them; until 2026-11-27 it never shared,
//     and lstm_varlen needed 198 MiB instead of 196 (its 16 MiB requests one
//     granule short at 196; no other workload of the stress suite moved).
//     While whole granules cover the request, splitting the cached fit costs
//     no remap. Sharing then as well (every request near a full device, the
//     rule until 2026-11-25) saved 46 MiB more on interleaved_lifetimes (608
//     MiB instead of 654) and 32 on two_stream, but remapped on almost every
//     request: 1,000-1,500 ns per operation on the sim backend under
//     pressure against 180-240 now, and 4-6 times plain segments on the
//     ViT-L and ResNet-50 traces at 1.05 times their peak live bytes, where a
//     GPU would pay a map per granule besides
//     (docs/benchmarks/2026-11-25-scale-cpu.md).
//
// Twins part again lazily, whenever free granules are gathered (untwin_free:
// stitching, release, empty_cache, and share_first): a twin whose own part is
// all free is unmapped (after its stream is synchronized) and becomes a hole,
// and the pieces the other twin lent it become free memory there. A window
// never shares a twin again; a move may merge its group with another (Note
// [Groups of twins] in groups.cpp), and then untwin gives a parting twin's
// bytes to the next twin of its group.
//
// Measured on the stress suite against share=0 (the rule of when as it is
// now: docs/benchmarks/2026-11-25-scale-cpu.md): interleaved_lifetimes needs
// 654 MiB instead of 660, mlp 132 instead of 134 (what the model of
// PyTorch's allocator needs), encoder_padding, seq2seq, transformer_lm,
// resnet50_b256_s224, llama1b_b4_s4096 and llama7b_b1_s2048 2 to 4 MiB less;
// the rest the same.
#include <algorithm>
#include <vector>

#include "blocks/arena.hpp"
#include "blocks/sliver_index_inl.hpp"
#include "device/device_allocator.hpp"
#include "device/fast_path.hpp"

namespace pyalloc {

// Near a full device (Note [Shared granules]): serves `rounded` bytes from a
// shared window (plan_share) when it takes fewer granules than the best
// cached fit would. Twins whose own part is free part first, and the window's
// fresh granules come from the backend, after free blocks give theirs back
// (stitching) when the limit is near. The free sets may change even when it
// returns nullptr. `fit`: the request's cached best fit, as the caller found
// it (nullptr: none).
Block* DeviceAllocator::share_first(Pool& pool, size_t rounded, StreamId stream, const Block* fit) {
  Segment* arena = arena_for(pool, stream);
  if (arena == nullptr) return nullptr;
  if (spare_covers(rounded, fit)) return nullptr;
  index_slivers();  // untwin_free and plan_share read the sliver indexes
  if (!arena->twins.empty() && !untwin_free(arena, 0, 0)) return nullptr;
  const SharePlan plan = plan_share(arena, rounded, granule_);
  if (!plan.found) return nullptr;
  if (const Block* cached = pool.free_blocks.best_fit(stream, rounded)) {
    if (plan.fresh >= granules_taken(cached, rounded, granule_)) return nullptr;
  }
  // The fresh granules: free ones moved (stitching), then new ones.
  std::vector<PhysHandle>& spares = spares_;
  spares.clear();
  SharePlan now = plan;
  if (const size_t lacking = granules_lacking(plan.fresh); lacking > 0) {
    unmap_free_granules(lacking, 0, 0, &spares);
    now = plan_share(arena, rounded, granule_);  // stitching may have split or joined free blocks
  }
  Block* block = now.found && granules_lacking(now.fresh) == 0 ? map_share(arena, now, &spares) : nullptr;
  release_chunks(spares.data(), spares.size());  // what the window did not take
  spares.clear();
  return block;
}

// Note [Whole-granule count]
// Near a full device a request that would split its cached fit asks first
// whether whole granules cover it without sharing one (spare_covers): those
// the device may still reserve before its limit, and those wholly inside free
// blocks of its arenas, which stitching takes. The second are counted once,
// by one walk of the arenas (count_whole_granules), the first time they are
// needed, and then kept by free-set membership (count_cached and
// uncount_cached in device/blocks_inl.hpp, on the fast path too: a flag of
// the block's segment, Segment::counted, read beside the fields a cache hit
// reads anyway, and a few instructions while it is set) until reserved
// memory falls under 90% of the limit (relax_below), or the limit moves above
// it (settle_whole_count), as the sliver indexes are dropped. A request they
// cover takes its fit as it would with no sharing, so the fast path serves
// one whose count passes it by a granule (the general path's test,
// covered_without_sharing, also counts what may still be reserved), and
// only a request they do not cover builds the sliver indexes for
// plan_share. Until 2026-11-27 the sliver indexes counted them: asked on
// nearly every split, they stayed on, and kept every call of a churn of 10^3
// to 10^4 blocks at 1.05 times their peak on the general path, where no
// request shared a granule (tools/bench/scale.py: 630 and 471 instructions
// per operation; 516 and 349 with the count,
// docs/benchmarks/2026-11-27-whole-granule-count-cpu.md).
bool DeviceAllocator::spare_covers(size_t rounded, const Block* fit) {
  if (covered_without_sharing(rounded, fit)) return true;
  if (whole_counted_) return false;
  count_whole_granules();
  return covered_without_sharing(rounded, fit);
}

// Counts the whole granules inside free blocks of the arenas, and keeps the
// count from here on (Note [Whole-granule count]).
void DeviceAllocator::count_whole_granules() {
  size_t whole = 0;
  for_each_arena([&](Segment* arena) {
    for (const Block* b = arena->head; b != nullptr; b = b->next) {
      if (b->is_free()) whole += SliverIndex::whole_granules(b, granule_);
    }
    arena->counted = true;
  });
  free_whole_bytes_ = whole * granule_;
  whole_counted_ = true;
}

// Reserved memory fell under 90% of the limit: the count is no longer kept.
void DeviceAllocator::stop_counting_whole_granules() {
  for_each_arena([](Segment* arena) { arena->counted = false; });
  whole_counted_ = false;
  free_whole_bytes_ = 0;
}

// Carries out `plan` (plan_share, on the arena as it is now), taking its
// fresh granules, single ones (Note [Extents]), from the back of `spares`,
// topped up from the backend: returns the free block of exactly the planned
// range, or nullptr (the arena as it was; what was taken or made is back in
// `spares`) when the backend cannot make or map them.
Block* DeviceAllocator::map_share(Segment* arena, const SharePlan& plan, std::vector<PhysHandle>* spares) {
  const size_t g = granule_;
  const uintptr_t base = arena->base;
  const uintptr_t lo = plan.lo;
  const uintptr_t hi = lo + plan.granules * g;
  assert(plan.granules > 1 || plan.front == SharePlan::kNone || plan.back == SharePlan::kNone);
  if (!new_granules(plan.fresh - std::min(plan.fresh, spares->size()), spares)) return nullptr;

  // The window's granules in order: the twins' handles at its ends, fresh
  // ones between. Mapped in one call, all or none, so that a failure leaves
  // the arena as it was.
  std::vector<PhysHandle> mapped(plan.granules);
  for (size_t i = 0; i < plan.granules; ++i) {
    if (i == 0 && plan.front != SharePlan::kNone) {
      mapped[i] = arena->phys[plan.front];
    } else if (i + 1 == plan.granules && plan.back != SharePlan::kNone) {
      mapped[i] = arena->phys[plan.back];
    } else {
      mapped[i] = spares->back();
      spares->pop_back();
    }
  }
  if (!succeeded(backend_->map_range(device_, lo, mapped.data(), mapped.size()))) {
    const size_t from = plan.front != SharePlan::kNone;
    spares->insert(spares->end(), mapped.begin() + static_cast<std::ptrdiff_t>(from),
                   mapped.begin() + static_cast<std::ptrdiff_t>(from + plan.fresh));
    return nullptr;
  }

  const size_t first = (lo - base) / g;
  for (size_t i = 0; i < plan.granules; ++i) arena->phys[first + i] = mapped[i];
  arena->mapped += plan.granules * g;
  // The lenders' free slivers become their lent pieces: the back one first,
  // for one free block may hold both (from inside the front granule to inside
  // the back one), and carving its end leaves its object at its start.
  Block* back_lent = plan.back == SharePlan::kNone
                         ? nullptr
                         : lend(plan.back_block, base + plan.back * g, base + plan.back * g + plan.back_own);
  Block* front_lent = plan.front == SharePlan::kNone
                          ? nullptr
                          : lend(plan.front_block, base + plan.front * g + plan.offset, base + (plan.front + 1) * g);
  // One physical granule per lent piece. A window of one granule has one
  // twin: counting its first and its last granule counted it twice, and the
  // arena's doubled bytes drifted a granule above its twins (issue 24, seen
  // by pyalloc_check under 16 threads; tests/native/stress.cpp's near-full
  // phase finds it).
  const size_t shared = (front_lent != nullptr) + (back_lent != nullptr);
  arena->doubled += shared * g;
  stats_.num_shared_granules += static_cast<int64_t>(shared);
  stats_.reserved_bytes.increase(arena->pool->stat, static_cast<int64_t>(plan.fresh * g));
  trace_.record(TraceAction::kSegmentMap, lo, plan.granules * g, arena->stream);

  // Carve the window out of the hole: [lo, lo + offset) lent to the front
  // twin, the request's free block, then the back twin's lent end.
  Block* hole = arena->holes.at(lo);
  assert(hole != nullptr && hole->state == BlockState::kHole);
  arena->holes.erase(hole);
  if (end_of(hole) > hi) arena->holes.insert(split_block(hole, hi - lo));  // the rest stays a hole
  Block* middle = hole;
  if (front_lent != nullptr) {
    middle = split_block(hole, plan.offset);
    hole->state = BlockState::kLent;
    pair_twins(arena, first, hole, plan.front, front_lent);
  }
  if (back_lent != nullptr) {
    Block* tail = split_block(middle, hi - g + plan.back_own - middle->addr);
    tail->state = BlockState::kLent;
    pair_twins(arena, first + plan.granules - 1, tail, plan.back, back_lent);
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

// Turns on the sliver index of every arena of the device (Note [Sliver
// index]) unless they are on: one walk each puts the free blocks in, and
// every twin is looked at once; from then on free-set membership keeps them,
// on the general path only (kDivertSlivers). An arena made while they are on
// is indexed when it is made (arena_for).
namespace {
// Upkeep always allowed before the indexes go (a small arena's build walks a
// few blocks: dropping and building again at every other call would cost
// more than it saves).
constexpr size_t kSliverUpkeepFloor = 256;
}  // namespace

void DeviceAllocator::index_slivers() {
  sliver_upkeep_ = 0;  // asked: what follows is upkeep again
  if (divert_ & kDivertSlivers) return;
  sliver_build_blocks_ = 0;
  for (Pool* pool : pools()) {
    for (Segment* arena : pool->arenas) index_arena(arena);
  }
  divert_ |= kDivertSlivers;
  ++stats_.num_sliver_indexes;
}

void DeviceAllocator::index_arena(Segment* arena) {
  arena->slivers.start(granule_, arena->size / granule_);
  for (Block* b = arena->head; b != nullptr; b = b->next) {
    if (b->is_free()) arena->slivers.insert(b);
    ++sliver_build_blocks_;
  }
  for (const auto& t : arena->twins) arena->slivers.check_twin(t.first);
  arena->indexed = true;
}

// Turns every sliver index off, and the fast path back on, once reserved
// memory is back under relax_below(), or once their upkeep since they were last
// asked passed twice what building them again walks (a device that stays
// near full while no request needs them: built again when one does, the
// upkeep between two uses costs at most about three builds), or at once when
// `always`.
void DeviceAllocator::drop_sliver_indexes(bool always) {
  if (!always && sliver_upkeep_ <= 2 * sliver_build_blocks_ + kSliverUpkeepFloor && share_from_ != SIZE_MAX &&
      static_cast<size_t>(stats_.reserved_bytes.current(kStatAll)) >= relax_below()) {
    return;
  }
  for (Pool* pool : pools()) {
    for (Segment* arena : pool->arenas) {
      arena->slivers.stop();
      arena->indexed = false;
    }
  }
  divert_ &= ~kDivertSlivers;
}

// Makes [from, to), bytes of the free block `block`, a lent block, and returns it.
Block* DeviceAllocator::lend(Block* block, uintptr_t from, uintptr_t to) {
  Block* lent = carve_free(block, from, to);
  lent->state = BlockState::kLent;
  return lent;
}

// Granules `a` and `b` of `arena` map one physical granule from now on, each
// lending the pieces named (b two when a lends its middle: I13).
void DeviceAllocator::pair_twins(Segment* arena, size_t a, Block* a_lent, size_t b, Block* b_lent, Block* b_lent2) {
  arena->twins[a] = Twin{b, {a_lent}};
  arena->twins[b] = Twin{a, {b_lent}};
  if (b_lent2 != nullptr) arena->twins[b].lent.push_back(b_lent2);
  arena->twinned[a] = arena->twinned[b] = true;
  relist_granule(arena, a, a_lent);
  relist_granule(arena, b, b_lent);
}

// The free blocks of granule `slot` of `arena` (one of them, or a block
// beside them in the granule: `inside`) are listed in the sliver index anew,
// after the granule became a twin or stopped being one.
void DeviceAllocator::relist_granule(Segment* arena, size_t slot, Block* inside) {
  if (!arena->indexed) return;
  const uintptr_t lo = arena->base + slot * granule_;
  const uintptr_t hi = lo + granule_;
  Block* b = inside;
  while (b->prev != nullptr && b->addr > lo) b = b->prev;
  for (; b != nullptr && b->addr < hi; b = b->next) {
    if (!b->is_free()) continue;
    assert(b->pool->free_blocks.contains(b));
    arena->slivers.erase(b);
    arena->slivers.insert(b);
  }
}

// Unmaps twin granule `slot` of `arena`, whose own part is free, and gives
// what it owns to the next twin of its group, whose lent pieces there become
// free memory; the group closes ranks, and a twin left alone is a granule of
// its own again. The arena's stream must be synchronized.
void DeviceAllocator::untwin(Segment* arena, size_t slot) {
  const size_t g = granule_;
  const uintptr_t lo = arena->base + slot * g;
  const uintptr_t hi = lo + g;
  const Twin mine = arena->twins.at(slot);
  const size_t next = mine.other;
  const uintptr_t next_lo = arena->base + next * g;

  // What this granule owns, as offsets: where its blocks are not lent.
  std::vector<std::pair<size_t, size_t>> owned;
  for (const auto& [a, z] : lent_gaps(mine.lent, lo, hi)) owned.emplace_back(a - lo, z - lo);
  // The next twin lends every byte of that (I13): its pieces there become
  // free, cut first where they reach past a range this one owns.
  Twin& theirs = arena->twins.at(next);
  std::vector<Block*> pieces;
  for (Block* piece : theirs.lent) {
    for (const auto& [a, z] : owned) {
      for (const uintptr_t cut : {next_lo + a, next_lo + z}) {
        if (cut > piece->addr && cut < end_of(piece)) {
          pieces.push_back(piece);
          piece = split_block(piece, cut - piece->addr);
        }
      }
    }
    pieces.push_back(piece);
  }
  theirs.lent.clear();
  Block* freed = nullptr;  // a free block of the next granule, to relist it by
  for (Block* piece : pieces) {
    const size_t at = piece->addr - next_lo;
    const bool given = std::any_of(owned.begin(), owned.end(), [&](const auto& r) { return r.first <= at && at < r.second; });
    if (!given) {
      theirs.lent.push_back(piece);
      continue;
    }
    piece->state = BlockState::kFree;
    freed = insert_coalesced(piece);  // a neighbour still lent is not free: the merge leaves it be
  }

  breaks_capture();
  backend_->unmap(device_, lo, g);
  trace_.record(TraceAction::kSegmentUnmap, lo, g, arena->stream);
  arena->phys[slot] = PhysHandle{};
  size_t before = next;  // the twin that names this one
  while (arena->twins.at(before).other != slot) before = arena->twins.at(before).other;
  arena->twins.at(before).other = next;
  arena->twins.erase(slot);
  arena->twinned[slot] = false;
  if (theirs.other == next) {  // alone: it owns its whole granule again
    assert(theirs.lent.empty());
    arena->twins.erase(next);
    arena->twinned[next] = false;
  }
  if (freed != nullptr) relist_granule(arena, next, freed);  // this one becomes a hole below
  arena->mapped -= g;
  arena->doubled -= g;

  // This granule's blocks become one hole: its lent pieces and the parts of
  // the free blocks between and beside them that lie inside the granule.
  std::vector<Block*> inside;  // in address order: lent and free blocks
  Block* b = mine.lent.front();
  while (b->addr > lo) b = b->prev;
  for (; b != nullptr && b->addr < hi; b = b->next) inside.push_back(b);
  for (Block*& piece : inside) {
    if (piece->is_free()) piece = carve_free(piece, std::max(piece->addr, lo), std::min(end_of(piece), hi));
    piece->state = BlockState::kHole;
  }
  Block* hole = inside.front();
  for (size_t i = 1; i < inside.size(); ++i) {
    make_spare_room(1);
    absorb_next(hole);
  }
  merge_holes(hole);
  reserved_changed();
}

// Untwins (untwin) every twin of `arena` whose own part is all free, unless
// that part overlaps [skip_lo, skip_hi); synchronizes the stream first, once.
// With the sliver index on, only the twins it has noted are looked at (a
// skipped one stays noted); else all. False when the stream could not be
// synchronized.
bool DeviceAllocator::untwin_free(Segment* arena, uintptr_t skip_lo, uintptr_t skip_hi) {
  std::vector<size_t> slots;
  if (arena->indexed) {
    slots = arena->slivers.take_twins_to_check();
  } else {
    for (const auto& t : arena->twins) slots.push_back(t.first);
  }
  std::vector<size_t> ready;
  for (const size_t slot : slots) {
    const auto twin = arena->twins.find(slot);
    if (twin == arena->twins.end()) continue;  // parted since it was noted
    bool in_skip = false;  // the granule's own part, all but its lent pieces
    if (!own_part_free(arena, slot, granule_, skip_lo, skip_hi, &in_skip)) continue;
    if (in_skip) {
      if (arena->indexed) arena->slivers.check_twin(slot);
      continue;
    }
    ready.push_back(slot);
  }
  if (ready.empty()) return true;
  if (!synchronize_stream(arena)) {
    for (const size_t slot : ready) {
      if (arena->indexed) arena->slivers.check_twin(slot);
    }
    return false;
  }
  for (const size_t slot : ready) {
    // Untwinning gives the next twin free memory, and takes nothing from any
    // other: the ones found stay ready.
    if (arena->twins.count(slot) != 0) untwin(arena, slot);  // else its pair's other went first
  }
  return true;
}

}  // namespace pyalloc
