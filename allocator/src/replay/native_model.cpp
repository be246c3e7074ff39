// native_model.cpp: see native_model.hpp. A model of PyTorch's default policy.
#include "replay/native_model.hpp"

#include <algorithm>

namespace pyalloc {

namespace {

constexpr size_t kMinBlock = 512;               // PyTorch kMinBlockSize
constexpr size_t kSmallSize = size_t{1} << 20;  // kSmallSize: largest small request
constexpr size_t kSmallBuffer = size_t{2} << 20;
constexpr size_t kLargeBuffer = size_t{20} << 20;
constexpr size_t kMinLargeAlloc = size_t{10} << 20;
constexpr size_t kRoundLarge = size_t{2} << 20;

size_t round_up(size_t n, size_t step) { return (n + step - 1) / step * step; }

}  // namespace

NativeModel::NativeModel(size_t capacity) : ModelLedger(capacity) {}

NativeModel::~NativeModel() {
  std::vector<Block*> all;
  for (Block* b : small_) all.push_back(b);
  for (Block* b : large_) all.push_back(b);
  for (auto& e : live_) all.push_back(e.second);
  for (Block* b : all) delete b;
}

NativeModel::Block* NativeModel::find_free(FreeSet& pool, size_t size, uint64_t stream) {
  Block key{0, size, stream, false, false, nullptr, nullptr, 0, 0};
  auto it = pool.lower_bound(&key);
  if (it == pool.end() || (*it)->stream != stream) return nullptr;
  Block* b = *it;
  pool.erase(it);
  return b;
}

NativeModel::Block* NativeModel::new_segment(bool small, size_t size, uint64_t stream) {
  size_t seg;
  if (size <= kSmallSize) seg = kSmallBuffer;
  else if (size < kMinLargeAlloc) seg = kLargeBuffer;
  else seg = round_up(size, kRoundLarge);
  if (!fits(seg)) return nullptr;
  Block* b = new Block{next_addr_, seg, stream, small, false, nullptr, nullptr, next_addr_, seg};
  next_addr_ += round_up(seg, kRoundLarge);
  reserve(seg);
  segment_made();
  return b;
}

void NativeModel::release_unsplit_free_segments() {
  for (FreeSet* pool : {&small_, &large_}) {
    for (auto it = pool->begin(); it != pool->end();) {
      Block* b = *it;
      if (b->prev == nullptr && b->next == nullptr) {  // a whole, free segment
        unreserve(b->size);
        segment_gone();
        it = pool->erase(it);
        delete b;
      } else {
        ++it;
      }
    }
  }
}

uintptr_t NativeModel::malloc(size_t request, uint64_t stream) {
  const size_t size = request < kMinBlock ? kMinBlock : round_up(request, kMinBlock);
  const bool small = size <= kSmallSize;
  FreeSet& pool = small ? small_ : large_;
  Block* b = find_free(pool, size, stream);
  if (b == nullptr) b = new_segment(small, size, stream);
  if (b == nullptr) {
    release_unsplit_free_segments();
    b = new_segment(small, size, stream);
  }
  if (b == nullptr) return 0;

  const size_t remaining = b->size - size;
  if (small ? remaining >= kMinBlock : remaining > kSmallSize) {
    Block* rest = new Block{b->addr + size, remaining, stream, small, false, b, b->next, b->segment_base, b->segment_size};
    if (b->next != nullptr) b->next->prev = rest;
    b->next = rest;
    b->size = size;
    pool.insert(rest);
  }
  b->allocated = true;
  handed_out(b->size);
  live_.emplace(b->addr, b);
  return b->addr;
}

void NativeModel::free(uintptr_t addr) {
  auto it = live_.find(addr);
  if (it == live_.end()) return;
  Block* b = it->second;
  live_.erase(it);
  given_back(b->size);
  b->allocated = false;
  FreeSet& pool = b->small ? small_ : large_;
  if (Block* p = b->prev; p != nullptr && !p->allocated) {
    pool.erase(p);
    p->size += b->size;
    p->next = b->next;
    if (b->next != nullptr) b->next->prev = p;
    delete b;
    b = p;
  }
  if (Block* n = b->next; n != nullptr && !n->allocated) {
    pool.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next != nullptr) n->next->prev = b;
    delete n;
  }
  pool.insert(b);
}

size_t NativeModel::largest_free_block() const {
  size_t largest = 0;
  for (const Block* b : small_) largest = std::max(largest, b->size);
  for (const Block* b : large_) largest = std::max(largest, b->size);
  return largest;
}

}  // namespace pyalloc
