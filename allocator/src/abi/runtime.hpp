// runtime.hpp: the process-wide state behind the C ABI.
//
// A Runtime is one configuration's allocator: its Config, its Backend and
// one DeviceAllocator per device. Reconfiguring a layout key builds a new
// Runtime and retires the old one (whose devices redirect late callers).
// Pool names and pressure callbacks outlive Runtimes: they belong to the
// process. Everything here is leaked at exit on purpose (Note [Shutdown]).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/backend.hpp"
#include "device/device_allocator.hpp"
#include "ground/config.hpp"
#include "ground/last_error.hpp"
#include "pyalloc/pyalloc.h"

namespace pyalloc {

class Runtime final : public DeviceHooks {
 public:
  explicit Runtime(const Config& config);

  size_t run_pressure_callbacks(int device, size_t bytes_needed) override;
  bool ask_daemon(int device, size_t bytes_needed, size_t* freed_bytes) override;
  void reserved_changed() override;
  std::string pool_name(int pool_id) override;
  bool pool_held(int pool_id) override;

  const BackendKind backend_kind;    // fixed for the runtime's life: readable without a lock
  Config config;                     // guarded by the process's configure mutex
  // The vmm mode its devices were built with: config's, with vmm=auto decided
  // by the backend (Config::resolve_vmm). Set before the runtime is published.
  VmmMode vmm = VmmMode::kOff;
  std::unique_ptr<Backend> backend;  // null when it failed to start
  std::string error;                 // why the backend failed; empty if it runs
  // Filled before the runtime is published; neither changes after.
  std::vector<std::unique_ptr<DeviceAllocator>> devices;
  unsigned num_devices = 0;  // devices.size(), for the fast path's range check: one compare
};

// Hidden on the declaration too, so that other files read it directly
// rather than through the GOT: every malloc and free starts here.
extern std::atomic<Runtime*> g_current_runtime __attribute__((visibility("hidden")));  // null until first use
Runtime* first_runtime();  // builds it from PYALLOC_CONF (once, under a lock)

// The current Runtime; built from PYALLOC_CONF on first use. Never null.
// Inline: every malloc and free starts here.
inline Runtime* current_runtime() {
  Runtime* r = g_current_runtime.load(std::memory_order_acquire);
  if (__builtin_expect(r != nullptr, 1)) return r;
  return first_runtime();
}

// pyalloc_configure(): returns a PYALLOC_* status, message in *error.
int configure(const char* text, std::string* error);
std::string config_json();

// Pools: names registered once per process; id 0 is the default pool.
int pool_create(const std::string& name, int* id, std::string* error);
int pool_count();
std::string pool_name(int id);  // "" for unknown ids
// Whether pool `id` is held (Note [Held pools] in device/pools.cpp): read by a
// device when it first uses the pool; pyalloc_pool_hold sets it.
void pool_set_held(int id, bool held);
bool pool_held(int id);

int register_callback(pyalloc_pressure_fn fn, void* user_data, int* handle, std::string* error);
int unregister_callback(int handle, std::string* error);

// Bad calls that name no device of ours are counted process-wide and shown
// in every device's stats: a device out of range, and record_stream of a
// pointer no device allocated.
struct ProcessCounters {
  int64_t num_invalid_device;
  int64_t num_invalid_record_stream;
};
extern std::atomic<int64_t> g_num_invalid_device;
extern std::atomic<int64_t> g_num_invalid_record_stream;
ProcessCounters process_counters();

}  // namespace pyalloc
