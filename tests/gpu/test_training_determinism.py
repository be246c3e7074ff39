"""Training under pyalloc gives bit-identical results to PyTorch's native allocator.

An allocator only decides where tensors live, so with deterministic kernels
the losses and the trained weights must be the same to the last bit. Both
allocators get addresses aligned to 512 bytes, so even kernels that choose a
code path by alignment choose the same one. A difference means memory was
reused while still in use, or handed out uninitialised where it must not be.

Each allocator trains in its own process (seeds fixed, deterministic
algorithms, the math attention kernel); the losses are compared as
``float.hex()`` strings and the weights as a digest of their exact values.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

_TRAINING_SCRIPT = """
import hashlib
import warnings

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# Ops without a deterministic kernel warn rather than fail; the native
# allocator run twice (see the test) tells whether the setup is deterministic.
torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cudnn.benchmark = False
torch.backends.cudnn.deterministic = True
warnings.simplefilter("ignore")

STEPS = 6


def digest(params):
    h = hashlib.sha256()
    for p in params:
        h.update(",".join(v.hex() for v in p.detach().double().cpu().flatten().tolist()).encode())
    return h.hexdigest()


def data(seed, *shapes):
    g = torch.Generator().manual_seed(seed)  # on the CPU: the same bits on any GPU
    return [torch.randn(*shape, generator=g).cuda() for shape in shapes]


def train_mlp():
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(),
        torch.nn.Linear(256, 256), torch.nn.GELU(),
        torch.nn.Linear(256, 10),
    ).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = data(99, (512, 64), (512, 10))
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item().hex())
    return {"losses": losses, "weights": digest(model.parameters())}


def train_transformer():
    torch.manual_seed(4321)
    layer = torch.nn.TransformerEncoderLayer(
        d_model=64, nhead=4, dim_feedforward=256, dropout=0.1, batch_first=True
    ).cuda()
    head = torch.nn.Linear(64, 1).cuda()
    params = list(layer.parameters()) + list(head.parameters())
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    x, y = data(7, (16, 32, 64), (16, 32, 1))
    losses = []
    with sdpa_kernel(SDPBackend.MATH):
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(head(layer(x)), y)
            loss.backward()
            opt.step()
            losses.append(loss.item().hex())
    return {"losses": losses, "weights": digest(params)}


result = {"mlp": train_mlp(), "transformer": train_transformer()}
torch.cuda.synchronize()
try:
    import pyalloc
    from pyalloc.pytorch.install import is_installed
except ImportError:
    is_installed = lambda: False
if is_installed():
    pyalloc.check(0)
    result["pyalloc_peak"] = pyalloc.memory_stats(0)["allocated_bytes.all.peak"]
emit(result)
"""


def test_training_is_bitwise_identical_to_native_allocator(
    gpu_python: Callable[..., Any],
) -> None:
    native = gpu_python(_TRAINING_SCRIPT, allocator="native")
    under_pyalloc = gpu_python(_TRAINING_SCRIPT, allocator="pyalloc")

    # The run really allocated through pyalloc.
    assert under_pyalloc.get("pyalloc_peak", 0) > 0
    assert "pyalloc_peak" not in native

    for model in ("mlp", "transformer"):
        if under_pyalloc[model] != native[model]:
            # Tell an allocator bug from a nondeterministic setup: the native
            # allocator must at least agree with itself.
            native_again = gpu_python(_TRAINING_SCRIPT, allocator="native")
            if native_again[model] != native[model]:
                pytest.skip(
                    f"{model}: inconclusive, the native allocator does not reproduce its own "
                    f"results on this machine: {native[model]} vs {native_again[model]}"
                )
        assert under_pyalloc[model]["losses"] == native[model]["losses"], model
        assert under_pyalloc[model]["weights"] == native[model]["weights"], model
