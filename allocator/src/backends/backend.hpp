// backend.hpp: the seam between the caching allocator and memory.
//
// The allocator never touches a device API directly; every device call goes
// through a Backend. Three implementations exist:
//   host  real host memory with a capacity limit (backend_host.cpp)
//   sim   fake addresses, nothing touched, for GPU-scale replay (backend_sim.cpp)
//   cuda  the CUDA driver API, loaded with dlopen (cuda/backend_cuda.cpp)
//
// Contract for every implementation:
//   - No method throws. Failures return a Status with a message.
//   - Methods are called with the owning device's allocator lock held, from
//     any thread; a backend must be safe to call for different devices
//     concurrently.
//   - A backend never calls back into the allocator.
//   - Destructors make no device call: backends live until process exit and
//     are intentionally leaked (see Note [Shutdown] in abi/runtime.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace pyalloc {

struct Config;

// Streams are opaque handles from the caller (a CUstream on cuda).
using StreamId = uintptr_t;

struct Status {
  bool ok = true;
  std::string message;  // empty when ok

  static Status success() { return {}; }
  static Status failure(std::string msg) { return {false, std::move(msg)}; }
};

// A physical memory chunk that can be mapped into a virtual range.
struct PhysHandle {
  uint64_t value = 0;  // backend-specific (CUmemGenericAllocationHandle, memfd, id)
  size_t size = 0;
};

// An event recorded on a stream. Backends reuse event objects.
using EventHandle = uintptr_t;

struct MemInfo {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const char* name() const = 0;
  virtual int device_count() const = 0;
  // The device's memory: free and total bytes as the backend sees them
  // (host/sim: capacity minus what this backend handed out).
  virtual MemInfo mem_info(int device) = 0;

  // ---- plain segments ----------------------------------------------------
  // Allocates `size` bytes (a multiple of 512) for `device`; `*addr` is
  // aligned to at least 512 bytes. Fails when the device is full.
  virtual Status segment_alloc(int device, size_t size, uintptr_t* addr) = 0;
  virtual void segment_free(int device, uintptr_t addr, size_t size) = 0;

  // ---- virtual memory ------------------------------------------------------
  // Whether `device` can map physical chunks into reserved address ranges at
  // all (cuda: CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED).
  virtual bool vmm_supported(int device) { return true; }
  // Granularity of physical chunks and of mapping offsets/sizes.
  virtual size_t granularity(int device) = 0;
  virtual Status reserve(int device, size_t size, uintptr_t* va) = 0;
  virtual void release_reservation(int device, uintptr_t va, size_t size) = 0;
  virtual Status phys_create(int device, size_t size, PhysHandle* out) = 0;
  virtual void phys_release(int device, PhysHandle handle) = 0;
  // Maps `handle` at `va` (inside a reservation) with read-write access.
  virtual Status map(int device, uintptr_t va, PhysHandle handle) = 0;
  // Maps handles[0..n) end to end from `va`: all of them, or none (a failure
  // leaves the range unmapped). The default maps one at a time; cuda grants
  // access to the whole range in one call (Note [Backend time]).
  virtual Status map_range(int device, uintptr_t va, const PhysHandle* handles, size_t n);
  // Unmaps [va, va+size), one whole mapping; the reservation stays.
  virtual void unmap(int device, uintptr_t va, size_t size) = 0;
  // Unmaps what map_range(device, va, handles, n) mapped: mappings of
  // handles[i].size bytes laid end to end from `va`. The default unmaps one
  // at a time; cuda waits for queued work once for all.
  virtual void unmap_range(int device, uintptr_t va, const PhysHandle* handles, size_t n);

  // ---- events and streams ----------------------------------------------------
  // Records an event capturing the work queued on `stream` so far.
  virtual Status event_record(int device, StreamId stream, EventHandle* event) = 0;
  // True when the work the event captured has completed.
  virtual bool event_query(int device, EventHandle event) = 0;
  virtual void event_synchronize(int device, EventHandle event) = 0;
  // Returns the event to the backend's pool.
  virtual void event_release(int device, EventHandle event) = 0;
  // Waits for the work queued on every stream of `device` (cuda:
  // cuCtxSynchronize): before live bytes are copied (Note [Moving slivers]).
  virtual void synchronize_device(int device) = 0;
  // Makes future work on `stream` wait for `event`.
  virtual Status stream_wait(int device, StreamId stream, EventHandle event) = 0;

  // ---- copies ----------------------------------------------------------------
  virtual Status copy_to_host_async(int device, void* dst, uintptr_t src, size_t size,
                                    StreamId stream) = 0;
  virtual Status copy_to_device_async(int device, uintptr_t dst, const void* src, size_t size,
                                      StreamId stream) = 0;
  // Copies [src, src+size) to [dst, dst+size), both mapped on `device` and
  // not overlapping, after the work queued on `stream` so far (Note [Moving
  // slivers] in device/move.cpp).
  virtual Status copy_device_async(int device, uintptr_t dst, uintptr_t src, size_t size, StreamId stream) = 0;

  // ---- sharing memory with other processes (Note [Sharing blocks] in device/ipc.cpp) ----
  // Exporting: bytes that let another process of this machine map the same
  // memory, a plain segment's or a physical chunk's. The exporter keeps the
  // memory until the importers are done (its caller's business).
  virtual Status segment_export(int device, uintptr_t addr, size_t size, std::string* out);
  virtual Status phys_export(int device, PhysHandle handle, std::string* out);
  // Importing, in the other process: a segment mapped at *addr (*size: its
  // size as exported; undone with segment_close), or a chunk to map() into a reservation (undone with
  // phys_close after unmap; it frees nothing of the exporter's).
  virtual Status segment_import(int device, const std::string& in, uintptr_t* addr, size_t* size);
  virtual void segment_close(int /*device*/, uintptr_t /*addr*/, size_t /*size*/) {}
  virtual Status phys_import(int device, const std::string& in, size_t size, PhysHandle* out);
  virtual void phys_close(int /*device*/, PhysHandle /*handle*/) {}
};

// A copy of descriptor `fd` of process `pid` in this process (backend.cpp),
// for imports of memory exported as file descriptors.
// `may_reopen`: the descriptor is a file that reopens as itself (a memfd).
Status take_fd(int pid, int fd, bool may_reopen, int* out);
// Raises this process's soft limit of open descriptors to its hard limit,
// once: exporting and importing an arena block take one per granule.
void allow_shared_descriptors();

// Factories. Each returns nullptr and fills *error when the backend cannot
// start (e.g. cuda without a driver).
std::unique_ptr<Backend> make_host_backend(const Config& config, std::string* error);
std::unique_ptr<Backend> make_sim_backend(const Config& config, std::string* error);
std::unique_ptr<Backend> make_cuda_backend(const Config& config, std::string* error);

}  // namespace pyalloc
