"""The torch-facing layer (``cuda/torch/``): built against the PyTorch this process imports.

The layer is C++ that knows PyTorch's own types (Note [Out of memory under
PyTorch] in ``cuda/torch/oom.hpp``). It must be compiled against the exact
PyTorch it is loaded into, so it is not part of the wheel's build (pip builds
the wheel in an isolated environment, without the user's torch): the first
call that needs it compiles it with the C++ compiler that built the package,
into a cache keyed by the PyTorch version and the layer's sources
(``$PYALLOC_CACHE_DIR``, else ``~/.cache/pyalloc``), in seconds; later
processes load the cached library. Two libraries:

  ops   ``torch.ops.pyalloc`` (allocate, free, cache_info, device_stats, and the
        memory history's and private pools' test entry points): c10
        and torch_cpu only, so it loads on every build of PyTorch, CPU included;
  cuda  the subclass of PyTorch's CUDAPluggableAllocator that
        :func:`pyalloc.install` makes the current allocator: needs a CUDA build
        of PyTorch to load, and CUDA's runtime headers to compile (the
        ``nvidia-cuda-runtime`` and ``nvidia-cuda-crt`` wheels, or a toolkit
        under ``$CUDA_HOME`` or ``/usr/local/cuda``).

A failure to build is a :class:`LayerError` naming what is missing, never a crash.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from .._lib import PyallocError, library_path

__all__ = ["LayerError", "build", "cuda_include_dir", "load_ops", "sources_dir"]

_KINDS = {
    "ops": ("oom.cpp", "stats.cpp", "history.cpp", "pools.cpp", "ipc.cpp", "ops.cpp"),
    "cuda": ("oom.cpp", "stats.cpp", "history.cpp", "pools.cpp", "ipc.cpp", "cuda_allocator.cpp"),
}
_lock = threading.Lock()
_ops_loaded: Path | None = None


class LayerError(PyallocError):
    """The torch-facing layer could not be built or loaded; the message says why."""


def sources_dir() -> Path:
    """``cuda/torch`` of a source checkout, else the copy installed with the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[1] / "cuda" / "torch", here.parent / "_torch_layer"):
        if (candidate / "oom.hpp").is_file():
            return candidate
    raise LayerError(f"the torch-facing layer's sources are missing (looked in {here.parents[1] / 'cuda' / 'torch'} "
                     f"and {here.parent / '_torch_layer'}); reinstall pyalloc")


def _header_dir(sources: Path) -> Path:
    for candidate in (sources.parents[1] / "allocator" / "include", sources / "include"):
        if (candidate / "pyalloc" / "pyalloc.h").is_file():
            return candidate
    raise LayerError(f"pyalloc.h is missing beside the layer's sources ({sources})")


def cuda_include_dir() -> Path | None:
    """A directory with CUDA's runtime headers (cuda_runtime_api.h and crt/), or None."""
    roots: list[Path] = []
    for entry in sys.path:
        nvidia = Path(entry) / "nvidia"
        if nvidia.is_dir():
            roots += [nvidia / "cu13" / "include", nvidia / "cuda_runtime" / "include"]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            roots.append(Path(os.environ[env]) / "include")
    roots.append(Path("/usr/local/cuda/include"))
    for root in roots:
        if (root / "cuda_runtime_api.h").is_file() and (root / "crt" / "host_defines.h").is_file():
            return root
    return None


def _compiler() -> str:
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise LayerError("no C++ compiler (c++, g++ or clang++; or set CXX) to build the torch-facing layer")


def _command(kind: str, torch: Any, sources: Path, out: Path) -> list[str]:
    torch_dir = Path(torch.__file__).resolve().parent
    include = torch_dir / "include"
    lib = library_path()
    cmd = [_compiler(), "-O2", "-std=c++20", "-shared", "-fPIC", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{_header_dir(sources)}"]
    if kind == "cuda":
        cuda = cuda_include_dir()
        if cuda is None:
            raise LayerError("CUDA's runtime headers are missing (cuda_runtime_api.h and crt/host_defines.h): "
                             "pip install nvidia-cuda-runtime nvidia-cuda-crt, or set CUDA_HOME")
        cmd.append(f"-I{cuda}")
        if not (include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").is_file():
            cmd.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")  # a CPU build of PyTorch: headers only
    cmd += [str(sources / name) for name in _KINDS[kind]]
    cmd += [lib, f"-Wl,-rpath,{Path(lib).parent}", f"-L{torch_dir / 'lib'}", f"-Wl,-rpath,{torch_dir / 'lib'}",
            "-lc10", "-ltorch_cpu"]
    if kind == "cuda" and (torch_dir / "lib" / "libtorch_cuda.so").is_file():
        cmd += ["-ltorch_cuda", "-lc10_cuda"]
    return cmd + ["-o", str(out)]


def _cache_dir() -> Path:
    root = os.environ.get("PYALLOC_CACHE_DIR") or str(Path.home() / ".cache" / "pyalloc")
    return Path(root) / "torch-layer"


def build(kind: str) -> Path:
    """The layer library ``kind`` ("ops" or "cuda") for the imported torch, compiled if not cached."""
    if kind not in _KINDS:
        raise LayerError(f"unknown layer {kind!r} (expected one of {', '.join(_KINDS)})")
    import torch

    sources = sources_dir()
    key = hashlib.sha256()
    key.update(torch.__version__.encode())
    key.update(library_path().encode())
    for name in (*_KINDS[kind], "oom.hpp", "stats.hpp", "history.hpp", "pools.hpp", "ipc.hpp"):
        key.update((sources / name).read_bytes())
    key.update((_header_dir(sources) / "pyalloc" / "pyalloc.h").read_bytes())
    out = _cache_dir() / f"{torch.__version__.replace('+', '_')}-{key.hexdigest()[:16]}" / f"libpyalloc_torch_{kind}.so"
    if out.is_file():
        return out
    # A build that failed is remembered beside where it would be, under the same key and the
    # same compiler command (a fixed toolchain or newly installed headers build again), so that
    # every later process says why at once instead of compiling again for tens of seconds (on a
    # GPU machine, each check's fresh interpreter did, and timed out).
    command = _command(kind, torch, sources, out)
    failed = out.with_name(f"{out.stem}-{hashlib.sha256(' '.join(command).encode()).hexdigest()[:12]}.failed")
    if failed.is_file():
        raise LayerError(failed.read_text().strip() + f" (remembered in {failed}; delete it to build again)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        done = subprocess.run(command[:-1] + [str(partial)], capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            message = (f"building the torch-facing layer ({kind}) against torch {torch.__version__} failed: "
                       + ("; ".join(errors[:3]) or f"exit {done.returncode}"))
            (Path(tmp) / failed.name).write_text(message + "\n")
            os.replace(Path(tmp) / failed.name, failed)
            raise LayerError(message)
        os.replace(partial, out)  # atomic: a process beside this one loads a whole file or builds its own
    return out


def load_ops() -> Path:
    """Loads ``torch.ops.pyalloc`` (building it if needed); returns the library's path."""
    global _ops_loaded
    with _lock:
        if _ops_loaded is None:
            import torch

            path = build("ops")
            torch.ops.load_library(str(path))
            _ops_loaded = path
        return _ops_loaded


def install_cuda_allocator() -> None:
    """Makes the layer's CUDAPluggableAllocator subclass PyTorch's current allocator (CUDA builds only)."""
    import torch

    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    if not (torch_lib / "libtorch_cuda.so").is_file():
        raise LayerError(f"torch {torch.__version__} has no libtorch_cuda.so in {torch_lib}: "
                         f"the layer's allocator can only load into a CUDA build of PyTorch")
    path = build("cuda")
    try:
        layer = ctypes.CDLL(str(path))
    except OSError as e:
        raise LayerError(f"loading the torch-facing layer {path} failed: {e}") from e
    layer.pyalloc_torch_install.restype = ctypes.c_int
    layer.pyalloc_torch_error.restype = ctypes.c_char_p
    if layer.pyalloc_torch_install() != 0:
        raise LayerError(f"PyTorch refused pyalloc's allocator: {layer.pyalloc_torch_error().decode()}")
