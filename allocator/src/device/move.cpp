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
// Which granules move (move_slivers): per arena, the granules with a free
// end (a: free from p to the end, p > 0) and those with a free start (b:
// free up to q < g, every block after it allocated or free, none used on
// another stream, pending, or shared with another process: Note [Sharing
// blocks], whose importers map b's physical granule itself); single
// granules only, no twins, no granule of an extent (I16). Each b takes the
// a with the smallest p <= q not yet taken, b by b in increasing q: that
// pairs as many as any matching can. All copies are queued on the arena's
// stream (ordered after the work queued there on the blocks they copy), the
// stream is synchronized once, and then each pair is remapped.
//
// When: ladder step 2b, after stitching and sharing found too few granules
// and before the pressure callbacks: a request that would otherwise fail,
// never one the cache or a growth can serve. It costs a copy of at most a
// granule per pair (on an H100, 2 MiB in about a microsecond), one stream
// synchronization, and an unmap, a map and a release per pair.
//
// The cost of the rule: PyTorch's allocator never moves live memory, and
// neither does pyalloc until a request would fail. Between the copy and the
// remap (microseconds, under the allocator's lock, after the stream's queued
// work), a kernel that ANOTHER thread launches on a moved block would read
// or write the old granule, and its writes would be lost. A program that
// launches work on one device from several threads at once (not a training
// loop's single thread and its allocator calls) should set move=0.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "blocks/arena.hpp"
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

// A granule with a free end (kind a) or a free start (kind b): its slot, the
// offset where its live part ends (a) or starts (b), and a free block that
// held the free part when it was found (it may be split since; near()).
struct Sliver {
  size_t slot;
  size_t offset;
  Block* free;
};

// The block holding `addr`, walked to from `from`, a block of the same
// segment (moves split free blocks; none is deleted meanwhile).
Block* near(Block* from, uintptr_t addr) {
  while (end_of(from) <= addr) from = from->next;
  while (from->addr > addr) from = from->prev;
  return from;
}

}  // namespace

// Whether the blocks of [lo, hi) (inside one mapped granule of `arena`) may
// be moved to another physical granule: each allocated or free, used on its
// own stream only, never exported.
bool DeviceAllocator::movable(Block* from, uintptr_t lo, uintptr_t hi) const {
  for (Block* b = near(from, lo); b != nullptr && b->addr < hi; b = b->next) {
    if (b->is_free()) continue;
    if (b->state != BlockState::kAllocated || !b->uses.empty() || exported_.count(b->addr) != 0) return false;
  }
  return true;
}

// Ladder step 2b (Note [Moving slivers]): moves what pairs of slivers it can
// find in the arenas of this device; returns the granules given back.
size_t DeviceAllocator::move_slivers() {
  if (!moving_ || vmm_ == VmmMode::kOff || capturing_ > 0) return 0;  // Note [Capture]
  // Exports of blocks freed since: their address no longer names one.
  for (auto it = exported_.begin(); it != exported_.end();) {
    it = live_.find(*it) == nullptr ? exported_.erase(it) : std::next(it);
  }
  size_t moved = 0;
  for_each_arena([&](Segment* arena) { moved += move_in(arena); });
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

size_t DeviceAllocator::move_in(Segment* arena) {
  const size_t g = granule_;
  const uintptr_t base = arena->base;
  auto single = [&](size_t slot) { return arena->phys[slot].size == g && !arena->twinned[slot]; };
  std::vector<Sliver> ends, starts;  // kind a, kind b
  for (Block* b = arena->head; b != nullptr; b = b->next) {
    if (!b->is_free()) continue;  // holes too: they start and end on boundaries
    const size_t first = (b->addr - base) / g;
    const size_t p = (b->addr - base) % g;  // a live block before it in its first granule, unless 0
    const size_t last = (end_of(b) - base) / g;
    const size_t q = (end_of(b) - base) % g;  // a live block after it in its last granule, unless 0
    if (p != 0 && last > first && single(first)) ends.push_back({first, p, b});
    if (q != 0 && b->addr <= base + last * g && single(last) && movable(b, end_of(b), base + (last + 1) * g)) {
      starts.push_back({last, q, b});
    }
  }
  if (ends.empty() || starts.empty()) return 0;
  auto by_offset = [](const Sliver& x, const Sliver& y) { return x.offset < y.offset; };
  std::sort(ends.begin(), ends.end(), by_offset);
  std::sort(starts.begin(), starts.end(), by_offset);

  // Each b takes the a with the smallest p <= q not taken yet (and not b itself).
  std::vector<std::pair<Sliver, Sliver>> pairs;
  size_t next_end = 0;
  std::vector<size_t> open;  // ends with p <= the current q, not taken, in order of p
  for (const Sliver& b : starts) {
    while (next_end < ends.size() && ends[next_end].offset <= b.offset) open.push_back(next_end++);
    for (auto it = open.begin(); it != open.end(); ++it) {
      const Sliver& a = ends[*it];
      if (a.slot == b.slot) continue;
      pairs.emplace_back(a, b);
      open.erase(it);
      break;
    }
  }
  // A granule is an a or a b, never both: one with a free start and a free
  // end may have been taken twice; the later pair goes.
  std::vector<bool> taken(arena->phys.size());
  std::vector<std::pair<Sliver, Sliver>> kept;
  for (const auto& pr : pairs) {
    if (taken[pr.first.slot] || taken[pr.second.slot]) continue;
    taken[pr.first.slot] = taken[pr.second.slot] = true;
    kept.push_back(pr);
  }
  if (kept.empty()) return 0;

  // The copies, queued on the arena's stream; then one synchronization.
  std::vector<std::pair<Sliver, Sliver>> copied;
  for (const auto& [a, b] : kept) {
    const uintptr_t from = base + b.slot * g + b.offset;
    const uintptr_t to = base + a.slot * g + b.offset;
    breaks_capture();
    if (succeeded(backend_->copy_device_async(device_, to, from, g - b.offset, arena->stream))) copied.push_back({a, b});
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
    Block* a_lent = lend(near(a.free, a_lo + b.offset), a_lo + b.offset, a_lo + g);
    Block* b_lent = lend(near(b.free, b_lo), b_lo, b_lo + b.offset);
    pair_twins(arena, a.slot, a_lent, b.slot, b_lent);
    arena->doubled += g;
    stats_.reserved_bytes.decrease(arena->pool->stat, static_cast<int64_t>(g));
    ++stats_.num_moved_granules;
    stats_.moved_bytes += static_cast<int64_t>(g - b.offset);
    ++moved;
  }
  return moved;
}

}  // namespace pyalloc
