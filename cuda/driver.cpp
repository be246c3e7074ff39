// driver.cpp: loading the CUDA driver (driver.hpp).
#include "driver.hpp"

#include <dlfcn.h>

namespace pyalloc {
namespace cuda_backend {

std::string one_line(std::string text) {
  for (char& c : text) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return text;
}

std::string error_text(const DriverApi& api, CUresult rc) {
  const char* name = nullptr;
  if (api.cuGetErrorName == nullptr || api.cuGetErrorName(rc, &name) != CUDA_SUCCESS ||
      name == nullptr) {
    return "CUresult " + std::to_string(static_cast<int>(rc));
  }
  std::string text = name;
  const char* description = nullptr;
  if (api.cuGetErrorString != nullptr && api.cuGetErrorString(rc, &description) == CUDA_SUCCESS &&
      description != nullptr) {
    text += " (";
    text += description;
    text += ")";
  }
  return one_line(text);
}

namespace {

LoadResult load_driver() {
  LoadResult out;
  const std::string library_name = kDriverLibrary;

  dlerror();  // clear any stale error so the one read below is ours
  void* library = dlopen(kDriverLibrary, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    out.error = one_line("backend=cuda: cannot load " + library_name +
                         " (no NVIDIA driver on this machine?): " +
                         (why != nullptr ? why : "dlopen failed") + "; " + kNoGpuHint);
    return out;
  }
  // The library stays loaded for the life of the process, also on failure
  // below: unloading a driver that may have started threads is not safe.

  auto driver = std::make_unique<Driver>();
  DriverApi& api = driver->api;
#define PYALLOC_RESOLVE_FUNCTION(name, symbol, signature)                                   \
  api.name = reinterpret_cast<std::add_pointer_t<signature>>(dlsym(library, #symbol));    \
  if (api.name == nullptr) {                                                                \
    out.error = "backend=cuda: " + library_name + " has no " #symbol                        \
                " (the NVIDIA driver is too old for pyalloc; update it); " + kNoGpuHint;    \
    return out;                                                                             \
  }
  PYALLOC_CUDA_DRIVER_FUNCTIONS(PYALLOC_RESOLVE_FUNCTION)
#undef PYALLOC_RESOLVE_FUNCTION
#define PYALLOC_RESOLVE_OPTIONAL(name, symbol, signature) \
  api.name = reinterpret_cast<std::add_pointer_t<signature>>(dlsym(library, #symbol));
  PYALLOC_CUDA_DRIVER_OPTIONAL_FUNCTIONS(PYALLOC_RESOLVE_OPTIONAL)
#undef PYALLOC_RESOLVE_OPTIONAL

  CUresult rc = api.cuInit(0);
  if (rc != CUDA_SUCCESS) {
    out.error = "backend=cuda: cuInit failed: " + error_text(api, rc) + "; " + kNoGpuHint;
    return out;
  }
  int count = 0;
  rc = api.cuDeviceGetCount(&count);
  if (rc != CUDA_SUCCESS) {
    out.error = "backend=cuda: cuDeviceGetCount failed: " + error_text(api, rc) + "; " + kNoGpuHint;
    return out;
  }
  if (count <= 0) {
    out.error = "backend=cuda: the NVIDIA driver sees no CUDA device (is CUDA_VISIBLE_DEVICES "
                "empty?); " + std::string(kNoGpuHint);
    return out;
  }
  driver->device_count = count;
  driver->devices = std::make_unique<DeviceState[]>(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    rc = api.cuDeviceGet(&driver->devices[i].handle, i);
    if (rc != CUDA_SUCCESS) {
      out.error = "backend=cuda: cuDeviceGet(" + std::to_string(i) + ") failed: " +
                  error_text(api, rc) + "; " + kNoGpuHint;
      return out;
    }
  }
  out.driver = driver.release();
  return out;
}

}  // namespace

const LoadResult& driver_load_result() {
  static const LoadResult* const result = new LoadResult(load_driver());
  return *result;
}

CUresult primary_context(const DriverApi& api, DeviceState& state, CUcontext* out) {
  CUcontext context = state.context.load(std::memory_order_acquire);
  if (context == nullptr) {
    std::lock_guard<std::mutex> lock(state.mutex);
    context = state.context.load(std::memory_order_relaxed);
    if (context == nullptr) {
      const CUresult rc = api.cuDevicePrimaryCtxRetain(&context, state.handle);
      if (rc != CUDA_SUCCESS) return rc;
      state.context.store(context, std::memory_order_release);
    }
  }
  *out = context;
  return CUDA_SUCCESS;
}

}  // namespace cuda_backend
}  // namespace pyalloc
