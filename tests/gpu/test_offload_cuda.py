"""The offload manager on CUDA: asynchronous swap copies on a side stream stay exact.

Swap-outs copy on a side stream into pinned buffers and keep the device tensor until the copy's
event completes; swap-ins (prefetches included) copy on the side stream and the compute stream
waits for them only at use (pyalloc/offloading/swap.py, Note [Copies on CUDA]). A missing wait
or a tensor freed under a copy shows here as gradients that differ from a run without offload.
"""

from __future__ import annotations

from typing import Any, Callable

_SESSION_SCRIPT = """
import torch
from torch import nn

import pyalloc
from pyalloc.offloading.session import offload


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 2048), nn.GELU(), nn.Dropout(0.1), nn.Linear(2048, 2048), nn.Tanh(),
                         nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.GELU(),
                         nn.Linear(2048, 10)).cuda()


def train(session):
    model = make_model()
    grads = []
    for step in range(3):
        torch.manual_seed(step)
        x = torch.randn(512, 256, device="cuda")
        if session is None:
            model(x).square().mean().backward()
        else:
            with session:
                model(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return grads


expected = train(None)
results = {}
# One activation is 4 MiB: a budget of one forces a swap per pack; a budget of three leaves
# room for prefetches during backward.
for name, kwargs in {"swap_tight": dict(budget=4 << 20, recompute=False),
                     "swap_prefetch": dict(budget=12 << 20, recompute=False, prefetch=2),
                     "swap_and_recompute": dict(budget=4 << 20)}.items():
    session = offload(**kwargs)
    got = train(session)
    equal = all(torch.equal(a, b) for ea, ga in zip(expected, got) for a, b in zip(ea, ga))
    stats = session.stats()
    results[name] = {"equal": equal, **{k: stats[k] for k in (
        "swap_outs_total", "swap_ins_total", "swap_outs_reverted_total", "prefetches_total",
        "recomputed_tensors_total", "swapped_out_bytes", "resident_bytes")}}
stats = pyalloc.memory_stats(0)  # `session`, the last one, is alive: its counters are included
results["memory_stats_offload_keys"] = sorted(k for k in stats if k.startswith("offload."))
emit(results)
"""


def test_async_swap_on_cuda_is_bit_for_bit_exact(gpu_python: Callable[..., Any]) -> None:
    results = gpu_python(_SESSION_SCRIPT, "pyalloc")
    for name in ("swap_tight", "swap_prefetch", "swap_and_recompute"):
        r = results[name]
        assert r["equal"], (name, r)
        assert r["resident_bytes"] == 0 and r["swapped_out_bytes"] == 0, (name, r)
    tight = results["swap_tight"]
    assert tight["swap_outs_total"] > 0
    assert tight["swap_ins_total"] + tight["swap_outs_reverted_total"] > 0
    assert results["swap_prefetch"]["prefetches_total"] > 0
    assert "offload.swap_out_bytes_total" in results["memory_stats_offload_keys"]


_RUN_SCRIPT = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 2048), nn.GELU(), nn.Dropout(0.1), nn.Linear(2048, 2048), nn.Tanh(),
                      nn.Linear(2048, 10)).cuda()
grads = []
for step in range(3):
    torch.manual_seed(step)
    model(torch.randn(512, 256, device="cuda")).square().mean().backward()
    grads.append([p.grad.cpu() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
torch.save(grads, sys.argv[1])
"""


def test_run_offload_on_cuda_matches_a_run_without(gpu_python: Callable[..., Any]) -> None:
    results = gpu_python(
        f"""
        import json, os, subprocess, sys, tempfile
        import torch

        tmp = tempfile.mkdtemp()
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write({_RUN_SCRIPT!r})

        def run(*options):
            out = os.path.join(tmp, f"grads{{len(options)}}.pt")
            cmd = [sys.executable, "-m", "pyalloc.cli", "run", "--conf", "backend=cuda", *options, "--",
                   sys.executable, script, out]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr
            return torch.load(out)

        stats_path = os.path.join(tmp, "stats.json")
        plain = run()
        offloaded = run("--offload=4MiB", "--offload-stats=" + stats_path)
        equal = all(torch.equal(a, b) for pa, pb in zip(plain, offloaded) for a, b in zip(pa, pb))
        with open(stats_path) as f:
            stats = json.load(f)
        emit({{"equal": equal, "stats": stats}})
        """,
        "none",
    )
    assert results["equal"]
    stats = results["stats"]
    assert stats["steps_total"] == 3
    assert stats["evictions_total"] > 0


_NEIGHBOUR_SCRIPT = """
import torch
import pyalloc
from pyalloc.offloading.session import ActivationOffload

a = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
b = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
c = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
before = pyalloc.free_neighbours(b.untyped_storage().data_ptr())
del a
after = pyalloc.free_neighbours(b.untyped_storage().data_ptr())
session = ActivationOffload(budget=1 << 30)
emit({"before": list(before), "after": list(after), "query": session._free_neighbours is not None})
"""


def test_the_dtr_score_sees_free_neighbours_under_pyalloc(gpu_python: Callable[..., Any]) -> None:
    # Three 1 MiB tensors side by side in one large-pool segment; freeing the first opens 1 MiB
    # below the second (MegEngine's free-neighbour term, Note [Free neighbours]).
    r = gpu_python(_NEIGHBOUR_SCRIPT, "pyalloc")
    assert r["query"]
    assert r["before"][0] == 0 and r["after"][0] >= 1 << 20
