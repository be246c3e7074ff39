// move.cpp: moving live bytes so that two slivers give a granule back.
//
// Note [Moving slivers]
// Sharing (Note [Shared granules]) uses at most two slivers for a request,
// and only where a hole can hold a window of its size. Near the limit the
// slivers outnumber what requests can use that way: on two_stream, at the
// first capacity that fails, a 7.91 MiB request lacked three granules while
// 39.85 MiB sat free in about 40 slivers, not one whole granule among them.
//
// Two slivers of one arena whose live parts do not overlap in the granule
// fit in one physical granule:
//
//   granule a   [ live a | free ............... ]   live up to offset p
//   granule b   [ free ................ | live b ]   live from offset q >= p
//
// So the live bytes of b, [q, g), are copied to the same offsets of a's
// physical granule (through a's address: they are free there), and b's
// address range is mapped to a's physical granule instead of its own, which
// goes back to the backend. The two granules are then twins, as a shared
// window's are: a owns [0, q) and lends [q, g), b owns [q, g) and lends
// [0, q) (types.hpp I13); what follows is the ordinary twins' life (they
// part lazily in untwin_free once either's own part is free). No address
// changes: what the program holds stays valid, and a CUDA graph's kernels
// find the same bytes at the same addresses.
//
// Which granules move (move_in): per arena, the granules with a free end
// (a: free from p to the end, p > 0) and those with a free start (b: free up
// to q < g, every block after it allocated or free, none used on another
// stream by record_stream, pending, or shared with another process: Note
// [Sharing blocks], whose importers map b's physical granule itself); single
// granules only, no twins, no granule of an extent (I16). Both kinds are
// what the arena's sliver index lists, in offset order (Note [Sliver
// index]); a move builds the indexes when sharing has not. A granule free
// at both ends may be either. The pairs are as many as any matching finds,
// or within 1% of it (pair_slivers, Note [Pairing slivers]). Of the pairs,
// those that copy the fewest bytes go first, as many as the caller wants.
//
// Ordering: every stream of the device is synchronized first (a block may be
// used on a stream other than its own, ordered by the program's events and
// not recorded with record_stream: its bytes must be final before they are
// copied); the copies are queued on the arena's stream, which is
// synchronized once; then each pair is remapped (on cuda each unmap waits for
// the device again, idle by then).
//
// When: ladder step 4b, the last before a request fails: after stitching,
// sharing, the pressure callbacks and gpumemd, never for a request that any
// of them serves; first as many pairs as the request spans granules and two
// more, then, if that was not enough, all. A copy of at most a granule per
// pair (on an H100, 2 MiB in a few microseconds with the launch), and an
// unmap, a map and a release per pair.
//
// The cost of the rule: PyTorch's allocator never moves live memory, and
// neither does pyalloc until a request would otherwise fail. Between the copy
// and the remap (microseconds, under the allocator's lock), a kernel that
// ANOTHER thread launches on a moved block would read or write the old
// granule, and its writes would be lost. A program that launches work on one
// device from several threads at once (an inference server's workers, not a
// training loop's thread and autograd's) should set move=0; the first move is
// told on stderr, to make that choice visible.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "blocks/arena.hpp"
#include "blocks/sliver_index_inl.hpp"
#include "blocks/sliver_pairs.hpp"
#include "device/device_allocator.hpp"
#include "device/fast_path.hpp"

namespace pyalloc {

namespace {

// A failed move whose granule cannot be mapped back: its live bytes are out
// of reach, and going on would hand the program memory that faults or reads
// another granule.
[[noreturn]] void lost_mapping(uintptr_t va, const std::string& why) {
  std::fprintf(stderr, "pyalloc: fatal: the granule at 0x%llx could not be mapped back after a failed move (%s)\n",
               static_cast<unsigned long long>(va), why.c_str());
  std::abort();
}

// A granule with a free end (an a) or a free start (a b), as pair_slivers
// takes them: its slot, its edge (an a's live part ends there, at p; a b's starts there, at q), and a
// free block that held its free part when it was found.
struct Sliver {
  size_t slot;
  size_t edge;
  Block* free;
};

struct Pair {
  Sliver a, b;
};

// The block holding `addr`, walked to from `from`, a block of the same
// segment. Moves only split free blocks (lend, carve_free): none is merged
// or deleted meanwhile, so `from` is still a block.
Block* near(Block* from, uintptr_t addr) {
  while (end_of(from) <= addr) from = from->next;
  while (from->addr > addr) from = from->prev;
  return from;
}

}  // namespace

// Whether the blocks of [lo, hi) (inside one mapped granule of `arena`) may
// be moved to another physical granule: each allocated or free, used on its
// own stream only as far as record_stream says, never exported.
bool DeviceAllocator::movable(Block* from, uintptr_t lo, uintptr_t hi) const {
  for (Block* b = near(from, lo); b != nullptr && b->addr < hi; b = b->next) {
    if (b->is_free()) continue;
    if (b->state != BlockState::kAllocated || !b->uses.empty() || exported_.count(b->addr) != 0) return false;
  }
  return true;
}

// Forgets exports of blocks freed since: their address no longer names one
// (a block allocated at the same address since stays unmoved, to be safe).
void DeviceAllocator::prune_exported() {
  for (auto it = exported_.begin(); it != exported_.end();) {
    it = live_.find(*it) == nullptr ? exported_.erase(it) : std::next(it);
  }
}

// Ladder step 4b (Note [Moving slivers] and [Pressure ladder]): moves pairs,
// as many as the request spans granules and two more, then all, stitching
// after each; the block, or nullptr.
Block* DeviceAllocator::move_and_retry(Pool& pool, size_t rounded, StreamId stream) {
  if (!moving_ || !pool.in_arenas || vmm_ == VmmMode::kOff || capturing_ > 0) return nullptr;  // Note [Capture]
  for (const size_t wanted : {rounded / granule() + 2, SIZE_MAX}) {
    const size_t moved = move_slivers(wanted);
    if (moved == 0) return nullptr;
    if (Block* b = stitch(pool, rounded, stream)) return b;
    if (moved < wanted) return nullptr;  // every pair moved already
  }
  return nullptr;
}

// Moves up to `wanted` pairs of slivers in the arenas of this device; returns
// the granules given back.
size_t DeviceAllocator::move_slivers(size_t wanted) {
  prune_exported();
  index_slivers();  // move_in reads the slivers from it
  bool synchronized = false;
  size_t moved = 0;
  for_each_arena([&](Segment* arena) {
    if (moved < wanted) moved += move_in(arena, wanted - moved, &synchronized);
  });
  if (moved == 0) return 0;
  reserved_changed();
  if (oom_report_ && !move_told_) {  // once: a program should know its live memory moves
    move_told_ = true;
    std::fprintf(stderr,
                 "pyalloc: device %d: moved the live bytes of %zu granule(s) to serve a request that would have "
                 "failed (move=1; PYALLOC_CONF=move=0 turns this off, as a program that launches work on one "
                 "device from several threads at once should: Note [Moving slivers])\n",
                 device_, moved);
  }
  return moved;
}

// Moves up to `wanted` pairs of `arena`; the device is synchronized before
// the first copy (*synchronized says whether it was).
size_t DeviceAllocator::move_in(Segment* arena, size_t wanted, bool* synchronized) {
  const size_t g = granule_;
  const uintptr_t base = arena->base;
  auto single = [&](size_t slot) {  // no extent (I16) and no twin (I13): a granule of its own
    return arena->phys[slot].size == g && !arena->twinned[slot];
  };
  // The sliver index lists both kinds, each in increasing offset (Note [Sliver index]).
  const SliverIndex& slivers = arena->slivers;
  std::vector<Sliver> ends, starts;  // a's (in increasing p), b's (in increasing q)
  for (Block* b = slivers.first(SliverIndex::kEnd, 1); b != nullptr; b = slivers.next(SliverIndex::kEnd, b)) {
    const size_t slot = (b->addr - base) / g;
    if (single(slot)) ends.push_back({slot, (b->addr - base) % g, b});
  }
  for (Block* b = slivers.first(SliverIndex::kStart, 1); b != nullptr; b = slivers.next(SliverIndex::kStart, b)) {
    const size_t slot = (end_of(b) - base) / g;
    if (single(slot) && movable(b, end_of(b), base + (slot + 1) * g)) starts.push_back({slot, (end_of(b) - base) % g, b});
  }
  if (ends.empty() || starts.empty()) return 0;

  std::vector<Pair> pairs;
  for (const auto& [a, b] : pair_slivers(ends, starts, arena->phys.size())) pairs.push_back({*a, *b});
  std::sort(pairs.begin(), pairs.end(), [](const Pair& x, const Pair& y) { return x.b.edge > y.b.edge; });
  if (pairs.size() > wanted) pairs.resize(wanted);  // the smallest copies
  if (pairs.empty()) return 0;

  // Every stream's work first, then the copies on the arena's stream, then one wait for them.
  if (!*synchronized) {
    breaks_capture();
    backend_->synchronize_device(device_);
    *synchronized = true;
  }
  std::vector<Pair> copied;
  for (const Pair& pr : pairs) {
    const uintptr_t from = base + pr.b.slot * g + pr.b.edge;
    const uintptr_t to = base + pr.a.slot * g + pr.b.edge;
    if (succeeded(backend_->copy_device_async(device_, to, from, g - pr.b.edge, arena->stream))) copied.push_back(pr);
  }
  if (copied.empty() || !synchronize_stream(arena)) return 0;

  size_t moved = 0;
  for (const auto& [a, b] : copied) {
    const uintptr_t a_lo = base + a.slot * g;
    const uintptr_t b_lo = base + b.slot * g;
    const PhysHandle own = arena->phys[b.slot];
    backend_->unmap(device_, b_lo, g);
    if (!succeeded(backend_->map(device_, b_lo, arena->phys[a.slot]))) {
      // Back as it was: the bytes are still in b's own granule.
      if (!succeeded(backend_->map(device_, b_lo, own))) lost_mapping(b_lo, last_backend_error_);
      continue;
    }
    release_chunks(&own, 1);
    arena->phys[b.slot] = arena->phys[a.slot];
    Block* a_lent = lend(near(a.free, a_lo + b.edge), a_lo + b.edge, a_lo + g);
    Block* b_lent = lend(near(b.free, b_lo), b_lo, b_lo + b.edge);
    pair_twins(arena, a.slot, a_lent, b.slot, b_lent);
    arena->doubled += g;
    stats_.reserved_bytes.decrease(arena->pool->stat, static_cast<int64_t>(g));
    ++stats_.num_moved_granules;
    stats_.moved_bytes += static_cast<int64_t>(g - b.edge);
    ++moved;
  }
  return moved;
}

}  // namespace pyalloc
