// driver_api.hpp: the few CUDA driver API declarations the cuda backend uses.
//
// The library must build with g++ alone, without a CUDA toolkit, and run on
// any machine with an NVIDIA driver: so <cuda.h> is never included. Instead
// this header declares, in namespace pyalloc::cuda_driver, exactly the types,
// enum values, structs and function signatures that backend_cuda.cpp needs,
// copied from cuda.h (CUDA 12/13; these parts of the ABI have not changed
// since the VMM API appeared in CUDA 10.2). The functions themselves are
// resolved at run time from libcuda.so.1 with dlsym.
//
// tests/native/cuda_driver_api_check.cpp includes this header next to the
// real <cuda.h> and static_asserts every value, size, field offset, function
// signature and versioned symbol name below against it; tests/
// test_cuda_backend.py compiles that check wherever a CUDA toolkit is found.
// Add to this header only together with that check.
#pragma once

#include <cstddef>

namespace pyalloc {
namespace cuda_driver {

// ---- scalar and handle types -------------------------------------------------

// CUresult is a plain C enum in cuda.h (4 bytes). A fixed underlying type
// lets any code the driver returns, named here or not, be held and printed.
enum CUresult : int {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_DEINITIALIZED = 4,  // returned while the process is exiting
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_NOT_READY = 600,  // cuEventQuery: captured work still running
  CUDA_ERROR_NOT_SUPPORTED = 801,
};

using CUdevice = int;                                // device ordinal handle
using CUdeviceptr = unsigned long long;              // device address (64-bit ABI)
using CUmemGenericAllocationHandle = unsigned long long;  // cuMemCreate handle

// Opaque driver objects, only ever passed back to the driver.
struct CUctx_st;
struct CUstream_st;
struct CUevent_st;
using CUcontext = CUctx_st*;
using CUstream = CUstream_st*;  // nullptr: the legacy default stream
using CUevent = CUevent_st*;

// ---- enums -----------------------------------------------------------------

enum CUdevice_attribute : int {
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
};

// cuEventCreate flags.
enum CUevent_flags : unsigned int {
  CU_EVENT_DISABLE_TIMING = 0x2,  // cheaper to record and query: no timestamp
};

enum CUmemAllocationType : int {
  CU_MEM_ALLOCATION_TYPE_PINNED = 0x1,  // device-resident, never migrated
};

enum CUmemAllocationHandleType : int {
  CU_MEM_HANDLE_TYPE_NONE = 0x0,  // not exportable to other processes
  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,  // exportable as a file descriptor
};

enum CUipcMem_flags : unsigned int {
  CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1,
};

enum CUmemLocationType : int {
  CU_MEM_LOCATION_TYPE_DEVICE = 0x1,  // CUmemLocation::id is a device ordinal
};

enum CUmemAccess_flags : int {
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3,
};

enum CUmemAllocationGranularity_flags : int {
  CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
};

// ---- structs (layouts checked field by field against cuda.h) -------------------

struct CUmemLocation {
  CUmemLocationType type;
  int id;
};

struct CUmemAllocationProp {
  CUmemAllocationType type;
  CUmemAllocationHandleType requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;  // Windows only; must be null elsewhere
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};

struct CUmemAccessDesc {
  CUmemLocation location;
  CUmemAccess_flags flags;
};

// cuIpcGetMemHandle's opaque handle of a cuMemAlloc allocation.
struct CUipcMemHandle {
  char reserved[64];
};

// ---- functions -----------------------------------------------------------------
//
// X(name, symbol, signature): `name` is the API name used in code, `symbol`
// the exported libcuda.so.1 symbol it resolves to. Where cuda.h maps a name
// to a versioned symbol (#define cuMemAlloc cuMemAlloc_v2) the versioned one
// is used, as a program compiled against cuda.h would; the unversioned
// symbols are kept by the driver only for binaries built before the change.
// Stream-taking functions use the legacy-default-stream symbols (no _ptsz):
// a stream value of 0 means the legacy default stream, as in PyTorch.
#define PYALLOC_CUDA_DRIVER_FUNCTIONS(X)                                                        \
  X(cuGetErrorName, cuGetErrorName, CUresult(CUresult, const char**))                           \
  X(cuGetErrorString, cuGetErrorString, CUresult(CUresult, const char**))                       \
  X(cuInit, cuInit, CUresult(unsigned int))                                                     \
  X(cuDeviceGetCount, cuDeviceGetCount, CUresult(int*))                                         \
  X(cuDeviceGet, cuDeviceGet, CUresult(CUdevice*, int))                                         \
  X(cuDeviceGetAttribute, cuDeviceGetAttribute, CUresult(int*, CUdevice_attribute, CUdevice))   \
  X(cuDeviceTotalMem, cuDeviceTotalMem_v2, CUresult(size_t*, CUdevice))                         \
  X(cuDevicePrimaryCtxGetState, cuDevicePrimaryCtxGetState,                                     \
    CUresult(CUdevice, unsigned int*, int*))                                                    \
  X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, CUresult(CUcontext*, CUdevice))         \
  X(cuCtxGetCurrent, cuCtxGetCurrent, CUresult(CUcontext*))                                     \
  X(cuCtxPushCurrent, cuCtxPushCurrent_v2, CUresult(CUcontext))                                 \
  X(cuCtxPopCurrent, cuCtxPopCurrent_v2, CUresult(CUcontext*))                                  \
  X(cuCtxSynchronize, cuCtxSynchronize, CUresult())                                             \
  X(cuMemAlloc, cuMemAlloc_v2, CUresult(CUdeviceptr*, size_t))                                  \
  X(cuMemFree, cuMemFree_v2, CUresult(CUdeviceptr))                                             \
  X(cuMemGetInfo, cuMemGetInfo_v2, CUresult(size_t*, size_t*))                                  \
  X(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity,                               \
    CUresult(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags))            \
  X(cuMemAddressReserve, cuMemAddressReserve,                                                   \
    CUresult(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long))                    \
  X(cuMemAddressFree, cuMemAddressFree, CUresult(CUdeviceptr, size_t))                          \
  X(cuMemCreate, cuMemCreate,                                                                   \
    CUresult(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,                 \
             unsigned long long))                                                               \
  X(cuMemRelease, cuMemRelease, CUresult(CUmemGenericAllocationHandle))                         \
  X(cuMemMap, cuMemMap,                                                                         \
    CUresult(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))    \
  X(cuMemSetAccess, cuMemSetAccess,                                                             \
    CUresult(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t))                              \
  X(cuMemUnmap, cuMemUnmap, CUresult(CUdeviceptr, size_t))                                      \
  X(cuEventCreate, cuEventCreate, CUresult(CUevent*, unsigned int))                             \
  X(cuEventDestroy, cuEventDestroy_v2, CUresult(CUevent))                                       \
  X(cuEventRecord, cuEventRecord, CUresult(CUevent, CUstream))                                  \
  X(cuEventQuery, cuEventQuery, CUresult(CUevent))                                              \
  X(cuEventSynchronize, cuEventSynchronize, CUresult(CUevent))                                  \
  X(cuStreamWaitEvent, cuStreamWaitEvent, CUresult(CUstream, CUevent, unsigned int))            \
  X(cuMemcpyDtoHAsync, cuMemcpyDtoHAsync_v2, CUresult(void*, CUdeviceptr, size_t, CUstream))    \
  X(cuMemcpyHtoDAsync, cuMemcpyHtoDAsync_v2, CUresult(CUdeviceptr, const void*, size_t, CUstream)) \
  X(cuMemcpyDtoDAsync, cuMemcpyDtoDAsync_v2, CUresult(CUdeviceptr, CUdeviceptr, size_t, CUstream))

// Resolved like the above, but a driver without them still loads: the one
// feature that needs them fails, naming the missing function. Sharing memory
// with other processes (Note [Sharing blocks] in allocator/src/device/ipc.cpp).
#define PYALLOC_CUDA_DRIVER_OPTIONAL_FUNCTIONS(X)                                               \
  X(cuIpcGetMemHandle, cuIpcGetMemHandle, CUresult(CUipcMemHandle*, CUdeviceptr))               \
  X(cuIpcOpenMemHandle, cuIpcOpenMemHandle_v2, CUresult(CUdeviceptr*, CUipcMemHandle, unsigned int)) \
  X(cuIpcCloseMemHandle, cuIpcCloseMemHandle, CUresult(CUdeviceptr))                            \
  X(cuMemExportToShareableHandle, cuMemExportToShareableHandle,                                 \
    CUresult(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long)) \
  X(cuMemImportFromShareableHandle, cuMemImportFromShareableHandle,                             \
    CUresult(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType))

// The soname of the driver library, installed with the NVIDIA driver itself
// (not with the toolkit; libcuda.so without the .1 is a development link).
constexpr const char* kDriverLibrary = "libcuda.so.1";

}  // namespace cuda_driver
}  // namespace pyalloc
