// cuda_allocator.cpp: pyalloc as PyTorch's CUDAAllocator.
//
// A subclass of PyTorch's CUDAPluggableAllocator (its members are protected
// for this), installed with PyTorch's own changeCurrentAllocator by
// pyalloc_torch_install(). The base class keeps what it does well (the
// DataPtr and its deleter, the table of live allocations that raw_delete
// reads); this class gives the entry points the base class leaves unchecked
// or refuses:
//   - allocation (allocate, raw_alloc, raw_alloc_with_stream all go through
//     alloc_fn_): a NULL from pyalloc_malloc runs the OOM observers and throws
//     c10::OutOfMemoryError (Note [Out of memory under PyTorch], oom.hpp);
//   - cacheInfo, which cuDNN's benchmark mode asks for its workspace;
//   - getDeviceStats, resetPeakStats, resetAccumulatedStats (stats.hpp);
//   - attachOutOfMemoryObserver, set/getMemoryFraction, emptyCache, name;
//   - recordHistory and snapshot, with PyTorch's gathered stack contexts
//     (Note [Memory history under PyTorch], history.hpp).
// Built against the installed PyTorch's headers and CUDA's runtime headers;
// loaded only where PyTorch has CUDA (pyalloc/pytorch/layer.py builds it).
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <map>
#include <memory>
#include <mutex>

#include "history.hpp"
#include "oom.hpp"
#include "stats.hpp"

namespace {

using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using pyalloc::torch_layer::History;

class PyallocCUDAAllocator final : public Base {
 public:
  PyallocCUDAAllocator()
      : Base([](size_t size, int device, cudaStream_t stream) {
               return pyalloc::torch_layer::allocate_or_throw(size, device, stream);
             },
             [](void* ptr, size_t size, int device, cudaStream_t stream) {
               pyalloc::torch_layer::free_block(ptr, size, device, stream);
             }) {
    set_record_stream_fn([](void* ptr, cudaStream_t stream) { pyalloc_record_stream(ptr, stream); });
    set_reset_fn([] { pyalloc_empty_cache(); });
    set_memory_fraction_fn([](double fraction, int device) { pyalloc_set_memory_fraction(fraction, device); });
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    *largest = pyalloc::torch_layer::largest_request(device);
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    return pyalloc::torch_layer::device_stats(device);
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    TORCH_CHECK(pyalloc_reset_peak_stats(device) == PYALLOC_OK, "pyalloc: ", pyalloc_last_error());
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    TORCH_CHECK(pyalloc_reset_accumulated_stats(device) == PYALLOC_OK, "pyalloc: ", pyalloc_last_error());
  }

  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    pyalloc::torch_layer::attach_oom_observer(std::move(observer));
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "invalid fraction: ", fraction, ". Please set within [0, 1].");
    pyalloc_set_memory_fraction(fraction, device);
    std::lock_guard<std::mutex> lock(mutex_);
    fractions_[device] = fraction;
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = fractions_.find(device);
    return it == fractions_.end() ? 1.0 : it->second;
  }

  void emptyCache(c10::cuda::MempoolId_t /*mempool_id*/) override { pyalloc_empty_cache(); }

  // Note [Memory history under PyTorch] (history.hpp).
  void recordHistory(bool enabled, c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, c10::cuda::CUDACachingAllocator::RecordContext when,
                     bool clear_history, const std::vector<std::string>& /*skip_actions*/) override {
    History::instance().configure(enabled, context_recorder, alloc_trace_max_entries, when, clear_history);
  }

  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(c10::cuda::MempoolId_t /*mempool*/,
                                                         bool include_traces) override {
    c10::cuda::CUDACachingAllocator::SnapshotInfo info;
    const int devices = pyalloc_device_count();
    for (int d = 0; d < devices; ++d) {
      for (auto& segment : History::instance().segments(d)) info.segments.push_back(std::move(segment));
    }
    if (include_traces) info.device_traces = History::instance().traces(devices);
    return info;
  }

  std::string name() override { return "pyalloc"; }

 private:
  std::mutex mutex_;
  std::map<c10::DeviceIndex, double> fractions_;
};

}  // namespace

// Makes pyalloc PyTorch's CUDA allocator. Returns 0, or 1 with the reason in
// pyalloc_torch_error() (PyTorch refuses once its allocator was used).
extern "C" __attribute__((visibility("default"))) int pyalloc_torch_install(void);
extern "C" __attribute__((visibility("default"))) const char* pyalloc_torch_error(void);

namespace {
std::string& install_error() {
  static std::string e;
  return e;
}
}  // namespace

int pyalloc_torch_install(void) {
  try {
    auto allocator = std::make_shared<PyallocCUDAAllocator>();
    allocator->init(c10::cuda::device_count());  // as PyTorch's createCustomAllocator does
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
    return 0;
  } catch (const std::exception& e) {
    install_error() = e.what();
    return 1;
  }
}

const char* pyalloc_torch_error(void) { return install_error().c_str(); }
