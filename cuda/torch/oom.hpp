// oom.hpp: a failed allocation, as PyTorch's own allocator reports it.
//
// Note [Out of memory under PyTorch]
// pyalloc_malloc returns NULL when the pressure ladder (release, stitch,
// share, pressure callbacks, gpumemd) could not find the memory; its report is
// in pyalloc_last_error. PyTorch's caching allocator, in the same case, runs
// its out-of-memory observers (torch.cuda.memory._record_memory_history's
// snapshot on OOM attaches one), tells the profiler, and throws
// c10::OutOfMemoryError, which PyTorch's Python bindings turn into
// torch.OutOfMemoryError. Code that catches it matches on its type or on the
// start of its message ("CUDA out of memory."; accelerate's
// find_executable_batch_size does), so the message keeps PyTorch's shape,
// "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity
// of ...", and pyalloc's report follows it.
//
// Depends on c10 only (no CUDA header): the CPU build of PyTorch has the
// exception and its translation, so the tests show it arriving in Python.
#pragma once

#include <pyalloc/pyalloc.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace pyalloc::torch_layer {

// PyTorch's format for sizes in its messages: "512 bytes", "4.00 KiB",
// "20.00 MiB", "2.00 GiB".
std::string format_size(uint64_t bytes);

// The message of the error thrown when a request of `size` bytes on `device`
// failed; `report` is pyalloc's own (pyalloc_last_error), appended.
std::string out_of_memory_message(size_t size, int device, const pyalloc_memory_info_t& info,
                                  const std::string& report);

// PyTorch's CUDACachingAllocator::OutOfMemoryObserver: (device, allocated
// bytes, device total, device free).
using OomObserver = std::function<void(int64_t, size_t, size_t, size_t)>;

// Adds an observer, run on every failed allocation before the throw (any
// thread; observers are called outside pyalloc's locks).
void attach_oom_observer(OomObserver observer);

// Runs the observers and throws c10::OutOfMemoryError for a failed request of
// `size` bytes on `device`, with pyalloc's `report` (its pyalloc_last_error).
// Reads the figures with pyalloc_memory_info.
[[noreturn]] void throw_out_of_memory(size_t size, int device, const std::string& report);

// pyalloc_malloc, or the throw above when it returns NULL for size > 0. A bad
// argument (a device out of range) throws c10::Error with pyalloc's message.
// The request goes to the private pool a route picks (pools.hpp), else the
// default pools, then the use_on_oom pools before the throw. While memory
// history is recorded, the allocation is (history.hpp).
void* allocate_or_throw(size_t size, int device, void* stream);

// pyalloc_free, with the free recorded while memory history is: the one way
// the layer gives a block back.
void free_block(void* ptr, size_t size, int device, void* stream);

// CUDAAllocator::cacheInfo: the largest request `device` serves without
// releasing memory (pyalloc_memory_info_t::largest_request).
size_t largest_request(int device);

}  // namespace pyalloc::torch_layer
