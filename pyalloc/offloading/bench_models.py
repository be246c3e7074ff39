"""The models of the offload benchmark, their training step and a count of what the step saves.

One copy for ``tools/bench/offload_bench.py`` (the CPU table) and for the offload check of
``pyalloc gpu-check`` (:mod:`pyalloc.gpucheck.offload`). Each model has ``blocks``, what
hand-written checkpointing wraps, and a ``checkpoint`` flag: when it is set, every block runs
under ``torch.utils.checkpoint`` (non-reentrant).

Sizes: :func:`workloads` gives the benchmark's four models, scaled down for a CPU;
:func:`gpu_workloads` gives two of them at sizes where device memory (which the offload check
caps at 4 GiB), not a small batch cap, ends the largest-batch search (GPT-2 small's width and
depth at sequence 512; the ResNet-like model at 224x224 inputs). Every model runs in float32.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .plan import MadeInStep, is_activation, storage_key, tensor_leaves
from .regions import KeptSave, SavedBytes
from .session import ActivationOffload, OffloadFloorWarning


class CheckpointProbe:
    """The saved-bytes count of the step running now (None outside a counted step): checkpoint
    keeps each block's inputs until the block's backward, which an outer saved-tensor hook does
    not see, so :func:`run_block` adds them."""

    counter: SavedBytes | None = None
    pins: list[KeptSave] = []


def run_block(model: nn.Module, block: nn.Module, *args: Any) -> Any:
    """``block(*args)``, under ``torch.utils.checkpoint`` when the model's flag is set."""
    if not getattr(model, "checkpoint", False):
        return block(*args)
    counter = CheckpointProbe.counter
    if counter is not None:
        CheckpointProbe.pins += [KeptSave(counter, t) for t in tensor_leaves(args) if is_activation(t)]
    return checkpoint(block, *args, use_reentrant=False)


# ---- the models ----------------------------------------------------------------------------


class _GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPTSmallish(nn.Module):
    """GPT-2 small's shape (pre-LN blocks, 4x MLP), scaled down: 4 layers, d=128, seq 64."""

    def __init__(self, vocab: int = 1024, d: int = 128, layers: int = 4, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.checkpoint = False
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([_GPTBlock(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = run_block(self, block, x)
        return self.head(self.ln_f(x))


class BERTish(nn.Module):
    """BERT's encoder (post-LN layers, GELU, 4x FFN), scaled down: 6 layers, d=128, seq 128."""

    def __init__(self, vocab: int = 1024, d: int = 128, layers: int = 6, heads: int = 4) -> None:
        super().__init__()
        self.checkpoint = False
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, activation=nn.GELU(), batch_first=True)
            for _ in range(layers)])
        self.head = nn.Linear(d, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = run_block(self, block, x)
        return self.head(x[:, 0])


class _Bottleneck(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c // 4, 1, bias=False), nn.BatchNorm2d(c // 4), nn.ReLU(),
                                  nn.Conv2d(c // 4, c // 4, 3, padding=1, bias=False), nn.BatchNorm2d(c // 4),
                                  nn.ReLU(), nn.Conv2d(c // 4, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class ResNetish(nn.Module):
    """ResNet-50's bottleneck blocks, scaled down: 2 stages of 2 blocks (any input side)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.checkpoint = False
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.stage1 = nn.ModuleList([_Bottleneck(64), _Bottleneck(64)])
        self.down = nn.Sequential(nn.Conv2d(64, 128, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU())
        self.stage2 = nn.ModuleList([_Bottleneck(128), _Bottleneck(128)])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes))
        self.blocks = nn.ModuleList([*self.stage1, *self.stage2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.stage1:
            x = run_block(self, block, x)
        x = self.down(x)
        for block in self.stage2:
            x = run_block(self, block, x)
        return self.head(x)


class _LSTMBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lstm(x)[0])


class LSTMish(nn.Module):
    """A stacked LSTM language model: 4 one-layer LSTMs (hidden 256) with dropout, seq 64."""

    def __init__(self, vocab: int = 1024, d: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.checkpoint = False
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([_LSTMBlock(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = run_block(self, block, x)
        return self.head(x)


@dataclass(frozen=True)
class Workload:
    """A model of the benchmark and its input batches (random tokens or images)."""

    make_model: Callable[[], nn.Module]
    make_input: Callable[[int], torch.Tensor]  # a batch of that many samples


def workloads(device: str) -> dict[str, Workload]:
    """The benchmark's four models at their CPU sizes. The BERT-like model's batch of ``n`` is
    ``n // 2`` sequences of 128 tokens (as many tokens as ``n`` of the others' 64)."""
    return {
        "gpt": Workload(lambda: GPTSmallish().to(device),
                        lambda batch: torch.randint(0, 1024, (batch, 64), device=device)),
        "bert": Workload(lambda: BERTish().to(device),
                         lambda batch: torch.randint(0, 1024, (batch // 2, 128), device=device)),
        "resnet": Workload(lambda: ResNetish().to(device),
                           lambda batch: torch.randn(batch, 3, 32, 32, device=device)),
        "lstm": Workload(lambda: LSTMish().to(device),
                         lambda batch: torch.randint(0, 1024, (batch, 64), device=device)),
    }


def gpu_workloads(device: str) -> dict[str, Workload]:
    """The GPT-like and ResNet-like models at GPU sizes: GPT-2 small's width and depth (12 layers,
    d=768, 12 heads) at sequence 512 with a vocabulary of 8192; the ResNet-like model at 224x224."""
    vocab, seq = 8192, 512
    return {
        "gpt": Workload(lambda: GPTSmallish(vocab=vocab, d=768, layers=12, heads=12, seq=seq).to(device),
                        lambda batch: torch.randint(0, vocab, (batch, seq), device=device)),
        "resnet": Workload(lambda: ResNetish().to(device),
                           lambda batch: torch.randn(batch, 3, 224, 224, device=device)),
    }


# ---- the step and its count ----------------------------------------------------------------


def train_step(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward and backward (no optimizer), seeded so that every step draws the same dropout
    masks; returns the gradients and leaves the model's ``.grad`` empty."""
    torch.manual_seed(0)
    model(x).float().square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def probed(model: nn.Module, x: torch.Tensor) -> tuple[int, list[int], list[int]]:
    """One step without a session, its saves counted: the peak of saved-activation bytes
    (parameters and leaves excluded, each storage once), and per block (in forward order, first
    call only) the bytes held when it started and the bytes it saved."""
    counter = SavedBytes()
    made = MadeInStep()  # a leaf the step made counts (Note [Step-made leaves] in plan.py)
    blocks = list(model.blocks)  # type: ignore[arg-type]
    at_start = [-1] * len(blocks)
    saved: list[dict[Any, int]] = [{} for _ in blocks]
    open_blocks: list[int] = []

    def pack(t: torch.Tensor) -> Any:
        if not is_activation(t, made.made):
            return t
        for i in open_blocks:
            saved[i][storage_key(t)] = t.untyped_storage().nbytes()
        return KeptSave(counter, t)

    def unpack(h: Any) -> torch.Tensor:
        return h.tensor if isinstance(h, KeptSave) else h

    def pre(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if at_start[i] < 0 and torch.is_grad_enabled():
                at_start[i] = counter.current
                open_blocks.append(i)
        return hook

    def post(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if i in open_blocks:
                open_blocks.remove(i)
        return hook

    handles = [h for i, b in enumerate(blocks)
               for h in (b.register_forward_pre_hook(pre(i)), b.register_forward_hook(post(i)))]
    CheckpointProbe.counter, CheckpointProbe.pins = counter, []
    try:
        with made, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            train_step(model, x)
    finally:
        CheckpointProbe.counter, CheckpointProbe.pins = None, []
        for h in handles:
            h.remove()
    return counter.peak, at_start, [sum(d.values()) for d in saved]


SETTLE_STEPS = 12
"""A session's plan settles within a few steps (two, on these models); this many at most."""


def settle(session: ActivationOffload, step: Callable[[], object]) -> bool:
    """Runs ``step`` (a training step under ``session``) until the session's plan settled, so that
    the steps that count are steady-state steps; whether the session warned that the budget is
    below its floor meanwhile."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(SETTLE_STEPS):
            step()
            if session.stats()["plan_settled"]:
                break
    return any(issubclass(w.category, OffloadFloorWarning) for w in caught)
