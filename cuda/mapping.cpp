// mapping.cpp: the driver calls of mapping.hpp.
#include "mapping.hpp"

namespace pyalloc {
namespace cuda_backend {

using namespace cuda_driver;  // NOLINT(google-build-using-namespace)

DriverCall map_chunks(const DriverApi& api, CUdevice device, uintptr_t va, const PhysHandle* handles, size_t n) {
  DriverCall result{};
  size_t mapped = 0;
  uintptr_t end = va;
  for (; mapped < n; ++mapped) {
    const CUresult rc = api.cuMemMap(end, handles[mapped].size, 0, handles[mapped].value, 0);
    if (rc != CUDA_SUCCESS) {
      result = {rc, "cuMemMap"};
      break;
    }
    end += handles[mapped].size;
  }
  if (result.ok() && end > va) {
    // A fresh mapping is inaccessible until access is granted.
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    const CUresult rc = api.cuMemSetAccess(va, end - va, &access, 1);
    if (rc != CUDA_SUCCESS) result = {rc, "cuMemSetAccess"};
  }
  if (!result.ok()) unmap_chunks(api, va, handles, mapped);  // all or none: leave the range as it was
  return result;
}

DriverCall unmap_chunks(const DriverApi& api, uintptr_t va, const PhysHandle* handles, size_t n) {
  DriverCall first{};
  for (size_t i = 0; i < n; ++i) {
    const CUresult rc = api.cuMemUnmap(va, handles[i].size);
    if (rc != CUDA_SUCCESS && first.ok()) first = {rc, "cuMemUnmap"};
    va += handles[i].size;
  }
  return first;
}

}  // namespace cuda_backend
}  // namespace pyalloc
