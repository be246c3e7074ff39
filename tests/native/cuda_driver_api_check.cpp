// cuda_driver_api_check.cpp: compile-only proof that cuda/driver_api.hpp
// matches the real CUDA driver API.
//
// The cuda backend declares its own copy of the driver types so the library
// builds without a CUDA toolkit (cuda/driver_api.hpp). A wrong value, field
// offset or signature there would not fail to compile: it would corrupt
// calls at run time. This file includes both the real <cuda.h> and our
// header and static_asserts that they agree:
//   - every enum constant and CUresult code we name has the real value;
//   - every struct has the real size, alignment and field offsets;
//   - every function signature, mapped onto the real types, is the type of
//     the real function;
//   - every symbol we dlsym is the one cuda.h maps the API name to
//     (#define cuMemAlloc cuMemAlloc_v2).
//
// Not built by CMake (it needs a CUDA toolkit); tests/test_cuda_backend.py
// runs `g++ -std=c++17 -fsyntax-only -I<cuda>/include` on it.
#if !__has_include(<cuda.h>)
#error "cuda_driver_api_check.cpp needs the real cuda.h: pass -I<CUDA toolkit>/include"
#endif

#include <cuda.h>

#include <cstddef>
#include <type_traits>

#include "../../cuda/driver_api.hpp"

namespace drv = pyalloc::cuda_driver;

// ---- scalar types --------------------------------------------------------------

static_assert(std::is_same_v<drv::CUdevice, ::CUdevice>);
static_assert(std::is_same_v<drv::CUdeviceptr, ::CUdeviceptr>);
static_assert(std::is_same_v<drv::CUmemGenericAllocationHandle, ::CUmemGenericAllocationHandle>);
static_assert(sizeof(drv::CUresult) == sizeof(::CUresult));
static_assert(sizeof(drv::CUcontext) == sizeof(::CUcontext));
static_assert(sizeof(drv::CUstream) == sizeof(::CUstream));
static_assert(sizeof(drv::CUevent) == sizeof(::CUevent));

// ---- enum values ---------------------------------------------------------------

#define PYALLOC_CHECK_VALUE(name) \
  static_assert(static_cast<long long>(drv::name) == static_cast<long long>(::name), #name)

PYALLOC_CHECK_VALUE(CUDA_SUCCESS);
PYALLOC_CHECK_VALUE(CUDA_ERROR_INVALID_VALUE);
PYALLOC_CHECK_VALUE(CUDA_ERROR_OUT_OF_MEMORY);
PYALLOC_CHECK_VALUE(CUDA_ERROR_NOT_INITIALIZED);
PYALLOC_CHECK_VALUE(CUDA_ERROR_DEINITIALIZED);
PYALLOC_CHECK_VALUE(CUDA_ERROR_NO_DEVICE);
PYALLOC_CHECK_VALUE(CUDA_ERROR_NOT_READY);
PYALLOC_CHECK_VALUE(CUDA_ERROR_NOT_SUPPORTED);
PYALLOC_CHECK_VALUE(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
PYALLOC_CHECK_VALUE(CU_EVENT_DISABLE_TIMING);
PYALLOC_CHECK_VALUE(CU_MEM_ALLOCATION_TYPE_PINNED);
PYALLOC_CHECK_VALUE(CU_MEM_HANDLE_TYPE_NONE);
PYALLOC_CHECK_VALUE(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
PYALLOC_CHECK_VALUE(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
PYALLOC_CHECK_VALUE(CU_MEM_LOCATION_TYPE_DEVICE);
PYALLOC_CHECK_VALUE(CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
PYALLOC_CHECK_VALUE(CU_MEM_ALLOC_GRANULARITY_MINIMUM);

#undef PYALLOC_CHECK_VALUE

// Enums stored in structs or passed by value must have the real size.
static_assert(sizeof(drv::CUdevice_attribute) == sizeof(::CUdevice_attribute));
static_assert(sizeof(drv::CUmemAllocationType) == sizeof(::CUmemAllocationType));
static_assert(sizeof(drv::CUmemAllocationHandleType) == sizeof(::CUmemAllocationHandleType));
static_assert(sizeof(drv::CUmemLocationType) == sizeof(::CUmemLocationType));
static_assert(sizeof(drv::CUmemAccess_flags) == sizeof(::CUmemAccess_flags));
static_assert(sizeof(drv::CUmemAllocationGranularity_flags) ==
              sizeof(::CUmemAllocationGranularity_flags));

// ---- struct layouts --------------------------------------------------------------

#define PYALLOC_CHECK_STRUCT(type)                                       \
  static_assert(sizeof(drv::type) == sizeof(::type), "sizeof " #type); \
  static_assert(alignof(drv::type) == alignof(::type), "alignof " #type)
#define PYALLOC_CHECK_FIELD(type, field)                                                \
  static_assert(offsetof(drv::type, field) == offsetof(::type, field), #type "." #field); \
  static_assert(sizeof(drv::type::field) == sizeof(::type::field), "sizeof " #type "." #field)

PYALLOC_CHECK_STRUCT(CUmemLocation);
PYALLOC_CHECK_FIELD(CUmemLocation, type);
PYALLOC_CHECK_FIELD(CUmemLocation, id);

PYALLOC_CHECK_STRUCT(CUmemAllocationProp);
PYALLOC_CHECK_FIELD(CUmemAllocationProp, type);
PYALLOC_CHECK_FIELD(CUmemAllocationProp, requestedHandleTypes);
PYALLOC_CHECK_FIELD(CUmemAllocationProp, location);
PYALLOC_CHECK_FIELD(CUmemAllocationProp, win32HandleMetaData);
PYALLOC_CHECK_FIELD(CUmemAllocationProp, allocFlags);
// allocFlags is an anonymous struct: compare its members through decltype.
using DrvAllocFlags = decltype(drv::CUmemAllocationProp::allocFlags);
using RealAllocFlags = decltype(::CUmemAllocationProp::allocFlags);
static_assert(sizeof(DrvAllocFlags) == sizeof(RealAllocFlags));
static_assert(offsetof(DrvAllocFlags, compressionType) == offsetof(RealAllocFlags, compressionType));
static_assert(offsetof(DrvAllocFlags, gpuDirectRDMACapable) ==
              offsetof(RealAllocFlags, gpuDirectRDMACapable));
static_assert(offsetof(DrvAllocFlags, usage) == offsetof(RealAllocFlags, usage));
static_assert(offsetof(DrvAllocFlags, reserved) == offsetof(RealAllocFlags, reserved));
static_assert(sizeof(DrvAllocFlags::reserved) == sizeof(RealAllocFlags::reserved));

PYALLOC_CHECK_STRUCT(CUipcMemHandle);
PYALLOC_CHECK_FIELD(CUipcMemHandle, reserved);

PYALLOC_CHECK_STRUCT(CUmemAccessDesc);
PYALLOC_CHECK_FIELD(CUmemAccessDesc, location);
PYALLOC_CHECK_FIELD(CUmemAccessDesc, flags);

#undef PYALLOC_CHECK_FIELD
#undef PYALLOC_CHECK_STRUCT

// ---- function signatures and symbol names -------------------------------------------
//
// ToReal<T> rewrites a type built from our declarations into the same type
// built from cuda.h's, so a whole function type can be compared with
// std::is_same. A type of ours without a mapping below stays distinct from
// the real one and fails the comparison, so nothing is checked loosely.

template <class T>
struct ToReal {
  using type = T;  // builtin types (int, size_t, void, unsigned long long, ...)
};
template <class T>
using ToRealT = typename ToReal<T>::type;

template <class T>
struct ToReal<T*> {
  using type = ToRealT<T>*;
};
template <class T>
struct ToReal<const T> {
  using type = const ToRealT<T>;
};
template <class R, class... Args>
struct ToReal<R(Args...)> {
  using type = ToRealT<R>(ToRealT<Args>...);
};

#define PYALLOC_MAP_TYPE(name) \
  template <>                  \
  struct ToReal<drv::name> {   \
    using type = ::name;       \
  }

PYALLOC_MAP_TYPE(CUresult);
PYALLOC_MAP_TYPE(CUctx_st);
PYALLOC_MAP_TYPE(CUstream_st);
PYALLOC_MAP_TYPE(CUevent_st);
PYALLOC_MAP_TYPE(CUdevice_attribute);
PYALLOC_MAP_TYPE(CUmemAllocationGranularity_flags);
PYALLOC_MAP_TYPE(CUmemAllocationProp);
PYALLOC_MAP_TYPE(CUmemAccessDesc);
PYALLOC_MAP_TYPE(CUipcMemHandle);
PYALLOC_MAP_TYPE(CUmemAllocationHandleType);

#undef PYALLOC_MAP_TYPE

constexpr bool same_text(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) {
    ++a;
    ++b;
  }
  return *a == *b;
}

#define PYALLOC_STRINGIZE_EXPANDED(x) PYALLOC_STRINGIZE(x)
#define PYALLOC_STRINGIZE(x) #x

// Expanded inside namespace pyalloc::cuda_driver so that the unqualified
// types in each signature are ours; ::symbol is the real declaration. `name`
// goes through one more macro level, so cuda.h's #define (cuMemAlloc ->
// cuMemAlloc_v2) is applied to it before it is turned into text.
#define PYALLOC_CHECK_FUNCTION(name, symbol, signature)                                       \
  static_assert(std::is_same_v<ToRealT<signature>*, decltype(&::symbol)>,                     \
                "signature of " #symbol);                                                      \
  static_assert(same_text(PYALLOC_STRINGIZE_EXPANDED(name), #symbol),                          \
                "cuda.h maps this API name to another symbol than " #symbol);

namespace pyalloc {
namespace cuda_driver {
PYALLOC_CUDA_DRIVER_FUNCTIONS(PYALLOC_CHECK_FUNCTION)
PYALLOC_CUDA_DRIVER_OPTIONAL_FUNCTIONS(PYALLOC_CHECK_FUNCTION)
}  // namespace cuda_driver
}  // namespace pyalloc

#undef PYALLOC_CHECK_FUNCTION
