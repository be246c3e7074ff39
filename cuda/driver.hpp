// driver.hpp: the CUDA driver, loaded once per process, and the device's
// primary context made current around each call. The cuda backend
// (backend_cuda.cpp) is built on these.
//
// Note [Primary context]
//   Each device's primary context is retained on the device's first use,
//   not at load: creating a context costs hundreds of MiB of device memory,
//   and a process (one DDP rank) usually uses one device of many. For the
//   same reason mem_info() on a device whose primary context is not active
//   yet reports the total as free instead of creating the context to ask.
//   Around each driver call the context is made current with
//   cuCtxPushCurrent and popped after, so the calling thread's current
//   context is left as it was; when it is already current (the usual case
//   under PyTorch, which makes it current on its threads) nothing is pushed.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "driver_api.hpp"

namespace pyalloc {
namespace cuda_backend {

// The driver's own names read as in NVIDIA's documentation.
using namespace cuda_driver;  // NOLINT(google-build-using-namespace)

// Appended to every error that stops the backend from starting.
constexpr const char* kNoGpuHint = "use backend=host or backend=sim to run without a GPU";

// What a driver call (or a sequence of them) came to: its result, and the
// failing call's name.
struct DriverCall {
  CUresult result = CUDA_SUCCESS;
  const char* call = "";  // the failing call's name
  bool ok() const { return result == CUDA_SUCCESS; }
};

struct DriverApi {
#define PYALLOC_DECLARE_FUNCTION(name, symbol, signature) \
  std::add_pointer_t<signature> name = nullptr;
  PYALLOC_CUDA_DRIVER_FUNCTIONS(PYALLOC_DECLARE_FUNCTION)
  PYALLOC_CUDA_DRIVER_OPTIONAL_FUNCTIONS(PYALLOC_DECLARE_FUNCTION)  // null when the driver lacks one
#undef PYALLOC_DECLARE_FUNCTION
};

// One device's mutable state. `handle` is set at load and never changes;
// `context` is written once under `mutex` and read without it.
struct DeviceState {
  CUdevice handle = 0;
  std::atomic<CUcontext> context{nullptr};  // retained primary context; never released

  std::mutex mutex;                 // guards the fields below
  std::vector<CUevent> idle_events; // recorded-and-released events, ready for reuse
  size_t granularity = 0;           // 0 until first asked
  int vmm_supported = -1;           // -1 unknown, 0 no, 1 yes
  int exportable = -1;              // chunks made exportable as POSIX fds: -1 not tried, 0 no, 1 yes
  std::map<CUmemGenericAllocationHandle, int> exported;  // each exported chunk's fd, until released
  uint64_t unreported_errors = 0;   // driver errors a void method could not return
  std::string first_error;          // the first of them (printed once), for diagnostics
};

struct Driver {
  DriverApi api;
  int device_count = 0;
  std::unique_ptr<DeviceState[]> devices;  // [device_count]
};

struct LoadResult {
  Driver* driver = nullptr;  // leaked on purpose: lives until process exit
  std::string error;         // why loading failed, when driver is null
};

// The outcome of loading the driver: computed on the first call (thread-safe
// static initialization) and the same for every later one, so a backend
// rebuilt by a reconfiguration shares the driver, its contexts and its event
// pools.
const LoadResult& driver_load_result();

// Keeps a message on one line (dlerror and driver strings are not ours).
std::string one_line(std::string text);

// "CUDA_ERROR_OUT_OF_MEMORY (out of memory)"; the number when the driver
// has no name for it.
std::string error_text(const DriverApi& api, CUresult rc);

// Retains the device's primary context on first use (Note [Primary context]).
CUresult primary_context(const DriverApi& api, DeviceState& state, CUcontext* out);

// Makes a device's primary context current for the guard's scope and then
// restores the thread's previous one.
class ScopedContext {
 public:
  ScopedContext(const DriverApi& api, DeviceState& state) : api_(api) {
    CUcontext context = nullptr;
    result_ = primary_context(api, state, &context);
    if (result_ != CUDA_SUCCESS) {
      failed_call_ = "cuDevicePrimaryCtxRetain";
      return;
    }
    CUcontext current = nullptr;
    if (api.cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == context) return;
    result_ = api.cuCtxPushCurrent(context);
    if (result_ != CUDA_SUCCESS) {
      failed_call_ = "cuCtxPushCurrent_v2";
      return;
    }
    pushed_ = true;
  }
  ~ScopedContext() {
    if (pushed_) {
      CUcontext popped = nullptr;
      api_.cuCtxPopCurrent(&popped);
    }
  }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

  bool ok() const { return result_ == CUDA_SUCCESS; }
  CUresult result() const { return result_; }
  const char* failed_call() const { return failed_call_; }

 private:
  const DriverApi& api_;
  CUresult result_ = CUDA_SUCCESS;
  const char* failed_call_ = "";
  bool pushed_ = false;
};

}  // namespace cuda_backend
}  // namespace pyalloc
