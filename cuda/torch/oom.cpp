// oom.cpp: Note [Out of memory under PyTorch] (oom.hpp).
#include "oom.hpp"

#include "history.hpp"
#include "pools.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <mutex>
#include <vector>

namespace pyalloc::torch_layer {

std::string format_size(uint64_t bytes) {
  char buf[64];
  if (bytes <= 1024) {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(bytes));
  } else if (bytes <= (uint64_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", static_cast<double>(bytes) / 1024.0);
  } else if (bytes <= (uint64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / 1048576.0);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / 1073741824.0);
  }
  return buf;
}

std::string out_of_memory_message(size_t size, int device, const pyalloc_memory_info_t& info,
                                  const std::string& report) {
  std::string m = "CUDA out of memory. Tried to allocate " + format_size(size) + ". GPU " + std::to_string(device) +
                  " has a total capacity of " + format_size(info.device_total) + " of which " +
                  format_size(info.device_free) + " is free. ";
  if (info.limit < info.device_total) {
    m += "This process may reserve " + format_size(info.limit) + " of it (set_per_process_memory_fraction). ";
  }
  const size_t unallocated = info.reserved > info.allocated ? info.reserved - info.allocated : 0;
  m += "Of the allocated memory " + format_size(info.allocated) + " is allocated by PyTorch, and " +
       format_size(unallocated) + " is reserved by PyTorch but unallocated (held by pyalloc).";
  if (!report.empty()) m += " pyalloc: " + report;
  return m;
}

namespace {

std::mutex& observers_mutex() {
  static std::mutex m;
  return m;
}

std::vector<OomObserver>& observers() {
  static std::vector<OomObserver> list;
  return list;
}

pyalloc_memory_info_t read_info(int device) {
  pyalloc_memory_info_t info{};
  if (pyalloc_memory_info(device, &info) != PYALLOC_OK) info = pyalloc_memory_info_t{};
  return info;
}

}  // namespace

void attach_oom_observer(OomObserver observer) {
  std::lock_guard<std::mutex> lock(observers_mutex());
  observers().push_back(std::move(observer));
}

void throw_out_of_memory(size_t size, int device, const std::string& report) {
  const pyalloc_memory_info_t info = read_info(device);
  std::vector<OomObserver> to_call;
  {
    std::lock_guard<std::mutex> lock(observers_mutex());
    to_call = observers();
  }
  for (const OomObserver& observer : to_call) observer(device, info.allocated, info.device_total, info.device_free);
  History& history = History::instance();
  if (history.recording()) history.on_oom(device, size, info.device_free, nullptr);
  c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(size), info.allocated, info.reserved,
                                   c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  TORCH_CHECK_WITH(OutOfMemoryError, false, out_of_memory_message(size, device, info, report));
}

namespace {

// pyalloc_malloc in user pool `pool` (0: the default pools). The current pool
// is the calling thread's, so it is set around the one call.
void* malloc_in(int pool, size_t size, int device, void* stream) {
  if (pool == 0) return pyalloc_malloc(size, device, stream);
  const int previous = pyalloc_current_pool();
  pyalloc_set_current_pool(pool);
  void* p = pyalloc_malloc(size, device, stream);
  pyalloc_set_current_pool(previous);
  return p;
}

}  // namespace

void* allocate_or_throw(size_t size, int device, void* stream) {
  // Every allocation of PyTorch's comes here: one relaxed load for the
  // private pools (Note [Private pools under PyTorch]) before the call. A
  // NULL for size > 0 always leaves its reason in pyalloc_last_error.
  Pools& pools = Pools::instance();
  const int pool = pools.route(device, stream);
  void* p = malloc_in(pool, size, device, stream);
  if (p != nullptr) {
    History& history = History::instance();
    if (history.recording()) history.on_alloc(device, p, size, stream);
    return p;
  }
  if (size == 0) return p;
  const char* last = pyalloc_last_error();
  const std::string report = last != nullptr ? last : "";  // before another call overwrites it
  if (device < 0 || device >= pyalloc_device_count()) TORCH_CHECK(false, "pyalloc: ", report);
  if (pool == 0) {
    // torch.cuda.MemPool(use_on_oom=True): the pool's cache before an OOM.
    for (int fallback : pools.oom_fallbacks(device)) {
      if (void* q = pyalloc_pool_take_cached(fallback, size, device, stream)) {
        History& history = History::instance();
        if (history.recording()) history.on_alloc(device, q, size, stream);
        return q;
      }
    }
  }
  throw_out_of_memory(size, device, report);
}

void free_block(void* ptr, size_t size, int device, void* stream) {
  History& history = History::instance();
  if (history.recording()) history.on_free(device, ptr, size, stream);
  pyalloc_free(ptr, size, device, stream);
}

size_t largest_request(int device) {
  pyalloc_memory_info_t info{};
  if (pyalloc_memory_info(device, &info) != PYALLOC_OK) {
    const char* last = pyalloc_last_error();
    TORCH_CHECK(false, "pyalloc: ", last != nullptr ? last : "pyalloc_memory_info failed");
  }
  return info.largest_request;
}

}  // namespace pyalloc::torch_layer
