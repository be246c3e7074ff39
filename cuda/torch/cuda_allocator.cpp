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
//     (Note [Memory history under PyTorch], history.hpp);
//   - the private pools of CUDA graphs and torch.cuda.MemPool, and the
//     capture marks (Note [Private pools under PyTorch], pools.hpp);
//   - shareIpcHandle and getIpcDevPtr, CUDA tensors passed between
//     processes (Note [Sharing under PyTorch], ipc.hpp).
// Built against the installed PyTorch's headers and CUDA's runtime headers;
// loaded only where PyTorch has CUDA (pyalloc/pytorch/layer.py builds it).
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/headeronly/version.h>

#include <map>
#include <memory>
#include <mutex>
#include <unordered_set>

#include "history.hpp"
#include "ipc.hpp"
#include "oom.hpp"
#include "pools.hpp"
#include "stats.hpp"

// PyTorch's allocator interface grows between releases: getContextForPointer
// came in 2.12, markCaptureBegin/End in 2.13. The layer is compiled against
// whichever PyTorch is imported, so those overrides exist only where the
// base class declares them (on 2.11 a GPU machine's PyTorch refused the
// build: "marked 'override', but does not override").
#define PYALLOC_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace {

using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using pyalloc::torch_layer::History;

class PyallocCUDAAllocator final : public Base {
 public:
  PyallocCUDAAllocator()
      : Base([](size_t size, int device, cudaStream_t stream) {
               if (pyalloc::torch_layer::Pools::instance().capturing()) {
                 // New memory during a capture: allowed in the relaxed mode
                 // only, as PyTorch's own allocator does (Note [Capture]).
                 RelaxedCaptureMode relaxed;
                 return pyalloc::torch_layer::allocate_or_throw(size, device, stream);
               }
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

  void emptyCache(c10::cuda::MempoolId_t mempool_id) override {
    if (mempool_id.first == 0 && mempool_id.second == 0) {
      pyalloc_empty_cache();  // held private pools keep their memory (Note [Held pools])
    } else {
      pools().empty(mempool_id);
    }
  }

  // Note [Private pools under PyTorch] (pools.hpp).
  void beginAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    pools().begin_route(device, mempool_id,
                        [f = std::move(filter)](void* stream) { return f(static_cast<cudaStream_t>(stream)); });
  }

  void endAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) override {
    pools().end_route(device, mempool_id);
  }

  void releasePool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) override {
    pools().release(device, mempool_id);
  }

  void createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                          std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator) override {
    TORCH_CHECK(allocator == nullptr || allocator.get() == this,
                "pyalloc: a torch.cuda.MemPool with an allocator of its own (", allocator ? allocator->name() : "",
                ") is not supported while pyalloc is PyTorch's allocator; make the MemPool without one");
    pools().incref(device, mempool_id);
  }

  int getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) override {
    return pools().use_count(device, mempool_id);
  }

  void setUseOnOOM(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id, bool use_on_oom) override {
    pools().set_use_on_oom(device, mempool_id, use_on_oom);
  }

  void setNoSplit(c10::DeviceIndex /*device*/, c10::cuda::MempoolId_t /*mempool_id*/) override {
    TORCH_CHECK(false, "pyalloc does not support torch.cuda.MemPool(no_split=True) (setNoSplit): its pools split "
                       "blocks as the default pools do");
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected_live_allocations) override {
    return pools().live_allocations_are(device, mempool_id, expected_live_allocations);
  }

  // Note [Sharing under PyTorch] (ipc.hpp).
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override {
    auto [offset, handle] = pyalloc::torch_layer::share_handle(ptr);
    return {static_cast<ptrdiff_t>(offset), std::move(handle)};
  }

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return pyalloc::torch_layer::Imports::instance().open(c10::cuda::current_device(), handle);
  }

#if PYALLOC_TORCH_AT_LEAST(2, 13)
  void markCaptureBegin(c10::DeviceIndex device) override { pools().capture_begin(device); }
  void markCaptureEnd(c10::DeviceIndex device) override { pools().capture_end(device); }
#endif

  // Note [Memory history under PyTorch] (history.hpp).
  void recordHistory(bool enabled, c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, c10::cuda::CUDACachingAllocator::RecordContext when,
                     bool clear_history, const std::vector<std::string>& /*skip_actions*/) override {
    History::instance().configure(enabled, context_recorder, alloc_trace_max_entries, when, clear_history);
  }

  bool isHistoryEnabled() override { return History::instance().recording(); }

#if PYALLOC_TORCH_AT_LEAST(2, 12)
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) override {
    return History::instance().context_of(ptr);
  }
#endif

  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(c10::cuda::MempoolId_t mempool,
                                                         bool include_traces) override {
    c10::cuda::CUDACachingAllocator::SnapshotInfo info;
    const int devices = pyalloc_device_count();
    const bool one_pool = mempool.first != 0 || mempool.second != 0;  // MemPool.snapshot()
    for (int d = 0; d < devices; ++d) {
      for (auto& segment : History::instance().segments(d)) {
        if (!one_pool || segment.owner_private_pool_id == mempool) info.segments.push_back(std::move(segment));
      }
    }
    if (include_traces) info.device_traces = History::instance().traces(devices);
    return info;
  }

  std::string name() override { return "pyalloc"; }

 private:
  static pyalloc::torch_layer::Pools& pools() { return pyalloc::torch_layer::Pools::instance(); }

  // The calling thread in cudaStreamCaptureModeRelaxed for a scope.
  class RelaxedCaptureMode {
   public:
    RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
    ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
    RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
    RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

   private:
    cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  };

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
