// ptr_map.hpp: PtrMap, the live-block index.
//
// The fast path must not call malloc: a node-based map would pay for a heap
// allocation per live block. Each device owns a PtrMap of its live blocks,
// used under its lock (and recycles its Block objects; the free sets are
// intrusive, Note [Free sets]).
#pragma once

#include <cassert>
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

  // nullptr when absent. `key` must not be 0 (an empty slot would match it):
  // the C ABI turns NULL away before any lookup, off the free path's lookup.
  Entry* find(uintptr_t key) const {
    assert(key != 0);
    Entry* e = home(key);
    while (__builtin_expect(e->key != key, 0)) {
      if (e->key == 0) return nullptr;
      e = next(e);
    }
    return e;
  }

  void insert(uintptr_t key, V value) {
    make_room();
    place(key, value);
  }

  // Whether the next insert() must grow the table (a heap allocation).
  bool full() const { return size_ >= max_size_; }
  void make_room() {
    if (__builtin_expect(full(), 0)) rehash(2 * (mask_ + 1));
  }
  // insert() when !full(): never allocates.
  void place(uintptr_t key, V value) {
    Entry* e = home(key);
    while (__builtin_expect(e->key != 0, 0)) e = next(e);
    *e = Entry{key, value};
    ++size_;
  }

  // Removes the entry find() returned.
  void erase(Entry* entry) {
    --size_;
    Entry* hole = entry;
    // Shift later members of the probe run back so lookups never stop early.
    for (Entry* e = next(hole); e->key != 0; e = next(e)) {
      // Move e into the hole if its home is not in (hole, e], cyclically.
      const size_t at = index(e);
      if (((at - slot(e->key)) & mask_) >= ((at - index(hole)) & mask_)) {
        *hole = *e;
        hole = e;
      }
    }
    hole->key = 0;
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
  Entry* home(uintptr_t key) const { return entries_.get() + slot(key); }
  Entry* next(Entry* e) const {
    ++e;
    if (__builtin_expect(e == end_, 0)) e = entries_.get();  // wraps around
    return e;
  }
  size_t index(const Entry* e) const { return static_cast<size_t>(e - entries_.get()); }

  void rehash(size_t capacity) {
    std::unique_ptr<Entry[]> old(new Entry[capacity]());
    old.swap(entries_);
    const size_t old_capacity = old == nullptr ? 0 : mask_ + 1;
    end_ = entries_.get() + capacity;
    mask_ = capacity - 1;
    shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(capacity));
    max_size_ = capacity / 2;  // at most half full
    size_ = 0;
    for (size_t i = 0; i < old_capacity; ++i) {
      if (old[i].key != 0) place(old[i].key, old[i].value);
    }
  }

  std::unique_ptr<Entry[]> entries_;
  Entry* end_ = nullptr;  // entries_ + capacity
  size_t mask_ = 0;
  unsigned shift_ = 0;
  size_t size_ = 0;
  size_t max_size_ = 0;
};

}  // namespace pyalloc
