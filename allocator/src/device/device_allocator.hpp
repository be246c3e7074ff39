// device_allocator.hpp: the caching allocator of one device.
//
// Policy summary
//   - Sizes are rounded up to 512 B (optionally to power-of-two divisions,
//     like PyTorch's roundup_power2_divisions).
//   - Requests up to 1 MiB come from the small pool, carved from
//     `small_segment` (2 MiB) segments; larger ones from the large pool:
//     below large_segment/2 from `large_segment` (20 MiB) segments, above
//     that from a segment of their own rounded up to 2 MiB. A thread's current
//     user pool overrides both. With `lifetime` on, requests predicted to
//     outlive the next 32 go to the long pool instead (Note [Lifetime-aware
//     placement] in policy/lifetime.cpp).
//   - With `vmm` on, the large and user pools (and with vmm=all the small
//     pool) grow in virtual-memory arenas instead: granules mapped where the
//     request fits best, and stitched from free slivers under pressure
//     (Note [Arenas] in arena.cpp). With vmm=shared (the default on the host
//     and sim backends) there is no small pool: requests of every size share
//     the large pool's arena (Note [One arena for small and large]).
//   - A free block is found by best fit on the request's stream, lowest
//     address first among equal sizes. It is split when the remainder is
//     worth keeping: any remainder in the small and user pools, more than
//     1 MiB in the large pool.
//   - Freed blocks coalesce with free neighbours at once. A block used on
//     other streams (record_stream) is pending until events recorded on those
//     streams complete.
//   - Segments go back to the backend only when wholly free: on
//     empty_cache(), when cached free bytes exceed max_cached (oldest first),
//     and on the slow path under pressure (Note [Pressure ladder]).
//
// Locking: one mutex per device guards everything here. The fast path takes
// it once. It is never held while calling a pressure callback or the daemon.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "backends/backend.hpp"
#include "backends/metered.hpp"
#include "observe/snapshot.hpp"
#include "blocks/arena.hpp"
#include "blocks/ptr_map.hpp"
#include "blocks/types.hpp"
#include "device/device_mutex.hpp"
#include "ground/config.hpp"
#include "observe/stats.hpp"
#include "observe/trace.hpp"
#include "policy/lifetime.hpp"
#include "policy/plan.hpp"

namespace pyalloc {

class JsonWriter;

// What a device allocator asks of the process around it. The runtime
// implements it (abi/runtime.cpp), so that the device knows nothing of
// pressure callbacks, gpumemd or the registry.
class DeviceHooks {
 public:
  virtual ~DeviceHooks() = default;
  // Ladder step 3: the registered pressure callbacks; returns the bytes they
  // freed. Called WITHOUT the device lock held.
  virtual size_t run_pressure_callbacks(int device, size_t bytes_needed) = 0;
  // Ladder step 4: asks gpumemd to have other processes on the device trim.
  // True when it answered, with the bytes they freed in *freed_bytes. Called
  // WITHOUT the device lock held.
  virtual bool ask_daemon(int device, size_t bytes_needed, size_t* freed_bytes) = 0;
  // Reserved memory changed (a segment or granule came or went), so
  // published figures are stale. Called WITH the device lock held: it must
  // neither block nor call back into the allocator.
  virtual void reserved_changed() = 0;
  // The name of user pool `pool_id` (>= 1), for stats and snapshots.
  virtual std::string pool_name(int pool_id) = 0;
  // Whether user pool `pool_id` is held (Note [Held pools] in device/pools.cpp).
  virtual bool pool_held(int pool_id) = 0;
};

// Passed as `size` to free() when the caller does not know it (CuPy).
constexpr size_t kAnySize = SIZE_MAX;
constexpr StreamId kAnyStream = ~StreamId{0};  // PYALLOC_ANY_STREAM

enum class FreeResult { kOk, kUnknownPointer, kDoubleFree, kSizeMismatch, kStreamMismatch, kRetired };

class DeviceAllocator {
 public:
  // `backend` is the runtime's metered backend (Note [Backend time]).
  DeviceAllocator(int device, const Config& config, MeteredBackend* backend, DeviceHooks& hooks);
  ~DeviceAllocator();
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;

  // malloc and free (the general path) are defined in fast_path.hpp.
  // Returns the block's address, or nullptr with *status (PYALLOC_ENOMEM, or
  // PYALLOC_EBUSY when this allocator was retired by a reconfiguration); an
  // OOM report goes to the thread's last error. `size` must be in
  // (0, kMaxRequest].
  void* malloc(size_t size, StreamId stream, int pool_id, int* status);
  // A bad call is counted and described in the thread's last error.
  FreeResult free(uintptr_t addr, size_t size, StreamId stream);
  // The fast path (Note [Fast path] in fast_path.hpp). After
  // try_lock(), malloc_cached() (default pool) and free_cached() serve the
  // request from the cache and release the lock; a request that needs the
  // general path gets `otherwise()`, called with nothing changed and the lock
  // still held (it unlocks and goes to malloc() / free()).
  bool try_lock() { return mutex_.try_lock(); }
  void unlock() { mutex_.unlock(); }
  // Held across fork() by the process's handlers (Note [Fork] in abi/runtime.cpp).
  void lock() { mutex_.lock(); }
  template <typename Otherwise>
  void* malloc_cached(size_t size, StreamId stream, Otherwise otherwise);
  template <typename Otherwise>
  void free_cached(uintptr_t addr, size_t size, StreamId stream, Otherwise otherwise);
  // False when `addr` is not a live allocation of this device.
  bool record_stream(uintptr_t addr, StreamId stream);
  // False when `addr` is not a live allocation of this device; else the
  // sizes of its free address neighbours (0 where not free).
  bool free_neighbours(uintptr_t addr, size_t* below, size_t* above);
  // Counts a request refused before reaching the allocator (absurd size).
  void count_invalid_size();

  // Note [Held pools] and Note [Capture] (device/pools.cpp).
  // Holds or lets go user pool `pool_id` on this device (creating it); false
  // with *error when a pool to hold already has arena memory here.
  bool hold_pool(int pool_id, bool held, std::string* error);
  // Releases the wholly free segments of user pool `pool_id`, held or not;
  // returns the bytes released and writes what the pool still reserves.
  size_t release_pool(int pool_id, size_t* still_reserved);
  void begin_capture();
  // A cached block of user pool `pool_id` that fits, taken; nullptr when none
  // does (nothing grows, nothing is released: torch.cuda.MemPool's
  // use_on_oom).
  void* take_cached(int pool_id, size_t size, StreamId stream);
  // False when no capture was begun.
  bool end_capture();

  // Note [Sharing blocks] (device/ipc.cpp). Export: the handle of live block
  // `addr`'s memory and the block's offset in what it maps. Import: maps a
  // handle of another process at *base. False with *error (export: with
  // *error empty when `addr` is no live allocation of this device).
  bool ipc_export(uintptr_t addr, std::string* handle, size_t* offset, std::string* error);
  bool ipc_import(const std::string& handle, uintptr_t* base, std::string* error);
  bool ipc_close(uintptr_t base);  // false when `base` is no import of this device

  // Synchronizes pending frees and releases every wholly free segment.
  size_t empty_cache();
  // Releases wholly free segments, oldest first, until `bytes` (0 = all).
  size_t release_cached(size_t bytes);

  void apply_settings(const Config& config);  // runtime-adjustable keys only
  void set_memory_fraction(double fraction);

  // Full invariant walk (types.hpp I1..I13). False with *error on violation.
  bool check(std::string* error);

  // A consistent view of the device's memory, for replays and reports.
  struct Usage {
    size_t reserved;
    size_t allocated;
    size_t active;
    size_t cached_free;
    size_t largest_free;
    size_t peak_reserved;
    uint64_t num_ooms;
    uint64_t num_alloc_retries;
    uint64_t allocations_total;  // changes whenever the device allocates
  };
  Usage usage();
  // The figures of pyalloc_memory_info (pyalloc.h says what each is); asks
  // the backend for free memory.
  struct MemoryInfo {
    size_t device_total;
    size_t device_free;
    size_t reserved;
    size_t allocated;
    size_t limit;
    size_t largest_cached;
    size_t largest_request;
  };
  MemoryInfo memory_info();

  // torch.cuda.memory_stats() keys, then pool.<name>.<figure> for each pool
  // (PoolUsage::fields).
  std::string stats_json(int64_t num_invalid_device, int64_t num_invalid_record_stream);
  void write_pools_json(JsonWriter& w);  // the snapshot's "pools" entries
  void reset_peaks();
  void reset_accumulated();
  void write_segments_json(JsonWriter& w);
  // The same segments, to a visitor (observe/snapshot.hpp), under the lock.
  template <typename F>
  void visit_snapshot(F fn) {
    Lock lock(mutex_);
    visit_segments(segments_, fn);
  }
  void write_trace_json(JsonWriter& w);

  // Reconfiguration: true when nothing is allocated or pending; then
  // releases all memory and marks this allocator retired, so late callers
  // are sent to its successor.
  bool retire_if_idle(int64_t* live_bytes);
  void unretire();  // undoes retire_if_idle when a reconfiguration is abandoned

  int device() const { return device_; }

 private:
  using Lock = std::lock_guard<DeviceMutex>;

  struct PendingFree {
    Block* block;
    std::vector<EventHandle> events;
    bool stuck;  // an event could not be recorded: never safe to reuse
    bool deferred = false;  // freed during a capture: no event yet (Note [Capture])
  };

  // Settings, limits and pools (device_allocator.cpp).
  void update_share_from();
  size_t reserved_limit();
  size_t device_total();  // the backend's total bytes, asked once (slow path only)
  Pool& user_pool(int pool_id);  // created on first use
  size_t segment_size_for(const Pool& pool, size_t rounded) const;
  std::vector<Pool*> pools();  // small, large, long, plan, then user pools
  std::vector<const Pool*> pools() const;

  // Block changes, inline (blocks_inl.hpp).
  Block* new_block();
  void delete_block(Block* block);
  void recycle_block(Block* block);  // delete_block() given spare_room(1)
  bool spare_room(size_t n) const;
  void make_spare_room(size_t n);
  size_t round_size(size_t size) const;
  Pool& select_pool(size_t rounded, int pool_id);
  bool should_split(const Pool& pool, size_t remaining) const;
  bool shares_first(const Pool& pool, size_t rounded) const;
  size_t whole_granule_offset(const Block* block, size_t rounded) const;
  template <bool kCount = true>
  void give_back(Block* block);
  template <bool kCount = true>
  Block* coalesce(Block* block);                            // merges free neighbours; spare_room(2)
  void split_into(Block* block, Block* rest, size_t offset);  // `rest` becomes the part after `offset`
  void absorb_next(Block* block);                           // spare_room(1)
  void insert_free(Block* block);
  template <bool kFast = false, bool kCount = true>
  void reinsert_free(Block* block);
  template <bool kCount = true>
  void erase_free(Block* block);
  template <bool kCount = true>
  void count_cached(StatType t, const Block* block);
  template <bool kCount = true>
  void uncount_cached(StatType t, const Block* block);
  void index_in(Block* block);
  void index_out(Block* block);

  // The fast path's state changes and the general path (fast_path.hpp).
  template <bool kFast = false, bool kCount = true>
  void* hand_out(Pool& pool, Block* block, Block* rest, size_t size, size_t rounded);
  void count_freed(const Block* block);
  bool has_free_neighbour(const Block* block) const;
  template <bool kFast = false, bool kCount = true>
  void cache_block(Block* block);
  void* split_and_unlock(Pool& pool, Block* block, size_t size, size_t rounded);
  void merge_and_unlock(Block* block);
  void* counted_hand_out_and_unlock(Pool& pool, Block* block, size_t size, size_t rounded);
  void counted_cache_and_unlock(Block* block);
  // The general path's allocation by the cache: the allocated block, or
  // nullptr with *status. Callers that keep a number with the block (the
  // planner, lifetime placement) have it at hand with no live-map lookup.
  Block* alloc_block(Pool& pool, size_t size, size_t rounded, StreamId stream, int* status);
  void* malloc_cache(Pool& pool, size_t size, size_t rounded, StreamId stream, int* status);
  void* take(Pool& pool, Block* block, size_t size, size_t rounded);
  void finish_free(Block* block);

  // The slow path (Note [Pressure ladder] in slow_path.cpp). Called with the
  // lock held; returns with it held (steps 3 and 4 drop it meanwhile).
  // Returns a free block of `pool` that fits (for take()), or nullptr with
  // *status.
  Block* malloc_slow(Pool& pool, size_t size, size_t rounded, StreamId stream, int* status);
  Block* find_or_grow(Pool& pool, size_t rounded, StreamId stream);
  Block* release_and_retry(Pool& pool, size_t rounded, StreamId stream);  // step 1
  Block* retry_after_outside_help(Pool& pool, size_t rounded, StreamId stream);
  Block* grow(Pool& pool, size_t rounded, StreamId stream);
  Segment* alloc_segment(Pool& pool, size_t size, StreamId stream);
  Segment* add_segment(Pool& pool, StreamId stream, uintptr_t base, size_t size, BlockState head_state);
  bool succeeded(const Status& s);  // records a failed backend call's message
  void reserved_changed() {
    const size_t reserved = static_cast<size_t>(stats_.reserved_bytes.current(kStatAll));
    if (reserved == 0) reserved_high_ = 0;  // all given back: a new start
    settle_whole_count(reserved);
    hooks_.reserved_changed();
  }
  void drop_sliver_indexes(bool always);
  void make_pending(Block* block);
  void record_pending_events(PendingFree* pending);
  size_t reclaim_pending(bool synchronize);
  void synchronize_pending();
  size_t release_free_segments(size_t bytes);  // plain segments only
  size_t release_cached_memory(size_t bytes);  // plain segments, then arena granules
  void release_segment(Segment* segment);
  void enforce_max_cached();

  // Arenas and stitching (Note [Arenas] in arena.cpp; the geometry is
  // blocks/arena.hpp).
  size_t granule();
  Segment* arena_for(Pool& pool, StreamId stream);  // created on first use
  Block* split_block(Block* block, size_t offset);
  Block* insert_coalesced(Block* block);
  Block* carve_free(Block* block, uintptr_t lo, uintptr_t hi);
  Block* split_free(Block* block, size_t offset);
  void merge_holes(Block* hole);
  Block* align_to_granule(Block* block, size_t rounded);
  Block* fill_hole(Block* hole, uintptr_t lo, uintptr_t hi, const PhysHandle* handles, size_t n);
  void unmap_free_range(Block* block, uintptr_t lo, uintptr_t hi, std::vector<PhysHandle>* spares);
  bool synchronize_stream(const Segment* arena);
  template <typename F>
  void for_each_arena(F fn);
  uintptr_t chunks_holding(const Segment* arena, uintptr_t lo, uintptr_t hi, size_t granules) const;
  size_t unmap_free_granules(size_t wanted, uintptr_t skip_lo, uintptr_t skip_hi, std::vector<PhysHandle>* spares,
                             const Pool* only = nullptr);
  size_t reservable_granules();
  size_t granules_lacking(size_t granules);
  bool new_granules(size_t n, std::vector<PhysHandle>* handles);
  void release_chunks(const PhysHandle* chunks, size_t n);
  struct Piece {  // a chunk of new memory for a window: where it goes and its size
    uintptr_t va;
    size_t size;
  };
  enum class Fill { kDone, kNoMemory, kMapFailed };
  Fill map_window(Segment* arena, uintptr_t lo, uintptr_t hi, uintptr_t req_lo, uintptr_t req_hi,
                  std::vector<PhysHandle>* spares);
  Block* grow_arena(Pool& pool, size_t rounded, StreamId stream, bool stitch);
  bool reuses_first(size_t fresh) const;
  size_t reuse_granules(Pool& pool, Segment* arena, size_t n, uintptr_t skip_lo, uintptr_t skip_hi,
                        std::vector<PhysHandle>* spares, bool* synchronized, bool any = false);
  Block* stitch(Pool& pool, size_t rounded, StreamId stream);  // ladder step 2
  size_t release_arena_memory(size_t bytes);
  void release_arena(Segment* arena);

  // Shared granules (Note [Shared granules] in share.cpp).
  Block* share_first(Pool& pool, size_t rounded, StreamId stream, const Block* fit);
  Block* map_share(Segment* arena, const SharePlan& plan, std::vector<PhysHandle>* spares);
  Block* lend(Block* block, uintptr_t from, uintptr_t to);
  void pair_twins(Segment* arena, size_t a, Block* a_lent, size_t b, Block* b_lent, Block* b_lent2 = nullptr);
  void index_slivers();
  void count_whole_granules();
  void stop_counting_whole_granules();
  // Stops the count once reserved memory is under 90% of where sharing starts
  // (after a change of either).
  void settle_whole_count(size_t reserved) {
    if (whole_counted_ && reserved < relax_below()) stop_counting_whole_granules();
  }
  // Reserved bytes under which the near-full structures (sliver indexes, the
  // whole-granule count) go: 90% of what the allocator may reserve, a margin
  // below share_from_ so that a device hovering there does not build them
  // again and again.
  size_t relax_below() const { return share_from_ / 19 * 18; }
  bool covered_without_sharing(size_t rounded, const Block* fit) const;
  void relist_granule(Segment* arena, size_t slot, Block* inside);
  void index_arena(Segment* arena);
  void untwin(Segment* arena, size_t slot);
  bool untwin_free(Segment* arena, uintptr_t skip_lo, uintptr_t skip_hi);
  bool spare_covers(size_t rounded, const Block* fit = nullptr);
  // Moving slivers (Note [Moving slivers] in move.cpp): ladder step 4b.
  Block* move_and_retry(Pool& pool, size_t rounded, StreamId stream);
  size_t move_slivers(size_t wanted);
  size_t move_in(Segment* arena, size_t wanted, bool* synchronized);
  size_t merge_in(Segment* arena, size_t wanted, bool* synchronized);
  [[noreturn]] static void lost_mapping(uintptr_t va, const std::string& why);
  void synchronize_for_moves(bool* synchronized);
  bool remap(Segment* arena, const size_t* slots, size_t n, PhysHandle to);
  bool movable(Block* from, uintptr_t lo, uintptr_t hi) const;
  void prune_exported();

  // Placement policies (placement.cpp): lifetime-aware placement (Note
  // [Lifetime-aware placement] in policy/lifetime.cpp) and iteration plans
  // (Note [Iteration plans] in policy/plan.cpp).
  void* malloc_default(Pool& pool, size_t size, size_t rounded, StreamId stream, int* status);
  void* malloc_capturing(Pool& pool, size_t size, size_t rounded, StreamId stream, int* status);
  void unmap_import(uintptr_t base);
  void* take_fit(Pool& pool, Block* block, size_t size, size_t rounded);
  void defer_free(Block* block);
  Block* malloc_watched(Pool& pool, size_t size, size_t rounded, StreamId stream, int* status);
  Block* malloc_from_plan(Pool& pool, size_t size, size_t rounded, StreamId stream, int* status);
  void watch_free(Block* block);
  void observe();  // (re)starts observation
  bool start_plan_region();
  Block* carve_planned(size_t offset, size_t rounded);
  void drop_plan();
  bool check_plan(std::string* problem) const;       // I10
  bool check_lifetimes(std::string* problem) const;  // I11

  // Reports (reports.cpp).
  FreeResult classify_bad_free(uintptr_t addr);
  FreeResult refuse_size_mismatch(Block* block, size_t size);
  FreeResult refuse_stream_mismatch(Block* block, StreamId stream);
  size_t largest_free_block() const;
  std::string oom_report(size_t size, size_t rounded, StreamId stream, size_t callback_freed,
                         size_t daemon_freed);

  // First, so that the fast path reaches the lock at the allocator's own address.
  DeviceMutex mutex_;
  // Nonzero sends every call to the general path: kDivertRetired (a
  // reconfiguration retired this allocator), kDivertPlanner (the planner is
  // observing, or a plan is in force), kDivertLifetime (lifetime-aware
  // placement is on), kDivertSlivers (an arena's sliver index is on: Note
  // [Sliver index]), kDivertCapture (a CUDA graph capture is under way:
  // Note [Capture] in pools.cpp), kDivertTrace (a trace is being recorded:
  // one flag for the fast path to test instead of two).
  enum : uint8_t {
    kDivertRetired = 1,
    kDivertPlanner = 2,
    kDivertLifetime = 4,
    kDivertSlivers = 8,
    kDivertCapture = 16,
    kDivertTrace = 32
  };
  uint8_t divert_ = 0;

  const int device_;
  // The concrete (final) type, so that its forwarding to the real backend
  // inlines: one virtual call a backend call, not two.
  MeteredBackend* const backend_;
  DeviceHooks& hooks_;
  const size_t small_segment_;
  const size_t large_segment_;
  const size_t largest_small_;  // the largest request of the small pool: 0 with vmm=shared
  const VmmMode vmm_;    // which pools grow in arenas (Note [Arenas])
  const bool planning_;  // iteration plans (Note [Iteration plans])
  const bool placing_lifetimes_;  // Note [Lifetime-aware placement]
  size_t granule_ = 0;   // the backend's mapping granularity, asked on first use

  int capturing_ = 0;  // captures under way (Note [Capture]); kDivertCapture while > 0
  // Driver calls that break a capture made while one was under way: always 0
  // (I15); counted where such calls are made (breaks_capture()).
  uint64_t capture_violations_ = 0;
  void breaks_capture() {
    if (capturing_ > 0) ++capture_violations_;
  }
  std::vector<uintptr_t> closing_;  // imports closed during a capture, unmapped at its end

  struct Import {  // another process's memory mapped here (Note [Sharing blocks])
    int refs = 1;                     // imports of it not yet closed
    size_t size = 0;
    std::vector<PhysHandle> chunks;   // empty for a plain segment
  };
  std::map<uintptr_t, Import> imports_;  // by base address
  void close_import_chunks(uintptr_t base, const Import& imported);

  // Runtime-adjustable settings.
  double memory_fraction_;
  size_t max_cached_;
  int round_power2_;
  bool oom_report_;
  bool sharing_ = true;  // Note [Shared granules]
  bool moving_ = true;   // Note [Moving slivers]
  bool move_told_ = false;  // the first move was reported on stderr (with oom_report)
  std::set<uintptr_t> exported_;  // blocks exported to other processes (never moved), by address
  // Reserved bytes from which a request of more than a granule may be served
  // from a shared window first (SIZE_MAX: never).
  size_t share_from_ = SIZE_MAX;
  size_t share_limit_ = SIZE_MAX;  // what the allocator may reserve, when share_from_ is set
  // Reserved bytes from which a growth's walk for donors is cut at kDonorLook
  // blocks (95% of the limit, sharing on or off; SIZE_MAX: never): Note
  // [Reuse before growing].
  size_t near_limit_ = SIZE_MAX;
  // The sliver indexes' upkeep (free-set changes they followed) since they
  // were last asked, and what building them walked: drop_sliver_indexes
  // drops them once the first passes twice the second (Note [Sliver index]).
  size_t sliver_upkeep_ = 0;
  size_t sliver_build_blocks_ = 0;
  // The bytes of whole granules inside free blocks of the arenas, counted
  // while whole_counted_, else 0 (Note [Whole-granule count] in share.cpp).
  size_t free_whole_bytes_ = 0;
  bool whole_counted_ = false;
  // The most an arena's growth left reserved since reserved memory was last
  // zero, and frees_ when it was set (Note [Cold donors] in arena.cpp: past a
  // standing mark, warm donors too).
  size_t reserved_high_ = 0;
  uint64_t high_set_at_ = 0;
  bool reusing_ = true;  // Note [Reuse before growing]: near the limit as well
  size_t extent_bytes_ = size_t{32} << 20;  // Note [Extents]

  std::vector<Block*> spare_blocks_;  // Block objects not in use: recycled, or from a slab
  std::vector<std::unique_ptr<Block[]>> block_slabs_;  // every Block, kBlockSlab at a time
  Pool small_pool_;
  Pool large_pool_;
  std::vector<std::unique_ptr<Pool>> user_pools_;  // index = pool id - 1
  Pool plan_pool_;
  Pool long_pool_;  // predicted long-lived requests

  LifetimeLearner lifetimes_;

  Planner planner_;
  Segment* plan_region_ = nullptr;   // null until a plan reaches its start position

  std::map<uintptr_t, Segment*> segments_;        // by base address
  PtrMap<Block*> live_;                            // allocated blocks by address
  std::deque<PendingFree> pending_;
  size_t cached_free_bytes_ = 0;                   // sum of free block sizes
  uint64_t next_segment_id_ = 0;
  // Scratch of grow_arena, map_window, unmap_free_range and reuse_granules
  // (under the lock; never nested).
  struct Donor {
    Block* block;
    uintptr_t lo, hi;  // its whole chunks
  };
  std::vector<PhysHandle> spares_;        // single granules a growth moves (Note [Extents])
  std::vector<PhysHandle> grow_handles_;  // map_window's chunks
  std::vector<Piece> pieces_;             // and where they go
  std::vector<PhysHandle> chunks_;        // unmap_free_range's
  std::vector<Donor> donors_;
  uint64_t frees_ = 0;                             // blocks cached so far: Block::freed_at's clock
  std::string last_backend_error_;
  size_t device_total_ = 0;  // 0 until device_total() asked the backend

  DeviceStats stats_;
  TraceRing trace_;
};

}  // namespace pyalloc
