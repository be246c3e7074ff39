// arena.cpp: growing in virtual-memory arenas, and stitching (ladder step 2).
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
// window the request needs; a chunk of several granules (Note [Extents])
// moves only whole, given back to the backend and created anew in the
// window. That is GMLake's idea with the allocator's own
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
// path; an exact fit stays on the fast path. Near a full device a request
// that is not a whole number of granules may end on a boundary instead (Note
// [Balanced slivers] in blocks/arena.hpp).
//

// Note [Reuse before growing]
// An arena that finds no cached block for a request grows: it maps granules
// where the window needs them (best_window). Until 2026-11-25 it mapped new
// granules even while whole granules sat unused inside free blocks elsewhere
// in the arena, and reused those by stitching only once the device was full,
// so peak reserved memory climbed towards the device's size
// (llama1b_b32_s4096_ckpt: 81,446 MiB reserved for 69,077 live on an 80 GiB
// device, more than either model of PyTorch's allocator).
// Now a growth takes its granules from free blocks of its own arena first
// (reuse_granules: the smallest free blocks that hold whole granules first,
// their interior granules unmapped and mapped into the window), and new ones
// only for the rest. A cache hit changes nothing: only a miss that would
// have mapped new granules moves cached ones instead.
// Near the limit as well. Until 2026-11-29 reuse stopped once reserved
// memory would pass 95% of what the allocator may reserve, and growth mapped
// new granules until the device was full and the pressure ladder stitched:
// a limit changed the decisions made below it, and a device that held the
// run with no limit's peak reserved failed under it (resnet50_b256_s224
// reserves 10,988 MiB with no limit and needed a capacity of 11,026;
// llama1b_b32_s4096_ckpt 69,156 and 69,230). Reusing whatever the limit,
// the minimum capacities are 10,978 and 69,156 MiB, vit_l_b256_s224 40,278
// instead of 40,292, llama7b_b2_s4096_ckpt 64,490 instead of 64,500,
// batch_growth 1,626 instead of 1,628; size_sweep 1,090 instead of 1,088
// (docs/benchmarks/2026-11-29-reuse-near-the-limit-cpu.md). Two things
// differ near the limit (past near_limit_, 95% of it, sharing on or off):
//   - The walk for donors looks at the kDonorLook smallest free blocks of a
//     granule or more, not at all of them. On a random churn at 1.05 times
//     its peak live bytes (tools/bench/scale.py) the free blocks there are
//     mostly pieces of extents that live blocks hold too, which cannot
//     donate: the whole walk looked at 125 blocks a growth for 6 donors, 500
//     instructions per operation at 10^3 live blocks against 486 before reuse
//     went past 95%, and 485 cut at 16. The stress suite's minimum capacities
//     and peaks did not move with the cut.
//   - A window that what was moved and what may still be reserved do not
//     fill gives the moved granules back (single ones released, made again
//     by the ladder's stitching: backend calls a growth below the limit does
//     not make; a review counted 39 of 74 reuses of a random churn at 256 MiB
//     so), and only a reuse that served its window is counted (num_reuses,
//     reused_bytes). Moving only when the window would be filled saves those
//     calls, and cost two_stream 4 MiB (924 -> 928, 1.022 times its live
//     bytes) and the churn above 8 instructions an operation (485 -> 493:
//     flat instructions 1.51, over issue 18's 1.5): not kept.
// Letting reserved memory pass the peak of allocated memory by a slack
// before reusing (1/1024, 1/256, 1/64: tried) moved as many granules on the
// random churn of tools/bench/scale.py, kept moving some on every iteration
// of vit_l_b256_s224 (4 reuses, 0.55 GiB, where no slack settles after two),
// and left reserved memory higher: 1/256 reserved 64,538 MiB on
// llama7b_b1_s2048 against 64,360; 1/64 on vit_l 40,486 against 40,406
// before reuse. A slack against what is allocated now (rather than the peak)
// did the same.
// The cost: a synchronization of the arena's stream and a remap of each
// granule moved (on a GPU an unmap and a map, microseconds each; an extent
// is given back and created anew, Note [Extents]), on such a miss; counted in num_reuses and reused_bytes. On the recorded training
// traces it is paid in the first iterations (llama1b_b32_s4096_ckpt: 100
// reuses before the first iteration mark, 4 and 2 in the next two, none in
// the last); on a random churn that never repeats, on every miss, and the
// search for a window (best_window) walks the more holes that moving
// leaves: 2.5 to 3 times the instructions per operation of
// tools/bench/scale.py at 10^3 and 10^4 live blocks with no limit, as the
// allocator kept reserved memory near live instead of 19% above it, until
// donors had to be cold (Note [Cold donors]).
// Moving a granule leaves a hole between live blocks, so live blocks spread
// over more of the address space: an arena reserves kArenaSpan times the
// device's size of it, not twice (with twice, interleaved_lifetimes at a
// capacity of 800 MiB ran out of address space with 638 MiB reserved).
// Measured on the stress suite and tools/bench/scale.py:
// docs/benchmarks/2026-11-25-reuse-cpu.md.
//

#include <algorithm>
#include <cassert>

#include "blocks/arena.hpp"
#include "blocks/sliver_index_inl.hpp"
#include "device/device_allocator.hpp"
#include "device/fast_path.hpp"

namespace pyalloc {

namespace {
// An arena's address space, in device sizes (Note [Reuse before growing]).
constexpr size_t kArenaSpan = 8;
// The free blocks a growth near the limit looks at for donors (Note [Reuse
// before growing]).
constexpr size_t kDonorLook = 16;
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
  if (g == 0 || g % kBlockAlign != 0 || (g & (g - 1)) != 0) {
    last_backend_error_ = "the backend's virtual-memory granularity (" + std::to_string(g) +
                          " bytes) is not a power of two of at least 512 bytes";
    return nullptr;
  }
  // kArenaSpan times the device, so that address space is rarely what runs
  // out: live blocks would have to be spread thinly over all of it (Note
  // [Reuse before growing]).
  const size_t size = round_up_to(kArenaSpan * device_total(), g);
  uintptr_t va = 0;
  pool.arenas.reserve(pool.arenas.size() + 1);  // (the push below cannot throw)
  if (!succeeded(backend_->reserve(device_, size, &va))) return nullptr;
  Segment* arena = add_segment(pool, stream, va, size, BlockState::kHole);
  arena->arena = true;
  pool.arenas.push_back(arena);
  try {  // its per-granule metadata: host memory in proportion to the device
    arena->holes.start(va, size, g);
    arena->holes.insert(arena->head);
    arena->phys.resize(size / g);
    arena->twinned.resize(size / g);
    if (divert_ & kDivertSlivers) index_arena(arena);  // every arena is, while any is
  } catch (...) {  // (std::bad_alloc) the device as it was before, then the caller's error
    release_arena(arena);
    throw;
  }
  arena->counted = whole_counted_;  // and counted (Note [Whole-granule count]): it holds no free block yet
  return arena;
}

// ---- block surgery (arenas, shared windows, plan regions) ---------------------------

// Splits `block` (free but out of its free set, or a hole) at `offset`
// bytes; the returned second part has the same state.
Block* DeviceAllocator::split_block(Block* block, size_t offset) {
  Block* rest = new_block();
  split_into(block, rest, offset);
  rest->state = block->state;
  return rest;
}

// `block` (free memory that no request freed: a hole just mapped, a lent
// piece given back; out of the free set) joins its free neighbours and goes
// into the free set; returns the merged block, as young as its youngest part
// (Note [Cold donors]).
Block* DeviceAllocator::insert_coalesced(Block* block) {
  make_spare_room(2);
  uint64_t youngest = 0;
  for (const Block* beside : {block->prev, block->next}) {
    if (beside != nullptr && beside->is_free()) youngest = std::max(youngest, beside->freed_at);
  }
  block = coalesce(block);
  block->freed_at = youngest;
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

// `hole`, a block that has just become a hole, merges with the holes beside
// it, and the result joins the arena's hole set.
void DeviceAllocator::merge_holes(Block* hole) {
  Holes& holes = hole->segment->holes;
  make_spare_room(2);
  if (hole->prev != nullptr && hole->prev->state == BlockState::kHole) {
    holes.erase(hole->prev);
    hole = hole->prev;
    absorb_next(hole);
  }
  if (hole->next != nullptr && hole->next->state == BlockState::kHole) {
    holes.erase(hole->next);
    absorb_next(hole);
  }
  holes.insert(hole);
}

// The block to hand out for a request of `rounded` bytes from `block` (a
// free block of an arena, in its free set): `block` itself, or the part of
// it from granule_offset() on, whose front part stays free (Note [Whole
// granules]).
Block* DeviceAllocator::align_to_granule(Block* block, size_t rounded) {
  const size_t offset = pyalloc::granule_offset(block, rounded, granule_);
  return offset == 0 ? block : split_free(block, offset);
}

// ---- unmapping free memory -------------------------------------------------------

// Waits for the work queued on the arena's stream, so its free blocks are
// no longer in use. False when the backend cannot record an event.
bool DeviceAllocator::synchronize_stream(const Segment* arena) {
  EventHandle event = 0;
  if (!succeeded(backend_->event_record(device_, arena->stream, &event))) return false;
  breaks_capture();
  backend_->event_synchronize(device_, event);
  backend_->event_release(device_, event);
  return true;
}

// Unmaps at least `wanted` granules (when there are so many) wholly inside
// free blocks of any arena, lowest first, in whole chunks, outside [skip_lo,
// skip_hi) (a window being grown; a free block it overlaps gives what lies
// beyond it: interior_outside): single granules go to `spares` (when not
// null) to be mapped again, extents back to the backend (unmap_free_range).
// Returns the granules unmapped. An arena's sliver index, when on, lists
// those blocks (roomy); else its blocks are walked.
size_t DeviceAllocator::unmap_free_granules(size_t wanted, uintptr_t skip_lo, uintptr_t skip_hi,
                                            std::vector<PhysHandle>* spares, const Pool* only) {
  size_t done = 0;
  for_each_arena([&](Segment* arena) {
    if (only != nullptr && arena->pool != only) return;  // one pool's (release_pool)
    if (!arena->twins.empty() && !untwin_free(arena, skip_lo, skip_hi)) return;
    bool synchronized = false;
    // Unmaps what it needs of the whole chunks inside free block b's
    // granule-aligned interior [lo, hi); false when the stream cannot be
    // synchronized. b may be gone after.
    auto unmap_from = [&](Block* b, uintptr_t lo, uintptr_t hi) {
      uintptr_t a, z;
      if (!whole_chunks(arena, lo, hi, granule_, &a, &z)) return true;
      if (!synchronized && !(synchronized = synchronize_stream(arena))) return false;
      z = chunks_holding(arena, a, z, wanted - done);
      done += (z - a) / granule_;
      unmap_free_range(b, a, z, spares);
      return true;
    };
    uintptr_t lo, hi;
    if (arena->indexed) {
      const SliverIndex& slivers = arena->slivers;
      for (Block* b = slivers.roomy_from(0); b != nullptr && done < wanted;) {
        // What is left of b after the unmap, if roomy, starts past its first whole granule.
        const size_t slot = SliverIndex::first_whole(b, granule_);
        if (interior_outside(b, granule_, skip_lo, skip_hi, &lo, &hi) && !unmap_from(b, lo, hi)) return;
        b = slivers.roomy_from(slot + 1);
      }
      return;
    }
    for (Block* b = arena->head; b != nullptr && done < wanted; b = b->next) {
      if (!b->is_free() || !interior_outside(b, granule_, skip_lo, skip_hi, &lo, &hi)) continue;
      Block* before = b->prev;
      const size_t was = done;
      if (!unmap_from(b, lo, hi)) return;
      if (done != was) b = before != nullptr ? before : arena->head;  // b may be gone: go on from what precedes it
    }
  });
  return done;
}

// ---- growing and stitching ---------------------------------------------------------

// Ladder step 0 for a pool with arenas (stitch false), and step 2 (stitch
// true: memory may be taken from free blocks elsewhere on the device).
Block* DeviceAllocator::grow_arena(Pool& pool, size_t rounded, StreamId stream, bool stitch) {
  Segment* arena = arena_for(pool, stream);
  if (arena == nullptr) return nullptr;
  const size_t g = granule_;
  const Window w = best_window(arena, rounded, g);
  if (!w.found) return nullptr;  // the reservation itself is full
  const uintptr_t lo = arena->base + (w.lo - arena->base) / g * g;
  const uintptr_t hi = arena->base + round_up_to(w.lo + rounded - arena->base, g);
  const size_t need = w.granules;

  // Memory moved from free blocks comes first, so that running short maps
  // nothing: its single granules are mapped again (spares), its extents go
  // back to the backend, which creates the window's memory anew (Note
  // [Extents]).
  std::vector<PhysHandle>& spares = spares_;
  spares.clear();
  size_t reused = 0;  // granules moved from cold (or warm) donors
  if (!stitch && reuses_first(need * g)) {
    bool synchronized = false;  // one wait on the arena's stream for both walks
    reused = reuse_granules(pool, arena, need, lo, hi, &spares, &synchronized);
    // Past a standing high-water mark, warm donors too (Note [Cold donors]).
    const size_t reserved_now = static_cast<size_t>(stats_.reserved_bytes.current(kStatAll));
    const size_t fresh = (need - std::min(need, reused)) * g;
    const uint64_t settled = static_cast<uint64_t>(stats_.allocation.current(kStatAll)) / 4;
    if (reserved_now + fresh > reserved_high_ && frees_ - high_set_at_ >= settled) {
      reused += reuse_granules(pool, arena, (reserved_now + fresh - reserved_high_ + g - 1) / g, lo, hi, &spares,
                               &synchronized, true);
    }
  }
  auto take_free = [&](size_t granules) {
    const size_t n = unmap_free_granules(granules, lo, hi, &spares);
    if (n > 0) {
      stats_.num_stitches += 1;
      stats_.stitched_bytes += static_cast<int64_t>(n * g);
    }
    return n;
  };
  size_t lacking = granules_lacking(need);
  if (stitch && lacking > 0) {
    take_free(lacking);
    lacking = granules_lacking(need);
  }
  Fill fill = lacking == 0 ? map_window(arena, lo, hi, w.lo, w.lo + rounded, &spares) : Fill::kNoMemory;
  // The backend itself ran out (another process's memory, a device smaller
  // than our limit): free memory of ours goes back to it, once.
  if (fill == Fill::kNoMemory && stitch && take_free(need - std::min(need, spares.size())) > 0) {
    fill = map_window(arena, lo, hi, w.lo, w.lo + rounded, &spares);
  }
  if (reused > 0 && fill == Fill::kDone) {  // counted when they served the window
    stats_.num_reuses += 1;
    stats_.reused_bytes += static_cast<int64_t>(reused * g);
  }
  Block* block = nullptr;
  if (fill != Fill::kNoMemory) {
    block = pool.free_blocks.best_fit(stream, rounded);
  } else if (stitch && sharing_) {
    index_slivers();
    const SharePlan plan = plan_share(arena, rounded, g);
    if (plan.found && granules_lacking(plan.fresh) == 0) block = map_share(arena, plan, &spares);
  }
  release_chunks(spares.data(), spares.size());  // what the window did not take
  spares.clear();
  if (const size_t r = static_cast<size_t>(stats_.reserved_bytes.current(kStatAll)); r > reserved_high_) {
    reserved_high_ = r;
    high_set_at_ = frees_;
  }
  return block;
}

// Whether a growth that needs `fresh` bytes of new granules takes cached free
// granules first (Note [Reuse before growing]): with reuse on, however near
// the limit reserved memory is.
bool DeviceAllocator::reuses_first(size_t fresh) const {
  // Never during a capture: moving granules synchronizes and remaps (Note [Capture]).
  return reusing_ && fresh != 0 && capturing_ == 0;
}

// Note [Cold donors]
// Reuse takes granules only from cold free blocks: memory that no request
// freed as it is (a split's remainder, a hole just mapped: Block::freed_at
// 0), or a block that stayed free while a quarter as many blocks were freed
// as there are live allocations (freed_at against frees_). A block freed
// moments ago is what the next requests of its size would find. Taking from
// any free block, as reuse first did, kept the cache so small on a churn that
// never repeats (tools/bench/scale.py) that misses came in a cascade, each
// moving granules out of the block the next request would have hit: at 10^3
// live blocks with no limit, 880 growths in 20,000 pairs against 526
// without reuse, and 890 instructions per operation against 352, a third of
// them in best_window walking the holes the moves leave (150 a growth).
// With cold donors, about 650 growths and 501 instructions, and reserved
// memory 1.07 times the peak live bytes, between reuse from any block (1.02)
// and none (1.19). On the stress suite peak reserved memory stays below both
// models of PyTorch's allocator on every workload; min capacity is 2 MiB
// higher on four workloads and 2 to 8 MiB lower on three
// (docs/benchmarks/2026-11-25-cold-donors-cpu.md).
// Tried: half instead of a quarter left interleaved_lifetimes at 786 MiB
// reserved, above the expandable_segments model's 742; a remainder that
// keeps the stamp of the block it was split from left llama1b_b32_s4096_ckpt
// at 81,446 MiB, as without reuse.
//
// Past the high-water mark, warm donors too. A growth whose new granules
// would take reserved memory past the most an arena's growth ever left
// reserved (reserved_high_), when that mark has stood while a quarter as many
// blocks were freed as are live, takes the granules past the mark from any
// free block, recently freed ones included: the peak is what a user sees
// and what the device must hold, and a mark that stood that long is a
// steady state (a later training iteration), not the first iteration's climb.
// On vit_l_b256_s224 the second iteration's first big requests found 231 MiB
// cached but only 40 MiB of it cold, and grew 354 MiB past the first
// iteration's peak: peak reserved 40,448 MiB, above the expandable_segments
// model's 40,426; with warm donors past a standing mark 40,292
// (llama1b_b32_s4096_ckpt 70,584 -> 69,156, llama1b_b4_s4096 49,800 ->
// 48,996, interleaved_lifetimes 730 -> 694, two_stream 1,020 -> 1,008). Min
// capacity moved both ways, below both models of PyTorch everywhere still:
// llama7b_b2_s4096_ckpt 36 MiB lower, seq2seq_varlen 2; resnet50_b256_s224
// 34 higher (11,032 against 11,038 and 11,050), vit_l_b256_s224 and
// llama7b_b1_s2048 4, llama1b_b4_s4096 and batch_growth 2. The mark starts
// again when reserved memory is back to zero (reserved_changed): a replay,
// or a program that gave everything back, starts afresh. Without the
// standing condition
// (every growth past the peak, the first iteration's included) the first
// iteration emptied the blocks its next requests would hit, and
// llama1b_b32_s4096_ckpt reserved 81,896 MiB, more than either model.
//

// Unmaps about `n` granules (whole chunks: Note [Extents]) from cold free
// blocks (Note [Cold donors]) of `pool` in `arena` (its own stream's cached
// memory), smallest blocks first, outside [skip_lo, skip_hi) (the window
// being grown: interior_outside): single granules go to `spares`, for the
// growth to map again, extents back to the backend, for the growth to create
// anew. Returns the granules unmapped. The stream is synchronized first,
// unless *synchronized says an earlier walk of the same growth did (it is set
// here when this one does); nothing moves when it cannot be.
size_t DeviceAllocator::reuse_granules(Pool& pool, Segment* arena, size_t n, uintptr_t skip_lo, uintptr_t skip_hi,
                                       std::vector<PhysHandle>* spares, bool* synchronized, bool any) {
  const size_t g = granule_;
  std::vector<Donor>& donors = donors_;  // capacity kept between growths
  donors.clear();
  size_t found = 0;
  const uint64_t cold_after = static_cast<uint64_t>(stats_.allocation.current(kStatAll)) / 4;
  const size_t reserved = static_cast<size_t>(stats_.reserved_bytes.current(kStatAll));
  const size_t look = reserved + n * g >= near_limit_ ? kDonorLook : SIZE_MAX;  // near the limit: a few
  size_t looked = 0;
  pool.free_blocks.for_each_at_least(arena->stream, g, [&](Block* b) {
    if (++looked > look) return false;
    uintptr_t lo, hi, a, z;
    const bool cold = any || b->freed_at == 0 || frees_ - b->freed_at >= cold_after;
    if (b->segment != arena || !cold || !interior_outside(b, g, skip_lo, skip_hi, &lo, &hi) ||
        !whole_chunks(arena, lo, hi, g, &a, &z)) {
      return true;
    }
    donors.push_back(Donor{b, a, z});
    found += (z - a) / g;
    return found < n;
  });
  if (donors.empty() || !(*synchronized || (*synchronized = synchronize_stream(arena)))) return 0;
  size_t done = 0;
  // Unmapping one donor carves it and merges holes: the other donors, free
  // blocks apart from it (free neighbours coalesce), stay as they are.
  for (const Donor& d : donors) {
    if (done >= n) break;
    const uintptr_t z = chunks_holding(arena, d.lo, d.hi, n - done);
    unmap_free_range(d.block, d.lo, z, spares);
    done += (z - d.lo) / g;
  }
  return done;
}

// Ladder step 2. A pool without arenas grows by plain segments from the
// backend: the arenas' free granules go back to it first, as many as the
// segment needs, or more when memory_fraction's limit was lowered below what
// is reserved: enough to bring the segment under it.
Block* DeviceAllocator::stitch(Pool& pool, size_t rounded, StreamId stream) {
  if (vmm_ == VmmMode::kOff || capturing_ > 0) return nullptr;  // Note [Capture]
  if (pool.in_arenas) return grow_arena(pool, rounded, stream, /*stitch=*/true);
  const size_t size = segment_size_for(pool, rounded);
  const size_t reserved = static_cast<size_t>(stats_.reserved_bytes.current(kStatAll));
  const size_t limit = reserved_limit();
  const size_t over = limit != SIZE_MAX && reserved + size > limit ? reserved + size - limit : 0;
  if (release_arena_memory(std::max(size, over)) == 0) return nullptr;
  return grow(pool, rounded, stream);
}

// Gives back the granules wholly inside free blocks, and the reservations
// of arenas left with nothing mapped, until `bytes` (0: all).
size_t DeviceAllocator::release_arena_memory(size_t bytes) {
  if (granule_ == 0 || capturing_ > 0) return 0;  // no arena was ever made; Note [Capture]
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
  const bool indexed = arena->indexed;
  delete arena;
  if (indexed) drop_sliver_indexes(/*always=*/true);  // the next share builds what it needs
}

}  // namespace pyalloc
