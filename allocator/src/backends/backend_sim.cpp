// backend_sim.cpp: fake addresses, nothing touched.
//
// For replaying an 80 GiB device's trace on a small machine: segment_alloc
// hands out addresses from a per-device range that no real memory backs, and
// only the capacity is accounted. Addresses are never reused, so a bug that
// touched them would fault at once. Events are countdown events; copies are
// refused, since there are no bytes to copy.
#include <atomic>
#include <memory>
#include <vector>

#include "backends/backend.hpp"
#include "backends/countdown_events.hpp"
#include "ground/config.hpp"

namespace pyalloc {

namespace {

constexpr size_t kSimDefaultCapacity = size_t{80} << 30;
constexpr size_t kSimGranularity = size_t{2} << 20;
constexpr unsigned kSimRangeBits = 52;  // 4 PiB of fake address space per device

class SimBackend final : public Backend {
 public:
  SimBackend(int devices, size_t capacity, int event_delay) : capacity_(capacity) {
    for (int i = 0; i < devices; ++i) {
      devices_.push_back(std::make_unique<DeviceState>(event_delay, (uintptr_t{1} + i) << kSimRangeBits));
    }
  }

  const char* name() const override { return "sim"; }
  int device_count() const override { return static_cast<int>(devices_.size()); }

  MemInfo mem_info(int device) override {
    const size_t used = devices_[device]->used;
    return {capacity_ - std::min(used, capacity_), capacity_};
  }

  Status segment_alloc(int device, size_t size, uintptr_t* addr) override {
    DeviceState& d = *devices_[device];
    if (size > capacity_ || d.used > capacity_ - size) {
      return Status::failure("sim backend: device " + std::to_string(device) + " is out of memory");
    }
    d.used += size;
    *addr = bump(d, size);
    return Status::success();
  }

  void segment_free(int device, uintptr_t, size_t size) override { devices_[device]->used -= size; }

  size_t granularity(int) override { return kSimGranularity; }

  Status reserve(int device, size_t size, uintptr_t* va) override {
    *va = bump(*devices_[device], size);
    return Status::success();
  }
  void release_reservation(int, uintptr_t, size_t) override {}

  Status phys_create(int device, size_t size, PhysHandle* out) override {
    DeviceState& d = *devices_[device];
    if (size == 0 || size % kSimGranularity != 0) {
      return Status::failure("sim backend: physical chunk size must be a multiple of the granularity");
    }
    if (size > capacity_ || d.used > capacity_ - size) {
      return Status::failure("sim backend: device " + std::to_string(device) + " is out of memory");
    }
    d.used += size;
    *out = PhysHandle{++d.next_chunk, size};
    return Status::success();
  }
  void phys_release(int device, PhysHandle handle) override { devices_[device]->used -= handle.size; }
  Status map(int, uintptr_t, PhysHandle) override { return Status::success(); }
  void unmap(int, uintptr_t, size_t) override {}

  Status event_record(int device, StreamId, EventHandle* event) override {
    *event = devices_[device]->events.record();
    return Status::success();
  }
  bool event_query(int device, EventHandle event) override { return devices_[device]->events.query(event); }
  void event_synchronize(int device, EventHandle event) override { devices_[device]->events.synchronize(event); }
  void event_release(int device, EventHandle event) override { devices_[device]->events.release(event); }
  Status stream_wait(int, StreamId, EventHandle) override { return Status::success(); }

  Status copy_to_host_async(int, void*, uintptr_t, size_t, StreamId) override {
    return Status::failure("sim backend: no bytes to copy (addresses are fake)");
  }
  Status copy_to_device_async(int, uintptr_t, const void*, size_t, StreamId) override {
    return Status::failure("sim backend: no bytes to copy (addresses are fake)");
  }
  void synchronize_device(int) override {}
  // Nothing is behind the addresses: a move's copy is its bookkeeping alone
  // (Note [Moving slivers]), as a map is.
  Status copy_device_async(int, uintptr_t, uintptr_t, size_t, StreamId) override { return Status::success(); }

 private:
  struct DeviceState {
    DeviceState(int delay, uintptr_t base) : events(delay), next_addr(base) {}
    CountdownEvents events;
    size_t used = 0;           // guarded by the device lock
    uintptr_t next_addr;       // bump pointer, 2 MiB aligned
    uint64_t next_chunk = 0;
  };

  static uintptr_t bump(DeviceState& d, size_t size) {
    const uintptr_t addr = d.next_addr;
    d.next_addr += (size + kSimGranularity - 1) / kSimGranularity * kSimGranularity;
    return addr;
  }

  const size_t capacity_;
  std::vector<std::unique_ptr<DeviceState>> devices_;
};

}  // namespace

std::unique_ptr<Backend> make_sim_backend(const Config& config, std::string* error) {
  const size_t capacity = config.capacity != 0 ? config.capacity : kSimDefaultCapacity;
  return std::make_unique<SimBackend>(config.devices, capacity, config.event_delay);
}

}  // namespace pyalloc
