// ptr_map.hpp: PtrMap, the live-block index.
//
// The fast path must not call malloc: a node-based map would pay for a heap
// allocation per live block. Each device owns a PtrMap of its live blocks,
// used under its lock (and recycles its Block objects; the free sets are
// intrusive, Note [Free sets]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pyalloc {

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
