// mapping.hpp: the driver calls that map physical chunks (cuMemCreate's)
// into reserved address ranges and unmap them, for the cuda backend. Each
// runs with the device's context current (the backend's in_context); a
// failure returns the driver's result and names the call.
//
// A range of chunks laid end to end is mapped chunk by chunk (cuMemMap takes
// one) and then made accessible in one cuMemSetAccess (the driver grants
// access over any fully mapped range): an arena's growth by n granules is n
// cuMemMap and one cuMemSetAccess, not n of each (Note [Backend time] in
// allocator/src/backends/metered.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "backends/backend.hpp"
#include "driver.hpp"

namespace pyalloc {
namespace cuda_backend {

// Maps handles[0..n) end to end from `va` on `device`, readable and writable
// there: all of them, or none (what was mapped is unmapped again).
DriverCall map_chunks(const DriverApi& api, cuda_driver::CUdevice device, uintptr_t va, const PhysHandle* handles,
                      size_t n);
// Unmaps what map_chunks(api, device, va, handles, n) mapped, mapping by
// mapping (cuMemUnmap cannot unmap a part of one): every one tried, the first
// failure returned. The caller waits for queued work first.
DriverCall unmap_chunks(const DriverApi& api, uintptr_t va, const PhysHandle* handles, size_t n);

}  // namespace cuda_backend
}  // namespace pyalloc
