// metered.hpp: what the allocator spends in its backend, per device.
//
// Note [Backend time]
// Where the slow path's time goes, in figures a user can read: the backend
// calls that change device memory, and the waits for queued work before
// memory moves, per device. A MeteredBackend sits between every device
// allocator and the real backend (abi/runtime.cpp puts it there) and counts:
//   memory  calls that create, map, unmap or release device memory
//           (segment_alloc/free, phys_create/release, map, map_range,
//           unmap, unmap_range, reserve/release_reservation): their number
//           and wall time, a range mapped or unmapped in one call counting
//           once. On cuda, unmapping and freeing a segment first wait for the
//           device (cuCtxSynchronize): that wait is inside the call's time;
//   waits   event_synchronize, the slow path waiting for one stream's queued
//           work before granules move (stitching, reuse): number and time.
// memory_stats() reports them as backend_memory_calls, backend_memory_ns,
// backend_waits and backend_wait_ns; reset_accumulated_memory_stats() zeroes
// them. Only slow-path calls are timed (two clock reads each, against a
// driver call's microseconds); event_query, which the fast path may make for
// a pending free, is forwarded uncounted. The sim backend's calls are counted
// but not timed: its memory is not there, nor is its time
// (docs/benchmarks/2026-11-27-backend-calls-cpu.md has what the clock cost).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "backends/backend.hpp"

namespace pyalloc {

struct BackendMeter {
  std::atomic<int64_t> memory_calls{0};
  std::atomic<int64_t> memory_ns{0};
  std::atomic<int64_t> waits{0};
  std::atomic<int64_t> wait_ns{0};

  void reset() {
    memory_calls.store(0, std::memory_order_relaxed);
    memory_ns.store(0, std::memory_order_relaxed);
    waits.store(0, std::memory_order_relaxed);
    wait_ns.store(0, std::memory_order_relaxed);
  }
};

class MeteredBackend final : public Backend {
 public:
  // Takes `inner` over; meters its first `devices` devices, timing the calls
  // when `timed`.
  MeteredBackend(std::unique_ptr<Backend> inner, int devices, bool timed)
      : inner_(std::move(inner)), meters_(static_cast<size_t>(devices)), timed_(timed) {}

  BackendMeter& meter(int device) { return meters_[static_cast<size_t>(device)]; }

  const char* name() const override { return inner_->name(); }
  int device_count() const override { return inner_->device_count(); }
  MemInfo mem_info(int device) override { return inner_->mem_info(device); }

  Status segment_alloc(int device, size_t size, uintptr_t* addr) override {
    return timed_memory(device, [&] { return inner_->segment_alloc(device, size, addr); });
  }
  void segment_free(int device, uintptr_t addr, size_t size) override {
    timed_memory(device, [&] { inner_->segment_free(device, addr, size); });
  }

  bool vmm_supported(int device) override { return inner_->vmm_supported(device); }
  size_t granularity(int device) override { return inner_->granularity(device); }
  Status reserve(int device, size_t size, uintptr_t* va) override {
    return timed_memory(device, [&] { return inner_->reserve(device, size, va); });
  }
  void release_reservation(int device, uintptr_t va, size_t size) override {
    timed_memory(device, [&] { inner_->release_reservation(device, va, size); });
  }
  Status phys_create(int device, size_t size, PhysHandle* out) override {
    return timed_memory(device, [&] { return inner_->phys_create(device, size, out); });
  }
  void phys_release(int device, PhysHandle handle) override {
    timed_memory(device, [&] { inner_->phys_release(device, handle); });
  }
  Status map(int device, uintptr_t va, PhysHandle handle) override {
    return timed_memory(device, [&] { return inner_->map(device, va, handle); });
  }
  Status map_range(int device, uintptr_t va, const PhysHandle* handles, size_t n) override {
    return timed_memory(device, [&] { return inner_->map_range(device, va, handles, n); });
  }
  void unmap(int device, uintptr_t va, size_t size) override {
    timed_memory(device, [&] { inner_->unmap(device, va, size); });
  }
  void unmap_range(int device, uintptr_t va, const PhysHandle* handles, size_t n) override {
    timed_memory(device, [&] { inner_->unmap_range(device, va, handles, n); });
  }

  Status event_record(int device, StreamId stream, EventHandle* event) override {
    return inner_->event_record(device, stream, event);
  }
  bool event_query(int device, EventHandle event) override { return inner_->event_query(device, event); }
  void event_synchronize(int device, EventHandle event) override {
    BackendMeter& m = meter(device);
    counted(m.waits, m.wait_ns, [&] { inner_->event_synchronize(device, event); });
  }
  void event_release(int device, EventHandle event) override { inner_->event_release(device, event); }
  Status stream_wait(int device, StreamId stream, EventHandle event) override {
    return inner_->stream_wait(device, stream, event);
  }

  Status copy_to_host_async(int device, void* dst, uintptr_t src, size_t size, StreamId stream) override {
    return inner_->copy_to_host_async(device, dst, src, size, stream);
  }
  Status copy_to_device_async(int device, uintptr_t dst, const void* src, size_t size, StreamId stream) override {
    return inner_->copy_to_device_async(device, dst, src, size, stream);
  }
  void synchronize_device(int device) override {
    BackendMeter& m = meter(device);
    counted(m.waits, m.wait_ns, [&] { inner_->synchronize_device(device); });
  }
  Status copy_device_async(int device, uintptr_t dst, uintptr_t src, size_t size, StreamId stream) override {
    return inner_->copy_device_async(device, dst, src, size, stream);
  }

  Status segment_export(int device, uintptr_t addr, size_t size, std::string* out) override {
    return inner_->segment_export(device, addr, size, out);
  }
  Status phys_export(int device, PhysHandle handle, std::string* out) override {
    return inner_->phys_export(device, handle, out);
  }
  Status segment_import(int device, const std::string& in, uintptr_t* addr, size_t* size) override {
    return inner_->segment_import(device, in, addr, size);
  }
  void segment_close(int device, uintptr_t addr, size_t size) override { inner_->segment_close(device, addr, size); }
  Status phys_import(int device, const std::string& in, size_t size, PhysHandle* out) override {
    return inner_->phys_import(device, in, size, out);
  }
  void phys_close(int device, PhysHandle handle) override { inner_->phys_close(device, handle); }

 private:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // A memory call: counted, and timed (Note [Backend time]).
  template <typename Call>
  auto timed_memory(int device, Call&& call) -> decltype(call()) {
    BackendMeter& m = meter(device);
    return counted(m.memory_calls, m.memory_ns, call);
  }

  // Counts `call` in `calls`, and adds its time to `ns` when timed_.
  template <typename Call>
  auto counted(std::atomic<int64_t>& calls, std::atomic<int64_t>& ns, Call&& call) -> decltype(call()) {
    calls.fetch_add(1, std::memory_order_relaxed);
    if (!timed_) return call();
    struct Time {  // added on every way out, void calls included
      std::atomic<int64_t>& ns;
      int64_t start;
      ~Time() { ns.fetch_add(now_ns() - start, std::memory_order_relaxed); }
    } time{ns, now_ns()};
    return call();
  }

  std::unique_ptr<Backend> inner_;
  std::vector<BackendMeter> meters_;
  const bool timed_;
};

}  // namespace pyalloc
