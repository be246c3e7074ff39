"""The cuda backend through pyalloc's own API, without PyTorch's allocator.

The child configures ``backend=cuda`` and calls ``pyalloc.malloc``/``free``
directly; it checks the memory with the driver API through ctypes: that
bytes written to a block read back intact, that a block belongs to the
device's primary context (the one PyTorch and CuPy use), that the calling
thread's current context is left as it was, and that errors leave the
allocator consistent (``pyalloc.check``).
"""

from __future__ import annotations

from typing import Any, Callable

MiB = 1 << 20

_SCRIPT = """
import ctypes

import pyalloc

MiB = 1 << 20
CU_POINTER_ATTRIBUTE_CONTEXT = 1
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9

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

# Bytes written at both ends of every block read back intact, and every
# block lives in device 0's primary context.
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
    check(cuda.cuPointerGetAttribute(ctypes.byref(owner), CU_POINTER_ATTRIBUTE_CONTEXT, address),
          "cuPointerGetAttribute")
    owners.append(owner.value == primaries[0])
result["intact"] = intact
result["in_primary_context"] = owners
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
    assert all(r["in_primary_context"]), "blocks must live in the device's primary context"
    assert all(r["aligned"])
    assert r["context_kept"], "the backend changed the thread's current context"
    assert r["ordinals"] == list(range(r["devices"]))
    assert r["allocated_after_free"] == 0
    assert r["reserved_after_empty_cache"] == 0
    assert r["oom_message"] is not None, "a 1 PiB allocation must fail"
    assert "out of memory" in r["oom_message"]
