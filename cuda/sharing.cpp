// sharing.cpp: the driver calls of sharing.hpp.
#include "sharing.hpp"

#include <unistd.h>

#include <cstring>
#include <mutex>

namespace pyalloc {
namespace cuda_backend {

using namespace cuda_driver;  // NOLINT(google-build-using-namespace)

DriverCall export_segment(const DriverApi& api, uintptr_t addr, std::string* out) {
  CUipcMemHandle handle{};
  const CUresult rc = api.cuIpcGetMemHandle(&handle, addr);
  if (rc == CUDA_SUCCESS) out->assign(handle.reserved, sizeof handle.reserved);
  return {rc, "cuIpcGetMemHandle"};
}

DriverCall open_segment(const DriverApi& api, const std::string& in, uintptr_t* addr) {
  CUipcMemHandle handle{};
  std::memcpy(handle.reserved, in.data(), sizeof handle.reserved);
  CUdeviceptr ptr = 0;
  const CUresult rc = api.cuIpcOpenMemHandle(&ptr, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (rc == CUDA_SUCCESS) *addr = static_cast<uintptr_t>(ptr);
  return {rc, "cuIpcOpenMemHandle_v2"};
}

DriverCall export_chunk(const DriverApi& api, DeviceState& state, CUmemGenericAllocationHandle handle,
                        std::string* out) {
  std::lock_guard<std::mutex> lock(state.mutex);
  auto it = state.exported.find(handle);
  if (it == state.exported.end()) {
    int fd = -1;
    const CUresult rc = api.cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (rc != CUDA_SUCCESS) return {rc, "cuMemExportToShareableHandle"};
    it = state.exported.emplace(handle, fd).first;
  }
  const int32_t ref[2] = {static_cast<int32_t>(getpid()), static_cast<int32_t>(it->second)};
  out->assign(reinterpret_cast<const char*>(ref), sizeof ref);
  return {};
}

DriverCall import_chunk(const DriverApi& api, int fd, CUmemGenericAllocationHandle* out) {
  const CUresult rc = api.cuMemImportFromShareableHandle(out, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  return {rc, "cuMemImportFromShareableHandle"};
}

}  // namespace cuda_backend
}  // namespace pyalloc
