// backend_cuda.cpp: the cuda backend, the CUDA driver API behind backend.hpp.
//
// Policy summary
//   - The driver is loaded with dlopen("libcuda.so.1") once per process and
//     every function is resolved with dlsym (cuda/driver_api.hpp lists them,
//     with their versioned symbol names). No CUDA header or library is needed
//     to build, and a machine without a driver gets a one-line error from
//     make_cuda_backend, not a load failure of libpyalloc.so.
//   - All memory lives in each device's primary context: the one the CUDA
//     runtime, and so PyTorch and CuPy, use. Pointers we hand out are
//     therefore valid in their kernels. See Note [Primary context] in
//     driver.hpp.
//   - Plain segments: cuMemAlloc_v2 / cuMemFree_v2. Virtual memory:
//     cuMemAddressReserve, cuMemCreate (pinned device memory), cuMemMap +
//     cuMemSetAccess, cuMemUnmap, a range of chunks at a time (mapping.hpp).
//     Events come from a per-device pool of CU_EVENT_DISABLE_TIMING events
//     (creating one costs microseconds and a driver lock; recording a reused
//     one does not).
//   - segment_free and unmap first wait for the device (cuCtxSynchronize,
//     once a range): block frees are stream ordered, so kernels queued before
//     the free may still be using the memory when it goes back to the driver.
//   - Errors come back as a Status naming the call, the device and the
//     driver's own error name. Errors a void method cannot return (a failed
//     cuMemFree, an event query on a faulted context) are counted per device
//     and the first is printed to stderr. See Note [Event errors].
//
// Threading (the Backend contract): calls for one device come with that
// device's allocator lock held; calls for different devices run concurrently.
// The function table and device handles are immutable after loading. Each
// device's mutable state (its context, its event pool, cached attributes)
// has a mutex of its own, held around those few fields and the one-time
// driver queries that fill them (retaining the context, the granularity),
// never around work queued on a stream.
//
// Shutdown: nothing here is ever torn down. The driver state is allocated
// once and leaked, CudaBackend's destructor makes no driver call, and
// primary contexts are never released: at process exit the driver may
// already be gone, and a call into it then crashes (Note [Shutdown] in
// abi/runtime.cpp). ScopedContext's destructor does call the driver, but it is a
// local guard that only lives inside a backend call.
//
// Note [Event errors]
//   cuEventQuery returns CUDA_SUCCESS (done), CUDA_ERROR_NOT_READY (still
//   running) or an error. An error means the context faulted (an illegal
//   address in some kernel) or the driver is shutting down: no queued work
//   will run any more, so none can still touch the memory the event guards.
//   It is reported as complete, so that the allocator is not left waiting
//   forever on memory it can never get back, and the error is remembered
//   for diagnostics. CUDA_ERROR_DEINITIALIZED (the process is exiting) is
//   expected then and not reported.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "backends/backend.hpp"
#include "driver.hpp"
#include "mapping.hpp"
#include "sharing.hpp"
#include "ground/config.hpp"

namespace pyalloc {
namespace {

using namespace cuda_backend;  // NOLINT(google-build-using-namespace)

// Backend contract: segment addresses are aligned to at least this many bytes.
// cuMemAlloc aligns far more (2 MiB for segment-sized requests); checked anyway.
constexpr uintptr_t kSegmentAlign = 512;
// Idle events kept per device. A burst of cross-stream frees needs many at
// once, the steady state few; beyond this, released events are destroyed.
constexpr size_t kMaxIdleEvents = 1024;
// Granularity reported when the device cannot tell (no VMM support): what
// every NVIDIA GPU so far reports. Never 0, which a caller would divide by;
// reserve() and phys_create() then fail with a message saying why.
constexpr size_t kFallbackGranularity = size_t{2} << 20;

CUstream to_stream(StreamId stream) { return reinterpret_cast<CUstream>(stream); }
CUevent to_event(EventHandle event) { return reinterpret_cast<CUevent>(event); }

// A Status for when building the real one failed (std::bad_alloc): it
// carries no message rather than risk another allocation.
Status host_memory_failure() noexcept {
  Status status;
  status.ok = false;
  try {
    status.message = "cuda backend: out of host memory";
  } catch (...) {
  }
  return status;
}

// ---- the backend ------------------------------------------------------------------

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(Driver& driver) : driver_(driver), api_(driver.api) {}
  // No driver call (file comment, "Shutdown").
  ~CudaBackend() override = default;

  const char* name() const override { return "cuda"; }
  int device_count() const override { return driver_.device_count; }

  MemInfo mem_info(int device) override {
    MemInfo info;
    DeviceState* state = device_state(device);
    if (state == nullptr) return info;
    try {
      if (state->context.load(std::memory_order_acquire) == nullptr &&
          !primary_context_active(*state)) {
        // Asking for free bytes would create the context (Note [Primary context]).
        size_t total = 0;
        const CUresult rc = api_.cuDeviceTotalMem(&total, state->handle);
        if (rc != CUDA_SUCCESS) {
          note_error(device, "cuDeviceTotalMem_v2", rc);
          return info;
        }
        info.free_bytes = total;
        info.total_bytes = total;
        return info;
      }
      ScopedContext context(api_, *state);
      if (!context.ok()) {
        note_error(device, context.failed_call(), context.result());
        return info;
      }
      size_t free_bytes = 0;
      size_t total_bytes = 0;
      const CUresult rc = api_.cuMemGetInfo(&free_bytes, &total_bytes);
      if (rc != CUDA_SUCCESS) {
        note_error(device, "cuMemGetInfo_v2", rc);
        return info;
      }
      info.free_bytes = free_bytes;
      info.total_bytes = total_bytes;
    } catch (...) {
    }
    return info;
  }

  // ---- plain segments ----------------------------------------------------------

  Status segment_alloc(int device, size_t size, uintptr_t* addr) override {
    return in_context(device, [&](DeviceState&) -> Status {
      CUdeviceptr ptr = 0;
      const CUresult rc = api_.cuMemAlloc(&ptr, size);
      if (rc != CUDA_SUCCESS) return alloc_failure(device, "cuMemAlloc_v2", size, rc);
      if (ptr % kSegmentAlign != 0) {
        api_.cuMemFree(ptr);
        return Status::failure("cuda device " + std::to_string(device) + ": cuMemAlloc_v2 of " +
                               std::to_string(size) + " bytes returned an address not aligned to " +
                               std::to_string(kSegmentAlign) + " bytes");
      }
      *addr = static_cast<uintptr_t>(ptr);
      return Status::success();
    });
  }

  void segment_free(int device, uintptr_t addr, size_t /*size*/) override {
    // Block frees are stream ordered: a kernel queued before the free may still use the
    // segment. cuMemFree waits in practice but does not promise it: wait explicitly.
    synchronize_device(device);
    call_void(device, "cuMemFree_v2", [&] { return api_.cuMemFree(addr); });
  }

  // ---- virtual memory ----------------------------------------------------------

  bool vmm_supported(int device) override {
    DeviceState* state = device_state(device);
    return state != nullptr && vmm_supported(*state);
  }

  size_t granularity(int device) override {
    DeviceState* state = device_state(device);
    if (state == nullptr) return kFallbackGranularity;
    try {
      std::lock_guard<std::mutex> lock(state->mutex);
      if (state->granularity == 0) state->granularity = query_granularity(*state);
      return state->granularity;
    } catch (...) {
      return kFallbackGranularity;
    }
  }

  Status reserve(int device, size_t size, uintptr_t* va) override {
    return in_context(device, [&](DeviceState&) -> Status {
      CUdeviceptr ptr = 0;
      // Alignment 0: the allocation granularity. Address 0: anywhere.
      const CUresult rc = api_.cuMemAddressReserve(&ptr, size, 0, 0, 0);
      if (rc != CUDA_SUCCESS) return call_failure(device, "cuMemAddressReserve", rc);
      *va = static_cast<uintptr_t>(ptr);
      return Status::success();
    }, /*require_vmm=*/true);
  }

  void release_reservation(int device, uintptr_t va, size_t size) override {
    call_void(device, "cuMemAddressFree", [&] { return api_.cuMemAddressFree(va, size); });
  }

  Status phys_create(int device, size_t size, PhysHandle* out) override {
    return in_context(device, [&](DeviceState& state) -> Status {
      CUmemAllocationProp prop = device_memory_prop(state);
      CUmemGenericAllocationHandle handle = 0;
      // Chunks are made exportable as file descriptors where the driver
      // can (Note [Sharing blocks]); a driver or system that refuses it
      // gets chunks that cannot be shared, once asked.
      std::unique_lock<std::mutex> lock(state.mutex);
      const bool try_export = state.exportable != 0 && api_.cuMemExportToShareableHandle != nullptr;
      lock.unlock();
      if (try_export) prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      CUresult rc = api_.cuMemCreate(&handle, size, &prop, 0);
      if (try_export && (rc == CUDA_ERROR_INVALID_VALUE || rc == CUDA_ERROR_NOT_SUPPORTED)) {
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
        rc = api_.cuMemCreate(&handle, size, &prop, 0);
        if (rc == CUDA_SUCCESS) {
          lock.lock();
          state.exportable = 0;
        }
      } else if (try_export && rc == CUDA_SUCCESS) {
        lock.lock();
        state.exportable = 1;
      }
      if (rc != CUDA_SUCCESS) return alloc_failure(device, "cuMemCreate", size, rc);
      out->value = handle;
      out->size = size;
      return Status::success();
    }, /*require_vmm=*/true);
  }

  void phys_release(int device, PhysHandle handle) override {
    if (DeviceState* state = device_state(device)) {
      std::lock_guard<std::mutex> lock(state->mutex);
      const auto it = state->exported.find(handle.value);
      if (it != state->exported.end()) {
        close(it->second);
        state->exported.erase(it);
      }
    }
    // Releasing a handle still mapped somewhere only drops our reference:
    // the memory goes back when the last mapping is unmapped.
    call_void(device, "cuMemRelease", [&] { return api_.cuMemRelease(handle.value); });
  }

  // ---- sharing with other processes (Note [Sharing blocks]; sharing.hpp) ----------

  Status segment_export(int device, uintptr_t addr, size_t, std::string* out) override {
    if (api_.cuIpcGetMemHandle == nullptr) return missing(device, "cuIpcGetMemHandle");
    return in_context(device, [&](DeviceState&) { return status_of(device, export_segment(api_, addr, out)); });
  }

  Status segment_import(int device, const std::string& in, uintptr_t* addr, size_t*) override {
    if (api_.cuIpcOpenMemHandle == nullptr) return missing(device, "cuIpcOpenMemHandle_v2");
    if (in.size() != sizeof(CUipcMemHandle)) return malformed(device, "segment");
    return in_context(device, [&](DeviceState&) { return status_of(device, open_segment(api_, in, addr)); });
  }

  void segment_close(int device, uintptr_t addr, size_t) override {
    if (api_.cuIpcCloseMemHandle) call_void(device, "cuIpcCloseMemHandle", [&] { return api_.cuIpcCloseMemHandle(addr); });
  }

  Status phys_export(int device, PhysHandle handle, std::string* out) override {
    if (api_.cuMemExportToShareableHandle == nullptr) return missing(device, "cuMemExportToShareableHandle");
    return in_context(device, [&](DeviceState& state) -> Status {
      allow_shared_descriptors();
      if (state.exportable == 0) {
        return Status::failure("cuda device " + std::to_string(device) + ": the driver refused memory exportable "
                               "as file descriptors (cuMemCreate), so arena blocks cannot be shared; set vmm=off "
                               "for plain segments, which can");
      }
      return status_of(device, export_chunk(api_, state, handle.value, out));
    });
  }

  Status phys_import(int device, const std::string& in, size_t size, PhysHandle* out) override {
    if (api_.cuMemImportFromShareableHandle == nullptr) return missing(device, "cuMemImportFromShareableHandle");
    int32_t ref[2] = {0, 0};  // (exporter's pid, descriptor): sharing.hpp
    if (in.size() != sizeof ref) return malformed(device, "chunk");
    std::memcpy(ref, in.data(), sizeof ref);
    int fd = -1;
    if (Status s = take_fd(ref[0], ref[1], /*may_reopen=*/false, &fd); !s.ok) return Status::failure("cuda device " + std::to_string(device) + ": " + s.message);
    CUmemGenericAllocationHandle handle = 0;
    Status status = in_context(device, [&](DeviceState&) { return status_of(device, import_chunk(api_, fd, &handle)); });
    close(fd);  // the driver holds its own reference
    *out = PhysHandle{handle, size};
    return status;
  }

  void phys_close(int device, PhysHandle handle) override {
    call_void(device, "cuMemRelease", [&] { return api_.cuMemRelease(handle.value); });
  }

  Status map(int device, uintptr_t va, PhysHandle handle) override { return map_range(device, va, &handle, 1); }

  Status map_range(int device, uintptr_t va, const PhysHandle* handles, size_t n) override {
    return in_context(device, [&](DeviceState& state) {
      return status_of(device, map_chunks(api_, state.handle, va, handles, n));  // mapping.hpp
    });
  }

  void unmap(int device, uintptr_t va, size_t size) override {
    const PhysHandle whole{0, size};  // unmap_chunks reads sizes only
    unmap_range(device, va, &whole, 1);
  }

  void unmap_range(int device, uintptr_t va, const PhysHandle* handles, size_t n) override {
    // cuMemUnmap does not wait for queued work, and a kernel still using the range would
    // fault (block frees are stream ordered). Wait for the device first, as segment_free and
    // PyTorch's expandable segments do: once for the whole range, however many granules.
    synchronize_device(device);
    call_void(device, "cuMemUnmap", [&] { return unmap_chunks(api_, va, handles, n).result; });
  }

  void synchronize_device(int device) override {
    call_void(device, "cuCtxSynchronize", [&] { return api_.cuCtxSynchronize(); });
  }

  // ---- events and streams --------------------------------------------------------

  Status event_record(int device, StreamId stream, EventHandle* event) override {
    return in_context(device, [&](DeviceState& state) -> Status {
      CUevent ev = take_idle_event(state);
      if (ev == nullptr) {
        const CUresult rc = api_.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING);
        if (rc != CUDA_SUCCESS) return call_failure(device, "cuEventCreate", rc);
      }
      const CUresult rc = api_.cuEventRecord(ev, to_stream(stream));
      if (rc != CUDA_SUCCESS) {
        recycle_event(state, ev);
        return call_failure(device, "cuEventRecord", rc);
      }
      *event = reinterpret_cast<EventHandle>(ev);
      return Status::success();
    });
  }

  bool event_query(int device, EventHandle event) override {
    DeviceState* state = device_state(device);
    if (state == nullptr || event == 0) return true;
    try {
      ScopedContext context(api_, *state);
      if (!context.ok()) {
        note_error(device, context.failed_call(), context.result());
        return true;  // Note [Event errors]
      }
      const CUresult rc = api_.cuEventQuery(to_event(event));
      if (rc == CUDA_SUCCESS) return true;
      if (rc == CUDA_ERROR_NOT_READY) return false;
      note_error(device, "cuEventQuery", rc);
      return true;  // Note [Event errors]
    } catch (...) {
      return false;  // not known to be complete: the caller asks again later
    }
  }

  void event_synchronize(int device, EventHandle event) override {
    if (event == 0) return;
    call_void(device, "cuEventSynchronize",
              [&] { return api_.cuEventSynchronize(to_event(event)); });
  }

  void event_release(int device, EventHandle event) override {
    DeviceState* state = device_state(device);
    if (state == nullptr || event == 0) return;
    recycle_event(*state, to_event(event));
  }

  Status stream_wait(int device, StreamId stream, EventHandle event) override {
    return called(device, "cuStreamWaitEvent", [&] { return api_.cuStreamWaitEvent(to_stream(stream), to_event(event), 0); });
  }

  // ---- copies ------------------------------------------------------------------------
  Status copy_to_host_async(int device, void* dst, uintptr_t src, size_t size, StreamId stream) override {
    return called(device, "cuMemcpyDtoHAsync_v2", [&] { return api_.cuMemcpyDtoHAsync(dst, src, size, to_stream(stream)); });
  }
  Status copy_to_device_async(int device, uintptr_t dst, const void* src, size_t size, StreamId stream) override {
    return called(device, "cuMemcpyHtoDAsync_v2", [&] { return api_.cuMemcpyHtoDAsync(dst, src, size, to_stream(stream)); });
  }
  Status copy_device_async(int device, uintptr_t dst, uintptr_t src, size_t size, StreamId stream) override {
    return called(device, "cuMemcpyDtoDAsync_v2", [&] { return api_.cuMemcpyDtoDAsync(dst, src, size, to_stream(stream)); });
  }

 private:
  // One driver call in the device's context; a failure names the function.
  template <typename Call>
  Status called(int device, const char* name, Call call) {
    return in_context(device, [&](DeviceState&) -> Status {
      const CUresult rc = call();
      return rc == CUDA_SUCCESS ? Status::success() : call_failure(device, name, rc);
    });
  }

  DeviceState* device_state(int device) const {
    if (device < 0 || device >= driver_.device_count) return nullptr;
    return &driver_.devices[device];
  }

  bool primary_context_active(const DeviceState& state) const {
    unsigned int flags = 0;
    int active = 0;
    return api_.cuDevicePrimaryCtxGetState(state.handle, &flags, &active) == CUDA_SUCCESS &&
           active != 0;
  }

  CUmemAllocationProp device_memory_prop(const DeviceState& state) const {
    CUmemAllocationProp prop{};  // zeroed: no export handle, no compression, no Windows data
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = state.handle;
    return prop;
  }

  // Called with state.mutex held. Needs no context.
  bool query_vmm_supported(DeviceState& state) {
    if (state.vmm_supported < 0) {
      int supported = 0;
      const CUresult rc = api_.cuDeviceGetAttribute(
          &supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, state.handle);
      state.vmm_supported = (rc == CUDA_SUCCESS && supported != 0) ? 1 : 0;
    }
    return state.vmm_supported == 1;
  }

  bool vmm_supported(DeviceState& state) {
    std::lock_guard<std::mutex> lock(state.mutex);
    return query_vmm_supported(state);
  }

  // Called with state.mutex held. Needs no context.
  size_t query_granularity(DeviceState& state) {
    if (!query_vmm_supported(state)) return kFallbackGranularity;
    const CUmemAllocationProp prop = device_memory_prop(state);
    size_t granularity = 0;
    const CUresult rc =
        api_.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    return (rc == CUDA_SUCCESS && granularity != 0) ? granularity : kFallbackGranularity;
  }

  CUevent take_idle_event(DeviceState& state) {
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.idle_events.empty()) return nullptr;
    CUevent ev = state.idle_events.back();
    state.idle_events.pop_back();
    return ev;
  }

  // Returns an event to the device's pool, or destroys it when the pool is
  // full. Re-recording a pooled event later is fine even if the work it
  // captured last time is still running: a record replaces what it captures.
  void recycle_event(DeviceState& state, CUevent ev) noexcept {
    try {
      std::lock_guard<std::mutex> lock(state.mutex);
      if (state.idle_events.size() < kMaxIdleEvents) {
        state.idle_events.push_back(ev);
        return;
      }
    } catch (...) {
      // No room to keep it: destroy it below instead.
    }
    try {
      ScopedContext context(api_, state);
      if (context.ok()) api_.cuEventDestroy(ev);
    } catch (...) {
    }
  }

  // Runs a driver call of a void method in the device's context; a failure
  // can only be noted (Note [Event errors]).
  // The frame of every Status method: the device (and, for the virtual-memory
  // calls, its VMM support), its primary context made current for the body,
  // and no exception out.
  template <class Body>
  Status in_context(int device, Body&& body, bool require_vmm = false) noexcept {
    try {
      DeviceState* state = device_state(device);
      if (state == nullptr) return bad_device(device);
      if (require_vmm && !vmm_supported(*state)) return no_vmm(device);
      ScopedContext context(api_, *state);
      if (!context.ok()) return context_failure(device, context);
      return body(*state);
    } catch (...) {
      return host_memory_failure();
    }
  }

  template <class Call>
  void call_void(int device, const char* call_name, Call&& call) noexcept {
    try {
      DeviceState* state = device_state(device);
      if (state == nullptr) return;
      ScopedContext context(api_, *state);
      if (!context.ok()) {
        note_error(device, context.failed_call(), context.result());
        return;
      }
      const CUresult rc = call();
      if (rc != CUDA_SUCCESS) note_error(device, call_name, rc);
    } catch (...) {
    }
  }

  // Counts an error no caller can be told about; prints the first one per
  // device (later ones are usually the same sticky fault repeated).
  void note_error(int device, const char* call_name, CUresult rc) noexcept {
    if (rc == CUDA_ERROR_DEINITIALIZED) return;  // the process is exiting
    DeviceState* state = device_state(device);
    if (state == nullptr) return;
    try {
      std::string message = "cuda device " + std::to_string(device) + ": " + call_name +
                            " failed: " + error_text(api_, rc);
      std::lock_guard<std::mutex> lock(state->mutex);
      ++state->unreported_errors;
      if (!state->first_error.empty()) return;
      state->first_error = std::move(message);
      std::fprintf(stderr, "pyalloc: %s (further driver errors on this device are not printed)\n",
                   state->first_error.c_str());
    } catch (...) {
    }
  }

  Status status_of(int device, const DriverCall& c) const {
    return c.ok() ? Status::success() : call_failure(device, c.call, c.result);
  }

  Status malformed(int device, const char* what) const {
    return Status::failure("cuda device " + std::to_string(device) + ": a shared " + what + "'s handle is malformed");
  }
  Status missing(int device, const char* symbol) const {
    return Status::failure("cuda device " + std::to_string(device) + ": " + kDriverLibrary + " has no " + symbol +
                           ", which sharing memory with another process needs (update the NVIDIA driver)");
  }

  Status call_failure(int device, const char* call_name, CUresult rc) const {
    return Status::failure("cuda device " + std::to_string(device) + ": " + call_name +
                           " failed: " + error_text(api_, rc));
  }

  Status alloc_failure(int device, const char* call_name, size_t size, CUresult rc) const {
    if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
      return Status::failure("cuda device " + std::to_string(device) + " out of memory: " +
                             call_name + " of " + std::to_string(size) +
                             " bytes failed: " + error_text(api_, rc));
    }
    return call_failure(device, call_name, rc);
  }

  Status context_failure(int device, const ScopedContext& context) const {
    return call_failure(device, context.failed_call(), context.result());
  }

  Status bad_device(int device) const {
    return Status::failure("cuda backend: device " + std::to_string(device) +
                           " out of range (the driver sees " +
                           std::to_string(driver_.device_count) + ")");
  }

  Status no_vmm(int device) const {
    return Status::failure("cuda device " + std::to_string(device) +
                           " does not support virtual memory management "
                           "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)");
  }

  Driver& driver_;
  const DriverApi& api_;
};

}  // namespace

// The cuda backend takes nothing from the config: the device count and
// capacity are the hardware's.
std::unique_ptr<Backend> make_cuda_backend(const Config& /*config*/, std::string* error) {
  try {
    const LoadResult& loaded = driver_load_result();
    if (loaded.driver == nullptr) {
      if (error != nullptr) *error = loaded.error;
      return nullptr;
    }
    return std::make_unique<CudaBackend>(*loaded.driver);
  } catch (...) {
    try {
      if (error != nullptr) *error = "backend=cuda: out of host memory while loading the driver";
    } catch (...) {
    }
    return nullptr;
  }
}

}  // namespace pyalloc
