// registry.cpp: this process's record for gpumemd (pyalloc/registry.h).
//
// Note [Registry publisher]
// A background thread owns the record: it refreshes the counters a few times
// a second (so the heartbeat moves even when the process allocates nothing),
// and serves the mailbox (trim requests) between refreshes. The allocator's
// slow path only pokes it (registry_poke), so the fast path never touches the
// registry and no allocator lock is held while the record is written.
//
// The record is a 0600 file in /dev/shm named after our uid and pid. It
// appears under that name only when complete: it is created as <name>.new
// (a name readers ignore), and the first publish writes the counters, then
// the magic, then renames it into place; so a reader that finds the record
// can read it. It is unlinked at exit; a process killed with SIGKILL leaves it behind, and
// gpumemd removes records whose process is gone. After fork() the child must
// not write its parent's record: the atfork handler drops the mapping, and
// the child publishes a record of its own the next time it configures or
// reaches the slow path.
//
// Note [Registry folder unusable]: a missing, read-only or full registry folder
// must cost the process its record, never its allocations. The record's pages
// are reserved with posix_fallocate before they are mapped: on a full tmpfs a
// file made with ftruncate alone is sparse, and the first store into the mapping
// raises SIGBUS, killing the process. The reason is written to stderr once per
// process (gpumemd says the same from its side); the next configure or slow
// path tries again, so a folder that is fixed later is used.
#include "node/registry.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <new>
#include <thread>

namespace pyalloc {

namespace {

constexpr auto kRefreshPeriod = std::chrono::milliseconds(250);

// Once per process, why the record could not be published (Note [Registry folder unusable]).
void say_unpublished(const char* dir, int err) {
  static std::atomic<bool> said{false};
  if (said.exchange(true)) return;
  std::fprintf(stderr,
               "pyalloc: no registry record in %s: %s; allocating goes on, but gpumemd cannot see this "
               "process (set PYALLOC_REGISTRY_DIR to a writable tmpfs, or registry=0 to run without one)\n",
               dir, std::strerror(err));
}

uint64_t unix_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

// Field 22 of /proc/self/stat: start time in clock ticks since boot.
uint64_t start_time_ticks() {
  FILE* f = std::fopen("/proc/self/stat", "r");
  if (f == nullptr) return 0;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command may contain spaces
  if (p == nullptr) return 0;
  unsigned long long value = 0;
  // After ")": state is field 3; start time is field 22, i.e. the 20th after.
  int field = 2;
  for (const char* q = p + 1; *q != '\0'; ++q) {
    if (*q == ' ') {
      ++field;
      if (field == 22) {
        value = std::strtoull(q + 1, nullptr, 10);
        break;
      }
    }
  }
  return value;
}

void read_command(char* out, size_t len) {
  FILE* f = std::fopen("/proc/self/cmdline", "r");
  size_t n = 0;
  if (f != nullptr) {
    n = std::fread(out, 1, len - 1, f);
    std::fclose(f);
  }
  // argv is NUL-separated, and an argument may hold newlines (python -c):
  // readers want one printable line.
  for (size_t i = 0; i < n; ++i) {
    if (static_cast<unsigned char>(out[i]) < 0x20 || out[i] == 0x7f) out[i] = ' ';
  }
  // Cut at len - 1 bytes, a multi-byte UTF-8 character may be split: drop
  // an incomplete last character so readers can decode the line.
  size_t start = n;
  while (start > 0 && (static_cast<unsigned char>(out[start - 1]) & 0xC0) == 0x80) --start;
  if (start > 0) {
    const unsigned char lead = static_cast<unsigned char>(out[start - 1]);
    const size_t want = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
    if (n - (start - 1) < want) n = start - 1;
  }
  while (n > 0 && out[n - 1] == ' ') --n;
  out[n] = '\0';
}

class Publisher {
 public:
  // Starts publishing for this process (idempotent; restarts after fork).
  void start() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (record_ != nullptr && owner_pid_ == getpid()) return;
    if (!open_record()) return;
    dirty_.store(true, std::memory_order_relaxed);  // publish at once: the record appears complete
    if (!thread_started_for_pid(getpid())) {
      std::thread([this] { run(); }).detach();
      thread_pid_ = getpid();
    }
    wake_.notify_one();
  }

  void stop() {
    std::lock_guard<std::mutex> lock(mutex_);
    close_record();
  }

  void poke() {
    if (enabled_.load(std::memory_order_relaxed) && owner_pid_ != getpid()) start();  // a forked child
    dirty_.store(true, std::memory_order_relaxed);
    wake_.notify_one();
  }

  void set_enabled(bool on) { enabled_.store(on, std::memory_order_relaxed); }

  void set_opt_in(bool on) { opt_in_.store(on, std::memory_order_relaxed); }

  void set_source(RegistrySource* source) { source_.store(source, std::memory_order_release); }

  // atfork child: the record and the thread belong to the parent.
  void forget_after_fork() {
    record_ = nullptr;  // the parent's mapping stays mapped but unused
    owner_pid_ = 0;
    // Held or waited on by the parent's publisher thread, which the child
    // does not have: start both afresh.
    new (&mutex_) std::mutex;
    new (&wake_) std::condition_variable;
  }

  std::string path() {
    std::lock_guard<std::mutex> lock(mutex_);
    return record_ != nullptr ? path_ : std::string();
  }

  void unlink_at_exit() {
    if (record_ != nullptr && owner_pid_ == getpid()) ::unlink(path_.c_str());
  }

 private:
  bool thread_started_for_pid(pid_t pid) const { return thread_pid_ == pid; }

  bool open_record() {
    const pid_t pid = getpid();
    // PYALLOC_REGISTRY_DIR moves the records (tests, containers without a
    // shared /dev/shm); gpumemd reads the same variable.
    const char* dir = std::getenv("PYALLOC_REGISTRY_DIR");
    if (dir == nullptr || dir[0] == '\0') dir = PYALLOC_REGISTRY_DIR;
    char name[4096];
    std::snprintf(name, sizeof name, "%s/%s%u.%d", dir, PYALLOC_REGISTRY_PREFIX,
                  static_cast<unsigned>(getuid()), static_cast<int>(pid));
    const std::string unpublished = std::string(name) + ".new";
    ::unlink(name);  // stale records of an earlier process with our pid
    ::unlink(unpublished.c_str());
    const int fd = ::open(unpublished.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {  // no such folder, not writable, read-only: run without a record
      say_unpublished(dir, errno);
      return false;
    }
    const int err = posix_fallocate(fd, 0, sizeof(pyalloc_registry_record));  // not sparse: no SIGBUS
    if (err != 0) {
      ::close(fd);
      ::unlink(unpublished.c_str());
      say_unpublished(dir, err);
      return false;
    }
    void* p = mmap(nullptr, sizeof(pyalloc_registry_record), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) {
      ::unlink(unpublished.c_str());
      return false;
    }
    auto* r = static_cast<pyalloc_registry_record*>(p);
    std::memset(r, 0, sizeof *r);
    r->version = PYALLOC_REGISTRY_VERSION;
    r->record_size = sizeof *r;
    r->pid = static_cast<int32_t>(pid);
    r->uid = static_cast<uint32_t>(getuid());
    r->start_time_ticks = start_time_ticks();
    read_command(r->command, sizeof r->command);
    // No magic yet: publish() writes it, and renames the file into place.
    record_ = r;
    path_ = unpublished;
    final_path_ = name;
    owner_pid_ = pid;
    static bool registered = false;
    if (!registered) {
      registered = true;
      std::atexit([] { registry_unlink_at_exit(); });
    }
    return true;
  }

  void close_record() {
    if (record_ == nullptr) return;
    if (owner_pid_ == getpid()) ::unlink(path_.c_str());
    munmap(record_, sizeof *record_);
    record_ = nullptr;
  }

  void run() {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait_for(lock, kRefreshPeriod, [this] { return dirty_.load(std::memory_order_relaxed); });
        dirty_.store(false, std::memory_order_relaxed);
        if (thread_pid_ != getpid()) return;  // we are a stale thread image (cannot happen after fork, kept safe)
        if (record_ == nullptr) continue;
      }
      serve_mailbox();
      publish();
    }
  }

  // Copies the counters of every device. The source takes each device lock
  // briefly; the publisher's mutex is not held meanwhile, so it cannot
  // deadlock with the allocator.
  void publish() {
    RegistrySource* source = source_.load(std::memory_order_acquire);
    if (source == nullptr) return;
    pyalloc_registry_device devices[PYALLOC_REGISTRY_MAX_DEVICES] = {};
    uint64_t allocations[PYALLOC_REGISTRY_MAX_DEVICES] = {};
    const size_t n = std::min<size_t>(source->read_devices(devices, allocations, PYALLOC_REGISTRY_MAX_DEVICES),
                                      PYALLOC_REGISTRY_MAX_DEVICES);
    const uint64_t now = unix_ns();
    for (size_t i = 0; i < n; ++i) {
      if (allocations[i] != last_allocations_[i]) {
        last_allocations_[i] = allocations[i];
        last_alloc_ns_[i] = now;
      }
      devices[i].last_alloc_unix_ns = last_alloc_ns_[i];
    }
    std::lock_guard<std::mutex> lock(mutex_);
    pyalloc_registry_record* r = record_;
    if (r == nullptr) return;
    const uint64_t seq = r->seq;
    __atomic_store_n(&r->seq, seq + 1, __ATOMIC_RELAXED);  // odd: writing
    __atomic_thread_fence(__ATOMIC_RELEASE);
    std::snprintf(r->backend, sizeof r->backend, "%s", source->backend_name());
    r->heartbeat_unix_ns = now;
    r->num_devices = static_cast<uint32_t>(n);
    r->flags = opt_in_.load(std::memory_order_relaxed) ? PYALLOC_REGISTRY_PRESSURE_OPT_IN : 0;
    std::memcpy(r->devices, devices, sizeof devices);
    __atomic_store_n(&r->seq, seq + 2, __ATOMIC_RELEASE);  // even: stable
    if (path_ != final_path_) {  // the first publish: the record is complete
      __atomic_store_n(&r->magic, PYALLOC_REGISTRY_MAGIC, __ATOMIC_RELEASE);
      if (::rename(path_.c_str(), final_path_.c_str()) == 0) path_ = final_path_;
    }
  }

  void serve_mailbox() {
    uint64_t request;
    uint32_t kind;
    int32_t device;
    uint64_t bytes;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pyalloc_registry_record* r = record_;
      if (r == nullptr) return;
      request = __atomic_load_n(&r->request_seq, __ATOMIC_ACQUIRE);
      if (request == r->response_seq) return;
      kind = r->request_kind;
      device = r->request_device;
      bytes = r->request_bytes;
    }
    size_t released = 0;
    RegistrySource* source = source_.load(std::memory_order_acquire);
    if (kind == PYALLOC_REQUEST_TRIM && source != nullptr && device >= -1) released = source->trim(device, bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    pyalloc_registry_record* r = record_;
    if (r == nullptr) return;
    r->response_bytes = released;
    r->requests_served += 1;
    __atomic_store_n(&r->response_seq, request, __ATOMIC_RELEASE);
    dirty_.store(true, std::memory_order_relaxed);  // publish the new counters at once
  }

  std::mutex mutex_;  // guards record_, path_, final_path_, owner_pid_
  std::condition_variable wake_;
  std::atomic<bool> dirty_{false};
  std::atomic<bool> opt_in_{false};
  std::atomic<bool> enabled_{false};
  std::atomic<RegistrySource*> source_{nullptr};
  pyalloc_registry_record* record_ = nullptr;
  std::string path_;        // where the record is now: <name>.new until the first publish
  std::string final_path_;  // <name>
  pid_t owner_pid_ = 0;
  pid_t thread_pid_ = 0;
  uint64_t last_allocations_[PYALLOC_REGISTRY_MAX_DEVICES] = {};
  uint64_t last_alloc_ns_[PYALLOC_REGISTRY_MAX_DEVICES] = {};
};

Publisher& publisher() {
  static Publisher* p = [] {
    auto* created = new Publisher;  // leaked: see Note [Shutdown]
    pthread_atfork(nullptr, nullptr, [] { registry_after_fork_in_child(); });
    return created;
  }();
  return *p;
}

}  // namespace

void registry_apply(const Config& config, RegistrySource* source) {
  publisher().set_source(source);
  publisher().set_opt_in(config.pressure_opt_in);
  publisher().set_enabled(config.registry);
  if (config.registry) {
    publisher().start();
  } else {
    publisher().stop();
  }
}

void registry_poke() { publisher().poke(); }

std::string registry_path() { return publisher().path(); }

void registry_after_fork_in_child() { publisher().forget_after_fork(); }

void registry_unlink_at_exit() { publisher().unlink_at_exit(); }

}  // namespace pyalloc
