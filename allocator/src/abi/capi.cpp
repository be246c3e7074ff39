// capi.cpp: the C ABI of pyalloc.h.
//
// Each entry point validates its arguments, finds the device's allocator in
// the current Runtime, and converts results to the C contract: no exception
// crosses the ABI, and a failure leaves a thread-local message for
// pyalloc_last_error().
#include <atomic>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "abi/runtime.hpp"
#include "device/fast_path.hpp"
#include "ground/json.hpp"
#include "pyalloc/pyalloc.h"

using pyalloc::DeviceAllocator;
using pyalloc::FreeResult;
using pyalloc::Runtime;
using pyalloc::StreamId;

namespace {

thread_local int t_current_pool = 0;
thread_local StreamId t_cupy_stream = 0;
// Threads whose current pool is not the default. While it is zero (the
// common case) malloc skips the thread-local read, which in a dlopen'ed
// library costs a __tls_get_addr call.
std::atomic<int> g_threads_in_user_pools{0};

int current_pool_id() {
  return g_threads_in_user_pools.load(std::memory_order_relaxed) == 0 ? 0 : t_current_pool;
}

void set_error(std::string message) { pyalloc::set_last_error(std::move(message)); }

// Runs `body`, turning any exception into an error message and `fallback`.
template <typename R, typename F>
R guarded(R fallback, F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    set_error("pyalloc: out of host memory for allocator metadata");
  } catch (const std::exception& e) {
    set_error(std::string("pyalloc: internal error: ") + e.what());
  } catch (...) {
    set_error("pyalloc: internal error");
  }
  return fallback;
}

// The device's allocator, or nullptr with the error set and counted.
__attribute__((noinline, cold)) DeviceAllocator* device_error(Runtime* r, int device, const char* fn) {
  if (!r->error.empty()) {
    set_error(std::string(fn) + ": " + r->error);
    return nullptr;
  }
  pyalloc::g_num_invalid_device.fetch_add(1, std::memory_order_relaxed);
  set_error(std::string(fn) + ": device " + std::to_string(device) + " is out of range (" +
            std::to_string(r->devices.size()) + " devices on the " + pyalloc::backend_name(r->backend_kind) +
            " backend)");
  return nullptr;
}

// A failed runtime has no devices, so one range check covers both cases.
inline DeviceAllocator* device_or_error(Runtime* r, int device, const char* fn) {
  if (PYALLOC_UNLIKELY(static_cast<unsigned>(device) >= r->devices.size())) return device_error(r, device, fn);
  return r->devices[static_cast<size_t>(device)].get();
}

size_t copy_out(const std::string& text, char* buf, size_t len) {
  if (buf != nullptr && len > 0) {
    const size_t n = text.size() < len - 1 ? text.size() : len - 1;
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return text.size();
}

std::string error_json(const std::string& message) {
  pyalloc::JsonWriter w;
  w.begin_object().key("error").value(message).end_object();
  return w.str();
}

// Why a malloc was refused before reaching an allocator: size 0 (NULL, no
// error: documented), a device out of range, or an absurd size.
__attribute__((noinline, cold)) void* malloc_refused(Runtime* r, size_t size, int device) {
  if (size == 0) return nullptr;
  DeviceAllocator* d = device_or_error(r, device, "pyalloc_malloc");
  if (d == nullptr) return nullptr;
  d->count_invalid_size();
  set_error("pyalloc_malloc: size " + std::to_string(size) + " is beyond any device (limit " +
            std::to_string(pyalloc::kMaxRequest) + " bytes)");
  return nullptr;
}

// The general path (Note [Fast path]): the runtime (built on first use), two
// range checks, the device's malloc. A reconfiguration between the load and
// the device's lock retires that device (status PYALLOC_EBUSY): start again
// from the new runtime.
PYALLOC_INLINE void* malloc_impl(size_t size, int device, StreamId stream) {
  for (;;) {
    Runtime* r = pyalloc::current_runtime();
    if (PYALLOC_UNLIKELY(size - 1 >= pyalloc::kMaxRequest || static_cast<unsigned>(device) >= r->devices.size())) {
      return malloc_refused(r, size, device);
    }
    int status = PYALLOC_OK;
    void* p = r->devices[static_cast<size_t>(device)]->malloc(size, stream, current_pool_id(), &status);
    if (PYALLOC_UNLIKELY(p == nullptr && status == PYALLOC_EBUSY)) continue;
    return p;
  }
}

PYALLOC_INLINE void free_impl(void* ptr, size_t size, int device, StreamId stream) {
  if (ptr == nullptr) return;
  for (;;) {
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_free");
    if (d == nullptr) return;
    const FreeResult result = d->free(reinterpret_cast<uintptr_t>(ptr), size, stream);
    if (PYALLOC_UNLIKELY(result == FreeResult::kRetired)) continue;
    return;
  }
}

// The current runtime when the fast path may serve a call on `device`: it
// exists and `device` is in range. Otherwise nullptr, and the general path
// sorts it out.
PYALLOC_INLINE Runtime* fast_runtime(int device) {
  Runtime* r = pyalloc::g_current_runtime.load(std::memory_order_acquire);
  return r != nullptr && static_cast<unsigned>(device) < r->num_devices ? r : nullptr;
}

__attribute__((noinline)) void* malloc_general(size_t size, int device, StreamId stream) {
  return guarded<void*>(nullptr, [&] { return malloc_impl(size, device, stream); });
}

__attribute__((noinline)) void free_general(void* ptr, size_t size, int device, StreamId stream) {
  guarded<int>(0, [&] { return free_impl(ptr, size, device, stream), 0; });
}

// The fast path gave up with the device's lock held.
__attribute__((noinline)) void* unlock_then_malloc(DeviceAllocator* d, size_t size, StreamId stream) {
  d->unlock();
  return malloc_general(size, d->device(), stream);
}

__attribute__((noinline)) void unlock_then_free(DeviceAllocator* d, void* ptr, size_t size, StreamId stream) {
  d->unlock();
  free_general(ptr, size, d->device(), stream);
}

}  // namespace

extern "C" {

// Note [Fast path] (device/fast_path.hpp): a cache hit in the default
// pool makes no call; anything else, errors included, ends in one tail call
// to the general path.
void* pyalloc_malloc(size_t size, int device, void* stream) {
  const StreamId s = reinterpret_cast<StreamId>(stream);
  Runtime* r = fast_runtime(device);
  if (PYALLOC_LIKELY(r != nullptr && size - 1 < pyalloc::kMaxRequest &&
                     g_threads_in_user_pools.load(std::memory_order_relaxed) == 0)) {
    DeviceAllocator* d = r->devices[static_cast<unsigned>(device)].get();
    if (PYALLOC_LIKELY(d->try_lock())) return d->malloc_cached(size, s, [=] { return unlock_then_malloc(d, size, s); });
  }
  return malloc_general(size, device, s);
}

void pyalloc_free(void* ptr, size_t size, int device, void* stream) {
  // PyTorch passes the allocation's stream; the block remembers it, and a
  // different one is a bad call (PYALLOC_ANY_STREAM: the caller does not know).
  const StreamId s = reinterpret_cast<StreamId>(stream);
  Runtime* r = fast_runtime(device);
  if (PYALLOC_LIKELY(r != nullptr && ptr != nullptr)) {
    DeviceAllocator* d = r->devices[static_cast<unsigned>(device)].get();
    if (PYALLOC_LIKELY(d->try_lock())) {
      return d->free_cached(reinterpret_cast<uintptr_t>(ptr), size, s, [=] { unlock_then_free(d, ptr, size, s); });
    }
  }
  free_general(ptr, size, device, s);
}

void pyalloc_record_stream(void* ptr, void* stream) {
  guarded<int>(0, [&] {
    if (ptr == nullptr) return 0;
    Runtime* r = pyalloc::current_runtime();
    for (auto& d : r->devices) {
      if (d->record_stream(reinterpret_cast<uintptr_t>(ptr), reinterpret_cast<StreamId>(stream))) return 0;
    }
    pyalloc::g_num_invalid_record_stream.fetch_add(1, std::memory_order_relaxed);
    char where[32];
    std::snprintf(where, sizeof where, "%p", ptr);
    set_error(std::string("pyalloc_record_stream: ") + where + " is not the start of a live allocation");
    return 0;
  });
}

int pyalloc_free_neighbours(void* ptr, size_t* free_below, size_t* free_above) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    if (free_below == nullptr || free_above == nullptr) {
      set_error("pyalloc_free_neighbours: free_below and free_above must not be NULL");
      return static_cast<int>(PYALLOC_EINVAL);
    }
    *free_below = *free_above = 0;
    for (auto& d : pyalloc::current_runtime()->devices) {
      if (ptr == nullptr) break;  // never live (and no key of the live-block map)
      if (d->free_neighbours(reinterpret_cast<uintptr_t>(ptr), free_below, free_above)) {
        return static_cast<int>(PYALLOC_OK);
      }
    }
    set_error("pyalloc_free_neighbours: " + std::to_string(reinterpret_cast<uintptr_t>(ptr)) +
              " is not a live allocation of pyalloc");
    return static_cast<int>(PYALLOC_EINVAL);
  });
}

void pyalloc_empty_cache(void) {
  guarded<int>(0, [] {
    for (auto& d : pyalloc::current_runtime()->devices) d->empty_cache();
    return 0;
  });
}

void pyalloc_set_memory_fraction(double fraction, int device) {
  guarded<int>(0, [&] {
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_set_memory_fraction");
    if (d == nullptr) return 0;
    // [0, 1], as torch.cuda.set_per_process_memory_fraction takes it: 0 lets nothing be
    // reserved (refused, PyTorch's 0 reached us as an error nobody read, and no cap was set)
    if (!(fraction >= 0.0 && fraction <= 1.0)) {
      char text[32];
      std::snprintf(text, sizeof text, "%.17g", fraction);  // (to_string printed 1.0000001 as 1.000000)
      set_error(std::string("pyalloc_set_memory_fraction: fraction ") + text + " is not in [0, 1]");
      return 0;
    }
    d->set_memory_fraction(fraction);
    return 0;
  });
}

void* pyalloc_cupy_malloc(void* /*param*/, size_t size, int device) {
  return guarded<void*>(nullptr, [&] { return malloc_impl(size, device, t_cupy_stream); });
}

void pyalloc_cupy_free(void* /*param*/, void* ptr, int device) {
  guarded<int>(0, [&] { return free_impl(ptr, pyalloc::kAnySize, device, pyalloc::kAnyStream), 0; });
}

void pyalloc_cupy_set_stream(void* stream) { t_cupy_stream = reinterpret_cast<StreamId>(stream); }

int pyalloc_configure(const char* conf) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    if (conf == nullptr) {
      set_error("pyalloc_configure: the configuration string is NULL");
      return static_cast<int>(PYALLOC_EINVAL);
    }
    std::string error;
    const int status = pyalloc::configure(conf, &error);
    if (status != PYALLOC_OK) set_error(error);
    return status;
  });
}

const char* pyalloc_last_error(void) { return pyalloc::last_error_slot().c_str(); }

size_t pyalloc_stats_json(int device, char* buf, size_t len) {
  return guarded<size_t>(0, [&] {
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_stats_json");
    if (d == nullptr) return copy_out(error_json(pyalloc::last_error_slot()), buf, len);
    const pyalloc::ProcessCounters c = pyalloc::process_counters();
    return copy_out(d->stats_json(c.num_invalid_device, c.num_invalid_record_stream), buf, len);
  });
}

int pyalloc_memory_info(int device, pyalloc_memory_info_t* out) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    if (out == nullptr) {
      set_error("pyalloc_memory_info: out must not be NULL");
      return static_cast<int>(PYALLOC_EINVAL);
    }
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_memory_info");
    if (d == nullptr) return static_cast<int>(PYALLOC_EDEVICE);
    const DeviceAllocator::MemoryInfo m = d->memory_info();
    *out = pyalloc_memory_info_t{m.device_total, m.device_free,    m.reserved,       m.allocated,
                                 m.limit,        m.largest_cached, m.largest_request};
    return static_cast<int>(PYALLOC_OK);
  });
}

int pyalloc_snapshot_walk(int device, pyalloc_segment_fn segment, pyalloc_block_fn block, void* user_data) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    if (segment == nullptr || block == nullptr) {
      set_error("pyalloc_snapshot_walk: the callbacks must not be NULL");
      return static_cast<int>(PYALLOC_EINVAL);
    }
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_snapshot_walk");
    if (d == nullptr) return static_cast<int>(PYALLOC_EDEVICE);
    d->visit_snapshot([&](const pyalloc::SnapshotSegment& s) {
      const pyalloc_segment_info_t info{s.address,
                                        s.total,
                                        s.allocated,
                                        s.active,
                                        s.requested,
                                        reinterpret_cast<void*>(s.segment->stream),
                                        s.segment->pool->kind != pyalloc::PoolKind::kSmall,
                                        s.segment->arena,
                                        s.segment->pool->id};
      segment(&info, user_data);
      for (const pyalloc::Block* b = s.first; b != s.end; b = b->next) {
        const pyalloc_block_info_t bi{b->addr, b->size, b->requested, pyalloc::snapshot_allocated(b),
                                      pyalloc::snapshot_active(b)};
        block(&bi, user_data);
      }
    });
    return static_cast<int>(PYALLOC_OK);
  });
}

size_t pyalloc_snapshot_json(char* buf, size_t len) {
  return guarded<size_t>(0, [&] {
    Runtime* r = pyalloc::current_runtime();
    pyalloc::JsonWriter w;
    w.begin_object();
    w.key("segments").begin_array();
    for (auto& d : r->devices) d->write_segments_json(w);
    w.end_array();
    w.key("device_traces").begin_array();
    for (auto& d : r->devices) d->write_trace_json(w);
    w.end_array();
    w.key("pools").begin_array();  // pyalloc's own: per-pool figures
    for (auto& d : r->devices) d->write_pools_json(w);
    w.end_array();
    w.key("allocator_settings").raw(pyalloc::config_json());
    w.key("pyalloc_version").value(PYALLOC_VERSION);
    if (!r->error.empty()) w.key("error").value(r->error);
    w.end_object();
    return copy_out(w.str(), buf, len);
  });
}

int pyalloc_check(int device) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_check");
    if (d == nullptr) return static_cast<int>(PYALLOC_EDEVICE);
    std::string error;
    if (d->check(&error)) return static_cast<int>(PYALLOC_OK);
    set_error(error);
    return static_cast<int>(PYALLOC_EINVAL);
  });
}

const char* pyalloc_version(void) { return PYALLOC_VERSION; }

void pyalloc_clear_last_error(void) { pyalloc::last_error_slot().clear(); }

int pyalloc_device_count(void) {
  return guarded<int>(0, [] { return static_cast<int>(pyalloc::current_runtime()->devices.size()); });
}

size_t pyalloc_config_json(char* buf, size_t len) {
  return guarded<size_t>(0, [&] { return copy_out(pyalloc::config_json(), buf, len); });
}

int pyalloc_reset_peak_stats(int device) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_reset_peak_stats");
    if (d == nullptr) return static_cast<int>(PYALLOC_EDEVICE);
    d->reset_peaks();
    return static_cast<int>(PYALLOC_OK);
  });
}

int pyalloc_reset_accumulated_stats(int device) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_reset_accumulated_stats");
    if (d == nullptr) return static_cast<int>(PYALLOC_EDEVICE);
    d->reset_accumulated();
    return static_cast<int>(PYALLOC_OK);
  });
}

int pyalloc_release_cached(int device, size_t bytes, size_t* released) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_release_cached");
    if (d == nullptr) return static_cast<int>(PYALLOC_EDEVICE);
    const size_t n = d->release_cached(bytes);
    if (released != nullptr) *released = n;
    return static_cast<int>(PYALLOC_OK);
  });
}

int pyalloc_pool_create(const char* name, int* pool_id) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    if (name == nullptr || pool_id == nullptr) {
      set_error("pyalloc_pool_create: name and pool_id must not be NULL");
      return static_cast<int>(PYALLOC_EINVAL);
    }
    std::string error;
    const int status = pyalloc::pool_create(name, pool_id, &error);
    if (status != PYALLOC_OK) set_error(error);
    return status;
  });
}

int pyalloc_set_current_pool(int pool_id) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    if (pool_id < 0 || pool_id > pyalloc::pool_count()) {
      set_error("pyalloc_set_current_pool: no pool has id " + std::to_string(pool_id));
      return static_cast<int>(PYALLOC_EINVAL);
    }
    if ((t_current_pool != 0) != (pool_id != 0)) {
      g_threads_in_user_pools.fetch_add(pool_id != 0 ? 1 : -1, std::memory_order_relaxed);
    }
    t_current_pool = pool_id;
    return static_cast<int>(PYALLOC_OK);
  });
}

int pyalloc_current_pool(void) { return t_current_pool; }

int pyalloc_pool_hold(int pool_id, int held) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    if (pool_id < 1 || pool_id > pyalloc::pool_count()) {
      set_error("pyalloc_pool_hold: no user pool has id " + std::to_string(pool_id));
      return static_cast<int>(PYALLOC_EINVAL);
    }
    Runtime* rt = pyalloc::current_runtime();
    if (!rt->error.empty()) {
      set_error("pyalloc_pool_hold: " + rt->error);
      return static_cast<int>(PYALLOC_EBACKEND);
    }
    for (auto& d : rt->devices) {
      std::string error;
      if (!d->hold_pool(pool_id, held != 0, &error)) {
        set_error("pyalloc_pool_hold: " + error);
        return static_cast<int>(PYALLOC_EINVAL);
      }
    }
    pyalloc::pool_set_held(pool_id, held != 0);
    return static_cast<int>(PYALLOC_OK);
  });
}

int pyalloc_pool_empty_cache(int pool_id, size_t* released, size_t* still_reserved) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    if (pool_id < 1 || pool_id > pyalloc::pool_count()) {
      set_error("pyalloc_pool_empty_cache: no user pool has id " + std::to_string(pool_id));
      return static_cast<int>(PYALLOC_EINVAL);
    }
    size_t freed = 0;
    size_t kept = 0;
    for (auto& d : pyalloc::current_runtime()->devices) {
      size_t still = 0;
      freed += d->release_pool(pool_id, &still);
      kept += still;
    }
    if (released != nullptr) *released = freed;
    if (still_reserved != nullptr) *still_reserved = kept;
    return static_cast<int>(PYALLOC_OK);
  });
}

int pyalloc_ipc_export(void* ptr, void* buf, size_t len, size_t* handle_len, size_t* offset) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    if (handle_len == nullptr || offset == nullptr) {
      set_error("pyalloc_ipc_export: handle_len and offset must not be NULL");
      return static_cast<int>(PYALLOC_EINVAL);
    }
    for (auto& d : pyalloc::current_runtime()->devices) {
      if (ptr == nullptr) break;  // never live (and no key of the live-block map)
      std::string handle;
      std::string error;
      if (d->ipc_export(reinterpret_cast<uintptr_t>(ptr), &handle, offset, &error)) {
        *handle_len = handle.size();
        if (buf != nullptr) std::memcpy(buf, handle.data(), std::min(len, handle.size()));
        return static_cast<int>(PYALLOC_OK);
      }
      if (!error.empty()) {
        set_error("pyalloc_ipc_export: " + error);
        return static_cast<int>(PYALLOC_EBACKEND);
      }
    }
    char where[32];
    std::snprintf(where, sizeof where, "%p", ptr);
    set_error(std::string("pyalloc_ipc_export: ") + where + " is not the start of a live allocation");
    return static_cast<int>(PYALLOC_EINVAL);
  });
}

int pyalloc_ipc_import(int device, const void* handle, size_t len, void** base) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    if (handle == nullptr || base == nullptr) {
      set_error("pyalloc_ipc_import: handle and base must not be NULL");
      return static_cast<int>(PYALLOC_EINVAL);
    }
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_ipc_import");
    if (d == nullptr) return static_cast<int>(PYALLOC_EDEVICE);
    std::string error;
    uintptr_t at = 0;
    if (!d->ipc_import(std::string(static_cast<const char*>(handle), len), &at, &error)) {
      set_error("pyalloc_ipc_import: " + error);
      return static_cast<int>(PYALLOC_EINVAL);
    }
    *base = reinterpret_cast<void*>(at);
    return static_cast<int>(PYALLOC_OK);
  });
}

int pyalloc_ipc_close(int device, void* base) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_ipc_close");
    if (d == nullptr) return static_cast<int>(PYALLOC_EDEVICE);
    if (!d->ipc_close(reinterpret_cast<uintptr_t>(base))) {
      char where[32];
      std::snprintf(where, sizeof where, "%p", base);
      set_error(std::string("pyalloc_ipc_close: ") + where + " is not memory imported on device " +
                std::to_string(device));
      return static_cast<int>(PYALLOC_EINVAL);
    }
    return static_cast<int>(PYALLOC_OK);
  });
}

void* pyalloc_pool_take_cached(int pool_id, size_t size, int device, void* stream) {
  return guarded<void*>(nullptr, [&]() -> void* {
    if (pool_id < 1 || pool_id > pyalloc::pool_count()) {
      set_error("pyalloc_pool_take_cached: no user pool has id " + std::to_string(pool_id));
      return nullptr;
    }
    if (size == 0 || size > pyalloc::kMaxRequest) return nullptr;
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_pool_take_cached");
    if (d == nullptr) return nullptr;
    return d->take_cached(pool_id, size, reinterpret_cast<StreamId>(stream));
  });
}

int pyalloc_capture_begin(int device) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_capture_begin");
    if (d == nullptr) return static_cast<int>(PYALLOC_EDEVICE);
    d->begin_capture();
    return static_cast<int>(PYALLOC_OK);
  });
}

int pyalloc_capture_end(int device) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    DeviceAllocator* d = device_or_error(pyalloc::current_runtime(), device, "pyalloc_capture_end");
    if (d == nullptr) return static_cast<int>(PYALLOC_EDEVICE);
    if (!d->end_capture()) {
      set_error("pyalloc_capture_end: no capture was begun on device " + std::to_string(device));
      return static_cast<int>(PYALLOC_EINVAL);
    }
    return static_cast<int>(PYALLOC_OK);
  });
}

int pyalloc_register_pressure_callback(pyalloc_pressure_fn fn, void* user_data, int* handle) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    std::string error;
    const int status = pyalloc::register_callback(fn, user_data, handle, &error);
    if (status != PYALLOC_OK) set_error(error);
    return status;
  });
}

int pyalloc_unregister_pressure_callback(int handle) {
  return guarded<int>(PYALLOC_EINVAL, [&] {
    std::string error;
    const int status = pyalloc::unregister_callback(handle, &error);
    if (status != PYALLOC_OK) set_error(error);
    return status;
  });
}

}  // extern "C"
