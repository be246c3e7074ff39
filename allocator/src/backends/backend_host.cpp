// backend_host.cpp: real host memory standing in for a device.
//
// Segments are anonymous mappings (committed only when touched), limited to
// `capacity` bytes per device. Virtual memory is emulated the way the CUDA
// VMM API works: a reservation is a PROT_NONE mapping; a physical chunk is a
// memfd; mapping places the memfd at a fixed address inside the reservation
// (MAP_FIXED | MAP_SHARED), so the same bytes can be mapped at a new address
// with their content intact. Unmapping puts PROT_NONE back, keeping the
// reservation. Copies are memcpy; events are countdown events.
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/backend.hpp"
#include "backends/countdown_events.hpp"
#include "ground/config.hpp"

namespace pyalloc {

namespace {

constexpr size_t kHostDefaultCapacity = size_t{4} << 30;
constexpr size_t kHostGranularity = size_t{2} << 20;

class HostBackend final : public Backend {
 public:
  HostBackend(int devices, size_t capacity, int event_delay) : capacity_(capacity) {
    for (int i = 0; i < devices; ++i) devices_.push_back(std::make_unique<DeviceState>(event_delay));
  }

  const char* name() const override { return "host"; }
  int device_count() const override { return static_cast<int>(devices_.size()); }

  MemInfo mem_info(int device) override {
    const size_t used = devices_[device]->used.load();
    return {capacity_ - std::min(used, capacity_), capacity_};
  }

  Status segment_alloc(int device, size_t size, uintptr_t* addr) override {
    if (!charge(device, size)) return out_of_memory(device, size);
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      devices_[device]->used -= size;
      return Status::failure(std::string("host backend: mmap failed: ") + std::strerror(errno));
    }
    *addr = reinterpret_cast<uintptr_t>(p);
    return Status::success();
  }

  void segment_free(int device, uintptr_t addr, size_t size) override {
    munmap(reinterpret_cast<void*>(addr), size);
    devices_[device]->used -= size;
  }

  size_t granularity(int) override { return kHostGranularity; }

  Status reserve(int, size_t size, uintptr_t* va) override {
    void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return Status::failure(std::string("host backend: reserve failed: ") + std::strerror(errno));
    *va = reinterpret_cast<uintptr_t>(p);
    return Status::success();
  }

  void release_reservation(int, uintptr_t va, size_t size) override {
    munmap(reinterpret_cast<void*>(va), size);
  }

  Status phys_create(int device, size_t size, PhysHandle* out) override {
    if (size == 0 || size % kHostGranularity != 0) {
      return Status::failure("host backend: physical chunk size must be a multiple of the granularity");
    }
    if (!charge(device, size)) return out_of_memory(device, size);
    const int fd = memfd_create("pyalloc-chunk", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
      const std::string why = std::strerror(errno);
      if (fd >= 0) close(fd);
      devices_[device]->used -= size;
      return Status::failure("host backend: memfd chunk failed: " + why);
    }
    *out = PhysHandle{static_cast<uint64_t>(fd), size};
    return Status::success();
  }

  void phys_release(int device, PhysHandle handle) override {
    close(static_cast<int>(handle.value));
    devices_[device]->used -= handle.size;
  }

  Status map(int, uintptr_t va, PhysHandle handle) override {
    void* p = mmap(reinterpret_cast<void*>(va), handle.size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                   static_cast<int>(handle.value), 0);
    if (p == MAP_FAILED) return Status::failure(std::string("host backend: map failed: ") + std::strerror(errno));
    return Status::success();
  }

  void unmap(int, uintptr_t va, size_t size) override {
    mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  }

  Status event_record(int device, StreamId, EventHandle* event) override {
    *event = devices_[device]->events.record();
    return Status::success();
  }
  bool event_query(int device, EventHandle event) override { return devices_[device]->events.query(event); }
  void event_synchronize(int device, EventHandle event) override { devices_[device]->events.synchronize(event); }
  void event_release(int device, EventHandle event) override { devices_[device]->events.release(event); }
  Status stream_wait(int, StreamId, EventHandle) override { return Status::success(); }

  // A chunk is a memfd: another process takes the descriptor (take_fd) and
  // maps the same file. A plain segment is a private mapping, which cannot
  // be shared: sharing needs arenas (vmm=on or vmm=shared, the default here).
  Status segment_export(int, uintptr_t, size_t, std::string*) override {
    return Status::failure("host backend: a plain segment is private memory and cannot be shared with another "
                           "process; share blocks of arenas (vmm=on or vmm=shared)");
  }

  Status phys_export(int, PhysHandle handle, std::string* out) override {
    allow_shared_descriptors();
    const ChunkRef ref{static_cast<int32_t>(getpid()), static_cast<int32_t>(handle.value)};
    out->assign(reinterpret_cast<const char*>(&ref), sizeof ref);
    return Status::success();
  }

  Status phys_import(int, const std::string& in, size_t size, PhysHandle* out) override {
    ChunkRef ref{};
    if (in.size() != sizeof ref) return Status::failure("host backend: a shared chunk's description is malformed");
    std::memcpy(&ref, in.data(), sizeof ref);
    int fd = -1;
    if (Status s = take_fd(ref.pid, ref.fd, /*may_reopen=*/true, &fd); !s.ok) return Status::failure("host backend: " + s.message);
    struct stat st {};
    if (fstat(fd, &st) != 0 || st.st_size < 0 || static_cast<uint64_t>(st.st_size) < size) {
      close(fd);  // mapping past the file's end would fault on first touch
      return Status::failure("host backend: a shared chunk holds " + std::to_string(st.st_size) + " bytes, fewer than the " +
                             std::to_string(size) + " the handle names");
    }
    *out = PhysHandle{static_cast<uint64_t>(fd), size};
    return Status::success();
  }

  void phys_close(int, PhysHandle handle) override { close(static_cast<int>(handle.value)); }

  Status copy_to_host_async(int, void* dst, uintptr_t src, size_t size, StreamId) override {
    std::memcpy(dst, reinterpret_cast<const void*>(src), size);
    return Status::success();
  }
  Status copy_to_device_async(int, uintptr_t dst, const void* src, size_t size, StreamId) override {
    std::memcpy(reinterpret_cast<void*>(dst), src, size);
    return Status::success();
  }
  void synchronize_device(int) override {}  // copies and events here are synchronous
  Status copy_device_async(int, uintptr_t dst, uintptr_t src, size_t size, StreamId) override {
    std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), size);
    return Status::success();
  }

 private:
  struct ChunkRef {  // what phys_export writes: the exporter and its memfd
    int32_t pid;
    int32_t fd;
  };

  struct DeviceState {
    explicit DeviceState(int delay) : events(delay) {}
    std::atomic<size_t> used{0};
    CountdownEvents events;
  };

  bool charge(int device, size_t size) {
    std::atomic<size_t>& used = devices_[device]->used;
    size_t current = used.load();
    do {
      if (size > capacity_ || current > capacity_ - size) return false;
    } while (!used.compare_exchange_weak(current, current + size));
    return true;
  }

  Status out_of_memory(int device, size_t size) const {
    return Status::failure("host backend: device " + std::to_string(device) + " is out of memory (" +
                           std::to_string(size) + " bytes requested, capacity " + std::to_string(capacity_) + ")");
  }

  const size_t capacity_;
  std::vector<std::unique_ptr<DeviceState>> devices_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(const Config& config, std::string* error) {
  const size_t capacity = config.capacity != 0 ? config.capacity : kHostDefaultCapacity;
  return std::make_unique<HostBackend>(config.devices, capacity, config.event_delay);
}

}  // namespace pyalloc
