// native_model.hpp: a model of PyTorch's default CUDACachingAllocator policy.
//
// A MODEL, not PyTorch's code: it reproduces the policy decisions that
// determine reserved memory, on fake addresses, so that replays can compare
// pyalloc with PyTorch's default side by side in one run:
//   - sizes rounded up to 512 B;
//   - requests up to 1 MiB from the small pool, in 2 MiB segments;
//   - 1 MiB to 10 MiB from 20 MiB segments; larger requests get a segment
//     rounded up to 2 MiB;
//   - best fit on (stream, size, address);
//   - split when the remainder is at least 512 B (small pool) or more than
//     1 MiB (large pool); coalesce with free neighbours on free;
//   - when a segment cannot be allocated (capacity reached): free every
//     cached, unsplit segment and retry once; then fail (an OOM).
// Not modelled: max_split_size, garbage_collection_threshold,
// expandable_segments, roundup_power2_divisions (all off by default),
// record_stream events (traces have none), CUDA graph pools.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "replay/model_ledger.hpp"

namespace pyalloc {

class NativeModel : public ModelLedger {
 public:
  explicit NativeModel(size_t capacity);
  ~NativeModel();

  // Returns a fake address, or 0 on OOM.
  uintptr_t malloc(size_t size, uint64_t stream);
  void free(uintptr_t addr);

  // reserved(), peak_reserved(), allocated(), segments(): ModelLedger.
  size_t largest_free_block() const;

 private:
  struct Block {
    uintptr_t addr;
    size_t size;
    uint64_t stream;
    bool small;
    bool allocated = false;
    Block* prev = nullptr;
    Block* next = nullptr;
    uintptr_t segment_base;
    size_t segment_size;
  };
  struct Order {
    bool operator()(const Block* a, const Block* b) const {
      if (a->stream != b->stream) return a->stream < b->stream;
      if (a->size != b->size) return a->size < b->size;
      return a->addr < b->addr;
    }
  };
  using FreeSet = std::set<Block*, Order>;

  Block* find_free(FreeSet& pool, size_t size, uint64_t stream);
  Block* new_segment(bool small, size_t size, uint64_t stream);
  void release_unsplit_free_segments();

  FreeSet small_;
  FreeSet large_;
  std::unordered_map<uintptr_t, Block*> live_;
  uintptr_t next_addr_ = uintptr_t{1} << 44;
};

}  // namespace pyalloc
