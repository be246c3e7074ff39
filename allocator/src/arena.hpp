// arena.hpp: host-side storage for the allocator's own bookkeeping.
//
// The fast path must not call malloc: a cache hit would otherwise pay for a
// heap allocation per free-set node and per block. Each device owns a
// NodeArena (free lists of small fixed-size objects) used under its lock, a
// PtrMap (open-addressing hash of live blocks by address), and recycles its
// Block objects.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace pyalloc {

// Free lists for objects of up to kMaxObject bytes, in 16-byte classes,
// carved from 64 KiB chunks. Not thread-safe: one per device, used under its
// lock. Memory is returned to the system only when the arena is destroyed.
class NodeArena {
 public:
  static constexpr size_t kMaxObject = 128;
  static constexpr size_t kChunk = 64 * 1024;

  NodeArena() = default;
  NodeArena(const NodeArena&) = delete;
  NodeArena& operator=(const NodeArena&) = delete;
  ~NodeArena() {
    for (void* chunk : chunks_) ::operator delete(chunk);
  }

  void* allocate(size_t bytes) {
    if (bytes > kMaxObject) return ::operator new(bytes);
    FreeNode*& head = free_[index(bytes)];
    if (head == nullptr) refill(index(bytes));
    FreeNode* node = head;
    head = node->next;
    return node;
  }

  void deallocate(void* p, size_t bytes) {
    if (bytes > kMaxObject) return ::operator delete(p);
    FreeNode* node = static_cast<FreeNode*>(p);
    node->next = free_[index(bytes)];
    free_[index(bytes)] = node;
  }

 private:
  struct FreeNode {
    FreeNode* next;
  };
  static size_t index(size_t bytes) { return (bytes + 15) / 16 - 1; }

  void refill(size_t cls) {
    const size_t size = (cls + 1) * 16;
    char* chunk = static_cast<char*>(::operator new(kChunk));
    chunks_.push_back(chunk);
    for (size_t off = 0; off + size <= kChunk; off += size) {
      FreeNode* node = reinterpret_cast<FreeNode*>(chunk + off);
      node->next = free_[cls];
      free_[cls] = node;
    }
  }

  FreeNode* free_[kMaxObject / 16] = {};
  std::vector<void*> chunks_;
};

// A standard allocator drawing from a NodeArena, for std::set nodes.
template <typename T>
struct ArenaAllocator {
  using value_type = T;
  NodeArena* arena;

  explicit ArenaAllocator(NodeArena* a) noexcept : arena(a) {}
  template <typename U>
  ArenaAllocator(const ArenaAllocator<U>& other) noexcept : arena(other.arena) {}

  T* allocate(size_t n) { return static_cast<T*>(arena->allocate(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { arena->deallocate(p, n * sizeof(T)); }

  template <typename U>
  bool operator==(const ArenaAllocator<U>& o) const noexcept { return arena == o.arena; }
  template <typename U>
  bool operator!=(const ArenaAllocator<U>& o) const noexcept { return arena != o.arena; }
};

// Live blocks by address: open addressing with linear probing and
// backward-shift deletion (no tombstones), kept at most half full.
// Key 0 marks an empty slot; block addresses are never 0.
template <typename V>
class PtrMap {
 public:
  PtrMap() { rehash(1024); }

  V* find(uintptr_t key) {
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      if (keys_[i] == key) return &values_[i];
      if (keys_[i] == 0) return nullptr;
    }
  }

  void insert(uintptr_t key, V value) {
    if (2 * (size_ + 1) > keys_.size()) rehash(2 * keys_.size());
    size_t i = slot(key);
    while (keys_[i] != 0) i = (i + 1) & mask_;
    keys_[i] = key;
    values_[i] = value;
    ++size_;
  }

  // Removes the entry found by find(); `value` must point into this map.
  void erase(V* value) {
    size_t hole = static_cast<size_t>(value - values_.data());
    --size_;
    // Shift later members of the probe run back so lookups never stop early.
    for (size_t i = (hole + 1) & mask_; keys_[i] != 0; i = (i + 1) & mask_) {
      const size_t home = slot(keys_[i]);
      // Move entry i into the hole if its home is not in (hole, i].
      if (((i - home) & mask_) >= ((i - hole) & mask_)) {
        keys_[hole] = keys_[i];
        values_[hole] = values_[i];
        hole = i;
      }
    }
    keys_[hole] = 0;
  }

  size_t size() const { return size_; }

  template <typename F>
  void for_each(F fn) const {
    for (size_t i = 0; i < keys_.size(); ++i) {
      if (keys_[i] != 0) fn(keys_[i], values_[i]);
    }
  }

 private:
  size_t slot(uintptr_t key) const {
    // Addresses are multiples of 512: drop those bits, then mix.
    return static_cast<size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  void rehash(size_t capacity) {
    std::vector<uintptr_t> old_keys(capacity, 0);
    std::vector<V> old_values(capacity);
    old_keys.swap(keys_);
    old_values.swap(values_);
    mask_ = capacity - 1;
    shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(capacity));
    size_ = 0;
    for (size_t i = 0; i < old_keys.size(); ++i) {
      if (old_keys[i] != 0) insert(old_keys[i], old_values[i]);
    }
  }

  std::vector<uintptr_t> keys_;
  std::vector<V> values_;
  size_t mask_ = 0;
  unsigned shift_ = 0;
  size_t size_ = 0;
};

}  // namespace pyalloc
