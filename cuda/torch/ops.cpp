// ops.cpp: torch.ops.pyalloc, pyalloc's raw allocation as PyTorch operators.
//
// allocate(size, device, stream) -> address, free(address, size, device,
// stream), cache_info(device) -> bytes, device_stats(device) -> {key: value}:
// the C ABI's malloc, free, pyalloc_memory_info and the DeviceStats that
// getDeviceStats gives PyTorch (stats.hpp), with PyTorch's error types (Note [Out of memory under
// PyTorch] in oom.hpp). They load on every build of PyTorch, CPU included,
// which is how the tests show a failed allocation reaching Python as
// torch.OutOfMemoryError; under a CUDA build they are also a way to take raw
// device memory from pyalloc with the errors PyTorch code expects. The
// pool_* and capture_mark operators drive the private pools as the
// allocator's entry points do (pools.hpp), and ipc_* its sharing (ipc.hpp),
// for the tests.
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

#include "history.hpp"
#include "ipc.hpp"
#include "oom.hpp"
#include "pools.hpp"
#include "stats.hpp"

namespace {

void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<uintptr_t>(stream)); }

int64_t allocate(int64_t size, int64_t device, int64_t stream) {
  TORCH_CHECK(size >= 0, "pyalloc.allocate: size must not be negative, got ", size);
  void* p = pyalloc::torch_layer::allocate_or_throw(static_cast<size_t>(size), static_cast<int>(device),
                                                    as_stream(stream));
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
}

void free_op(int64_t address, int64_t size, int64_t device, int64_t stream) {
  TORCH_CHECK(size >= 0, "pyalloc.free: size must not be negative, got ", size);
  pyalloc_clear_last_error();  // pyalloc_free is void: an error is told by the message it leaves
  pyalloc::torch_layer::free_block(reinterpret_cast<void*>(static_cast<uintptr_t>(address)),
                                   static_cast<size_t>(size), static_cast<int>(device), as_stream(stream));
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

// A context that says which allocation recorded it: the tests' stand-in for
// PyTorch's captured stacks (Note [Memory history under PyTorch]).
struct Numbered : c10::GatheredContext {
  explicit Numbered(int64_t n) : number(n) {}
  int64_t number;
};

std::atomic<int64_t> contexts_made{0};

std::shared_ptr<c10::GatheredContext> make_numbered() {
  return std::make_shared<Numbered>(++contexts_made);
}

int64_t number_of(const std::shared_ptr<c10::GatheredContext>& c) {
  const auto* n = dynamic_cast<const Numbered*>(c.get());
  return n == nullptr ? 0 : n->number;
}

void record_history(bool enabled, int64_t max_entries, int64_t when, bool clear) {
  TORCH_CHECK(when >= 0 && when <= 3, "record_history: when must be 0 (never) to 3 (all), got ", when);
  pyalloc::torch_layer::History::instance().configure(
      enabled, &make_numbered, static_cast<size_t>(max_entries),
      static_cast<c10::CachingDeviceAllocator::RecordContext>(when), clear);
}

// The snapshot the torch-facing allocator would give PyTorch, flattened:
// [segment address, total, allocated, active, expandable, block count] per
// segment, then [size, requested, allocated, active, context number] per
// block; and the trace of `device` as [action, address, size, context number].
std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>> snapshot_recorded(int64_t device) {
  auto& history = pyalloc::torch_layer::History::instance();
  std::vector<int64_t> segments, blocks, trace;
  for (const auto& s : history.segments(static_cast<int>(device))) {
    segments.insert(segments.end(), {static_cast<int64_t>(s.address), static_cast<int64_t>(s.total_size),
                                     static_cast<int64_t>(s.allocated_size), static_cast<int64_t>(s.active_size),
                                     s.is_expandable, static_cast<int64_t>(s.blocks.size())});
    for (const auto& b : s.blocks) {
      blocks.insert(blocks.end(), {static_cast<int64_t>(b.size), static_cast<int64_t>(b.requested_size), b.allocated,
                                   b.active, number_of(b.context_when_allocated)});
    }
  }
  const auto traces = history.traces(pyalloc_device_count());
  if (device >= 0 && static_cast<size_t>(device) < traces.size()) {
    for (const auto& e : traces[device]) {
      trace.insert(trace.end(), {static_cast<int64_t>(e.action_), static_cast<int64_t>(e.addr_),
                                 static_cast<int64_t>(e.size_), number_of(e.context_)});
    }
  }
  return {segments, blocks, trace};
}

// Private pools (Note [Private pools under PyTorch] in pools.hpp) as the
// torch-facing allocator drives them, with a stream filter that takes the
// allocations of one stream (a graph's filter takes its capture's).
pyalloc::torch_layer::PoolKey pool_key(int64_t first, int64_t second) {
  TORCH_CHECK(first >= 0 && second >= 0, "a pool id is two non-negative integers, got (", first, ", ", second, ")");
  return {static_cast<unsigned long long>(first), static_cast<unsigned long long>(second)};
}

void pool_begin(int64_t device, int64_t first, int64_t second, int64_t stream) {
  void* routed = as_stream(stream);
  pyalloc::torch_layer::Pools::instance().begin_route(static_cast<int>(device), pool_key(first, second),
                                                      [routed](void* s) { return s == routed; });
}

void pool_end(int64_t device, int64_t first, int64_t second) {
  pyalloc::torch_layer::Pools::instance().end_route(static_cast<int>(device), pool_key(first, second));
}

void pool_incref(int64_t device, int64_t first, int64_t second) {
  pyalloc::torch_layer::Pools::instance().incref(static_cast<int>(device), pool_key(first, second));
}

void pool_release(int64_t device, int64_t first, int64_t second) {
  pyalloc::torch_layer::Pools::instance().release(static_cast<int>(device), pool_key(first, second));
}

int64_t pool_use_count(int64_t device, int64_t first, int64_t second) {
  return pyalloc::torch_layer::Pools::instance().use_count(static_cast<int>(device), pool_key(first, second));
}

void pool_use_on_oom(int64_t device, int64_t first, int64_t second, bool on) {
  pyalloc::torch_layer::Pools::instance().set_use_on_oom(static_cast<int>(device), pool_key(first, second), on);
}

int64_t pool_empty(int64_t first, int64_t second) {
  return static_cast<int64_t>(pyalloc::torch_layer::Pools::instance().empty(pool_key(first, second)));
}

bool pool_live_allocations_are(int64_t device, int64_t first, int64_t second, std::vector<int64_t> addresses) {
  std::unordered_set<void*> expected;
  for (int64_t a : addresses) expected.insert(reinterpret_cast<void*>(static_cast<uintptr_t>(a)));
  return pyalloc::torch_layer::Pools::instance().live_allocations_are(static_cast<int>(device), pool_key(first, second),
                                                                      expected);
}

// The PyTorch pool id of each segment of the snapshot the torch-facing
// allocator would give PyTorch: [address, first, second] per segment.
std::vector<int64_t> snapshot_pools(int64_t device) {
  std::vector<int64_t> out;
  for (const auto& s : pyalloc::torch_layer::History::instance().segments(static_cast<int>(device))) {
    out.insert(out.end(), {static_cast<int64_t>(s.address), static_cast<int64_t>(s.owner_private_pool_id.first),
                           static_cast<int64_t>(s.owner_private_pool_id.second)});
  }
  return out;
}

// Sharing (Note [Sharing under PyTorch] in ipc.hpp), as shareIpcHandle and
// getIpcDevPtr do it: the handle's bytes travel as a list of ints; an open
// mapping is held here, by number, until ipc_release.
std::tuple<std::vector<int64_t>, int64_t> ipc_share(int64_t address) {
  auto [offset, handle] = pyalloc::torch_layer::share_handle(reinterpret_cast<void*>(static_cast<uintptr_t>(address)));
  std::vector<int64_t> bytes(handle.begin(), handle.end());
  for (int64_t& b : bytes) b &= 0xff;
  return {bytes, static_cast<int64_t>(offset)};
}

// The handle's two forms (Note [Sharing under PyTorch]), byte lists both ways.
std::vector<int64_t> ipc_convert(std::vector<int64_t> bytes, bool to_pytorch) {
  std::string handle;
  for (int64_t b : bytes) handle.push_back(static_cast<char>(b));
  const std::string out = to_pytorch ? pyalloc::torch_layer::to_pytorch_form(handle)
                                     : pyalloc::torch_layer::from_pytorch_form(handle);
  std::vector<int64_t> result;
  for (char c : out) result.push_back(static_cast<unsigned char>(c));
  return result;
}

std::mutex held_mutex;
std::map<int64_t, std::shared_ptr<void>> held;
int64_t held_next = 0;

// (holder number, base address)
std::tuple<int64_t, int64_t> ipc_open(int64_t device, std::vector<int64_t> bytes) {
  std::string handle;
  for (int64_t b : bytes) handle.push_back(static_cast<char>(b));
  std::shared_ptr<void> mapped = pyalloc::torch_layer::Imports::instance().open(static_cast<int>(device), handle);
  const int64_t base = static_cast<int64_t>(reinterpret_cast<uintptr_t>(mapped.get()));
  std::lock_guard<std::mutex> lock(held_mutex);
  held.emplace(++held_next, std::move(mapped));
  return {held_next, base};
}

void ipc_release(int64_t holder) {
  std::shared_ptr<void> mapped;
  {
    std::lock_guard<std::mutex> lock(held_mutex);
    const auto it = held.find(holder);
    TORCH_CHECK(it != held.end(), "ipc_release: no open mapping numbered ", holder);
    mapped = std::move(it->second);
    held.erase(it);
  }
}

// getContextForPointer's answer for `address`: the number of the stand-in
// context recorded with it (0: none).
int64_t context_for_pointer(int64_t address) {
  return number_of(pyalloc::torch_layer::History::instance().context_of(
      reinterpret_cast<const void*>(static_cast<uintptr_t>(address))));
}

void capture_mark(int64_t device, bool begin) {
  auto& pools = pyalloc::torch_layer::Pools::instance();
  begin ? pools.capture_begin(static_cast<int>(device)) : pools.capture_end(static_cast<int>(device));
}

}  // namespace

TORCH_LIBRARY(pyalloc, m) {
  m.def("allocate(int size, int device=0, int stream=0) -> int", &allocate);
  m.def("free(int address, int size, int device=0, int stream=0) -> ()", &free_op);
  m.def("cache_info(int device=0) -> int", &cache_info);
  m.def("device_stats(int device=0) -> Dict(str, int)", &device_stats);
  m.def("record_history(bool enabled, int max_entries=10000, int when=2, bool clear=False) -> ()", &record_history);
  m.def("snapshot_recorded(int device=0) -> (int[], int[], int[])", &snapshot_recorded);
  m.def("pool_begin(int device, int first, int second, int stream) -> ()", &pool_begin);
  m.def("pool_end(int device, int first, int second) -> ()", &pool_end);
  m.def("pool_incref(int device, int first, int second) -> ()", &pool_incref);
  m.def("pool_release(int device, int first, int second) -> ()", &pool_release);
  m.def("pool_use_count(int device, int first, int second) -> int", &pool_use_count);
  m.def("pool_use_on_oom(int device, int first, int second, bool on) -> ()", &pool_use_on_oom);
  m.def("pool_empty(int first, int second) -> int", &pool_empty);
  m.def("pool_live_allocations_are(int device, int first, int second, int[] addresses) -> bool",
        &pool_live_allocations_are);
  m.def("snapshot_pools(int device=0) -> int[]", &snapshot_pools);
  m.def("capture_mark(int device, bool begin) -> ()", &capture_mark);
  m.def("context_for_pointer(int address) -> int", &context_for_pointer);
  m.def("ipc_share(int address) -> (int[], int)", &ipc_share);
  m.def("ipc_open(int device, int[] handle) -> (int, int)", &ipc_open);
  m.def("ipc_release(int holder) -> ()", &ipc_release);
  m.def("ipc_convert(int[] handle, bool to_pytorch) -> int[]", &ipc_convert);
}
