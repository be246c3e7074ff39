"""pyalloc inside PyTorch, without a GPU: install()'s checks and wiring, and the
patched torch.cuda memory API reading pyalloc's figures on the host backend."""

from __future__ import annotations

import ctypes
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

import pyalloc
from pyalloc import PyallocError
from pyalloc.pytorch import install as torch_install
from pyalloc.pytorch import memory_api
from pyalloc._lib import lib

MiB = 1 << 20

# Every setting a test here depends on, spelled out: configure() applies on
# top of whatever an earlier test left in force.
HOST_CONF = (
    "backend=host,devices=2,capacity=64MiB,trace=0,event_delay=0,memory_fraction=1,"
    "max_cached=unlimited,round_power2=0,vmm=auto,plan=0,lifetime=0,share=1,move=1,reuse=1,extent=32MiB"
)

PATCHED_NAMES = list(memory_api._REPLACEMENTS)


@pytest.fixture
def host() -> Iterator[None]:
    """The host backend, nothing allocated; checks every invariant afterwards."""
    pyalloc.configure(HOST_CONF)
    yield
    pyalloc.check(0)
    pyalloc.check(1)


@pytest.fixture
def patched(host: None) -> Iterator[None]:
    pyalloc.patch_torch_memory_api()
    yield
    pyalloc.unpatch_torch_memory_api()


@pytest.fixture
def block() -> Iterator[Callable[..., int]]:
    """Allocates through pyalloc; frees whatever is still live at the end."""
    live: list[tuple[int, int, int]] = []

    def alloc(size: int, device: int = 0) -> int:
        ptr = pyalloc.malloc(size, device)
        live.append((ptr, size, device))
        return ptr

    yield alloc
    for ptr, size, device in live:
        pyalloc.free(ptr, size, device)


def _namespaced(name: str) -> list[tuple[Any, str]]:
    return [(m, name) for m in (torch.cuda, torch.cuda.memory) if hasattr(m, name)]


# ---- install() ---------------------------------------------------------------


def test_install_without_cuda_raises_pyalloc_error_naming_the_cause() -> None:
    assert not torch.cuda.is_available()  # this suite runs on a CPU-only machine
    with pytest.raises(PyallocError, match=r"needs CUDA: .*(without CUDA|is_available)"):
        pyalloc.install()
    assert not torch_install.is_installed()


class FakePluggable:
    """Stands in for torch's CUDAPluggableAllocator; records what install() wires."""

    instances: list["FakePluggable"] = []

    def __init__(self, path: str, alloc_fn: str, free_fn: str, *, setters: tuple[str, ...]) -> None:
        self.args = (path, alloc_fn, free_fn)
        self.wired: dict[str, int] = {}
        native = type("Native", (), {})()
        for setter in setters:
            setattr(native, setter, lambda address, s=setter: self.wired.__setitem__(s, address))
        self.native = native
        FakePluggable.instances.append(self)

    def allocator(self) -> Any:
        return self.native


ALL_SETTERS = ("set_reset_fn", "set_record_stream_fn", "set_memory_fraction_fn")


@pytest.fixture
def fake_cuda_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """A torch that claims CUDA (not initialized), with a recording pluggable allocator."""
    changed: list[Any] = []
    monkeypatch.setattr(torch._C, "_cuda_customAllocator", lambda *a: None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(
        torch.cuda.memory,
        "CUDAPluggableAllocator",
        lambda *a: FakePluggable(*a, setters=ALL_SETTERS),
    )
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", changed.append)
    monkeypatch.setattr(torch_install, "config", lambda: {"backend": "cuda"})
    monkeypatch.setattr(torch_install, "device_count", lambda: 1)
    monkeypatch.setattr(torch_install, "_installed_allocator", None)
    monkeypatch.delenv(torch_install.PATCH_ENV, raising=False)
    monkeypatch.setenv(torch_install.LAYER_ENV, "0")  # PyTorch's plain pluggable path (the layer: below)
    FakePluggable.instances.clear()
    yield changed
    pyalloc.unpatch_torch_memory_api()


def _address(name: str) -> int:
    return int(ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value or 0)


def test_install_wires_malloc_free_and_every_hook_by_raw_address(fake_cuda_torch: list[Any]) -> None:
    pyalloc.install()
    (pluggable,) = FakePluggable.instances
    assert pluggable.args == (pyalloc.library_path(), "pyalloc_malloc", "pyalloc_free")
    assert pluggable.wired == {
        "set_reset_fn": _address("pyalloc_empty_cache"),
        "set_record_stream_fn": _address("pyalloc_record_stream"),
        "set_memory_fraction_fn": _address("pyalloc_set_memory_fraction"),
    }
    assert fake_cuda_torch == [pluggable]
    assert torch_install.is_installed()
    assert torch.cuda.memory_stats is memory_api.memory_stats  # patched by default


def test_install_falls_back_to_the_plain_pluggable_path_when_the_layer_cannot_load(
    fake_cuda_torch: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The torch-facing layer loads only into a CUDA build of PyTorch; here (a CPU
    build claiming CUDA) install() says why and wires PyTorch's plain pluggable
    allocator instead, building nothing."""
    monkeypatch.setenv(torch_install.LAYER_ENV, "1")
    monkeypatch.setenv("PYALLOC_CACHE_DIR", str(tmp_path))
    with pytest.warns(torch_install.PyallocWarning, match=r"no libtorch_cuda\.so.*Falling back to PyTorch's plain"):
        pyalloc.install()
    (pluggable,) = FakePluggable.instances
    assert fake_cuda_torch == [pluggable] and torch_install.is_installed()
    assert not any(tmp_path.iterdir())


def test_second_install_is_a_no_op(fake_cuda_torch: list[Any]) -> None:
    pyalloc.install()
    pyalloc.install()
    assert len(FakePluggable.instances) == 1
    assert len(fake_cuda_torch) == 1


def test_install_warns_when_torch_cannot_wire_record_stream(
    fake_cuda_torch: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        torch.cuda.memory,
        "CUDAPluggableAllocator",
        lambda *a: FakePluggable(*a, setters=("set_reset_fn", "set_memory_fraction_fn")),
    )
    with pytest.warns(torch_install.PyallocWarning, match="record_stream"):
        pyalloc.install()
    assert set(FakePluggable.instances[0].wired) == {"set_reset_fn", "set_memory_fraction_fn"}


def test_install_refuses_once_cuda_is_initialized_and_says_how_to_fix(
    fake_cuda_torch: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(PyallocError) as info:
        pyalloc.install()
    message = str(info.value)
    assert "before the first CUDA call" in message
    assert "pyalloc run -- python train.py" in message
    assert "sitecustomize" in message
    assert fake_cuda_torch == []  # nothing was swapped


def test_install_refuses_a_backend_the_gpu_cannot_use(
    fake_cuda_torch: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch_install, "config", lambda: {"backend": "host"})
    with pytest.raises(PyallocError, match="needs backend=cuda.*backend=host"):
        pyalloc.install()
    assert fake_cuda_torch == []


def test_install_refuses_when_the_cuda_backend_did_not_start(
    fake_cuda_torch: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch_install, "device_count", lambda: 0)
    with pytest.raises(PyallocError, match="cuda backend did not start"):
        pyalloc.install()
    assert fake_cuda_torch == []


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_install_leaves_torch_unpatched_when_opted_out(
    fake_cuda_torch: list[Any], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    original = torch.cuda.memory_stats
    if how == "argument":
        pyalloc.install(patch_torch=False)
    else:
        monkeypatch.setenv(torch_install.PATCH_ENV, "0")
        pyalloc.install()
    assert torch_install.is_installed()
    assert torch.cuda.memory_stats is original


def test_install_cupy_without_cupy_raises_pyalloc_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    with pytest.raises(PyallocError, match="needs CuPy.*pip install"):
        pyalloc.install_cupy()


# ---- the patched memory API ----------------------------------------------------


@pytest.mark.parametrize("device", [0, None, "cuda:0", torch.device("cuda", 0), torch.device("cuda")])
def test_patched_memory_allocated_reads_pyalloc_for_every_device_spelling(
    patched: None, block: Callable[..., int], device: Any
) -> None:
    before = torch.cuda.memory_allocated(device)
    block(3 * MiB)
    after = torch.cuda.memory_allocated(device)
    assert after - before >= 3 * MiB
    assert after == pyalloc.memory_stats(0)["allocated_bytes.all.current"]
    assert torch.cuda.memory.memory_allocated(device) == after


def test_patched_memory_stats_is_pyalloc_flat_dict(patched: None, block: Callable[..., int]) -> None:
    block(2 * MiB)
    block(4096)
    stats = torch.cuda.memory_stats(0)
    assert stats == pyalloc.memory_stats(0)
    assert stats["allocation.all.current"] == 2
    # The host backend's default (vmm=shared) serves small requests from the large pool's arena.
    assert stats["allocation.small_pool.current"] == 0
    assert stats["allocation.large_pool.current"] == 2
    assert list(stats) == sorted(stats)


def test_patched_memory_stats_split_small_and_large_pools_like_pytorch(
    patched: None, block: Callable[..., int]
) -> None:
    pyalloc.configure(HOST_CONF + ",vmm=on")  # a small pool of its own, as in PyTorch
    block(2 * MiB)
    block(4096)
    stats = torch.cuda.memory_stats(0)
    assert stats["allocation.small_pool.current"] == 1
    assert stats["allocation.large_pool.current"] == 1
    assert stats["segment.small_pool.current"] == 1


def test_patched_stats_keep_devices_apart(patched: None, block: Callable[..., int]) -> None:
    on_zero = torch.cuda.memory_allocated(0)
    block(5 * MiB, device=1)
    assert torch.cuda.memory_allocated(1) >= 5 * MiB
    assert torch.cuda.memory_allocated("cuda:1") == torch.cuda.memory_allocated(1)
    assert torch.cuda.memory_allocated(0) == on_zero


def test_patched_max_memory_allocated_tracks_peak_until_reset(
    patched: None, block: Callable[..., int]
) -> None:
    big = pyalloc.malloc(8 * MiB)
    pyalloc.free(big, 8 * MiB)
    block(1 * MiB)
    assert torch.cuda.max_memory_allocated(0) >= 8 * MiB
    assert torch.cuda.max_memory_allocated(0) > torch.cuda.memory_allocated(0)
    torch.cuda.reset_peak_memory_stats(0)
    assert torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0)
    assert torch.cuda.max_memory_reserved(0) == torch.cuda.memory_reserved(0)


def test_patched_memory_reserved_covers_allocated(patched: None, block: Callable[..., int]) -> None:
    block(3 * MiB)
    reserved = torch.cuda.memory_reserved(0)
    assert reserved >= torch.cuda.memory_allocated(0) >= 3 * MiB
    assert reserved == pyalloc.memory_stats(0)["reserved_bytes.all.current"]
    assert torch.cuda.max_memory_reserved(0) >= reserved


def test_patched_reset_accumulated_zeroes_totals(patched: None, block: Callable[..., int]) -> None:
    ptr = pyalloc.malloc(MiB)
    pyalloc.free(ptr, MiB)
    assert torch.cuda.memory_stats(0)["allocation.all.allocated"] >= 1
    torch.cuda.reset_accumulated_memory_stats(0)
    stats = torch.cuda.memory_stats(0)
    assert stats["allocation.all.allocated"] == 0
    assert stats["allocated_bytes.all.freed"] == 0


def test_patched_nested_dict_matches_flat_stats(patched: None, block: Callable[..., int]) -> None:
    block(MiB)
    nested = torch.cuda.memory_stats_as_nested_dict(0)
    flat = torch.cuda.memory_stats(0)
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"]
    assert nested["num_ooms"] == flat["num_ooms"]


def test_patched_memory_summary_is_pytorch_table_of_pyalloc_figures(
    patched: None, block: Callable[..., int]
) -> None:
    block(5 * MiB)
    summary = torch.cuda.memory_summary(0)
    assert "PyTorch CUDA memory summary, device ID 0" in summary
    allocated_row = next(line for line in summary.splitlines() if "Allocated memory" in line)
    current = allocated_row.split("|")[2].strip()
    assert current == f"{pyalloc.memory_stats(0)['allocated_bytes.all.current'] // 1024} KiB"
    allocs_row = next(line for line in summary.splitlines() if "| Allocations" in line)
    assert allocs_row.split("|")[2].split() == ["1"]
    assert torch.cuda.memory_summary(abbreviated=True).count("from large pool") == 0


def test_patched_snapshot_shows_live_block(patched: None, block: Callable[..., int]) -> None:
    ptr = block(3 * MiB)
    snap = torch.cuda.memory._snapshot()
    blocks = [b for seg in snap["segments"] for b in seg["blocks"] if b["address"] == ptr]
    assert len(blocks) == 1
    assert blocks[0]["state"] == "active_allocated"
    assert blocks[0]["requested_size"] == 3 * MiB
    assert torch.cuda.memory_snapshot() == snap["segments"]


def test_patched_dump_snapshot_pickles_pyalloc_snapshot(
    patched: None, block: Callable[..., int], tmp_path: Path
) -> None:
    ptr = block(MiB)
    path = tmp_path / "snap.pickle"
    torch.cuda.memory._dump_snapshot(str(path))  # PyTorch's own, calling the patched _snapshot
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert any(b["address"] == ptr for seg in snap["segments"] for b in seg["blocks"])


def test_patched_record_memory_history_sets_trace_ring(patched: None) -> None:
    record = torch.cuda.memory._record_memory_history
    record(max_entries=500)
    assert pyalloc.config()["trace"] == 500
    record(enabled=None)
    assert pyalloc.config()["trace"] == 0
    record()  # PyTorch's default is unbounded: a bounded default instead
    assert pyalloc.config()["trace"] == memory_api.DEFAULT_HISTORY_ENTRIES
    record("state")
    assert pyalloc.config()["trace"] == 0
    record(True, trace_alloc_max_entries=12)  # type: ignore[arg-type]  # legacy boolean form
    assert pyalloc.config()["trace"] == 12
    record(False)  # type: ignore[arg-type]
    assert pyalloc.config()["trace"] == 0


def test_recorded_history_appears_in_snapshot_device_traces(
    patched: None, block: Callable[..., int]
) -> None:
    torch.cuda.memory._record_memory_history(max_entries=100)
    try:
        ptr = block(MiB)
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        assert any(e["action"] == "alloc" and e["addr"] == ptr for e in trace)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def test_patched_functions_reject_non_cuda_devices(patched: None) -> None:
    with pytest.raises(ValueError, match="Expected a cuda device"):
        torch.cuda.memory_allocated("cpu")


def test_unpatch_restores_pytorch_functions_in_both_namespaces(host: None) -> None:
    originals = {(m, n): getattr(m, n) for name in PATCHED_NAMES for m, n in _namespaced(name)}
    assert originals  # the names exist in this PyTorch
    pyalloc.patch_torch_memory_api()
    pyalloc.patch_torch_memory_api()  # idempotent: must not save our own functions as originals
    try:
        for (module, name), original in originals.items():
            assert getattr(module, name) is not original, f"{module.__name__}.{name} not patched"
    finally:
        pyalloc.unpatch_torch_memory_api()
    for (module, name), original in originals.items():
        assert getattr(module, name) is original, f"{module.__name__}.{name} not restored"


def test_unpatched_torch_no_longer_reports_pyalloc(host: None, block: Callable[..., int]) -> None:
    pyalloc.patch_torch_memory_api()
    pyalloc.unpatch_torch_memory_api()
    block(MiB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # PyTorch's own function: CUDA was never initialized, so it reports nothing.
        assert torch.cuda.memory_stats(0) == {}


def test_patching_can_leave_pytorchs_history_functions_to_the_torch_facing_layer() -> None:
    """With the layer installed, snapshots and history come from PyTorch's own
    functions (the layer answers them from C++ with stack contexts)."""
    originals = {name: getattr(torch.cuda.memory, name) for name in memory_api.HISTORY_FUNCTIONS}
    pyalloc.patch_torch_memory_api(keep=memory_api.HISTORY_FUNCTIONS)
    try:
        for name, original in originals.items():
            assert getattr(torch.cuda.memory, name) is original
        assert torch.cuda.memory.memory_stats is memory_api.memory_stats
    finally:
        pyalloc.unpatch_torch_memory_api()
    assert torch.cuda.memory.memory_stats is not memory_api.memory_stats


def test_the_layer_turns_cudagraph_trees_off_when_inductor_is_imported() -> None:
    """torch.compile(mode="reduce-overhead")'s cudagraph trees checkpoint the allocator's state
    after every recording, which the torch-facing layer cannot do yet: install() sets
    torch._inductor.config.triton.cudagraph_trees = False when that config is imported (not
    before: importing it costs a second of start-up), and a program's own setting after wins."""
    code = (
        "import sys\n"
        "from pyalloc.pytorch import install as i\n"
        "assert 'torch._inductor.config' not in sys.modules\n"
        "i._after_import('torch._inductor.config', i._without_cudagraph_trees)\n"
        "import torch._inductor.config as c\n"
        "print(c.triton.cudagraph_trees)\n"
        "c.triton.cudagraph_trees = True\n"
        "print(c.triton.cudagraph_trees)\n"
        "i._after_import('json', lambda m: print('already imported:', m.__name__))\n"
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["False", "True", "already imported: json"]
