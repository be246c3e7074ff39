// replay.cpp: pyalloc_replay(), a pre-loaded trace replayed in C++.
//
// The trace arrives as parallel arrays (Python parses and validates it), so
// the loop below measures the allocator, not parsing. Two passes:
//   1. timed: every operation through the policy, clock read only at the
//      start and the end;
//   2. measured: from a fresh state again, tracking live bytes, the largest
//      free block at the peak of live bytes, and sampled curves.
// Policies: "pyalloc" is this process's allocator through the same C ABI
// PyTorch calls (device 0, as configured; replays use backend=sim or host);
// "native" is NativeModel, a model of PyTorch's default policy;
// "native-expandable" is ExpandableModel, a model of PyTorch's policy with
// expandable_segments:True.
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "abi/runtime.hpp"
#include "pyalloc/pyalloc.h"
#include "replay/expandable_model.hpp"
#include "replay/native_model.hpp"

namespace pyalloc {

namespace {

constexpr unsigned char kOpAlloc = 0;
constexpr unsigned char kOpFree = 1;

struct Trace {
  const unsigned char* ops;
  const uint32_t* slots;
  const uint64_t* sizes;
  const uint64_t* streams;
  size_t n;
  size_t n_slots;
};

// The policy under replay: malloc/free plus the measurements we need.
class Policy {
 public:
  virtual ~Policy() = default;
  virtual uintptr_t malloc(size_t size, uint64_t stream) = 0;
  virtual void free(uintptr_t addr, size_t size, uint64_t stream) = 0;
  virtual size_t largest_free() = 0;
  virtual size_t reserved() = 0;
  virtual size_t peak_reserved() = 0;
  virtual void reset() = 0;  // back to a fresh state between passes
};

class PyallocPolicy final : public Policy {
 public:
  explicit PyallocPolicy(DeviceAllocator* device) : device_(device) {}
  uintptr_t malloc(size_t size, uint64_t stream) override {
    return reinterpret_cast<uintptr_t>(pyalloc_malloc(size, 0, reinterpret_cast<void*>(stream)));
  }
  // A trace's free may name another stream than its alloc (a consumer's,
  // TRACE_FORMAT: optional, default 0): the block keeps its own.
  void free(uintptr_t addr, size_t size, uint64_t /*stream*/) override {
    pyalloc_free(reinterpret_cast<void*>(addr), size, 0, PYALLOC_ANY_STREAM);
  }
  size_t largest_free() override { return device_->usage().largest_free; }
  size_t reserved() override { return device_->usage().reserved; }
  size_t peak_reserved() override { return device_->usage().peak_reserved; }
  void reset() override {
    device_->empty_cache();
    device_->reset_peaks();
  }

 private:
  DeviceAllocator* device_;
};

// A model of PyTorch's policy, fresh for each pass.
template <typename Model>
class ModelPolicy final : public Policy {
 public:
  explicit ModelPolicy(size_t capacity) : capacity_(capacity), model_(new Model(capacity)) {}
  uintptr_t malloc(size_t size, uint64_t stream) override { return model_->malloc(size, stream); }
  void free(uintptr_t addr, size_t, uint64_t) override { model_->free(addr); }
  size_t largest_free() override { return model_->largest_free_block(); }
  size_t reserved() override { return model_->reserved(); }
  size_t peak_reserved() override { return model_->peak_reserved(); }
  void reset() override { model_.reset(new Model(capacity_)); }

 private:
  size_t capacity_;
  std::unique_ptr<Model> model_;
};

// Frees whatever the trace left live, so the next pass starts clean.
void free_remaining(Policy& policy, const Trace& t, std::vector<uintptr_t>& addr) {
  for (size_t i = 0; i < t.n; ++i) {
    if (t.ops[i] == kOpAlloc && addr[t.slots[i]] != 0) {
      policy.free(addr[t.slots[i]], t.sizes[i], t.streams[i]);
      addr[t.slots[i]] = 0;
    }
  }
}

double timed_pass(Policy& policy, const Trace& t, std::vector<uintptr_t>& addr, uint64_t* ops) {
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < t.n; ++i) {
    const uint32_t slot = t.slots[i];
    if (t.ops[i] == kOpAlloc) {
      addr[slot] = policy.malloc(t.sizes[i], t.streams[i]);
      ++*ops;
    } else if (t.ops[i] == kOpFree) {
      if (addr[slot] != 0) policy.free(addr[slot], t.sizes[i], t.streams[i]);
      addr[slot] = 0;
      ++*ops;
    }
  }
  const auto end = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(end - start).count();
}

}  // namespace

}  // namespace pyalloc

extern "C" int pyalloc_replay(const char* policy_name, size_t capacity, const unsigned char* ops,
                              const uint32_t* slots, const uint64_t* sizes, const uint64_t* streams, size_t n,
                              size_t n_slots, uint64_t* curve_live, uint64_t* curve_reserved,
                              size_t curve_points, pyalloc_replay_result* out) {
  using namespace pyalloc;
  try {
    if (policy_name == nullptr || out == nullptr || (n > 0 && (ops == nullptr || slots == nullptr ||
                                                               sizes == nullptr || streams == nullptr))) {
      set_last_error("pyalloc_replay: NULL argument");
      return PYALLOC_EINVAL;
    }
    for (size_t i = 0; i < n; ++i) {
      if (ops[i] <= kOpFree && slots[i] >= n_slots) {
        set_last_error("pyalloc_replay: event " + std::to_string(i) + " names slot " +
                                std::to_string(slots[i]) + " of " + std::to_string(n_slots));
        return PYALLOC_EINVAL;
      }
    }
    std::unique_ptr<Policy> policy;
    const std::string name = policy_name;
    if (name == "pyalloc") {
      Runtime* r = current_runtime();
      if (!r->error.empty() || r->devices.empty()) {
        set_last_error("pyalloc_replay: " + r->error);
        return PYALLOC_EBACKEND;
      }
      policy = std::make_unique<PyallocPolicy>(r->devices[0].get());
    } else if (name == "native" || name == "native-expandable") {
      if (capacity == 0) {
        set_last_error("pyalloc_replay: the " + name + " model needs a capacity");
        return PYALLOC_EINVAL;
      }
      if (name == "native") {
        policy = std::make_unique<ModelPolicy<NativeModel>>(capacity);
      } else {
        policy = std::make_unique<ModelPolicy<ExpandableModel>>(capacity);
      }
    } else {
      set_last_error("pyalloc_replay: unknown policy '" + name + "' (expected pyalloc, native or native-expandable)");
      return PYALLOC_EINVAL;
    }
    const Trace t{ops, slots, sizes, streams, n, n_slots};
    std::vector<uintptr_t> addr(n_slots, 0);
    std::memset(out, 0, sizeof *out);

    // Pass 1: timed.
    policy->reset();
    uint64_t timed_ops = 0;
    const double ns = timed_pass(*policy, t, addr, &timed_ops);
    free_remaining(*policy, t, addr);
    out->ops = timed_ops;
    out->ns_per_op = timed_ops ? ns / static_cast<double>(timed_ops) : 0.0;

    // Pass 2: measured.
    policy->reset();
    uint64_t live = 0;
    size_t next_sample = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint32_t slot = slots[i];
      if (ops[i] == kOpAlloc) {
        addr[slot] = policy->malloc(sizes[i], streams[i]);
        if (addr[slot] == 0) {
          ++out->ooms;
        } else {
          live += sizes[i];
          if (live > out->peak_live_bytes) {
            out->peak_live_bytes = live;
            out->largest_free_at_peak_bytes = policy->largest_free();
          }
        }
      } else if (ops[i] == kOpFree && addr[slot] != 0) {
        policy->free(addr[slot], sizes[i], streams[i]);
        live -= sizes[i];
        addr[slot] = 0;
      }
      if (curve_points > 0 && n > 0 && next_sample < curve_points && i >= next_sample * n / curve_points) {
        if (curve_live != nullptr) curve_live[next_sample] = live;
        if (curve_reserved != nullptr) curve_reserved[next_sample] = policy->reserved();
        ++next_sample;
      }
    }
    out->peak_reserved_bytes = policy->peak_reserved();
    free_remaining(*policy, t, addr);
    policy->reset();
    return PYALLOC_OK;
  } catch (const std::exception& e) {
    set_last_error(std::string("pyalloc_replay: ") + e.what());
    return PYALLOC_EINVAL;
  }
}
