// types.hpp: the allocator's data structures, and the invariants they keep.
//
// Glossary
//   segment      a contiguous range obtained from the backend in one call
//                (cuMemAlloc on cuda). Segments belong to one pool and one
//                stream, and are released to the backend only when wholly free.
//   block        a piece of a segment. Blocks tile their segment exactly, in
//                address order, linked by prev/next. A block is free,
//                allocated, or pending-free.
//   pool         a set of segments with one free set: the small pool
//                (requests <= kSmallRequest; unused with vmm=shared, Note
//                [One arena for small and large]), the large pool, user pools
//                (selected by the thread's current pool), the plan pool
//                (an iteration plan's region, Note [Iteration plans]), and
//                the long pool (requests predicted long-lived, Note
//                [Lifetime-aware placement]).
//   free set     a pool's free blocks by stream and size class (Note [Free
//                sets]): best fit, lowest address first among equal sizes.
//   stream       the stream a segment was allocated for. A free block is
//                reused only by requests on the same stream.
//   stream use   another stream the block was used on (record_stream). Such
//                a block, once freed, is pending until events recorded on
//                those streams complete.
//   cached free  bytes of free blocks: reserved but not handed out.
//   arena        a segment made with the backend's virtual-memory calls: one
//                large reservation per pool and stream, backed by physical
//                granules mapped where blocks need them (Note [Arenas]).
//   hole         a block of an arena with no physical memory behind it.
//   twin         one of the granules of an arena (two, or more: a group)
//                that map the same physical granule (Note [Shared granules],
//                device/share.cpp; a move makes them too: Note [Moving
//                slivers], device/move.cpp; Note [Groups of twins],
//                device/groups.cpp).
//   lent         a part of a twin that another twin of its group owns:
//                mapped here, but never handed out or cached here.
//
// Invariants (pyalloc_check: I1..I9, I13 and I16 by observe/check.cpp's walk,
// I10..I12, I14 and I15 by the device allocator beside it, device/reports.cpp)
//   I1  the blocks of a segment tile it: first.addr == base,
//       b.next.addr == b.addr + b.size, sum(b.size) == segment.size
//   I2  no two address-adjacent blocks of a segment are both free
//   I3  a block is in its pool's free set  <=>  it is free; every entry of a
//       free set is a free block of a segment of that pool and stream
//   I4  a block is in the live map  <=>  it is allocated (keyed by address)
//   I5  a block is in the pending list  <=>  it is pending-free
//   I6  reserved == allocated + pending_free + cached_free      (bytes)
//       active   == allocated + pending_free                   (bytes)
//       and, while counted, the device's count of whole free granules ==
//       the whole granules inside free blocks of its arenas (Note
//       [Whole-granule count] in device/share.cpp)
//   I7  every counter's current value equals what the walk sums, for all,
//       small-pool and large-pool stat types
//   I8  block sizes and addresses are multiples of kBlockAlign (512 B)
//   I9  in an arena (Note [Arenas] in device/arena.cpp): a hole starts and
//       ends on granule boundaries, no two holes are adjacent, the arena's
//       hole set lists exactly its holes, and a granule
//       is mapped  <=>  some non-hole block overlaps it; reserved counts
//       physical bytes (mapped bytes less one granule per pair of twins), so
//       reserved == sum of the sizes of blocks neither hole nor lent
//   I10 the plan region, while a plan holds one (Note [Iteration plans] in
//       policy/plan.cpp), is a plain segment of the plan pool, and every
//       planned slot lies inside it
//   I11 with lifetime-aware placement on (Note [Lifetime-aware placement] in
//       policy/lifetime.cpp), every call is diverted from the fast path; with
//       it off, the long pool holds no segment
//   I12 the small pool holds only requests of at most kSmallRequest, and
//       with vmm=shared (Note [One arena for small and large] in
//       device/arena.cpp) no segment at all
//   I13 twins (Note [Shared granules] in device/share.cpp) come in groups
//       of two or more granules of one arena, each naming the next in a ring
//       (a pair: each other), all mapping the same physical granule; a lent
//       block is one piece of one twin, and at every offset of the granule
//       exactly one twin of the group owns the bytes (its block there is not
//       lent) while every other lends them (Note [Moving slivers], Note
//       [Groups of twins]), so each twin owns some offsets and lends some.
//       Each twin's record names its lent pieces, all of them, in address
//       order (Twin::lent)
//   I14 once an arena's sliver index is on, it lists exactly the arena's free
//       slivers, each under its offset (Note [Sliver index] in
//       blocks/sliver_index.hpp); an index is on  <=>  every call is diverted
//       from the fast path
//   I15 a held pool (Note [Held pools] in device/pools.cpp) has no arena; a
//       pending free is deferred (Note [Capture]) only while a capture is
//       under way, and every call is diverted from the fast path  <=>  one is;
//       no driver call that breaks a capture (a release, an unmap, an event
//       recorded, queried or synchronized) was ever made during one
//   I16 in an arena, a physical chunk of k granules (an extent when k > 1:
//       Note [Extents] in device/chunks.cpp) is mapped whole over k granules,
//       each of which records it in phys[]; no granule of an extent is a twin
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "backends/backend.hpp"
#include "blocks/free_set.hpp"
#include "blocks/holes.hpp"
#include "blocks/sliver_index.hpp"

namespace pyalloc {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;

constexpr size_t kBlockAlign = 512;          // every size is rounded to this
constexpr size_t kSmallRequest = 1 * kMiB;   // largest request of the small pool
constexpr size_t kLargeSplitMin = 1 * kMiB;  // large blocks split only if more than this remains
constexpr size_t kLargeRound = 2 * kMiB;     // big requests get segments rounded to this
// Requests above this are refused outright: far beyond any device, and safe
// from overflow in every rounding computation.
constexpr size_t kMaxRequest = size_t{1} << 52;

// `n` rounded up to a multiple of `step`.
inline size_t round_up_to(size_t n, size_t step) { return (n + step - 1) / step * step; }

// kHole and kLent exist only in arenas. A hole is unmapped address space,
// never handed out as it is, never in a free set. A lent block is mapped, but
// its bytes belong to the block at the same offsets of its granule's twin
// (Note [Shared granules] in device/share.cpp): never handed out, cached or
// counted.
enum class BlockState : uint8_t { kFree, kAllocated, kPendingFree, kHole, kLent };

// kPlan: the region of an iteration plan (Note [Iteration plans] in
// policy/plan.cpp), never chosen for a request by size.
// kLong: requests predicted long-lived (Note [Lifetime-aware placement] in
// policy/lifetime.cpp).
enum class PoolKind : uint8_t { kSmall, kLarge, kUser, kPlan, kLong };

// The built-in pools' names: their stats are pool.<name>.*, so no user pool
// may take one (pyalloc_pool_create).
inline constexpr const char* kSmallPoolName = "small";
inline constexpr const char* kLargePoolName = "large";
inline constexpr const char* kPlanPoolName = "plan";
inline constexpr const char* kLongPoolName = "long";
inline constexpr const char* kBuiltinPoolNames[] = {kSmallPoolName, kLargePoolName, kPlanPoolName, kLongPoolName};

// Stat types, as in torch.cuda.memory_stats(): all / small_pool / large_pool.
// A segment's blocks count as small_pool when its pool is the small pool;
// large and user pools count as large_pool.
enum StatType : int { kStatAll = 0, kStatSmall = 1, kStatLarge = 2, kNumStatTypes = 3 };

struct Pool;
struct Segment;

// Note [Block layout]
// A Block is three cache lines, aligned. The first holds what a walk reads
// in the blocks it passes: a free-set class walk (size, addr, bin_next),
// coalescing's look at a neighbour (state, size, the free-set links), best
// fit. The second holds the rest of what the fast path's own malloc or free
// reads and writes (requested, pool, stream, uses, freed_at): a free of a
// block whose records are out of the cache misses these two lines and no
// third (freed_at in the third: 0.65 more misses an operation of a
// simulated 2 MiB cache at 10^5 live blocks; the CPU's adjacent-line
// prefetch hid most of it: ns/op the same within noise,
// docs/benchmarks/2026-11-28-scale-misses-cpu.md). With 10^5
// live blocks a churn's blocks no longer fit the CPU's caches and each block
// a walk passes costs a miss: one line per block instead of two took the
// D1 misses of tools/bench/scale.cpp's churn at 10^5 live blocks from 26.8
// to 16.1 per operation (callgrind's cache simulation). Blocks come 64 to a
// slab (kBlockSlab, DeviceAllocator::new_block): an aligned allocation each
// cost ~60 instructions in glibc's memalign.
constexpr size_t kBlockSlab = 64;

struct alignas(64) Block {
  uintptr_t addr = 0;
  size_t size = 0;           // bytes, multiple of kBlockAlign
  Block* prev = nullptr;     // address-order neighbours in the segment
  Block* next = nullptr;
  Block* bin_prev = nullptr;   // neighbours in its free-set class list, while free; in its
  Block* bin_next = nullptr;   // arena's address-order list of holes, while a hole (holes.hpp)
  Segment* segment = nullptr;
  BlockState state = BlockState::kFree;
  uint8_t sliver_kinds = 0;  // bit k: listed as a sliver of kind k (Note [Sliver index])
  int bin_class = -1;          // FreeSet::size_class(size), set when it enters a free set and
                               // kept while allocated (its size does not change then)
  // ---- the second cache line: the rest of what the fast path's malloc and free touch
  size_t requested = 0;      // bytes the caller asked for; 0 unless allocated/pending
  Pool* pool = nullptr;      // == segment->pool, kept here for the fast path
  StreamId stream = 0;       // == segment->stream, likewise
  std::vector<StreamId> uses;  // streams recorded by record_stream (rarely non-empty)
  uint64_t freed_at = 0;  // while free: the allocator's count of frees when a request freed it
                          // (coalesced with free neighbours); 0 for memory no request freed as
                          // it is (a split's remainder, a hole just mapped): Note [Cold donors]
  uint64_t born = UINT64_MAX;  // its number in the planner's observation, while observed
                               // (stale otherwise: SequenceLearner ignores old numbers)
  // ---- the third: the lifetime learner's and the sliver index's, off the fast path
  uint64_t lifetime_number = UINT64_MAX;  // its request number in LifetimeLearner, while learning
  Block* sliver_prev[2] = {nullptr, nullptr};  // neighbours in its arena's sliver lists, while
  Block* sliver_next[2] = {nullptr, nullptr};  // free and indexed (Note [Sliver index])

  bool is_free() const { return state == BlockState::kFree; }
};
// Note [Block layout]: what a walk reads in the first line, the rest of the
// fast path's in the second.
static_assert(offsetof(Block, bin_class) + sizeof(int) <= 64 && offsetof(Block, requested) == 64 &&
                  offsetof(Block, freed_at) + sizeof(uint64_t) <= 128,
              "Note [Block layout]: a Block's fields moved across its cache lines");

// One granule of a group of twins (Note [Shared granules] in
// device/share.cpp; Note [Groups of twins] in device/groups.cpp): the next
// granule of the group, which maps the same physical granule (the group is a
// ring: following `other` comes back here; a pair names each other), and this
// granule's lent pieces in address order, every one of them. A lent block is
// never merged or freed while the group lasts; a piece splits only when its
// granule's group changes (untwin, merge_in), which keeps this list.
struct Twin {
  size_t other = 0;
  std::vector<Block*> lent;
};

struct Segment {
  uintptr_t base = 0;
  size_t size = 0;          // an arena's whole reservation
  Pool* pool = nullptr;
  StreamId stream = 0;
  Block* head = nullptr;    // lowest-addressed block
  uint64_t id = 0;          // creation order
  // Arenas only: granule i of the reservation is backed by phys[i] (value 0:
  // not mapped), a chunk of one granule or more (I16); `mapped` counts the
  // bytes of backed granules.
  // twins[i] for each granule i that maps the same physical granule as
  // others (Note [Shared granules] in device/share.cpp, Note [Groups of
  // twins] in device/groups.cpp), in granule order, each naming the next of
  // its group; `doubled` counts one granule per twin beyond the first of
  // each group.
  bool arena = false;
  bool indexed = false;  // slivers.on(), here beside the fields a cache hit reads
  // Its free blocks' whole granules are in the device's count (Note
  // [Whole-granule count] in device/share.cpp), here for the same reason.
  bool counted = false;
  size_t mapped = 0;
  size_t doubled = 0;
  std::vector<PhysHandle> phys;
  std::map<size_t, Twin> twins;
  std::vector<bool> twinned;  // per granule: a key of `twins` (a lookup without the map's walk)
  Holes holes;          // every hole, by address and size (I9)
  SliverIndex slivers;  // its free slivers, once on (Note [Sliver index])

  bool wholly_free() const { return head->is_free() && head->size == size; }
  size_t reserved_bytes() const { return arena ? mapped - doubled : size; }
};

struct Pool {
  Pool(PoolKind k, int pool_id, std::string pool_name)
      : kind(k), stat(k == PoolKind::kSmall ? kStatSmall : kStatLarge), id(pool_id), name(std::move(pool_name)) {}
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  const PoolKind kind;
  const StatType stat;      // the stat type its blocks count under
  const int id;             // 0 small/large defaults; user pools from 1
  const std::string name;
  FreeSet free_blocks;  // Note [Free sets]
  bool in_arenas = false;        // grows in arenas, not plain segments (Note [Arenas])
  bool held = false;             // Note [Held pools] (device/pools.cpp)
  std::vector<Segment*> arenas;  // one per stream
};

}  // namespace pyalloc
