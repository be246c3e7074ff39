// expandable_model.hpp: a model of PyTorch's caching allocator with
// PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
//
// A MODEL, not PyTorch's code, on fake addresses, read from
// c10/cuda/CUDACachingAllocator.cpp (Note [Expandable Segments] there), so
// that replays can put pyalloc beside what a user fighting fragmentation
// would pick. What it reproduces:
//   - sizes rounded up to 512 B; requests up to 1 MiB in the small pool,
//     larger ones in the large pool, each pool with its own segments;
//   - a segment per (pool, stream): a virtual range of 9/8 of the device
//     (ExpandableSegment's constructor), mapped in pages of 2 MiB in the
//     small pool and 20 MiB in the large (kSmallBuffer, kLargeBuffer);
//     reserved bytes are the mapped pages;
//   - best fit among the mapped free blocks on (stream, size, address),
//     then, from that block on in that order, moving to the next one while
//     its size plus the unmapped space right after it is smaller
//     (get_free_block's expandable_size): a block at the mapped end of a
//     segment is taken last;
//   - no fit: the lowest unmapped range of the pool and stream that, with
//     the free block before it, holds the request, mapped a page at a time as
//     needed and merged with its free neighbours (find_expandable_block,
//     try_allocate_expandable_block, map_block); a new segment when none
//     does;
//   - split whenever at least 512 B remain (should_split with
//     expandable_segments, either pool); coalesce free neighbours on free
//     (mapped with mapped only);
//   - a page cannot be mapped (the device is full): unmap every whole free
//     page of every free block, large pool then small, drop segments left
//     wholly unmapped, and retry once (release_cached_blocks,
//     release_blocks, unmap_block); then an OOM.
// Not modelled: max_split_size, garbage_collection_threshold,
// roundup_power2_divisions (all off by default), the memory-callback retry,
// record_stream events and CUDA graph pools (traces have none), and the time
// mapping takes: only where memory goes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "replay/model_ledger.hpp"

namespace pyalloc {

class ExpandableModel : public ModelLedger {
 public:
  explicit ExpandableModel(size_t capacity);
  ~ExpandableModel();
  ExpandableModel(const ExpandableModel&) = delete;
  ExpandableModel& operator=(const ExpandableModel&) = delete;

  // Returns a fake address, or 0 on OOM.
  uintptr_t malloc(size_t size, uint64_t stream);
  void free(uintptr_t addr);

  // reserved(), peak_reserved(), allocated(), segments(): ModelLedger.
  size_t largest_free_block() const;  // mapped free memory only

 private:
  struct Pool;
  struct Block {
    Pool* pool = nullptr;
    uintptr_t addr = 0;
    size_t size = 0;
    uint64_t stream = 0;
    bool allocated = false;
    bool mapped = false;
    Block* prev = nullptr;
    Block* next = nullptr;
    uintptr_t segment_base = 0;
  };
  struct BySize {  // (stream, size, address): best fit
    bool operator()(const Block* a, const Block* b) const;
  };
  struct ByAddress {  // (stream, address): the lowest unmapped range first
    bool operator()(const Block* a, const Block* b) const;
  };
  struct Pool {
    bool small = false;
    size_t page = 0;
    std::set<Block*, BySize> blocks;       // mapped and free
    std::set<Block*, ByAddress> unmapped;  // whole pages, never two side by side
  };

  Block* get_free_block(Pool& pool, size_t size, uint64_t stream);
  Block* find_expandable_block(Pool& pool, size_t size, uint64_t stream);
  bool map_block(Pool& pool, Block* to_map, size_t size);
  Block* try_allocate_expandable_block(Pool& pool, size_t size, uint64_t stream);
  void free_block(Pool& pool, Block* block);
  void merge(Pool& pool, Block* dst, Block* src);
  Block* split_off(Pool& pool, Block* block, size_t offset);
  void release_cached_blocks();
  void unmap_block(Pool& pool, Block* block);
  Block* new_block(Pool& pool, uintptr_t addr, size_t size, uint64_t stream, bool mapped, uintptr_t segment_base);

  Pool small_;
  Pool large_;
  std::unordered_map<uintptr_t, Block*> live_;
  std::vector<std::unique_ptr<Block>> blocks_;  // every Block object, for the destructor
  std::vector<Block*> spare_;                   // Block objects to reuse
  uintptr_t next_va_ = uintptr_t{1} << 44;
};

}  // namespace pyalloc
