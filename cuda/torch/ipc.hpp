// ipc.hpp: CUDA tensors passed between processes, under pyalloc.
//
// Note [Sharing under PyTorch]
// torch.multiprocessing sends a CUDA tensor as its storage's handle: the
// sender asks its allocator's shareIpcHandle(data pointer) for bytes and an
// offset, keeps the storage alive until the receivers let go (PyTorch's
// reference counter file), and the receiver asks its allocator's
// getIpcDevPtr(bytes) for the memory, holding the shared_ptr it returns for
// as long as any tensor uses it. pyalloc's handle (Note [Sharing blocks] in
// allocator/src/device/ipc.cpp) maps a plain segment whole or an arena
// block's granules. A receiver may be sent several tensors of one segment
// (the same bytes): the driver maps a handle once per process, so the
// receiver keeps one mapping per handle, shared by every tensor that opened
// it, and closes it when the last one goes.
//
// A process whose allocator is PyTorch's own may be on the other end (a
// DataLoader worker that did not install pyalloc). PyTorch's handle of a
// cudaMalloc block is a version byte, 'c' and cudaIpcGetMemHandle's 64
// bytes, with the block's offset in its segment beside it: the same facts as
// pyalloc's handle of a plain segment. So a plain segment's handle leaves in
// PyTorch's form, which either allocator opens, and PyTorch's form is read
// on arrival. The version byte is 2 up to PyTorch 2.12 and 3 from 2.13, with
// the same 'c' payload; PyTorch refuses a version above its own ("received
// sharable handle from a future version of torch", seen on a GPU with 2.11),
// so pyalloc writes 2, which both read, and reads 1 to 3. An arena block's
// handle (exported granules) has no PyTorch form; PyTorch's own expandable
// segments ('e') have no pyalloc form, and opening one is an error that says
// so.
//
// c10 only (no CUDA header), so the tests drive it on a CPU build.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace pyalloc::torch_layer {

// shareIpcHandle: (the block's offset in what the handle maps, the handle).
std::pair<size_t, std::string> share_handle(void* ptr);

// pyalloc's handle of a plain segment in PyTorch's form; any other handle
// as it is.
std::string to_pytorch_form(const std::string& handle);
// PyTorch's form of a cudaMalloc block's handle in pyalloc's; pyalloc's
// handles as they are; anything else is an error naming it.
std::string from_pytorch_form(const std::string& handle);

class Imports {
 public:
  static Imports& instance();
  // getIpcDevPtr: the memory a handle maps on `device`, mapped once while
  // any holder keeps it.
  std::shared_ptr<void> open(int device, const std::string& handle);

 private:
  std::mutex mutex_;
  std::map<std::pair<int, std::string>, std::weak_ptr<void>> open_;
};

}  // namespace pyalloc::torch_layer
