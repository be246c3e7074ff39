// expandable_model.cpp: see expandable_model.hpp. A model of PyTorch's
// caching allocator with expandable_segments:True.
#include "replay/expandable_model.hpp"

#include <algorithm>
#include <cassert>
#include <iterator>

namespace pyalloc {

namespace {

constexpr size_t kMinBlock = 512;                 // kMinBlockSize
constexpr size_t kSmallSize = size_t{1} << 20;    // largest small request
constexpr size_t kSmallPage = size_t{2} << 20;    // kSmallBuffer: the small pool's page
constexpr size_t kLargePage = size_t{20} << 20;   // kLargeBuffer: the large pool's page

size_t round_up(size_t n, size_t step) { return (n + step - 1) / step * step; }

}  // namespace

bool ExpandableModel::BySize::operator()(const Block* a, const Block* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->size != b->size) return a->size < b->size;
  return a->addr < b->addr;
}

bool ExpandableModel::ByAddress::operator()(const Block* a, const Block* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  return a->addr < b->addr;
}

ExpandableModel::ExpandableModel(size_t capacity) : ModelLedger(capacity) {
  small_.small = true;
  small_.page = kSmallPage;
  large_.page = kLargePage;
}

ExpandableModel::~ExpandableModel() = default;

ExpandableModel::Block* ExpandableModel::new_block(Pool& pool, uintptr_t addr, size_t size, uint64_t stream,
                                                   bool mapped, uintptr_t segment_base) {
  Block* b;
  if (!spare_.empty()) {
    b = spare_.back();
    spare_.pop_back();
  } else {
    blocks_.push_back(std::make_unique<Block>());
    b = blocks_.back().get();
  }
  *b = Block{};
  b->pool = &pool;
  b->addr = addr;
  b->size = size;
  b->stream = stream;
  b->mapped = mapped;
  b->segment_base = segment_base;
  return b;
}

// ---- finding memory -----------------------------------------------------------------

// Best fit among the mapped free blocks, then on while the next block in that
// order, with the unmapped space after it, is smaller than this one with its.
ExpandableModel::Block* ExpandableModel::get_free_block(Pool& pool, size_t size, uint64_t stream) {
  Block key;
  key.stream = stream;
  key.size = size;
  auto it = pool.blocks.lower_bound(&key);
  if (it == pool.blocks.end() || (*it)->stream != stream) return nullptr;
  auto expandable_size = [](const Block* b) {
    return b->size + (b->next != nullptr && !b->next->mapped ? b->next->size : 0);
  };
  for (auto next = std::next(it);
       next != pool.blocks.end() && (*next)->stream == stream && expandable_size(*next) < expandable_size(*it);
       ++next) {
    it = next;
  }
  Block* block = *it;
  pool.blocks.erase(it);
  return block;
}

// The lowest unmapped range of the pool's segments on `stream` that, with the
// free block right before it, spans `size` bytes of free and unmapped
// memory: the block to start from. Else a new segment, all unmapped.
ExpandableModel::Block* ExpandableModel::find_expandable_block(Pool& pool, size_t size, uint64_t stream) {
  auto available_from = [&](const Block* b) {
    size_t bytes = 0;
    for (; b != nullptr && !b->allocated && bytes < size; b = b->next) bytes += b->size;
    return bytes;
  };
  Block key;
  key.stream = stream;
  for (auto it = pool.unmapped.lower_bound(&key); it != pool.unmapped.end() && (*it)->stream == stream; ++it) {
    Block* c = *it;
    if (c->prev != nullptr && !c->prev->allocated) c = c->prev;
    if (available_from(c) >= size) return c;
  }
  const size_t va = round_up(capacity_ + capacity_ / 8, pool.page);
  const uintptr_t base = round_up(next_va_, kLargePage);
  next_va_ = base + va;
  segment_made();
  Block* segment = new_block(pool, base, va, stream, /*mapped=*/false, base);
  pool.unmapped.insert(segment);
  return segment;
}

// Maps the pages under the first `size` bytes of the unmapped block `to_map`
// (all of them or none: a page past the capacity fails the whole call); the
// mapped part joins its free neighbours in the free set.
bool ExpandableModel::map_block(Pool& pool, Block* to_map, size_t size) {
  assert(!to_map->mapped && (to_map->addr - to_map->segment_base) % pool.page == 0);
  const size_t bytes = round_up(size, pool.page);
  assert(bytes <= to_map->size);
  if (!fits(bytes)) return false;
  pool.unmapped.erase(to_map);
  if (bytes < to_map->size) pool.unmapped.insert(split_off(pool, to_map, bytes));  // the rest stays unmapped
  to_map->mapped = true;
  merge(pool, to_map, to_map->prev);
  merge(pool, to_map, to_map->next);
  pool.blocks.insert(to_map);
  reserve(bytes);
  return true;
}

ExpandableModel::Block* ExpandableModel::try_allocate_expandable_block(Pool& pool, size_t size, uint64_t stream) {
  Block* candidate = find_expandable_block(pool, size, stream);
  if (!candidate->mapped && !map_block(pool, candidate, std::min(candidate->size, size))) return nullptr;
  while (candidate->size < size) {  // a free block, then unmapped space after it
    Block* next = candidate->next;
    if (!map_block(pool, next, std::min(size - candidate->size, next->size))) return nullptr;
    candidate = next;  // the mapped part took the free block in
  }
  pool.blocks.erase(candidate);
  return candidate;
}

// ---- blocks -----------------------------------------------------------------------------

// Splits `block` at `offset` bytes; returns the part after, mapped as `block`
// is, in no set.
ExpandableModel::Block* ExpandableModel::split_off(Pool& pool, Block* block, size_t offset) {
  Block* rest = new_block(pool, block->addr + offset, block->size - offset, block->stream, block->mapped,
                          block->segment_base);
  rest->prev = block;
  rest->next = block->next;
  if (block->next != nullptr) block->next->prev = rest;
  block->next = rest;
  block->size = offset;
  return rest;
}

// `src`, a neighbour of `dst`, joins it when both are free and both mapped or
// both unmapped (try_merge_blocks). `dst` is in no set.
void ExpandableModel::merge(Pool& pool, Block* dst, Block* src) {
  if (src == nullptr || src->allocated || src->mapped != dst->mapped) return;
  if (src->mapped) {
    pool.blocks.erase(src);
  } else {
    pool.unmapped.erase(src);
  }
  if (dst->prev == src) {
    dst->addr = src->addr;
    dst->prev = src->prev;
    if (dst->prev != nullptr) dst->prev->next = dst;
  } else {
    dst->next = src->next;
    if (dst->next != nullptr) dst->next->prev = dst;
  }
  dst->size += src->size;
  spare_.push_back(src);
}

void ExpandableModel::free_block(Pool& pool, Block* block) {
  merge(pool, block, block->prev);
  merge(pool, block, block->next);
  pool.blocks.insert(block);
}

uintptr_t ExpandableModel::malloc(size_t request, uint64_t stream) {
  const size_t size = request < kMinBlock ? kMinBlock : round_up(request, kMinBlock);
  Pool& pool = size <= kSmallSize ? small_ : large_;
  Block* b = get_free_block(pool, size, stream);
  if (b == nullptr) b = try_allocate_expandable_block(pool, size, stream);
  if (b == nullptr) {
    release_cached_blocks();
    b = try_allocate_expandable_block(pool, size, stream);
  }
  if (b == nullptr) return 0;
  if (b->size - size >= kMinBlock) pool.blocks.insert(split_off(pool, b, size));
  b->allocated = true;
  handed_out(b->size);
  live_.emplace(b->addr, b);
  return b->addr;
}

void ExpandableModel::free(uintptr_t addr) {
  auto it = live_.find(addr);
  if (it == live_.end()) return;
  Block* b = it->second;
  live_.erase(it);
  given_back(b->size);
  b->allocated = false;
  free_block(*b->pool, b);
}

// ---- giving memory back --------------------------------------------------------------

// Unmaps the whole pages inside the free block `block`: what lies before and
// after them stays free and mapped, the pages join the unmapped space beside.
void ExpandableModel::unmap_block(Pool& pool, Block* block) {
  const size_t page = pool.page;
  const uintptr_t lo = block->segment_base + round_up(block->addr - block->segment_base, page);
  const uintptr_t hi = block->segment_base + (block->addr + block->size - block->segment_base) / page * page;
  if (lo >= hi) return;
  pool.blocks.erase(block);
  if (lo > block->addr) {
    Block* before = new_block(pool, block->addr, lo - block->addr, block->stream, true, block->segment_base);
    before->prev = block->prev;
    before->next = block;
    if (block->prev != nullptr) block->prev->next = before;
    block->prev = before;
    pool.blocks.insert(before);
  }
  if (block->addr + block->size > hi) {
    Block* after = new_block(pool, hi, block->addr + block->size - hi, block->stream, true, block->segment_base);
    after->prev = block;
    after->next = block->next;
    if (block->next != nullptr) block->next->prev = after;
    block->next = after;
    pool.blocks.insert(after);
  }
  block->addr = lo;
  block->size = hi - lo;
  block->mapped = false;
  merge(pool, block, block->prev);
  merge(pool, block, block->next);
  pool.unmapped.insert(block);
  unreserve(hi - lo);
}

// The OOM retry: every free block's whole pages unmapped, large pool then
// small; a segment left with nothing mapped is dropped.
void ExpandableModel::release_cached_blocks() {
  for (Pool* pool : {&large_, &small_}) {
    const std::vector<Block*> to_unmap(pool->blocks.begin(), pool->blocks.end());
    for (Block* block : to_unmap) {
      unmap_block(*pool, block);
      if (!block->mapped && block->prev == nullptr && block->next == nullptr) {
        pool->unmapped.erase(block);
        spare_.push_back(block);
        segment_gone();
      }
    }
  }
}

size_t ExpandableModel::largest_free_block() const {
  size_t largest = 0;
  for (const Pool* pool : {&small_, &large_}) {
    for (const Block* b : pool->blocks) largest = std::max(largest, b->size);
  }
  return largest;
}

}  // namespace pyalloc
