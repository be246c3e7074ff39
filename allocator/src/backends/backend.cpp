// backend.cpp: what every backend shares: the refusals of a backend that
// cannot share memory, and taking another process's file descriptor.
#include "backends/backend.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cassert>
#include <cerrno>
#include <cstring>

namespace pyalloc {

namespace {

Status cannot_share(const Backend& b) {
  return Status::failure(std::string("the ") + b.name() + " backend cannot share memory with other processes");
}

}  // namespace

Status Backend::map_range(int device, uintptr_t va, const PhysHandle* handles, size_t n) {
  uintptr_t at = va;
  for (size_t i = 0; i < n; ++i) {
    Status s = map(device, at, handles[i]);
    if (!s.ok) {
      unmap_range(device, va, handles, i);  // all or none: each mapping undone whole
      return s;
    }
    at += handles[i].size;
  }
  return Status::success();
}

void Backend::unmap_range(int device, uintptr_t va, const PhysHandle* handles, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    unmap(device, va, handles[i].size);
    va += handles[i].size;
  }
}

Status Backend::segment_export(int, uintptr_t, size_t, std::string*) { return cannot_share(*this); }
Status Backend::phys_export(int, PhysHandle, std::string*) { return cannot_share(*this); }
Status Backend::segment_import(int, const std::string&, uintptr_t*, size_t*) { return cannot_share(*this); }
Status Backend::phys_import(int, const std::string&, size_t, PhysHandle*) { return cannot_share(*this); }

void allow_shared_descriptors() {
  // An exported arena block keeps one descriptor per granule open in the
  // exporter, and the importer takes one per granule too: a 1 GiB tensor in
  // 2 MiB granules is 512. The soft limit (often 1,024) is raised to the hard
  // one, once, as torch.multiprocessing's users are told to do by hand.
  static const bool raised = [] {
    rlimit limit{};
    if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return false;
    limit.rlim_cur = limit.rlim_max;
    return setrlimit(RLIMIT_NOFILE, &limit) == 0;
  }();
  (void)raised;
}

// A copy of descriptor `fd` of process `pid` in this process: pidfd_getfd
// (Linux 5.6; it needs the right to ptrace `pid`: under Yama's
// ptrace_scope=1 only an ancestor has it), else, where `may_reopen` (a
// memfd, which reopens as the same file), /proc/pid/fd/N reopened (needs
// only the right to read the process's /proc entry).
Status take_fd(int pid, int fd, bool may_reopen, int* out) {
  allow_shared_descriptors();
  std::string why;
#if defined(SYS_pidfd_open) && defined(SYS_pidfd_getfd)
  const long pidfd = syscall(SYS_pidfd_open, pid, 0);
  if (pidfd >= 0) {
    const long copy = syscall(SYS_pidfd_getfd, static_cast<int>(pidfd), fd, 0);
    const int err = errno;
    close(static_cast<int>(pidfd));
    if (copy >= 0) {
      *out = static_cast<int>(copy);
      return Status::success();
    }
    why = std::string("pidfd_getfd: ") + std::strerror(err) +
          (err == EPERM ? " (this process may not ptrace the exporter: see /proc/sys/kernel/yama/ptrace_scope)" : "");
  } else {
    why = std::string("pidfd_open: ") + std::strerror(errno);
  }
#endif
  if (!may_reopen) {
    return Status::failure("cannot take descriptor " + std::to_string(fd) + " of process " + std::to_string(pid) +
                           " (" + why + "): is the exporting process alive, and of this user?");
  }
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int reopened = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (reopened >= 0) {
    *out = reopened;
    return Status::success();
  }
  return Status::failure("cannot take descriptor " + std::to_string(fd) + " of process " + std::to_string(pid) +
                         " (" + (why.empty() ? "" : why + "; ") + "open " + path + ": " + std::strerror(errno) +
                         "): is the exporting process alive, and of this user?");
}

}  // namespace pyalloc
