"""The cuda backend through pyalloc's own API, without PyTorch's allocator.

The child configures ``backend=cuda`` and calls ``pyalloc.malloc``/``free``
directly; it checks the memory with the driver API through ctypes: that
bytes written to a block read back intact, that a block is usable from the
device's primary context (the one PyTorch and CuPy use), that the calling
thread's current context is left as it was, and that errors leave the
allocator consistent (``pyalloc.check``).

A plain segment (cuMemAlloc) belongs to the context that allocated it, which
must be the primary one. Memory mapped with cuMemMap (the arenas: vmm=auto on
one device with virtual memory) is made for a device, not in a context, like
the stream-ordered allocator's, whose pointers the CUDA programming guide says
answer ``CU_POINTER_ATTRIBUTE_CONTEXT`` with NULL (NVIDIA's Open MPI change
open-mpi/ompi#12835 treats VMM pointers the same way); what makes it usable
from the primary context is the access cuMemSetAccess granted to the device,
read back here with cuMemGetAccess.
"""

from __future__ import annotations

from typing import Any, Callable

MiB = 1 << 20
_PROT_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE

_SCRIPT = """
import ctypes

import pyalloc

MiB = 1 << 20
CU_POINTER_ATTRIBUTE_CONTEXT = 1
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


pyalloc.configure("backend=cuda")
cuda = ctypes.CDLL("libcuda.so.1")  # the driver pyalloc already loaded
u64, vp, sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
cuda.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
cuda.cuCtxSetCurrent.argtypes = [vp]
cuda.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
cuda.cuMemcpyHtoD_v2.argtypes = [u64, ctypes.c_char_p, sz]
cuda.cuMemcpyDtoH_v2.argtypes = [ctypes.c_char_p, u64, sz]
cuda.cuPointerGetAttribute.argtypes = [vp, ctypes.c_int, u64]
cuda.cuStreamCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
cuda.cuStreamSynchronize.argtypes = [vp]
cuda.cuMemRetainAllocationHandle.argtypes = [ctypes.POINTER(u64), vp]
cuda.cuMemRelease.argtypes = [u64]
cuda.cuMemGetAccess.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(CUmemLocation), u64]


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc}")


def current_context():
    ctx = vp()
    check(cuda.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    return ctx.value


result = {"devices": pyalloc.device_count(), "backend": pyalloc.config()["backend"]}

# The backend pushes and pops the primary context around its driver calls:
# a thread with no current context still has none afterwards.
result["context_before"] = current_context()
sizes = [512, 4096, MiB, 5 * MiB, 64 * MiB]
blocks = [pyalloc.malloc(n) for n in sizes]
result["context_after_malloc"] = current_context()
pyalloc.check(0)

primaries = []
for device in range(result["devices"]):
    ctx = vp()
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
    primaries.append(ctx.value)
check(cuda.cuCtxSetCurrent(primaries[0]), "cuCtxSetCurrent")

# Bytes written at both ends of every block read back intact; every block
# is owned by device 0's primary context (a plain segment) or by no context,
# readable and writable from device 0 (a mapping: module docstring).
intact = []
owners = []
for address, n in zip(blocks, sizes):
    span = min(n, 4096)
    ok = True
    for offset in (0, n - span):
        pattern = bytes((i * 31 + n + offset) & 0xFF for i in range(span))
        check(cuda.cuMemcpyHtoD_v2(address + offset, pattern, span), "cuMemcpyHtoD_v2")
        back = ctypes.create_string_buffer(span)
        check(cuda.cuMemcpyDtoH_v2(back, address + offset, span), "cuMemcpyDtoH_v2")
        ok = ok and back.raw == pattern
    intact.append(ok)
    owner = vp()
    context_rc = cuda.cuPointerGetAttribute(ctypes.byref(owner), CU_POINTER_ATTRIBUTE_CONTEXT, address)
    handle = u64()
    mapped = cuda.cuMemRetainAllocationHandle(ctypes.byref(handle), address) == 0  # fails off cuMemMap
    access = None
    if mapped:
        check(cuda.cuMemRelease(handle), "cuMemRelease")
        flags = ctypes.c_ulonglong(0)
        here = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, 0)
        check(cuda.cuMemGetAccess(ctypes.byref(flags), ctypes.byref(here), address), "cuMemGetAccess")
        access = flags.value
    owners.append({"size": n, "mapped": mapped, "context_rc": context_rc, "context": owner.value,
                   "access": access})
result["intact"] = intact
result["owners"] = owners
result["primary_context"] = primaries[0]
result["aligned"] = [address % 512 == 0 for address in blocks]

# With the primary context already current (as on PyTorch's threads) it stays current.
extra = pyalloc.malloc(MiB)
pyalloc.free(extra, MiB)
result["context_kept"] = current_context() == primaries[0]

# Every device's blocks live on that device.
ordinals = []
for device in range(result["devices"]):
    address = pyalloc.malloc(2 * MiB, device)
    ordinal = ctypes.c_int(-1)
    check(cuda.cuPointerGetAttribute(ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                     address), "cuPointerGetAttribute")
    ordinals.append(ordinal.value)
    pyalloc.free(address, 2 * MiB, device)
    pyalloc.check(device)
result["ordinals"] = ordinals

# A block used on another stream: freed with an event on that stream, then
# reclaimed once the stream is done.
stream = vp()
check(cuda.cuStreamCreate(ctypes.byref(stream), 0), "cuStreamCreate")
shared = pyalloc.malloc(8 * MiB)
pyalloc.record_stream(shared, stream.value)
pyalloc.free(shared, 8 * MiB)
pyalloc.check(0)
check(cuda.cuStreamSynchronize(stream), "cuStreamSynchronize")

for address, n in zip(blocks, sizes):
    pyalloc.free(address, n)
pyalloc.check(0)
stats = pyalloc.memory_stats(0)
result["allocated_after_free"] = stats["allocated_bytes.all.current"]
pyalloc.empty_cache()
pyalloc.check(0)
result["reserved_after_empty_cache"] = pyalloc.memory_stats(0)["reserved_bytes.all.current"]

# Far more than any device: a clean failure that says why, state intact.
try:
    pyalloc.malloc(1 << 50)
    result["oom_message"] = None
except pyalloc.PyallocError as exc:
    result["oom_message"] = str(exc)
pyalloc.check(0)
after_oom = pyalloc.malloc(MiB)
pyalloc.free(after_oom, MiB)
pyalloc.check(0)
emit(result)
"""


def test_cuda_backend_serves_real_device_memory_without_torch(
    gpu_python: Callable[..., Any],
) -> None:
    r = gpu_python(_SCRIPT, allocator="none")
    assert r["backend"] == "cuda"
    assert r["devices"] >= 1
    assert r["context_before"] is None
    assert r["context_after_malloc"] is None, "the backend left its context current"
    assert all(r["intact"]), r["intact"]
    primary = r["primary_context"]
    for block in r["owners"]:
        assert block["context_rc"] == 0, f"cuPointerGetAttribute(CONTEXT) failed: {block}"
        if block["mapped"]:
            # No context, or the primary one; read and write access for device 0 either way.
            assert block["context"] in (None, primary) and block["access"] == _PROT_READWRITE, (
                f"a mapped block must be device 0's, readable and writable there (access "
                f"{_PROT_READWRITE}), owned by no context or the primary one ({primary}): {block}")
        else:
            assert block["context"] == primary, (
                f"a plain segment must live in the device's primary context ({primary}): {block}")
    assert all(r["aligned"])
    assert r["context_kept"], "the backend changed the thread's current context"
    assert r["ordinals"] == list(range(r["devices"]))
    assert r["allocated_after_free"] == 0
    assert r["reserved_after_empty_cache"] == 0
    assert r["oom_message"] is not None, "a 1 PiB allocation must fail"
    assert "out of memory" in r["oom_message"]
