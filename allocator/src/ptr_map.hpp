// ptr_map.hpp: PtrMap, the live-block index.
//
// The fast path must not call malloc: a node-based map would pay for a heap
// allocation per live block. Each device owns a PtrMap of its live blocks,
// used under its lock (and recycles its Block objects; the free sets are
// intrusive, Note [Free sets]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace pyalloc {

// Live blocks by address: open addressing with linear probing and
// backward-shift deletion (no tombstones), kept at most half full.
// Key 0 marks an empty slot; block addresses are never 0.
template <typename V>
class PtrMap {
 public:
  struct Entry {
    uintptr_t key;  // 0: empty
    V value;
  };

  PtrMap() { rehash(1024); }

  Entry* find(uintptr_t key) {
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      if (entries_[i].key == key) return &entries_[i];
      if (entries_[i].key == 0) return nullptr;
    }
  }

  void insert(uintptr_t key, V value) {
    if (__builtin_expect(size_ >= max_size_, 0)) rehash(2 * (mask_ + 1));
    size_t i = slot(key);
    while (entries_[i].key != 0) i = (i + 1) & mask_;
    entries_[i] = Entry{key, value};
    ++size_;
  }

  // Removes the entry find() returned.
  void erase(Entry* entry) {
    size_t hole = static_cast<size_t>(entry - entries_.get());
    --size_;
    // Shift later members of the probe run back so lookups never stop early.
    for (size_t i = (hole + 1) & mask_; entries_[i].key != 0; i = (i + 1) & mask_) {
      const size_t home = slot(entries_[i].key);
      // Move entry i into the hole if its home is not in (hole, i].
      if (((i - home) & mask_) >= ((i - hole) & mask_)) {
        entries_[hole] = entries_[i];
        hole = i;
      }
    }
    entries_[hole].key = 0;
  }

  size_t size() const { return size_; }

  template <typename F>
  void for_each(F fn) const {
    for (size_t i = 0; i <= mask_; ++i) {
      if (entries_[i].key != 0) fn(entries_[i].key, entries_[i].value);
    }
  }

 private:
  size_t slot(uintptr_t key) const {
    // Addresses are multiples of 512: drop those bits, then mix.
    return static_cast<size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  void rehash(size_t capacity) {
    std::unique_ptr<Entry[]> old(new Entry[capacity]());
    old.swap(entries_);
    const size_t old_capacity = old == nullptr ? 0 : mask_ + 1;
    mask_ = capacity - 1;
    shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(capacity));
    max_size_ = capacity / 2;  // at most half full
    size_ = 0;
    for (size_t i = 0; i < old_capacity; ++i) {
      if (old[i].key != 0) insert(old[i].key, old[i].value);
    }
  }

  std::unique_ptr<Entry[]> entries_;
  size_t mask_ = 0;
  unsigned shift_ = 0;
  size_t size_ = 0;
  size_t max_size_ = 0;
};

}  // namespace pyalloc
