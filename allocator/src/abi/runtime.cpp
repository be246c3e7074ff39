// runtime.cpp: configuration, reconfiguration, pools and pressure callbacks.
//
// Note [Shutdown]
// PyTorch frees tensors from static destructors and atexit handlers, after
// which any of our statics may already be gone, and the CUDA driver may be
// shutting down. So the Runtime, its Backend and everything below them are
// heap objects that are never destroyed, and no destructor makes a device
// call. The OS reclaims the memory at exit.
#include "abi/runtime.hpp"

#include "ground/json.hpp"
#include "node/gpumemd_client.hpp"
#include "node/registry.hpp"

#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>

namespace pyalloc {

std::atomic<int64_t> g_num_invalid_device{0};
std::atomic<int64_t> g_num_invalid_record_stream{0};

ProcessCounters process_counters() {
  return {g_num_invalid_device.load(std::memory_order_relaxed),
          g_num_invalid_record_stream.load(std::memory_order_relaxed)};
}

namespace {

struct Callback {
  int handle;
  pyalloc_pressure_fn fn;
  void* user_data;
};

}  // namespace

// The current runtime: a constant-initialized global, so reading it on the
// fast path is one load with no static-initialization guard.
std::atomic<Runtime*> g_current_runtime{nullptr};

namespace {

struct Process {
  std::mutex configure_mutex;  // serializes configuration and runtime swaps
  std::vector<Runtime*> retired;  // kept alive: late callers may still hold them

  std::mutex pools_mutex;
  std::vector<std::string> pool_names;  // index = id - 1
  std::vector<char> pool_held;          // index = id - 1 (Note [Held pools] in device/pools.cpp)

  std::mutex callbacks_mutex;
  std::condition_variable callbacks_idle;
  std::vector<Callback> callbacks;
  int next_handle = 1;
  int callbacks_in_flight = 0;
};

// Note [Fork]
//   fork() copies one thread and every lock as it is: a lock another thread
//   held stays held in the child, whose first allocation then waits forever
//   (a review saw 1 child in 50 hang while a second thread allocated). So the
//   process takes every lock before fork() and lets go in both processes
//   after it, in the order the allocator takes them: configuration, each
//   device of every runtime (a retired runtime's too: late callers use it),
//   then the pool names and the callbacks, which a device's lock may be held
//   over. What fork() copies is then between calls. (CUDA itself cannot be
//   used in a forked child; the host and sim backends, and a child that only
//   frees what it inherited, can.)
void for_each_fork_device(Process& p, void (*fn)(DeviceAllocator&)) {
  for (Runtime* r : p.retired) {
    for (auto& d : r->devices) fn(*d);
  }
  if (Runtime* r = g_current_runtime.load(std::memory_order_acquire)) {
    for (auto& d : r->devices) fn(*d);
  }
}

void before_fork();
void after_fork();

Process& process() {
  static Process* p = [] {
    Process* made = new Process;  // leaked: see Note [Shutdown]
    pthread_atfork(before_fork, after_fork, after_fork);
    return made;
  }();
  return *p;
}

void before_fork() {
  Process& p = process();
  p.configure_mutex.lock();
  for_each_fork_device(p, [](DeviceAllocator& d) { d.lock(); });
  p.pools_mutex.lock();
  p.callbacks_mutex.lock();
}

void after_fork() {  // in the parent and in the child
  Process& p = process();
  p.callbacks_mutex.unlock();
  p.pools_mutex.unlock();
  for_each_fork_device(p, [](DeviceAllocator& d) { d.unlock(); });
  p.configure_mutex.unlock();
}

thread_local bool t_in_pressure_callback = false;

Runtime* build_runtime(const Config& config) {
  Runtime* r = new Runtime(config);
  std::unique_ptr<Backend> backend;
  switch (config.backend) {
    case BackendKind::kHost: backend = make_host_backend(config, &r->error); break;
    case BackendKind::kSim: backend = make_sim_backend(config, &r->error); break;
    case BackendKind::kCuda: backend = make_cuda_backend(config, &r->error); break;
  }
  if (!backend) {
    if (r->error.empty()) r->error = std::string("backend=") + backend_name(config.backend) + " failed to start";
    return r;
  }
  const int n = backend->device_count();
  if (n <= 0) {
    r->error = std::string("backend=") + backend_name(config.backend) + ": no devices";
    return r;
  }
  Config resolved = config;  // what each device's allocator is made with: vmm=auto decided
  resolved.vmm = config.resolve_vmm(n, backend->vmm_supported(0));
  r->vmm = resolved.vmm;
  // Note [Backend time]: the sim backend's calls are counted, not timed.
  auto metered = std::make_unique<MeteredBackend>(std::move(backend), n, config.backend != BackendKind::kSim);
  for (int i = 0; i < n; ++i) r->devices.push_back(std::make_unique<DeviceAllocator>(i, resolved, metered.get(), *r));
  r->num_devices = static_cast<unsigned>(n);
  r->backend = std::move(metered);
  return r;
}

// The registry publisher's view of the process (node/registry.hpp): always
// the current runtime, so that a reconfiguration needs no new source.
class CurrentRuntimeSource final : public RegistrySource {
 public:
  const char* backend_name() override { return pyalloc::backend_name(current_runtime()->backend_kind); }

  size_t read_devices(pyalloc_registry_device* out, uint64_t* allocations_total, size_t max) override {
    Runtime* rt = current_runtime();
    const size_t n = std::min(rt->devices.size(), max);
    for (size_t i = 0; i < n; ++i) {
      const DeviceAllocator::Usage u = rt->devices[i]->usage();
      pyalloc_registry_device& d = out[i];
      d.reserved_bytes = u.reserved;
      d.allocated_bytes = u.allocated;
      d.active_bytes = u.active;
      d.cached_free_bytes = u.cached_free;
      d.largest_free_bytes = u.largest_free;
      d.peak_reserved_bytes = u.peak_reserved;
      d.num_ooms = u.num_ooms;
      d.num_alloc_retries = u.num_alloc_retries;
      allocations_total[i] = u.allocations_total;
    }
    return n;
  }

  size_t trim(int device, size_t bytes) override {
    Runtime* rt = current_runtime();
    size_t released = 0;
    if (device >= 0 && static_cast<size_t>(device) < rt->devices.size()) {
      released = rt->devices[static_cast<size_t>(device)]->release_cached(bytes);
    } else if (device == -1) {  // every device
      for (auto& d : rt->devices) released += d->release_cached(bytes);
    }
    return released;
  }
};

RegistrySource* registry_source() {
  static CurrentRuntimeSource* source = new CurrentRuntimeSource;  // leaked: see Note [Shutdown]
  return source;
}

Runtime* initial_runtime_locked(Process& p) {
  Runtime* r = g_current_runtime.load(std::memory_order_acquire);
  if (r != nullptr) return r;
  Config config;
  std::string error;
  const char* env = std::getenv("PYALLOC_CONF");
  if (env != nullptr && !parse_config(env, Config{}, "PYALLOC_CONF", &config, &error)) {
    r = new Runtime(Config{});
    r->error = error;
    // The pyalloc command reports it itself, in one line (PYALLOC_CLI, set by pyalloc/cli.py).
    if (std::getenv("PYALLOC_CLI") == nullptr) {
      std::fprintf(stderr, "pyalloc: %s; every allocation will fail until pyalloc_configure() succeeds\n",
                   error.c_str());
    }
  } else {
    r = build_runtime(config);
  }
  g_current_runtime.store(r, std::memory_order_release);
  if (r->error.empty()) registry_apply(r->config, registry_source());
  return r;
}

}  // namespace

Runtime::Runtime(const Config& c) : backend_kind(c.backend), config(c) {}

Runtime* first_runtime() {
  Process& p = process();
  std::lock_guard<std::mutex> lock(p.configure_mutex);
  return initial_runtime_locked(p);
}

int configure(const char* text, std::string* error) {
  Process& p = process();
  std::lock_guard<std::mutex> lock(p.configure_mutex);
  Runtime* cur = initial_runtime_locked(p);
  Config next;
  if (!parse_config(text, cur->config, "pyalloc_configure", &next, error)) return PYALLOC_EINVAL;

  // vmm=auto is decided by the backend (shared on one cuda device with
  // virtual memory, else off), so the mode asked for is resolved the same way
  // and compared with the one the devices were built with (Config's own
  // comparison leaves vmm out): on cuda, "vmm=off" after "vmm=auto" rebuilds,
  // and "vmm=shared" after it does not.
  const bool vmm_changes =
      cur->backend && next.resolve_vmm(static_cast<int>(cur->num_devices), cur->backend->vmm_supported(0)) != cur->vmm;
  if (cur->error.empty() && !cur->config.layout_differs(next) && !vmm_changes) {
    cur->config = next;
    for (auto& d : cur->devices) d->apply_settings(next);
    registry_apply(next, registry_source());
    return PYALLOC_OK;
  }

  // A layout change: build the successor first, so a failure leaves the
  // current runtime untouched.
  Runtime* fresh = build_runtime(next);
  if (!fresh->error.empty()) {
    *error = fresh->error;
    p.retired.push_back(fresh);
    return PYALLOC_EBACKEND;
  }
  size_t retired = 0;
  for (; retired < cur->devices.size(); ++retired) {
    int64_t live = 0;
    if (!cur->devices[retired]->retire_if_idle(&live)) {
      for (size_t i = 0; i < retired; ++i) cur->devices[i]->unretire();
      *error = "pyalloc_configure: cannot change backend, capacity, devices, segment sizes, event_delay, vmm, plan "
               "or lifetime while " +
               std::to_string(live) + " bytes are allocated on device " + std::to_string(retired) +
               "; free them first";
      p.retired.push_back(fresh);
      return PYALLOC_EBUSY;
    }
  }
  p.retired.push_back(cur);
  g_current_runtime.store(fresh, std::memory_order_release);
  registry_apply(next, registry_source());
  return PYALLOC_OK;
}

std::string config_json() {
  Process& p = process();
  std::lock_guard<std::mutex> lock(p.configure_mutex);
  const Runtime* r = initial_runtime_locked(p);
  std::string json = r->config.to_json();
  if (!r->error.empty()) {
    // Why the allocator is not running (a bad PYALLOC_CONF, no driver).
    JsonWriter w;
    w.value(r->error);
    json.insert(json.size() - 1, ",\"startup_error\":" + w.str());
  }
  return json;
}

int pool_create(const std::string& name, int* id, std::string* error) {
  if (name.empty()) {
    *error = "pyalloc_pool_create: the pool name is empty";
    return PYALLOC_EINVAL;
  }
  for (const char* builtin : kBuiltinPoolNames) {
    if (name == builtin) {
      *error = "pyalloc_pool_create: '" + name + "' is the name of a built-in pool (small, large, plan, long)";
      return PYALLOC_EINVAL;
    }
  }
  Process& p = process();
  std::lock_guard<std::mutex> lock(p.pools_mutex);
  for (size_t i = 0; i < p.pool_names.size(); ++i) {
    if (p.pool_names[i] == name) return *id = static_cast<int>(i + 1), PYALLOC_OK;
  }
  constexpr size_t kMaxPools = 4096;
  if (p.pool_names.size() >= kMaxPools) {
    *error = "pyalloc_pool_create: too many pools (at most 4096)";
    return PYALLOC_EINVAL;
  }
  p.pool_names.push_back(name);
  p.pool_held.push_back(0);
  *id = static_cast<int>(p.pool_names.size());
  return PYALLOC_OK;
}

void pool_set_held(int id, bool held) {
  Process& p = process();
  std::lock_guard<std::mutex> lock(p.pools_mutex);
  if (id >= 1 && static_cast<size_t>(id) <= p.pool_held.size()) p.pool_held[static_cast<size_t>(id) - 1] = held;
}

bool pool_held(int id) {
  Process& p = process();
  std::lock_guard<std::mutex> lock(p.pools_mutex);
  return id >= 1 && static_cast<size_t>(id) <= p.pool_held.size() && p.pool_held[static_cast<size_t>(id) - 1];
}

int pool_count() {
  Process& p = process();
  std::lock_guard<std::mutex> lock(p.pools_mutex);
  return static_cast<int>(p.pool_names.size());
}

std::string pool_name(int id) {
  Process& p = process();
  std::lock_guard<std::mutex> lock(p.pools_mutex);
  if (id < 1 || static_cast<size_t>(id) > p.pool_names.size()) return "";
  return p.pool_names[static_cast<size_t>(id) - 1];
}

int register_callback(pyalloc_pressure_fn fn, void* user_data, int* handle, std::string* error) {
  if (fn == nullptr) {
    *error = "pyalloc_register_pressure_callback: the callback is NULL";
    return PYALLOC_EINVAL;
  }
  Process& p = process();
  std::lock_guard<std::mutex> lock(p.callbacks_mutex);
  const int h = p.next_handle++;
  p.callbacks.push_back(Callback{h, fn, user_data});
  if (handle != nullptr) *handle = h;
  return PYALLOC_OK;
}

int unregister_callback(int handle, std::string* error) {
  Process& p = process();
  std::unique_lock<std::mutex> lock(p.callbacks_mutex);
  for (auto it = p.callbacks.begin(); it != p.callbacks.end(); ++it) {
    if (it->handle == handle) {
      p.callbacks.erase(it);
      // The caller may free the callback's state once we return, so wait
      // for calls in flight, unless we are inside one (it would never end).
      if (!t_in_pressure_callback) p.callbacks_idle.wait(lock, [&] { return p.callbacks_in_flight == 0; });
      return PYALLOC_OK;
    }
  }
  *error = "pyalloc_unregister_pressure_callback: no callback has handle " + std::to_string(handle);
  return PYALLOC_EINVAL;
}

size_t Runtime::run_pressure_callbacks(int device, size_t bytes_needed) {
  if (t_in_pressure_callback) return 0;  // an allocation made by a callback: no re-entry
  Process& p = process();
  std::vector<Callback> calls;
  {
    std::lock_guard<std::mutex> lock(p.callbacks_mutex);
    if (p.callbacks.empty()) return 0;
    calls = p.callbacks;
    ++p.callbacks_in_flight;
  }
  size_t freed = 0;
  t_in_pressure_callback = true;
  for (const Callback& c : calls) {
    freed += c.fn(device, bytes_needed, c.user_data);
    if (freed >= bytes_needed) break;
  }
  t_in_pressure_callback = false;
  {
    std::lock_guard<std::mutex> lock(p.callbacks_mutex);
    --p.callbacks_in_flight;
  }
  p.callbacks_idle.notify_all();
  return freed;
}

bool Runtime::ask_daemon(int device, size_t bytes_needed, size_t* freed_bytes) {
  *freed_bytes = 0;
  if (t_in_pressure_callback) return false;  // not from inside a callback's allocation
  std::string socket_path;
  bool registry = false;
  {
    std::lock_guard<std::mutex> lock(process().configure_mutex);
    socket_path = config.daemon_socket;
    registry = config.registry;
  }
  // gpumemd trusts a requester that has a registry record: without one, it
  // would refuse us, so do not ask.
  if (!registry || socket_path == "off") return false;
  return ask_gpumemd(socket_path, device, bytes_needed, freed_bytes);
}

void Runtime::reserved_changed() { registry_poke(); }

std::string Runtime::pool_name(int pool_id) { return pyalloc::pool_name(pool_id); }

bool Runtime::pool_held(int pool_id) { return pyalloc::pool_held(pool_id); }

}  // namespace pyalloc
