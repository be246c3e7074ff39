// gpumemd_client.cpp: see gpumemd_client.hpp. The protocol is gpumemd's
// (pyalloc/gpumemd/pressure.py): one JSON line each way,
//   request  {"device": 0, "bytes": 1073741824}
//   answer   {"ok": true, "freed_bytes": N, "asked": [...]}
// gpumemd identifies us by SO_PEERCRED and our registry record.
#include "node/gpumemd_client.hpp"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace pyalloc {

namespace {

// gpumemd gives itself 5 s per request; wait a little longer than that.
constexpr int kTimeoutSeconds = 6;
constexpr size_t kMaxAnswer = 4096;

// Whether `path` is a socket in a folder that only `owner` (or root) can
// change, and is owned by one of them: another user must not be able to put a
// daemon of their own where we look, and answer in its place.
bool trusted_socket(const std::string& path, uid_t owner) {
  struct stat sock {};
  struct stat dir {};
  const std::string folder = path.substr(0, path.rfind('/'));
  if (lstat(path.c_str(), &sock) != 0 || !S_ISSOCK(sock.st_mode)) return false;
  if (lstat(folder.empty() ? "/" : folder.c_str(), &dir) != 0 || !S_ISDIR(dir.st_mode)) return false;
  const bool folder_ours = dir.st_uid == owner || dir.st_uid == 0;
  const bool folder_closed = (dir.st_mode & (S_IWGRP | S_IWOTH)) == 0;
  return folder_ours && folder_closed && (sock.st_uid == owner || sock.st_uid == 0);
}

// Where gpumemd listens, Note [Record identity] in pyalloc/gpumemd/registry.py:
// the node's root daemon (/run/gpumemd.sock, root's), else this user's own
// daemon ($XDG_RUNTIME_DIR, then /tmp/gpumemd-<uid>, each only if that folder
// is this user's and closed to others); "" when none can be trusted.
std::string default_socket() {
  const uid_t me = getuid();
  const std::string node = "/run/gpumemd.sock";
  if (trusted_socket(node, 0)) return node;
  const char* runtime_dir = std::getenv("XDG_RUNTIME_DIR");
  if (runtime_dir != nullptr && runtime_dir[0] == '/') {
    const std::string mine = std::string(runtime_dir) + "/gpumemd.sock";
    if (trusted_socket(mine, me)) return mine;
  }
  const std::string tmp = "/tmp/gpumemd-" + std::to_string(me) + "/gpumemd.sock";
  return trusted_socket(tmp, me) ? tmp : std::string();
}

// The value of "freed_bytes" in a one-line JSON answer; false if absent.
bool parse_freed(const std::string& answer, size_t* freed) {
  if (answer.find("\"ok\": true") == std::string::npos && answer.find("\"ok\":true") == std::string::npos) {
    return false;
  }
  const size_t key = answer.find("\"freed_bytes\"");
  if (key == std::string::npos) return false;
  const size_t colon = answer.find(':', key);
  if (colon == std::string::npos) return false;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(answer.c_str() + colon + 1, &end, 10);
  if (end == answer.c_str() + colon + 1) return false;
  *freed = static_cast<size_t>(v);
  return true;
}

}  // namespace

bool ask_gpumemd(const std::string& socket_path, int device, size_t bytes, size_t* freed_bytes) {
  *freed_bytes = 0;
  const std::string path = socket_path == "auto" ? default_socket() : socket_path;
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof addr.sun_path) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);

  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const timeval timeout{kTimeoutSeconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  bool answered = false;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) {
    char request[96];
    const int n = std::snprintf(request, sizeof request, "{\"device\": %d, \"bytes\": %zu}\n", device, bytes);
    if (n > 0 && send(fd, request, static_cast<size_t>(n), MSG_NOSIGNAL) == n) {
      std::string answer;
      char buf[512];
      while (answer.size() < kMaxAnswer && answer.find('\n') == std::string::npos) {
        const ssize_t got = recv(fd, buf, sizeof buf, 0);
        if (got <= 0) break;  // closed, timed out, or failed
        answer.append(buf, static_cast<size_t>(got));
      }
      answered = parse_freed(answer, freed_bytes);
    }
  }
  close(fd);
  if (!answered) *freed_bytes = 0;
  return answered;
}

}  // namespace pyalloc
