"""The cuda backend, checked without a GPU.

1. ``cuda/driver_api.hpp`` (our copy of the driver API declarations) is
   compiled next to the real ``cuda.h`` by tests/native/cuda_driver_api_check.cpp,
   which static_asserts every value, layout, signature and symbol name.
2. The library builds with g++ alone: no source includes a CUDA header.
3. Without an NVIDIA driver, ``configure("backend=cuda")`` fails with a
   one-line message naming libcuda.so.1 and pointing to backend=host/sim.
4. Against a fake libcuda.so.1 (C++ source below, built into a temporary
   folder and found through LD_LIBRARY_PATH): every Backend method, driven
   directly by a small C++ harness, and the whole library through pyalloc's
   Python API. The fake counts misuse the real driver would punish with a
   crash or a wrong result: a driver call without the right context
   current, an unbalanced context stack, events created with timing, a map
   outside a reservation, and so on.

The real driver is exercised by tests/gpu/ on a machine with a GPU.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECK_SOURCE = REPO_ROOT / "tests" / "native" / "cuda_driver_api_check.cpp"
# The cuda backend: the Backend over the driver, the driver's loading, and what every backend shares.
BACKEND_SOURCES = (REPO_ROOT / "cuda" / "backend_cuda.cpp", REPO_ROOT / "cuda" / "driver.cpp",
                   REPO_ROOT / "cuda" / "sharing.cpp", REPO_ROOT / "cuda" / "mapping.cpp",
                   REPO_ROOT / "allocator" / "src" / "backends" / "backend.cpp")
LIBRARY_SOURCE_DIRS = (REPO_ROOT / "allocator", REPO_ROOT / "cuda")

# How long a compile or a child process may take before the test fails.
COMPILE_TIMEOUT_S = 300
CHILD_TIMEOUT_S = 120

# A CUDA header in library code would tie the build to a toolkit.
_CUDA_INCLUDE = re.compile(
    r'^\s*#\s*include\s*[<"](cuda|cuda_runtime|cuda_runtime_api|cudaTypedefs|driver_types)\.h[>"]',
    re.MULTILINE,
)


# ---- helpers -------------------------------------------------------------------------


def _cxx() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        pytest.skip("no C++ compiler (g++) on PATH")
    return compiler


def _compile(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)


def _compile_or_fail(command: list[str]) -> None:
    proc = _compile(command)
    if proc.returncode != 0:
        pytest.fail(f"compile failed: {' '.join(command)}\n{proc.stderr[-6000:]}")


def cuda_include_dirs() -> list[Path]:
    """Every distinct folder holding a CUDA toolkit's cuda.h on this machine."""
    candidates: list[Path] = []
    for variable in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(variable):
            candidates.append(Path(os.environ[variable]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
        # A wrapper script (exec /usr/local/cuda-X/bin/nvcc "$@") hides the real one.
        try:
            text = Path(nvcc).read_text(errors="replace")[:4096]
        except OSError:
            text = ""
        for match in re.finditer(r"(/\S+)/bin/nvcc\b", text):
            candidates.append(Path(match.group(1)) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    candidates.extend(sorted(Path("/usr/local").glob("cuda-*/include"), reverse=True))
    candidates.extend([Path("/usr/include"), Path("/opt/cuda/include")])

    found: list[Path] = []
    seen: set[Path] = set()
    for folder in candidates:
        if (folder / "cuda.h").is_file():
            real = (folder / "cuda.h").resolve().parent
            if real not in seen:
                seen.add(real)
                found.append(folder)
    return found


def _libcuda_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _library() -> str:
    import pyalloc

    try:
        return pyalloc.library_path()
    except pyalloc.PyallocError as exc:
        pytest.fail(f"libpyalloc.so is not built: {exc}")


_RESULT_MARKER = "PYALLOC_TEST_RESULT "


def _prepend_path(value: str, existing: str | None) -> str:
    return os.pathsep.join([value] + ([existing] if existing else []))


def _run_python(code: str, extra_env: dict[str, str]) -> Any:
    """Runs ``code`` in a fresh interpreter and returns what it ``emit()``s.

    The library starts on the host backend; ``extra_env`` adds variables, and
    its LD_LIBRARY_PATH (where the fake driver lives) goes before the inherited one.
    """
    import pyalloc

    env = dict(os.environ)
    package_root = str(Path(pyalloc.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = _prepend_path(package_root, env.get("PYTHONPATH"))
    env["PYALLOC_LIBRARY"] = _library()
    env["PYALLOC_CONF"] = "backend=host"
    for name in list(env):
        if name.startswith("FAKE_CUDA_"):
            del env[name]
    for name, value in extra_env.items():
        env[name] = _prepend_path(value, env.get(name)) if name == "LD_LIBRARY_PATH" else value
    prelude = (
        "import json as _json\n"
        f"def emit(value):\n    print({_RESULT_MARKER!r} + _json.dumps(value), flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"child failed (exit status {proc.returncode})\n--- stdout ---\n{proc.stdout[-4000:]}\n"
            f"--- stderr ---\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len(_RESULT_MARKER) :])


# ---- 1. the declarations match cuda.h ---------------------------------------------------


def test_driver_api_header_matches_real_cuda_h() -> None:
    cxx = _cxx()
    folders = cuda_include_dirs()
    if not folders:
        pytest.skip(
            "no CUDA toolkit headers found (cuda.h under $CUDA_HOME, $CUDA_PATH, nvcc's "
            "../include, /usr/local/cuda*/include, /usr/include): cannot compare "
            "cuda/driver_api.hpp with the real driver API here"
        )
    failures = []
    for folder in folders:
        flags = ["-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", f"-I{folder}"]
        proc = _compile([cxx, *flags, str(CHECK_SOURCE)])
        if proc.returncode != 0:
            failures.append(f"against {folder}:\n{proc.stderr[-4000:]}")
    assert not failures, "\n".join(failures)


def test_driver_api_check_rejects_a_wrong_declaration(tmp_path: Path) -> None:
    # The check must be able to fail: copy the header with a wrong value, an
    # unversioned symbol, a wrong signature or swapped fields, and expect each
    # to stop the compile.
    cxx = _cxx()
    folders = cuda_include_dirs()
    if not folders:
        pytest.skip("no CUDA toolkit headers found (see the test above)")
    header = (REPO_ROOT / "cuda" / "driver_api.hpp").read_text()
    mutations = {
        "value": ("CUDA_ERROR_NOT_READY = 600", "CUDA_ERROR_NOT_READY = 601"),
        "symbol": ("X(cuMemAlloc, cuMemAlloc_v2,", "X(cuMemAlloc, cuMemAlloc,"),
        "signature": (
            "X(cuMemFree, cuMemFree_v2, CUresult(CUdeviceptr))",
            "X(cuMemFree, cuMemFree_v2, CUresult(CUdeviceptr*))",
        ),
        "layout": (
            "  CUmemLocation location;\n  CUmemAccess_flags flags;",
            "  CUmemAccess_flags flags;\n  CUmemLocation location;",
        ),
    }
    for name, (old, new) in mutations.items():
        assert old in header, f"mutation {name}: {old!r} not found in driver_api.hpp"
        root = tmp_path / name
        (root / "cuda").mkdir(parents=True)
        (root / "tests" / "native").mkdir(parents=True)
        (root / "cuda" / "driver_api.hpp").write_text(header.replace(old, new, 1))
        check = root / "tests" / "native" / CHECK_SOURCE.name
        shutil.copy(CHECK_SOURCE, check)
        proc = _compile([cxx, "-std=c++17", "-fsyntax-only", f"-I{folders[0]}", str(check)])
        assert proc.returncode != 0, f"the check accepted a wrong {name}"
        assert "static assertion failed" in proc.stderr, proc.stderr[-2000:]


# ---- 2. no CUDA toolkit needed ---------------------------------------------------------------


def test_library_sources_include_no_cuda_header() -> None:
    offenders = []
    for folder in LIBRARY_SOURCE_DIRS:
        for path in sorted(folder.rglob("*")):
            if path.suffix not in (".c", ".cc", ".cpp", ".h", ".hpp"):
                continue
            if _CUDA_INCLUDE.search(path.read_text(errors="replace")):
                offenders.append(str(path.relative_to(REPO_ROOT)))
    assert not offenders, f"library sources must not include CUDA headers: {offenders}"


def test_cuda_backend_compiles_with_gcc_alone() -> None:
    cxx = _cxx()
    # No include path from the environment: only the repository's folders.
    hidden = ("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH")
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    command = [
        cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra",
        f"-I{REPO_ROOT / 'allocator' / 'src'}", f"-I{REPO_ROOT / 'allocator' / 'include'}",
        *map(str, BACKEND_SOURCES),
    ]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    own_warnings = [
        line
        for line in proc.stderr.splitlines()
        if "/cuda/" in line and "warning:" in line
    ]
    assert not own_warnings, "\n".join(own_warnings)


# ---- 3. no driver: a clear refusal -----------------------------------------------------------


def test_configure_cuda_without_driver_names_libcuda_and_suggests_host_or_sim() -> None:
    if _libcuda_loads():
        pytest.skip("libcuda.so.1 loads on this machine (an NVIDIA driver is installed)")
    result = _run_python(
        """
        import pyalloc

        try:
            pyalloc.configure("backend=cuda")
            outcome = {"raised": False}
        except pyalloc.PyallocError as exc:
            outcome = {"raised": True, "message": str(exc), "code": exc.code}
        outcome["backend_after"] = pyalloc.config()["backend"]
        address = pyalloc.malloc(4096)  # the host allocator in force still works
        pyalloc.free(address, 4096)
        pyalloc.check(0)
        emit(outcome)
        """,
        {},
    )
    assert result["raised"], "configure('backend=cuda') must fail without a driver"
    message = result["message"]
    assert "libcuda.so.1" in message
    assert "backend=host" in message and "backend=sim" in message
    assert "\n" not in message.strip()
    assert result["backend_after"] == "host", "a failed configure must keep the old config"


# ---- 4. against a fake driver ------------------------------------------------------------------


def _build_fake_driver(folder: Path, *defines: str) -> Path:
    source = folder / "fake_libcuda.cpp"
    source.write_text(FAKE_LIBCUDA_SOURCE)
    _compile_or_fail(
        [
            _cxx(), "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Wextra", *defines,
            f"-I{REPO_ROOT}", "-Wl,-soname,libcuda.so.1",
            "-o", str(folder / "libcuda.so.1"), str(source),
        ]
    )
    return folder


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the fake libcuda.so.1."""
    return _build_fake_driver(tmp_path_factory.mktemp("fake_libcuda"))


@pytest.fixture(scope="module")
def fake_driver_without_cumemcreate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fake libcuda.so.1 that lacks cuMemCreate, like a driver older than CUDA 10.2."""
    folder = tmp_path_factory.mktemp("fake_libcuda_old")
    return _build_fake_driver(folder, "-DFAKE_OMIT_CUMEMCREATE")


def test_backend_methods_against_fake_driver(fake_driver: Path, tmp_path: Path) -> None:
    harness = tmp_path / "harness.cpp"
    harness.write_text(HARNESS_SOURCE)
    binary = tmp_path / "harness"
    _compile_or_fail(
        [
            _cxx(), "-std=c++17", "-O1", "-g", "-Wall", "-Wextra",
            f"-I{REPO_ROOT / 'allocator' / 'src'}", f"-I{REPO_ROOT / 'allocator' / 'include'}",
            str(harness), *map(str, BACKEND_SOURCES), "-ldl", "-lpthread", "-o", str(binary),
        ]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CUDA_")}
    env["LD_LIBRARY_PATH"] = _prepend_path(str(fake_driver), env.get("LD_LIBRARY_PATH"))
    proc = subprocess.run(
        [str(binary)], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env
    )
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, output
    # The faulted-context query error is printed once, with the driver's name for it.
    reports = [line for line in proc.stderr.splitlines() if line.startswith("pyalloc: ")]
    assert len(reports) == 1, proc.stderr
    assert "cuEventQuery failed: CUDA_ERROR_ILLEGAL_ADDRESS" in reports[0]


# The fake driver as the script's pyalloc loaded it, with its counters.
_FAKE = """
import ctypes

import pyalloc

MiB = 1 << 20
fake = ctypes.CDLL("libcuda.so.1")  # the fake pyalloc loaded
fake.fake_cuda_get.restype = ctypes.c_longlong
fake.fake_cuda_get.argtypes = [ctypes.c_char_p]
fake.fake_cuda_misuse_report.restype = ctypes.c_char_p
"""


# Run on the fake driver: every allocator path that reaches the backend, with
# the fake's counters read back at the end.
_ON_FAKE_DRIVER = """
import ctypes

import pyalloc

MiB = 1 << 20
pyalloc.configure("backend=cuda")
fake = ctypes.CDLL("libcuda.so.1")  # the fake pyalloc loaded
fake.fake_cuda_get.restype = ctypes.c_longlong
fake.fake_cuda_get.argtypes = [ctypes.c_char_p]
fake.fake_cuda_misuse_report.restype = ctypes.c_char_p


def counter(name):
    return int(fake.fake_cuda_get(name.encode()))


out = {"backend": pyalloc.config()["backend"], "devices": pyalloc.device_count()}
out["retains_after_configure"] = counter("retain")

small = pyalloc.malloc(4096)
large = pyalloc.malloc(8 * MiB)
out["retains_after_device0"] = counter("retain")
pyalloc.check(0)

# A block used on another stream stays pending until that stream's event completes.
pyalloc.record_stream(large, 0x5000)
pyalloc.free(large, 8 * MiB)
out["records"] = counter("event_record")
out["last_record_stream"] = counter("last_record_stream")
pyalloc.check(0)
for _ in range(5):  # the fake completes events after FAKE_CUDA_EVENT_DELAY queries
    pyalloc.free(pyalloc.malloc(8 * MiB), 8 * MiB)
    pyalloc.check(0)

other = pyalloc.malloc(MiB, 1)
pyalloc.free(other, MiB, 1)
pyalloc.check(1)
out["retains_after_device1"] = counter("retain")

pyalloc.free(small, 4096)
pyalloc.empty_cache()
pyalloc.check(0)
out["reserved_after_empty_cache"] = pyalloc.memory_stats(0)["reserved_bytes.all.current"]
out["driver_live_allocs"] = counter("live_allocs")

try:
    pyalloc.malloc(1 << 40)
    out["oom"] = None
except pyalloc.PyallocError as exc:
    out["oom"] = str(exc)
pyalloc.check(0)

out["events_created"] = counter("event_create")
out["push_minus_pop"] = counter("push") - counter("pop")
out["misuse"] = fake.fake_cuda_misuse_report().decode()
emit(out)
"""


def test_pyalloc_runs_on_fake_driver(fake_driver: Path) -> None:
    result = _run_python(
        _ON_FAKE_DRIVER, {"LD_LIBRARY_PATH": str(fake_driver), "FAKE_CUDA_EVENT_DELAY": "2"}
    )
    assert result["backend"] == "cuda"
    assert result["devices"] == 2
    # Contexts are created on a device's first use only.
    assert result["retains_after_configure"] == 0
    assert result["retains_after_device0"] == 1
    assert result["retains_after_device1"] == 2
    assert result["records"] >= 1
    assert result["last_record_stream"] == 0x5000
    assert result["events_created"] <= result["records"]
    assert result["reserved_after_empty_cache"] == 0
    assert result["driver_live_allocs"] == 0
    assert result["oom"] is not None and "out of memory" in result["oom"]
    assert result["push_minus_pop"] == 0
    assert result["misuse"] == ""


_FAKE_RULES_SOURCE = r"""// The fake driver's VMM rules, each broken once on purpose.
#include <cstdio>
#include <cstring>

#include "cuda/driver_api.hpp"

using namespace pyalloc::cuda_driver;

extern "C" {
CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(CUcontext*, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAddressReserve(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemCreate(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void*, size_t);
CUresult cuMemcpyDtoH_v2(void*, CUdeviceptr, size_t);
long long fake_cuda_get(const char*);
}

#define EXPECT(c) do { if (!(c)) { std::printf("FAILED line %d: %s\n", __LINE__, #c); return 1; } } while (0)

int main() {
  const size_t g = size_t{2} << 20;
  CUcontext ctx;
  EXPECT(cuInit(0) == CUDA_SUCCESS && cuDevicePrimaryCtxRetain(&ctx, 0) == CUDA_SUCCESS);
  EXPECT(cuCtxSetCurrent(ctx) == CUDA_SUCCESS);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUdeviceptr va = 0;
  CUmemGenericAllocationHandle a = 0, b = 0;
  EXPECT(cuMemAddressReserve(&va, 4 * g, 0, 0, 0) == CUDA_SUCCESS);
  EXPECT(cuMemCreate(&a, g, &prop, 0) == CUDA_SUCCESS && cuMemCreate(&b, g, &prop, 0) == CUDA_SUCCESS);
  EXPECT(cuMemMap(va, g, 0, a, 0) == CUDA_SUCCESS && cuMemMap(va + g, g, 0, b, 0) == CUDA_SUCCESS);
  char byte = 7, back = 0;
  // Use before cuMemSetAccess: refused.
  EXPECT(cuMemcpyHtoD_v2(va, &byte, 1) != CUDA_SUCCESS);
  EXPECT(fake_cuda_get("misuse_use_before_access") == 1);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  // Access over half a mapping, or over a range with an unmapped part, is refused; over two
  // mappings laid end to end it is granted to both in one call.
  EXPECT(cuMemSetAccess(va, g / 2, &access, 1) != CUDA_SUCCESS && cuMemSetAccess(va, 3 * g, &access, 1) != CUDA_SUCCESS);
  EXPECT(fake_cuda_get("misuse_bad_access") == 2);
  EXPECT(cuMemcpyHtoD_v2(va, &byte, 1) != CUDA_SUCCESS);  // nothing was granted
  EXPECT(cuMemSetAccess(va, 2 * g, &access, 1) == CUDA_SUCCESS);
  // A copy across the two mappings lands in both handles' bytes.
  char out[4] = {1, 2, 3, 4}, in[4] = {};
  EXPECT(cuMemcpyHtoD_v2(va + g - 2, out, 4) == CUDA_SUCCESS && cuMemcpyDtoH_v2(in, va + g - 2, 4) == CUDA_SUCCESS);
  EXPECT(std::memcmp(in, out, 4) == 0);
  // The same handle mapped a second time shows the same bytes.
  EXPECT(cuMemMap(va + 2 * g, g, 0, a, 0) == CUDA_SUCCESS && cuMemSetAccess(va + 2 * g, g, &access, 1) == CUDA_SUCCESS);
  EXPECT(cuMemcpyDtoH_v2(&back, va + 3 * g - 2, 1) == CUDA_SUCCESS && back == 1);
  // An unmap of half a mapping, or of two mappings at once, is refused and changes nothing.
  EXPECT(cuMemUnmap(va, g / 2) != CUDA_SUCCESS && cuMemUnmap(va, 2 * g) != CUDA_SUCCESS);
  EXPECT(fake_cuda_get("misuse_bad_unmap") == 2);
  EXPECT(cuMemcpyDtoH_v2(in, va + g - 2, 4) == CUDA_SUCCESS && std::memcmp(in, out, 4) == 0);
  // Released while mapped: the bytes live until the last mapping goes.
  EXPECT(cuMemRelease(a) == CUDA_SUCCESS && cuMemUnmap(va, g) == CUDA_SUCCESS);
  EXPECT(cuMemcpyDtoH_v2(&back, va + 3 * g - 2, 1) == CUDA_SUCCESS && back == 1);
  EXPECT(cuMemcpyDtoH_v2(&back, va, 1) != CUDA_SUCCESS);  // unmapped now
  EXPECT(cuMemUnmap(va + g, g) == CUDA_SUCCESS && cuMemUnmap(va + 2 * g, g) == CUDA_SUCCESS);
  EXPECT(cuMemRelease(b) == CUDA_SUCCESS);
  std::printf("ALL OK\n");
  return 0;
}
"""


def test_the_fake_driver_enforces_the_vmm_rules_pyalloc_relies_on(fake_driver: Path, tmp_path: Path) -> None:
    source = tmp_path / "rules.cpp"
    source.write_text(_FAKE_RULES_SOURCE)
    binary = tmp_path / "rules"
    _compile_or_fail([_cxx(), "-std=c++17", "-O1", f"-I{REPO_ROOT}", str(source), f"-L{fake_driver}",
                      "-l:libcuda.so.1", f"-Wl,-rpath,{fake_driver}", "-o", str(binary)])
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout + proc.stderr


# Virtual memory on the fake driver, near a full device: stitching and shared
# granules remap physical handles, and every live block keeps its bytes. The
# fake keeps bytes behind each handle (two mappings of one handle share them),
# refuses a copy through a mapping without cuMemSetAccess, an unmap that is not
# exactly one cuMemMap's range, and the rest of its misuse list.
_VMM_ON_FAKE_DRIVER = _FAKE + """
import random

pyalloc.configure("backend=cuda,vmm=VMM,share=1,oom_report=0")
fake.cuMemcpyHtoD_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_char_p, ctypes.c_size_t]
fake.cuMemcpyDtoH_v2.argtypes = [ctypes.c_char_p, ctypes.c_ulonglong, ctypes.c_size_t]
ctx = ctypes.c_void_p()
assert fake.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert fake.cuCtxSetCurrent(ctx) == 0  # this thread's copies run in device 0's primary context

live = {}  # address -> (size, byte)
rng = random.Random(7)
failed = 0


def fill(ptr, size, byte):
    assert fake.cuMemcpyHtoD_v2(ptr, bytes([byte]) * size, size) == 0, "a copy into a live block failed"


def intact():
    bad = 0
    for ptr, (size, byte) in live.items():
        buf = ctypes.create_string_buffer(size)
        assert fake.cuMemcpyDtoH_v2(buf, ptr, size) == 0, "a copy out of a live block failed"
        bad += buf.raw != bytes([byte]) * size
    return bad


corrupt = 0
for step in range(600):
    if live and (rng.random() < 0.45 or sum(s for s, _ in live.values()) > 60 * MiB):
        ptr = rng.choice(list(live))
        pyalloc.free(ptr, live.pop(ptr)[0])
    else:
        size = rng.choice([MiB // 4, 3 * MiB // 4, 5 * MiB // 4, 9 * MiB // 4, 7 * MiB // 2, 5 * MiB])
        try:
            ptr = pyalloc.malloc(size)
        except pyalloc.PyallocError:
            failed += 1
            continue
        live[ptr] = (size, 1 + step % 251)
        fill(ptr, size, live[ptr][1])
    pyalloc.check(0)
    if step % 50 == 49:
        corrupt += intact()
corrupt += intact()
stats = pyalloc.memory_stats(0)
for ptr, (size, _) in list(live.items()):
    pyalloc.free(ptr, size)
pyalloc.empty_cache()
emit({"corrupt": corrupt, "failed": failed, "stitches": stats["num_stitches"], "reuses": stats["num_reuses"],
      "shared": stats["num_shared_granules"], "moved": stats["num_moved_granules"],
      "device_copies": int(fake.fake_cuda_get(b"copy_device")), "maps": int(fake.fake_cuda_get(b"map")),
      "unmaps": int(fake.fake_cuda_get(b"unmap")),
      "reserved_after": pyalloc.memory_stats(0)["reserved_bytes.all.current"],
      "misuse": fake.fake_cuda_misuse_report().decode()})
"""


@pytest.mark.parametrize("vmm", ["shared", "all"])
def test_virtual_memory_on_the_fake_driver_keeps_every_byte_near_a_full_device(fake_driver: Path, vmm: str) -> None:
    result = _run_python(_VMM_ON_FAKE_DRIVER.replace("VMM", vmm),
                         {"LD_LIBRARY_PATH": str(fake_driver), "FAKE_CUDA_CAPACITY_MIB": "64"})
    assert result["misuse"] == ""
    assert result["corrupt"] == 0
    # The paths that remap were taken: granules moved between blocks (stitching near the limit,
    # or reuse before growing: with cold donors, vmm=shared on this churn reuses and never
    # stitches; vmm=all stitches), and shared.
    assert result["stitches"] + result["reuses"] > 0 and result["shared"] > 0
    # Slivers moved (Note [Moving slivers]): one device-to-device copy per pair, every byte kept.
    assert result["moved"] > 0 and result["device_copies"] == result["moved"], result
    assert result["maps"] > 0 and result["unmaps"] > 0
    assert result["reserved_after"] == 0


# One growth of an arena by many granules, and their release: what the driver is asked
# (Note [Backend time], Note [Extents]). The request's memory comes in extents of the largest
# power of two of granules that is at most a sixteenth of it (up to `extent`), each one
# cuMemCreate and one cuMemMap; access is granted to the whole range at once, and the device is
# synchronized once per range unmapped, not once per chunk.
_GROWTH_CALLS = _FAKE + """
def counts():
    return {k: int(fake.fake_cuda_get(k.encode())) for k in ("map", "set_access", "unmap", "synchronize")}


out = {}
for extent, size in (("2MiB", 64 * MiB), ("32MiB", 64 * MiB), ("32MiB", 1024 * MiB)):
    pyalloc.configure("backend=cuda,vmm=shared,oom_report=0,extent=" + extent)
    pyalloc.reset_accumulated_memory_stats(0)
    before = counts()
    p = pyalloc.malloc(size)
    grown = counts()
    pyalloc.free(p, size)
    pyalloc.empty_cache()
    released = counts()
    stats = pyalloc.memory_stats(0)
    out[f"{extent} {size // MiB}"] = {
        "grown": {k: grown[k] - before[k] for k in before}, "released": {k: released[k] - grown[k] for k in before},
        "calls": stats["backend_memory_calls"], "ns": stats["backend_memory_ns"],
        "reserved_after": stats["reserved_bytes.all.current"]}
out["misuse"] = fake.fake_cuda_misuse_report().decode()
emit(out)
"""


@pytest.mark.parametrize("case, chunks", [("2MiB 64", 32), ("32MiB 64", 16), ("32MiB 1024", 32)],
                         ids=["granules", "4MiB-extents", "32MiB-extents"])
def test_an_arenas_growth_maps_few_chunks_grants_access_once_and_synchronizes_once(
        fake_driver: Path, case: str, chunks: int) -> None:
    """extent=2MiB maps 64 MiB granule by granule (32); by default a 64 MiB request gets
    extents of 4 MiB (16) and one of 1 GiB extents of 32 MiB (32)."""
    r = _run_python(_GROWTH_CALLS, {"LD_LIBRARY_PATH": str(fake_driver), "FAKE_CUDA_CAPACITY_MIB": "1536"})
    assert r["misuse"] == ""
    c = r[case]
    assert c["grown"]["map"] == chunks and c["grown"]["set_access"] == 1, c["grown"]
    assert c["released"]["unmap"] == chunks and c["released"]["synchronize"] == 1, c["released"]
    assert c["reserved_after"] == 0
    # Every backend call was metered: a create, a release per chunk, one map_range, one unmap_range.
    assert c["calls"] >= chunks + 1 + 1 + chunks and c["ns"] > 0


# A growth whose map fails part-way (the 5th of 32 cuMemMap), or whose access grant fails, leaves
# nothing half done: map_range is all or none, the handles go back, the allocator's walk agrees, and
# once everything is freed no handle, mapping or reserved byte is left.
_FAILED_MAP = _FAKE + """
fake.fake_cuda_set.argtypes = [ctypes.c_char_p, ctypes.c_longlong]
pyalloc.configure("backend=cuda,vmm=shared,oom_report=0")
out = {}
for name, knob, value in (("map", b"fail_map_in", 5), ("access", b"fail_set_access", 1)):
    fake.fake_cuda_set(knob, value)
    try:
        p = pyalloc.malloc(64 * MiB)
    except pyalloc.PyallocError as exc:
        p, out[name + "_error"] = None, str(exc)
    pyalloc.check(0)
    if p is not None:
        pyalloc.free(p, 64 * MiB)
    pyalloc.empty_cache()
    pyalloc.check(0)
    s = pyalloc.memory_stats(0)
    out[name] = {"served": p is not None, "reserved": s["reserved_bytes.all.current"],
                 "created": s["num_device_alloc"], "released": s["num_device_free"],
                 "live_handles": int(fake.fake_cuda_get(b"live_handles")),
                 "live_mappings": int(fake.fake_cuda_get(b"live_mappings"))}
out["injected"] = [int(fake.fake_cuda_get(k)) for k in (b"injected_map_failures", b"injected_access_failures")]
out["misuse"] = fake.fake_cuda_misuse_report().decode()
emit(out)
"""


def test_a_growth_whose_map_fails_part_way_leaves_nothing_behind(fake_driver: Path) -> None:
    r = _run_python(_FAILED_MAP, {"LD_LIBRARY_PATH": str(fake_driver), "FAKE_CUDA_CAPACITY_MIB": "256"})
    assert r["injected"] == [1, 1]
    assert r["misuse"] == ""
    for name in ("map", "access"):
        got = r[name]
        assert got["reserved"] == 0 and got["created"] == got["released"], (name, got)
        assert got["live_mappings"] == 0 and got["live_handles"] == 0, (name, got)
        # The failure is the driver's, once: the slow path's next try (a stitch) maps afresh.
        assert got["served"], (name, r.get(name + "_error"))


# vmm=auto is decided by the backend: shared on one cuda device with virtual memory. Asking for
# vmm=off after it is a change of layout (a new runtime), though the config's own word for the
# first one was "auto" (whose vmm_mode() on cuda reads off): found by a reader, config() said off
# while a 512 B block still went to an arena.
_VMM_AFTER_AUTO = _FAKE + """
def small_pool_segments():
    return pyalloc.memory_stats(0)["segment.small_pool.current"]


pyalloc.configure("backend=cuda")
p = pyalloc.malloc(512)
auto = {"vmm": pyalloc.config()["vmm"], "small_segments": small_pool_segments()}
# While a block is live, a change of the resolved mode is refused with a reason that names vmm;
# asking for the mode auto resolved to is no change at all.
try:
    pyalloc.configure("backend=cuda,vmm=off")
    refused = None
except pyalloc.PyallocError as exc:
    refused = str(exc)
pyalloc.configure("backend=cuda,vmm=shared")
same_kept_block = pyalloc.memory_stats(0)["allocation.all.current"]
pyalloc.free(p, 512)
pyalloc.configure("backend=cuda,vmm=off")
p = pyalloc.malloc(512)
off = {"vmm": pyalloc.config()["vmm"], "small_segments": small_pool_segments()}
pyalloc.free(p, 512)
pyalloc.configure("backend=cuda,vmm=auto")
p = pyalloc.malloc(512)
back = {"small_segments": small_pool_segments()}
pyalloc.free(p, 512)
emit({"auto": auto, "off": off, "back": back, "refused": refused, "same_kept_block": same_kept_block,
      "misuse": fake.fake_cuda_misuse_report().decode()})
"""


def test_vmm_off_after_auto_on_cuda_rebuilds_the_runtime(fake_driver: Path) -> None:
    r = _run_python(_VMM_AFTER_AUTO, {"LD_LIBRARY_PATH": str(fake_driver), "FAKE_CUDA_DEVICES": "1"})
    assert r["misuse"] == ""
    assert r["auto"]["small_segments"] == 0  # vmm=shared: no small pool
    assert r["refused"] is not None and "vmm" in r["refused"] and "512 bytes are allocated" in r["refused"], r
    assert r["same_kept_block"] == 1  # vmm=shared after auto (resolved to shared): the same runtime
    assert r["off"] == {"vmm": "off", "small_segments": 1}, r["off"]  # a plain 2 MiB small segment
    assert r["back"]["small_segments"] == 0


_DEFAULT_VMM = _FAKE + """
pyalloc.configure("backend=cuda")
p = pyalloc.malloc(9 * MiB // 2)
out = {"maps": int(fake.fake_cuda_get(b"map")), "plain": int(fake.fake_cuda_get(b"live_allocs"))}
pyalloc.free(p, 9 * MiB // 2)
pyalloc.empty_cache()
out["misuse"] = fake.fake_cuda_misuse_report().decode()
emit(out)
"""


@pytest.mark.parametrize(("fake_env", "arenas"), [
    ({"FAKE_CUDA_DEVICES": "1"}, True),
    ({"FAKE_CUDA_DEVICES": "2"}, False),
    ({"FAKE_CUDA_DEVICES": "1", "FAKE_CUDA_NO_VMM": "1"}, False),
], ids=["one-device", "two-devices", "no-vmm-support"])
def test_vmm_auto_on_cuda_uses_arenas_on_a_single_device_that_supports_them(
    fake_driver: Path, fake_env: dict[str, str], arenas: bool
) -> None:
    """vmm=auto on cuda: arenas where the process sees one device with virtual
    memory; plain segments with several (peer access to mappings is not granted
    yet) or without support."""
    result = _run_python(_DEFAULT_VMM, {"LD_LIBRARY_PATH": str(fake_driver), **fake_env})
    assert result["misuse"] == ""
    assert (result["maps"] > 0, result["plain"] == 0) == (arenas, arenas)


_IPC_ON_FAKE_DRIVER = _FAKE + """
fake.fake_cuda_bytes.restype = ctypes.c_void_p
fake.fake_cuda_bytes.argtypes = [ctypes.c_ulonglong]
pyalloc.configure("backend=cuda,VMM")
pyalloc.malloc(1 * MiB)
size = 5 * MiB + 4096
p = pyalloc.malloc(size)
handle, offset = pyalloc.ipc_export(p)
base = pyalloc.ipc_import(handle)
out = {"same_bytes": [fake.fake_cuda_bytes(p + k) == fake.fake_cuda_bytes(base + offset + k) for k in (0, size - 1)],
       "distinct_address": base + offset != p}
pyalloc.ipc_close(base)
pyalloc.ipc_export(p)  # again: the exported descriptors are kept, not made anew
pyalloc.free(p, size)
pyalloc.empty_cache()
for name in ("export", "import", "ipc_get", "ipc_open", "ipc_close", "live_mappings"):
    out[name] = int(fake.fake_cuda_get(name.encode()))
out["misuse"] = fake.fake_cuda_misuse_report().decode()
emit(out)
"""


def test_an_arena_block_is_shared_through_exported_granules_on_the_fake_driver(fake_driver: Path) -> None:
    result = _run_python(_IPC_ON_FAKE_DRIVER.replace("VMM", "vmm=shared"), {"LD_LIBRARY_PATH": str(fake_driver)})
    assert result["misuse"] == ""
    assert result["same_bytes"] == [True, True]  # the import maps the exporter's memory, block contiguous
    assert result["distinct_address"]  # at an address of its own
    assert result["export"] == 4 and result["import"] == 4  # 5 MiB + 4 KiB at 1 MiB: granules 0-3 of 2 MiB
    assert result["ipc_get"] == 0


def test_a_plain_segment_is_shared_through_cuipcgetmemhandle_on_the_fake_driver(fake_driver: Path) -> None:
    result = _run_python(_IPC_ON_FAKE_DRIVER.replace("VMM", "vmm=off"), {"LD_LIBRARY_PATH": str(fake_driver)})
    assert result["misuse"] == ""
    assert result["same_bytes"] == [True, True]
    assert (result["ipc_get"], result["ipc_open"], result["ipc_close"]) == (2, 1, 1)
    assert result["export"] == 0


_IPC_WITHOUT_SYMBOLS = _FAKE + """
pyalloc.configure("backend=cuda,vmm=shared")
p = pyalloc.malloc(3 * MiB)
try:
    pyalloc.ipc_export(p)
    emit("exported")
except pyalloc.PyallocError as e:
    emit(str(e))
"""


@pytest.fixture(scope="module")
def fake_driver_without_ipc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fake libcuda.so.1 without the sharing functions: the driver still loads."""
    return _build_fake_driver(tmp_path_factory.mktemp("fake_libcuda_no_ipc"), "-DFAKE_OMIT_IPC")


def test_a_driver_without_the_sharing_functions_loads_and_names_them(fake_driver_without_ipc: Path) -> None:
    message = _run_python(_IPC_WITHOUT_SYMBOLS, {"LD_LIBRARY_PATH": str(fake_driver_without_ipc)})
    assert message == ("pyalloc_ipc_export: cuda device 0: libcuda.so.1 has no cuMemExportToShareableHandle, which "
                       "sharing memory with another process needs (update the NVIDIA driver)")


_CONFIGURE_CUDA = """
import pyalloc

try:
    pyalloc.configure("backend=cuda")
    outcome = {"raised": False, "message": ""}
except pyalloc.PyallocError as exc:
    outcome = {"raised": True, "message": str(exc)}
outcome["backend_after"] = pyalloc.config()["backend"]
emit(outcome)
"""


@pytest.mark.parametrize(
    ("fake_env", "expected"),
    [
        ({"FAKE_CUDA_INIT_ERROR": "100"}, "cuInit failed: CUDA_ERROR_NO_DEVICE"),
        ({"FAKE_CUDA_DEVICES": "0"}, "sees no CUDA device"),
    ],
    ids=["cuinit-fails", "no-devices"],
)
def test_configure_cuda_reports_why_the_driver_cannot_start(
    fake_driver: Path, fake_env: dict[str, str], expected: str
) -> None:
    result = _run_python(_CONFIGURE_CUDA, {"LD_LIBRARY_PATH": str(fake_driver), **fake_env})
    assert result["raised"]
    assert expected in result["message"]
    assert "backend=host" in result["message"]
    assert result["backend_after"] == "host"


def test_configure_cuda_names_a_missing_driver_symbol(
    fake_driver_without_cumemcreate: Path,
) -> None:
    env = {"LD_LIBRARY_PATH": str(fake_driver_without_cumemcreate)}
    result = _run_python(_CONFIGURE_CUDA, env)
    assert result["raised"]
    assert "has no cuMemCreate" in result["message"]
    assert "libcuda.so.1" in result["message"]




# ---- sources of the fake driver and the harness -----------------------------------------------

FAKE_LIBCUDA_SOURCE = r'''// A fake libcuda.so.1 for testing the cuda backend without a GPU.
//
// It exports only the (versioned) symbols the backend resolves, keeps a
// thread-local context stack like the real driver, hands out host memory
// for cuMemAlloc (so copies really copy), fakes the VMM calls with
// bookkeeping, and counts every misuse it can see: a call that needs a
// current context made without one, a pop of an empty stack, a call before
// cuInit, a mapping outside a reservation, an unmap of unmapped memory.
// Behaviour is set with environment variables (read in cuInit) and
// fake_cuda_set(); counters are read with fake_cuda_get().
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/driver_api.hpp"

using namespace pyalloc::cuda_driver;

#define EXPORT extern "C" __attribute__((visibility("default")))

constexpr CUresult kInvalidContext = static_cast<CUresult>(201);
constexpr size_t kGranularity = size_t{2} << 20;

struct CUctx_st_fake {
  int device;
};

namespace {

std::mutex g_mutex;
bool g_initialized = false;
int g_devices = 2;
size_t g_capacity = size_t{256} << 20;
int g_event_delay = 0;
int g_query_error = 0;
// Injected failures (fake_cuda_set): the n-th cuMemMap from now, or the next
// cuMemSetAccess, fails with CUDA_ERROR_OUT_OF_MEMORY, once.
long long g_fail_map_in = 0;
bool g_fail_set_access = false;
bool g_no_vmm = false;
std::map<std::string, long long> g_counters;
std::vector<CUctx_st_fake*> g_primary;      // per device
std::vector<int> g_primary_retains;
std::vector<size_t> g_used;                 // per device
CUctx_st_fake g_foreign{-1};
struct Alloc { size_t size; int device; void* host; };
std::map<CUdeviceptr, Alloc> g_allocs;
struct Reservation { size_t size; };
std::map<CUdeviceptr, Reservation> g_reservations;
struct Handle {
  size_t size; int device; bool released; int mappings; std::vector<char>* bytes;
  bool exportable = false;  // made with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
  bool imported = false;    // another handle's bytes (cuMemImportFromShareableHandle): not ours to free
};
std::map<CUmemGenericAllocationHandle, Handle> g_handles;
struct Mapping { size_t size; CUmemGenericAllocationHandle handle; bool access; };
std::map<CUdeviceptr, Mapping> g_mappings;
CUmemGenericAllocationHandle g_next_handle = 1;
CUdeviceptr g_next_va = 0x7e0000000000ull;
struct Event { int device; int pending; bool recorded; };
std::map<CUevent, Event*> g_events;

thread_local std::vector<CUcontext> t_stack;

void count(const char* name) { ++g_counters[name]; }

CUctx_st_fake* current() {
  return t_stack.empty() ? nullptr : reinterpret_cast<CUctx_st_fake*>(t_stack.back());
}

long long env_or(const char* name, long long fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoll(v) : fallback;
}

}  // namespace

#define NEED_INIT                       \
  if (!g_initialized) {                 \
    count("misuse_before_init");        \
    return CUDA_ERROR_NOT_INITIALIZED;  \
  }
#define NEED_CONTEXT                    \
  NEED_INIT                             \
  CUctx_st_fake* ctx = current();       \
  if (ctx == nullptr || ctx->device < 0) { \
    count("misuse_no_context");         \
    return kInvalidContext;             \
  }

EXPORT CUresult cuGetErrorName(CUresult rc, const char** out) {
  switch (static_cast<int>(rc)) {
    case 0: *out = "CUDA_SUCCESS"; return CUDA_SUCCESS;
    case 1: *out = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
    case 2: *out = "CUDA_ERROR_OUT_OF_MEMORY"; return CUDA_SUCCESS;
    case 3: *out = "CUDA_ERROR_NOT_INITIALIZED"; return CUDA_SUCCESS;
    case 4: *out = "CUDA_ERROR_DEINITIALIZED"; return CUDA_SUCCESS;
    case 100: *out = "CUDA_ERROR_NO_DEVICE"; return CUDA_SUCCESS;
    case 201: *out = "CUDA_ERROR_INVALID_CONTEXT"; return CUDA_SUCCESS;
    case 600: *out = "CUDA_ERROR_NOT_READY"; return CUDA_SUCCESS;
    case 700: *out = "CUDA_ERROR_ILLEGAL_ADDRESS"; return CUDA_SUCCESS;
    case 801: *out = "CUDA_ERROR_NOT_SUPPORTED"; return CUDA_SUCCESS;
    default: *out = nullptr; return CUDA_ERROR_INVALID_VALUE;
  }
}

EXPORT CUresult cuGetErrorString(CUresult rc, const char** out) {
  switch (static_cast<int>(rc)) {
    case 2: *out = "out of memory"; return CUDA_SUCCESS;
    case 100: *out = "no CUDA-capable device is detected"; return CUDA_SUCCESS;
    case 700: *out = "an illegal memory access was encountered"; return CUDA_SUCCESS;
    default: *out = nullptr; return CUDA_ERROR_INVALID_VALUE;
  }
}

EXPORT CUresult cuInit(unsigned int flags) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  const long long forced = env_or("FAKE_CUDA_INIT_ERROR", 0);
  if (forced != 0) return static_cast<CUresult>(forced);
  if (!g_initialized) {
    g_devices = static_cast<int>(env_or("FAKE_CUDA_DEVICES", 2));
    g_capacity = static_cast<size_t>(env_or("FAKE_CUDA_CAPACITY_MIB", 256)) << 20;
    g_event_delay = static_cast<int>(env_or("FAKE_CUDA_EVENT_DELAY", 0));
    g_no_vmm = env_or("FAKE_CUDA_NO_VMM", 0) != 0;
    for (int i = 0; i < g_devices; ++i) {
      g_primary.push_back(new CUctx_st_fake{i});
      g_primary_retains.push_back(0);
      g_used.push_back(0);
    }
    g_initialized = true;
  }
  count("cuInit");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int* n) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  *n = g_devices;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice* dev, int ordinal) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  if (ordinal < 0 || ordinal >= g_devices) return CUDA_ERROR_INVALID_VALUE;
  *dev = ordinal;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int* value, CUdevice_attribute attr, CUdevice dev) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  if (dev < 0 || dev >= g_devices) return CUDA_ERROR_INVALID_VALUE;
  if (attr != CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) return CUDA_ERROR_INVALID_VALUE;
  *value = g_no_vmm ? 0 : 1;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  if (dev < 0 || dev >= g_devices) return CUDA_ERROR_INVALID_VALUE;
  *bytes = g_capacity;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  if (dev < 0 || dev >= g_devices) return CUDA_ERROR_INVALID_VALUE;
  *flags = 0;
  *active = g_primary_retains[dev] > 0 ? 1 : 0;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  if (dev < 0 || dev >= g_devices) return CUDA_ERROR_INVALID_VALUE;
  ++g_primary_retains[dev];
  count("retain");
  *ctx = reinterpret_cast<CUcontext>(g_primary[dev]);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext* ctx) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  *ctx = t_stack.empty() ? nullptr : t_stack.back();
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  t_stack.push_back(ctx);
  count("push");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext* ctx) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  if (t_stack.empty()) {
    count("misuse_bad_pop");
    return kInvalidContext;
  }
  if (ctx != nullptr) *ctx = t_stack.back();
  t_stack.pop_back();
  count("pop");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSynchronize() {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  for (auto& e : g_events) {
    if (e.second->device == ctx->device) e.second->pending = 0;
  }
  count("synchronize");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* ptr, size_t size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  const size_t rounded = (size + kGranularity - 1) / kGranularity * kGranularity;
  if (g_used[ctx->device] + rounded > g_capacity) return CUDA_ERROR_OUT_OF_MEMORY;
  void* host = std::aligned_alloc(kGranularity, rounded);  // untouched pages cost nothing
  if (host == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  g_used[ctx->device] += rounded;
  *ptr = reinterpret_cast<CUdeviceptr>(host);
  g_allocs[*ptr] = Alloc{rounded, ctx->device, host};
  count("alloc");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  auto it = g_allocs.find(ptr);
  if (it == g_allocs.end()) {
    count("misuse_bad_free");
    return CUDA_ERROR_INVALID_VALUE;
  }
  g_used[it->second.device] -= it->second.size;
  std::free(it->second.host);
  g_allocs.erase(it);
  count("free");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  *free_bytes = g_capacity - g_used[ctx->device];
  *total_bytes = g_capacity;
  return CUDA_SUCCESS;
}

static bool prop_ok(const CUmemAllocationProp* prop) {
  return prop != nullptr && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
         (prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_NONE ||
          prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) &&
         prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && prop->location.id >= 0 &&
         prop->location.id < g_devices && prop->win32HandleMetaData == nullptr &&
         prop->allocFlags.compressionType == 0;
}

EXPORT CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                              CUmemAllocationGranularity_flags option) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  if (g_no_vmm) return CUDA_ERROR_NOT_SUPPORTED;
  if (!prop_ok(prop) || option != CU_MEM_ALLOC_GRANULARITY_MINIMUM) return CUDA_ERROR_INVALID_VALUE;
  *granularity = kGranularity;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  if (size == 0 || size % kGranularity != 0 || (alignment != 0 && alignment % kGranularity != 0) ||
      addr != 0 || flags != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  *ptr = g_next_va;
  g_next_va += size + kGranularity;  // a guard gap between reservations
  g_reservations[*ptr] = Reservation{size};
  count("reserve");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  auto it = g_reservations.find(ptr);
  if (it == g_reservations.end() || it->second.size != size) {
    count("misuse_bad_address_free");
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (auto& m : g_mappings) {
    if (m.first >= ptr && m.first < ptr + size) {
      count("misuse_address_free_while_mapped");
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  g_reservations.erase(it);
  count("address_free");
  return CUDA_SUCCESS;
}

#ifndef FAKE_OMIT_CUMEMCREATE  // the variant for the missing-symbol test
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                            const CUmemAllocationProp* prop, unsigned long long flags) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  if (!prop_ok(prop) || flags != 0 || size == 0 || size % kGranularity != 0) {
    count("misuse_bad_create");
    return CUDA_ERROR_INVALID_VALUE;
  }
  const int device = prop->location.id;
  if (g_used[device] + size > g_capacity) return CUDA_ERROR_OUT_OF_MEMORY;
  g_used[device] += size;
  *handle = g_next_handle++;
  g_handles[*handle] = Handle{size, device, false, 0, new std::vector<char>(size, 0)};
  g_handles[*handle].exportable = prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  count("create");
  return CUDA_SUCCESS;
}
#endif

static void maybe_drop_handle(CUmemGenericAllocationHandle h) {
  auto it = g_handles.find(h);
  if (it != g_handles.end() && it->second.released && it->second.mappings == 0) {
    if (!it->second.imported) {
      g_used[it->second.device] -= it->second.size;
      delete it->second.bytes;
    }
    g_handles.erase(it);
  }
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  auto it = g_handles.find(handle);
  if (it == g_handles.end() || it->second.released) {
    count("misuse_bad_release");
    return CUDA_ERROR_INVALID_VALUE;
  }
  it->second.released = true;
  maybe_drop_handle(handle);
  count("release");
  return CUDA_SUCCESS;
}

static bool inside_reservation(CUdeviceptr ptr, size_t size) {
  for (auto& r : g_reservations) {
    if (ptr >= r.first && ptr + size <= r.first + r.second.size) return true;
  }
  return false;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                         CUmemGenericAllocationHandle handle, unsigned long long flags) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  if (g_fail_map_in > 0 && --g_fail_map_in == 0) {
    count("injected_map_failures");
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  auto h = g_handles.find(handle);
  if (h == g_handles.end() || h->second.released || offset != 0 || flags != 0 ||
      size != h->second.size || ptr % kGranularity != 0 || !inside_reservation(ptr, size)) {
    count("misuse_bad_map");
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (auto& m : g_mappings) {
    if (ptr < m.first + m.second.size && m.first < ptr + size) {
      count("misuse_map_overlap");
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  g_mappings[ptr] = Mapping{size, handle, false};
  ++h->second.mappings;
  count("map");
  return CUDA_SUCCESS;
}

// The range must be fully mapped and hold whole mappings (one, or several
// laid end to end), as the real driver asks.
EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t n) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  if (g_fail_set_access) {
    g_fail_set_access = false;
    count("injected_access_failures");
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  bool ok = size != 0 && desc != nullptr && n == 1 && desc->location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
            desc->flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (CUdeviceptr at = ptr; ok && at < ptr + size;) {
    auto m = g_mappings.find(at);
    ok = m != g_mappings.end() && at + m->second.size <= ptr + size &&
         desc->location.id == g_handles[m->second.handle].device;
    if (ok) at += m->second.size;
  }
  if (!ok) {
    count("misuse_bad_access");
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (CUdeviceptr at = ptr; at < ptr + size; at += g_mappings[at].size) g_mappings[at].access = true;
  count("set_access");
  return CUDA_SUCCESS;
}

// The real driver unmaps the whole range one cuMemMap mapped, and nothing
// else: a sub-range, or a range over two mappings, is refused, and the
// mappings stay as they were.
EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  auto it = g_mappings.find(ptr);
  if (it == g_mappings.end() || it->second.size != size) {
    count("misuse_bad_unmap");
    return CUDA_ERROR_INVALID_VALUE;
  }
  const CUmemGenericAllocationHandle h = it->second.handle;
  --g_handles[h].mappings;
  g_mappings.erase(it);
  maybe_drop_handle(h);
  count("unmap");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuEventCreate(CUevent* event, unsigned int flags) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  if (flags != CU_EVENT_DISABLE_TIMING) count("events_with_timing");
  Event* e = new Event{ctx->device, 0, false};
  *event = reinterpret_cast<CUevent>(e);
  g_events[*event] = e;
  count("event_create");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuEventDestroy_v2(CUevent event) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  auto it = g_events.find(event);
  if (it == g_events.end()) {
    count("misuse_bad_event");
    return CUDA_ERROR_INVALID_VALUE;
  }
  delete it->second;
  g_events.erase(it);
  count("event_destroy");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(CUevent event, CUstream stream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  auto it = g_events.find(event);
  if (it == g_events.end() || it->second->device != ctx->device) {
    count("misuse_bad_event");
    return CUDA_ERROR_INVALID_VALUE;
  }
  it->second->pending = g_event_delay;
  it->second->recorded = true;
  g_counters["last_record_stream"] = static_cast<long long>(reinterpret_cast<uintptr_t>(stream));
  count("event_record");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuEventQuery(CUevent event) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  auto it = g_events.find(event);
  if (it == g_events.end()) {
    count("misuse_bad_event");
    return CUDA_ERROR_INVALID_VALUE;
  }
  count("event_query");
  if (g_query_error != 0) return static_cast<CUresult>(g_query_error);
  if (it->second->pending > 0) {
    --it->second->pending;
    return CUDA_ERROR_NOT_READY;
  }
  return CUDA_SUCCESS;
}

EXPORT CUresult cuEventSynchronize(CUevent event) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  auto it = g_events.find(event);
  if (it == g_events.end()) {
    count("misuse_bad_event");
    return CUDA_ERROR_INVALID_VALUE;
  }
  it->second->pending = 0;
  count("event_synchronize");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamWaitEvent(CUstream, CUevent event, unsigned int flags) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  if (g_events.find(event) == g_events.end() || flags != 0) {
    count("misuse_bad_event");
    return CUDA_ERROR_INVALID_VALUE;
  }
  count("stream_wait");
  return CUDA_SUCCESS;
}

// Host memory behind a cuMemAlloc range, or nullptr.
static char* host_range(CUdeviceptr ptr, size_t size) {
  auto it = g_allocs.upper_bound(ptr);
  if (it == g_allocs.begin()) return nullptr;
  --it;
  if (ptr + size > it->first + it->second.size) return nullptr;
  return static_cast<char*>(it->second.host) + (ptr - it->first);
}

// Calls fn(host bytes, count, offset into the copy) for each piece of
// [ptr, ptr + size): one piece in a cuMemAlloc range, else one per mapping
// the range crosses (the bytes of the mapped handle: two mappings of one
// handle share them, as on a GPU). False when a byte is not device memory,
// or lies in a mapping without access (cuMemSetAccess must come first).
template <typename F>
static bool for_each_piece(CUdeviceptr ptr, size_t size, F fn) {
  if (char* host = host_range(ptr, size)) {
    fn(host, size, size_t{0});
    return true;
  }
  size_t done = 0;
  while (done < size) {
    const CUdeviceptr at = ptr + done;
    auto it = g_mappings.upper_bound(at);
    if (it == g_mappings.begin()) return false;
    --it;
    if (at >= it->first + it->second.size) return false;
    if (!it->second.access) {
      count("misuse_use_before_access");
      return false;
    }
    const size_t n = std::min<size_t>(size - done, it->first + it->second.size - at);
    fn(g_handles[it->second.handle].bytes->data() + (at - it->first), n, done);
    done += n;
  }
  return true;
}

static CUresult copy_to_host(void* dst, CUdeviceptr src, size_t size) {
  char* out = static_cast<char*>(dst);
  if (!for_each_piece(src, size, [&](char* host, size_t n, size_t at) { std::memcpy(out + at, host, n); })) {
    count("misuse_bad_copy");
    return CUDA_ERROR_INVALID_VALUE;
  }
  count("copy_to_host");
  return CUDA_SUCCESS;
}

static CUresult copy_to_device(CUdeviceptr dst, const void* src, size_t size) {
  const char* in = static_cast<const char*>(src);
  if (!for_each_piece(dst, size, [&](char* host, size_t n, size_t at) { std::memcpy(host, in + at, n); })) {
    count("misuse_bad_copy");
    return CUDA_ERROR_INVALID_VALUE;
  }
  count("copy_to_device");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t size, CUstream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  return copy_to_host(dst, src, size);
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t size, CUstream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  return copy_to_device(dst, src, size);
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t size, CUstream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  std::vector<char> staged(size);
  char* bytes = staged.data();
  if (!for_each_piece(src, size, [&](char* host, size_t n, size_t at) { std::memcpy(bytes + at, host, n); }) ||
      !for_each_piece(dst, size, [&](char* host, size_t n, size_t at) { std::memcpy(host, bytes + at, n); })) {
    count("misuse_bad_copy");
    return CUDA_ERROR_INVALID_VALUE;
  }
  count("copy_device");
  return CUDA_SUCCESS;
}

// ---- used by tests/gpu/test_cuda_backend_direct.py's checks, not by pyalloc ----------

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  if (!t_stack.empty()) t_stack.pop_back();
  if (ctx != nullptr) t_stack.push_back(ctx);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  return copy_to_device(dst, src, size);
}

EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  return copy_to_host(dst, src, size);
}

// Attributes 1 (CU_POINTER_ATTRIBUTE_CONTEXT) and 9 (..._DEVICE_ORDINAL).
EXPORT CUresult cuPointerGetAttribute(void* data, int attribute, CUdeviceptr ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  auto it = g_allocs.upper_bound(ptr);
  if (it == g_allocs.begin()) return CUDA_ERROR_INVALID_VALUE;
  --it;
  if (ptr >= it->first + it->second.size) return CUDA_ERROR_INVALID_VALUE;
  if (attribute == 1) {
    *static_cast<CUcontext*>(data) = reinterpret_cast<CUcontext>(g_primary[it->second.device]);
  } else if (attribute == 9) {
    *static_cast<int*>(data) = it->second.device;
  } else {
    return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreate(CUstream* stream, unsigned int) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  static uintptr_t next_stream = 0x10000;
  *stream = reinterpret_cast<CUstream>(next_stream++);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(CUstream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  for (auto& e : g_events) e.second->pending = 0;
  return CUDA_SUCCESS;
}

// ---- sharing with other processes ------------------------------------------------
// One process stands for both sides: an exported handle is a memfd named after
// it, which the importer (after taking it with pidfd_getfd) reads back from
// /proc/self/fd; an imported handle maps the exporter's bytes. A cuMemAlloc
// segment's IPC handle names its address, and opening it gives that address.

#ifndef FAKE_OMIT_IPC  // the variant of a driver without them
EXPORT CUresult cuMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle handle,
                                             CUmemAllocationHandleType type, unsigned long long flags) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  auto it = g_handles.find(handle);
  if (it == g_handles.end() || it->second.released || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
      flags != 0 || out == nullptr) {
    count("misuse_bad_export");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!it->second.exportable) {
    count("misuse_export_of_unexportable");
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  const std::string name = "fake-cuda-handle-" + std::to_string(handle);
  *static_cast<int*>(out) = memfd_create(name.c_str(), MFD_CLOEXEC);
  count("export");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* out, void* os_handle,
                                               CUmemAllocationHandleType type) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_INIT
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(os_handle));
  char link[256] = {0};
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = readlink(path.c_str(), link, sizeof link - 1);
  const std::string target = n > 0 ? std::string(link, static_cast<size_t>(n)) : "";
  const size_t at = target.find("fake-cuda-handle-");
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || at == std::string::npos) {
    count("misuse_bad_import");
    return CUDA_ERROR_INVALID_VALUE;
  }
  const CUmemGenericAllocationHandle source = std::strtoull(target.c_str() + at + 17, nullptr, 10);
  auto it = g_handles.find(source);
  if (it == g_handles.end()) {
    count("misuse_import_of_released");
    return CUDA_ERROR_INVALID_VALUE;
  }
  *out = g_next_handle++;
  g_handles[*out] = Handle{it->second.size, it->second.device, false, 0, it->second.bytes};
  g_handles[*out].imported = true;
  count("import");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle* handle, CUdeviceptr ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  if (g_allocs.find(ptr) == g_allocs.end()) {
    count("misuse_ipc_of_unknown");
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::memset(handle->reserved, 0, sizeof handle->reserved);
  std::memcpy(handle->reserved, &ptr, sizeof ptr);
  count("ipc_get");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* ptr, CUipcMemHandle handle, unsigned int flags) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  std::memcpy(ptr, handle.reserved, sizeof *ptr);
  if (flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS || g_allocs.find(*ptr) == g_allocs.end()) {
    count("misuse_bad_ipc_open");
    return CUDA_ERROR_INVALID_VALUE;
  }
  count("ipc_open");
  return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  NEED_CONTEXT
  if (g_allocs.find(ptr) == g_allocs.end()) count("misuse_bad_ipc_close");
  count("ipc_close");
  return CUDA_SUCCESS;
}
#endif

// The host bytes behind device address `va` (a mapping's or a segment's), or null.
EXPORT const void* fake_cuda_bytes(CUdeviceptr va) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto& m : g_mappings) {
    if (va >= m.first && va < m.first + m.second.size) {
      return g_handles[m.second.handle].bytes->data() + (va - m.first);
    }
  }
  for (auto& a : g_allocs) {
    if (va >= a.first && va < a.first + a.second.size) return static_cast<char*>(a.second.host) + (va - a.first);
  }
  return nullptr;
}

// ---- test controls --------------------------------------------------------------

EXPORT long long fake_cuda_get(const char* name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const std::string key = name;
  if (key == "stack_depth") return static_cast<long long>(t_stack.size());
  if (key == "live_allocs") return static_cast<long long>(g_allocs.size());
  if (key == "live_events") return static_cast<long long>(g_events.size());
  if (key == "live_handles") return static_cast<long long>(g_handles.size());
  if (key == "live_mappings") return static_cast<long long>(g_mappings.size());
  if (key == "live_reservations") return static_cast<long long>(g_reservations.size());
  if (key == "misuse") {
    long long total = 0;
    for (auto& c : g_counters) {
      if (c.first.rfind("misuse_", 0) == 0) total += c.second;
    }
    return total;
  }
  auto it = g_counters.find(key);
  return it == g_counters.end() ? 0 : it->second;
}

EXPORT void fake_cuda_set(const char* name, long long value) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const std::string key = name;
  if (key == "query_error") g_query_error = static_cast<int>(value);
  if (key == "event_delay") g_event_delay = static_cast<int>(value);
  if (key == "fail_map_in") g_fail_map_in = value;
  if (key == "fail_set_access") g_fail_set_access = value != 0;
}

// A context that is nobody's primary context, to stand for the caller's own.
EXPORT CUcontext fake_cuda_foreign_context() { return reinterpret_cast<CUcontext>(&g_foreign); }

// A list of every misuse counter that is non-zero, for failure messages.
EXPORT const char* fake_cuda_misuse_report() {
  static thread_local std::string report;
  std::lock_guard<std::mutex> lock(g_mutex);
  report.clear();
  for (auto& c : g_counters) {
    if (c.first.rfind("misuse_", 0) == 0 && c.second != 0) {
      report += c.first + "=" + std::to_string(c.second) + " ";
    }
  }
  return report.c_str();
}
'''

HARNESS_SOURCE = r'''// Drives every method of the cuda backend (cuda/backend_cuda.cpp and driver.cpp, compiled
// in) against the fake libcuda.so.1, which counts misuse. Prints one line
// per failed expectation and "ALL OK" when there is none.
#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "backends/backend.hpp"
#include "ground/config.hpp"

using namespace pyalloc;

namespace {

std::atomic<int> g_failures{0};

#define EXPECT(cond)                                                         \
  do {                                                                       \
    if (!(cond)) {                                                           \
      ++g_failures;                                                          \
      std::printf("FAILED line %d: %s\n", __LINE__, #cond);                  \
    }                                                                        \
  } while (0)

#define EXPECT_OK(status)                                                          \
  do {                                                                             \
    const Status s_ = (status);                                                    \
    if (!s_.ok) {                                                                  \
      ++g_failures;                                                                \
      std::printf("FAILED line %d: %s: %s\n", __LINE__, #status, s_.message.c_str()); \
    }                                                                              \
  } while (0)

using GetFn = long long (*)(const char*);
using SetFn = void (*)(const char*, long long);
using CtxFn = void* (*)();
using PushFn = int (*)(void*);
using PopFn = int (*)(void**);
using GetCurrentFn = int (*)(void**);
using RetainFn = int (*)(void**, int);
using ReportFn = const char* (*)();

struct Fake {
  GetFn get;
  SetFn set;
  CtxFn foreign;
  PushFn push;
  PopFn pop;
  GetCurrentFn current;
  RetainFn retain;
  ReportFn misuse_report;
};

Fake load_fake() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::printf("cannot load the fake libcuda.so.1: %s\n", dlerror());
    std::exit(3);
  }
  Fake f;
  f.get = reinterpret_cast<GetFn>(dlsym(lib, "fake_cuda_get"));
  f.set = reinterpret_cast<SetFn>(dlsym(lib, "fake_cuda_set"));
  f.foreign = reinterpret_cast<CtxFn>(dlsym(lib, "fake_cuda_foreign_context"));
  f.push = reinterpret_cast<PushFn>(dlsym(lib, "cuCtxPushCurrent_v2"));
  f.pop = reinterpret_cast<PopFn>(dlsym(lib, "cuCtxPopCurrent_v2"));
  f.current = reinterpret_cast<GetCurrentFn>(dlsym(lib, "cuCtxGetCurrent"));
  f.retain = reinterpret_cast<RetainFn>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
  f.misuse_report = reinterpret_cast<ReportFn>(dlsym(lib, "fake_cuda_misuse_report"));
  if (!f.get || !f.set || !f.foreign || !f.push || !f.pop || !f.current || !f.retain ||
      !f.misuse_report) {
    std::printf("the fake libcuda.so.1 lacks a test control\n");
    std::exit(3);
  }
  return f;
}

constexpr size_t kMiB = size_t{1} << 20;

void* current_context(const Fake& fake) {
  void* ctx = nullptr;
  fake.current(&ctx);
  return ctx;
}

// Per-device worker for the concurrency check: alloc, record, query,
// release, free, over and over, on its own device.
void churn(Backend* backend, int device, int rounds) {
  for (int i = 0; i < rounds; ++i) {
    uintptr_t addr = 0;
    EXPECT_OK(backend->segment_alloc(device, 2 * kMiB, &addr));
    EventHandle event = 0;
    EXPECT_OK(backend->event_record(device, 0x100 + static_cast<StreamId>(device), &event));
    while (!backend->event_query(device, event)) {
    }
    backend->event_release(device, event);
    backend->segment_free(device, addr, 2 * kMiB);
  }
}

}  // namespace

int main() {
  std::string error;
  Config config;
  config.backend = BackendKind::kCuda;
  std::unique_ptr<Backend> backend = make_cuda_backend(config, &error);
  if (!backend) {
    std::printf("LOAD ERROR: %s\n", error.c_str());
    return 2;
  }
  const Fake fake = load_fake();

  EXPECT(std::strcmp(backend->name(), "cuda") == 0);
  EXPECT(backend->device_count() == 2);

  // No context is created just to answer mem_info on an unused device.
  const size_t capacity = 256 * kMiB;
  MemInfo unused = backend->mem_info(1);
  EXPECT(unused.total_bytes == capacity);
  EXPECT(unused.free_bytes == capacity);
  EXPECT(fake.get("retain") == 0);

  // A plain segment, in the primary context, leaving the thread as it was.
  EXPECT(current_context(fake) == nullptr);
  uintptr_t segment = 0;
  EXPECT_OK(backend->segment_alloc(0, 4 * kMiB, &segment));
  EXPECT(segment != 0 && segment % 512 == 0);
  EXPECT(fake.get("retain") == 1);
  EXPECT(fake.get("stack_depth") == 0);
  EXPECT(current_context(fake) == nullptr);
  MemInfo used = backend->mem_info(0);
  EXPECT(used.total_bytes == capacity);
  EXPECT(used.free_bytes == capacity - 4 * kMiB);

  // The caller's own current context is restored, not replaced.
  void* foreign = fake.foreign();
  EXPECT(fake.push(foreign) == 0);
  uintptr_t second = 0;
  EXPECT_OK(backend->segment_alloc(0, 2 * kMiB, &second));
  EXPECT(current_context(fake) == foreign);
  backend->segment_free(0, second, 2 * kMiB);
  EXPECT(current_context(fake) == foreign);
  EXPECT(fake.get("stack_depth") == 1);
  void* popped = nullptr;
  EXPECT(fake.pop(&popped) == 0 && popped == foreign);

  // When the primary context is already current (as on PyTorch's threads)
  // nothing is pushed.
  void* primary = nullptr;
  EXPECT(fake.retain(&primary, 0) == 0);
  EXPECT(fake.push(primary) == 0);
  const long long pushes = fake.get("push");
  MemInfo again = backend->mem_info(0);
  EXPECT(again.free_bytes == capacity - 4 * kMiB);
  EXPECT(fake.get("push") == pushes);
  EXPECT(fake.pop(&popped) == 0 && popped == primary);

  // Out of memory says so.
  uintptr_t huge = 0;
  Status oom = backend->segment_alloc(0, 2 * capacity, &huge);
  EXPECT(!oom.ok);
  EXPECT(oom.message.find("out of memory") != std::string::npos);
  EXPECT(oom.message.find("CUDA_ERROR_OUT_OF_MEMORY") != std::string::npos);
  EXPECT(oom.message.find("cuda device 0") != std::string::npos);

  // Copies move real bytes (the fake backs cuMemAlloc with host memory).
  std::vector<unsigned char> out(4096), back(4096, 0);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<unsigned char>(i * 7 + 3);
  EXPECT_OK(backend->copy_to_device_async(0, segment + 512, out.data(), out.size(), 0));
  EXPECT_OK(backend->copy_to_host_async(0, back.data(), segment + 512, back.size(), 0));
  EXPECT(out == back);
  backend->segment_free(0, segment, 4 * kMiB);
  EXPECT(fake.get("live_allocs") == 0);
  EXPECT(fake.get("synchronize") >= 1);  // segment_free waits for queued work

  // Events: recorded on the caller's stream, polled until done, pooled.
  fake.set("event_delay", 2);
  EventHandle event = 0;
  EXPECT_OK(backend->event_record(0, 0x1234, &event));
  EXPECT(fake.get("last_record_stream") == 0x1234);
  EXPECT(!backend->event_query(0, event));
  EXPECT(!backend->event_query(0, event));
  EXPECT(backend->event_query(0, event));
  backend->event_release(0, event);
  EventHandle reused = 0;
  EXPECT_OK(backend->event_record(0, 0, &reused));
  EXPECT(reused == event);
  EXPECT(fake.get("event_create") == 1);
  EXPECT_OK(backend->stream_wait(0, 0x5678, reused));
  backend->event_synchronize(0, reused);
  EXPECT(backend->event_query(0, reused));
  EventHandle more[3] = {0, 0, 0};
  for (EventHandle& e : more) EXPECT_OK(backend->event_record(0, 0, &e));
  EXPECT(fake.get("event_create") == 4);  // `reused` is still out: three new ones
  for (EventHandle& e : more) backend->event_release(0, e);
  backend->event_release(0, reused);
  EXPECT(fake.get("event_destroy") == 0);
  EXPECT(fake.get("events_with_timing") == 0);
  fake.set("event_delay", 0);

  // A faulted context: the query reports completion (Note [Event errors]).
  EventHandle faulted = 0;
  EXPECT_OK(backend->event_record(0, 0, &faulted));
  fake.set("query_error", 700);
  EXPECT(backend->event_query(0, faulted));
  EXPECT(backend->event_query(0, faulted));
  fake.set("query_error", 0);
  backend->event_release(0, faulted);

  // Virtual memory: reserve, create, map with access, unmap, release.
  const size_t granularity = backend->granularity(0);
  EXPECT(granularity == 2 * kMiB);
  uintptr_t va = 0;
  EXPECT_OK(backend->reserve(0, 4 * granularity, &va));
  PhysHandle chunk;
  EXPECT_OK(backend->phys_create(0, 2 * granularity, &chunk));
  EXPECT(chunk.size == 2 * granularity && chunk.value != 0);
  EXPECT_OK(backend->map(0, va + granularity, chunk));
  EXPECT(fake.get("set_access") == 1);
  const long long syncs = fake.get("synchronize");
  backend->unmap(0, va + granularity, 2 * granularity);
  EXPECT(fake.get("synchronize") == syncs + 1);  // unmap waits for queued work
  EXPECT(fake.get("live_mappings") == 0);
  backend->phys_release(0, chunk);
  backend->release_reservation(0, va, 4 * granularity);
  EXPECT(fake.get("live_handles") == 0);
  EXPECT(fake.get("live_reservations") == 0);
  PhysHandle too_big;
  Status vmm_oom = backend->phys_create(0, 2 * capacity, &too_big);
  EXPECT(!vmm_oom.ok && vmm_oom.message.find("out of memory") != std::string::npos);

  // A device the driver does not have.
  uintptr_t nowhere = 0;
  Status bad = backend->segment_alloc(7, 2 * kMiB, &nowhere);
  EXPECT(!bad.ok && bad.message.find("out of range") != std::string::npos);
  EXPECT(backend->event_query(7, 1));

  // Two devices from two threads at once (each thread owns its device, as
  // the allocator's per-device lock guarantees).
  std::thread t0(churn, backend.get(), 0, 500);
  std::thread t1(churn, backend.get(), 1, 500);
  t0.join();
  t1.join();
  EXPECT(fake.get("live_allocs") == 0);
  EXPECT(fake.get("retain") == 3);  // device 0, device 1, and the test's own retain
  EXPECT(fake.get("event_create") <= 6);

  // A second backend (a reconfiguration) shares the loaded driver.
  std::unique_ptr<Backend> rebuilt = make_cuda_backend(config, &error);
  EXPECT(rebuilt != nullptr);
  EXPECT(fake.get("cuInit") == 1);

  EXPECT(fake.get("push") == fake.get("pop"));
  EXPECT(fake.get("stack_depth") == 0);
  if (fake.get("misuse") != 0) {
    ++g_failures;
    std::printf("FAILED: the fake driver saw misuse: %s\n", fake.misuse_report());
  }
  // Backends are leaked in the library; here destroying them must be harmless.
  backend.reset();
  rebuilt.reset();
  std::printf("driver calls: push=%lld pop=%lld records=%lld creates=%lld\n", fake.get("push"),
              fake.get("pop"), fake.get("event_record"), fake.get("event_create"));
  if (g_failures == 0) std::printf("ALL OK\n");
  return g_failures == 0 ? 0 : 1;
}
'''
