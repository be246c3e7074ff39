// sharing.hpp: the driver calls that share memory with other processes
// (Note [Sharing blocks] in allocator/src/device/ipc.cpp), for the cuda
// backend. Each runs with the device's context current (the backend's
// in_context); a failure returns the driver's result and names the call.
//
// A plain segment travels as cuIpcGetMemHandle's 64 bytes; a physical chunk
// as (exporter's pid, descriptor): cuMemExportToShareableHandle's POSIX file
// descriptor, kept open in DeviceState::exported until the chunk is released
// (the importer may take it with pidfd_getfd any time before).
#pragma once

#include <cstdint>
#include <string>

#include "driver.hpp"

namespace pyalloc {
namespace cuda_backend {

DriverCall export_segment(const DriverApi& api, uintptr_t addr, std::string* out);
// `in` must be cuIpcGetMemHandle's 64 bytes (the caller checks the size).
DriverCall open_segment(const DriverApi& api, const std::string& in, uintptr_t* addr);
DriverCall export_chunk(const DriverApi& api, DeviceState& state, cuda_driver::CUmemGenericAllocationHandle handle,
                        std::string* out);
// `fd` is this process's copy of the exporter's descriptor (take_fd); the
// caller closes it after.
DriverCall import_chunk(const DriverApi& api, int fd, cuda_driver::CUmemGenericAllocationHandle* out);

}  // namespace cuda_backend
}  // namespace pyalloc
