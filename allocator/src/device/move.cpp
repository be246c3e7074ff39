// move.cpp: moving live bytes so that two partly free granules give one back.
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
// A granule live only in its middle fits in another's free middle too:
//
//   granule a   [ live a | free ............. | live a ]   free in [x, y)
//   granule b   [ free ....... | live b | free ........ ]   live in [q, p)
//
// with x <= q and p <= y: b's live bytes go to the same offsets of a's
// granule, a lends [x, y), b owns [x, y) and lends its start [0, x) and its
// end [y, g) (I13: a twin lends one piece, or two when the other lends its
// middle). These nested pairs are sought after the cut ones, among the
// granules free at both ends that no cut pair took, each in the tightest
// free middle (a free block inside one granule, touching neither edge, of a
// granule no pair took) that holds its live part (nest). At lstm_varlen's
// first failing request at 194 MiB, the last pair the request lacked was
// such a one; with it the replay went on from its 11,605th call to its
// 26,837th before a request failed: by then the partly free granules were
// twins, which pair no more; merging their groups (Note [Groups of twins]
// in groups.cpp) took its minimum from 196 MiB to 194.
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

// A granule with a free end (an a) or a free start (a b), as pair_slivers
// takes them: its slot, its edge (an a's live part ends there, at p; a b's
// starts there, at q), and a free block that held its free part when it was
// found.
struct Sliver {
  size_t slot;
  size_t edge;
  Block* free;
};

// One move: b's live bytes [copy_lo, copy_hi) go to the same offsets of a's
// physical granule, and b's address range maps a's granule. a lends [x, y)
// (offsets), b the rest: [0, x) and, when y < g, [y, g). From a pair cut at
// one offset (x = b's start, y = g) or a nested pair ([x, y) a free block in
// the middle of a, b live only inside it). The free blocks named hold those
// pieces when the move is planned: in a, [x, y); in b, its start and its end.
struct Move {
  size_t a_slot, b_slot;
  size_t x, y;
  size_t copy_lo, copy_hi;
  Block* a_free;
  Block* b_start;
  Block* b_end;  // nested pairs only
};

// Nested pairs (Note [Moving slivers]): granules free at both ends that no
// cut pair took (`duals`: each its start sliver and its end sliver), each
// placed in the tightest free middle of another untaken single granule
// (`middles`: a slot and a free block inside it that touches neither edge)
// that holds its live part. At most `budget` comparisons in all.
std::vector<Move> nest(const std::vector<std::pair<Sliver, Sliver>>& duals,
                       const std::vector<std::pair<size_t, Block*>>& middles, uintptr_t base, size_t g,
                       std::vector<bool>* taken, size_t budget) {
  std::vector<Move> out;
  std::vector<size_t> order(duals.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  auto span = [&](size_t i) { return duals[i].second.edge - duals[i].first.edge; };
  std::sort(order.begin(), order.end(), [&](size_t i, size_t j) { return span(i) > span(j); });  // widest first
  for (const size_t i : order) {
    const Sliver& start = duals[i].first;  // b is free up to start.edge and from end.edge on
    const Sliver& end = duals[i].second;
    if ((*taken)[start.slot]) continue;
    const std::pair<size_t, Block*>* best = nullptr;  // the tightest middle that holds b's live part
    size_t best_m1 = 0;
    for (size_t k = 0; k < middles.size() && budget > 0; ++k, --budget) {
      const auto& [slot, gap] = middles[k];
      const size_t m1 = gap->addr - base - slot * g;
      if (slot == start.slot || (*taken)[slot] || m1 > start.edge || m1 + gap->size < end.edge ||
          (best != nullptr && gap->size >= best->second->size)) {
        continue;
      }
      best = &middles[k];
      best_m1 = m1;
    }
    if (best == nullptr) continue;
    const auto& [slot, gap] = *best;
    (*taken)[slot] = (*taken)[start.slot] = true;
    out.push_back({slot, start.slot, best_m1, best_m1 + gap->size, start.edge, end.edge, gap, start.free, end.free});
  }
  return out;
}

}  // namespace

// A failed move whose granule cannot be mapped back: its live bytes are out
// of reach, and going on would hand the program memory that faults or reads
// another granule.
void DeviceAllocator::lost_mapping(uintptr_t va, const std::string& why) {
  std::fprintf(stderr, "pyalloc: fatal: the granule at 0x%llx could not be mapped back after a failed move (%s)\n",
               static_cast<unsigned long long>(va), why.c_str());
  std::abort();
}

// Before the first copy of a move: every stream's work done (a block may be
// used on a stream other than its own, ordered by the program's events), once
// per ladder step (*synchronized).
void DeviceAllocator::synchronize_for_moves(bool* synchronized) {
  if (*synchronized) return;
  breaks_capture();
  backend_->synchronize_device(device_);
  *synchronized = true;
}

// Maps physical granule `to` at granules slots[0..n) of `arena` instead of
// their own (phys[], left as it is for the caller); on a failure, every one
// remapped so far maps its own again and false is returned.
bool DeviceAllocator::remap(Segment* arena, const size_t* slots, size_t n, PhysHandle to) {
  const size_t g = granule_;
  for (size_t i = 0; i < n; ++i) {
    const uintptr_t lo = arena->base + slots[i] * g;
    backend_->unmap(device_, lo, g);
    if (succeeded(backend_->map(device_, lo, to))) continue;
    for (size_t j = i + 1; j-- > 0;) {  // this one (unmapped) and those before it (mapped to `to`)
      const uintptr_t back = arena->base + slots[j] * g;
      if (j < i) backend_->unmap(device_, back, g);
      if (!succeeded(backend_->map(device_, back, arena->phys[slots[j]]))) lost_mapping(back, last_backend_error_);
    }
    return false;
  }
  return true;
}

// Whether the blocks of [lo, hi) (inside one mapped granule of `arena`) may
// be moved to another physical granule: each allocated or free, used on its
// own stream only as far as record_stream says, never exported.
bool DeviceAllocator::movable(Block* from, uintptr_t lo, uintptr_t hi) const {
  for (Block* b = walk_to(from, lo); b != nullptr && b->addr < hi; b = b->next) {
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
  for_each_arena([&](Segment* arena) {  // then whole groups of twins (Note [Groups of twins])
    if (moved < wanted && !arena->twins.empty()) moved += merge_in(arena, wanted - moved, &synchronized);
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

  const size_t slots = arena->phys.size();
  std::vector<Move> moves;
  std::vector<bool> taken(slots, false);
  for (const auto& [a, b] : pair_slivers(ends, starts, slots)) {
    moves.push_back({a->slot, b->slot, b->edge, g, b->edge, g, a->free, b->free, nullptr});
    taken[a->slot] = taken[b->slot] = true;
  }
  // Granules free at both ends left over: nested in another's free middle.
  std::vector<const Sliver*> end_of_slot(slots, nullptr);
  for (const Sliver& a : ends) end_of_slot[a.slot] = &a;
  std::vector<std::pair<Sliver, Sliver>> duals;
  for (const Sliver& b : starts) {
    if (!taken[b.slot] && end_of_slot[b.slot] != nullptr && end_of_slot[b.slot]->edge > b.edge) {
      duals.emplace_back(b, *end_of_slot[b.slot]);
    }
  }
  if (!duals.empty() && moves.size() < wanted) {
    std::vector<std::pair<size_t, Block*>> middles;  // free blocks inside one granule, touching neither edge
    for (Block* b = arena->head; b != nullptr; b = b->next) {
      const size_t lo = b->addr - base;
      if (!b->is_free() || lo % g == 0 || (lo + b->size) % g == 0 || (lo + b->size) / g != lo / g) continue;
      if (single(lo / g) && !taken[lo / g]) middles.emplace_back(lo / g, b);
    }
    for (const Move& m : nest(duals, middles, base, g, &taken, size_t{1} << 22)) moves.push_back(m);
  }
  auto copied_bytes = [](const Move& m) { return m.copy_hi - m.copy_lo; };
  std::stable_sort(moves.begin(), moves.end(),
                   [&](const Move& p, const Move& q) { return copied_bytes(p) < copied_bytes(q); });
  if (moves.size() > wanted) moves.resize(wanted);  // the smallest copies
  if (moves.empty()) return 0;

  // Every stream's work first, then the copies on the arena's stream, then one wait for them.
  synchronize_for_moves(synchronized);
  std::vector<Move> copied;
  for (const Move& m : moves) {
    const uintptr_t from = base + m.b_slot * g + m.copy_lo;
    const uintptr_t to = base + m.a_slot * g + m.copy_lo;
    if (succeeded(backend_->copy_device_async(device_, to, from, m.copy_hi - m.copy_lo, arena->stream))) {
      copied.push_back(m);
    }
  }
  if (copied.empty() || !synchronize_stream(arena)) return 0;

  size_t moved = 0;
  for (const Move& m : copied) {
    const uintptr_t a_lo = base + m.a_slot * g;
    const uintptr_t b_lo = base + m.b_slot * g;
    const PhysHandle own = arena->phys[m.b_slot];
    if (!remap(arena, &m.b_slot, 1, arena->phys[m.a_slot])) continue;  // back as it was: bytes still in b's
    release_chunks(&own, 1);
    arena->phys[m.b_slot] = arena->phys[m.a_slot];
    Block* a_lent = lend(walk_to(m.a_free, a_lo + m.x), a_lo + m.x, a_lo + m.y);
    Block* b_lent = lend(walk_to(m.b_start, b_lo), b_lo, b_lo + m.x);
    Block* b_lent2 = m.y < g ? lend(walk_to(m.b_end, b_lo + m.y), b_lo + m.y, b_lo + g) : nullptr;
    pair_twins(arena, m.a_slot, a_lent, m.b_slot, b_lent, b_lent2);
    arena->doubled += g;
    stats_.reserved_bytes.decrease(arena->pool->stat, static_cast<int64_t>(g));
    ++stats_.num_moved_granules;
    stats_.moved_bytes += static_cast<int64_t>(m.copy_hi - m.copy_lo);
    ++moved;
  }
  return moved;
}

}  // namespace pyalloc
