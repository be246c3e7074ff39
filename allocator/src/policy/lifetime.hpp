// lifetime.hpp: predicting from a request's size and order whether it will
// live long.
//
// LifetimeLearner is pure bookkeeping: no allocator, no backend, no lock of
// its own (the device lock covers it). The allocator uses it as Note
// [Lifetime-aware placement] in lifetime.cpp describes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <unordered_map>

namespace pyalloc {

// Learns which default-pool requests outlive the kHorizon requests made
// after them, keyed by their rounded size and the two sizes requested just
// before (the order signature), and predicts the next request from that.
// Requests are numbered in the order they are recorded, from 0.
class LifetimeLearner {
 public:
  static constexpr size_t kHorizon = 32;      // requests a long-lived block outlives
  static constexpr size_t kMaxKeys = 1 << 16;  // signatures and sizes counted; later new ones count by class only

  // Whether the next request, of `rounded` bytes, is predicted to outlive
  // the horizon (Note [Lifetime-aware placement]): by its order signature,
  // else its size, else its coarse size class; false when none was judged.
  bool predicts_long(size_t rounded) const;

  // Records the next request (`addr` 0: it failed) and returns its number,
  // which the caller keeps with the block. The request that thereby leaves
  // the horizon is judged: long-lived if still_live(addr, number) says its
  // block is still allocated.
  template <typename StillLive>
  uint64_t record(size_t rounded, uintptr_t addr, StillLive still_live) {
    const uint64_t number = recorded_++;
    Seen& slot = horizon_[number % kHorizon];
    if (slot.addr != 0) count(slot.key, still_live(slot.addr, slot.number));
    slot = Seen{addr, number, key_of(rounded)};
    before_[1] = before_[0];
    before_[0] = rounded;
    return number;
  }

  uint64_t recorded() const { return recorded_; }

 private:
  struct Counts {
    uint32_t long_lived = 0;
    uint32_t short_lived = 0;
    bool seen() const { return long_lived + short_lived > 0; }
    bool mostly_long() const { return long_lived >= short_lived; }
  };
  struct Key {
    uint64_t order = 0;  // hash of (size, the two sizes before)
    size_t size = 0;
  };
  struct Seen {
    uintptr_t addr = 0;  // 0: nothing to judge
    uint64_t number = 0;
    Key key;
  };
  // Four classes per power of two of bytes (the two bits below the leading
  // one), for sizes never judged before.
  static constexpr size_t kCoarseClasses = 4 * 64;
  static size_t coarse_class(size_t rounded);
  Key key_of(size_t rounded) const;
  void count(const Key& key, bool long_lived);
  static void bump(std::unordered_map<uint64_t, Counts>& map, uint64_t key, bool long_lived);

  uint64_t recorded_ = 0;
  size_t before_[2] = {0, 0};  // the sizes of the last two requests recorded
  std::array<Seen, kHorizon> horizon_{};
  std::unordered_map<uint64_t, Counts> by_order_;
  std::unordered_map<uint64_t, Counts> by_size_;
  std::array<Counts, kCoarseClasses> by_class_{};
};

}  // namespace pyalloc
