// ipc.cpp: Note [Sharing under PyTorch] (ipc.hpp).
#include "ipc.hpp"

#include <pyalloc/pyalloc.h>

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace pyalloc::torch_layer {

namespace {

// PyTorch's shareable handle: a version byte, then the kind. pyalloc writes
// 2 and reads every version whose 'c' payload it knows (ipc.hpp).
constexpr char kPytorchVersion = 2;
constexpr char kPytorchNewestVersion = 3;
constexpr char kPytorchCudaMalloc = 'c';
constexpr char kPytorchExpandable = 'e';
constexpr size_t kIpcHandleBytes = 64;  // cudaIpcMemHandle_t
// pyalloc's handle (pyalloc.h): the 40-byte header, then length and bytes.
constexpr size_t kHeader = 40;
constexpr char kMagic[12] = "pyalloc-ipc";

bool is_pyalloc_form(const std::string& h) {
  return h.size() >= kHeader && std::memcmp(h.data(), kMagic, sizeof kMagic) == 0;
}

// A PyTorch handle of kind `kind`, of a version pyalloc reads.
bool is_pytorch_form(const std::string& h, char kind) {
  return h.size() >= 2 && h[0] >= 1 && h[0] <= kPytorchNewestVersion && h[1] == kind;
}

}  // namespace

std::string to_pytorch_form(const std::string& handle) {
  // A plain segment with one part of cuIpcGetMemHandle's 64 bytes.
  if (!is_pyalloc_form(handle) || handle[13] != 'S' || handle.size() != kHeader + 4 + kIpcHandleBytes) return handle;
  std::string out{kPytorchVersion, kPytorchCudaMalloc};
  out.append(handle, kHeader + 4, kIpcHandleBytes);
  return out;
}

std::string from_pytorch_form(const std::string& handle) {
  if (is_pyalloc_form(handle)) return handle;
  if (handle.size() == 2 + kIpcHandleBytes && is_pytorch_form(handle, kPytorchCudaMalloc)) {
    std::string out(kHeader, '\0');
    std::memcpy(out.data(), kMagic, sizeof kMagic);
    out[12] = 1;    // version
    out[13] = 'S';  // a plain segment, of a size the handle does not say
    const uint32_t parts = 1;
    const uint32_t length = kIpcHandleBytes;
    std::memcpy(out.data() + 16, &parts, sizeof parts);
    out.append(reinterpret_cast<const char*>(&length), sizeof length);
    out.append(handle, 2, kIpcHandleBytes);
    return out;
  }
  TORCH_CHECK(!is_pytorch_form(handle, kPytorchExpandable),
              "pyalloc: this CUDA tensor was shared by a process whose allocator is PyTorch's own with "
              "expandable_segments, which pyalloc cannot open; install pyalloc in that process too, or share "
              "from plain segments");
  TORCH_CHECK(false, "pyalloc: cannot open a CUDA tensor shared by another process: its handle (", handle.size(),
              " bytes) is neither pyalloc's nor PyTorch's");
}

std::pair<size_t, std::string> share_handle(void* ptr) {
  std::vector<char> buf(4096);
  size_t length = 0;
  size_t offset = 0;
  for (;;) {
    const int status = pyalloc_ipc_export(ptr, buf.data(), buf.size(), &length, &offset);
    if (status != PYALLOC_OK) {
      const char* last = pyalloc_last_error();
      TORCH_CHECK(false, "pyalloc: cannot share this CUDA tensor with another process: ",
                  last != nullptr ? last : "pyalloc_ipc_export failed");
    }
    if (length <= buf.size()) return {offset, to_pytorch_form(std::string(buf.data(), length))};
    buf.resize(length);
  }
}

Imports& Imports::instance() {
  static Imports* imports = new Imports;  // leaked: tensors may be released during exit
  return *imports;
}

std::shared_ptr<void> Imports::open(int device, const std::string& handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto key = std::make_pair(device, handle);
  if (auto held = open_[key].lock()) return held;
  const std::string mine = from_pytorch_form(handle);
  void* base = nullptr;
  if (pyalloc_ipc_import(device, mine.data(), mine.size(), &base) != PYALLOC_OK) {
    open_.erase(key);
    const char* last = pyalloc_last_error();
    TORCH_CHECK(false, "pyalloc: cannot open a CUDA tensor shared by another process: ",
                last != nullptr ? last : "pyalloc_ipc_import failed");
  }
  std::shared_ptr<void> mapped(base, [this, key, device](void* p) {
    // Closed under the lock, so that an open of the same handle meanwhile
    // maps it anew rather than racing this close (lock order: this, then
    // pyalloc's device lock, as in open).
    std::lock_guard<std::mutex> guard(mutex_);
    const auto it = open_.find(key);
    if (it != open_.end() && it->second.expired()) open_.erase(it);
    pyalloc_ipc_close(device, p);
  });
  open_[key] = mapped;
  return mapped;
}

}  // namespace pyalloc::torch_layer
