// ops.cpp: torch.ops.pyalloc, pyalloc's raw allocation as PyTorch operators.
//
// allocate(size, device, stream) -> address, free(address, size, device,
// stream), cache_info(device) -> bytes, device_stats(device) -> {key: value}:
// the C ABI's malloc, free, pyalloc_memory_info and the DeviceStats that
// getDeviceStats gives PyTorch (stats.hpp), with PyTorch's error types (Note [Out of memory under
// PyTorch] in oom.hpp). They load on every build of PyTorch, CPU included,
// which is how the tests show a failed allocation reaching Python as
// torch.OutOfMemoryError; under a CUDA build they are also a way to take raw
// device memory from pyalloc with the errors PyTorch code expects.
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "oom.hpp"
#include "stats.hpp"

namespace {

void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<uintptr_t>(stream)); }

int64_t allocate(int64_t size, int64_t device, int64_t stream) {
  TORCH_CHECK(size >= 0, "pyalloc.allocate: size must not be negative, got ", size);
  void* p = pyalloc::torch_layer::allocate_or_throw(static_cast<size_t>(size), static_cast<int>(device),
                                                    as_stream(stream));
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
}

void free_block(int64_t address, int64_t size, int64_t device, int64_t stream) {
  TORCH_CHECK(size >= 0, "pyalloc.free: size must not be negative, got ", size);
  pyalloc_clear_last_error();
  pyalloc_free(reinterpret_cast<void*>(static_cast<uintptr_t>(address)), static_cast<size_t>(size),
               static_cast<int>(device), as_stream(stream));
  const char* last = pyalloc_last_error();
  TORCH_CHECK(last == nullptr || *last == '\0', "pyalloc: ", last);
}

int64_t cache_info(int64_t device) {
  return static_cast<int64_t>(pyalloc::torch_layer::largest_request(static_cast<int>(device)));
}

// DeviceStats as torch.cuda.memory_stats() names its keys: what
// getDeviceStats gives PyTorch, read back for the tests.
c10::Dict<std::string, int64_t> device_stats(int64_t device) {
  const c10::CachingDeviceAllocator::DeviceStats s = pyalloc::torch_layer::device_stats(static_cast<int>(device));
  c10::Dict<std::string, int64_t> out;
  const char* pools[] = {"all", "small_pool", "large_pool"};
  auto put = [&](const std::string& name, const c10::CachingAllocator::StatArray& a) {
    for (size_t i = 0; i < 3; ++i) {
      const std::string prefix = name + "." + pools[i] + ".";
      out.insert(prefix + "current", a[i].current);
      out.insert(prefix + "peak", a[i].peak);
      out.insert(prefix + "allocated", a[i].allocated);
      out.insert(prefix + "freed", a[i].freed);
    }
  };
  put("allocation", s.allocation);
  put("segment", s.segment);
  put("active", s.active);
  put("inactive_split", s.inactive_split);
  put("allocated_bytes", s.allocated_bytes);
  put("reserved_bytes", s.reserved_bytes);
  put("active_bytes", s.active_bytes);
  put("inactive_split_bytes", s.inactive_split_bytes);
  put("requested_bytes", s.requested_bytes);
  out.insert("num_alloc_retries", s.num_alloc_retries);
  out.insert("num_ooms", s.num_ooms);
  out.insert("num_sync_all_streams", s.num_sync_all_streams);
  out.insert("num_device_alloc", s.num_device_alloc);
  out.insert("num_device_free", s.num_device_free);
  out.insert("max_split_size", s.max_split_size);
  out.insert("oversize_allocations.current", s.oversize_allocations.current);
  out.insert("oversize_segments.current", s.oversize_segments.current);
  return out;
}

}  // namespace

TORCH_LIBRARY(pyalloc, m) {
  m.def("allocate(int size, int device=0, int stream=0) -> int", &allocate);
  m.def("free(int address, int size, int device=0, int stream=0) -> ()", &free_block);
  m.def("cache_info(int device=0) -> int", &cache_info);
  m.def("device_stats(int device=0) -> Dict(str, int)", &device_stats);
}
