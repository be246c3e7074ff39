// ipc.cpp: Note [Sharing under PyTorch] (ipc.hpp).
#include "ipc.hpp"

#include <pyalloc/pyalloc.h>

#include <c10/util/Exception.h>

#include <vector>

namespace pyalloc::torch_layer {

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
    if (length <= buf.size()) return {offset, std::string(buf.data(), length)};
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
  void* base = nullptr;
  if (pyalloc_ipc_import(device, handle.data(), handle.size(), &base) != PYALLOC_OK) {
    open_.erase(key);
    const char* last = pyalloc_last_error();
    TORCH_CHECK(false, "pyalloc: cannot open a CUDA tensor shared by another process: ",
                last != nullptr ? last : "pyalloc_ipc_import failed");
  }
  std::shared_ptr<void> mapped(base, [this, key, device](void* p) {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      const auto it = open_.find(key);
      if (it != open_.end() && it->second.expired()) open_.erase(it);
    }
    pyalloc_ipc_close(device, p);
  });
  open_[key] = mapped;
  return mapped;
}

}  // namespace pyalloc::torch_layer
