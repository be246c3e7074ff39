// model_ledger.hpp: what a model of PyTorch's allocator counts for the
// replayer (replay.cpp's ModelPolicy reads it), kept once for both models
// (native_model.hpp, expandable_model.hpp): reserved bytes and their peak
// under a capacity, allocated bytes, segments.
#pragma once

#include <algorithm>
#include <cstddef>

namespace pyalloc {

class ModelLedger {
 public:
  size_t reserved() const { return reserved_; }
  size_t peak_reserved() const { return peak_reserved_; }
  size_t allocated() const { return allocated_; }
  size_t segments() const { return segments_; }

 protected:
  explicit ModelLedger(size_t capacity) : capacity_(capacity) {}

  // Whether `bytes` more fit under the capacity.
  bool fits(size_t bytes) const { return reserved_ + bytes <= capacity_; }
  void reserve(size_t bytes) {
    reserved_ += bytes;
    peak_reserved_ = std::max(peak_reserved_, reserved_);
  }
  void unreserve(size_t bytes) { reserved_ -= bytes; }
  void handed_out(size_t bytes) { allocated_ += bytes; }
  void given_back(size_t bytes) { allocated_ -= bytes; }
  void segment_made() { ++segments_; }
  void segment_gone() { --segments_; }

  const size_t capacity_;

 private:
  size_t reserved_ = 0;
  size_t peak_reserved_ = 0;
  size_t allocated_ = 0;
  size_t segments_ = 0;
};

}  // namespace pyalloc
